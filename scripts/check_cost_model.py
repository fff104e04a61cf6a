#!/usr/bin/env python3
"""The cost model against measured attention time:
cp_attention --cp 8 --nodes 2 --emulate-links --heads 8 --kv-heads 2
--seqlens 4096,1024,512,300 for ring (zigzag), all-gather, usp (Ulysses degree 2) and dcp (block
128), causal and lambda:64,512. Prints measured and predicted attention time (forward + backward,
ms) and their ratio per run; with --check asserts predicted/measured within 0.75-1.25 for each.

Usage: python3 scripts/check_cost_model.py [BIN] [--link-scale F] [--masks causal,lambda:64,512]
       [--strategies ring,all-gather,usp,dcp,dcp-units2] [--seqlens 4096,1024,512,300] [--head-dim D]
       [--check]
"""
import json
import subprocess
import sys

args = sys.argv[1:]
binary = args[0] if args and not args[0].startswith("--") else "target/release/cp_attention"


def option(name, default):
    return args[args.index(name) + 1] if name in args else default


strategies = option("--strategies", "ring,all-gather,usp,dcp").split(",")
masks = option("--masks", "causal;lambda:64,512").split(";")
common = ["--cp", "8", "--nodes", "2", "--emulate-links", "--heads", "8", "--kv-heads", "2",
          "--seqlens", option("--seqlens", "4096,1024,512,300"), "--json"]
if "--head-dim" in args:
    common += ["--head-dim", option("--head-dim", "")]
if "--link-scale" in args:
    common += ["--link-scale", option("--link-scale", "")]
flags = {
    "ring": ["--strategy", "ring", "--layout", "zigzag"],
    "all-gather": ["--strategy", "all-gather"],
    "ulysses": ["--strategy", "ulysses"],
    "usp": ["--strategy", "usp", "--ulysses-degree", "2"],
    "dcp": ["--strategy", "dcp", "--block", "128"],
    # DCP placing 2 head units (one kv head each) apart; tokens stay on their token homes
    "dcp-units2": ["--strategy", "dcp", "--block", "128", "--head-units", "2"],
}

failures = []
print(f"{'strategy':<11} {'mask':<14} {'scale':>7} {'measured ms':>12} {'predicted ms':>13} "
      f"{'pred/meas':>9} {'fwd meas':>9} {'fwd pred':>9} {'err':>8}")
for mask in masks:
    for strategy in strategies:
        command = [binary, *flags[strategy], "--mask", mask, *common]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"{' '.join(command)} failed:\n{done.stderr}")
        run = json.loads(done.stdout)
        measured, predicted = run["measured_attention_ms"], run["predicted_attention_ms"]
        ratio = predicted / measured
        error = max(run["max_rel_err"].values())
        print(f"{strategy:<11} {mask:<14} {run['link_scale']:>7.0f} {measured:>12.1f} "
              f"{predicted:>13.1f} {ratio:>9.2f} {run['timings_ms']['cp_forward']:>9.1f} "
              f"{run['predicted_forward_ms']:>9.1f} {error:>8.1e}", flush=True)
        if not 0.75 <= ratio <= 1.25:
            failures.append(f"{strategy} {mask}: predicted/measured {ratio:.2f}")
        if error > 1e-4:
            failures.append(f"{strategy} {mask}: max relative error {error:.1e}")
if "--check" in args and failures:
    sys.exit("outside 0.75-1.25 (or not exact): " + "; ".join(failures))
