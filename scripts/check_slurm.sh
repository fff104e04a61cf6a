#!/usr/bin/env bash
# gpt_longctx under Slurm: starts a one-node Slurm (Debian's slurm-wlm and munge; root, no
# systemd), then runs `srun -n 4` over MPI (PMIx) and, inside the same kind of allocation, the TCP
# world (torchrun's variables from Slurm's), and checks both give the threads run's losses.
# Usage: scripts/check_slurm.sh [EXAMPLES_DIR]   (gpt_longctx built with --features mpi;
#        default target/debug/examples)
# Installs slurm-wlm and munge when missing; leaves the daemons running (a second run reuses
# them).
set -euo pipefail
examples=${1:-target/debug/examples}
binary=$(cd "$(dirname "$examples/gpt_longctx")" && pwd)/gpt_longctx
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y slurm-wlm munge
fi
host=$(hostname)
cpus=$(nproc)
# munge: a key, the daemon as its user
if ! pgrep -x munged >/dev/null; then
  mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
  [ -s /etc/munge/munge.key ] || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
  chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge
  chmod 400 /etc/munge/munge.key
  runuser -u munge -- /usr/sbin/munged
fi
# slurm: one node of 4 task slots (more than the cores: config_overrides), no cgroups; its
# addresses are the loopback's (a container's hostname may not resolve)
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
cat >/etc/slurm/slurm.conf <<CONF
ClusterName=burn-dcp
SlurmctldHost=$host(127.0.0.1)
AuthType=auth/munge
SlurmUser=root
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
NodeName=$host NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
if ! pgrep -x slurmctld >/dev/null; then slurmctld; fi
if ! pgrep -x slurmd >/dev/null; then slurmd; fi
for _ in $(seq 60); do
  if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then break; fi
  scontrol update nodename="$host" state=resume >/dev/null 2>&1 || true
  sleep 1
done
sinfo
flags=(--cp 4 --steps 3 --seq-len 1024 --seed 7 --json --timeout-secs 60)
losses() { python3 -c 'import json,sys; print(json.load(sys.stdin)["losses"])'; }
threads=$("$binary" "${flags[@]}" 2>/dev/null | losses)
echo "threads:              $threads"
mpi_plugin=pmix
srun --mpi=list 2>&1 | grep -q pmix || mpi_plugin=pmi2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpi=$(srun -n 4 --mpi=$mpi_plugin "$binary" "${flags[@]}" 2>/tmp/slurm_mpi.err | losses) || { cat /tmp/slurm_mpi.err; exit 1; }
echo "srun -n 4 --mpi=$mpi_plugin: $mpi"
tcp=$(srun -n 4 --mpi=none bash -c 'MASTER_ADDR=127.0.0.1 MASTER_PORT=29517 RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID exec "$0" "$@"' "$binary" "${flags[@]}" 2>/tmp/slurm_tcp.err | losses) || { cat /tmp/slurm_tcp.err; exit 1; }
echo "srun -n 4 (TCP world): $tcp"
if [ "$mpi" != "$threads" ] || [ "$tcp" != "$threads" ]; then
  echo "the losses differ" >&2
  exit 1
fi
echo "slurm check passed: srun over MPI ($mpi_plugin) and over TCP give the threads' losses"
