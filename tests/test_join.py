"""A replacement joins a running job in a fenced rollout rank's place (runtime/join.py), under the local
launcher, over links (runtime/link.py: gloo pairs outside MPI), with MPICH's OFI netmod in the run, as
``slurm.fence_rollout`` makes every Slurm job use it."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dora_hpc.analysis.basic import analyze

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "dora_hpc.cli"]
OFI = {**os.environ, "MPIR_CVAR_CH4_NETMOD": "ofi"}


def wait_for(cond, what: str, timeout: float = 120, log=None) -> None:
    """Poll ``cond``; on timeout fail naming ``what``, with the run's log's tail when given (``log()``)."""
    end = time.time() + timeout
    while not cond():
        assert time.time() < end, f"timed out waiting for {what}" + (f"; the run's log ends:\n{log()[-3000:]}"
                                                                      if log else "")
        time.sleep(0.2)


PROCS: list[subprocess.Popen] = []  # every process a test started: none outlives it


def finish_soon(run_dir: Path, after: int) -> int:
    """Ask the run to end ``after`` steps past the ones logged now (``dora-hpc finish``); the step it ends at."""
    from test_ft import run_dir_steps

    logged = run_dir_steps(run_dir)
    p = subprocess.run(CLI + ["finish", str(run_dir), "--at", str(logged + after)], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return logged + after


def join(run_dir: Path, *sets: str, role: str | None = None) -> subprocess.Popen:
    PROCS.append(subprocess.Popen(CLI + ["join", str(run_dir), *[x for kv in sets for x in ("--set", kv)],
                                         *(["--role", role] if role else [])],
                                  cwd=REPO, env=OFI, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return PROCS[-1]


@pytest.mark.slow
def test_replacements_join_a_running_job_and_bad_ones_are_refused(tmp_path):
    """One DORA run, two rollout instances, and five replacements in turn:
    * one while nothing is lost: refused (exit 2, one line), the run goes on;
    * rank 3 is SIGKILLed and fenced; one with another config: refused;
    * one joins in rank 3's place: linked to every live rank, it loads the latest version from the trainer
      and generates; it is SIGKILLed as soon as it joined (while it loads): fenced again (a send to it fails,
      or it is silent for the hang timeout);
    * the next one joins and stays to the end.
    The run makes every step with every invariant 0, and analyze shows both fences and both joins."""
    run_dir, err = tmp_path / "run", tmp_path / "run.err"
    steps = 60
    cmd = CLI + ["run", "configs/tiny-cpu.yaml", "--run-dir", str(run_dir), "--set", f"train.max_steps={steps}",
                 "--set", "batch.tbs=4", "--set", "batch.rbs=6", "--set", "cluster.rollout_instances=2",
                 "--set", "runtime.hang_timeout_s=8", "--set", "runtime.heartbeat_s=1"]
    with err.open("w") as f:
        run = subprocess.Popen(cmd, cwd=REPO, env=OFI, stdout=subprocess.DEVNULL, stderr=f)
    PROCS.append(run)
    log = err.read_text
    try:
        wait_for(lambda: len(list(run_dir.glob("train-*.h5"))) >= 2, "two train shards", log=log)
        p = join(run_dir)
        out = p.communicate(timeout=120)[1]
        assert p.returncode == 2 and "join refused: no rollout instance is lost" in out, out
        os.kill(int((run_dir / "pids" / "rank-3").read_text()), signal.SIGKILL)
        wait_for(lambda: "rank 3 (rollout instance 1) died: fenced" in log(), "rank 3 to be fenced", log=log)
        p = join(run_dir, "engine.kv_blocks=256")
        out = p.communicate(timeout=120)[1]
        assert p.returncode == 2 and "join refused: its config differs" in out, out
        first = join(run_dir)
        wait_for(lambda: log().count("its replacement joined") == 1, "the first replacement to join", log=log)
        first.kill()  # dies while it loads the latest version
        first.communicate()
        wait_for(lambda: len(re.findall(r"rank 3 \(rollout instance 1\) [^\n]*: fenced", log())) == 2,
                 "the first replacement to be fenced", log=log)
        second = join(run_dir)
        wait_for(lambda: log().count("its replacement joined") == 2, "the second replacement to join", log=log)
        steps = finish_soon(run_dir, after=6)  # of the 60 asked: enough for the last replacement to generate
        assert run.wait(timeout=400) == 0, log()[-3000:]
        out = second.communicate(timeout=60)[1]
        assert second.returncode == 0 and "joined as rank 3" in out, out
    finally:
        for proc in PROCS:
            if proc.poll() is None:
                proc.kill()
    a = analyze(run_dir)
    assert a["steps"] == steps and a["consumed"] == steps * 4 * 4
    assert not any(a["invariants"][k] for k in ("lost_groups", "duplicate_groups", "split_groups",
                                                "staleness_over_k", "mixed_version_trajectories")), a["invariants"]
    assert [f["rank"] for f in a["fenced"]] == [3, 3] and a["fenced"][0]["cause"] == "died"
    events = [(e["event"], e["instances"]) for e in a["instances"]["timeline"]]
    assert events == [("start", 2), ("fence", 1), ("join", 2), ("fence", 1), ("join", 2)], events
    joined_at = a["instances"]["joined"][-1]["t"]
    from dora_hpc.store.shards import read_table

    ops = read_table(run_dir, "events", "ops")
    linked = [(float(t), int(p)) for t, k, p in zip(ops["t_start"], ops["kind"], ops["peer"], strict=True)
              if k == "join_linked"]
    assert [p for _, p in sorted(linked)] == [1, 2, 1, 2], linked  # each join: its peers one after the other

    traj = read_table(run_dir, "traj", "trajectories", ["t_finish"], with_rank=True)
    assert ((traj["rank"] == 3) & (traj["t_finish"] > joined_at)).sum() >= 4  # the last replacement generated


LINK_PEER = """
import os, signal, sys
import numpy as np
from dora_hpc.runtime.link import Link, store
st = store("127.0.0.1", 0, master=True)
print(st.port, flush=True)
link = Link.pair(st, "0", 1)
for i in range(3):
    link.send({"n": i}, tag=1)
