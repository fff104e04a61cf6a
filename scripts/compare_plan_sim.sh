#!/bin/bash
# Usage: scripts/compare_plan_sim.sh OLD_PLAN_SIM NEW_PLAN_SIM
# A refactor's check that plans did not change: both binaries on the same cases, their JSON
# compared byte for byte.
old=${1:?old plan_sim binary}; new=${2:?new plan_sim binary}
# planning_ms (wall-clock time) is masked before comparing.
cases=(
 "--json --tokens 65536 --nodes 2 --strategies ring-zigzag,ulysses,usp,all-gather,megatron-dynamic,dcp,auto"
 "--json --lengths-from longalign-like --tokens 65536 --nodes 2 --mask lambda:64,4096 --seed 1"
 "--json --lengths 3000,12000,500,700 --nodes 1 --devices-per-node 4 --heads 4 --kv-heads 4 --block 256 --mask blockwise:256,2 --strategies ring-zigzag,usp,dcp,auto"
 "--json --tokens 32768 --topology h100-dgx --nodes 2 --mask shared-question:0.2,4 --heads 16 --kv-heads 8"
)
tmp=$(mktemp -d)
fail=0
for c in "${cases[@]}"; do
  timeout 600 $old $c > "$tmp/old.json" 2>&1; a=$?
  timeout 600 $new $c > "$tmp/new.json" 2>&1; b=$?
  sed -i -E 's/"planning_ms": ?[0-9.e+-]+/"planning_ms": T/g' "$tmp/old.json" "$tmp/new.json"
  if cmp -s "$tmp/old.json" "$tmp/new.json" && [ $a = $b ]; then echo "identical ($(wc -c < "$tmp/new.json") bytes, rc $a): $c"; else echo "DIFFER (rc $a/$b): $c"; fail=1; fi
done
exit $fail
