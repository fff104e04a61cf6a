#!/usr/bin/env python3
"""Runs cp_attention --backend wgpu for every strategy and layout and checks max_rel_err <= 1e-5
(f32) for out, lse, dq, dk, dv against the CPU reference.
Usage: check_wgpu.py CP_ATTENTION_BINARY [--backend wgpu|cuda]   (cuda: scripts/gpu_check.sh)"""
import json
import subprocess
import sys

binary = sys.argv[1]
backend = sys.argv[sys.argv.index("--backend") + 1] if "--backend" in sys.argv else "wgpu"
common = ["--backend", backend, "--cp", "4", "--head-dim", "16", "--seqlens", "300,129,77", "--json"]
runs = [
    ["--strategy", "ring", "--layout", "zigzag", "--heads", "4", "--kv-heads", "2", "--mask", "causal"],
    ["--strategy", "ring", "--layout", "contiguous", "--heads", "4", "--kv-heads", "1", "--mask", "lambda:8,40"],
    ["--strategy", "ring", "--layout", "stripe", "--heads", "2", "--kv-heads", "2", "--mask", "full"],
    ["--strategy", "all-gather", "--layout", "zigzag", "--heads", "4", "--kv-heads", "2", "--mask", "sliding:50"],
    ["--strategy", "ulysses", "--layout", "zigzag", "--heads", "8", "--kv-heads", "4", "--mask", "causal"],
    # one query head per rank (a [1, T] lse slice per rank) and kv heads replicated over ranks
    ["--strategy", "ulysses", "--layout", "zigzag", "--heads", "4", "--kv-heads", "1", "--mask", "blockwise:32,2"],
    ["--strategy", "usp", "--ulysses-degree", "2", "--layout", "zigzag", "--heads", "8", "--kv-heads", "4",
     "--mask", "shared-question:0.3,3"],
    ["--strategy", "usp", "--ulysses-degree", "4", "--layout", "stripe", "--heads", "4", "--kv-heads", "2",
     "--mask", "causal"],
    # a DCP block plan over two virtual nodes (copies relayed inside the remote node)
    ["--strategy", "dcp", "--block", "32", "--nodes", "2", "--heads", "4", "--kv-heads", "2",
     "--mask", "lambda:8,40"],
]
worst = 0.0
for args in runs:
    result = subprocess.run([binary, *common, *args], capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{' '.join(args)} failed:\n{result.stderr[-2000:]}")
    errors = json.loads(result.stdout)["max_rel_err"]
    print(" ".join(args), errors)
    bad = {k: v for k, v in errors.items() if not v <= 1e-5}
    report = json.loads(result.stdout)
    if report.get("predicted_bytes_by_link") and report["predicted_bytes_by_link"] != report["bytes_by_link"]:
        sys.exit(f"{' '.join(args)}: measured bytes by link {report['bytes_by_link']} differ from the plan's {report['predicted_bytes_by_link']}")
    if bad:
        sys.exit(f"{' '.join(args)}: max_rel_err above 1e-5: {bad}")
    worst = max(worst, *errors.values())
print(f"all strategies on {backend} within 1e-5 (worst {worst:.2e})")