buf = np.empty(1 << 20, np.float32)
req = link.Irecv(buf, tag=2)
req.Wait()
link.send(float(buf.sum()), tag=1)
link.recv(tag=4)  # then dies, as a replacement SIGKILLed while it loads
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_link_keeps_order_per_tag_and_a_dead_peer_is_an_error_not_an_abort(tmp_path):
    """A link (runtime/link.py) to a process outside MPI: control messages arrive in order, a buffer lands in
    the receive posted for it, and once the other end is SIGKILLed a send of a megabyte to it -- which over an
    MPI link aborted the sender (slurm/NOTES.md) -- and a probe raise PeerLost, and this process lives on."""
    import numpy as np

    from dora_hpc.runtime.data_plane import PeerLost
    from dora_hpc.runtime.link import Link

    peer = subprocess.Popen([sys.executable, "-c", LINK_PEER], cwd=REPO, stdout=subprocess.PIPE, text=True)
    PROCS.append(peer)
    try:
        link = Link.connect(f"127.0.0.1:{peer.stdout.readline().strip()}", "0")
        assert link is not None
        big = np.full(1 << 20, 0.5, np.float32)
        req = link.Isend(big, tag=2)
        assert [link.recv(tag=1) for _ in range(3)] == [{"n": 0}, {"n": 1}, {"n": 2}]
        assert link.recv(tag=1) == 0.5 * (1 << 20) and req.Test()
        link.send("die", tag=4)
        assert peer.wait(timeout=30) == -signal.SIGKILL
        with pytest.raises(PeerLost):
            end = time.time() + 30
            while time.time() < end:  # the loss shows on the next transfer, or on a probe
                link.Iprobe(tag=1)
                link.Isend(big, tag=2).Test()
                time.sleep(0.05)
    finally:
        peer.kill()
    t = time.time()
    assert Link.connect(f"127.0.0.1:{_free_port()}", "0", timeout_s=2) is None  # nobody there: None, no hang
    assert time.time() - t < 30


