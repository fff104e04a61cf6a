//! The tools (`cp_attention`, `plan_sim`, `dataset_stats`) on invalid and edge inputs: every
//! bad input is a clear one-line error (exit 2, no panic), edge inputs that are valid work.

use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::{Dtype, TensorView};

#[allow(dead_code)] // each command-line test file uses a part of them
#[path = "../../tests/support/cli.rs"]
mod cli;
use cli::{refused, refused_each, succeeded, temp_dir, words};

#[test]
fn cp_attention_refuses_sizes_it_cannot_hold_and_bad_values() {
    refused_each(
        "cp_attention",
        &[],
        &[
            ("--seqlens 4000000000", "GiB of memory, more than the"),
            ("--heads 4000000000", "GiB of memory, more than the"),
            (
                "--seqlens 18446744073709551615,1",
                "the total token count overflows",
            ),
            ("--cp 100000", "--cp 100000 must be between 1 and 1024"),
        ],
    );
    for scale in ["1e38", "nan", "inf", "0", "-1"] {
        refused(
            "cp_attention",
            &[&format!("--scale={scale}")],
            "softmax scale",
        );
    }
    refused_each(
        "cp_attention",
        &[],
        &[
            ("--timeout-secs 0", "--timeout-secs 0 must be between 1"),
            ("--seqlens 0,0", "hold no token"),
            (
                "--strategy usp --ulysses-degree 0",
                "ulysses degree must be at least 1",
            ),
        ],
    );
}

#[test]
fn cp_attention_checks_the_dcp_and_topology_flags() {
    refused_each(
        "cp_attention",
        &[],
        &[
            ("--block 32", "--block only applies to --strategy dcp"),
            ("--cp 4 --nodes 3", "3 nodes must divide the 4 ranks"),
            ("--topology tpu-pod", "unknown topology 'tpu-pod'"),
            ("--strategy dcp --block 0", "block size (0)"),
            (
                "--strategy dcp --seqlens 40,0 --block 8",
                "sequence 1 has length 0",
            ),
        ],
    );
    let report = succeeded(
        "cp_attention",
        &words(
            "--strategy dcp --cp 4 --nodes 2 --heads 2 --head-dim 8 --seqlens 70,9 \
            --block 16 --json",
        ),
    );
    let report: serde_json::Value = serde_json::from_str(&report).unwrap();
    assert_eq!(
        report["bytes_by_link"], report["predicted_bytes_by_link"],
        "{report}"
    );
    assert!(
        report["max_rel_err"]["out"].as_f64().unwrap() <= 1e-5,
        "{report}"
    );
    // Head units placed apart by the plan: exact, bytes as predicted; units that do not fit
    // the heads are refused with the rule.
    refused_each(
        "cp_attention",
        &[],
        &[
            (
                "--head-units 2",
                "--head-units only applies to --strategy dcp",
            ),
            (
                "--strategy dcp --heads 4 --head-units 3",
                "3 head units do not divide 4 query heads",
            ),
        ],
    );
    let flags = words(
        "--strategy dcp --cp 4 --nodes 2 --heads 4 --kv-heads 2 --head-dim 8 --seqlens \
        90,33 --block 16 --head-units 4 --json",
    );
    let report: serde_json::Value =
        serde_json::from_str(&succeeded("cp_attention", &flags)).unwrap();
    assert_eq!(report["head_units"], 4, "{report}");
    assert_eq!(
        report["bytes_by_link"], report["predicted_bytes_by_link"],
        "{report}"
    );
    assert_eq!(
        report["bytes_sent_per_rank"], report["analytic_bytes_per_rank"],
        "{report}"
    );
    for (name, error) in report["max_rel_err"].as_object().unwrap() {
        assert!(error.as_f64().unwrap() <= 1e-5, "{name}: {report}");
    }
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Writes a Mode 2 input file: `q`, `dout` `[t, heads, dim]`, `k`, `v` `[t, kv, dim]`.
fn mode2_inputs(path: &Path, t: usize, heads: usize, kv: usize, dim: usize, nan_at: Option<usize>) {
    let value = |i: usize| ((i * 37 % 101) as f32 / 101.0) - 0.5;
    let mut q: Vec<f32> = (0..t * heads * dim).map(value).collect();
    if let Some(at) = nan_at {
        q[at] = f32::NAN;
    }
    let kv_values: Vec<f32> = (0..t * kv * dim).map(|i| value(i + 7)).collect();
    let dout: Vec<f32> = (0..t * heads * dim).map(|i| value(i + 3)).collect();
    let (q, kv_bytes, dout) = (f32_bytes(&q), f32_bytes(&kv_values), f32_bytes(&dout));
    let cu: Vec<u8> = [0i64, t as i64 / 2, t as i64]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let tensors: HashMap<String, TensorView<'_>> = [
        ("q", TensorView::new(Dtype::F32, vec![t, heads, dim], &q)),
        (
            "k",
            TensorView::new(Dtype::F32, vec![t, kv, dim], &kv_bytes),
        ),
        (
            "v",
            TensorView::new(Dtype::F32, vec![t, kv, dim], &kv_bytes),
        ),
        (
            "dout",
            TensorView::new(Dtype::F32, vec![t, heads, dim], &dout),
        ),
        ("cu_seqlens", TensorView::new(Dtype::I64, vec![3], &cu)),
    ]
    .into_iter()
    .map(|(name, view)| (name.to_string(), view.unwrap()))
    .collect();
    safetensors::serialize_to_file(tensors, None, path).unwrap();
}

