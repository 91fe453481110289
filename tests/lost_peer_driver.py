"""Run under ``mpiexec -disable-auto-cleanup -n 3``, each rank under a shell (mpiexec ends every rank when
one is killed by a signal, as launch/local.py's RANK_SHELL knows): orchestrator, trainer, rollout. The
trainer sends the rollout rank a version's weights (64 MiB, one bucket) over the data plane, and the rollout
rank, having read the announcement, is SIGKILLed before it reads a byte -- as when a rollout node is lost while it
loads weights. The trainer must live on: its sends to the dead rank fail (``Comm.broken``), nothing raises.
Rank 1 writes "trainer alive, broken [2], unfinished 0" to OUT (a file: mpiexec may end before it forwards
the ranks' output when one of them was killed).

    mpiexec -disable-auto-cleanup -n 3 sh -c '"$0" "$@"; exit 0' python tests/lost_peer_driver.py torch OUT
"""

import os
import signal
import sys
import time

import torch
from mpi4py import MPI

from dora_hpc.runtime.comm import Comm
from dora_hpc.runtime.messages import WeightsHeader

signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # hydra's notice that a rank ended (runtime/main.py does the same)
comm = Comm(trainers=1, data_plane=sys.argv[1], weight_bucket_mb=1)
MPI.COMM_WORLD.Barrier()  # every rank is past the plane's start-up (rank 0 holds its store) before rank 0 leaves
if comm.rank == 1:
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

os._exit(0)  # no MPI_Finalize: a rank of the world is dead
