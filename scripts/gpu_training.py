#!/usr/bin/env python3
"""gpu_check.sh step 9: burn-dcp's training step against Hugging Face transformers + PyTorch on
the same GPU, the same Llama-shaped model, the same initial weights and the same tokens.

    python3 gpu_training.py BIN_DIR OUT_DIR [--models llama-125m llama-1b] [--seq-len 8192]

For each model: `step_batches` writes the run's micro-batches and its initial weights (an HF
checkpoint, f32); `gpt_longctx --backend cuda --precision bf16 --cp 1` trains them (fused, then
--no-fusion), `scripts/torch_train.py` trains the checkpoint on the same batches
(`LlamaForCausalLM`, sdpa, bf16 autocast, fused AdamW); then cp 4 (threads on the one GPU,
ring-zigzag) for the first model. Every run has its own time limit; what did not finish is
recorded as such. Writes OUT_DIR/training.json: one object per model x seq-len with the keys of
the training issue (model, parameters, seq_len, precision, ours_tokens_per_s, torch_tokens_per_s,
ours_mfu, torch_mfu, ours_peak_gpu_gib, torch_peak_gpu_gib, ours_losses, torch_losses) and the
rest of what was measured; and prints the table.
"""
import argparse
import json
import os
import subprocess
import sys
import time

# Dense bf16 tensor-core peak of an H100/H200 SXM (NVIDIA's datasheet, without sparsity).
PEAK_BF16 = 989e12
CONFIGS = {  # hidden, layers, heads (for attention's FLOPs)
    "llama-125m": (768, 12, 12),
    "llama-350m": (1024, 24, 16),
    "llama-1b": (2048, 16, 32),
}


def run(cmd, limit, log):
    started = time.time()
    print("$", " ".join(cmd), flush=True)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as e:
        log.write(f"$ {' '.join(cmd)}\nTIMEOUT after {limit}s\n{e.stderr or ''}\n")
        print(f"  timed out after {limit}s", flush=True)
        return None
    log.write(f"$ {' '.join(cmd)}\nexit {done.returncode} in {time.time() - started:.1f}s\n"
              f"{done.stderr[-6000:]}\n")
    log.flush()
    if done.returncode != 0:
        print(f"  exit {done.returncode}: {done.stderr.strip()[-600:]}", flush=True)
        return None
    print(f"  ok in {time.time() - started:.1f}s", flush=True)
    lines = [l for l in done.stdout.strip().splitlines() if l.strip()]
    try:
        return json.loads(done.stdout) if done.stdout.lstrip().startswith("{\n") else json.loads(lines[-1])
    except (json.JSONDecodeError, IndexError):
        return {"stdout": done.stdout[-2000:]}


def steady(step_ms, tokens_per_step, warmup):
    timed = step_ms[warmup:] if len(step_ms) > warmup else step_ms[-1:]
    return tokens_per_step * len(timed) / (sum(timed) / 1e3)


def mfu(tokens_per_s, parameters, model, seq_len):
    hidden, layers, _ = CONFIGS[model]
    per_token = 6 * parameters + 6 * layers * hidden * seq_len  # causal attention: half of 12·L·d·T
    return tokens_per_s * per_token / PEAK_BF16


def write(out, rows):
    with open(os.path.join(out, "training.json"), "w") as f:
        json.dump(rows, f, indent=1)


def row_of(model, args, ours, torch_run):
    row = {"model": model, "seq_len": args.seq_len, "precision": "bf16",
           "device": (torch_run or {}).get("device"), "lr": args.lr}
    parameters = (ours or {}).get("parameters") or (torch_run or {}).get("parameters")
    row["parameters"] = parameters
    if ours and "step_ms" in ours:
        row["ours_tokens_per_s"] = steady(ours["step_ms"], args.seq_len, args.warmup)
        row["ours_mfu"] = mfu(row["ours_tokens_per_s"], parameters, model, args.seq_len)
        row["ours_peak_gpu_gib"] = (ours.get("peak_gpu_memory_mb") or 0) / 1024
        row["ours_losses"] = ours["losses"]
        row["ours_step_ms"] = ours["step_ms"]
        row["ours_backend"] = ours.get("backend")
        row["ours_phases_ms"] = ours.get("phases_ms")
    if torch_run and "losses" in torch_run:
        row["torch_tokens_per_s"] = torch_run["tokens_per_second"]
        row["torch_mfu"] = mfu(row["torch_tokens_per_s"], parameters, model, args.seq_len)
        row["torch_peak_gpu_gib"] = torch_run["peak_gpu_reserved_gib"]
        row["torch_peak_gpu_allocated_gib"] = torch_run["peak_gpu_allocated_gib"]
        row["torch_losses"] = torch_run["losses"]
        row["torch_step_ms"] = torch_run["step_ms"]
    if "ours_losses" in row and "torch_losses" in row:
        row["max_rel_loss_diff"] = max(abs(a - b) / abs(b) for a, b in zip(row["ours_losses"], row["torch_losses"]))
        row["tokens_per_s_ratio"] = row["ours_tokens_per_s"] / row["torch_tokens_per_s"]
        row["peak_gpu_ratio"] = row["ours_peak_gpu_gib"] / row["torch_peak_gpu_gib"]
    return row


