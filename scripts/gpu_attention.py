#!/usr/bin/env python3
"""Issue 47's side-by-side on one GPU, in one run: our flash kernels and burn's `attention` (examples/attention_tflops, one process each, so that one running out of
memory loses only its own lines) and torch's scaled_dot_product_attention on its flash backend
(here, in this process), bf16, on 1 x 32 heads x 8192 x 128 (causal, full) and GQA 32/8 heads x
16384 (causal), forward and forward + backward. TFLOP/s by FlashAttention's FLOP count.

Writes OUT_DIR/<date>-<gpu>.json: a list, one object per shape x pass, with `shape`, `pass`,
`ours_tflops`, `torch_flash_tflops`, `burn_tflops` (null where a side could not run; its error under `errors`), the milliseconds behind them and the ratios; prints the
table for benches/RESULTS.md.

    python3 scripts/gpu_attention.py BIN_DIR [OUT_DIR] [--reps N]
"""
import datetime, json, os, subprocess, sys

SHAPES = {
    "causal-1x8192-h32-d128": dict(tokens=8192, heads=32, kv_heads=32, dim=128, causal=True),
    "full-1x8192-h32-d128": dict(tokens=8192, heads=32, kv_heads=32, dim=128, causal=False),
    "gqa-causal-1x16384-h32k8-d128": dict(tokens=16384, heads=32, kv_heads=8, dim=128, causal=True),
}
PASSES = {"forward": 1.0, "forward+backward": 3.5}
KEYS = {"ours": "ours_tflops", "burn": "burn_tflops", "torch": "torch_flash_tflops"}


def flops(shape, factor):
    s = SHAPES[shape]
    f = 4.0 * s["tokens"] ** 2 * s["heads"] * s["dim"]
    return (f / 2 if s["causal"] else f) * factor


def ours(binary, impl, reps, limit, env=None, label=None):
    lines = []
    try:
        done = subprocess.run([binary, "--impl", impl, "--reps", str(reps)], capture_output=True,
                              text=True, timeout=limit, env={**os.environ, **(env or {})})
        out, err, code = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err, code = f"timed out after {limit} s", "timeout"
    for line in out.splitlines():
        if line.startswith("{"):
            lines.append(json.loads(line))
            if label:
                lines[-1]["impl"] = label
    if code != 0:
        print(f"{impl}: exit {code}: {err[-2000:]}", file=sys.stderr)
    return lines


def torch_flash(reps):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def timed(fn, warmup=3):
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        times.sort()
        return times[len(times) // 2], times[0]

    lines = []
    for name, s in SHAPES.items():
        t, h, kh, d = s["tokens"], s["heads"], s["kv_heads"], s["dim"]
        gen = torch.Generator(device="cuda").manual_seed(0)
        rand = lambda heads: (torch.rand(1, heads, t, d, device="cuda", generator=gen) * 2 - 1).to(torch.bfloat16)
        q, k, v, dout = rand(h), rand(kh), rand(kh), rand(h)
        gqa = "native"

        def sdpa(q, k, v):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=s["causal"], enable_gqa=h != kh)

        try:
            sdpa(q, k, v)
        except RuntimeError as e:
            # The flash backend without GQA support: kv heads repeated.
            print(f"torch {name}: enable_gqa refused on the flash backend ({e}); kv heads repeated", file=sys.stderr)
            k, v = k.repeat_interleave(h // kh, dim=1), v.repeat_interleave(h // kh, dim=1)
            gqa = "repeated"
            kh = h
        for pass_name, fn in [
            ("forward", lambda: sdpa(q, k, v)),
            ("forward+backward", None),
        ]:
            if fn is None:
                qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

                def fn():
                    out = sdpa(qg, kg, vg)
                    out.backward(dout)
            try:
                ms, ms_min = timed(fn)
                lines.append(dict(shape=name, pass_=pass_name, impl="torch", ms=ms, ms_min=ms_min,
                                  tflops=flops(name, PASSES[pass_name]) / (ms * 1e-3) / 1e12, gqa=gqa))
            except Exception as e:  # noqa: BLE001 — recorded, the run goes on
                lines.append(dict(shape=name, pass_=pass_name, impl="torch", error=str(e)[:500]))
    for line in lines:
        line["pass"] = line.pop("pass_")
    return lines, torch.__version__, torch.cuda.get_device_name()


def main():
    import argparse
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bins", help="the folder holding attention_tflops")
    parser.add_argument("out_dir", nargs="?", default=os.environ.get("OUT", "."))
    parser.add_argument("--reps", type=int, default=20)
    a = parser.parse_args()
    bins, out_dir, reps = a.bins, a.out_dir, a.reps
    results = []
    binary = os.path.join(bins, "attention_tflops")
    for impl, limit in [("ours", 150), ("burn", 200)]:
        results += ours(binary, impl, reps, limit)
    # Ours with the cube size pinned (no measuring at run time: `ours` picks the forward's
    # per shape), in the same run (reported under `ours_variants`).
    variants = {
        "ours-planes4": {"BURN_DCP_FLASH_PLANES": "4"},
        "ours-planes8": {"BURN_DCP_FLASH_PLANES": "8"},
    }
    for label, env in variants.items():
        results += ours(binary, "ours", reps, 150, env, label)
    torch_lines, torch_version, gpu = torch_flash(reps)
    results += torch_lines
    for line in results:
        print(json.dumps(line), file=sys.stderr)
    rows = []
    for shape in SHAPES:
        for pass_name in PASSES:
            row = {"shape": shape, "pass": pass_name}
            errors = {}
            for impl, key in KEYS.items():
                found = [r for r in results if r["shape"] == shape and r["pass"] == pass_name and r["impl"] == impl]
                row[key] = round(found[0]["tflops"], 2) if found and "tflops" in found[0] else None
                row[key.replace("_tflops", "_ms")] = round(found[0]["ms"], 3) if found and "ms" in found[0] else None
                if found and "error" in found[0]:
                    errors[impl] = found[0]["error"]
                if impl == "torch" and found and "gqa" in found[0]:
                    row["torch_gqa"] = found[0]["gqa"]
            row["ours_variants"] = {
                label: next((round(r["tflops"], 2) for r in results if r["impl"] == label and r["shape"] == shape
                             and r["pass"] == pass_name and "tflops" in r), None) for label in variants}
            ours_t, torch_t, burn_t = row["ours_tflops"], row["torch_flash_tflops"], row["burn_tflops"]
            row["ours_vs_torch_flash"] = round(ours_t / torch_t, 3) if ours_t and torch_t else None
            row["ours_vs_burn"] = round(ours_t / burn_t, 3) if ours_t and burn_t else None
            if errors:
                row["errors"] = errors
            rows.append(row)
    date = datetime.date.today().isoformat()
    slug = gpu.lower().replace("nvidia", "").strip().split()[0] if gpu else "gpu"
    path = os.path.join(out_dir, f"{date}-{slug}.json")
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
        f.write("\n")
    print(f"# {gpu}, torch {torch_version}, bf16, median of {reps}; written to {path}")
    print("| shape | pass | ours | torch flash | burn | ours/torch | ours/burn |")
    print("|---|---|---|---|---|---|---|")
    fmt = lambda x: "—" if x is None else f"{x}"
    for r in rows:
        print(f"| {r['shape']} | {r['pass']} | {fmt(r['ours_tflops'])} | {fmt(r['torch_flash_tflops'])} | "
              f"{fmt(r['burn_tflops'])} | {fmt(r['ours_vs_torch_flash'])} | "
              f"{fmt(r['ours_vs_burn'])} |")


if __name__ == "__main__":
    main()