CLOSING_PEER = """
import os, sys, time
from dora_hpc.runtime.link import Link, close_links, store
st = store("127.0.0.1", 0, master=True)
print(st.port, flush=True)
link = Link.pair(st, "0", 1)
link.send("last", tag=1)
if sys.argv[1] == "silent":  # never closes: its peer's close_links falls back
    time.sleep(20)
else:
    assert link.closed(timeout_s=30)  # its peer closed first
    print(close_links({1: link}, timeout_s=5, rank=2), flush=True)
os._exit(0)  # at once, as a rank does after MPI_Finalize
"""


@pytest.mark.parametrize("peer_closes", [True, False])
def test_a_rank_sends_its_close_before_it_waits_for_its_peers_and_ends_past_a_short_fallback(peer_closes, capfd):
    """Comm.close's last phase (link.close_links) on two linked processes: a side's CLOSE has left when
    close_links returns, so a process that ends right after it leaves its peer's link ended by that CLOSE,
    not broken by the exit; a peer that never closes costs the fallback's seconds, named on stderr."""
    from dora_hpc.runtime.link import Link, close_links

    how = "close" if peer_closes else "silent"
    peer = subprocess.Popen([sys.executable, "-c", CLOSING_PEER, how], cwd=REPO, stdout=subprocess.PIPE, text=True)
    PROCS.append(peer)
    try:
        link = Link.connect(f"127.0.0.1:{peer.stdout.readline().strip()}", "0")
        assert link is not None and link.recv(tag=1) == "last"
        t = time.monotonic()
        waited = close_links({2: link}, timeout_s=3, rank=1)
        took = time.monotonic() - t
        if peer_closes:
            assert waited == [] and took < 2.5 and link.error is None, (waited, took, link.error)
            assert peer.stdout.readline().strip() == "[]" and peer.wait(timeout=30) == 0
        else:
            assert waited == ["rank 2's CLOSE"] and 2.9 < took < 10, (waited, took)
            assert "dora-hpc: rank 1 ends after 3 s of waiting for rank 2's CLOSE" in capfd.readouterr().err
    finally:
        peer.kill()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Comm:  # rank 0's sends, recorded (the desk's bookkeeping is what this test checks; test above: the wire)
    def __init__(self) -> None:
        self.told: list[tuple[int, int]] = []
        self.fenced: list[int] = []
        self.links: dict = {}

    def announce(self, rank: int, port: str, others: list[int]) -> None:
        self.told += [(rank, r) for r in others]

    def fence(self, rank: int, others) -> None:
        self.fenced.append(rank)