def model_arguments(parser):
    """BIN_DIR OUT_DIR, the models, their length and the corpus: what every GPU step that trains
    the presets takes (gpu_breakdown.py too)."""
    parser.add_argument("bin")
    parser.add_argument("out")
    parser.add_argument("--models", nargs="+", default=["llama-125m", "llama-1b"])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--corpus", default="/tmp/gpu_training_corpus")


def main():
    parser = argparse.ArgumentParser()
    model_arguments(parser)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--limit", type=int, default=200, help="seconds per run")
    parser.add_argument("--extras", nargs="*", default=["cp4", "no-fusion"],
                        help="runs after every model's pair, on the first model: cp4, no-fusion")
    args = parser.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "training.log"), "a")
    # One document of text (this repository's sources when they are here, else the bundle's
    # scripts), byte tokens: every micro-batch is one sequence of --seq-len tokens.
    os.makedirs(args.corpus, exist_ok=True)
    with open(os.path.join(args.corpus, "all.txt"), "w") as out:
        root = os.path.dirname(here) if os.path.isdir(os.path.join(os.path.dirname(here), "burn-dcp")) else here
        for dirpath, _, names in sorted(os.walk(root)):
            if "/target" in dirpath or "/.git" in dirpath:
                continue
            for name in sorted(names):
                if name.endswith((".rs", ".md", ".py", ".sh")):
                    with open(os.path.join(dirpath, name), errors="replace") as f:
                        out.write(f.read())
    common = ["--corpus", args.corpus, "--seq-len", str(args.seq_len), "--micro-batches", "1",
              "--steps", str(args.steps), "--seed", "0", "--lr", str(args.lr), "--adam-eps", "1e-5",
              "--weight-decay", "1e-4"]
    rows = []
    fusion = True  # off for the later models once a fused run failed
    runs = {}
    for model in args.models:
        work = f"/tmp/gpu_training_{model}"
        batches = f"{work}.json"
        made = run([f"{args.bin}/step_batches", "--model-size", model, *common, "--out", batches,
                    "--export-init", work], args.limit, log)
        if made is None:
            rows.append({"model": model, "seq_len": args.seq_len, "error": "step_batches failed"})
            continue
        gpt = [f"{args.bin}/gpt_longctx", "--backend", "cuda", "--precision", "bf16",
               "--model-size", model, *common, "--json"]
        ours = run([*gpt, "--cp", "1", *([] if fusion else ["--no-fusion"])], args.limit, log)
        if ours is None and fusion:
            fusion = False
            print("  the fused run failed: --no-fusion from here on", flush=True)
        torch_run = run([sys.executable, f"{here}/torch_train.py", "--checkpoint", work, "--batches",
                         batches, "--lr", str(args.lr), "--eps", "1e-5", "--weight-decay", "1e-4",
                         "--warmup", str(args.warmup)], args.limit, log)
        runs[model] = (gpt, ours, torch_run)
        rows.append(row_of(model, args, ours, torch_run))
        write(args.out, rows)
    first = args.models[0]
    if first in runs and runs[first][1]:
        gpt, ours, _ = runs[first]
        row = rows[0]
        if "cp4" in args.extras:
            cp4 = run([*gpt, "--cp", "4", "--strategy", "ring-zigzag", *([] if fusion else ["--no-fusion"])],
                      args.limit, log)
            if cp4 and "step_ms" in cp4:
                row["ours_cp4_tokens_per_s"] = steady(cp4["step_ms"], args.seq_len, args.warmup)
                row["ours_cp4_losses"] = cp4["losses"]
                row["cp4_vs_cp1_max_rel"] = max(abs(a - b) / abs(b) for a, b in zip(cp4["losses"], ours["losses"]))
                write(args.out, rows)
        if "no-fusion" in args.extras and fusion:
            plain = run([*gpt, "--cp", "1", "--no-fusion"], args.limit, log)
            if plain and "step_ms" in plain:
                row["ours_no_fusion_tokens_per_s"] = steady(plain["step_ms"], args.seq_len, args.warmup)
                row["ours_no_fusion_peak_gpu_gib"] = (plain.get("peak_gpu_memory_mb") or 0) / 1024
                row["ours_no_fusion_losses"] = plain["losses"]
                write(args.out, rows)
    print("\nmodel | params | seq | ours tok/s | torch tok/s | ratio | ours MFU | torch MFU | ours GiB | torch GiB | loss rel diff")
    for r in rows:
        get = lambda k, fmt="{:.3g}": fmt.format(r[k]) if isinstance(r.get(k), (int, float)) else "-"
        print(" | ".join([r["model"], get("parameters"), str(r["seq_len"]), get("ours_tokens_per_s"),
                          get("torch_tokens_per_s"), get("tokens_per_s_ratio"), get("ours_mfu"),
                          get("torch_mfu"), get("ours_peak_gpu_gib"), get("torch_peak_gpu_gib"),
                          get("max_rel_loss_diff")]))
        for k in ("ours_no_fusion_tokens_per_s", "ours_cp4_tokens_per_s", "cp4_vs_cp1_max_rel"):
            if k in r:
                print(f"  {k}: {r[k]:.4g}")


if __name__ == "__main__":
    main()
