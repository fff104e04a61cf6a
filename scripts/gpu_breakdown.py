#!/usr/bin/env python3
"""gpu_check.sh step 10: where a training step's time goes on the GPU.

    python3 gpu_breakdown.py BIN_DIR OUT_DIR [--models llama-125m llama-1b] [--seq-len 8192]

For each model: op_times (burn-dcp's backend) and torch_ops.py (PyTorch) time the step's
operations one by one at its shapes; gpt_longctx --sync-phases runs a few steps waiting for the
device at each phase (forward until the loss is read, backward, gradient reduction, optimizer).
Writes OUT_DIR/breakdown.json and prints both tables side by side.
"""
import argparse
import json
import os
import subprocess
import sys

from gpu_training import model_arguments  # beside this script, in the bundle too


def run(cmd, limit):
    print("$", " ".join(cmd), flush=True)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-800:]
        print(f"  timed out after {limit}s: {tail.decode(errors='replace') if isinstance(tail, bytes) else tail}", flush=True)
        return None
    if done.returncode != 0:
        print(f"  exit {done.returncode}: {done.stderr.strip()[-800:]}", flush=True)
        return None
    text = done.stdout.strip()
    try:
        return json.loads(text[text.index("{"):])
    except ValueError:
        print(f"  no JSON in: {text[-400:]}", flush=True)
        return None


def main():
    parser = argparse.ArgumentParser()
    model_arguments(parser)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--limit", type=int, default=120)
    parser.add_argument("--no-phases", action="store_true", help="skip gpt_longctx --sync-phases")
    args = parser.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    if not os.path.isdir(args.corpus):
        os.makedirs(args.corpus)
        with open(os.path.join(args.corpus, "all.txt"), "w") as out:
            for name in sorted(os.listdir(here)):
                if name.endswith((".py", ".sh")):
                    out.write(open(os.path.join(here, name)).read() * 200)
    results = []
    for model in args.models:
        ours = run([f"{args.bin}/op_times", "--backend", "cuda", "--model-size", model,
                    "--seq-len", str(args.seq_len), "--json"], args.limit)
        torch_ops = run([sys.executable, f"{here}/torch_ops.py", "--model-size", model,
                         "--seq-len", str(args.seq_len), "--json"], args.limit)
        phases = None if args.no_phases else run([f"{args.bin}/gpt_longctx", "--backend", "cuda", "--precision", "bf16",
                      "--model-size", model, "--corpus", args.corpus, "--seq-len", str(args.seq_len),
                      "--micro-batches", "1", "--steps", str(args.steps), "--lr", "1e-4", "--cp", "1",
                      "--sync-phases", "--json"], args.limit)
        results.append({"model": model, "seq_len": args.seq_len, "op_times": ours,
                        "torch_ops": torch_ops, "sync_phases_summary": phases})
        with open(os.path.join(args.out, "breakdown.json"), "w") as f:
            json.dump(results, f, indent=1)
        if ours and torch_ops:
            theirs = {o["op"]: o for o in torch_ops["ops"]}
            print(f"\n{model}: op | ours ms | torch ms | ours/torch time | ours rate | torch rate")
            for o in ours["ops"]:
                t = theirs.get(o["op"])
                if t:
                    print(f"{o['op']:<30} {o['ms']:8.3f} {t['ms']:8.3f} {o['ms'] / t['ms']:6.2f}x "
                          f"{o['rate']:8.1f} {t['rate']:8.1f} {o['unit']}")
        if phases:
            print(f"{model} --sync-phases, ms per step:")
            for step in phases.get("phases_ms", []):
                print("  " + ", ".join(f"{k} {v:.1f}" for k, v in step.items() if isinstance(v, (int, float))))


if __name__ == "__main__":
    main()
