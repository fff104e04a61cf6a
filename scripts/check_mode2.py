#!/usr/bin/env python3
"""Mode 2 of cp_attention on inputs written by numpy, checked against an independent numpy oracle.

Writes random q, k, v, dout and cu_seqlens (ragged, GQA) with numpy + safetensors, runs
`cp_attention --inputs IN --output OUT` for each strategy, and compares out, lse, dq, dk, dv with a
dense float64 numpy implementation of masked attention and its gradients.

Usage: python3 scripts/check_mode2.py [CARGO_RUN_PREFIX...]
(default prefix: cargo run -q -p burn-dcp-tools --bin cp_attention --)
Needs: pip install numpy safetensors
"""
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file


def allowed(mask, i, j, n):
    """The mask rule as the issue writes it."""
    if mask == "full":
        return True
    if mask == "causal":
        return j <= i
    kind, args = mask.split(":")
    p = args.split(",")
    if kind == "sliding":
        return i - int(p[0]) < j <= i
    if kind == "lambda":
        s, w = int(p[0]), int(p[1])
        return j <= i and (j < s or i - w < j)
    if kind == "blockwise":
        # DCP's causal-blockwise: causal in the first and last block; otherwise the first block
        # (a sink) and a window of l*b tokens: [max(b, i - l*b), i].
        b, l = int(p[0]), int(p[1])
        blocks = -(-n // b)
        if i // b in (0, blocks - 1):
            return j <= i
        return j <= i and (j < b or j >= max(b, i - l * b))
    if kind == "shared-question":
        f, a = float(p[0]), int(p[1])
        q = math.floor(f * n)
        alen = (n - q) // a

        def answer(x):
            if x < q:
                return None
            return a - 1 if alen == 0 else min((x - q) // alen, a - 1)

        ai, aj = answer(i), answer(j)
        if ai is None and aj is None:
            return j <= i
        if ai is None:
            return False
        if aj is None:
            return True
        return ai == aj and j <= i
    raise ValueError(mask)


def reference(q, k, v, dout, cu, mask):
    """Dense float64 attention per sequence and head, with gradients of sum(out * dout)."""
    t, h, d = q.shape
    kh = k.shape[1]
    g = h // kh
    scale = 1.0 / math.sqrt(d)
    q, k, v, dout = (x.astype(np.float64) for x in (q, k, v, dout))
    out = np.zeros((t, h, v.shape[2]))
    lse = np.full((h, t), -np.inf)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for s in range(len(cu) - 1):
        a, b = cu[s], cu[s + 1]
        n = b - a
        if n == 0:
            continue
        m = np.array([[allowed(mask, i, j, n) for j in range(n)] for i in range(n)])
        for head in range(h):
            kv = head // g
            qs, ks, vs, do = q[a:b, head], k[a:b, kv], v[a:b, kv], dout[a:b, head]
            scores = np.where(m, scale * qs @ ks.T, -np.inf)
            mx = scores.max(axis=1, keepdims=True)
            mx = np.where(np.isfinite(mx), mx, 0.0)
            e = np.where(m, np.exp(scores - mx), 0.0)
            z = e.sum(axis=1, keepdims=True)
            p = np.divide(e, z, out=np.zeros_like(e), where=z > 0)
            out[a:b, head] = p @ vs
            with np.errstate(divide="ignore"):
                lse[head, a:b] = np.where(z[:, 0] > 0, mx[:, 0] + np.log(z[:, 0]), -np.inf)
            dp = do @ vs.T
            ds = p * (dp - (p * dp).sum(axis=1, keepdims=True))
            dq[a:b, head] += scale * ds @ ks
            dk[a:b, kv] += scale * ds.T @ qs
            dv[a:b, kv] += p.T @ do
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def rel_err(got, want):
    finite = np.isfinite(want)
    if not np.array_equal(np.isfinite(got), finite) or not np.array_equal(got[~finite], want[~finite]):
        return float("inf")
    scale = np.abs(want[finite]).max() if finite.any() else 0.0
    diff = np.abs(got[finite] - want[finite]).max() if finite.any() else 0.0
    return diff / scale if scale > 0 else diff


def main():
    prefix = sys.argv[1:] or ["cargo", "run", "-q", "-p", "burn-dcp-tools", "--bin", "cp_attention", "--"]
    rng = np.random.default_rng(5)
    seqlens = [70, 3, 41, 1, 25]
    cu = np.concatenate([[0], np.cumsum(seqlens)]).astype(np.int64)
    t, h, kh, d = int(cu[-1]), 4, 2, 16
    tensors = {
        "q": rng.standard_normal((t, h, d), dtype=np.float32),
        "k": rng.standard_normal((t, kh, d), dtype=np.float32),
        "v": rng.standard_normal((t, kh, d), dtype=np.float32),
        "dout": rng.standard_normal((t, h, d), dtype=np.float32),
        "cu_seqlens": cu,
    }
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        inputs = Path(tmp) / "in.safetensors"
        save_file(tensors, str(inputs))
        runs = [
            ("ring", "zigzag", "causal", []),
            ("ulysses", "contiguous", "lambda:4,9", []),
            ("all-gather", "stripe", "sliding:7", []),
            ("usp", "zigzag", "shared-question:0.2,4", ["--ulysses-degree", "2"]),
            # a DCP block plan (the layout is unused: the plan places the tokens)
            ("dcp", "zigzag", "blockwise:3,2", ["--block", "8", "--nodes", "2"]),
        ]
        for strategy, layout, mask, extra in runs:
            output = Path(tmp) / f"{strategy}.safetensors"
            cmd = prefix + ["--strategy", strategy, "--layout", layout, "--cp", "4", "--mask", mask,
                            "--inputs", str(inputs), "--output", str(output), "--json", *extra]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            got = load_file(str(output))
            want = reference(tensors["q"], tensors["k"], tensors["v"], tensors["dout"], cu, mask)
            errors = {name: rel_err(got[name].astype(np.float64), want[name]) for name in want}
            print(f"{strategy:<10} {layout:<10} {mask:<22} " + " ".join(f"{n}={e:.1e}" for n, e in errors.items()))
            worst = max(worst, *errors.values())
    print(f"worst max_rel_err {worst:.2e}")
    if not worst <= 1e-5:
        sys.exit(f"FAILED: max_rel_err {worst:.2e} > 1e-5")
    print("mode 2 check passed")


if __name__ == "__main__":
    main()
