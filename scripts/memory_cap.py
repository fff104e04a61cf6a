#!/usr/bin/env python3
"""The longest sequence that trains under a per-rank memory cap, per cp: for each cp, one process per rank (the TCP launcher, or mpirun), every
process under `ulimit -v CAP` (virtual memory; MALLOC_ARENA_MAX=2 so glibc's per-thread arenas do
not reserve address space the run never touches), the longest `--seq-len` (a multiple of
--granularity) whose `gpt_longctx --micro-batches 1 --steps 1` finishes. A run that needs more
memory than the cap dies allocating (the launcher reports the failed rank). Prints, per cp, the
longest length, its ratio to cp 1's, and that run's peak memory per rank (`peak_memory_mb`, the
largest process RSS).

Usage: python3 scripts/memory_cap.py [BIN_DIR] [--cap-mib M] [--cps 1,2,4,8] [--mask MASK]
       [--model-size S] [--granularity N] [--launcher tcp|mpi] [--max-len N] [--corpus PATH]
       [--recompute none|attention|block]

Give --corpus one long document (e.g. the Vim help files concatenated into one file): the
packing splits it into micro-batches of exactly --seq-len tokens, so the step trains that many
(with the default corpus of short documents, the step's micro-batch may be a partly filled bin).
The table reports the tokens the step trained.
Defaults: BIN_DIR target/release/examples, --cap-mib 640, --cps 1,2,4,8, --mask lambda:64,1024
(a sink + sliding window: attention work linear in the length, so long runs stay short; the
memory per rank does not depend on the mask),
--model-size tiny, --granularity 1024, --launcher tcp, --max-len 1048576.
"""
import json
import os
import shlex
import subprocess
import sys
import time

args = sys.argv[1:]
bin_dir = args[0] if args and not args[0].startswith("--") else "target/release/examples"


def option(name, default):
    return args[args.index(name) + 1] if name in args else default


cap_mib = int(option("--cap-mib", "640"))
cps = [int(c) for c in option("--cps", "1,2,4,8").split(",")]
mask = option("--mask", "lambda:64,1024")
model_size = option("--model-size", "tiny")
granularity = int(option("--granularity", "1024"))
launcher = option("--launcher", "tcp")
max_len = int(option("--max-len", str(1 << 20)))
corpus = ["--corpus", option("--corpus", "")] if "--corpus" in args else []
recompute = ["--recompute", option("--recompute", "")] if "--recompute" in args else []
train = os.path.join(bin_dir, "gpt_longctx")
here = os.path.dirname(os.path.abspath(__file__))
env = dict(os.environ, MALLOC_ARENA_MAX="2", OMPI_ALLOW_RUN_AS_ROOT="1",
           OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def launch(processes):
    if launcher == "tcp":
        return [sys.executable, os.path.join(here, "launch_tcp.py"), "-n", str(processes),
                "--grace", "30", "--"]
    return ["mpirun", "--oversubscribe", "--allow-run-as-root", "-n", str(processes)]


def trial(cp, length):
    """The run's summary when it trains under the cap, else None."""
    command = [*launch(cp), train, "--cp", str(cp), "--seq-len", str(length),
               "--micro-batches", "1", "--steps", "1", "--mask", mask,
               "--model-size", model_size, *corpus, *recompute, "--json"]
    shell = f"ulimit -v {cap_mib * 1024}; exec {shlex.join(command)}"
    started = time.time()
    done = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, env=env)
    seconds = time.time() - started
    ok = done.returncode == 0
    summary = json.loads(done.stdout) if ok else None
    if ok and summary["tokens"] < length:
        # The step drew a partly filled piece (the corpus's last): no measurement of `length`.
        print(f"  cp {cp} seq-len {length}: trained only {summary['tokens']} tokens (the corpus "
              f"is too short for whole pieces of this length): not a measurement ({seconds:.0f} s)",
              flush=True)
        short.add(cp)
        return None
    print(f"  cp {cp} seq-len {length}: {'trains' if ok else 'does not fit'} ({seconds:.0f} s)",
          flush=True)
    return summary


# cps whose search met a length the corpus cannot fill: their result is a lower bound.
short = set()


results = []
for cp in cps:
    # Doubling from cp × granularity until a run fails, then bisection to the granularity.
    good, bad, summary = None, None, None
    length = cp * granularity
    while length <= max_len:
        run = trial(cp, length)
        if run is None:
            bad = length
            break
        good, summary = length, run
        length *= 2
    if good is None:
        print(f"cp {cp}: not even {cp * granularity} tokens fit under {cap_mib} MiB")
        results.append((cp, 0, None))
        continue
    while bad is not None and bad - good > granularity:
        middle = (good + bad) // 2 // granularity * granularity
        run = trial(cp, middle)
        if run is None:
            bad = middle
        else:
            good, summary = middle, run
    results.append((cp, good, summary))

base = results[0][1] or 1
print(f"\ncap {cap_mib} MiB of virtual memory per process, mask {mask}, model {model_size}, "
      f"{launcher} launcher")
print(f"{'cp':>3} {'longest seq-len':>16} {'tokens trained':>15} {'× cp 1':>7} "
      f"{'peak RSS per rank (MiB)':>24}")
for cp, length, summary in results:
    tokens = summary["tokens"] if summary else 0
    peak = f"{summary['peak_memory_mb']:.1f}" if summary else "-"
    bound = "  (at least: a longer probe hit the corpus's end)" if cp in short else ""
    print(f"{cp:>3} {length:>16} {tokens:>15} {length / base:>7.2f} {peak:>24}{bound}")
