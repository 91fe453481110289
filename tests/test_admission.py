"""Lean admission (core/admission.py, dora.admission: lean): staleness <= K still holds by construction, the
pipeline never runs deeper than its cap, a group queued whole takes the version it starts under, and
when rollout outpaces the trainer lean trains fresher groups than eager, which fills the window."""

import random
import statistics

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from random_driver import RandomDriver

from dora_hpc.core.admission import LeanDepth
from dora_hpc.core.cluster import ClusterView
from dora_hpc.core.policies import PolicyConfig, policy_for


class HoldChecked(RandomDriver):
    """After every event: the pipeline's depth (unconsumed groups + the batch in training) is within lean's cap."""

    def feed(self, event) -> None:
        super().feed(event)
        lean = self.p.lean
        assert self.p._in_pipeline() <= lean.depth, f"depth {self.p._in_pipeline()} > cap {lean.depth} after {event}"
        assert lean.tbs <= lean.depth <= lean.ceiling


@st.composite
def lean_configs(draw):
    tbs, k = draw(st.integers(1, 4)), draw(st.integers(0, 3))
    rbs = None if draw(st.booleans()) else tbs + draw(st.integers(0, 6))
    return PolicyConfig(tbs=tbs, rbs=rbs, group_size=draw(st.integers(1, 4)), n_instances=draw(st.integers(1, 5)),
                        slots=draw(st.integers(1, 6)), k=k, rebalance_every=draw(st.integers(1, 3)),
                        borrowed=draw(st.integers(0, 2)), legacy_topup=draw(st.booleans()),
                        filter_groups=False, admission="lean", depth=draw(st.none() | st.floats(1.0, k + 2.0)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=lean_configs(), seed=st.integers(0, 2**32 - 1), lose=st.integers(0, 2))
def test_lean_keeps_staleness_within_k_and_the_pipeline_within_its_cap(cfg, seed, lose):
    lose = min(lose, cfg.n_instances - 1)
    driver = HoldChecked(policy_for("dora", cfg), random.Random(seed), lose=lose)
    driver.run(steps=10)  # raises InvariantBroken: staleness > K, a split or lost group, a deadlock
    driver.check_nothing_lost()
    assert max(driver.staleness) <= cfg.k


def _mean_staleness(k: int, seed: int, admission: str, depth: float | None = None) -> float:
    cfg = PolicyConfig(tbs=4, rbs=None, group_size=2, n_instances=4, slots=4, k=k, admission=admission, depth=depth,
                       legacy_topup=admission == "eager")
    driver = RandomDriver(policy_for("dora", cfg), random.Random(seed))
    driver.run(steps=30)  # a train step ends as often as any one request: rollout can outpace the trainer
    return statistics.mean(driver.staleness[4 * 2 * (k + 1):])  # past the window's fill


def test_the_pipeline_depth_sets_the_mean_staleness_and_k_only_bounds_it():
    for k in (2, 3):
        eager = statistics.mean(_mean_staleness(k, s, "eager") for s in range(3))
        learned = statistics.mean(_mean_staleness(k, s, "lean") for s in range(3))
        one_batch = statistics.mean(_mean_staleness(k, s, "lean", depth=1.0) for s in range(3))
        two_batches = statistics.mean(_mean_staleness(k, s, "lean", depth=2.0) for s in range(3))
        assert eager > k - 0.1, eager          # eager fills the window: nearly every group is K stale
        assert one_batch == 0                  # nothing admitted while the trainer trains: synchronous
        assert 0.7 < two_batches < 1.1         # the next batch is made while this one trains
        assert learned < eager - 0.3, (learned, eager)  # learned: between (it pays staleness for no trainer wait)


def test_the_learned_depth_shrinks_with_surplus_and_grows_by_what_the_cap_held_back():
    lean = LeanDepth(tbs=8, k=3)
    assert lean.depth == 16                        # a batch in training and the next one in the making
    lean.on_trainer_free(complete=8, can_train=True)
    assert lean.depth == 16                        # exactly a batch: nothing to spare
    lean.on_trainer_free(complete=14, can_train=True)
    assert lean.depth == 15                        # 6 groups to spare: at least one goes
    lean.on_trainer_free(complete=31, can_train=True)
    assert lean.depth == 12                        # 23 to spare: an eighth of them, rounded up
    lean.on_trainer_free(complete=5, can_train=False)
    assert lean.depth == 12                        # short, but the cap withheld nothing: not its doing
    assert lean.room(in_pipeline=11, wanted=5) == 1 and lean.capped
    assert lean.room(in_pipeline=12, wanted=2) == 0 and lean.withheld == 4  # the most held back at once
    lean.on_trainer_free(complete=6, can_train=False)
    assert lean.depth == 14 and not lean.capped    # short by 2, 4 held back: 2 more
    assert lean.room(in_pipeline=14, wanted=1) == 0
    lean.on_trainer_free(complete=0, can_train=False)
    assert lean.depth == 15                        # short by 8, but only 1 held back: the cap does not ratchet
    for _ in range(30):
        lean.room(in_pipeline=lean.depth, wanted=8)
        lean.on_trainer_free(complete=0, can_train=False)
    assert lean.depth == lean.ceiling == 32        # never past what the window holds: (K + 1) batches
    for _ in range(40):
        lean.on_trainer_free(complete=9, can_train=True)
    assert lean.depth == 8                         # never below one batch; a surplus of 1 still shrinks it
    fixed = LeanDepth(tbs=8, k=3, fixed=1.5)
    fixed.on_trainer_free(complete=30, can_train=True)
    assert fixed.depth == 12                      # dora.depth: not learned
    assert LeanDepth(tbs=8, k=1, depth=40).depth == 16  # a restored cap is clamped to this run's range


def test_a_group_queued_whole_takes_the_version_it_will_start_under():
    view = ClusterView(n_instances=1, slots=2, group_size=2)
    view.enqueue_group(0, 0)
    view.enqueue_group(1, 0)
    view.trajs[1].started = True              # sample 1 of group 0 ran on a lost instance: queued again
    assert view.retag_unstarted(1) == [(1, 0)]
    assert list(view.queues[0]) == [0, 1] and list(view.queues[1]) == [2, 3]
    assert view.trajs[2].version == view.trajs[3].version == 1 and view.trajs[0].version == 0


def test_lean_retags_whole_queued_groups_at_a_publish_and_the_window_follows():
    from dora_hpc.core.events import InstanceReady, RequestFinished, Start, StartTrain, VersionPublished

    cfg = PolicyConfig(tbs=1, rbs=None, group_size=2, n_instances=2, slots=2, k=3, admission="lean", depth=3.0)
    p = policy_for("dora", cfg)
    p.on(Start())
    p.on(InstanceReady(0, 0))
    p.on(InstanceReady(1, 0))
    assert p._in_pipeline() == 2 and p.window.unconsumed == {0: 2}  # two groups fill the 4 slots
    out = p.on(RequestFinished(0, 0)) + p.on(RequestFinished(1, 0))
    step = [c for c in out if isinstance(c, StartTrain)]
    assert step and step[0].group_ids == (0,)
    gid = p.admit(0)  # a group queued under v0 that has not started when v1 is published
    p.on(VersionPublished(1))
    assert p.ledger.groups[gid].version == 1 and p.window.unconsumed.get(1, 0) >= 1
