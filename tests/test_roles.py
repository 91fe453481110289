"""Which role and which GPUs each world rank gets (runtime/roles.py, pure)."""

import pytest

from dora_hpc.runtime.roles import Roles, assign_gpus


def test_roles_and_gpu_needs():
    r = Roles(size=6, trainers=2)
    assert [r.role(i) for i in range(6)] == ["orchestrator", "trainer", "trainer", "rollout", "rollout", "rollout"]
    assert [r.gpus_needed(i, rollout_gpus=2) for i in range(6)] == [0, 1, 1, 2, 2, 2]


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
