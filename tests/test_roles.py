"""Which role and which GPUs each world rank gets (runtime/roles.py, pure)."""

import pytest

from dora_hpc.runtime.roles import Roles, assign_gpus


def test_roles_and_gpu_needs():
    r = Roles(size=6, trainers=2)
    assert [r.role(i) for i in range(6)] == ["orchestrator", "trainer", "trainer", "rollout", "rollout", "rollout"]
    assert [r.gpus_needed(i, rollout_gpus=2) for i in range(6)] == [0, 1, 1, 2, 2, 2]


def test_trainer_replicas_each_get_every_group_and_can_be_fenced():
    """train.replicas: every trainer rank gets every group and keeps versions whole; a replica, like a rollout
    rank, can be fenced while another lives. Data-parallel ranks own a group each and cannot."""
    dp, ft = Roles(size=6, trainers=2), Roles(size=6, trainers=2, replicated=True)
    assert [dp.trainers_of_group(g) for g in range(4)] == [[1], [2], [1], [2]]
    assert all(ft.trainers_of_group(g) == [1, 2] for g in range(4))
    assert (dp.publish_shards, ft.publish_shards) == (2, 1)
    assert [dp.fenceable(r) for r in range(6)] == [False, False, False, True, True, True]
    assert [ft.fenceable(r) for r in range(6)] == [False, True, True, True, True, True]


@pytest.mark.parametrize("needs, count, want, shared", [
    ([0, 1, 1, 2, 2], 8, [[], [0], [1], [2, 3], [4, 5]], False),      # one 8-GPU node, room to spare
    ([0, 1, 1], 1, [[], [0], [0]], True),                             # one GPU: the ranks share it
    ([0, 1, 2, 2], 4, [[], [0], [1, 2], [0, 1]], True),               # a TP pair never wraps around
    ([2, 2], 4, [[0, 1], [2, 3]], False),                             # a rollout-only node
    ([0], 0, [[]], False),                                            # the orchestrator needs none
])
def test_assign_gpus(needs, count, want, shared):
    assert assign_gpus(needs, count) == (want, shared)


def test_an_instance_wider_than_its_node_is_refused():
    with pytest.raises(ValueError, match="needs 4 GPUs but its node has 2"):
        assign_gpus([0, 1, 4], 2)


BIND = """
import json, os, sys
import torch
from mpi4py import MPI
torch.cuda.device_count = lambda: 3  # a node with three GPUs, as NVML would count them
from dora_hpc.runtime.main import bind_gpus
from dora_hpc.runtime.roles import Roles
got = bind_gpus(MPI.COMM_WORLD, Roles(MPI.COMM_WORLD.Get_size(), trainers=1), rollout_gpus=2)
every = MPI.COMM_WORLD.gather([got, os.environ.get("CUDA_VISIBLE_DEVICES")])
if MPI.COMM_WORLD.Get_rank() == 0:
    print(json.dumps(every))
"""


@pytest.mark.slow
def test_bind_gpus_narrows_each_rank_to_its_gpus_under_mpi(tmp_path):
    """Four ranks on one node that shows GPUs 2,3,5: the orchestrator keeps them all, the trainer takes
    the first, the first rollout pair the next two, the second pair wraps around to share them."""
    import json
    import os
    import subprocess
    import sys

    from dora_hpc.launch.local import mpiexec

    script = tmp_path / "bind.py"
    script.write_text(BIND)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "2,3,5"}
    p = subprocess.run([mpiexec(), "-n", "4", sys.executable, str(script)], capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == [
        [None, "2,3,5"], ["2", "2"], ["3,5", "3,5"], ["2,3", "2,3"]]
    assert "5 GPUs wanted" in p.stderr and "ranks share them" in p.stderr


def test_a_requeued_start_removes_only_the_stale_mpich_segments(tmp_path):
    """Segments a dead start left (old, mapped by no process) go; a fresh one, a mapped one and other
    files stay (runtime/main.py: clear_stale_shm, run before MPI_Init on a requeued Slurm start)."""
    import mmap
    import os
    import time

    from dora_hpc.runtime.main import STALE_AFTER_S, clear_stale_shm

    old = time.time() - 2 * STALE_AFTER_S
    names = ["mpich_shm_b911e98_1", "mpich_vci_b911e98_1", "mpich_shm_b911e98_0", "mpich_shm_c0ffee_0", "other"]
    for n in names:
        (tmp_path / n).write_bytes(b"x" * 4096)
        os.utime(tmp_path / n, (old, old))
    os.utime(tmp_path / "mpich_shm_c0ffee_0")  # just made: a start being set up now
    with open(tmp_path / "mpich_shm_b911e98_0", "r+b") as f, mmap.mmap(f.fileno(), 4096):  # a live job's
        assert sorted(clear_stale_shm(tmp_path)) == ["mpich_shm_b911e98_1", "mpich_vci_b911e98_1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mpich_shm_b911e98_0", "mpich_shm_c0ffee_0", "other"]


def test_a_start_whose_mpi_init_never_completes_exits_instead_of_holding_its_nodes(tmp_path):
    """A rank's PMI server that accepts and never answers (as a stalled Slurm pmi2 exchange does) leaves
    MPI_Init waiting: the rank's watchdog ends it with status 1 after DORA_HPC_MPI_INIT_TIMEOUT_S, naming
    where it waited. A start whose MPI_Init completes lives on past that time."""
    import os
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        env = {**os.environ, "DORA_HPC_MPI_INIT_TIMEOUT_S": "3", "PMI_PORT": f"127.0.0.1:{server.getsockname()[1]}",
               "PMI_RANK": "0", "PMI_SIZE": "2", "PMI_ID": "0"}
        t0 = time.time()
        p = subprocess.run([sys.executable, "-m", "dora_hpc.runtime.main", str(tmp_path)], env=env,
                           capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and 3 <= time.time() - t0 < 30, (p.returncode, p.stderr[-2000:])
    assert "Timeout (0:00:03)!" in p.stderr and "init_mpi" in p.stderr, p.stderr[-2000:]
    p = subprocess.run([sys.executable, "-c", "import time\nfrom dora_hpc.runtime.main import init_mpi\n"
                        "MPI = init_mpi(2)\ntime.sleep(3)\nprint(MPI.COMM_WORLD.Get_size())"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "1", p.stderr[-2000:]

