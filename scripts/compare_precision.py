#!/usr/bin/env python3
"""bf16 training against f32: gpt_longctx at the same seed and data in f32 and in
bf16 (`--precision bf16`: f32 master weights, bf16 forward/backward, attention accumulating in
f32, the loss in f32), on the CPU backend.

Checks, per step:
- every CP strategy at cp 4 in bf16 against cp 1 in bf16, relative loss difference ≤ 2.5e-2
  (TransformerEngine's bf16 tolerance for CP against one device);
- bf16 cp 1 against f32 cp 1, relative loss difference ≤ BF16_VS_F32 (the stated bound: bf16's
  unit roundoff 2⁻⁸ ≈ 3.9e-3 on every activation, over the run's steps);
- the CP bytes of bf16 at cp 4 (ring-zigzag) are half of f32's (ring sends no LSE).
Prints tokens/s, peak memory per rank and CP bytes of f32 and bf16 (the README's table).

Usage: python3 scripts/compare_precision.py [BIN] [--steps N]
(default BIN: target/release/examples/gpt_longctx; default 30 steps)
"""
import json
import subprocess
import sys

TE_BF16 = 2.5e-2
BF16_VS_F32 = 2e-2

args = sys.argv[1:]
binary = args[0] if args and not args[0].startswith("--") else "target/release/examples/gpt_longctx"
steps = args[args.index("--steps") + 1] if "--steps" in args else "30"
common = ["--steps", steps, "--seed", "7", "--seq-len", "2048", "--json"]


def run(*flags):
    out = subprocess.run([binary, *flags, *common], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def worst(got, want):
    assert len(got) == len(want), (len(got), len(want))
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


strategies = {
    "ring-zigzag": ["--strategy", "ring-zigzag"],
    "ulysses": ["--strategy", "ulysses"],
    "usp 2x2": ["--strategy", "usp", "--ulysses-degree", "2"],
    "all-gather": ["--strategy", "all-gather"],
    "dcp": ["--strategy", "dcp"],
    "dynamic": ["--strategy", "dynamic", "--max-tokens-per-rank", "512"],
}
failures = []
f32_cp1 = run("--cp", "1")
bf16_cp1 = run("--cp", "1", "--precision", "bf16")
drift = worst(bf16_cp1["losses"], f32_cp1["losses"])
print(f"bf16 cp1 vs f32 cp1      steps {len(bf16_cp1['losses'])}  max relative loss difference {drift:.2e} (bound {BF16_VS_F32:.0e})  final {bf16_cp1['final_loss']:.4f} vs {f32_cp1['final_loss']:.4f}")
if drift > BF16_VS_F32:
    failures.append("bf16 vs f32")
table = {}
for name, flags in strategies.items():
    got = run("--cp", "4", "--precision", "bf16", *flags)
    diff = worst(got["losses"], bf16_cp1["losses"])
    print(f"bf16 cp4 {name:<14} max relative loss difference vs bf16 cp1: {diff:.2e} (bound {TE_BF16:.1e})")
    if diff > TE_BF16:
        failures.append(f"bf16 cp4 {name}")
    if name == "ring-zigzag":
        table["bf16"] = got
table["f32"] = run("--cp", "4", "--strategy", "ring-zigzag")
cp = {p: table[p]["bytes_by_axis"]["cp"] for p in table}
print("\n| cp 4 ring-zigzag, 2048 tokens | tokens/s | peak memory per rank (MiB) | CP bytes |")
print("|---|---:|---:|---:|")
for precision in ("f32", "bf16"):
    summary = table[precision]
    peak = summary["peak_memory_mb"]
    print(f"| {precision} | {summary['tokens_per_second']:.0f} | {'—' if peak is None else f'{peak:.1f}'} | {cp[precision]} |")
ratio = cp["bf16"] / cp["f32"]
print(f"\nCP bytes bf16 / f32: {ratio:.4f}")
if ratio != 0.5:
    failures.append(f"CP bytes ratio {ratio}")
if failures:
    sys.exit("failed: " + ", ".join(failures))