def test_rank_0_tells_one_peer_at_a_time_and_excuses_its_silence_while_it_links(tmp_path):
    """The replacement builds its links one after another in its plan's order, so rank 0 tells the next peer
    only when the one before said Linked; the peer told is not hung while it links; a peer that could not
    link abandons the join (the rank stays fenced)."""
    from types import SimpleNamespace

    from dora_hpc.config import load_config
    from dora_hpc.runtime.join import Join, JoinDesk
    from dora_hpc.runtime.link import CONNECT_TIMEOUT_S
    from dora_hpc.runtime.messages import Linked

    model = tmp_path / "model"
    model.mkdir()
    (tmp_path / "launch.json").write_text(f'{{"model_dir": "{model}"}}')
    cfg = load_config("configs/tiny-cpu.yaml", ["cluster.rollout_instances=3", "runtime.hang_timeout_s=20"])
    ops: list[tuple] = []
    orch = SimpleNamespace(run_dir=tmp_path, cfg=cfg, comm=_Comm(), fenced={3, 5}, roles=SimpleNamespace(size=6),
                           op=lambda kind, peer=-1, detail="": ops.append((kind, peer)))
    desk = JoinDesk(orch)
    desk.pending[3] = Join("n3", "port", time.monotonic() + 600, [1, 2, 4])
    desk._tell_next(3)
    assert orch.comm.told == [(3, 1)]  # one peer at a time
    assert desk.excused(1, time.monotonic() + CONNECT_TIMEOUT_S) and not desk.excused(2, time.monotonic())
    assert not desk.excused(1, time.monotonic() + CONNECT_TIMEOUT_S + 21)  # connect returned long ago: hung
    desk.linked(Linked(3), 1)
    assert orch.comm.told == [(3, 1), (3, 2)] and desk.pending[3].told == 2 and ("join_linked", 1) in ops
    assert not desk.excused(1, time.monotonic())  # linked: no longer excused
    orch.fenced.add(4)
    desk.linked(Linked(3), 2)  # rank 4 was fenced meanwhile: nobody left to tell
    assert orch.comm.told == [(3, 1), (3, 2)] and desk.pending[3].told is None and not desk.excused(2, time.monotonic())
    desk.pending[5] = Join("n5", "port5", time.monotonic() + 600, [1, 2])
    desk._tell_next(5)
    desk.linked(Linked(5, ok=False), 1)  # its replacement could not be reached: given up, rank 5 fenced again
    assert 5 not in desk.pending and not desk.excused(1, time.monotonic()) and orch.comm.fenced == [5]
    assert orch.comm.told[-1] == (5, 1) and ("join_failed", 5) in ops


def test_a_replacement_with_another_model_or_config_is_refused(tmp_path):
    """Rank 0's vetting (the run above tests a wrong config end to end): an offer whose model folder differs
    (files or config.json) or whose config differs is refused with one line naming what differs."""
    from types import SimpleNamespace

    from dora_hpc.config import load_config
    from dora_hpc.runtime.join import JoinDesk, identity
    from dora_hpc.runtime.roles import Roles

    model, other = tmp_path / "model", tmp_path / "other"
    for d, size in ((model, 10), (other, 11)):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"x" * size)
        (d / "config.json").write_text("{}")
    (tmp_path / "launch.json").write_text(f'{{"model_dir": "{model}"}}')
    cfg = load_config("configs/tiny-cpu.yaml")
    orch = SimpleNamespace(run_dir=tmp_path, cfg=cfg, fenced={3}, roles=Roles(4, 1))
    desk = JoinDesk(orch)
    mine = identity(cfg.model_dump_json(), model)
    assert desk.vet(mine) == (3, "")
    assert desk.vet(mine | {"role": "trainer"}) == (None, "no trainer replica is lost")
    # trainer replicas (train.replicas): a lost one is given first, and an offer's role picks its kind
    orch.roles, orch.fenced = Roles(6, 2, 0, True), {2, 4}
    assert desk.vet(mine) == (2, "") and desk.vet(mine | {"role": "rollout"}) == (4, "")
    orch.fenced = set()
    assert desk.vet(mine) == (None, "no rollout instance or trainer replica is lost")
    orch.roles, orch.fenced = Roles(4, 1), {3}
    rank, why = desk.vet(identity(cfg.model_dump_json(), other))
    assert rank is None and why == f"its model folder differs from the run's ({model})"
    (other / "model.safetensors").write_bytes(b"x" * 10)
    (other / "config.json").write_text('{"hidden_size": 8}')
    assert desk.vet(identity(cfg.model_dump_json(), other))[0] is None  # same files, another config.json
    changed = load_config("configs/tiny-cpu.yaml", ["engine.kv_blocks=256"])
    assert desk.vet(identity(changed.model_dump_json(), model)) == (None, "its config differs from the run's "
                                                                          "(launch.json)")


class _Sends:  # rank 0's checkpoint sends, recorded
    def __init__(self, roles) -> None:
        self.roles, self.sent = roles, []
        self.live_trainers = [1]

    def send(self, msg, dst: int) -> None:
        self.sent.append((type(msg).__name__, dst))


