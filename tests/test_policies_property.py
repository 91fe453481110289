"""Property tests: every policy, random configs, random completion orders -> the run invariants (docs/invariants.md)."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from random_driver import InvariantBroken, RandomDriver

from dora_hpc.core.events import (
    TRAINER,
    AssignVersion,
    Dispatch,
    InstanceJoined,
    InstanceLost,
    InstanceReady,
    RequestFinished,
    Start,
    StartTrain,
    VersionPublished,
)
from dora_hpc.core.policies import MODES, PolicyConfig, policy_for


@st.composite
def configs(draw, mode: str):
    tbs = draw(st.integers(1, 4))
    streaming = mode in ("partial", "dora", "oversample")
    rbs = tbs + (draw(st.integers(0, 4)) if streaming else 0)
    if mode in ("partial", "dora") and draw(st.booleans()):
        rbs = None  # batch.rbs: auto
    shared = mode == "dora" and draw(st.booleans())  # train.lora: versions share instances
    borrowed = draw(st.integers(0, 3)) if mode == "dora" and not shared else 0  # cluster.elastic
    k = draw(st.integers(0, 3))
    admission = draw(st.sampled_from(["eager", "lean"])) if mode == "dora" else "eager"
    depth = draw(st.none() | st.floats(1.0, k + 2.0)) if admission == "lean" else None
    return PolicyConfig(borrowed=borrowed, admission=admission, depth=depth,
                        by_work=mode == "dora" and draw(st.booleans()),
        tbs=tbs, rbs=rbs, group_size=draw(st.integers(1, 4)), n_instances=draw(st.integers(1, 5)),
        slots=draw(st.integers(1, 6)), k=k,
        rebalance_every=draw(st.integers(1, 3)), carry_kv=draw(st.booleans()),
        legacy_topup=draw(st.booleans()), topup_after_rebalance=draw(st.booleans()),
        group_together=draw(st.booleans()), shared_instances=shared,
    )


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_invariants_hold_under_random_completion_orders(mode, data, seed):
    cfg = data.draw(configs(mode))
    driver = RandomDriver(policy_for(mode, cfg), random.Random(seed))
    driver.run(steps=8)  # raises InvariantBroken on any violation or deadlock
    driver.check_nothing_lost()
    assert driver.steps_done == 8


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), seed=st.integers(0, 2**32 - 1), lose=st.integers(1, 3))
def test_invariants_hold_when_instances_are_lost(mode, data, seed, lose):
    """Fenced instances (a hung or dead rollout rank) at random moments: their trajectories start again
    elsewhere under their own tag; every invariant holds and the run still makes its steps."""
    cfg = data.draw(configs(mode))
    if cfg.n_instances < 2:
        cfg = PolicyConfig(**{**cfg.__dict__, "n_instances": 2})
    lose = min(lose, cfg.n_instances - 1)
    if mode == "partial":  # it starts a group only when all its samples fit at once: keep room for one
        lose = max(0, min(lose, cfg.n_instances - -(-cfg.group_size // cfg.slots)))
    driver = RandomDriver(policy_for(mode, cfg), random.Random(seed), lose=lose)
    driver.start()
    if lose:
        driver.lose(driver.rng.randrange(cfg.n_instances))  # one at once, while its first load is in flight
    driver.run(steps=8)
    driver.check_nothing_lost()
    assert driver.steps_done == 8 and len(driver.lost) >= min(lose, 1)


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), seed=st.integers(0, 2**32 - 1), lose=st.integers(1, 3))
def test_invariants_hold_when_lost_instances_are_replaced(mode, data, seed, lose):
    """Instances lost at random moments and their replacements joining at others (InstanceJoined): a
    replacement is given nothing while lost, loads a version, takes work again; every invariant holds
    (staleness <= K, nothing lost or trained twice, one version an episode) and the run makes its steps."""
    cfg = data.draw(configs(mode))
    if cfg.n_instances < 2:
        cfg = PolicyConfig(**{**cfg.__dict__, "n_instances": 2})
    lose = min(lose, cfg.n_instances - 1)
    if mode == "partial":
        lose = max(0, min(lose, cfg.n_instances - -(-cfg.group_size // cfg.slots)))
    driver = RandomDriver(policy_for(mode, cfg), random.Random(seed), lose=lose, rejoin=True)
    driver.run(steps=12)
    driver.check_nothing_lost()
    assert driver.steps_done == 12


def test_a_replacement_loads_the_latest_version_and_takes_work():
    """DORA, two instances: instance 0 is lost mid-run, its replacement joins, loads the latest version
    (from instance 1 when it holds it, else from the trainer) and is dispatched requests again; a joined
    instance that was never lost is refused."""
    cfg = PolicyConfig(tbs=2, rbs=3, group_size=2, n_instances=2, slots=2, k=2)
    driver = RandomDriver(policy_for("dora", cfg), random.Random(3), lose=1)
    driver.run(steps=3)
    driver.lose(0)
    driver.advance(steps=5)
    latest = driver.p.latest
    peer = driver.p.view.hosts(latest, ready_only=True) == [1]
    cmds = driver.p.on(InstanceJoined(0))
    assert cmds == [AssignVersion(0, latest, 1 if peer else TRAINER)]
    driver.lost.discard(0)
    driver.joined.add(0)
    for cmd in cmds:
        driver.execute(cmd)
    driver.advance(steps=10)
    driver.check_nothing_lost()
    assert 0 in driver.served_after_join
    with pytest.raises(ValueError, match="never lost"):
        driver.p.on(InstanceJoined(1))


def test_a_replacement_loads_from_a_peer_that_holds_the_latest_version():
    """When a live instance already holds the latest version, a replacement loads it from that peer, not
    from the trainer (a replacement dying mid-load then costs a rollout instance, not the start)."""
    cfg = PolicyConfig(tbs=2, rbs=3, group_size=2, n_instances=2, slots=2, k=2)
    driver = RandomDriver(policy_for("dora", cfg), random.Random(0), lose=1)
    driver.run(steps=3)
    driver.lose(0)
    for _ in range(2000):
        if driver.p.view.hosts(driver.p.latest, ready_only=True) == [1]:
            break
        driver.step_once()
    assert driver.p.on(InstanceJoined(0)) == [AssignVersion(0, driver.p.latest, 1)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_dynamic_sampling_filters_equal_reward_groups_and_still_trains_tbs_per_step(data, seed):
    """DORA with filter_groups: binary rewards, so groups of equal rewards are common; each is filtered
    (never trained on), leaves the window, and a replacement keeps every step at TBS informative groups."""
    drawn = data.draw(configs("dora")).__dict__
    cfg = PolicyConfig(**{**drawn, "filter_groups": True, "group_size": max(2, drawn["group_size"])})
    driver = RandomDriver(policy_for("dora", cfg), random.Random(seed))
    driver.run(steps=8)
    driver.check_nothing_lost()
    assert driver.steps_done == 8
    informative = [g for g in driver.consumed if len({driver.rewards[t] for t in driver.p.ledger.traj_ids(g)}) > 1]
    assert len(informative) == len(driver.consumed) >= 8 * cfg.tbs  # (a 9th step may have started)



def test_dynamic_sampling_really_filters():
    """Not vacuous: across seeds, groups are filtered and replaced."""
    cfg = PolicyConfig(tbs=2, rbs=3, group_size=2, n_instances=2, slots=2, k=2, filter_groups=True)
    filtered = 0
    for seed in range(20):
        d = RandomDriver(policy_for("dora", cfg), random.Random(seed))
        d.run(steps=8)
        d.check_nothing_lost()
        filtered += len(d.filtered)
    assert filtered > 20


def test_filter_groups_is_for_dora_only():
    cfg = PolicyConfig(tbs=1, rbs=2, group_size=2, n_instances=1, slots=2, filter_groups=True)
    with pytest.raises(ValueError, match="filter_groups"):
        policy_for("sync", cfg)


def test_dora_keeps_several_versions_live_and_migrates():
    """Across random runs, DORA really is multi-version and really migrates (not a vacuous pass)."""
    multi = migrated = 0
    stale = set()
    for seed in range(60):
        cfg = PolicyConfig(tbs=2, rbs=4, group_size=2, n_instances=3, slots=3, k=2)
        d = RandomDriver(policy_for("dora", cfg), random.Random(seed))
        d.run(steps=10)
        multi += d.max_live_versions > 1
        migrated += d.migrations > 0
        stale |= set(d.staleness)
    assert multi > 30 and migrated > 5
    assert max(stale) <= 2 and 2 in stale


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_shared_instances_run_several_versions_on_one_instance_and_never_migrate(data, seed):
    """Versions as adapters (PolicyConfig.shared_instances): every instance adds each new version and retires the
    ones no trajectory needs; nothing migrates; the invariants hold; at most K + 2 versions are hosted on an instance
    (the K + 1 the window holds, and one it left whose retirement waits for the next version's load)."""
    cfg = data.draw(configs("dora"))
    cfg = PolicyConfig(**{**cfg.__dict__, "shared_instances": True, "borrowed": 0})
    driver = RandomDriver(policy_for("dora", cfg), random.Random(seed))
    hosted = []
    for step in range(1, 9):
        driver.run(steps=step)
        hosted += [len(driver.serving(i)) for i in range(cfg.n_instances)]
    driver.check_nothing_lost()
    assert driver.migrations == 0 and max(hosted) <= cfg.k + 2


def test_shared_instances_do_mix_versions_in_one_instance():
    mixed = []
    for seed in range(6):
        cfg = PolicyConfig(tbs=2, rbs=6, group_size=2, n_instances=2, slots=6, k=2, shared_instances=True)
        d = RandomDriver(policy_for("dora", cfg), random.Random(seed))
        d.run(steps=10)
        mixed.append(d.mixed_instances)
    assert max(mixed) >= 2, mixed  # requests of two versions or more ran on one instance at once


def test_shared_instances_need_dora_and_no_borrowed_instances():
    for mode in ("sync", "partial"):
        with pytest.raises(ValueError, match="shared instances"):
            policy_for(mode, PolicyConfig(tbs=1, rbs=2 if mode == "partial" else 1, group_size=1, n_instances=1,
                                          slots=1, shared_instances=True))
    with pytest.raises(ValueError, match="borrowed"):
        policy_for("dora", PolicyConfig(tbs=1, rbs=2, group_size=1, n_instances=1, slots=1, borrowed=1,
                                        shared_instances=True))


def test_partial_records_reprefill_and_oversample_drops():
    cfg = PolicyConfig(tbs=2, rbs=4, group_size=2, n_instances=2, slots=4)
    d = RandomDriver(policy_for("partial", cfg), random.Random(1))
    d.run(steps=10)
    assert d.reprefills > 0
    d = RandomDriver(policy_for("oversample", cfg), random.Random(1))
    d.run(steps=10)
    assert d.dropped and all(d.p.ledger.groups[g].state.name == "DROPPED" for g in d.dropped)
    d.check_nothing_lost()


def test_the_checker_catches_a_broken_policy():
    """The invariant checker is not vacuous: a policy that over-consumes stale data is caught."""
    cfg = PolicyConfig(tbs=2, rbs=6, group_size=1, n_instances=2, slots=2, k=0)
    policy = policy_for("dora", cfg)
    policy.window.k = 5  # lie to the window: it now admits groups that K=0 forbids
    with pytest.raises(InvariantBroken, match="staleness"):
        for seed in range(20):
            policy = policy_for("dora", cfg)
            policy.window.k = 5
            RandomDriver(policy, random.Random(seed)).run(steps=6)


def checkpointed_run(mode: str, cfg: PolicyConfig, rng: random.Random, before: int, after: int):
    """A run that checkpoints after ``before`` random events and goes on for ``after`` more (a future the
    crash loses): (the driver, the policy's snapshot as a checkpoint keeps it, its version)."""
    first = RandomDriver(policy_for(mode, cfg), rng)
    first.feed(Start())
    for _ in range(before):
        first.step_once()
    snapshot, version = first.p.snapshot(), first.p.next_step
    for _ in range(after):
        first.step_once()
    return first, snapshot, version


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), seed=st.integers(0, 2**32 - 1), before=st.integers(0, 300), after=st.integers(0, 50),
       lose=st.floats(0, 1))
