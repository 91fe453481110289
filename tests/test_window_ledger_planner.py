import pytest

from dora_hpc.core.cluster import ClusterView
from dora_hpc.core.events import AssignVersion, Migrate
from dora_hpc.core.ledger import GroupState, Ledger, LedgerError
from dora_hpc.core.planner import VersionLoad, plan, target_counts
from dora_hpc.core.window import StalenessViolation, VersionWindow


def test_window_admission_and_gate_k1():
    w = VersionWindow(k=1, tbs=2)
    assert w.room(0) == 4  # v0 groups may be consumed by steps 0 and 1
    for _ in range(4):
        w.admit(0)
    assert w.room(0) == 0
    with pytest.raises(StalenessViolation):
        w.admit(0)
    assert not w.can_train({0: 1})
    assert w.can_train({0: 2})
    assert w.consume([0, 0]) == 0
    # step 1 must take the last two v0 groups: two v1 groups alone cannot start it
    w.publish(1)
    w.admit(1)
    w.admit(1)
    assert not w.can_train({1: 2})
    assert not w.can_train({0: 1, 1: 2})
    assert w.can_train({0: 2, 1: 2})
    assert w.oldest == 0
    w.consume([0, 0])
    assert w.oldest == 1  # the window slid only once v0 was fully consumed
    with pytest.raises(StalenessViolation):
        w.consume([0])


def test_window_legacy_slack_and_roundtrip():
    w = VersionWindow(k=2, tbs=1)
    w.admit(0)
    w.consume([0])
    w.publish(1)
    # v0 may still be consumed by steps 1 and 2; with slack 2 it is out of the window
    assert w.room(0) == 2 and w.room(0, slack=1) == 2 and w.room(0, slack=2) == 0
    assert w.room(1) == 3
    w.admit(1)
    w2 = VersionWindow.from_dict(w.to_dict())
    assert w2 == w
    with pytest.raises(ValueError):
        w.publish(3)


def test_ledger_exactly_once():
    led = Ledger(group_size=2)
    g = led.new_group(version=0)
    assert not led.finish(0)
    with pytest.raises(LedgerError):
        led.finish(0)
    assert led.finish(1)
    led.consume(g, step=0)
    with pytest.raises(LedgerError):
        led.consume(g, step=1)
    with pytest.raises(LedgerError):
        led.drop(g, "late")
    g2 = led.new_group(version=1)
    led.drop(g2, "oversample")
    with pytest.raises(LedgerError):
        led.consume(g2, 1)
    with pytest.raises(LedgerError):
        led.finish(99)
    back = Ledger.from_dict(led.to_dict())
    assert back.totals() == led.totals() == {
        "dispatched": 2, "pending": 0, "complete": 0, "consumed": 1, "dropped": 1, "filtered": 0}
    assert back.groups[g2].state is GroupState.DROPPED and back.next_group == 2


def test_target_counts_proportional_with_bounds():
    loads = {0: VersionLoad(active=3, queued=0), 1: VersionLoad(active=0, queued=40)}
    t = target_counts(n=8, slots=4, loads=loads, latest=1)
    assert t == {0: 1, 1: 7}  # legacy keeps what its 3 live requests need, latest gets the rest
    loads = {0: VersionLoad(active=20, queued=0), 1: VersionLoad(active=0, queued=20)}
    assert target_counts(n=10, slots=4, loads=loads, latest=1) == {0: 5, 1: 5}
    # a version with live requests never gets 0
    loads = {0: VersionLoad(1, 0), 1: VersionLoad(1, 0), 2: VersionLoad(0, 100)}
    t = target_counts(n=3, slots=4, loads=loads, latest=2)
    assert t[0] >= 1 and t[1] >= 1 and sum(t.values()) == 3


