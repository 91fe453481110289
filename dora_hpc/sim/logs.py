"""A simulated run's HDF5 logs: the runtime's shards (docs/hdf5-schema.md), written once at the end, so
``dora-hpc analyze`` opens a simulated run like a real one.

Invariants:
* ranks are the runtime's: 0 the orchestrator, 1 the trainer (however many accelerators it has), and
  rollout instance i is rank 2 + i (a borrowed instance too: in the simulator it has no trainer rank to live
  on); every rollout rank gets a ``traj`` and an ``events`` shard, possibly empty;
* the rows are the simulator's own record (sim/cluster.py), taken as it runs: a trajectory's row when the
  policy hears it finished, an engine-step row per macro step (the batch is constant over one, so its
  ``new_tokens`` are the macro step's decode steps times its running sequences), a ``trainer_wait`` op per
  stretch of one kind, the train steps and what they consumed; nothing is derived from the summary;
* columns the simulator does not know are left out of the files (readers give their default): a
  trajectory's tokens, logprobs, reward and finish reason; the train steps' loss figures; environment
  errors. Weight checksums are ``sim-v{version}``, the same for a publish and each load of it;
* tables are kept as lists in memory and written as whole columns (store/shards.py ``write_shard``);
  ``tables`` gives them to the measurement layer (measure/), which computes the simulator's summary from
  them as ``analyze`` does from the files.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..core.events import FOLDER, TRAINER
from ..core.policy_base import TRAIN_WAITS
from ..store.shards import SCHEMA_VERSION, write_shard

ORCH, TRAINER_RANK, FIRST_INSTANCE_RANK = 0, 1, 2


class Tables(NamedTuple):
    """A run's tables as measure/ takes them: dicts of numpy columns."""
    esteps: dict   # engine steps, with ``rank``
    tsteps: dict   # the measured train steps, ``tokens`` their trained tokens
    ops: dict      # ops, with ``rank``
    traj: dict     # trajectory rows in the invariant check's columns (measure/invariants.py)
    consumed: dict


def rank_of(instance: int) -> int:
    return FIRST_INSTANCE_RANK + instance


