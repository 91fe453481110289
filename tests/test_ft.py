"""Fault-tolerant trainer replicas (train/ft.py, torchft) as real processes around one lighthouse
(tests/ft_replicas.py): two replicas take one trainer's steps; a replica SIGKILLed inside a step's gradient
all-reduce costs that step, which the survivor takes again alone with the same result; a replacement
recovers the weights and optimizer from the survivor (no checkpoint) and trains beside it."""

import contextlib
import importlib.util
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dora_hpc.engine.local_models import build_tiny_model

SCRIPT = [sys.executable, str(Path(__file__).parent / "ft_replicas.py")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("m") / "tiny"))


@contextlib.contextmanager
def serving():
    """A lighthouse of its own (tests/ft_replicas.py); yields its address."""
    p = subprocess.Popen([*SCRIPT, "lighthouse"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        yield json.loads(p.stdout.readline())["address"]
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)


@pytest.fixture
def lighthouse():
    with serving() as address:
        yield address


def replica(tiny: str, address: str, rid: str, steps: int, *opts: str) -> subprocess.Popen:
    return subprocess.Popen([*SCRIPT, "replica", tiny, address, rid, str(steps), *opts], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parent)


def lines(p: subprocess.Popen, timeout: float = 240) -> list[dict]:
    out, err = p.communicate(timeout=timeout)
    return [json.loads(x) for x in out.splitlines()], err, p.returncode


def single(tiny: str, steps: int, *opts: str) -> list[dict]:
    p = subprocess.run([*SCRIPT, "single", tiny, str(steps), *opts], capture_output=True, text=True, timeout=240,
                       cwd=Path(__file__).parent)
    assert p.returncode == 0, p.stderr[-2000:]
    return [json.loads(x) for x in p.stdout.splitlines()]


def steps_of(rows: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in rows if "step" in r}


def same_steps(rows: dict[int, dict], ref: list[dict]) -> None:
    """The same losses and gradient norms as the single trainer's (summation order apart: measured 2e-7
    relative on the loss, 5e-6 on the gradient norm, after 8 steps; a missing or doubled share is ~1e-1)."""
    for r in ref:
        got = rows[r["step"]]
        assert got["loss"] == pytest.approx(r["loss"], rel=1e-5), r["step"]
        assert got["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4), r["step"]


@pytest.mark.slow  # two replica processes and a lighthouse
@pytest.mark.parametrize("opts", [(), ("--lora", "4")], ids=["full", "lora"])
def test_two_replicas_take_one_trainers_steps(tiny, lighthouse, opts):
    """A replica that starts late joins at a step's quorum (recovering the first one's state: under LoRA the
    adapter and its optimizer state); from then on each takes its share of every step (paced, so the late one
    has steps left to share)."""
    ps = [replica(tiny, lighthouse, rid, 4, "--pace", "1", *opts) for rid in ("a", "b")]
    (a, err, rc), (b, _, rc_b) = [lines(p) for p in ps]
    assert rc == rc_b == 0, err[-2000:]
    a, b = steps_of(a), steps_of(b)
    both = sorted(set(a) & set(b))
    assert sorted(a) == list(range(4)) and both and both[-1] == 3
    assert [a[s]["checksum"] for s in both] == [b[s]["checksum"] for s in both]  # bit-identical
    assert all(a[s]["size"] == 2 and {a[s]["rank"], b[s]["rank"]} == {0, 1} for s in both)  # shared
    same_steps(a, single(tiny, 4, *opts))


@pytest.mark.slow
def test_a_replica_lost_in_a_step_costs_that_step_and_a_replacement_recovers_from_the_survivor(tiny, lighthouse):
    a = replica(tiny, lighthouse, "a", 6, "--pace", "1")
    b = replica(tiny, lighthouse, "b", 6, "--die-in", "1")  # SIGKILLed in step 1's gradient all-reduce
    c = replica(tiny, lighthouse, "b", 6, "--after", str(b.pid))  # its replacement, under its name, once b is gone
    _, _, rc_b = lines(b)
    assert rc_b == -signal.SIGKILL
    (rows_a, err, rc), (rows_c, err_c, rc_c) = lines(a), lines(c)
    assert rc == 0 and rc_c == 0, (err[-2000:], err_c[-2000:])
    assert {"aborted": 1} in rows_a  # the step it was lost in was taken again, by those left
    got_a, got_c = steps_of(rows_a), steps_of(rows_c)
    assert sorted(got_a) == list(range(6))
    healed = [r["healed"] for r in rows_c if "healed" in r]
    assert len(healed) == 1 and min(got_c) == healed[0] >= 1  # live recovery, then it trains
    assert all(got_c[s]["checksum"] == got_a[s]["checksum"] and got_c[s]["size"] == 2 for s in got_c)
    same_steps(got_a, single(tiny, 6))  # every step, the lost and the shared, is the one trainer's


@pytest.mark.slow
def test_a_recovered_fsdp_rank_keeps_none_of_its_own_optimizer_state(tiny):
    """An FSDP2 rank loading a live replica's state takes its weights, step and Adam moments, and drops its
    own moments for a parameter the source has none for (one rank, its own process: torch.distributed)."""
    p = subprocess.run([*SCRIPT, "overwrite", tiny], capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).parent)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout.splitlines()[-1]) == {"step": 1, "moments": True, "equal": True, "checksum": True}


