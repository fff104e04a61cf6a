#!/usr/bin/env python3
"""Runs plan_sim on the planners issue's scenarios and prints a markdown table; with --check,
fails unless DCP moves >= 30% fewer inter-node bytes than ring-zigzag at compute imbalance
<= 1.10 under causal masks, and is estimated faster than ring-zigzag by >= 2.15x under the
sparse masks (the low end of the DCP paper's sparse range).

    python3 scripts/plan_table.py [--check] [--seeds 0,1,2] [--binary target/release/plan_sim]
"""

import argparse
import json
import subprocess
import sys

MASKS = ["causal", "lambda:64,4096", "blockwise:256,2", "shared-question:0.2,4"]
MIXES = ["ldc-like", "longalign-like"]


def run(binary, mix, mask, seed, nodes=4, extra=()):
    cmd = [binary, "--lengths-from", mix, "--tokens", "131072", "--topology", "a100-p4d",
           "--nodes", str(nodes), "--mask", mask, "--heads", "8", "--kv-heads", "2",
           "--head-dim", "128", "--block", "512", "--seed", str(seed), "--json", *extra]
    return strategies(cmd)


def strategies(command):
    """plan_sim's `command` run: its strategies by name (exits naming the command if it fails)."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stderr}")
    return {s["name"]: s for s in json.loads(done.stdout)["strategies"]}


def plan_sim_parser(seeds):
    """The flags of every plan_sim script: --binary, and --seeds defaulting to `seeds`."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--binary", default="target/release/plan_sim")
    parser.add_argument("--seeds", default=seeds)
    return parser


def main():
    parser = plan_sim_parser("0")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    failures = []
    print("| mix | mask | seed | ring inter GB | dcp inter GB | inter-node bytes | dcp compute imb. | dcp memory imb. | ring ms (fwd+bwd) | dcp ms (fwd+bwd) | speedup | dcp plan ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for seed in [int(s) for s in args.seeds.split(",")]:
        for mix in MIXES:
            for mask in MASKS:
                r = run(args.binary, mix, mask, seed, extra=("--strategies", "ring-zigzag,dcp"))
                ring, dcp = r["ring-zigzag"], r["dcp"]
                reduction = 1 - dcp["inter_node_bytes"] / max(ring["inter_node_bytes"], 1)
                ring_ms = ring["attention_fwd_ms"] + ring["attention_bwd_ms"]
                dcp_ms = dcp["attention_fwd_ms"] + dcp["attention_bwd_ms"]
                speedup = ring_ms / dcp_ms
                print(f"| {mix} | {mask} | {seed} | {ring['inter_node_bytes'] / 1e9:.3f} | "
                      f"{dcp['inter_node_bytes'] / 1e9:.3f} | -{100 * reduction:.1f}% | "
                      f"{dcp['compute_imbalance']:.3f} | {dcp['memory_imbalance']:.3f} | "
                      f"{ring_ms:.2f} | {dcp_ms:.2f} | {speedup:.2f}x | {dcp['planning_ms']:.1f} |")
                if dcp["compute_imbalance"] > 1.10 + 1e-9:
                    failures.append(f"{mix} {mask} seed {seed}: compute imbalance {dcp['compute_imbalance']}")
                if mask == "causal" and reduction < 0.30:
                    failures.append(f"{mix} {mask} seed {seed}: inter-node reduction {reduction:.3f} < 0.30")
                if mask.startswith(("lambda", "blockwise")) and speedup < 2.15:
                    failures.append(f"{mix} {mask} seed {seed}: speedup {speedup:.2f} < 2.15")
    if args.check and failures:
        print("\n".join(failures), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
