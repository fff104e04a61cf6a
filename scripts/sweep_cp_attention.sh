#!/usr/bin/env bash
# Runs cp_attention for every strategy × layout × mask at cp 2, 4 and 8 on a ragged GQA batch and
# prints one line per run with the largest max_rel_err and whether bytes match the analytic volume.
# Usage: scripts/sweep_cp_attention.sh [SEQLENS] [HEADS] [KV_HEADS]
set -euo pipefail
seqlens=${1:-1000,3000,517,7}
heads=${2:-8}
kv_heads=${3:-2}
cargo build --release -p burn-dcp-tools --bin cp_attention -q
bin=target/release/cp_attention
fail=0
for cp in 2 4 8; do
  for strategy in ulysses ring all-gather usp; do
    extra=""
    [ "$strategy" = usp ] && extra="--ulysses-degree 2"
    for layout in contiguous zigzag stripe; do
      for mask in causal full sliding:256 lambda:64,512 blockwise:128,2 shared-question:0.2,4; do
        out=$($bin --strategy $strategy $extra --layout $layout --cp $cp --heads $heads --kv-heads $kv_heads \
              --head-dim 64 --seqlens $seqlens --mask $mask --seed $cp --json)
        line=$(python3 -c '
import json,sys
r=json.loads(sys.stdin.read())
e=max(r["max_rel_err"].values())
ok=e<=1e-5 and r["bytes_sent_per_rank"]==r["analytic_bytes_per_rank"]
print(("ok  " if ok else "FAIL"), f"max_rel_err={e:.2e}", "bytes="+("analytic" if r["bytes_sent_per_rank"]==r["analytic_bytes_per_rank"] else "MISMATCH"))
' <<<"$out")
        echo "cp=$cp $strategy $layout $mask: $line"
        [[ $line == ok* ]] || fail=1
      done
    done
  done
done
exit $fail
