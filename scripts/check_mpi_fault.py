#!/usr/bin/env python3
"""Fault across processes: SIGKILL one rank of a 4-process `gpt_longctx --cp 4` job after its
first step; every rank must end (the job exits non-zero) within the timeout, the output must name
the killed rank, and no process of the job may be left behind.

With `--launcher mpi` (default) the job runs under `mpirun`; with `--launcher tcp` under
scripts/launch_tcp.py (the TCP world), whose ranks must all exit by themselves (the launcher
only kills leftovers after a grace period far beyond the timeout, which fails this check).

With `--stall` the rank is stopped (SIGSTOP) instead: it holds its sockets (or its MPI
connections) open and answers nothing, so its peers time out; they must name it first ("global
rank R made no progress"), not the first rank to time out, and end (TCP: by themselves; MPI: the
first report aborts the job); the stopped rank is killed once they have.

Usage: python3 scripts/check_mpi_fault.py [BIN] [--rank R] [--launcher mpi|tcp] [--stall]
  BIN: gpt_longctx (built with `--features mpi` for MPI; default target/release/examples/gpt_longctx)
"""
import os
import re
import signal
import subprocess
import sys
import time

args = sys.argv[1:]
binary = args[0] if args and not args[0].startswith("--") else "target/release/examples/gpt_longctx"
victim = int(args[args.index("--rank") + 1]) if "--rank" in args else 2
timeout = 20
launcher = args[args.index("--launcher") + 1] if "--launcher" in args else "mpi"
stall = "--stall" in args
if stall:
    timeout = 5
env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
if launcher == "tcp":
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch_tcp.py")
    prefix = [sys.executable, script, "-n", "4", "--grace", "300", "--"]
    rank_variable = b"RANK"
elif launcher == "mpi":
    prefix = ["mpirun", "--oversubscribe", "--allow-run-as-root", "-n", "4"]
    rank_variable = b"OMPI_COMM_WORLD_RANK"
else:
    sys.exit(f"--launcher {launcher}: expected mpi or tcp")
command = [*prefix, binary, "--cp", "4", "--steps", "200", "--seq-len", "1024",
           "--timeout-secs", str(timeout)]


def ranks_of(binary_name):
    """PID → world rank of the running processes of the job."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if binary_name not in f.read().split(b"\0")[0].decode(errors="replace"):
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
            if rank_variable in environ:
                found[int(pid)] = int(environ[rank_variable])
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass
    return found


job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
name = os.path.basename(binary)
# Wait for the first step (the progress line) so the ranks are training, then kill one.
output = ""
started = time.time()
while "step 1/" not in output:
    chunk = job.stdout.read(1) if job.poll() is None else ""
    if not chunk:
        sys.exit(f"the job ended before its first step:\n{output}")
    output += chunk
    if time.time() - started > 300:
        job.kill()
        sys.exit("no first step within 300 s")
pids = {rank: pid for pid, rank in ranks_of(name).items()}
if victim not in pids:
    job.kill()
    sys.exit(f"rank {victim} not found among {pids}")
os.kill(pids[victim], signal.SIGSTOP if stall else signal.SIGKILL)
killed_at = time.time()
if stall:
    # The other ranks must end by themselves; then the stopped one is killed.
    while any(rank != victim for rank in ranks_of(name).values()):
        if time.time() - killed_at > timeout + 30:
            os.kill(pids[victim], signal.SIGKILL)
            job.kill()
            sys.exit(f"the other ranks still run {timeout + 30} s after rank {victim} stopped")
        time.sleep(0.2)
    ended_at = time.time()
    os.kill(pids[victim], signal.SIGKILL)
    os.kill(pids[victim], signal.SIGCONT)
try:
    rest, _ = job.communicate(timeout=timeout + 30)
except subprocess.TimeoutExpired:
    job.kill()
    sys.exit(f"the job still runs {timeout + 30} s after rank {victim} was killed")
output += rest
if stall:
    print(output[-2000:])
    elapsed = ended_at - killed_at
    print(f"{launcher}: stopped rank {victim}; the other ranks exited after {elapsed:.1f} s")
    if job.returncode == 0:
        sys.exit("the job exited 0 after a rank stopped")
    # Each rank names the stopped one: as the peer it timed out on, or as the rank that made no
    # progress (when it waited for another waiting rank); no rank blames any other.
    named = [f"global rank {victim} made no progress", f"(global rank {victim}) and timed out"]
    if not any(text in output for text in named):
        sys.exit(f"the output does not name the stopped rank ({named})")
    blamed = {int(r) for r in re.findall(r"global rank (\d+) (?:failed|made no progress)", output)}
    if blamed - {victim}:
        sys.exit(f"ranks {sorted(blamed - {victim})} were blamed, not the stopped rank {victim}")
    if elapsed > timeout + 10:
        sys.exit(f"the ranks took {elapsed:.1f} s to end, more than the {timeout} s timeout")
    print("stall check passed")
    sys.exit(0)
elapsed = time.time() - killed_at
left = ranks_of(name)
print(output[-2000:])
print(f"{launcher}: killed rank {victim} (pid {pids[victim]}); the job exited with {job.returncode} after {elapsed:.1f} s; processes left: {left}")
if job.returncode == 0:
    sys.exit("the job exited 0 after a rank was killed")
if left:
    sys.exit(f"processes left behind: {left}")
# The ranks themselves must name it (with TCP the launcher's own line would name it too).
named = f"global rank {victim} failed" if launcher == "tcp" else f"rank {victim}"
if named not in output:
    sys.exit(f"the output does not name rank {victim} ('{named}')")
if elapsed > timeout + 10:
    sys.exit(f"the job took {elapsed:.1f} s to end, more than the {timeout} s timeout")
print("fault check passed")