class SimLog:
    """Rows of every table, by rank, as the simulator produces them."""

    def __init__(self, group_size: int, block_size: int) -> None:
        self.g, self.block = group_size, block_size
        self.traj: dict[int, list[tuple]] = defaultdict(list)   # rank -> trajectory rows
        self.esteps: dict[int, list[tuple]] = defaultdict(list)  # rank -> engine-step rows
        self.ops: dict[int, list[tuple]] = defaultdict(list)     # rank -> op rows
        self.consumed: list[tuple] = []
        self.tsteps: dict[int, list] = {}                         # step -> [t_start, t_end, tokens]
        self.dispatched: dict[int, tuple[float, list[int]]] = {}  # traj -> (t_dispatch, instance path)
        self.moving: dict[int, tuple[float, int, bool]] = {}      # traj -> (sent at, from instance, with KV)
        self.loading: dict[int, tuple[float, int, int]] = {}      # instance -> (ordered at, version, from rank)
        self.cancelled = 0                                        # loads a sleep cancelled
        self.kept = 0                                             # train steps the run kept (``end``)
        self.wait: tuple[str, float, float] | None = None         # the trainer wait under way: kind, from, to
        self.op(ORCH, 0.0, 0.0, "start", version=0, detail="fresh")

    def op(self, rank: int, t0: float, t1: float, kind: str, traj: int = -1, peer: int = -1, nbytes: int = -1,
           version: int = -1, detail: str = "") -> None:
        self.ops[rank].append((t0, t1, kind, traj, peer, nbytes, version, detail))

    # -- hooks (sim/cluster.py) ------------------------------------------------------------------------
    def dispatched_to(self, now: float, traj: int, instance: int) -> None:
        self.dispatched[traj] = (now, [instance])

    def assigned(self, now: float, instance: int, version: int, src: int) -> None:
        peer = TRAINER_RANK if src == TRAINER else -2 if src == FOLDER else rank_of(src)
        self.op(ORCH, now, now, "assign", peer=peer, version=version, detail=f"instance={instance}")
        self.loading[instance] = (now, version, peer)

    def ready(self, now: float, instance: int) -> None:
        if instance in self.loading:
            t0, v, peer = self.loading.pop(instance)
            self.op(rank_of(instance), t0, now, "weight_load", peer=peer, version=v,
                    detail=f"sim-v{v}" + (" from the model folder" if peer == -2 else ""))

    def slept(self, instance: int) -> None:
        """A borrowed instance went to sleep: a weight load under way is cancelled, never logged."""
        if self.loading.pop(instance, None) is not None:
            self.cancelled += 1

    def migrating(self, now: float, traj: int, src: int, dst: int, kv: bool) -> None:
        self.op(ORCH, now, now, "migrate", traj=traj, detail=f"{src}->{dst} kv={kv}")
        self.moving[traj] = (now, src, kv)

    def offloaded(self, traj: int) -> None:
        """A request parked in host memory (a borrowed instance's drain), on its way or not: a move under way ends
        there; its ``Restore`` is a move of its own (``restoring``)."""
        self.moving.pop(traj, None)

    def restoring(self, now: float, traj: int, src: int, dst: int) -> None:
        """A parked request sent from where it was parked to ``dst``: logged as the runtime logs it, a ``migrate``
        decision (``restore``) and a ``migration_in`` when it arrives."""
        self.op(ORCH, now, now, "migrate", traj=traj, detail=f"{src}->{dst} kv=True restore")
        self.moving[traj] = (now, src, True)

    def arrived(self, now: float, traj: int, dst: int, kv_bytes: float) -> None:
        if traj not in self.moving:
            return
        t0, src, kv = self.moving.pop(traj)
        self.dispatched[traj][1].append(dst)
        self.op(rank_of(dst), t0, now, "migration_in", traj=traj, peer=rank_of(src),
                nbytes=int(kv_bytes) if kv else 0, detail="" if kv else "reprefill=True")

    def finished(self, now: float, traj: int, instance: int, rec, prompt: int, response: int) -> None:
        t0, path = self.dispatched[traj]
        self.traj[rank_of(instance)].append((
            traj, rec.group, traj % self.g, rec.segments[0], rec.segments[0], prompt, response, t0, now,
            rec.migrations, rec.reprefill, ">".join(map(str, path)), list(rec.segments), rec.turn + 1, rec.env_s))

    def advanced(self, t0: float, t1: float, inst, steps: int, running: int, waiting: int, capacity: int,
                 versions: int = 1) -> None:
        """One macro step of ``inst`` (its batch constant over [t0, t1]): ``steps`` decode steps of requests of
        ``versions`` versions."""
        self.esteps[rank_of(inst.idx)].append((
            t0, t1, running + waiting, capacity, steps * running, int(inst.kv_tokens() // self.block),
            -1 if inst.version is None else inst.version, running, versions))

    def waiting_for(self, t0: float, t1: float, kind: str) -> None:
        """The trainer sat idle over [t0, t1] waiting for ``kind``; stretches of one kind are one op."""
        if kind not in TRAIN_WAITS:
            return
        if self.wait and self.wait[0] == kind and self.wait[2] >= t0 - 1e-12:
            self.wait = (kind, self.wait[1], t1)
            return
        self.end_wait()
        self.wait = (kind, t0, t1)

    def end_wait(self) -> None:
        if self.wait:
            kind, t0, t1 = self.wait
            self.op(ORCH, t0, t1, "trainer_wait", detail=kind)
            self.wait = None

    def train(self, now: float, begin: float, step: int, groups, trajs, tokens: int, cap: int | None) -> None:
        self.end_wait()
        for g in groups:
            for t in range(g * self.g, (g + 1) * self.g):
                tag = trajs[t].segments[0]
                self.consumed.append((t, g, step, tag, step - tag))
        self.tsteps[step] = [begin, None, tokens]
        if cap is not None:
            self.op(ORCH, now, now, "admission_cap", version=step, detail=f"groups={cap}")

    def dropped(self, now: float, group: int, reason: str) -> None:
        self.op(ORCH, now, now, "drop", detail=f"group={group} {reason}")

    def trained(self, now: float, step: int) -> None:
        self.tsteps[step][1] = now
        self.op(ORCH, now, now, "publish", version=step + 1, detail=f"sim-v{step + 1}")

    # -- the end and the tables ----------------------------------------------------------------------------
    def end(self, steps: int, next_group: int, open_groups: set[int]) -> None:
        """The run ends with train step ``steps - 1`` (a step started after it is left out, with what it
        consumed): ``pending_at_end`` names the groups open then -- the ledger's open ones (``open_groups``) and
        those only a left-out step consumed -- and ``done`` the groups admitted (``next_group``), as a runtime's
        end does."""
        self.end_wait()
        self.kept = steps
        end = self.tsteps[steps - 1][1]
        later = {c[1] for c in self.consumed if c[2] >= steps}
        self.op(ORCH, end, end, "pending_at_end", detail=",".join(map(str, sorted(open_groups | later))))
        self.op(ORCH, end, end, "done", version=steps, detail=f"next_group={next_group}")

    def tables(self, steps: list[dict]) -> Tables:
        """Every table as numpy columns, for measure/, once the run has ended (``end``). ``steps``: the
        simulator's measured steps; each one's trained tokens are its ``tokens`` (prompt + response of what it
        consumed: measure/utilization.py ``trained_tokens``)."""
        e = [(r, *row) for r, rows in self.esteps.items() for row in rows]
        esteps = {c: np.array([x[i] for x in e], dtype=float if c in ("t_start", "t_end") else np.int64)
                  for i, c in enumerate(("rank", "t_start", "t_end", "batch_size", "capacity", "new_tokens",
                                         "kv_blocks_used", "version", "running", "batch_versions"))}
        tsteps = {"step": np.array([s["step"] for s in steps], np.int64),
                  "t_start": np.array([self.tsteps[s["step"]][0] for s in steps], float),
                  "t_end": np.array([s["t_end"] for s in steps], float),
                  "tokens": np.array([s["tokens"] for s in steps], np.int64)}
        o = [(r, *row) for r, rows in self.ops.items() for row in rows]
        ops = {"rank": np.array([x[0] for x in o], np.int64), "t_start": np.array([x[1] for x in o], float),
               "t_end": np.array([x[2] for x in o], float), "kind": np.array([x[3] for x in o], dtype=object),
               "bytes": np.array([x[6] for x in o], np.int64), "detail": np.array([x[8] for x in o], dtype=object),
               "attempt": np.zeros(len(o), np.int64)}
        rows = [row for rs in self.traj.values() for row in rs]
        segs = [row[12] for row in rows]
        traj = {c: np.array([r[i] for r in rows], np.int64)
                for c, i in (("traj_id", 0), ("group_id", 1), ("version", 3), ("prompt_len", 5), ("response_len", 6))}
        traj |= {"attempt": np.zeros(len(rows), np.int64),
                "first_version": np.array([s[0] for s in segs], np.int64),
                "min_version": np.array([min(s) for s in segs], np.int64),
                "switched": np.array([min(s) != max(s) for s in segs], bool)}
        kept = [c for c in self.consumed if c[2] < self.kept]
        consumed = {c: np.array([x[i] for x in kept], np.int64)
                    for i, c in enumerate(("traj_id", "group_id", "consume_step", "version"))}
        return Tables(esteps, tsteps, ops, traj, consumed | {"traj_attempt": np.zeros(len(kept), np.int64)})

    # -- the files -------------------------------------------------------------------------------------
    def write(self, run_dir: Path, config_json: str, run_id: str, instances: int) -> Path:
        """Every shard of the run into ``run_dir`` (created), once it has ended (``end``): its train steps up to
        the last one kept, with what they consumed."""
        run_dir = Path(run_dir)
        if run_dir.is_dir() and any(run_dir.glob("*.h5")):
            raise FileExistsError(f"{run_dir} already holds a run's logs: write a simulated run into an empty "
                                  "directory (its shards would mix with them)")
        run_dir.mkdir(parents=True, exist_ok=True)
        steps = self.kept
        (run_dir / "launch.json").write_text(json.dumps({"config": json.loads(config_json), "run_id": run_id,
                                                         "simulated": True, "instances": instances,
                                                         "first_instance_rank": FIRST_INSTANCE_RANK},
                                                        indent=1) + "\n")

        def attrs(rank: int, role: str) -> dict:
            return {"schema_version": SCHEMA_VERSION, "run_id": run_id, "rank": rank, "role": role,
                    "config_json": config_json, "attempt": 0}

        def cols(rows: list[tuple], names: tuple[str, ...]) -> dict[str, list]:
            return {n: [r[i] for r in rows] for i, n in enumerate(names)} | {"attempt": [0] * len(rows)}

        op_cols = ("t_start", "t_end", "kind", "traj_id", "peer", "bytes", "version", "detail")
        traj_cols = ("traj_id", "group_id", "sample_idx", "version", "dispatch_version", "prompt_len", "response_len",
                     "t_dispatch", "t_finish", "n_migrations", "reprefill_tokens", "instance_path",
                     "segment_versions", "turns", "env_s")
        step_cols = ("t_start", "t_end", "batch_size", "capacity", "new_tokens", "kv_blocks_used", "version", "running",
                     "batch_versions")
        for i in range(instances):
            r = rank_of(i)
            write_shard(run_dir / f"traj-r{r}-00000.h5", "traj", attrs(r, "rollout"),
                        {"trajectories": cols(self.traj[r], traj_cols)})
            write_shard(run_dir / f"events-r{r}-00000.h5", "events", attrs(r, "rollout"),
                        {"steps": cols(self.esteps[r], step_cols), "ops": cols(self.ops[r], op_cols)})
        write_shard(run_dir / f"events-r{ORCH}-00000.h5", "events", attrs(ORCH, "orchestrator"),
                    {"steps": cols([], step_cols), "ops": cols(self.ops[ORCH], op_cols)})
        kept = [s for s in sorted(self.tsteps) if s < steps and self.tsteps[s][1] is not None]
        rows = [(s, *self.tsteps[s], f"sim-v{s + 1}") for s in kept]
        consumed = [c for c in self.consumed if c[2] < steps]
        return write_shard(run_dir / "train-00000.h5", "train", attrs(TRAINER_RANK, "trainer"), {
            "steps": cols(rows, ("step", "t_start", "t_end", "tokens", "weights_checksum")),
            "consumed": cols(consumed, ("traj_id", "group_id", "consume_step", "version", "staleness"))
            | {"traj_attempt": [0] * len(consumed)}})
