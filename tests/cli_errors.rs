//! gpt_longctx and custom_model on invalid and edge inputs: every bad input is a clear one-line
//! error (exit 2, no panic), edge inputs that are valid work. `cargo test` builds the examples;
//! they are found next to this test's executable (`target/<profile>/examples/`). The tools'
//! command lines are tested beside them (`tools/tests/cli.rs`).

use std::collections::HashMap;
use std::net::TcpListener;
use std::process::{Command, Output, Stdio};

#[allow(dead_code)] // each command-line test file uses a part of them
#[path = "support/cli.rs"]
mod cli;
use cli::{example, refused, stderr, succeeded, temp_dir};

const QUICK: [&str; 6] = [
    "--corpus",
    "builtin",
    "--seq-len",
    "64",
    "--micro-batches",
    "2",
];

fn gpt(extra: &[&str]) -> Vec<String> {
    QUICK.iter().chain(extra).map(|s| s.to_string()).collect()
}

fn refused_gpt(extra: &[&str], expected: &str) {
    let args = gpt(extra);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    refused("gpt_longctx", &args, expected);
}

#[test]
fn gpt_longctx_refuses_bad_flags_with_the_rule() {
    refused_gpt(
        &["--lr", "nan"],
        "learning rate NaN must be a finite number in (0, 1]",
    );
    refused_gpt(&["--lr=-1"], "learning rate -1 must be");
    refused_gpt(&["--timeout-secs", "0"], "timeout 0 s must be between 1");
    refused_gpt(&["--cp", "100000"], "exceed the 1024 ranks");
    refused_gpt(&["--mask", "full"], "needs a causal-family mask");
    refused(
        "gpt_longctx",
        &["--corpus", "builtin", "--micro-batches=4000000000"],
        "exceed the limit",
    );
    refused(
        "gpt_longctx",
        &["--max-tokens-per-rank", "9223372036854775808", "--cp", "2"],
        "--max-tokens-per-rank 9223372036854775808 × --cp 2 overflows, far beyond the limit",
    );
    refused(
        "gpt_longctx",
        &["--max-tokens-per-rank", "9223372036854775807", "--cp", "2"],
        "--max-tokens-per-rank 9223372036854775807 × --cp 2 exceeds the limit of 4294967295 tokens",
    );
    refused_gpt(&["--block", "16"], "--block only applies to --strategy dcp");
    refused_gpt(
        &["--lengths-from", "books"],
        "--lengths-from: invalid setting: unknown length distribution 'books': expected longalign-like or ldc-like",
    );
    refused_gpt(
        &["--link-scale", "10"],
        "--link-scale 10 only applies with --emulate-links",
    );
    refused_gpt(
        &["--emulate-links", "--link-scale", "0"],
        "--link-scale 0 must be a positive number",
    );
    refused_gpt(
        &["--cp", "4", "--nodes", "3"],
        "--nodes 3 must divide the 4 ranks",
    );
    refused(
        "gpt_longctx",
        &[
            "--corpus",
            "builtin",
            "--cp",
            "4",
            "--dp",
            "3",
            "--micro-batches",
            "3",
            "--nodes",
            "2",
        ],
        "a CP group of 4 ranks neither fills whole nodes of 6 ranks nor fits in one",
    );
    refused_gpt(
        &["--strategy", "dcp", "--block", "0"],
        "--block 0 must be between 1",
    );
    refused_gpt(&["--strategy", "dcp", "--stages", "0"], "--stages 0");
    refused_gpt(&["--topology", "tpu-pod"], "unknown topology 'tpu-pod'");
    refused_gpt(
        &["--strategy", "dynamic", "--block", "32"],
        "--block only applies to --strategy dcp or auto",
    );
    refused_gpt(
        &["--optimizer", "lion"],
        "unknown --optimizer 'lion': expected adamw, adam, sgd",
    );
    refused_gpt(
        &["--optimizer", "sgd", "--adam-beta1", "0.8"],
        "--adam-beta1 does not apply to --optimizer sgd",
    );
    refused_gpt(&["--lr-schedule", "step"], "unknown --lr-schedule 'step'");
    refused_gpt(
        &["--warmup-steps", "50"],
        "--warmup-steps 50 exceeds the 30 steps of the schedule",
    );
    refused_gpt(
        &["--clip-grad-norm", "0"],
        "--clip-grad-norm 0 must be a positive number",
    );
    refused_gpt(
        &["--strategy", "dcp", "--layout", "stripe"],
        "--layout stripe does not apply to --strategy dcp",
    );
}

/// DCP inside dynamic CP's groups (`--inner-strategy dcp`): each group's sequences run a DCP
/// block plan on the group's ranks, and the losses are cp 1's.
#[test]
fn dynamic_cp_groups_run_dcp_plans_exactly() {
    let losses = |extra: &[&str]| -> Vec<f64> {
        let args = gpt(&[&["--steps", "2", "--json"][..], extra].concat());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let summary: serde_json::Value =
            serde_json::from_str(&succeeded("gpt_longctx", &args)).unwrap();
        summary["losses"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l.as_f64().unwrap())
            .collect()
    };
    let reference = losses(&["--cp", "1"]);
    let dynamic = losses(&[
        "--cp",
        "4",
        "--nodes",
        "2",
        "--strategy",
        "dynamic",
        "--inner-strategy",
        "dcp",
        "--block",
        "16",
        "--max-tokens-per-rank",
        "32",
    ]);
    assert_eq!(dynamic.len(), reference.len());
    for (got, want) in dynamic.iter().zip(&reference) {
        assert!(
            (got - want).abs() <= 1e-5 * want.abs(),
            "{dynamic:?} vs {reference:?}"
        );
    }
}