def test_a_checkpoint_in_flight_waits_for_the_ranks_asked_to_flush_only():
    """A checkpoint started while rank 3 was fenced commits once the ranks asked to flush have, though rank
    3's replacement joined meanwhile (it holds nothing the snapshot calls complete); a rank fenced before it
    flushed is not waited for, even once its replacement is back. Seen in CI: the first case hung the run's
    final step for ever."""
    from dora_hpc.runtime.checkpoints import Checkpointer
    from dora_hpc.runtime.messages import Checkpointed, Flushed
    from dora_hpc.runtime.roles import Roles

    roles = Roles(5, 1)  # rank 1 the trainer; ranks 2, 3, 4 instances 0, 1, 2
    comm = _Sends(roles)
    ckpt = Checkpointer(comm, lambda *a, **k: None, lambda: None)
    ckpt.start(10, {}, [2, 4], 0.0)  # rank 3 fenced at the start
    assert sorted(d for m, d in comm.sent if m == "Flush") == [2, 4]
    ckpt.on_progress(Flushed(roles.instance_of_rank(2), 10))
    ckpt.maybe_commit()  # rank 3's replacement joined here: nothing changes
    assert ("Commit", 1) not in comm.sent
    ckpt.on_progress(Flushed(roles.instance_of_rank(4), 10))
    assert ("Commit", 1) in comm.sent
    ckpt.on_progress(Checkpointed(10, "ckpt/10"))
    assert ckpt.last == 10 and not ckpt.busy

    ckpt.start(20, {}, [2, 3, 4], 1.0)
    ckpt.on_progress(Flushed(roles.instance_of_rank(2), 20))
    assert ckpt.forget(3) == [] and ("Commit", 1) not in comm.sent[-2:]  # fenced before it flushed
    ckpt.on_progress(Flushed(roles.instance_of_rank(4), 20))  # its replacement may be back by now
    assert comm.sent[-1] == ("Commit", 1)


def test_a_lost_replica_group_is_given_to_replacements_of_one_group_and_goes_live_at_its_last_hello(tmp_path):
    """Rank 0's desk under replica groups of two ranks (ranks 1-2 and 3-4): one replacement is refused with the
    command to start two; two replacements naming one group take ranks 1 and 2 of the lost group, in offer order,
    and go live together only at the second Hello; a third offer of the group finds nothing left; the group
    lost counts once for slurm.replace_lost."""
    from types import SimpleNamespace

    from dora_hpc.config import load_config
    from dora_hpc.runtime.join import JoinDesk, identity
    from dora_hpc.runtime.roles import Roles

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (tmp_path / "launch.json").write_text(f'{{"model_dir": "{model}"}}')
    cfg = load_config("configs/tiny-cpu.yaml", ["cluster.trainer_ranks=4", "train.replicas=2", "train.backend=fsdp"])
    live: list[int] = []
    orch = SimpleNamespace(run_dir=tmp_path, cfg=cfg, fenced={1, 2}, roles=Roles(8, 4, 0, True, 2),
                           rejoin=live.append)
    desk = JoinDesk(orch)
    mine = identity(cfg.model_dump_json(), model) | {"role": "trainer"}
    rank, why = desk.vet(mine)
    assert rank is None and "mpiexec -n 2 dora-hpc join RUN_DIR --role trainer" in why
    assert desk.lost_groups() == [1] and desk.lost() == []  # a group's ranks are not given one by one
    assert desk.vet(mine | {"group": ["g", 2]}) == (1, "")
    desk.pending[1] = object()
    assert desk.vet(mine | {"group": ["g", 2]}) == (2, "") and desk.lost_groups() == []
    desk.pending[2] = object()
    assert desk.vet(mine | {"group": ["g", 2]})[0] is None  # the group has both its replacements
    assert desk.vet(mine | {"group": ["h", 2]}) == (None, "no trainer replica group is lost")
    assert desk.hello(2) and live == []  # the first Hello: not live yet
    assert desk.hello(1) and live == [1, 2]  # the last: the group is live
    assert desk.groups == {} and desk.greeted == set()
