#!/usr/bin/env bash
# A fresh project depends on burn-dcp by the README's dependency lines (the toml block after the
# `dependency-lines` marker), the path pointing at this clone, and builds (`cargo check`) with
# every feature: threads, MPI, CUDA/NCCL and wgpu. Shares this workspace's target folder and
# lock file, so what the workspace's own check build compiled is reused.
# Usage: scripts/check_dependency_lines.sh
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
lines=$(awk '/dependency-lines/{found=1} found && /^```toml/{inside=1; next} inside && /^```/{exit} inside{print}' "$repo/README.md")
if ! grep -q '^burn-dcp = ' <<<"$lines"; then
  echo "README.md: no dependency lines after the dependency-lines marker" >&2
  exit 1
fi
mkdir -p "$scratch/src"
{
  printf '[package]\nname = "uses-burn-dcp"\nversion = "0.0.0"\nedition = "2021"\npublish = false\n\n'
  sed "s|\.\./burn-dcp/|$repo/|g" <<<"$lines"
  # The workspace's dev profile, so its compiled dependencies are reused.
  awk '/^\[profile\.dev/{p=1} /^\[/{if(!/^\[profile\.dev/)p=0} p' "$repo/Cargo.toml"
  printf '\n[workspace]\n'
} >"$scratch/Cargo.toml"
cat >"$scratch/src/main.rs" <<'RS'
//! A user's program: a burn backend made context-parallel, and the engine's configuration.
use burn::backend::{Autodiff, Flex};
use burn_dcp::ContextParallel;

type Backend = ContextParallel<Autodiff<Flex>>;

fn main() {
    let config = burn_dcp_train::TrainConfig::default();
    println!("{} cp {}", std::any::type_name::<Backend>(), config.cp);
}
RS
cp "$repo/Cargo.lock" "$scratch/Cargo.lock"
cd "$scratch"
CARGO_TARGET_DIR="$repo/target" cargo check --quiet \
  --features burn-dcp/mpi,burn-dcp-train/mpi,burn-dcp/cuda,burn-dcp/wgpu
# And with no feature at all (threads and TCP).
CARGO_TARGET_DIR="$repo/target" cargo check --quiet
echo "dependency lines: a fresh crate builds with every feature and with none"