#[test]
fn gpt_longctx_trains_with_ranks_that_hold_no_token() {
    let out = succeeded(
        "gpt_longctx",
        &[
            "--corpus",
            "builtin",
            "--cp",
            "4",
            "--seq-len",
            "3",
            "--micro-batches",
            "1",
            "--steps",
            "2",
            "--json",
        ],
    );
    let summary: serde_json::Value = serde_json::from_str(&out).unwrap();
    let losses = summary["losses"].as_array().unwrap();
    assert_eq!(losses.len(), 2);
    assert!(
        losses
            .iter()
            .all(|l| l.as_f64().is_some_and(f64::is_finite)),
        "{summary}"
    );
}

#[test]
fn gpt_longctx_checkpoints_never_move_backwards() {
    let dir = temp_dir("resume");
    let path = dir.to_str().unwrap();
    let args = gpt(&["--steps", "2", "--out", path]);
    succeeded(
        "gpt_longctx",
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let state = std::fs::read_to_string(dir.join("checkpoint/state.json")).unwrap();
    refused(
        "gpt_longctx",
        &["--resume", path, "--steps", "1"],
        "never moves backwards",
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("checkpoint/state.json")).unwrap(),
        state
    );
    // Equal: nothing to train, nothing written.
    let before = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let out = succeeded("gpt_longctx", &["--resume", path, "--steps", "2"]);
    assert!(out.contains("0 steps"), "{out}");
    assert_eq!(
        std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap(),
        before
    );
    // A second run into the same --out is refused (it would reset the checkpoint to step 1).
    let args = gpt(&["--steps", "1", "--out", path]);
    refused(
        "gpt_longctx",
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        "already holds a run",
    );
    // config.json edited to another model size.
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        config.replace("\"tiny\"", "\"small\""),
    )
    .unwrap();
    refused(
        "gpt_longctx",
        &["--resume", path, "--steps", "3"],
        "d_model: checkpoint 64, configuration 128",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn gpt_longctx_dynamic_flags_are_checked() {
    refused_gpt(
        &["--inner-strategy", "ring"],
        "--inner-strategy only applies to --strategy dynamic",
    );
    refused_gpt(
        &["--cp-sizes", "pow2"],
        "--cp-sizes only applies to --strategy dynamic",
    );
    refused_gpt(
        &["--strategy", "dynamic", "--cp-sizes", "odd"],
        "unknown --cp-sizes 'odd'",
    );
    refused_gpt(
        &[
            "--strategy",
            "dynamic",
            "--cp",
            "2",
            "--max-tokens-per-rank",
            "16",
        ],
        "does not fit the pool",
    );
    refused_gpt(
        &[
            "--strategy",
            "dynamic",
            "--cp",
            "8",
            "--inner-strategy",
            "ulysses",
        ],
        "dynamic CP may use groups of 8 ranks",
    );
    refused_gpt(
        &["--strategy", "dynamic", "--plan-ahead", "0"],
        "--plan-ahead 0 must be between 1",
    );
    let args = gpt(&[
        "--steps",
        "2",
        "--cp",
        "4",
        "--strategy",
        "dynamic",
        "--max-tokens-per-rank",
        "16",
        "--json",
    ]);
    let out = succeeded(
        "gpt_longctx",
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let summary: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(summary["cp_group_sizes"]["4"], 4, "{summary}");
    assert!(summary["plan_wait_ms"].as_f64().is_some(), "{summary}");
}

#[test]
fn gpt_longctx_counts_bytes_by_link_over_virtual_nodes() {
    let args = gpt(&[
        "--steps",
        "1",
        "--cp",
        "4",
        "--strategy",
        "dcp",
        "--block",
        "16",
        "--nodes",
        "2",
        "--json",
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let report: serde_json::Value = serde_json::from_str(&succeeded("gpt_longctx", &args)).unwrap();
    let links = &report["bytes_by_link"];
    let (intra, inter) = (
        links["intra_node"].as_u64().unwrap(),
        links["inter_node"].as_u64().unwrap(),
    );
    assert!(intra > 0 && inter > 0, "{report}");
    assert_eq!(
        intra + inter,
        report["bytes_communicated"].as_u64().unwrap(),
        "{report}"
    );
}

#[test]
fn gpt_longctx_auto_flags_are_checked() {
    refused_gpt(
        &["--auto-candidates", "dcp"],
        "--auto-candidates only applies to --strategy auto",
    );
    refused_gpt(
        &["--strategy", "auto", "--auto-candidates", "dcp,ring"],
        "unknown auto candidate 'ring'",
    );
    refused_gpt(
        &["--strategy", "auto", "--layout", "stripe"],
        "--layout stripe is not supported with it",
    );
    refused_gpt(
        &["--strategy", "auto", "--ulysses-degree", "2"],
        "--ulysses-degree 2 does not apply to --strategy auto",
    );
    refused_gpt(
        &[
            "--strategy",
            "auto",
            "--auto-candidates",
            "ulysses",
            "--cp",
            "3",
        ],
        "--auto-candidates ulysses alone cannot run on cp 3",
    );
    refused_gpt(
        &["--strategy", "ring", "--block", "16"],
        "only applies to --strategy dcp or auto",
    );
    refused(
        "plan_sim",
        &["--lengths", "100", "--auto-candidates", "dcp"],
        "--auto-candidates only applies with auto in --strategies",
    );
    refused(
        "plan_sim",
        &[
            "--lengths",
            "100",
            "--strategies",
            "auto",
            "--auto-candidates",
            "usp,bogus",
        ],
        "unknown auto candidate 'bogus'",
    );
    refused(
        "plan_sim",
        &["--lengths", "100,200", "--masks", "causal"],
        "--masks gives 1 masks for 2 sequences",
    );
    refused(
        "plan_sim",
        &["--lengths", "100", "--masks", "causal", "--mask", "full"],
        "cannot be used with",
    );
}

/// `gpt_longctx --strategy auto` records each micro-batch's choice in metrics.jsonl, counts them
/// in `strategy_counts`, and `plan_sim --strategies auto` makes the same choice, with the same
/// estimates, for the same batch.
#[test]
fn gpt_longctx_auto_choices_match_plan_sim() {
    let out = temp_dir("auto");
    let out_text = out.display().to_string();
    let args = [
        "--corpus",
        "default",
        "--seq-len",
        "1024",
        "--micro-batches",
        "2",
        "--steps",
        "2",
        "--cp",
        "4",
        "--nodes",
        "2",
        "--strategy",
        "auto",
        "--mask",
        "mixed",
        "--out",
        &out_text,
        "--json",
    ];
    let report: serde_json::Value = serde_json::from_str(&succeeded("gpt_longctx", &args)).unwrap();
    let counts = report["strategy_counts"].as_object().unwrap();
    assert_eq!(
        counts.values().map(|c| c.as_u64().unwrap()).sum::<u64>(),
        4,
        "{report}"
    );
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let mut checked = 0;
    for line in metrics.lines() {
        let step: serde_json::Value = serde_json::from_str(line).unwrap();
        for choice in step["auto_choices"].as_array().unwrap() {
            let lengths: Vec<String> = choice["seq_lens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|l| l.to_string())
                .collect();
            let lengths = lengths.join(",");
            let masks: Vec<&str> = choice["masks"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| m.as_str().unwrap())
                .collect();
            let masks = masks.join(";");
            let sim = [
                "--lengths",
                &lengths,
                "--masks",
                &masks,
                // The default GPT: 4 query heads of dim 16, 2 kv heads (moved unrepeated).
                "--heads",
                "4",
                "--kv-heads",
                "2",
                "--head-dim",
                "16",
                "--element-bytes",
                "4",
                "--topology",
                "a100-p4d",
                "--nodes",
                "2",
                "--devices-per-node",
                "2",
                "--block",
                "128",
                "--stages",
                "4",
                "--seed",
                "0",
                "--strategies",
                "auto",
                "--json",
            ];
            let sim: serde_json::Value =
                serde_json::from_str(&succeeded("plan_sim", &sim)).unwrap();
            let auto = &sim["auto"];
            assert_eq!(auto["choice"], choice["strategy"], "{sim} vs {choice}");
            for estimate in auto["estimates"].as_array().unwrap() {
                let name = estimate["strategy"].as_str().unwrap();
                assert_eq!(
                    estimate["estimated_ms"], choice["estimated_ms"][name],
                    "{name}: {sim} vs {choice}"
                );
            }
            checked += 1;
        }
        let counted: u64 = step["strategy_counts"]
            .as_object()
            .unwrap()
            .values()
            .map(|c| c.as_u64().unwrap())
            .sum();
        assert_eq!(counted, 2, "{line}");
    }
    assert_eq!(checked, 4);
    let _ = std::fs::remove_dir_all(&out);
}

/// The `--json` summary's `bytes_by_axis`, checked to add up to `bytes_communicated`.
fn axes_summing_to_the_total(
    report: &serde_json::Value,
) -> &serde_json::Map<String, serde_json::Value> {
    let axes = report["bytes_by_axis"].as_object().unwrap();
    let sum: u64 = axes.values().map(|v| v.as_u64().unwrap()).sum();
    assert_eq!(
        sum,
        report["bytes_communicated"].as_u64().unwrap(),
        "{report}"
    );
    axes
}

#[test]
fn gpt_longctx_tensor_parallel_flags_and_bytes_by_axis() {
    refused_gpt(&["--tp", "3"], "--tp 3 must divide the 4 query heads");
    refused_gpt(&["--tp", "0"], "must be at least 1");
    refused_gpt(
        &["--tp", "2", "--cp", "4", "--strategy", "ulysses"],
        "the heads of one TP rank of 2",
    );
    refused_gpt(
        &["--tp", "2", "--cp", "2", "--nodes", "4"],
        "must hold whole TP groups of 2",
    );
    let args = gpt(&["--steps", "1", "--tp", "2", "--cp", "2", "--json"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let report: serde_json::Value = serde_json::from_str(&succeeded("gpt_longctx", &args)).unwrap();
    let axes = axes_summing_to_the_total(&report);
    for axis in ["tp", "cp", "dp"] {
        assert!(axes[axis].as_u64().unwrap() > 0, "{axis}: {report}");
    }
    assert_eq!(axes["pp"].as_u64(), Some(0));
}

#[test]
fn gpt_longctx_pipeline_flags_bytes_by_axis_and_resume() {
    let refusals: [(&[&str], &str); 5] = [
        (&["--pp", "3"], "--pp 3 must divide the 2 layers"),
        (&["--pp", "0"], "must be at least 1"),
        (
            &["--pp", "2", "--dp", "2"],
            "--pp 2 needs at least 2 micro-batches per DP replica",
        ),
        (
            &["--pp", "2", "--pp-schedule", "zero-bubble"],
            "unknown pipeline schedule 'zero-bubble': expected 1f1b or gpipe",
        ),
        // tp 2 × cp 2 × pp 2 = 8 ranks over 8 nodes: a node of 1 rank cannot hold a TP group.
        (
            &["--tp", "2", "--pp", "2", "--cp", "2", "--nodes", "8"],
            "must hold whole TP groups of 2",
        ),
    ];
    for (args, expected) in refusals {
        refused_gpt(args, expected);
    }
    let dir = temp_dir("pipeline");
    let run = |extra: &[&str]| -> serde_json::Value {
        let args = gpt(&[&["--steps", "2", "--json", "--out"], extra].concat());
        let mut args: Vec<&str> = args.iter().map(String::as_str).collect();
        args.insert(args.len() - extra.len(), dir.to_str().unwrap());
        serde_json::from_str(&succeeded("gpt_longctx", &args)).unwrap()
    };
    let report = run(&["--tp", "2", "--pp", "2", "--cp", "2"]);
    let axes = axes_summing_to_the_total(&report);
    for axis in ["tp", "cp", "dp", "pp"] {
        assert!(axes[axis].as_u64().unwrap() > 0, "{axis}: {report}");
    }
    assert_eq!(report["config"]["pp"], 2);
    assert_eq!(report["config"]["pp_schedule"], "1f1b");
    // The checkpoint is sharded per (TP rank, stage).
    for shard in ["model-tp0-pp0", "model-tp1-pp1", "optimizer-tp1-pp0"] {
        assert!(
            dir.join("checkpoint")
                .join(format!("{shard}.mpk"))
                .is_file(),
            "{shard}"
        );
    }
    // Resuming under another pipeline depth is refused; another schedule is allowed and
    // continues the same curve (the schedule orders the passes, it does not change them).
    let resume = |extra: &[&str]| -> Vec<String> {
        [
            &["--resume", dir.to_str().unwrap(), "--steps", "3", "--json"][..],
            extra,
        ]
        .concat()
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let args = resume(&["--pp", "1"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    refused(
        "gpt_longctx",
        &args,
        "--pp 1 differs from the resumed run's 2",
    );
    let args = resume(&["--pp-schedule", "gpipe"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let resumed: serde_json::Value =
        serde_json::from_str(&succeeded("gpt_longctx", &args)).unwrap();
    assert_eq!(resumed["first_step"], 3, "{resumed}");
    assert_eq!(resumed["config"]["pp_schedule"], "gpipe");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Starts `name args` as the ranks `ranks` of a TCP launch of `world_size` processes
/// (torchrun's variables, as `scripts/launch_tcp.py` sets them) and returns each one's output.
fn launch_tcp(name: &str, args: &[String], ranks: &[usize], world_size: usize) -> Vec<Output> {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let children: Vec<_> = ranks
        .iter()
        .map(|rank| {
            Command::new(example(name))
                .args(args)
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world_size.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    children
        .into_iter()
        .map(|child| child.wait_with_output().unwrap())
        .collect()
}

#[test]
fn gpt_longctx_as_tcp_processes_gives_the_threads_losses_and_bytes() {
    for extra in [
        vec!["--cp", "2", "--dp", "2"],
        vec!["--cp", "4", "--strategy", "usp", "--ulysses-degree", "2"],
    ] {
        let mut extra = extra;
        extra.extend(["--steps", "2", "--json"]);
        let args = gpt(&extra);
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let threads: serde_json::Value =
            serde_json::from_str(&succeeded("gpt_longctx", &refs)).unwrap();
        let outputs = launch_tcp("gpt_longctx", &args, &[0, 1, 2, 3], 4);
        for (rank, output) in outputs.iter().enumerate() {
            assert!(output.status.success(), "rank {rank}: {}", stderr(output));
            if rank > 0 {
                assert!(output.stdout.is_empty(), "rank {rank} printed a report");
            }
        }
        let tcp: serde_json::Value = serde_json::from_slice(&outputs[0].stdout).unwrap();
        assert_eq!(tcp["losses"], threads["losses"], "{extra:?}");
        assert_eq!(tcp["bytes_by_axis"], threads["bytes_by_axis"], "{extra:?}");
        assert!(
            stderr(&outputs[0]).contains("4 TCP processes"),
            "{}",
            stderr(&outputs[0])
        );
    }
}

#[test]
fn tcp_launch_variables_are_checked() {
    let args = gpt(&["--steps", "1", "--cp", "2"]);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let with_env = |env: &[(&str, &str)]| {
        let mut command = Command::new(example("gpt_longctx"));
        command.args(&refs);
        for (key, value) in env {
            command.env(key, value);
        }
        command.output().unwrap()
    };
    let cases: [(&[(&str, &str)], &str); 3] = [
        (
            &[("RANK", "0"), ("WORLD_SIZE", "2")],
            "MASTER_ADDR is not set",
        ),
        (
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "3"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", "29511"),
            ],
            "WORLD_SIZE=3 but the configuration needs 2 ranks",
        ),
        (
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", "99999"),
            ],
            "MASTER_PORT=\"99999\" is not a port number",
        ),
    ];
    for (env, expected) in cases {
        let output = with_env(env);
        let text = stderr(&output);
        assert_eq!(output.status.code(), Some(2), "{env:?}: {text}");
        assert!(!text.contains("panicked"), "{env:?}: {text}");
        assert!(
            text.contains(expected),
            "{env:?}: expected '{expected}' in {text}"
        );
    }
}

/// Ranks 2 and 3 of 4 never start: ranks 0 and 1 both exit non-zero, each printing why, within
/// the timeout.
#[test]
fn a_missing_tcp_rank_fails_the_start_on_every_rank() {
    let args = gpt(&["--steps", "1", "--cp", "4", "--timeout-secs", "2"]);
    let started = std::time::Instant::now();
    let outputs = launch_tcp("gpt_longctx", &args, &[0, 1], 4);
    assert!(started.elapsed() < std::time::Duration::from_secs(30));
    let rank0 = stderr(&outputs[0]);
    assert_eq!(outputs[0].status.code(), Some(2), "{rank0}");
    assert!(rank0.contains("ranks [2, 3] had not connected"), "{rank0}");
    let rank1 = stderr(&outputs[1]);
    assert_eq!(outputs[1].status.code(), Some(2), "{rank1}");
    assert!(rank1.contains("rank 1 of the TCP launch"), "{rank1}");
    assert!(rank1.contains("ranks [2, 3] had not connected"), "{rank1}");
}

/// A precision the backend does not compute in is refused before the first step, naming the
/// backend and the precisions it has (lavapipe: no bf16; f32 and f16).
#[cfg(feature = "wgpu")]
#[test]
fn gpt_longctx_refuses_a_precision_the_backend_lacks() {
    refused(
        "gpt_longctx",
        &[
            "--backend",
            "wgpu",
            "--precision",
            "bf16",
            "--steps",
            "1",
            "--seq-len",
            "256",
        ],
        "precision bf16: the backend fusion<cubecl<wgpu<wgsl>>> does not compute in BF16 on this \
         device; it supports --precision f32, f16",
    );
}

/// `gpt_longctx --emulate-links` reports the cost model's attention time of its steps next to
/// the measured one; without emulated links the prediction is null.
#[test]
fn gpt_longctx_predicts_its_attention_time_on_emulated_links() {
    for strategy in [&["--strategy", "ring"][..], &["--strategy", "dcp"]] {
        let args = gpt(&[
            &["--steps", "2", "--cp", "4", "--nodes", "2", "--json"][..],
            strategy,
            &["--emulate-links", "--link-scale", "1000"],
        ]
        .concat());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let summary: serde_json::Value =
            serde_json::from_str(&succeeded("gpt_longctx", &args)).unwrap();
        let measured = summary["attention_ms"].as_f64().unwrap();
        let predicted = summary["predicted_attention_ms"].as_f64().unwrap();
        assert!(measured > 0.0 && predicted > 0.0, "{summary}");
    }
    let args = gpt(&["--steps", "1", "--cp", "2", "--json"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let summary: serde_json::Value =
        serde_json::from_str(&succeeded("gpt_longctx", &args)).unwrap();
    assert!(summary["predicted_attention_ms"].is_null(), "{summary}");
}

/// `gpt_longctx --trace FILE` on threads: one file, one track per rank, every span closed on its
/// own track, attention spans named so, and the communication spans' bytes summing exactly to
/// the summary's `bytes_communicated`; `metrics.jsonl` has the step's `comm_wait_ms`,
/// `optimizer_ms` and every rank's `peak_memory_mb`.
#[test]
fn gpt_longctx_trace_has_a_track_per_rank_and_every_byte() {
    let dir = temp_dir("trace");
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("trace.json");
    let out = dir.join("run");
    let mut args = gpt(&["--steps", "2", "--cp", "4", "--json"]);
    args.extend(["--trace".into(), trace.display().to_string()]);
    args.extend(["--out".into(), out.display().to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let summary: serde_json::Value =
        serde_json::from_str(&succeeded("gpt_longctx", &args)).unwrap();
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let mut open: HashMap<u64, Vec<String>> = HashMap::new();
    let (mut tracks, mut named) = (std::collections::BTreeSet::new(), 0);
    let (mut comm_bytes, mut attention) = (0u64, 0);
    for event in events {
        let tid = event["tid"].as_u64().unwrap();
        match event["ph"].as_str().unwrap() {
            "B" => {
                tracks.insert(tid);
                let name = event["name"].as_str().unwrap().to_string();
                attention += usize::from(name.starts_with("attention "));
                if event["cat"] == "comm" {
                    comm_bytes += event["args"]["bytes"].as_u64().unwrap();
                }
                open.entry(tid).or_default().push(name);
            }
            "E" => {
                let closed = open.get_mut(&tid).and_then(Vec::pop);
                assert_eq!(
                    closed.as_deref(),
                    event["name"].as_str(),
                    "an end that closes no begin of its name on track {tid}"
                );
                assert!(
                    event["args"]["bytes"].is_null(),
                    "bytes counted once: {event}"
                );
            }
            "M" => named += 1,
            other => panic!("unexpected phase {other}"),
        }
    }
    assert!(open.values().all(Vec::is_empty), "unclosed spans: {open:?}");
    assert_eq!(tracks, (0..4).collect(), "one track per rank");
    assert_eq!(named, 4, "each track named");
    // 2 steps × 4 ranks × micro-batches × layers × (forward, backward).
    assert!(attention >= 2 * 4 * 2, "{attention} attention spans");
    assert_eq!(comm_bytes, summary["bytes_communicated"].as_u64().unwrap());
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    for line in metrics.lines() {
        let step: serde_json::Value = serde_json::from_str(line).unwrap();
        assert!(step["comm_wait_ms"].as_f64().unwrap() > 0.0, "{step}");
        assert!(step["optimizer_ms"].as_f64().unwrap() > 0.0, "{step}");
        let peaks = step["peak_memory_mb"].as_array().unwrap();
        assert_eq!(peaks.len(), 4, "{step}");
        assert!(peaks.iter().all(|p| p.as_f64().unwrap() > 0.0), "{step}");
    }
    assert!(summary["peak_memory_mb"].as_f64().unwrap() > 0.0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--recompute none|attention|block`: an unknown mode is refused naming the modes; each mode
/// trains the same losses, reports itself in the summary's config, and recomputes one forward of
/// attention communication per backward (the same extra CP bytes for attention and block).
#[test]
fn gpt_longctx_recompute_modes_train_the_same_losses() {
    refused_gpt(
        &["--recompute", "everything"],
        "unknown recompute mode 'everything': expected none, attention or block",
    );
    let run = |mode: &str| -> serde_json::Value {
        let args = gpt(&["--steps", "2", "--json", "--recompute", mode]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        serde_json::from_str(&succeeded("gpt_longctx", &args)).unwrap()
    };
    let none = run("none");
    let cp_bytes = |report: &serde_json::Value| report["bytes_by_axis"]["cp"].as_u64().unwrap();
    let mut extra = Vec::new();
    for mode in ["attention", "block"] {
        let report = run(mode);
        assert_eq!(report["config"]["recompute"], mode, "{report}");
        let losses = report["losses"].as_array().unwrap();
        let reference = none["losses"].as_array().unwrap();
        assert_eq!(losses.len(), reference.len());
        for (loss, reference) in losses.iter().zip(reference) {
            let (loss, reference) = (loss.as_f64().unwrap(), reference.as_f64().unwrap());
            assert!(
                (loss - reference).abs() <= 1e-6 * reference.abs(),
                "recompute {mode}: loss {loss} vs {reference} without recompute"
            );
        }
        extra.push(cp_bytes(&report) - cp_bytes(&none));
    }
    assert!(extra[0] > 0, "no recompute communication: {extra:?}");
    assert_eq!(extra[0], extra[1], "attention vs block recompute bytes");
}

/// The losses of a run directory's `metrics.jsonl`, by step.
fn metrics_losses(dir: &std::path::Path) -> Vec<(u64, String)> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|line| {
            let step: serde_json::Value = serde_json::from_str(line).unwrap();
            (step["step"].as_u64().unwrap(), step["loss"].to_string())
        })
        .collect()
}

/// `--checkpoint-every 1`: a run killed with SIGKILL at random moments (seeded; over its whole
/// length, so during steps, plans and checkpoint writes) and resumed each time from its latest
/// complete checkpoint — started afresh when none was written yet — ends with the uninterrupted
/// run's losses, step for step, bit for bit; the kept checkpoints are complete.
#[test]
fn a_run_killed_at_random_moments_resumes_to_the_same_losses() {
    killed_and_resumed(&[], "killed", 24);
}

/// The same under `mpirun -n 2` (one process per rank; the whole job killed: `mpirun`, then
/// every rank), with checkpoint shards in chunks of 2 KiB. Skipped, saying so,
/// where `mpirun` is missing (CI installs OpenMPI).
#[test]
fn a_job_killed_under_mpirun_resumes_to_the_same_losses() {
    if Command::new("mpirun").arg("--version").output().is_err() {
        eprintln!("mpirun not found: the MPI kill test did not run");
        return;
    }
    let mpirun = [
        "mpirun",
        "--oversubscribe",
        "--allow-run-as-root",
        "-n",
        "2",
    ];
    // More steps: each launch also starts MPI, and a kill is drawn over the whole run.
    killed_and_resumed(&mpirun, "killed-mpi", 64);
}

/// OpenMPI starts each rank in a process group of its own: SIGKILL every process whose command
/// line names `dir` (this run's ranks), and wait until none is left.
fn kill_ranks(dir: &std::path::Path) {
    let pattern = dir.to_str().unwrap();
    for _ in 0..100 {
        let _ = Command::new("pkill")
            .args(["-KILL", "-f", pattern])
            .status();
        let left = Command::new("pgrep")
            .args(["-f", pattern])
            .output()
            .expect("pgrep (procps) finds mpirun's ranks");
        if left.stdout.is_empty() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    panic!("ranks of {pattern} still running after SIGKILL");
}

/// Runs gpt_longctx (under `launcher`, or alone), kills it at random moments, resumes it, and
/// checks the losses against an uninterrupted run.
fn killed_and_resumed(launcher: &[&str], name: &str, steps: u64) {
    let command = |args: &[String]| {
        let mut command = match launcher.split_first() {
            None => Command::new(example("gpt_longctx")),
            Some((program, rest)) => {
                let mut command = Command::new(program);
                command.args(rest).arg(example("gpt_longctx"));
                command
            }
        };
        command.args(args);
        // Its own process group: a kill reaches mpirun's ranks too.
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        command
    };
    let chunks = ["--checkpoint-chunk-bytes", "2048"];
    let steps_flag = steps.to_string();
    let flags = [
        "--cp",
        "2",
        "--steps",
        &steps_flag,
        "--checkpoint-every",
        "1",
        "--keep-checkpoints",
        "2",
    ];
    let base = gpt(&flags);
    let with = |extra: &[&str]| -> Vec<String> {
        let mut args = base.clone();
        args.extend(extra.iter().map(|s| s.to_string()));
        if !launcher.is_empty() {
            args.extend(chunks.iter().map(|s| s.to_string()));
        }
        args
    };
    let reference = temp_dir(&format!("{name}-reference"));
    let started = std::time::Instant::now();
    let output = command(&with(&["--out", reference.to_str().unwrap()]))
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    let length = started.elapsed();
    let want = metrics_losses(&reference);
    assert_eq!(want.len(), steps as usize);
    let dir = temp_dir(name);
    let mut seed: u64 = 0x9E37_79B9_7F4A_7C15;
    let (mut attempts, mut killed_runs) = (0, 0);
    loop {
        let saved = ["checkpoint", "checkpoint.old"]
            .iter()
            .find_map(|name| std::fs::read_to_string(dir.join(name).join("state.json")).ok())
            .map(|text| {
                serde_json::from_str::<serde_json::Value>(&text).unwrap()["step"]
                    .as_u64()
                    .unwrap()
            });
        let resumable = saved.is_some();
        let args = match resumable {
            true => with(&["--resume", dir.to_str().unwrap()]),
            false => {
                let _ = std::fs::remove_dir_all(&dir);
                with(&["--out", dir.to_str().unwrap()])
            }
        };
        let mut child = command(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Five runs killed, each at a moment drawn over what it has left to run.
        if killed_runs < 5 && attempts < 40 {
            attempts += 1;
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let fraction = (seed >> 11) as f64 / (1u64 << 53) as f64;
            let left = (steps - saved.unwrap_or(0)) as f64 / steps as f64;
            std::thread::sleep(length.mul_f64(fraction * left));
            if child.try_wait().unwrap().is_none() {
                // SIGKILL to the whole process group.
                let group = format!("-{}", child.id());
                let killed = Command::new("kill").args(["-KILL", "--", &group]).status();
                assert!(killed.unwrap().success(), "kill -KILL {group}");
                child.wait().unwrap();
                if !launcher.is_empty() {
                    kill_ranks(&dir);
                }
                killed_runs += 1;
                continue;
            }
        }
        let output = child.wait_with_output().unwrap();
        assert!(output.status.success(), "{}", stderr(&output));
        if dir.join("checkpoint/state.json").exists()
            && metrics_losses(&dir).len() == steps as usize
        {
            // Every chain of kills and resumes that reaches the end has the same losses.
            assert_eq!(metrics_losses(&dir), want, "after {killed_runs} kills");
            // A run can finish before its kill moment (the reference run's length was measured
            // beside other tests, so a later run may be faster): then a fresh chain starts,
            // until enough runs were killed.
            if killed_runs >= 5 || attempts >= 40 {
                break;
            }
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }
    eprintln!("{killed_runs} runs killed in {attempts} attempts");
    assert!(
        killed_runs >= 3,
        "only {killed_runs} runs killed mid-way in {attempts} attempts"
    );
    // The checkpoint and the one archived beside it: the last two steps.
    let archived = format!("checkpoint-{:08}", steps - 1);
    for (name, step) in [("checkpoint", steps), (archived.as_str(), steps - 1)] {
        let state: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join(name).join("state.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(state["step"], step, "{name}");
        assert!(dir.join(name).join("model.mpk").exists());
    }
    std::fs::remove_dir_all(&dir).ok();
    std::fs::remove_dir_all(&reference).ok();
}

/// custom_model checkpoints (`--out`, `--checkpoint-every`) and resumes (`--resume`): a run of 2
/// steps resumed to 4 gives the uninterrupted run's losses bit for bit; a resume whose flags give
/// another model is refused naming the difference.
#[test]
fn custom_model_checkpoints_and_resumes_exactly() {
    let base = [
        "--corpus",
        "builtin",
        "--seq-len",
        "64",
        "--cp",
        "2",
        "--d-model",
        "32",
        "--heads",
        "4",
    ];
    let run = |extra: &[&str]| {
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        succeeded("custom_model", &args)
    };
    let whole = temp_dir("custom-whole");
    run(&["--steps", "4", "--out", whole.to_str().unwrap()]);
    let parts = temp_dir("custom-parts");
    run(&[
        "--steps",
        "2",
        "--checkpoint-every",
        "1",
        "--out",
        parts.to_str().unwrap(),
    ]);
    assert!(parts.join("checkpoint/state.json").exists());
    run(&["--steps", "4", "--resume", parts.to_str().unwrap()]);
    assert_eq!(metrics_losses(&parts), metrics_losses(&whole));
    assert_eq!(metrics_losses(&whole).len(), 4);
    let wider: Vec<&str> = base
        .iter()
        .copied()
        .map(|flag| if flag == "32" { "48" } else { flag })
        .chain(["--steps", "5", "--resume", parts.to_str().unwrap()])
        .collect();
    let output = Command::new(example("custom_model"))
        .args(&wider)
        .output()
        .unwrap();
    let text = stderr(&output);
    assert!(
        !output.status.success() && text.contains("holds a different model"),
        "{text}"
    );
    std::fs::remove_dir_all(&whole).ok();
    std::fs::remove_dir_all(&parts).ok();
}

#[test]
fn gpt_longctx_refuses_bad_data_flags_with_the_rule() {
    refused_gpt(
        &["--eod-token", "0"],
        "--eod-token 0 ends the documents of a flat token file: it needs --data-path",
    );
    refused(
        "gpt_longctx",
        &["--data-path", "/nonexistent/prefix"],
        "neither a Megatron prefix",
    );
    refused(
        "gpt_longctx",
        &["--data-path", "0.5", "a", "0.5"],
        "one path, or weight and path pairs",
    );
    refused(
        "gpt_longctx",
        &["--data-path", "0", "a", "1", "b"],
        "weight 0 of a must be a positive number",
    );
    refused_gpt(&["--data-path", "x"], "give one source of training data");
    refused_gpt(&["--token-dtype", "int8"], "uint16 or uint32");
    refused_gpt(
        &["--tokenizer-file", "/nonexistent/tokenizer.json"],
        "/nonexistent/tokenizer.json",
    );
    // A flat token file needs its end-of-document id; ids past the vocabulary are refused.
    let dir = std::env::temp_dir().join(format!("bdcp-cli-data-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let flat = dir.join("tokens.bin");
    let ids: Vec<u8> = (0..4096u16).flat_map(|i| (i % 300).to_le_bytes()).collect();
    std::fs::write(&flat, ids).unwrap();
    let flat = flat.to_str().unwrap();
    refused(
        "gpt_longctx",
        &["--data-path", flat],
        "--eod-token must say which id",
    );
    refused(
        "gpt_longctx",
        &[
            "--data-path",
            flat,
            "--eod-token",
            "7",
            "--steps",
            "1",
            "--seq-len",
            "256",
        ],
        "outside the vocabulary of 256 ids",
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn gpt_longctx_refuses_what_vpp_cannot_run() {
    refused_gpt(
        &["--vpp", "2"],
        "--vpp 2 interleaves the chunks of a pipeline: it needs --pp 2 or more",
    );
    refused_gpt(
        &["--vpp", "2", "--pp", "2"],
        "--vpp 2 splits the 2 layers into --pp 2 × --vpp 2 = 4 chunks: they must divide",
    );
    refused_gpt(
        &[
            "--vpp",
            "2",
            "--pp",
            "2",
            "--model-size",
            "small",
            "--pp-schedule",
            "gpipe",
        ],
        "--pp-schedule gpipe has no virtual stages",
    );
    refused_gpt(&["--vpp", "0"], "--vpp 0 must be at least 1");
}

/// Inside a Slurm allocation (an `sbatch` script or `salloc` shell: `SLURM_NTASKS` and
/// `SLURM_PROCID` set, no MPI launcher's variables) a run is threads, not an MPI job: Slurm's
/// own variables never make a process think an MPI launcher started it.
#[test]
fn a_run_inside_a_slurm_allocation_is_not_taken_for_mpi() {
    let output = Command::new(example("gpt_longctx"))
        .args(gpt(&["--steps", "1", "--cp", "2", "--json"]))
        .envs([
            ("SLURM_NTASKS", "4"),
            ("SLURM_PROCID", "0"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_JOB_ID", "7"),
        ])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    let summary: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(summary["steps_run"], 1, "{summary}");
    assert!(stderr(&output).contains("threads"), "{}", stderr(&output));
}
