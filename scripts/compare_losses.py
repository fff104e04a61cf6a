#!/usr/bin/env python3
"""Runs gpt_longctx for several parallel configurations (static CP strategies, DP × CP and
dynamic CP pools, DCP block plans, strategy auto, TP × CP × DP, PP × TP × CP × DP) at the same seed and data and checks that
every step's loss agrees with the cp 1 × dp 1 run to ≤ 1e-4 relative.

Usage: python3 scripts/compare_losses.py [BIN] [--steps N]
(default BIN: target/release/examples/gpt_longctx)
"""
import json
import subprocess
import sys

args = sys.argv[1:]
binary = args[0] if args and not args[0].startswith("--") else "target/release/examples/gpt_longctx"
steps = args[args.index("--steps") + 1] if "--steps" in args else "30"
common = ["--steps", steps, "--seed", "7", "--seq-len", "2048", "--json"]


def losses(*flags, common=common):
    out = subprocess.run([binary, *flags, *common], check=True, capture_output=True, text=True).stdout
    return json.loads(out)["losses"]


runs = {
    "cp4 ulysses": ["--cp", "4", "--strategy", "ulysses"],
    "cp4 ring-zigzag": ["--cp", "4", "--strategy", "ring-zigzag"],
    "cp4 usp 2x2": ["--cp", "4", "--strategy", "usp", "--ulysses-degree", "2"],
    "cp4 all-gather": ["--cp", "4", "--strategy", "all-gather"],
    "cp2 dp2 ring": ["--cp", "2", "--dp", "2"],
    # Dynamic CP (Megatron-style) over pools of 2, 4 and 8 ranks.
    "dynamic pool 2": ["--cp", "2", "--strategy", "dynamic", "--max-tokens-per-rank", "1024"],
    "dynamic pool 4": ["--cp", "2", "--dp", "2", "--strategy", "dynamic", "--max-tokens-per-rank", "512"],
    "dynamic pool 8": ["--cp", "8", "--strategy", "dynamic", "--max-tokens-per-rank", "384", "--cp-sizes", "any"],
    # DCP block plans executed per micro-batch, on one node and over two virtual nodes.
    "dcp cp4": ["--cp", "4", "--strategy", "dcp"],
    "dcp cp4 2 nodes": ["--cp", "4", "--strategy", "dcp", "--topology", "a100-p4d", "--nodes", "2"],
    # Auto: per micro-batch the lowest estimated time (all candidates; and only dynamic or dcp).
    "auto cp4": ["--cp", "4", "--strategy", "auto"],
    "auto cp4 2 nodes": ["--cp", "4", "--strategy", "auto", "--nodes", "2"],
    "auto dynamic|dcp": ["--cp", "4", "--strategy", "auto", "--auto-candidates", "dynamic,dcp"],
    # Tensor parallelism composed with CP (and DP).
    "tp2 cp2": ["--tp", "2", "--cp", "2"],
    "tp2 cp2 dp2": ["--tp", "2", "--cp", "2", "--dp", "2"],
}
# Pipeline parallelism: every DP replica needs at least pp micro-batches per step, so these runs
# take 4 micro-batches per step and are compared with cp 1 at 4 micro-batches, over 8 steps (or
# --steps if fewer), which keeps CI's time in bounds.
pipeline_runs = {
    "pp2 cp2": ["--pp", "2", "--cp", "2"],
    "pp2 cp2 gpipe": ["--pp", "2", "--cp", "2", "--pp-schedule", "gpipe"],
    "tp2 pp2 cp2": ["--tp", "2", "--pp", "2", "--cp", "2"],
    "pp2 cp2 dp2 dynamic": ["--pp", "2", "--cp", "2", "--dp", "2", "--strategy", "dynamic", "--max-tokens-per-rank", "512"],
}
four = ["--micro-batches", "4"]
pipeline_common = ["--steps", str(min(int(steps), 8)), *common[2:]]
reference = losses("--cp", "1", "--dp", "1")
reference_four = losses("--cp", "1", "--dp", "1", *four, common=pipeline_common)
worst_all = 0.0
comparisons = [(name, flags, reference, common) for name, flags in runs.items()]
comparisons += [(name, flags + four, reference_four, pipeline_common) for name, flags in pipeline_runs.items()]
for name, flags, want, run_common in comparisons:
    got = losses(*flags, common=run_common)
    assert len(got) == len(want), (name, len(got))
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    worst_all = max(worst_all, worst)
    print(f"{name:<20} steps {len(got)}  max relative loss difference vs cp1 dp1: {worst:.2e}  final loss {got[-1]:.4f}")
print(f"reference final loss {reference[-1]:.4f} (4 micro-batches: {reference_four[-1]:.4f}); worst {worst_all:.2e}")
sys.exit(0 if worst_all <= 1e-4 else 1)
