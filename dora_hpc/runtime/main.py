"""Entry point of every MPI rank: ``python -m dora_hpc.runtime.main RUN_DIR``.

The role comes from the world rank (runtime/comm.py). Any exception ends the whole job at once:
the rank prints a message naming itself and calls MPI_Abort, so no rank hangs on a dead peer.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path


def main(run_dir: str) -> int:
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    try:
        import torch

        torch.set_num_threads(1)
        from ..config import validate
        from ..data.tasks import make_task
        from .comm import Comm

        run = Path(run_dir)
        (run / "pids").mkdir(exist_ok=True)
        (run / "pids" / f"rank-{rank}").write_text(str(os.getpid()))

        def cleaned_up(signum, frame):  # mpiexec tearing the job down: this rank did not fail itself
            (run / "pids" / f"rank-{rank}.cleanup").write_text(str(signum))
            os._exit(128 + signum)

        signal.signal(signal.SIGTERM, cleaned_up)
        signal.signal(signal.SIGINT, cleaned_up)
        meta = json.loads((run / "launch.json").read_text())
        cfg = validate(meta["config"])
        comm = Comm(cfg.cluster.trainer_ranks)
        t0 = meta["t0"]
        role = comm.roles.role(rank)
        model_dir = Path(meta["model_dir"])
        if role == "orchestrator":
            from .orchestrator import Orchestrator

            task = make_task(cfg, meta["vocab_size"], model_dir)
            Orchestrator(comm, cfg, run, task, meta["run_id"], t0).run()
        elif role == "trainer":
            from .trainer import TrainerRank

            TrainerRank(comm, cfg, run, model_dir, meta["run_id"], t0).run()
        else:
            from .rollout import RolloutRank

            task = make_task(cfg, meta["vocab_size"], model_dir)
            RolloutRank(comm, cfg, run, model_dir, task, meta["run_id"], t0).run()
        comm.close()
        (run / "pids" / f"rank-{rank}.done").write_text("ok")  # a clean exit: the launcher must not blame it
        return 0
    except BaseException as e:  # noqa: BLE001 - any failure must take the whole job down
        try:  # a marker for the launcher: this rank raised (it may be a consequence of a dead peer)
            (Path(run_dir) / "pids" / f"rank-{rank}.failed").write_text(f"{type(e).__name__}: {e}")
        except OSError:
            pass
        sys.stderr.write(f"dora-hpc: rank {rank} failed: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        sys.stderr.flush()
        time.sleep(0.2)
        MPI.COMM_WORLD.Abort(1)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
