#!/usr/bin/env python3
"""Starts one process per rank with torchrun's variables (MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE, LOCAL_RANK), for burn-dcp's TCP world (no MPI needed).

Usage: python3 scripts/launch_tcp.py -n P [--nnodes N --node-rank K] [--master-addr HOST]
                                     [--master-port PORT] [--grace S] -- PROGRAM ARGS...
  -n, --nproc-per-node P: processes on this node (ranks K*P .. K*P+P-1, LOCAL_RANK 0..P-1)
  --nnodes N, --node-rank K: run this on each of N hosts with K = 0..N-1 (default 1 and 0)
  --master-addr HOST: the host of rank 0 (default 127.0.0.1; on several hosts, node 0's name)
  --master-port PORT: rank 0's port (default: a free port on one node; 29500 on several)
  --grace S: once a rank has failed, how long the others get to exit on their own before
             this launcher kills them (default 120; burn-dcp ranks exit by themselves, naming
             the failed rank, well before: their peers' failures reach them at once)

Exits with the first non-zero exit status of a rank (a rank killed by a signal counts as 128 +
the signal), or 0 when every rank succeeded. Each rank's output goes to this terminal.
"""
import os
import signal
import socket
import subprocess
import sys
import time


def fail(message):
    sys.exit(f"launch_tcp: {message}")


def parse(argv):
    if "--" not in argv:
        fail("usage: launch_tcp.py -n P [options] -- PROGRAM ARGS...")
    split = argv.index("--")
    options, program = argv[:split], argv[split + 1:]
    if not program:
        fail("no program after --")
    values = {"-n": None, "--nnodes": "1", "--node-rank": "0", "--master-addr": "127.0.0.1",
              "--master-port": None, "--grace": "120"}
    aliases = {"--nproc-per-node": "-n"}
    i = 0
    while i < len(options):
        name = aliases.get(options[i], options[i])
        if name not in values or i + 1 >= len(options):
            fail(f"unknown option or missing value: {options[i]}")
        values[name] = options[i + 1]
        i += 2
    if values["-n"] is None:
        fail("-n P (processes on this node) is required")
    try:
        per_node, nodes, node = int(values["-n"]), int(values["--nnodes"]), int(values["--node-rank"])
        grace = float(values["--grace"])
    except ValueError as e:
        fail(f"not a number: {e}")
    if per_node < 1 or nodes < 1 or not 0 <= node < nodes:
        fail(f"need -n >= 1, --nnodes >= 1 and 0 <= --node-rank < --nnodes (got {per_node}, {nodes}, {node})")
    port = values["--master-port"]
    if port is None:
        if nodes > 1:
            port = "29500"
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = str(s.getsockname()[1])
    return per_node, nodes, node, values["--master-addr"], port, grace, program


def main():
    per_node, nodes, node, master_addr, port, grace, program = parse(sys.argv[1:])
    children = []
    for local in range(per_node):
        env = dict(os.environ, MASTER_ADDR=master_addr, MASTER_PORT=port,
                   RANK=str(node * per_node + local), WORLD_SIZE=str(nodes * per_node),
                   LOCAL_RANK=str(local))
        children.append(subprocess.Popen(program, env=env))

    def forward(signum, _frame):
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    status, failed_at = 0, None
    while any(child.poll() is None for child in children):
        for rank, child in enumerate(children):
            code = child.poll()
            if code not in (None, 0) and status == 0:
                status = code if code > 0 else 128 - code
                failed_at = time.time()
                print(f"launch_tcp: rank {node * per_node + rank} exited with status {code}", file=sys.stderr)
        if failed_at is not None and time.time() - failed_at > grace:
            alive = [node * per_node + r for r, c in enumerate(children) if c.poll() is None]
            print(f"launch_tcp: ranks {alive} still run {grace:.0f} s after a rank failed: killing them", file=sys.stderr)
            for child in children:
                if child.poll() is None:
                    child.kill()
        time.sleep(0.05)
    for rank, child in enumerate(children):
        code = child.returncode
        if code != 0 and status == 0:
            status = code if code > 0 else 128 - code
            print(f"launch_tcp: rank {node * per_node + rank} exited with status {code}", file=sys.stderr)
    sys.exit(status)


if __name__ == "__main__":
    main()
