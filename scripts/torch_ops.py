#!/usr/bin/env python3
"""The operations op_times times (a training step's, at a model's shapes), timed in PyTorch on
the GPU the same way: median of --reps runs after --warmup, the device waited for after each.

    python3 scripts/torch_ops.py --model-size llama-1b [--json]
"""
import argparse
import json
import time

import torch

PRESETS = {  # hidden, layers, heads, kv heads, MLP, vocabulary (models/src/presets.rs)
    "llama-125m": (768, 12, 12, 4, 2048, 32000),
    "llama-350m": (1024, 24, 16, 8, 2816, 32000),
    "llama-1b": (2048, 16, 32, 8, 8192, 128256),
}


def timed(op, warmup, reps):
    for _ in range(warmup):
        op()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        op()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    return sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-size", default="llama-125m", choices=PRESETS)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    d, _, heads, kv, ff, vocab = PRESETS[args.model_size]
    hd = d // heads
    t = args.seq_len
    dev, dt = "cuda", torch.bfloat16
    rnd = lambda *s: torch.randn(*s, device=dev, dtype=dt)
    ops = []
    for name, n_in, n_out in [("q", d, heads * hd), ("k/v", d, kv * hd), ("o", heads * hd, d),
                              ("gate/up", d, ff), ("down", ff, d), ("lm head", d, vocab)]:
        x, w, dy = rnd(1, t, n_in), rnd(1, n_in, n_out), rnd(1, t, n_out)
        flops = 2.0 * t * n_in * n_out
        for label, op in [("x·W", lambda: x @ w), ("dY·Wᵀ", lambda: dy @ w.transpose(1, 2)),
                          ("Xᵀ·dY", lambda: x.transpose(1, 2) @ dy)]:
            ms = timed(op, args.warmup, args.reps)
            ops.append({"op": f"matmul {name} {label}", "ms": ms, "rate": flops / ms / 1e9, "unit": "TFLOP/s"})
    h = rnd(1, t, d)
    norm = torch.nn.RMSNorm(d, eps=1e-5, device=dev, dtype=dt)
    a, b = rnd(1, t, ff), rnd(1, t, ff)
    logits = rnd(1, t, vocab)
    weight = torch.randn(ff, d, device=dev)
    for name, moved, op in [
        ("rmsnorm [T, d]", 2 * t * d * 2, lambda: norm(h)),
        ("silu(a)·b [T, ff]", 3 * t * ff * 2, lambda: torch.nn.functional.silu(a) * b),
        ("residual add [T, d]", 3 * t * d * 2, lambda: h + h),
        ("cast + log_softmax [T, V]", t * vocab * 6, lambda: torch.log_softmax(logits.float(), -1)),
        ("cast f32→bf16 [ff, d]", ff * d * 6, lambda: weight.to(dt)),
    ]:
        ms = timed(op, args.warmup, args.reps)
        ops.append({"op": name, "ms": ms, "rate": moved / ms / 1e6, "unit": "GB/s"})
    if args.json:
        print(json.dumps({"framework": f"torch {torch.__version__}", "model": args.model_size,
                          "seq_len": t, "ops": ops}))
    else:
        for o in ops:
            print(f"{o['op']:<32} {o['ms']:>9.3f} ms {o['rate']:>9.1f} {o['unit']}")


if __name__ == "__main__":
    main()
