#!/usr/bin/env bash
# The GPU checks, on a machine with an NVIDIA GPU, CUDA (nvcc's headers, NVRTC) and NCCL, from a
# bundle that scripts/gpu_bundle.sh built elsewhere: no Rust toolchain needed here.
#   1. the kernels on CUDA against the f64 oracle: vector kernels (f32), the flash kernels on
#      tensor cores (f16, bf16), forward and backward (burn-dcp-kernels/tests/cube_cuda.rs);
#   2. NCCL: a world of one moves device tensors (burn-dcp/tests/nccl.rs; one GPU allows no more:
#      NCCL refuses two ranks on one device);
#   3. every CP strategy on CUDA (threads as ranks on the one GPU) against the CPU reference,
#      max_rel_err <= 1e-5 (scripts/check_wgpu.py --backend cuda);
#   4. gpt_longctx on CUDA: cp 4 (ring zigzag, ulysses, dcp) against cp 1, per-step loss <= 1e-4;
#   5. the benchmark group `cuda` (1 x 32 heads x 8192 x 128, bf16);
#   6. step 3 on the flash kernels' plain bodies (BURN_DCP_ATTENTION_KERNEL=flash-plain: f32);
#   7. the side-by-side: the flash kernels, burn's attention and torch's
#      flash attention, bf16, TFLOP/s (scripts/gpu_attention.py: $OUT/<date>-<gpu>.json);
#   8. bf16 training on CUDA: gpt_longctx --precision bf16 (the flash kernels) at cp 1
#      against f32 (relative loss <= 2e-2) and cp 4 (ring zigzag, ulysses, dcp) against bf16 cp 1
#      (<= 2.5e-2, TransformerEngine's bf16 bound); tokens/s, peak memory and CP bytes of each;
#   9. training side by side (scripts/gpu_training.py): llama-125m and llama-1b at 8192 tokens,
#      bf16, burn-dcp (fused, plain, cp 4 on threads) against transformers' LlamaForCausalLM
#      (sdpa, bf16 autocast, fused AdamW) from the same initial weights on the same tokens:
#      tokens/s, MFU, peak GPU memory, losses ($OUT/training.json);
#  10. where a step's time goes (scripts/gpu_breakdown.py): op_times and torch_ops.py time the
#      step's operations at the models' shapes; gpt_longctx --sync-phases ($OUT/breakdown.json).
# Each step has its own time limit; the log goes to $OUT/gpu_check.log (or /tmp) as it runs.
#
# Usage: scripts/gpu_check.sh [DIR] [STEP...]   (DIR default .gpu; steps default 1 2 3 4 5 8)
set -uo pipefail
dir=$(cd "${1:-.gpu}" && pwd)
shift || true
steps=${*:-1 2 3 4 5 8}
out=${OUT:-/tmp}
log=$out/gpu_check.log
exec > >(tee -a "$log") 2>&1
cd "$dir"
[ -d bin ] || tar xJf bins.tar.xz
bin=$dir/bin
nvidia-smi -L || { echo "no NVIDIA GPU"; exit 1; }
# CUDA's headers (cubecl-cuda compiles its kernels with NVRTC and includes them) and the
# libraries cudarc loads by name: libnvrtc.so*, libnccl.so* (cudarc asks for libnccl.so, not
# the .so.2 that NCCL's packages install).
nvcc=$(command -v nvcc || ls /usr/local/cuda*/bin/nvcc 2>/dev/null | head -1)
export CUDA_PATH=${CUDA_PATH:-$(dirname "$(dirname "$nvcc")")}
libs=/tmp/gpu_check_libs
mkdir -p $libs
for name in nvrtc nccl; do
  found=$(find "$CUDA_PATH"/lib64/ /usr/lib/x86_64-linux-gnu /usr/local /opt -name "lib$name.so*" \
    -not -name "*builtins*" 2>/dev/null | sort | head -1)
  echo "lib$name: ${found:-not found}"
  [ -n "$found" ] && ln -sf "$found" $libs/lib$name.so && export LD_LIBRARY_PATH=$libs:$(dirname "$found"):${LD_LIBRARY_PATH:-}
done
echo "CUDA_PATH=$CUDA_PATH"
status=0
step() { # step NAME SECONDS COMMAND...
  local name=$1 seconds=$2
  shift 2
  echo "=== $name (limit ${seconds}s) ==="
  local start=$SECONDS
  timeout "$seconds" "$@"
  local rc=$?
  echo "=== $name: exit $rc in $((SECONDS - start))s ==="
  [ $rc -eq 0 ] || status=1
}
for s in $steps; do
  case $s in
    1) step "kernels on CUDA" ${KERNEL_LIMIT:-300} "$bin/cube_cuda" --ignored --test-threads 1 ${CUBE_CUDA_FILTER:-} ;;
    2) step "NCCL world of one" 40 "$bin/nccl" --include-ignored --test-threads 1 ;;
    3) step "every strategy on CUDA" 120 python3 "$dir/check_wgpu.py" "$bin/cp_attention" --backend cuda ;;
    4) step "gpt_longctx on CUDA" 90 python3 - "$bin/gpt_longctx" <<'PY'
