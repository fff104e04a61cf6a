#!/usr/bin/env python3
"""custom_model (a user's model of burn_dcp::nn drop-ins, trained through burn-dcp-train's public
engine): per-step losses at cp 4 (ring, Ulysses) and dp 2 x cp 2 equal cp 1's within 1e-5
relative; with --burn-nn (burn-nn's own attention) the run is refused with a message about
attention. With --prepare PREPARE_DATA (burn-dcp-tools' prepare_data), the repository's docs/
are written as byte tokens into a Megatron indexed dataset and a flat token file, and training
from each and from a blend of both (--data-path) gives cp 4's losses equal cp 1's too.

usage: check_custom_model.py target/release/examples/custom_model [--steps N] [--prepare PREPARE_DATA]
"""
import json
import os
import subprocess
import sys
import tempfile

binary = sys.argv[1]
steps = sys.argv[sys.argv.index("--steps") + 1] if "--steps" in sys.argv else "3"


def losses(*flags):
    out = subprocess.run(
        [binary, "--steps", steps, "--json", *flags],
        check=True, capture_output=True, text=True, timeout=900,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["losses"]


def same_as_cp1(data, variants):
    """cp 1's losses on `data` flags, then each variant's: equal within 1e-5 relative."""
    reference = losses("--cp", "1", *data)
    print(f"{' '.join(data) or 'corpus'} cp 1: {reference}")
    worst = 0.0
    for flags in variants:
        got = losses(*flags, *data)
        assert len(got) == len(reference), (flags, got)
        rel = max(abs(g - w) / abs(w) for g, w in zip(got, reference))
        worst = max(worst, rel)
        print(f"  {' '.join(flags)}: {got} (max rel {rel:.2e})")
        assert rel <= 1e-5, (flags, data, got, reference)
    return worst


worst = same_as_cp1([], (["--cp", "4"], ["--cp", "4", "--strategy", "ulysses"], ["--cp", "2", "--dp", "2"]))
if "--prepare" in sys.argv:
    prepare = sys.argv[sys.argv.index("--prepare") + 1]
    docs = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs")
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for layout in ("indexed", "flat"):
            out = subprocess.run(
                [prepare, "--input", docs, "--output-prefix", os.path.join(tmp, layout),
                 "--format", layout, "--tokenizer", "bytes", "--append-eod", "--eod-token", "0"],
                check=True, capture_output=True, text=True, timeout=300,
            )
            written = json.loads(out.stdout)
            print(f"prepare_data {layout}: {written['documents']} documents, {written['tokens']} tokens")
            paths[layout] = written["data_path"]
        eod = ["--eod-token", "0"]
        for data in (
            ["--data-path", paths["indexed"]],
            ["--data-path", paths["flat"], *eod],
            ["--data-path", "0.4", paths["indexed"], "0.6", paths["flat"], *eod],
        ):
            worst = max(worst, same_as_cp1(data, (["--cp", "4"], ["--cp", "2", "--dp", "2"])))
refused = subprocess.run(
    [binary, "--steps", "1", "--burn-nn"], capture_output=True, text=True, timeout=900
)
assert refused.returncode != 0, "burn-nn's attention was not refused"
assert "no attention call was intercepted" in refused.stderr and "burn_dcp::nn" in refused.stderr, refused.stderr
print(f"custom_model: losses equal cp 1 (worst {worst:.2e}); --burn-nn refused: {refused.stderr.strip()[:160]}...")