def test_resume_from_any_checkpoint_keeps_invariants(mode, data, seed, before, after, lose):
    """Checkpoint at a random moment, run on a little (that future is lost), crash, restore a fresh
    policy from the checkpoint's ledger, and continue: the invariants hold across the restart."""
    from dora_hpc.core.ledger import GroupState, Ledger
    from dora_hpc.core.resume import plan_resume

    cfg = data.draw(configs(mode))
    rng = random.Random(seed)
    _, snapshot, version = checkpointed_run(mode, cfg, rng, before, after)
    ledger = Ledger.from_dict(snapshot["ledger"])
    complete = [g for g, r in ledger.groups.items() if r.state is GroupState.COMPLETE]
    # rows of complete groups may be lost with the crash (streaming policies re-dispatch them)
    lost = set(complete[: int(len(complete) * lose)]) if mode in ("dora", "partial") else set()
    stored = {g: cfg.group_size for g in complete if g not in lost}
    plan = plan_resume(ledger, version, stored)
    assert set(plan.redispatch) >= lost
    policy = policy_for(mode, cfg)
    policy.restore(ledger, plan, snapshot.get("window"))  # a windowed policy checks the stored window
    if getattr(policy, "lean", None) is not None and cfg.depth is None:
        assert policy.lean.depth == snapshot["window"]["depth"]  # lean admission's learned cap is kept
    second = RandomDriver.resumed(policy, rng, snapshot["ledger"], plan.requeue)
    second.run(steps=version + 6)
    second.check_nothing_lost()
    assert second.steps_done == version + 6
    consumed = [g for g, r in policy.ledger.groups.items() if r.state is GroupState.CONSUMED]
    assert len(consumed) == policy.next_step * cfg.tbs  # every step (incl. one in progress) took TBS groups


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), seed=st.integers(0, 2**32 - 1), before=st.integers(0, 300), after=st.integers(0, 50))
def test_resume_with_dynamic_sampling_keeps_filtered_groups_filtered(data, seed, before, after):
    """DORA with filter_groups, checkpointed at a random moment and restored: a group filtered before the
    checkpoint is never trained on after it, every step still takes TBS informative groups, nothing is lost."""
    from dora_hpc.core.ledger import GroupState, Ledger
    from dora_hpc.core.resume import plan_resume

    drawn = data.draw(configs("dora")).__dict__
    cfg = PolicyConfig(**{**drawn, "filter_groups": True, "group_size": max(2, drawn["group_size"])})
    rng = random.Random(seed)
    first, snapshot, version = checkpointed_run("dora", cfg, rng, before, after)
    ledger = Ledger.from_dict(snapshot["ledger"])
    filtered = {g for g, r in ledger.groups.items() if r.state is GroupState.FILTERED}
    stored = {g: cfg.group_size for g, r in ledger.groups.items() if r.state is GroupState.COMPLETE}
    plan = plan_resume(ledger, version, stored)
    assert not filtered.intersection(plan.requeue + plan.redispatch)
    policy = policy_for("dora", cfg)
    policy.restore(ledger, plan, snapshot.get("window"))  # a windowed policy checks the stored window
    second = RandomDriver.resumed(policy, rng, snapshot["ledger"], plan.requeue)
    second.rewards.update(first.rewards)  # requeued groups' rewards, as the shards hold them
    second.run(steps=version + 6)
    second.check_nothing_lost()
    after_restart = [g for g, r in policy.ledger.groups.items() if r.state is GroupState.CONSUMED
                     and r.consume_step >= version]
    assert not filtered.intersection(after_restart) and len(after_restart) >= 6 * cfg.tbs


