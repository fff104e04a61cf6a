//! gpt_longctx's parallel layouts and what they report: ranks without tokens, bytes by link over
//! virtual nodes and by axis under TP and PP, the predicted time on emulated links, the trace and
//! the recompute modes.

use super::*;

#[test]
fn gpt_longctx_trains_with_ranks_that_hold_no_token() {
    let out = succeeded(
        "gpt_longctx",
        &words("--corpus builtin --cp 4 --seq-len 3 --micro-batches 1 --steps 2 --json"),
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
fn gpt_longctx_counts_bytes_by_link_over_virtual_nodes() {
    let args = gpt(&words(
        "--steps 1 --cp 4 --strategy dcp --block 16 --nodes 2 --json",
    ));
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
    refused_each(
        "gpt_longctx",
        &QUICK,
        &[
            ("--tp 3", "--tp 3 must divide the 4 query heads"),
            ("--tp 0", "must be at least 1"),
            (
                "--tp 2 --cp 4 --strategy ulysses",
                "the heads of one TP rank of 2",
            ),
            ("--tp 2 --cp 2 --nodes 4", "must hold whole TP groups of 2"),
        ],
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