#[test]
fn cp_attention_mode2_validates_shapes_and_keeps_nan_visible() {
    let dir = temp_dir("mode2");
    std::fs::create_dir_all(&dir).unwrap();
    let (input, output) = (dir.join("in.safetensors"), dir.join("out.safetensors"));
    let (i, o) = (input.to_str().unwrap(), output.to_str().unwrap());
    mode2_inputs(&input, 8, 0, 0, 4, None);
    refused(
        "cp_attention",
        &["--inputs", i, "--output", o],
        "must all be at least 1",
    );
    mode2_inputs(&input, 8, 2, 2, 0, None);
    refused(
        "cp_attention",
        &["--inputs", i, "--output", o],
        "must all be at least 1",
    );
    // NaN in q of token 1, head 0 (sequence 0): out, lse and dq of that row are NaN.
    let (t, heads, dim) = (8, 2, 4);
    mode2_inputs(&input, t, heads, 2, dim, Some(heads * dim));
    for strategy in ["ring", "ulysses", "all-gather"] {
        let out = succeeded(
            "cp_attention",
            &[
                "--inputs",
                i,
                "--output",
                o,
                "--cp",
                "2",
                "--strategy",
                strategy,
                "--json",
            ],
        );
        let summary: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(summary["non_finite_inputs"], true);
        let bytes = std::fs::read(&output).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let read = |name: &str| -> Vec<f32> {
            file.tensor(name)
                .unwrap()
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect()
        };
        let (out, lse, dq) = (read("out"), read("lse"), read("dq"));
        let row = heads * dim;
        assert!(
            out[row..row + dim].iter().all(|x| x.is_nan()),
            "{strategy}: out {out:?}"
        );
        assert!(lse[1].is_nan(), "{strategy}: lse {lse:?}");
        assert!(
            dq[row..row + dim].iter().all(|x| x.is_nan()),
            "{strategy}: dq {dq:?}"
        );
        // Token 6 is in sequence 1, which the NaN cannot reach.
        assert!(
            out[6 * row..7 * row].iter().all(|x| x.is_finite()),
            "{strategy}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn plan_sim_and_dataset_stats_refuse_sizes_with_limits() {
    refused_each(
        "plan_sim",
        &[],
        &[
            ("--lengths 4000000000", "block pairs"),
            ("--nodes 1000000 --lengths 4096", "exceed the 4096 ranks"),
            (
                "--stages 18446744073709551615",
                "1 to 64 communication stages",
            ),
            ("--compute-epsilon nan", "compute epsilon must be"),
        ],
    );
    refused_each(
        "dataset_stats",
        &[],
        &[
            (
                "--max-tokens-per-rank 4611686018427387904 --ranks 4",
                "overflows the tokens of a micro-batch",
            ),
            ("--corpus ldc-like --samples 1000000000000", "--samples"),
        ],
    );
}

/// The kernel choice of `BURN_DCP_ATTENTION_KERNEL` on wgpu (lavapipe): a bad value and a kernel
/// the device cannot run are one-line errors naming the rule, before anything is queued on
/// burn-fusion's stream; `flash-plain` runs every rank on the flash kernels' plain bodies within
/// 1e-5.
#[cfg(feature = "wgpu")]
#[test]
fn cp_attention_kernel_choice_is_checked_and_flash_plain_runs() {
    let with_kernel = |kernel: &str, extra: &[&str]| {
        let mut args = vec!["--backend", "wgpu", "--cp", "2", "--head-dim", "16"];
        args.extend(words("--seqlens 100,37 --strategy ring --mask causal"));
        args.extend(extra);
        std::process::Command::new(cli::example("cp_attention"))
            .args(&args)
            .env("BURN_DCP_ATTENTION_KERNEL", kernel)
            .output()
            .unwrap()
    };
    for (kernel, expected) in [
        (
            "cmma",
            "expected one of auto, flash, flash-plain, flash-plain-shared",
        ),
        ("tiles", "the matrix-tile kernels were retired"),
        ("vector", "the vector kernels were retired"),
        (
            "flash",
            "the flash kernels' tensor cores take f16 or bf16 inputs, not F32",
        ),
    ] {
        for extra in [&[][..], &["--no-fusion"][..]] {
            let output = with_kernel(kernel, extra);
            let text = cli::stderr(&output);
            assert_eq!(output.status.code(), Some(2), "{kernel} {extra:?}: {text}");
            assert!(!text.contains("panicked"), "{kernel} {extra:?}: {text}");
            assert!(text.contains(expected), "{kernel} {extra:?}: {text}");
        }
    }
    let output = with_kernel("flash-plain", &["--json"]);
    assert!(output.status.success(), "{}", cli::stderr(&output));
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    for (name, error) in report["max_rel_err"].as_object().unwrap() {
        assert!(error.as_f64().unwrap() <= 1e-5, "{name}: {error}");
    }
}

/// `cp_attention --emulate-links` reports the measured attention time next to the cost model's
/// prediction of the same plan; without it, or for a layout the cost model has no plan of, the
/// prediction is null; a bad scale is refused.
#[test]
fn cp_attention_emulated_links_report_measured_and_predicted_time() {
    let base =
        words("--cp 4 --nodes 2 --heads 4 --kv-heads 2 --head-dim 16 --seqlens 300,100 --json");
    let run = |extra: &[&str]| -> serde_json::Value {
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        serde_json::from_str(&succeeded("cp_attention", &args)).unwrap()
    };
    for strategy in [
        &["--strategy", "ring"][..],
        &["--strategy", "usp", "--ulysses-degree", "2"],
        &["--strategy", "dcp", "--block", "64"],
    ] {
        let extra: Vec<&str> = strategy
            .iter()
            .chain(&["--emulate-links", "--link-scale", "2000"])
            .copied()
            .collect();
        let report = run(&extra);
        assert_eq!(report["emulate_links"], true, "{report}");
        assert_eq!(report["link_scale"], 2000.0, "{report}");
        let measured = report["measured_attention_ms"].as_f64().unwrap();
        let predicted = report["predicted_attention_ms"].as_f64().unwrap();
        assert!(measured > 0.0 && predicted > 0.0, "{report}");
        let parts = report["predicted_forward_ms"].as_f64().unwrap()
            + report["predicted_backward_ms"].as_f64().unwrap();
        assert!((parts - predicted).abs() <= 1e-9 * predicted, "{report}");
        assert!(
            report["max_rel_err"]["dk"].as_f64().unwrap() < 1e-4,
            "{report}"
        );
    }
    let plain = run(&["--strategy", "ring"]);
    assert_eq!(plain["emulate_links"], false);
    assert!(plain["predicted_attention_ms"].is_null(), "{plain}");
    assert!(plain["measured_attention_ms"].as_f64().unwrap() > 0.0);
    let contiguous = run(&words(
        "--strategy ring --layout contiguous --emulate-links --link-scale 10",
    ));
    assert!(
        contiguous["predicted_attention_ms"].is_null(),
        "{contiguous}"
    );
    let mut args = base.to_vec();
    args.extend(["--emulate-links", "--link-scale", "0"]);
    refused(
        "cp_attention",
        &args,
        "--link-scale 0 must be a positive number",
    );
    let mut args = base.to_vec();
    args.extend(["--link-scale", "10"]);
    refused(
        "cp_attention",
        &args,
        "--link-scale 10 only applies with --emulate-links",
    );
}

#[test]
fn prepare_data_refuses_bad_flags_and_dataset_stats_reads_its_files() {
    refused(
        "prepare_data",
        &["--input", "builtin-missing", "--output-prefix", "/tmp/x"],
        "builtin-missing",
    );
    let dir = std::env::temp_dir().join(format!("bdcp-prepare-cli-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("text")).unwrap();
    std::fs::write(dir.join("text/a.txt"), "first document").unwrap();
    std::fs::write(dir.join("text/b.txt"), "the second one").unwrap();
    let input = dir.join("text");
    let input = input.to_str().unwrap();
    let prefix = dir.join("out");
    let prefix = prefix.to_str().unwrap();
    // The input and output every case below shares, then each case's flags.
    let with_io = |flags: &'static str| {
        ["--input", input, "--output-prefix", prefix]
            .into_iter()
            .chain(words(flags))
            .collect::<Vec<_>>()
    };
    refused(
        "prepare_data",
        &with_io("--format tar"),
        "--format tar: indexed or flat",
    );
    refused(
        "prepare_data",
        &with_io("--format flat --tokenizer bytes"),
        "--eod-token: which id ends a document with the bytes tokenizer?",
    );
    let written = succeeded(
        "prepare_data",
        &with_io("--tokenizer bytes --append-eod --eod-token 0"),
    );
    let written: serde_json::Value = serde_json::from_str(&written).unwrap();
    assert_eq!(
        (written["documents"].as_u64(), written["tokens"].as_u64()),
        (Some(2), Some(30))
    );
    let stats = succeeded("dataset_stats", &["--data-path", prefix, "--json"]);
    let stats: serde_json::Value = serde_json::from_str(&stats).unwrap();
    assert_eq!(
        (stats["documents"].as_u64(), stats["max"].as_u64()),
        (Some(2), Some(15))
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn pictures_of_runs_and_plans_are_drawn_and_bad_inputs_refused() {
    let dir = temp_dir("pictures");
    let run = |name: &str, losses: &[f64]| {
        let lines: Vec<String> = losses
            .iter()
            .enumerate()
            .map(|(i, loss)| {
                format!(
                    r#"{{"step":{},"loss":{loss},"tokens":1000,"step_ms":500.0,"peak_memory_mb":[10.0,12.5]}}"#,
                    i + 1
                )
            })
            .collect();
        let path = dir.join(name);
        std::fs::create_dir_all(&path).unwrap();
        std::fs::write(path.join("metrics.jsonl"), lines.join("\n")).unwrap();
        path
    };
    let (a, b) = (run("a", &[5.0, 4.0, 3.5]), run("b", &[5.0, 4.1, 3.4]));
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    for extension in ["svg", "png"] {
        let out = dir.join(format!("runs.{extension}"));
        let out = out.to_str().unwrap();
        succeeded(
            "plot_metrics",
            &[a, b, "--out", out, "--label", "cp 1", "--label", "cp 4"],
        );
        let bytes = std::fs::read(out).unwrap();
        match extension {
            "svg" => {
                let svg = String::from_utf8(bytes).unwrap();
                assert!(svg.contains("<svg") && svg.contains("cp 4") && svg.contains("tokens/s"));
            }
            _ => assert_eq!(&bytes[1..4], b"PNG"),
        }
    }
    let out = dir.join("runs.pdf");
    refused(
        "plot_metrics",
        &[a, "--out", out.to_str().unwrap()],
        "must end in .svg or .png",
    );
    refused(
        "plot_metrics",
        &[a, b, "--out", "x.svg", "--label", "one"],
        "--label given 1 times for 2 runs",
    );
    let missing = dir.join("missing");
    refused(
        "plot_metrics",
        &[missing.to_str().unwrap(), "--out", "x.svg"],
        "no such run (give a run's --out directory or its metrics.jsonl)",
    );
    let plan = dir.join("plan.svg");
    let plan = plan.to_str().unwrap();
    succeeded(
        "plan_sim",
        &[
            "--lengths",
            "3000,500",
            "--nodes",
            "1",
            "--devices-per-node",
            "4",
            "--heads",
            "4",
            "--kv-heads",
            "4",
            "--block",
            "256",
            "--strategies",
            "ring-zigzag,dcp,auto",
            "--svg",
            plan,
        ],
    );
    let svg = std::fs::read_to_string(plan).unwrap();
    for text in [
        "ring-zigzag: tiles",
        "dcp: tiles",
        "auto (",
        "MB sent per rank",
        "stages)",
    ] {
        assert!(svg.contains(text), "{text} not in the plan's picture");
    }
}
