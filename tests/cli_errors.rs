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
use cli::{example, refused, refused_each, stderr, succeeded, temp_dir, words};

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
    refused_each(
        "gpt_longctx",
        &QUICK,
        &[
            (
                "--lr nan",
                "learning rate NaN must be a finite number in (0, 1]",
            ),
            ("--lr=-1", "learning rate -1 must be"),
            ("--timeout-secs 0", "timeout 0 s must be between 1"),
            ("--cp 100000", "exceed the 1024 ranks"),
            ("--mask full", "needs a causal-family mask"),
        ],
    );
    refused_each(
        "gpt_longctx",
        &[],
        &[
            ("--corpus builtin --micro-batches=4000000000", "exceed the limit"),
            (
                "--max-tokens-per-rank 9223372036854775808 --cp 2",
                "--max-tokens-per-rank 9223372036854775808 × --cp 2 overflows, far beyond the limit",
            ),
            (
                "--max-tokens-per-rank 9223372036854775807 --cp 2",
                "--max-tokens-per-rank 9223372036854775807 × --cp 2 exceeds the limit of 4294967295 tokens",
            ),
        ],
    );
    refused_each(
        "gpt_longctx",
        &QUICK,
        &[
            ("--block 16", "--block only applies to --strategy dcp"),
            (
                "--lengths-from books",
                "--lengths-from: invalid setting: unknown length distribution 'books': expected longalign-like or ldc-like",
            ),
            ("--link-scale 10", "--link-scale 10 only applies with --emulate-links"),
            ("--emulate-links --link-scale 0", "--link-scale 0 must be a positive number"),
            ("--cp 4 --nodes 3", "--nodes 3 must divide the 4 ranks"),
        ],
    );
    refused(
        "gpt_longctx",
        &words("--corpus builtin --cp 4 --dp 3 --micro-batches 3 --nodes 2"),
        "a CP group of 4 ranks neither fills whole nodes of 6 ranks nor fits in one",
    );
    refused_each(
        "gpt_longctx",
        &QUICK,
        &[
            ("--strategy dcp --block 0", "--block 0 must be between 1"),
            ("--strategy dcp --stages 0", "--stages 0"),
            ("--topology tpu-pod", "unknown topology 'tpu-pod'"),
            (
                "--strategy dynamic --block 32",
                "--block only applies to --strategy dcp or auto",
            ),
            (
                "--optimizer lion",
                "unknown --optimizer 'lion': expected adamw, adam, sgd",
            ),
            (
                "--optimizer sgd --adam-beta1 0.8",
                "--adam-beta1 does not apply to --optimizer sgd",
            ),
            ("--lr-schedule step", "unknown --lr-schedule 'step'"),
            (
                "--warmup-steps 50",
                "--warmup-steps 50 exceeds the 30 steps of the schedule",
            ),
            (
                "--clip-grad-norm 0",
                "--clip-grad-norm 0 must be a positive number",
            ),
            (
                "--strategy dcp --layout stripe",
                "--layout stripe does not apply to --strategy dcp",
            ),
        ],
    );
}

/// A precision the backend does not compute in is refused before the first step, naming the
/// backend and the precisions it has (lavapipe: no bf16; f32 and f16).
#[cfg(feature = "wgpu")]
#[test]
fn gpt_longctx_refuses_a_precision_the_backend_lacks() {
    refused(
        "gpt_longctx",
        &words("--backend wgpu --precision bf16 --steps 1 --seq-len 256"),
        "precision bf16: the backend fusion<cubecl<wgpu<wgsl>>> does not compute in BF16 on this \
         device; it supports --precision f32, f16",
    );
}

#[test]
fn gpt_longctx_refuses_bad_data_flags_with_the_rule() {
    refused_gpt(
        &["--eod-token", "0"],
        "--eod-token 0 ends the documents of a flat token file: it needs --data-path",
    );
    refused_each(
        "gpt_longctx",
        &[],
        &[
            (
                "--data-path /nonexistent/prefix",
                "neither a Megatron prefix",
            ),
            (
                "--data-path 0.5 a 0.5",
                "one path, or weight and path pairs",
            ),
            (
                "--data-path 0 a 1 b",
                "weight 0 of a must be a positive number",
            ),
        ],
    );
    refused_each(
        "gpt_longctx",
        &QUICK,
        &[
            ("--data-path x", "give one source of training data"),
            ("--token-dtype int8", "uint16 or uint32"),
            (
                "--tokenizer-file /nonexistent/tokenizer.json",
                "/nonexistent/tokenizer.json",
            ),
        ],
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
    refused_each(
        "gpt_longctx",
        &QUICK,
        &[
            (
                "--vpp 2",
                "--vpp 2 interleaves the chunks of a pipeline: it needs --pp 2 or more",
            ),
            (
                "--vpp 2 --pp 2",
                "--vpp 2 splits the 2 layers into --pp 2 × --vpp 2 = 4 chunks: they must divide",
            ),
            (
                "--vpp 2 --pp 2 --model-size small --pp-schedule gpipe",
                "--pp-schedule gpipe has no virtual stages",
            ),
            ("--vpp 0", "--vpp 0 must be at least 1"),
        ],
    );
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

#[path = "cli_errors/strategies.rs"]
mod strategies;

#[path = "cli_errors/parallel.rs"]
mod parallel;

#[path = "cli_errors/tcp.rs"]
mod tcp;

#[path = "cli_errors/resume.rs"]
mod resume;
