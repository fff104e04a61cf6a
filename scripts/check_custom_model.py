#!/usr/bin/env python3
"""custom_model (a user's model of burn_dcp::nn drop-ins, trained through burn-dcp-train's public
engine): per-step losses at cp 4 (ring, Ulysses) and dp 2 x cp 2 equal cp 1's within 1e-5
relative; with --burn-nn (burn-nn's own attention) the run is refused with a message about
attention.

usage: check_custom_model.py target/release/examples/custom_model [--steps N]
"""
import json
import subprocess
import sys

binary = sys.argv[1]
steps = sys.argv[sys.argv.index("--steps") + 1] if "--steps" in sys.argv else "3"


def losses(*flags):
    out = subprocess.run(
        [binary, "--steps", steps, "--json", *flags],
        check=True, capture_output=True, text=True, timeout=900,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["losses"]


reference = losses("--cp", "1")
print(f"cp 1: {reference}")
worst = 0.0
for flags in (["--cp", "4"], ["--cp", "4", "--strategy", "ulysses"], ["--cp", "2", "--dp", "2"]):
    got = losses(*flags)
    assert len(got) == len(reference), (flags, got)
    rel = max(abs(g - w) / abs(w) for g, w in zip(got, reference))
    worst = max(worst, rel)
    print(f"{' '.join(flags)}: {got} (max rel {rel:.2e})")
    assert rel <= 1e-5, (flags, got, reference)
refused = subprocess.run(
    [binary, "--steps", "1", "--burn-nn"], capture_output=True, text=True, timeout=900
)
assert refused.returncode != 0, "burn-nn's attention was not refused"
assert "no attention call was intercepted" in refused.stderr and "burn_dcp::nn" in refused.stderr, refused.stderr
print(f"custom_model: losses equal cp 1 (worst {worst:.2e}); --burn-nn refused: {refused.stderr.strip()[:160]}...")
