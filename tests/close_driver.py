"""Run under ``mpiexec -n 3`` (orchestrator, trainer, rollout): the rollout rank announces a KV buffer to
rank 0 and a version's weights to rank 1, then every rank closes without handling them -- as when a run
ends while a migration or a weight transfer is on its way. ``Comm.close`` must still return on every rank
(the receivers take the announced buffers, so the sender's sends complete). Prints "closed" from rank 0.

    mpiexec -n 3 python tests/close_driver.py mpi|torch
"""

import os
import sys

import numpy as np
import torch
from mpi4py import MPI

from dora_hpc.runtime.comm import TAG_KV, Comm
from dora_hpc.runtime.messages import MigrateIn

comm = Comm(trainers=1, data_plane=sys.argv[1], weight_bucket_mb=1)
if comm.rank == 2:
    kv = np.ones((2, 2, 4096, 4, 16), dtype=np.float32)  # 4 MiB: far past any eager limit
    comm.send(MigrateIn({"req_id": 7}, kv.shape), 0)
    comm.send_array(kv, 0, TAG_KV)
    comm.send_weights({"w": torch.ones(1024, 1024)}, 3, "sum", 1)  # 4 buckets of 1 MiB
MPI.COMM_WORLD.Barrier()  # both announcements were sent before anyone closes
dropped = comm.close()
if comm.rank in (0, 1):
    assert dropped == 1, dropped
if comm.rank == 0:
    print("closed", flush=True)
MPI.Finalize()  # then leave as every rank does (runtime/main.py exit_now): no teardown of the links' threads
os._exit(0)