def test_resume_refuses_a_ledger_ahead_of_its_weights():
    from dora_hpc.core.ledger import Ledger
    from dora_hpc.core.resume import ResumeError, plan_resume

    led = Ledger(group_size=1)
    g = led.new_group(0)
    led.finish(g)
    led.consume(g, step=3)
    with pytest.raises(ResumeError, match="consumed by later steps"):
        plan_resume(led, 2, {})


def test_dora_gives_an_idle_instance_to_a_starved_version_when_its_load_completes():
    """Found by the property test above (CI, 1 in ~1500 runs): the one live instance finished loading a
    version with no work left while the latest version's groups waited; it must be re-assigned at once
    (a driver that sends no Tick would otherwise wait forever)."""
    p = policy_for("dora", PolicyConfig(tbs=1, rbs=1, group_size=1, n_instances=2, slots=1, k=0))
    assert [type(c) for c in p.on(Start())] == [AssignVersion, AssignVersion]
    assert [type(c) for c in p.on(InstanceReady(0, 0))] == [Dispatch]
    assert [type(c) for c in p.on(RequestFinished(0, 0, 1.0))] == [StartTrain]
    out = p.on(VersionPublished(1))  # instance 1 still loads v0: instance 0 is handed to v1
    assert AssignVersion(0, 1, -1, False) in out
    assert p.on(InstanceLost(0)) == []  # the v1 load dies with it; instance 1 is still loading v0
    out = p.on(InstanceReady(1, 0))  # v0 has no work left; v1's group waits
    assert [(type(c), c.instance, c.version) for c in out] == [(AssignVersion, 1, 1)]
    assert [type(c) for c in p.on(InstanceReady(1, 1))] == [Dispatch]