import json, subprocess, sys
binary = sys.argv[1]
common = ["--steps", "3", "--seed", "7", "--seq-len", "2048", "--corpus", "builtin", "--json"]
def losses(*flags):
    out = subprocess.run([binary, *flags, *common], check=True, capture_output=True, text=True).stdout
    summary = json.loads(out)
    print(" ".join(flags), "tokens/s", round(summary.get("tokens_per_second", 0.0), 1))
    return summary["losses"]
flex = losses("--cp", "1")
reference = losses("--backend", "cuda", "--cp", "1")
print("flex cp1", flex)
print("cuda cp1", reference)
worst = 0.0
for name, flags in {"cuda cp4 ring-zigzag": ["--cp", "4", "--strategy", "ring-zigzag"],
                    "cuda cp4 ulysses": ["--cp", "4", "--strategy", "ulysses"],
                    "cuda cp4 dcp": ["--cp", "4", "--strategy", "dcp"]}.items():
    got = losses("--backend", "cuda", *flags)
    rel = max(abs(a - b) / abs(b) for a, b in zip(got, reference))
    print(name, got, f"max rel vs cuda cp1 {rel:.2e}")
    worst = max(worst, rel)
print(f"cuda vs flex at cp1: max rel {max(abs(a - b) / abs(b) for a, b in zip(reference, flex)):.2e}")
sys.exit(0 if worst <= 1e-4 else f"cp 4 on CUDA differs from cp 1 by {worst:.2e} > 1e-4")
PY
       ;;
    6) step "every strategy on CUDA, flash kernels' plain bodies" 120 env BURN_DCP_ATTENTION_KERNEL=flash-plain \
         python3 "$dir/check_wgpu.py" "$bin/cp_attention" --backend cuda ;;
    5) step "benchmark group cuda" 150 "$bin/attention" --bench cuda --warm-up-time 1 --measurement-time 3 ;;
    8) step "bf16 training on CUDA" 150 python3 - "$bin/gpt_longctx" <<'PY'
import json, subprocess, sys
binary = sys.argv[1]
common = ["--backend", "cuda", "--steps", "5", "--seed", "7", "--seq-len", "8192", "--corpus", "builtin", "--json"]
def run(*flags):
    out = subprocess.run([binary, *flags, *common], check=True, capture_output=True, text=True).stdout
    summary = json.loads(out)
    print(" ".join(flags), "tokens/s", round(summary["tokens_per_second"], 1), "peak MB", summary.get("peak_memory_mb"),
          "cp bytes", summary["bytes_by_axis"]["cp"], "losses", summary["losses"])
    return summary
def worst(got, want):
    return max(abs(a - b) / abs(b) for a, b in zip(got["losses"], want["losses"]))
f32 = run("--cp", "1")
bf16 = run("--cp", "1", "--precision", "bf16")
failures = []
drift = worst(bf16, f32)
print(f"bf16 vs f32 at cp 1: max rel {drift:.2e} (bound 2e-2)")
if drift > 2e-2:
    failures.append("bf16 vs f32")
for name in ("ring-zigzag", "ulysses", "dcp"):
    got = run("--cp", "4", "--strategy", name, "--precision", "bf16")
    rel = worst(got, bf16)
    print(f"bf16 cp4 {name}: max rel vs bf16 cp1 {rel:.2e} (bound 2.5e-2)")
    if rel > 2.5e-2:
        failures.append(name)
    if name == "ring-zigzag":
        f32_ring = run("--cp", "4", "--strategy", name)
        print(f"ring-zigzag cp4 tokens/s bf16 / f32 {got['tokens_per_second'] / f32_ring['tokens_per_second']:.2f}, "
              f"cp bytes {got['bytes_by_axis']['cp'] / f32_ring['bytes_by_axis']['cp']:.4f}")
sys.exit("failed: " + ", ".join(failures) if failures else 0)
PY
       ;;
    9) step "training side by side" ${TRAIN_LIMIT:-480} python3 "$dir/gpu_training.py" "$bin" "$out" \
         ${TRAIN_ARGS:-} ;;
    10) step "where a step's time goes" ${BREAKDOWN_LIMIT:-300} python3 "$dir/gpu_breakdown.py" "$bin" \
         "$out" ${BREAKDOWN_ARGS:-} ;;
    7) step "flash side by side" ${SIDE_LIMIT:-480} python3 "$dir/gpu_attention.py" "$bin" "$out" --reps ${REPS:-10} ;;
  esac
done
echo "gpu_check: $([ $status -eq 0 ] && echo all steps passed || echo some steps FAILED)"
exit $status