def group(tiny: str, address: str, rid: str, steps: int, *opts: str) -> subprocess.Popen:
    """A replica group of two ranks sharding the model with FSDP2 (one mpiexec)."""
    from dora_hpc.launch.local import mpiexec

    return subprocess.Popen([mpiexec(), "-n", "2", *SCRIPT, "replica", tiny, address, rid, str(steps), *opts],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parent)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp", pytest.param("megatron", marks=pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="megatron-core not installed"))])
def test_two_replica_groups_take_one_trainers_steps_and_a_lost_group_costs_a_step(tiny, lighthouse, backend):
    """Two replica groups of two ranks each, sharded inside a group (FSDP2, HSDP; or megatron-core TP=2) and
    summed across groups: one trainer's losses and gradient norms (FSDP2: the plain trainer's; megatron: one TP
    group's alone), bit-identical across groups; group b SIGKILLed inside step 1's sum across groups costs that
    step, which a takes again alone, and b's replacement recovers its shards from a (rank for rank, no
    checkpoint) and trains beside it to the end."""
    opts = ("--backend", backend)
    a = group(tiny, lighthouse, "a", 6, "--pace", "1", *opts)
    b = group(tiny, lighthouse, "b", 6, "--die-in", "1", *opts)
    c = group(tiny, lighthouse, "b", 6, "--after", str(b.pid), *opts)  # its replacement, once b is gone
    b.communicate(timeout=240)  # mpiexec reports the killed rank on stdout, in its own words
    assert b.returncode != 0
    (rows_a, err, rc), (rows_c, err_c, rc_c) = lines(a), lines(c)
    assert rc == 0 and rc_c == 0, (err[-2000:], err_c[-2000:])
    got_a, got_c = steps_of(rows_a), steps_of(rows_c)
    assert sorted(got_a) == list(range(6))
    assert got_a[0]["size"] == 2 and {"aborted": 1} in rows_a  # shared step 0; step 1 lost b and was taken again
    healed = [r["healed"] for r in rows_c if "healed" in r]
    assert len(healed) == 1 and min(got_c) == healed[0] >= 1 and max(got_c) == 5, (rows_a, rows_c)
    assert all(got_c[s]["checksum"] == got_a[s]["checksum"] and got_c[s]["size"] == 2 for s in got_c)
    if backend == "fsdp":
        ref = single(tiny, 6)
    else:
        with serving() as alone:
            ref, err, rc = lines(group(tiny, alone, "ref", 6, *opts))
        assert rc == 0, err[-2000:]
    same_steps(got_a, ref)  # every step, shared, alone and shared again, is the one trainer's


REPO = Path(__file__).resolve().parents[1]
REPLICAS = ["--set", "cluster.trainer_ranks=2", "--set", "train.replicas=2"]


def run_dir_steps(run_dir: Path) -> int:
    from dora_hpc.store.shards import read_table

    try:
        return len(read_table(run_dir, "train", "steps", ["step"])["step"])
    except Exception:  # noqa: BLE001 - a shard being written
        return 0


