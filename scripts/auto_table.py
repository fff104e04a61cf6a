#!/usr/bin/env python3
"""Which strategy `--strategy auto` picks where: runs `plan_sim --strategies auto` on batches of
the ldc-like and longalign-like samplers (several token counts, masks and clusters) and prints a
markdown table of the winner and every candidate's estimated attention time (fwd + bwd, ms).

    python3 scripts/auto_table.py [--seeds 0] [--binary target/release/plan_sim]
"""

import argparse
import json
import subprocess

CANDIDATES = ["ring-zigzag", "ulysses", "usp", "all-gather", "dynamic", "dcp"]
MASKS = ["causal", "lambda:64,4096", "blockwise:256,2", "shared-question:0.2,4"]
MIXES = ["ldc-like", "longalign-like"]
# (tokens, topology, nodes): one 8-GPU node, 4 A100 nodes, 4 H100 nodes
CLUSTERS = [(32768, "a100-p4d", 1), (131072, "a100-p4d", 4), (131072, "h100-dgx", 4)]


def run(binary, mix, mask, seed, tokens, topology, nodes):
    cmd = [binary, "--lengths-from", mix, "--tokens", str(tokens), "--topology", topology,
           "--nodes", str(nodes), "--mask", mask, "--heads", "8", "--kv-heads", "2",
           "--head-dim", "128", "--block", "512", "--seed", str(seed), "--strategies", "auto",
           "--json"]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)["auto"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--binary", default="target/release/plan_sim")
    parser.add_argument("--seeds", default="0")
    args = parser.parse_args()
    print("| mix | mask | tokens | cluster | seed | winner | " + " | ".join(CANDIDATES) + " |")
    print("|---|---|---|---|---|---|" + "---|" * len(CANDIDATES))
    wins = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for tokens, topology, nodes in CLUSTERS:
            for mix in MIXES:
                for mask in MASKS:
                    auto = run(args.binary, mix, mask, seed, tokens, topology, nodes)
                    ms = {e["strategy"]: e["estimated_ms"] for e in auto["estimates"]}
                    cells = [f"{ms[c]:.2f}" if ms.get(c) is not None else "—" for c in CANDIDATES]
                    winner = auto["choice"]
                    wins[winner] = wins.get(winner, 0) + 1
                    print(f"| {mix} | {mask} | {tokens} | {nodes} × {topology} | {seed} | "
                          f"**{winner}** | " + " | ".join(cells) + " |")
    print()
    print("wins: " + ", ".join(f"{k} {v}" for k, v in sorted(wins.items())))


if __name__ == "__main__":
    main()
