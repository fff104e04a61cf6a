#!/usr/bin/env python3
"""Loads a checkpoint directory with transformers' AutoModelForCausalLM.from_pretrained (no
conversion) and prints, as one JSON object, its class and the f32 logits of the token ids given
(tests/training/hf.rs compares them with burn-dcp's on the same directory).

    python3 scripts/check_hf_export.py DIR 5,17,42,...
"""
import json
import sys

import torch
import transformers


def main():
    directory, ids = sys.argv[1], [int(t) for t in sys.argv[2].split(",")]
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    print(json.dumps({"class": model.__class__.__name__, "transformers": transformers.__version__,
                      "logits": logits.flatten().tolist()}))


if __name__ == "__main__":
    main()