def test_resume_refuses_a_stored_window_that_its_ledger_contradicts():
    """DORA rebuilds its window from the checkpoint's ledger and checks it against the stored window."""
    from dora_hpc.core.ledger import GroupState, Ledger
    from dora_hpc.core.resume import ResumeError, plan_resume

    cfg = PolicyConfig(tbs=2, rbs=6, group_size=1, n_instances=2, slots=2, k=2)
    _, snapshot, version = checkpointed_run("dora", cfg, random.Random(3), 60, 0)
    ledger = Ledger.from_dict(snapshot["ledger"])
    stored = {g: 1 for g, r in ledger.groups.items() if r.state is GroupState.COMPLETE}
    plan = plan_resume(ledger, version, stored)
    policy_for("dora", cfg).restore(Ledger.from_dict(snapshot["ledger"]), plan, snapshot["window"])  # agrees
    bad = {**snapshot["window"], "unconsumed": {**snapshot["window"]["unconsumed"], "0": 99}}
    with pytest.raises(ResumeError, match="window"):
        policy_for("dora", cfg).restore(Ledger.from_dict(snapshot["ledger"]), plan, bad)


def test_auto_rbs_fills_the_free_slots_within_the_window():
    """rbs: auto admits what the free slots hold (a fixed RBS stops at RBS groups) and never more than the
    window allows: with K=0 only TBS groups of the latest version can ever be consumed."""
    base = dict(tbs=2, group_size=2, n_instances=2, slots=4, k=2)
    fixed, auto = (policy_for("dora", PolicyConfig(rbs=rbs, **base)) for rbs in (2, None))
    for p in (fixed, auto):
        p.on(Start())
        for i in range(2):
            p.on(InstanceReady(i, 0))
    assert fixed.pending_groups == 2 and auto.pending_groups == 4  # 2 x 4 slots / groups of 2
    assert auto.capacity() == 0 and len(auto.view.trajs) == 8
    tight = policy_for("dora", PolicyConfig(rbs=None, **{**base, "k": 0}))
    tight.on(Start())
    for i in range(2):
        tight.on(InstanceReady(i, 0))
    assert tight.pending_groups == 2  # the window (TBS x (K + 1)), not the slots, bounds it


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_borrowed_instances_serve_while_the_trainer_waits_and_sleep_while_it_trains(data, seed):
    """cluster.elastic: borrowed instances (after the dedicated ones) take requests while the trainer is
    idle; before each StartTrain they migrate or offload every request and sleep (the driver refuses a step
    that starts while one serves); after it they wake, unless the next step starts at once (the driver
    refuses a wake and a sleep in one decision), and restore what they parked. Invariants as always."""
    drawn = data.draw(configs("dora")).__dict__
    cfg = PolicyConfig(**{**drawn, "borrowed": data.draw(st.integers(1, 3)), "shared_instances": False})
    driver = RandomDriver(policy_for("dora", cfg), random.Random(seed))
    driver.run(steps=8)
    driver.check_nothing_lost()
    woke, slept = driver.elastic["wakes"], driver.elastic["sleeps"]
    assert driver.steps_done == 8 and woke + cfg.borrowed >= slept >= woke  # each woken one sleeps before a step
    assert driver.elastic["restores"] <= driver.elastic["offloads"]


def test_borrowed_instances_take_work_migrate_it_out_and_park_the_rest():
    """More work in flight than the dedicated instances hold: the borrowed ones serve, and their drains
    both migrate (to dedicated room) and offload (none left), restoring the parked requests after the step."""
    total = dict.fromkeys(("sleeps", "offloads", "restores", "drain_migrations", "served", "wakes"), 0)
    for seed in range(20):
        cfg = PolicyConfig(tbs=2, rbs=None if seed % 2 else 4, group_size=2, n_instances=2, slots=3, k=2, borrowed=2)
        driver = RandomDriver(policy_for("dora", cfg), random.Random(seed))
        driver.run(steps=8)
        driver.check_nothing_lost()
        total["served"] += len(driver.served & driver.borrowed)
        for key, n in driver.elastic.items():
            total[key] += n
    assert all(n > 0 for n in total.values()), total


def test_elastic_is_for_dora_only():
    with pytest.raises(ValueError, match="borrowed instances"):
        policy_for("partial", PolicyConfig(tbs=1, rbs=2, group_size=1, n_instances=1, slots=1, borrowed=1))
