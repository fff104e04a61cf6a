#!/usr/bin/env python3
"""Trains a Hugging Face checkpoint with transformers + PyTorch on the micro-batches of a
gpt_longctx run: what a user would pick instead of burn-dcp, for a side-by-side on one GPU.

    step_batches --model-size llama-125m --seq-len 8192 --micro-batches 1 --steps 10 \
        --out batches.json --export-init init/
    python3 scripts/torch_train.py --checkpoint init/ --batches batches.json --lr 3e-4 --json out.json

The model is `AutoModelForCausalLM.from_pretrained(checkpoint)` with `attn_implementation="sdpa"`
(torch's flash attention for causal masks), f32 master weights, bf16 autocast, fused
`torch.optim.AdamW` (decay on matrices only, as gpt_longctx's AdamW). Each step sums the
next-token cross-entropy over the labels >= 0 of its micro-batches, in f32, divided by the step's
label count (gpt_longctx's loss). A micro-batch of several sequences runs them one by one (each
its own causal attention, as the packed varlen kernels do); `--recompute` turns on transformers'
gradient checkpointing (every layer, as gpt_longctx's `--recompute block`).

Prints one JSON object: losses, step_ms, tokens_per_second (steps after --warmup), peak GPU
memory (torch's max reserved and allocated, GiB), the model's parameter count.
"""
import argparse
import json
import time

import torch


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--batches", required=True)
    parser.add_argument("--steps", type=int, default=None, help="default: every step of --batches")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    parser.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.999))
    parser.add_argument("--eps", type=float, default=1e-5)
    parser.add_argument("--precision", choices=["bf16", "f32"], default="bf16")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of tokens/s")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--recompute", action="store_true", help="gradient checkpointing")
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--device", default="cuda", help="cuda | cpu (a check of the losses, untimed)")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            args.checkpoint, dtype=torch.float32, attn_implementation="sdpa")
    except TypeError:
        model = AutoModelForCausalLM.from_pretrained(
            args.checkpoint, torch_dtype=torch.float32, attn_implementation="sdpa")
    model.to(device)
    model.train()
    if args.recompute:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    parameters = sum(p.numel() for p in model.parameters())
    forward = torch.compile(model) if args.compile else model
    # Decay on matrices only, as gpt_longctx (and Megatron-LM, nanoGPT, transformers' Trainer).
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=tuple(args.betas), eps=args.eps, fused=cuda)
    with open(args.batches) as f:
        data = json.load(f)
    steps = data["steps"][: args.steps] if args.steps else data["steps"]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")
    losses, step_ms, tokens = [], [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for step in steps:
        sync()
        started = time.perf_counter()
        batches = step["micro_batches"]
        labelled = sum(sum(1 for l in b["labels"] if l >= 0) for b in batches)
        total = torch.zeros((), device=device)
        for batch in batches:
            cu = batch["cu_seqlens"]
            ids = torch.tensor(batch["tokens"], device=device)
            pos = torch.tensor(batch["positions"], device=device)
            lab = torch.tensor(batch["labels"], device=device)
            for start, end in zip(cu[:-1], cu[1:]):
                with autocast:
                    logits = forward(input_ids=ids[None, start:end],
                                     position_ids=pos[None, start:end]).logits
                loss = torch.nn.functional.cross_entropy(
                    logits[0].float(), lab[start:end], ignore_index=-1, reduction="sum") / labelled
                loss.backward()
                total += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total.item())
        sync()
        step_ms.append((time.perf_counter() - started) * 1e3)
        tokens.append(sum(len(b["tokens"]) for b in batches))
    timed = slice(min(args.warmup, max(len(steps) - 1, 0)), None)
    seconds = sum(step_ms[timed]) / 1e3
    result = {
        "framework": f"transformers + torch {torch.__version__}",
        "parameters": parameters,
        "precision": args.precision,
        "compiled": args.compile,
        "recompute": args.recompute,
        "losses": losses,
        "step_ms": step_ms,
        "tokens_per_second": sum(tokens[timed]) / seconds if seconds > 0 else 0.0,
        "peak_gpu_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
        "peak_gpu_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
    }
    text = json.dumps(result)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