def test_target_counts_oldest_first_serves_the_oldest_versions_pending_work_first():
    """The straggler-aware planner: the work the next train steps consume (the oldest version's) gets every
    instance its requests can fill; newer versions keep their lower bound and share what is left."""
    loads = {0: VersionLoad(active=4, queued=20), 1: VersionLoad(active=4, queued=4), 2: VersionLoad(0, 60)}
    assert target_counts(n=8, slots=4, loads=loads, latest=2) == {0: 2, 1: 1, 2: 5}  # proportional
    assert target_counts(n=8, slots=4, loads=loads, latest=2, oldest_first=True) == {0: 6, 1: 1, 2: 1}
    view, gid = _view_with([0, 1, 2, 2], [4, 4, 1, 0])
    for g in range(gid, gid + 8):
        view.enqueue_group(g, 0)
    cmds = plan(view, latest=2, oldest_first=True)  # v2's free instance goes to v0, v2's request stays
    assert [(c.instance, c.version) for c in cmds if isinstance(c, AssignVersion)] == [(3, 0)]
    assert not [c for c in cmds if isinstance(c, Migrate)]


def _view_with(versions, active_per_instance, slots=4):
    view = ClusterView(len(versions), slots, group_size=1)
    for i, v in enumerate(versions):
        view.assign(AssignVersion(i, v))
        view.ready(i, v)
    gid = 0
    for i, n in enumerate(active_per_instance):
        for _ in range(n):
            view.enqueue_group(gid, versions[i])
            view._put(gid, i)
            view.queues[versions[i]].remove(gid)
            gid += 1
    return view, gid


def test_plan_consolidates_legacy_and_hands_instances_to_latest():
    # 4 instances on v0, each with one residual request; v1 has 12 queued requests.
    view, gid = _view_with([0, 0, 0, 0], [1, 1, 1, 1])
    for g in range(gid, gid + 12):
        view.enqueue_group(g, 1)
    cmds = plan(view, latest=1)
    migrates = [c for c in cmds if isinstance(c, Migrate)]
    assigns = [c for c in cmds if isinstance(c, AssignVersion)]
    assert len(assigns) == 3 and all(a.version == 1 for a in assigns)
    assert assigns[0].source == -1  # nobody holds v1 yet: from the trainer
    assert len(migrates) == 3 and len({m.dst for m in migrates}) == 1
    assert all(m.carry_kv for m in migrates)
    kept = migrates[0].dst
    assert len(view.instances[kept].active) == 4 and view.instances[kept].version == 0
    # nothing starved -> no moves (hysteresis)
    view2, _ = _view_with([0, 1], [1, 0])
    assert plan(view2, latest=1) == []


def test_plan_uses_peer_weights_when_a_peer_holds_the_version():
    view, gid = _view_with([0, 0, 1], [0, 0, 4])
    for g in range(gid, gid + 8):
        view.enqueue_group(g, 1)
    cmds = plan(view, latest=1)
    assert {c.source for c in cmds if isinstance(c, AssignVersion)} == {2}


def test_the_work_estimate_is_the_mean_residual_length_of_the_responses_seen():
    from dora_hpc.core.work import WorkEstimate

    w = WorkEstimate()
    assert w.remaining(7) == 1.0 and w.expected() == 1.0  # nothing finished yet: every request alike
    for t, n in enumerate([10, 20, 30, 100]):
        w.finished(t, n)
    assert w.expected() == 40.0
    w.progress(((7, 0), (8, 25), (9, 150)))
    assert w.remaining(7) == 40.0            # not started: the mean length
    assert w.remaining(8) == 65 - 25         # longer than 25: 30 and 100, mean 65
    assert w.remaining(9) == 150             # past every finished length: as much again
    w.finished(8, 0)                          # its length unreported: forgotten, not counted
    assert 8 not in w.decoded and w.lengths == [10, 20, 30, 100]


def test_the_work_planner_weighs_versions_by_decode_tokens_left_within_the_same_bounds():
    from dora_hpc.core.planner import VersionLoad, target_counts

    # v0: 4 long stragglers decoding and 1 request queued (a lost instance's); v1 (latest): 16 queued
    count = {0: VersionLoad(active=4, queued=1), 1: VersionLoad(active=0, queued=16)}
    work = {0: VersionLoad(4, 1, work=4 * 900.0 + 300.0), 1: VersionLoad(0, 16, work=16 * 300.0)}
    assert target_counts(6, 4, count, latest=1) == {0: 1, 1: 5}
    assert target_counts(6, 4, work, latest=1) == {0: 2, 1: 4}  # its work fills the two instances it can use
    # a legacy version with nothing queued keeps what its requests need either way (lower = upper bound)
    alone = {0: VersionLoad(6, 0, work=6 * 5000.0), 1: VersionLoad(0, 16, work=16.0)}
    assert target_counts(6, 4, alone, latest=1) == {0: 2, 1: 4}


