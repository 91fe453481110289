#!/usr/bin/env bash
# MPICH's MPI_Comm_accept with peers connecting to one port at once, against one at a time (slurm/NOTES.md).
#   bash results/bench/faults/accept-race/run.sh [RUNS]     (from the repo root; prints one line per mode)
set -u
here=$(cd "$(dirname "$0")" && pwd); bin=$(cd "$here/../../../.." && pwd)/.venv/bin; runs=${1:-6}
work=$(mktemp -d); cd "$work"
export MPIR_CVAR_CH4_NETMOD=ofi
for mode in concurrent serial; do
  ok=0
  for _ in $(seq "$runs"); do
    rm -f port linked-* accepted
    timeout 40 "$bin/mpiexec" -n 1 "$bin/python" "$here/acceptor.py" 5 > acceptor.log 2>&1 & acceptor=$!
    timeout 40 "$bin/mpiexec" -n 5 "$bin/python" "$here/connector.py" "$mode" > connector.log 2>&1
    wait $acceptor
    [ -e accepted ] && ok=$((ok + 1))
  done
  echo "$mode: $ok of $runs runs linked all 5 (the others: a segfault in MPI_Comm_accept, or a hang)"
done
rm -rf "$work"
