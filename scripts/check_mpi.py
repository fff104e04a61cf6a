#!/usr/bin/env python3
"""Loss parity of multi-process runs: each configuration runs twice, once as threads of one
process and once as one process per rank — under `mpirun -n <world size>` (MPI), or with
torchrun's variables through scripts/launch_tcp.py (`--launcher tcp`, the TCP world) — with the
same flags; every step's loss must agree within 1e-6 relative (the communicators move the same
messages and sum in the same order, so in practice they are identical), and so must the bytes sent.

Also checks `cp_attention --json` with processes (one JSON object, from rank 0, equal to the
in-process run's errors and bytes).

Usage: python3 scripts/check_mpi.py [BIN_DIR] [--quick] [--steps N] [--launcher mpi|tcp]
  BIN_DIR: the examples folder with gpt_longctx (target/<profile>/examples; cp_attention, a tool,
  is in its parent), built with `--features mpi` for MPI
           (default target/release/examples)
  --quick: the CI set (2 and 4 processes); default: every mesh and strategy (up to 8 processes)
  --launcher: mpi (default) or tcp
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

args = sys.argv[1:]
bin_dir = args[0] if args and not args[0].startswith("--") else "target/release/examples"
quick = "--quick" in args
steps = args[args.index("--steps") + 1] if "--steps" in args else "3"
train = os.path.join(bin_dir, "gpt_longctx")
# cp_attention is a binary of burn-dcp-tools: target/<profile>/, above the examples.
attention = os.path.join(os.path.dirname(os.path.normpath(bin_dir)), "cp_attention")
common = ["--steps", steps, "--seed", "7", "--seq-len", "1024", "--json"]
env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
launcher = args[args.index("--launcher") + 1] if "--launcher" in args else "mpi"
if launcher not in ("mpi", "tcp"):
    sys.exit(f"--launcher {launcher}: expected mpi or tcp")


def launch(processes):
    """The command prefix that starts `processes` ranks."""
    if launcher == "tcp":
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch_tcp.py")
        return [sys.executable, script, "-n", str(processes), "--grace", "60", "--"]
    return ["mpirun", "--oversubscribe", "--allow-run-as-root", "-n", str(processes)]


# (name, processes, flags)
runs = [
    ("cp2 ring-zigzag", 2, ["--cp", "2"]),
    ("cp4 ring-zigzag", 4, ["--cp", "4"]),
    ("cp2 dp2", 4, ["--cp", "2", "--dp", "2"]),
    ("cp4 ulysses", 4, ["--cp", "4", "--strategy", "ulysses"]),
    ("dynamic pool 4", 4, ["--cp", "2", "--dp", "2", "--strategy", "dynamic", "--max-tokens-per-rank", "256"]),
    ("tp2 cp2", 4, ["--tp", "2", "--cp", "2"]),
    ("pp2 cp2", 4, ["--pp", "2", "--cp", "2", "--micro-batches", "4"]),
]
if not quick:
    runs += [
        ("cp4 ring-stripe", 4, ["--cp", "4", "--strategy", "ring", "--layout", "stripe"]),
        ("cp4 ring contiguous", 4, ["--cp", "4", "--strategy", "ring", "--layout", "contiguous"]),
        ("cp4 usp 2x2", 4, ["--cp", "4", "--strategy", "usp", "--ulysses-degree", "2"]),
        ("cp4 all-gather", 4, ["--cp", "4", "--strategy", "all-gather"]),
        ("dcp cp4", 4, ["--cp", "4", "--strategy", "dcp"]),
        ("dcp cp4 2 nodes", 4, ["--cp", "4", "--strategy", "dcp", "--topology", "a100-p4d", "--nodes", "2"]),
        ("auto cp4", 4, ["--cp", "4", "--strategy", "auto"]),
        ("dynamic pool 8", 8, ["--cp", "8", "--strategy", "dynamic", "--max-tokens-per-rank", "192", "--cp-sizes", "any"]),
        ("tp2 cp2 dp2", 8, ["--tp", "2", "--cp", "2", "--dp", "2"]),
        ("pp2 cp2 gpipe", 4, ["--pp", "2", "--cp", "2", "--micro-batches", "4", "--pp-schedule", "gpipe"]),
        ("tp2 pp2 cp2", 8, ["--tp", "2", "--pp", "2", "--cp", "2", "--micro-batches", "4"]),
    ]


def run(command):
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"FAILED ({done.returncode}): {' '.join(command)}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


worst = 0.0
for name, processes, flags in runs:
    threads = run([train, *flags, *common])
    mpi = run([*launch(processes), train, *flags, *common])
    if len(threads["losses"]) != len(mpi["losses"]):
        sys.exit(f"{name}: {len(mpi['losses'])} {launcher} steps vs {len(threads['losses'])}")
    rel = max(abs(a - b) / abs(a) for a, b in zip(threads["losses"], mpi["losses"]))
    worst = max(worst, rel)
    same_bytes = threads["bytes_by_axis"] == mpi["bytes_by_axis"]
    print(f"{name:22} -n {processes} ({launcher}): losses {mpi['losses']} max rel diff {rel:.2e}, bytes {'equal' if same_bytes else 'DIFFER'}")
    if rel > 1e-6:
        sys.exit(f"{name}: {launcher} losses {mpi['losses']} differ from in-process {threads['losses']}")
    if not same_bytes:
        sys.exit(f"{name}: {launcher} bytes {mpi['bytes_by_axis']} differ from in-process {threads['bytes_by_axis']}")

# cp_attention: one JSON object from rank 0, the same as the in-process run.
for processes, flags in [(2, ["--cp", "2", "--strategy", "ring"]), (4, ["--cp", "4", "--strategy", "ulysses"])]:
    attention_flags = [*flags, "--seqlens", "300,200", "--heads", "4", "--head-dim", "16", "--json"]
    done = subprocess.run([*launch(processes), attention, *attention_flags], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"cp_attention -n {processes} failed: {done.stderr[-3000:]}")
    mpi = json.loads(done.stdout)
    threads = run([attention, *attention_flags])
    keys = [k for k in ("max_rel_err", "bytes_forward_per_rank", "bytes_backward_per_rank", "bytes_by_link") if k in threads]
    print(f"cp_attention -n {processes}: " + ", ".join(f"{k} {mpi.get(k)}" for k in keys))
    for key in keys:
        if mpi.get(key) != threads[key]:
            sys.exit(f"cp_attention -n {processes}: {key} {mpi.get(key)} differs from in-process {threads[key]}")

# --trace with one process per rank: each rank writes FILE.rank<r>.json; merged, one track per
# rank whose communication spans hold every byte of the summary; peak memory is each process's.
trace_dir = tempfile.mkdtemp(prefix="bdcp-trace-")
trace = os.path.join(trace_dir, "trace.json")
traced = run([*launch(4), train, "--cp", "4", *common, "--trace", trace])
merge = os.path.join(os.path.dirname(os.path.abspath(__file__)), "merge_traces.py")
done = subprocess.run([sys.executable, merge, trace], capture_output=True, text=True)
if done.returncode != 0:
    sys.exit(f"merge_traces.py failed: {done.stderr}")
with open(trace) as f:
    events = json.load(f)["traceEvents"]
tracks = sorted({e["tid"] for e in events})
comm = sum(e.get("args", {}).get("bytes", 0) for e in events if e.get("cat") == "comm")
print(f"trace -n 4 ({launcher}): tracks {tracks}, communication spans {comm} bytes, summary "
      f"{traced['bytes_communicated']}, peak memory {traced['peak_memory_mb']:.1f} MiB")
if tracks != [0, 1, 2, 3] or comm != traced["bytes_communicated"]:
    sys.exit(f"trace -n 4 ({launcher}): tracks {tracks}, bytes {comm} vs {traced['bytes_communicated']}")
shutil.rmtree(trace_dir)

print(f"{launcher} loss parity: {len(runs)} configurations, worst relative difference {worst:.2e}")
