#!/usr/bin/env bash
# The flash kernels' register budget without a GPU: dumps the CUDA C++ cubecl-cuda generates for
# the forward, dq and dk/dv kernels in bf16 and f16 at head dims 64 and 128 (the plans an H100
# gets; burn-dcp-kernels/tests/flash_cuda_source.rs), compiles each with NVRTC and ptxas for
# sm_80 and sm_90 (scripts/cuda-offline/ptx_report.py: NVRTC, ptxas and CUDA's headers from PyPI
# wheels, fetched once into ~/.cache/cuda-offline by its setup.sh; or $CUDA_OFFLINE_DIR's) and
# prints one JSON line per kernel build: registers, spill bytes, shared memory and the counts of
# mma.sync / ldmatrix / cp.async / wmma instructions; the pass is in the `kernel` field
# (flash_forward_*, flash_dq_*, flash_dkdv_*). Fails on any spill byte or on a kernel without
# mma.sync.
#
# Usage: scripts/cuda_report.sh [OUT_DIR]   (default target/cuda-report; the .cu files and the
# JSON lines, report.jsonl, are kept there). The test builds with CI's feature set (`--workspace
# --features mpi,wgpu,cuda`, so CI reuses its test build); CUDA_REPORT_CARGO_ARGS overrides it
# (e.g. `-p burn-dcp-kernels --features cuda`).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/cuda-report}
tools=${CUDA_OFFLINE_DIR:-scripts/cuda-offline}
if [ ! -x "$tools/ptx_report.py" ] && [ ! -f "$tools/ptx_report.py" ]; then
  echo "cuda_report: no ptx_report.py in $tools (set CUDA_OFFLINE_DIR)" >&2
  exit 2
fi
rm -rf "$out" && mkdir -p "$out"
cargo_args=${CUDA_REPORT_CARGO_ARGS:---workspace --features mpi,wgpu,cuda}
# The test binary of that build, found without building anything else: a `--test` filter would
# resolve other features and rebuild burn and cubecl (minutes of CI).
# shellcheck disable=SC2086
binary=$(cargo test $cargo_args --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    message = json.loads(line)
    if message.get("reason") == "compiler-artifact" and message["target"]["name"] == "flash_cuda_source" and message.get("executable"):
        print(message["executable"])
' | head -1)
if [ -z "$binary" ]; then
  echo "cuda_report: no flash_cuda_source test binary in the build of: cargo test $cargo_args" >&2
  exit 2
fi
BURN_DCP_DUMP_CUDA="$(pwd)/$out/kernels" "$binary" --quiet
bash "$tools/setup.sh" >/dev/null
# One NVRTC + ptxas job per core (each kernel's lines stay together, in file order).
jobs=$(nproc 2>/dev/null || echo 2)
# shellcheck disable=SC2016
printf '%s\0' "$out"/kernels.flash_*.cu |
  xargs -0 -P "$jobs" -I{} sh -c 'python3 "$1" "$2" --arch sm_80,sm_90 >"$2.jsonl"' _ "$tools/ptx_report.py" {}
cat "$out"/kernels.flash_*.cu.jsonl | tee "$out/report.jsonl"
python3 - "$out/report.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
bad = [r for r in rows if r.get("spill_stores", 0) or r.get("spill_loads", 0) or not r.get("mma_sync")]
passes = {p for r in rows for p in ("forward", "dq", "dkdv") if f"flash_{p}_" in r["kernel"]}
print(f"cuda_report: {len(rows)} kernel builds, passes {sorted(passes)}; "
      f"registers {min(r['registers'] for r in rows)}-{max(r['registers'] for r in rows)}; "
      f"{len(bad)} with spills or without mma.sync")
for r in bad:
    print("  FAIL", json.dumps(r))
if bad or len(rows) != 24 or len(passes) != 3:
    sys.exit(1)
PY