def _ready_view(slots: int, group_size: int, groups: int, together: bool) -> ClusterView:
    """Three instances hosting v0, ``groups`` groups of v0 queued."""
    view = ClusterView(3, slots, group_size=group_size, group_together=together)
    for i in range(3):
        view.assign(AssignVersion(i, 0))
        view.ready(i, 0)
    for g in range(groups):
        view.enqueue_group(g, 0)
    return view


@pytest.mark.parametrize("together", [False, True])
def test_a_groups_samples_go_where_one_of_them_runs_when_the_engines_share_its_prompt(together):
    """3 instances of 8 slots, groups of 4: least loaded first spreads each group over the instances; with
    group_together each group runs on one instance while that has room. A group that does not fit is
    split: its first samples fill the instance with room, the rest wait for a slot."""
    view = _ready_view(slots=8, group_size=4, groups=6, together=together)

    def groups(cmds):
        where = {}
        for d in cmds:
            where.setdefault(d.group_id, set()).add(d.instance)
        return where

    where = groups(view.place(0))
    assert len(where) == 6 and sum(view.instances[i].free for i in range(3)) == 0
    assert all(len(s) == 1 for s in where.values()) if together else all(len(s) > 1 for s in where.values())
    freed = {view.remove(0).instance, view.remove(1).instance}  # together: group 0's instance, 2 slots
    view.enqueue_group(6, 0)
    assert groups(view.place(0)) == {6: freed} and len(view.queues[0]) == 2
    assert len(freed) == (1 if together else 2)


@pytest.mark.parametrize("together", [False, True])
def test_the_planner_moves_a_released_instances_samples_to_where_their_group_runs(together):
    """Groups of 2 on three v0 instances of 4 slots; v1 is starved, so the emptiest (instance 2, running
    sample 0 of groups 0 and 1) is released. Best fit alone sends each to the fullest peer with room,
    splitting both groups; with group_together each joins its sibling, whose prompt that engine holds."""
    view = _ready_view(slots=4, group_size=2, groups=4, together=together)
    for tid, i in {0: 2, 2: 2, 3: 0, 4: 0, 5: 0, 1: 1, 6: 1}.items():
        view._put(tid, i)
        view.queues[0].remove(tid)
    view.queues[0].remove(7)
    del view.trajs[7]
    for g in range(4, 6):
        view.enqueue_group(g, 1)
    moves = {m.traj_id: m.dst for m in plan(view, latest=1) if isinstance(m, Migrate)}
    assert moves == ({0: 1, 2: 0} if together else {0: 0, 2: 1}), moves


@pytest.mark.parametrize("together", [False, True])
def test_a_released_instances_group_moves_whole_to_a_peer_it_fits_on(together):
    """Groups of 3 on three v0 instances of 6 slots. Instance 2 (the emptiest: group 0 alone) is released for a
    starved v1. Best fit sends the first sample to the fullest peer with room (instance 0, 2 free) and the
    group splits 2 / 1, its prompt then held on two engines; with group_together the group moves whole to the
    peer with room for all three (instance 1)."""
    view = _ready_view(slots=6, group_size=3, groups=4, together=together)
    where = {0: 2, 1: 2, 2: 2, 3: 0, 4: 0, 5: 0, 6: 0, 7: 1, 8: 1, 9: 1}
    for tid, i in where.items():
        view._put(tid, i)
        view.queues[0].remove(tid)
    view.queues[0].remove(10)
    view.queues[0].remove(11)
    del view.trajs[10], view.trajs[11]
    for g in range(4, 7):
        view.enqueue_group(g, 1)
    moves = {m.traj_id: m.dst for m in plan(view, latest=1) if isinstance(m, Migrate)}
    assert moves == ({0: 1, 1: 1, 2: 1} if together else {0: 0, 1: 0, 2: 1}), moves