def signal_after_two_steps(run_dir: Path, sets: list[str], victim: int, sig: int, wait_s: float) -> str:
    """Run tiny-cpu for 8 steps with ``sets`` (trainer replicas), send ``sig`` to rank ``victim`` once two steps
    are logged, and return the run's stderr once it ended in success."""
    cmd = [sys.executable, "-m", "dora_hpc.cli", "run", "configs/tiny-cpu.yaml", "--run-dir", str(run_dir),
           *sets, "--set", "train.max_steps=8", "--set", "train.checkpoint_every=3",
           "--set", "train.replica_timeout_s=10", "--set", "runtime.hang_timeout_s=8"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + wait_s
    while run_dir_steps(run_dir) < 2 and time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    import os

    os.kill(int((run_dir / "pids" / f"rank-{victim}").read_text()), sig)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return err


@pytest.mark.slow
@pytest.mark.parametrize("victim, sig", [(2, signal.SIGSTOP)], ids=["stop-rank2"])
def test_a_run_loses_a_trainer_replica_and_finishes_in_its_first_attempt(tmp_path, victim, sig):
    """Two trainer replicas (tiny-cpu); after two steps rank 2 is SIGSTOPped (hung: rank 0 fences it after
    runtime.hang_timeout_s, the other's collective gives up after train.replica_timeout_s): the other takes every
    step from then on, and the run ends in its first attempt with every step logged once and every invariant 0.
    (Rank 1, the checkpoint writer and the weight source, SIGKILLed: the replacement replica test below, whose
    survivor takes the steps until the replacement joins.)"""
    from dora_hpc.analysis.basic import analyze
    from dora_hpc.store.shards import read_table

    run_dir = tmp_path / "ft"
    err = signal_after_two_steps(run_dir, REPLICAS, victim, sig, wait_s=180)
    why = "died" if sig == signal.SIGKILL else "sent nothing for"
    assert f"rank {victim} (trainer replica) {why}" in err, err[-3000:]
    assert len((run_dir / "attempts.jsonl").read_text().splitlines()) == 1  # no requeue, no restart
    a = analyze(run_dir)
    assert a["steps"] == 8 and a["consumed"] == 8 * 32
    assert not any(a["invariants"][k] for k in ("lost_groups", "duplicate_groups", "split_groups",
                                                "staleness_over_k", "mixed_version_trajectories"))
    steps = read_table(run_dir, "train", "steps", ["step", "loss"], with_rank=True)
    assert sorted(steps["step"].tolist()) == list(range(8))  # each step once, every loss finite
    assert all(abs(x) < 1e3 for x in steps["loss"].tolist())
    survivor = 3 - victim
    late = [int(s) for s, r in zip(steps["step"], steps["rank"], strict=True) if r == survivor]
    assert late and max(late) == 7  # the survivor logged the last steps
    ops = read_table(run_dir, "events", "ops", ["kind", "peer", "detail"])
    assert any(k == "fence" and p == victim and "role=trainer" in d
               for k, p, d in zip(ops["kind"], ops["peer"], ops["detail"], strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("victim, sig, backend", [(2, signal.SIGKILL, "fsdp")], ids=["kill-rank2"])
def test_a_run_loses_a_rank_of_a_replica_group_and_the_other_group_finishes_it(tmp_path, victim, sig, backend):
    """Two replica groups of two ranks (cluster.trainer_ranks=4, train.replicas=2, FSDP2 shards): after two steps
    rank 2, the second rank of the first group, is SIGKILLed. Rank 0 fences the victim
    with its group (the other rank leaves once it hears of the fence: it takes nothing down), and the other group
    takes every step from then on; the run ends in its first attempt with each step logged once and every
    invariant 0. (A group's first rank SIGSTOPped: the FSDP2 group replacement test below. Megatron-core TP groups
    lose and recover a group in test_two_replica_groups_...[megatron]: the run's side is the same code.)"""
    from dora_hpc.analysis.basic import analyze
    from dora_hpc.store.shards import read_table

    run_dir = tmp_path / "hsdp"
    groups = ["--set", "cluster.trainer_ranks=4", "--set", "train.replicas=2", "--set", f"train.backend={backend}"]
    err = signal_after_two_steps(run_dir, groups, victim, sig, wait_s=240)
    group, why = ([1, 2], "died") if victim == 2 else ([3, 4], "sent nothing for")
    other, = set(group) - {victim}
    assert f"rank {victim} (trainer replica) {why}" in err and "fenced with its replica group" in err, err[-3000:]
    assert f"rank {other} leaves: its trainer replica group" in err, err[-3000:]
    assert len((run_dir / "attempts.jsonl").read_text().splitlines()) == 1  # no requeue, no restart
    a = analyze(run_dir)
    assert a["steps"] == 8 and a["consumed"] == 8 * 32
    assert not any(a["invariants"][k] for k in ("lost_groups", "duplicate_groups", "split_groups",
                                                "staleness_over_k", "mixed_version_trajectories"))
    steps = read_table(run_dir, "train", "steps", ["step", "loss"], with_rank=True)
    assert sorted(set(steps["step"].tolist())) == list(range(8)) and all(abs(x) < 1e3 for x in steps["loss"].tolist())
    survivor = 3 if victim == 2 else 1  # the other group's first rank
    late = {int(s) for s, r in zip(steps["step"], steps["rank"], strict=True) if r == survivor}
    assert max(late) == 7 and not {int(r) for r in steps["rank"]} - {1, 3}  # each group's first rank reports
    ops = read_table(run_dir, "events", "ops", ["kind", "peer", "detail"])
    assert {p for k, p in zip(ops["kind"], ops["peer"], strict=True) if k == "fence"} == set(group)


@pytest.mark.slow
def test_a_replacement_replica_joins_a_running_job_and_trains(tmp_path):
    """Two trainer replicas (tiny-cpu); rank 1 is SIGKILLed after two steps and fenced, and ``dora-hpc join
    --role trainer`` takes its place: linked to every live rank, it takes the next Train and joins that
    step's quorum, where it recovers the weights, optimizer, version and the untrained trajectories from the
    survivor (no checkpoint read). From then on both replicas take each step, with bit-identical weights,
    and the run ends in its first attempt with every invariant 0."""
    from test_join import CLI, PROCS, finish_soon, wait_for

    from dora_hpc.analysis.basic import analyze
    run_dir, err = tmp_path / "ft", tmp_path / "run.err"
    steps = 30
    cmd = CLI + ["run", "configs/tiny-cpu.yaml", "--run-dir", str(run_dir), *REPLICAS,
                 "--set", f"train.max_steps={steps}", "--set", "train.checkpoint_every=4",
                 "--set", "train.replica_timeout_s=10", "--set", "runtime.hang_timeout_s=8",
                 "--set", "runtime.heartbeat_s=1"]
    with err.open("w") as f:
        run = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=f)
    PROCS.append(run)
    log = err.read_text
    try:
        wait_for(lambda: run_dir_steps(run_dir) >= 2, "two steps", timeout=180, log=log)
        import os

        os.kill(int((run_dir / "pids" / "rank-1").read_text()), signal.SIGKILL)
        wait_for(lambda: "rank 1 (trainer replica) died: fenced" in log(), "rank 1 to be fenced", log=log)
        with (tmp_path / "join.err").open("w") as f:
            p = subprocess.Popen(CLI + ["join", str(run_dir), "--role", "trainer"], cwd=REPO,
                                 stdout=subprocess.DEVNULL, stderr=f)
        PROCS.append(p)
        both = lambda: log() + "\n--- the replacement's log ---\n" + (tmp_path / "join.err").read_text()  # noqa: E731
        wait_for(lambda: "rank 1 (trainer replica) is back" in log(), "the replacement to join", log=both)
        steps = finish_soon(run_dir, after=5)
        assert run.wait(timeout=400) == 0, both()[-5000:]
        assert p.wait(timeout=60) == 0, both()[-5000:]
        out = (tmp_path / "join.err").read_text()
        assert "joined as rank 1 (trainer replica)" in out and "recovered v" in out, out[-3000:]
    finally:
        for proc in PROCS:
            if proc.poll() is None:
                proc.kill()
    assert len((run_dir / "attempts.jsonl").read_text().splitlines()) == 1
    a = analyze(run_dir)
    assert a["steps"] == steps and a["consumed"] == steps * 32
    assert not any(a["invariants"][k] for k in ("lost_groups", "duplicate_groups", "split_groups",
                                                "staleness_over_k", "mixed_version_trajectories")), a["invariants"]
    assert [e["event"] for e in a["instances"]["timeline"]] == ["start"]  # a replica is no rollout instance
    from dora_hpc.store.shards import read_table

    ops = read_table(run_dir, "events", "ops", ["kind", "peer", "detail"])
    assert any(k == "fence" and p == 1 and "role=trainer" in d
               for k, p, d in zip(ops["kind"], ops["peer"], ops["detail"], strict=True))
    late, survivor = replacement_steps(run_dir, 1, 2)
    assert len(late) >= 3 and max(late) == steps - 1, sorted(late)  # it trained, to the last step
    assert all(survivor[s] == c for s, c in late.items())  # with the survivor's weights, bit for bit


def replacement_steps(run_dir: Path, rank: int, survivor: int) -> tuple[dict[int, str], dict[int, str]]:
    """Step -> weights checksum, from every replica's rows (not one of each): the steps trainer replica
    ``rank``'s replacement took after it joined (its one ``join`` op), and every step ``survivor`` took."""
    from dora_hpc.store.shards import _read_table, read_table

    ops = read_table(run_dir, "events", "ops", ["kind", "peer", "detail", "t_end"])
    joined_at = [t for k, p, d, t in zip(ops["kind"].tolist(), ops["peer"].tolist(), ops["detail"].tolist(),
                                         ops["t_end"].tolist(), strict=True)
                 if k == "join" and p == rank and d == "role=trainer"]
    assert len(joined_at) == 1, joined_at
    rows = _read_table(run_dir, "train", "steps", ["step", "t_start", "weights_checksum"], None, True)
    logged = list(zip(rows["step"].tolist(), rows["t_start"].tolist(), rows["weights_checksum"].tolist(),
                      rows["rank"].tolist(), strict=True))
    return ({s: c for s, t, c, r in logged if r == rank and t > joined_at[0]},
            {s: c for s, _, c, r in logged if r == survivor})


@pytest.mark.slow
def test_a_replacement_fsdp_replica_group_joins_a_running_job_and_trains(tmp_path):
    """Two replica groups of two FSDP2 ranks; rank 3, the first of the second group (it serves its group's torchft
    manager), is SIGSTOPped after two steps: silent for runtime.hang_timeout_s, it is fenced with its group (rank
    4 leaves once it hears of the fence), and the first group takes the steps. Two replacements started together
    (``mpiexec -n 2 dora-hpc join --role trainer``) take ranks 3 and 4: they go live at the second's Hello, join
    the next step's quorum, recover the weights and optimizer shard for shard from the other group, and train
    beside it, with the same weights, to the end of the run's first attempt (``dora-hpc finish``: 5 steps on)."""
    from test_join import CLI, PROCS, finish_soon, wait_for

    from dora_hpc.analysis.basic import analyze
    from dora_hpc.launch.local import mpiexec

    run_dir, err = tmp_path / "hsdp", tmp_path / "run.err"
    steps = 40
    cmd = CLI + ["run", "configs/tiny-cpu.yaml", "--run-dir", str(run_dir), "--set", "cluster.trainer_ranks=4",
                 "--set", "train.replicas=2", "--set", "train.backend=fsdp", "--set", f"train.max_steps={steps}",
                 "--set", "train.checkpoint_every=4", "--set", "train.replica_timeout_s=10",
                 "--set", "runtime.hang_timeout_s=8", "--set", "runtime.heartbeat_s=1"]
    with err.open("w") as f:
        run = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=f)
    PROCS.append(run)
    log = err.read_text
    try:
        wait_for(lambda: run_dir_steps(run_dir) >= 2, "two steps", timeout=240, log=log)
        import os

        os.kill(int((run_dir / "pids" / "rank-3").read_text()), signal.SIGSTOP)
        wait_for(lambda: "fenced with its replica group (ranks 3, 4)" in log(), "the group to be fenced", log=log)
        with (tmp_path / "join.err").open("w") as f:
            p = subprocess.Popen([mpiexec(), "-n", "2", *CLI, "join", str(run_dir), "--role", "trainer"], cwd=REPO,
                                 stdout=subprocess.DEVNULL, stderr=f)
        PROCS.append(p)
        both = lambda: log() + "\n--- the replacements' log ---\n" + (tmp_path / "join.err").read_text()  # noqa: E731
        wait_for(lambda: "rank 4 (trainer replica) is back" in log(), "the replacements to join", timeout=180,
                 log=both)
        steps = finish_soon(run_dir, after=5)
        assert run.wait(timeout=400) == 0, both()[-5000:]
        assert p.wait(timeout=60) == 0, both()[-5000:]
        out = (tmp_path / "join.err").read_text()
        assert "joined as rank 3 (trainer replica)" in out and "joined as rank 4 (trainer replica)" in out, out[-3000:]
        assert "recovered v" in out, out[-3000:]
    finally:
        for proc in PROCS:
            if proc.poll() is None:
                proc.kill()
    assert "rank 3 (trainer replica) sent nothing for" in log() and "rank 4 leaves: its trainer replica group" in log()
    assert len((run_dir / "attempts.jsonl").read_text().splitlines()) == 1
    a = analyze(run_dir)
    assert a["steps"] == steps and a["consumed"] == steps * 32
    assert not any(a["invariants"][k] for k in ("lost_groups", "duplicate_groups", "split_groups",
                                                "staleness_over_k", "mixed_version_trajectories")), a["invariants"]
    late, survivor = replacement_steps(run_dir, 3, 1)
    assert len(late) >= 3 and max(late) == steps - 1, sorted(late)  # the new group trained, to the last step
    assert all(survivor[s] == c for s, c in late.items())  # the same weights as the other group's, step by step
