"""Run under ``mpiexec -disable-auto-cleanup -n 3``, each rank under a shell that ignores SIGUSR1 (mpiexec ends
every rank when one is killed by a signal, and tells the others with SIGUSR1, which would end their shell and
with it the rank: launch/local.py's RANK_SHELL traps it too): orchestrator, trainer, rollout. The
trainer sends the rollout rank a version's weights (64 MiB, one bucket) over the data plane, and the rollout
rank, having read the announcement, is SIGKILLed before it reads a byte -- as when a rollout node is lost while it
loads weights. The trainer must live on: its sends to the dead rank fail (``Comm.broken``), nothing raises.
Rank 1 writes "trainer alive, broken [2], unfinished 0" to OUT (a file: mpiexec may end before it forwards
the ranks' output when one of them was killed).

    mpiexec -disable-auto-cleanup -n 3 sh -c 'trap "" USR1; "$0" "$@"; exit 0' \
        python tests/lost_peer_driver.py torch OUT

With ``control`` instead of a data plane, rank 0 is the sender: the rollout rank is SIGKILLed after rank 0's
first message, and from half a second later rank 0 sends it a 4 KB one every 50 ms -- as when rank 0 orders
work from a rank that has just died, before it fenced it. Rank 0 writes "rank 0 alive, broken [2]". Run it
with MPIR_CVAR_NOLOCAL=1 and MPIR_CVAR_CH4_NETMOD=ofi, each rank under ``sh -c 'trap "" USR1; ...'``: MPICH
then talks OFI inside one host too, where a message to a dead process aborts the sender (slurm/NOTES.md),
as across nodes.
"""

import os
import signal
import sys
import time

import torch
from mpi4py import MPI

from dora_hpc.runtime.comm import Comm
from dora_hpc.runtime.messages import Heartbeat, Shutdown, WeightsHeader

signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # hydra's notice that a rank ended (runtime/main.py does the same)
control = sys.argv[1] == "control"
comm = Comm(trainers=1, data_plane="torch" if control else sys.argv[1], weight_bucket_mb=1)
MPI.COMM_WORLD.Barrier()  # every rank is past the plane's start-up (rank 0 holds its store) before rank 0 leaves
if control:
    if comm.rank == 0:
        comm.send(Heartbeat(0), 2)
        time.sleep(0.5)
        end = time.monotonic() + 30
        while 2 not in comm.broken and time.monotonic() < end:
            comm.send(Shutdown("x" * 4096, ()), 2)  # any message over about 100 bytes, as work is ordered
            comm.poll()
            time.sleep(0.05)
        with open(sys.argv[2], "w") as out:
            out.write(f"rank 0 alive, broken {sorted(comm.broken)}")
        comm.send(Heartbeat(0), 1)
        comm.wait_bulk()
        time.sleep(0.5)
    elif comm.rank == 2:
        comm.wait_for(Heartbeat, 0)
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        comm.wait_for(Heartbeat, 0)  # rank 0 is done: until then the trainer stays
elif comm.rank == 1:
    comm.send_weights({"w": torch.ones(4096, 4096)}, 3, "sum", 2)
    end = time.monotonic() + 60
    while comm._bulk and time.monotonic() < end:  # noqa: SLF001 - what wait_bulk does, without rank 0's fence
        comm._pending = comm._unfinished(comm._pending)  # noqa: SLF001 - MPI progress: the header must go out
        comm._bulk = comm._unfinished(comm._bulk)  # noqa: SLF001
        time.sleep(0.01)
    with open(sys.argv[2], "w") as out:
        out.write(f"trainer alive, broken {sorted(comm.broken)}, unfinished {len(comm._bulk)}")  # noqa: SLF001
elif comm.rank == 2:
    comm.wait_for(WeightsHeader, 1)
    os.kill(os.getpid(), signal.SIGKILL)
else:  # rank 0 outlives the trainer's verdict: a rank whose link to rank 0 closes raises PeerLost at its next
    end = time.monotonic() + 90  # poll (rank 0 gone is the job gone), so the rollout rank must see the header first
    while not os.path.exists(sys.argv[2]) and time.monotonic() < end:
        time.sleep(0.05)

os._exit(0)  # no MPI_Finalize: a rank of the world is dead
