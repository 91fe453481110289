"""The ranks of one world connect to the acceptor's port, as a run's ranks link to a replacement: rank 0
alone first (rank 0 of a run links first), then the others, ``concurrent`` or ``serial`` (each after the
one before linked). Every rank keeps MPI progressing while it waits, as a run's ranks do."""

import os
import sys
import time

from mpi4py import MPI

rank, serial = MPI.COMM_WORLD.rank, sys.argv[1] == "serial"


def wait(ready) -> None:
    while not ready():
        MPI.COMM_WORLD.Iprobe()
        time.sleep(0.005)


wait(lambda: os.path.exists("port"))
if rank:
    wait(lambda: os.path.exists("linked-0"))
if serial and rank > 1:
    wait(lambda: os.path.exists(f"linked-{rank - 1}"))
link = MPI.COMM_SELF.Connect(open("port").read())
link.send(rank, dest=0, tag=5)
open(f"linked-{rank}", "w").close()
wait(lambda: os.path.exists("accepted"))
os._exit(0)
