#!/usr/bin/env python3
"""Merges the per-rank Chrome traces of a multi-process run (`gpt_longctx --trace FILE` under
mpirun or the TCP launcher writes FILE with `.rank<r>` before its extension, one per rank) into
FILE: one track per rank, timestamps already on one clock (microseconds since the Unix epoch).

Usage: python3 scripts/merge_traces.py FILE        (e.g. runs/trace.json)
"""
import glob
import json
import os
import re
import sys

if len(sys.argv) != 2:
    sys.exit(__doc__)
target = sys.argv[1]
stem, ext = os.path.splitext(target)
pattern = re.compile(re.escape(stem) + r"\.rank(\d+)" + re.escape(ext) + "$")
parts = sorted(
    (int(m.group(1)), path)
    for path in glob.glob(glob.escape(stem) + ".rank*" + ext)
    if (m := pattern.match(path))
)
if not parts:
    sys.exit(f"no per-rank traces {stem}.rank<r>{ext} found")
ranks = [rank for rank, _ in parts]
if ranks != list(range(len(ranks))):
    sys.exit(f"per-rank traces of ranks {ranks}: expected 0..{len(ranks) - 1}, one each")
events = []
for rank, path in parts:
    with open(path) as f:
        trace = json.load(f)
    foreign = {e["tid"] for e in trace["traceEvents"]} - {rank}
    if foreign:
        sys.exit(f"{path}: events of tracks {sorted(foreign)}, expected only rank {rank}'s")
    events.extend(trace["traceEvents"])
with open(target, "w") as f:
    json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
print(f"{target}: {len(events)} events of {len(parts)} ranks")
