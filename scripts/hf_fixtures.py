#!/usr/bin/env python3
"""Writes the Hugging Face fixtures of the checkpoint tests (tests/hf.rs): small random Llama,
Mistral (sliding window) and Qwen2 (q/k/v biases) checkpoints written by transformers'
`save_pretrained`, one byte-level BPE tokenizer, a flat token file, and what transformers computes
on those tokens: the logits of two sequences and the mean next-token loss of each window of the
token file (`labels=input_ids`). Committed under tests/fixtures/hf/ so that CI needs no torch.

    python3 scripts/hf_fixtures.py [--out tests/fixtures/hf]

Every weight is drawn normal (norm gains around 1, biases non-zero) from a fixed seed, in f32.
"""
import argparse
import json
import os

import numpy as np
import torch
from safetensors.torch import save_file

WINDOW = 24  # tokens per window of the token file (the tests' --seq-len)
WINDOWS = 3
TEXT = (
    "Long-context training splits each sequence across devices; attention is the one op that "
    "needs the whole sequence, so it must communicate. Ring attention passes keys and values "
    "around the ranks while Ulysses trades heads for tokens with two all-to-alls. "
) * 8

COMMON = dict(vocab_size=None, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
              max_position_embeddings=256, initializer_range=0.02)
MODELS = {
    "llama": ("LlamaConfig", dict(rope_theta=500000.0, tie_word_embeddings=True,
                                  rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 16})),
    "mistral": ("MistralConfig", dict(rope_theta=10000.0, tie_word_embeddings=False, sliding_window=8)),
    "qwen2": ("Qwen2Config", dict(rope_theta=1000000.0, tie_word_embeddings=False)),
}


def tokenizer(out):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    tok.save(os.path.join(out, "tokenizer.json"))
    return tok


# TRAIN's steps: every window in each step (so the order of windows in a step does not matter),
# the loss summed over their labels and divided by their count (gpt_longctx's loss), AdamW with
# decay on matrices only (gpt_longctx's, Megatron-LM's, nanoGPT's).
TRAIN = dict(steps=3, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def train(model, ids):
    model = model.train()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": TRAIN["weight_decay"]},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=TRAIN["lr"], betas=TRAIN["betas"], eps=TRAIN["eps"])
    windows = [torch.tensor([ids[w * WINDOW:(w + 1) * WINDOW]]) for w in range(WINDOWS)]
    losses = []
    for _ in range(TRAIN["steps"]):
        total = 0.0
        labels = WINDOWS * (WINDOW - 1)
        for window in windows:
            logits = model(input_ids=window).logits[0, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits, window[0, 1:], reduction="sum") / labels
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="tests/fixtures/hf")
    args = parser.parse_args()
    import transformers
    os.makedirs(args.out, exist_ok=True)
    tok = tokenizer(args.out)
    vocab = tok.get_vocab_size()
    eod = tok.token_to_id("<|endoftext|>")
    ids = tok.encode(TEXT).ids[: WINDOW * WINDOWS]
    assert len(ids) == WINDOW * WINDOWS and eod not in ids
    # nanoGPT's flat uint16 token file; --eod-token names an id absent from it: one document.
    np.array(ids, dtype=np.uint16).tofile(os.path.join(args.out, "tokens.bin"))
    sequences = [ids[:WINDOW], ids[WINDOW:WINDOW + 17]]
    manifest = {"transformers": transformers.__version__, "torch": torch.__version__,
                "window": WINDOW, "windows": WINDOWS, "eod_token": eod, "vocab_size": vocab,
                "train": TRAIN,
                "models": {}}
    for index, (name, (cls, extra)) in enumerate(MODELS.items()):
        torch.manual_seed(1000 + index)
        config = getattr(transformers, cls)(**{**COMMON, "vocab_size": vocab, **extra})
        model = getattr(transformers, cls.replace("Config", "ForCausalLM"))(config).float().eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                elif pname.endswith("bias"):
                    p.copy_(0.1 * torch.randn_like(p))
                else:
                    p.copy_(0.08 * torch.randn_like(p))
        directory = os.path.join(args.out, name)
        model.save_pretrained(directory, safe_serialization=True)
        tensors, losses = {}, []
        with torch.no_grad():
            for i, seq in enumerate(sequences):
                input_ids = torch.tensor([seq])
                tensors[f"input_ids_{i}"] = input_ids[0]
                tensors[f"logits_{i}"] = model(input_ids=input_ids).logits[0].float().contiguous()
            for w in range(WINDOWS):
                window = torch.tensor([ids[w * WINDOW:(w + 1) * WINDOW]])
                losses.append(model(input_ids=window, labels=window).loss.item())
        save_file(tensors, os.path.join(directory, "expected.safetensors"))
        manifest["models"][name] = {"class": model.__class__.__name__,
                                    "parameters": model.num_parameters(),
                                    "window_losses": losses,
                                    "mean_window_loss": sum(losses) / len(losses),
                                    "train_losses": train(model, ids)}
    with open(os.path.join(args.out, "expected.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    print(json.dumps(manifest, indent=1))


if __name__ == "__main__":
    main()
