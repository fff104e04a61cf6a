#!/usr/bin/env bash
# Builds the GPU checks here (no GPU needed) and packs them for a machine with an NVIDIA GPU:
# the kernels' CUDA tests (tests/cube_cuda.rs), the NCCL tests (burn-dcp/tests/nccl.rs), the
# tools cp_attention and step_batches, the examples gpt_longctx and attention_tflops and the benchmark, release profile, feature `cuda` only
# (no MPI: the GPU machine has no OpenMPI), stripped. Then `scripts/gpu_check.sh DIR` there.
#
# Usage: scripts/gpu_bundle.sh [DIR]   (default .gpu, which .gitignore ignores: carry it to the GPU)
# Environment: CARGO_TARGET_DIR (default target/gpu: its own directory, so the CI build's
# debug artifacts are untouched).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.gpu}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/gpu}
# FEATURES=cuda,autotune builds with burn-cubecl's autotune (burn-dcp's feature `autotune`).
# gpu-tests: the GPU-only test binaries (cube_cuda, nccl), which no other build makes.
features=${FEATURES:-cuda},gpu-tests
export CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=true
tests=(cargo test --release -p burn-dcp-suite -p burn-dcp-kernels -p burn-dcp
  --features "$features" --test cube_cuda --test nccl --no-run)
# The examples as programs (`cargo test --example` would build their test harness).
programs=(cargo build --release -p burn-dcp-suite -p burn-dcp-tools --features "$features"
  --bin cp_attention --bin step_batches --bin op_times --example gpt_longctx --example attention_tflops --bench attention)
"${tests[@]}"
"${programs[@]}"
rm -rf "$dir" && mkdir -p "$dir/bin"
# Each artifact's executable under its target's name (cube_cuda, nccl, cp_attention, …).
{ "${tests[@]}" --message-format=json; "${programs[@]}" --message-format=json; } 2>/dev/null | python3 -c '
import json, shutil, sys
dest = sys.argv[1]
for line in sys.stdin:
    message = json.loads(line)
    exe = message.get("executable")
    if message.get("reason") == "compiler-artifact" and exe:
        name = message["target"]["name"]
        shutil.copy(exe, f"{dest}/{name}")
        print(name, exe)
' "$dir/bin"
cp scripts/gpu_check.sh scripts/check_wgpu.py scripts/gpu_attention.py scripts/gpu_training.py \
  scripts/torch_train.py scripts/torch_ops.py scripts/gpu_breakdown.py "$dir/"
tar -C "$dir" -cJf "$dir/bins.tar.xz" bin && rm -rf "$dir/bin"
du -sh "$dir"
