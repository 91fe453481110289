"""Simulator: a discrete-event cluster that executes a core policy's commands in simulated time.

Invariants:
* the simulator keeps its own record of every trajectory (segment versions, migrations, re-prefill)
  and of every consumed group; the invariant counts in the summary come from that record, never
  from the policy's bookkeeping;
* an instance advances in macro steps -- from one batch change to the next -- with the exact closed
  form of CostModel.decode_time, so a run costs O(events), not O(decode steps);
* borrowed instances (cluster.elastic) run on the trainer's accelerators, with the KV room its
  resident state leaves; a StartTrain waits until each is drained (its KV migrated or offloaded, at link
  speed, one transfer after another) and asleep (``engine_sleep_s``); waking costs ``engine_wake_s``
  plus the weight load;
* a multi-turn episode (``workload.turns``) is one trajectory to the policy: between its turns it is held
  on its instance (KV resident, no compute) while its environment step runs (an ``env`` event); it migrates,
  is offloaded and restored like any request, waiting or decoding, and its next turn starts where it is
  when the step ends (in transit: on arrival). The environment also steps after the last turn (it says
  done), the episode held as between turns; the policy hears of the episode once, when that step ends;
* simulated time only; nothing here reads a clock.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from dataclasses import dataclass, replace

from ..config import RunConfig
from ..core.events import (
    FOLDER,
    TRAINER,
    Abort,
    AssignVersion,
    Dispatch,
    Drop,
    InstanceReady,
    KvPressure,
    Migrate,
    Offload,
    Progress,
    RequestFinished,
    Restore,
    Retire,
    Sleep,
    Start,
    StartTrain,
    Tick,
    VersionPublished,
)
from ..core.policies import make_policy, traits_of
from .borrowed import Borrowing
from .costs import CostModel
from .episodes import EpisodeSteps
from .instance import OWES_HOST, OWES_NOTHING, OWES_REPREFILL, Instance, Req, SimError
from .logs import SimLog
from .workload import Logged, Workload


@dataclass
class TrajRecord:
    group: int
    segments: list[int]
    migrations: int = 0
    reprefill: int = 0
    finished: bool = False
    turn: int = 0          # the turn under way (a multi-turn episode)
    aborted: bool = False
    env_s: float = 0.0     # its environment steps' seconds
    said_done: bool = False  # its last environment step ended while it was moving or parked


class Simulator(Borrowing, EpisodeSteps):
    def __init__(self, cfg: RunConfig, mode: str, timeline: bool = True, cost: CostModel | None = None,
                 logged: Logged | None = None) -> None:
        """``cost``: a fitted cost model (sim/fit.py) instead of the roofline one of ``cfg.sim``; ``logged``: a
        real run's lengths in place of the workload's draws where it has them (sim/workload.py). It keeps the
        runtime's tables as it runs (sim/logs.py): its summary is computed from them, ``write_logs`` writes them."""
        self.cfg, self.mode = cfg, mode
        placement = cfg.cluster.placement_of(mode)
        self.colocated = placement == "colocated"
        n_inst, self.train_accels = cfg.cluster.split(placement)
        tp = cfg.cluster.accelerators_per_instance
        self.cost = cost or CostModel.build(cfg.sim, tp)
        self.n_borrowed = cfg.cluster.borrowed(placement, traits_of(mode, cfg.dora.k).elastic)
        resident = cfg.sim.hardware.trainer_state_bytes_per_param * cfg.sim.model.params_b * 1e9 / self.train_accels
        self.borrowed_cost = cost or CostModel.build(cfg.sim, tp, reserved_bytes=tp * resident)
        self.policy = make_policy(cfg, n_inst, mode, self.n_borrowed)
        self.shared = self.policy.cfg.shared_instances  # train.lora: versions are adapters every instance hosts
        if self.shared:  # each decode step pays for the adapters; a publish moves an adapter's bytes
            self.cost = replace(self.cost, a=self.cost.a + cfg.sim.hardware.lora_step_ms / 1e3)
            self.adapter_share = cfg.sim.model.adapter_bytes(cfg.train.lora.rank) / cfg.sim.model.weight_bytes
        self.work = Workload(cfg.workload, cfg.seed, logged)
        offload = self.policy.traits(cfg.dora.k).kv_offload and cfg.engine.on_kv_full == "offload"
        share = {"share": cfg.engine.prefix_caching, "shared_prefix": cfg.workload.shared_prefix_tokens}
        self.inst = [Instance(i, self.cost, kv_offload=offload, **share) for i in range(n_inst)]
        self.inst += [Instance(n_inst + j, self.borrowed_cost, kv_offload=offload, **share)
                      for j in range(self.n_borrowed)]
        self.parked: dict[int, tuple[int, Req]] = {}  # offloaded by a borrowed instance: (it, the request)
        self.drain_end: dict[int, float] = {}     # borrowed instance -> when its drain and sleep are done
        self.now = 0.0
        self._q: list[tuple[float, int, tuple]] = []
        self._seq = itertools.count()
        self.timeline_on = timeline
        # (instance, t0, t1, state, version, fill quartile 1-4 of max_num_seqs while busy)
        self.timeline: list[tuple[int, float, float, str, int | None, int]] = []
        # the simulator's own record
        self.trajs: dict[int, TrajRecord] = {}
        self.episodes: dict[int, list] = {}  # traj -> its turns (workload.Turn)
        self.in_transit: dict[int, list] = {}
        self.consumed: Counter[int] = Counter()
        self.dropped: set[int] = set()
        self.steps: list[dict] = []
        self.ops: Counter[str] = Counter()        # seconds by overhead kind (plus each instance's own)
        self.counts: Counter[str] = Counter()     # migrations, reprefill tokens, ... (likewise)
        self.trainer_busy = False
        self.running = 0
        self._last_mark = 0.0
        self.wait_s: Counter[str] = Counter()     # trainer idle seconds by what it waits for (Policy.train_wait)
        self.kv_peak = 0.0
        self._kv_hot: set[int] = set()
        self.log = SimLog(cfg.batch.group_size, cfg.engine.block_size)

    # -- event loop --------------------------------------------------------------------------------
    def _at(self, t: float, *ev) -> None:
        heapq.heappush(self._q, (t, next(self._seq), ev))

    def run(self, max_events: int = 50_000_000) -> Simulator:
        self._feed(Start())
        self._at(self.cfg.sim.tick_s, "tick")
        for _ in range(max_events):
            n = self.cfg.sim.steps
            if len(self.steps) >= n and self.steps[n - 1]["t_end"] is not None:
                del self.steps[n:]  # a step started after the last measured one is not counted
                self.log.end(n, self.policy.ledger.next_group, self.policy.ledger.open_groups())
                self._close_timeline()
                return self
            if not self._q:
                raise SimError(f"{self.mode}: deadlock at t={self.now:.1f}s after {len(self.steps)} steps")
            t, _, ev = heapq.heappop(self._q)
            self.now = t
            getattr(self, "_ev_" + ev[0])(*ev[1:])
        raise SimError(f"{self.mode}: no end after {max_events} events")

    def _feed(self, event) -> None:
        self._mark()  # the policy's state (what an idle trainer waits for) changes only here
        if isinstance(event, RequestFinished):
            t = event.traj_id
            self.log.finished(self.now, t, event.instance, self.trajs[t], self.work.prompt_len(self.trajs[t].group),
                              sum(x.tokens + x.env_tokens for x in self.episodes[t]))
        for cmd in self.policy.on(event):
            self._execute(cmd)

    def _model_tokens(self, t: int) -> int:
        return sum(x.tokens for x in self.episodes[t])

    def _ev_tick(self) -> None:
        if self.policy.cfg.by_work:  # what the work planner estimates decode left from
            for inst in self.inst:
                reqs = [*inst.reqs.values(), *inst.waiting, *inst.held.values()]
                if reqs:
                    self._feed(Progress(inst.idx, tuple((r.traj, inst.generated(r)) for r in reqs)))
        self._feed(Tick())
        self._at(self.now + self.cfg.sim.tick_s, "tick")

    def _ev_ready(self, i: int, v: int, load_epoch: int) -> None:
        inst = self.inst[i]
        if load_epoch != inst.load_epoch:
            return  # a Sleep cancelled this load
        inst.loading, inst.version = False, v
        inst.resident = {v}
        self.log.ready(self.now, i)
        self._start(inst)
        self._feed(InstanceReady(i, v))

    def _ev_added(self, i: int, v: int, load_epoch: int) -> None:
        """An adapter's load ended: the instance hosts ``v`` beside the others."""
        inst = self.inst[i]
        if load_epoch != inst.load_epoch:
            return
        inst.resident.add(v)
        inst.version = max(inst.resident)
        self.log.ready(self.now, i)
        self._feed(InstanceReady(i, v))

    def _ev_run(self, i: int, epoch: int) -> None:
        inst = self.inst[i]
        if epoch != inst.epoch:
            return
        self._stop(inst)
        done = []
        for r in inst.pop_finished():
            rec = self.trajs[r.traj]
            turns = self.episodes[r.traj]
            last = rec.turn == len(turns) - 1  # the step after the last turn only says done: skipped when instant
            if not rec.said_done and (not last or turns[rec.turn].env_s > 0):  # held while its environment steps
                r.waiting_env = True
                inst.hold(r)
                self._at(self._env_done_at(inst, turns[rec.turn].env_s), "env", r.traj, rec.turn)
                continue
            rec.finished = True
            done.append(r.traj)
        self._start(inst)
        for t in done:
            self._feed(RequestFinished(t, i, tokens=self._model_tokens(t)))
        self._check_kv(inst)

    def _ev_arrive(self, t: int, seq: int) -> None:
        if self.in_transit.get(t, [None, None, None])[2] != seq:
            return  # offloaded on the way (a drain): it waits in host memory instead
        dst, req, _ = self.in_transit.pop(t)
        inst = self.inst[dst]
        if not inst.hosts(self.trajs[t].segments[-1]):
            raise SimError(f"trajectory {t} arrived at instance {dst} that no longer hosts its version")
        self.log.arrived(self.now, t, dst, (req.prompt + req.gen_at_join) * self.cost.kv_bytes_per_token)
        self._stop(inst)
        if req.waiting_env:  # its environment step is still under way: held here
            inst.hold(req)
        else:
            inst.admit(req, front=True)
        self._start(inst)
        if req.waiting_env:
            self._check_kv(inst)

    def _ev_trained(self, step: int) -> None:
        self._mark()
        self.trainer_busy = False
        self.steps[step]["t_end"] = self.now
        self.log.trained(self.now, step)
        if self.colocated:
            for inst in self.inst:
                inst.paused = False
                self._start(inst)
        self._feed(VersionPublished(step + 1))

    # -- instance mechanics ------------------------------------------------------------------------
    def _stop(self, inst: Instance) -> None:
        """Advance ``inst`` to now; it stops running until _start."""
        if inst.t_run is None:
            return
        self._mark()
        t0, steps0, running, waiting = inst.t_run, inst.steps, len(inst.reqs), len(inst.waiting)
        if self.now > t0:  # the batch's versions, for its engine-step row (before advance finishes any): one where
            # the instance hosts one (a request runs only under the version its instance holds, Instance.hosts)
            versions = len({self.trajs[t].segments[-1] for t in inst.reqs}) if len(inst.resident) > 1 else \
                min(len(inst.reqs), 1)
        inst.advance(self.now)
        self.running -= 1
        if self.now > t0:
            self.log.advanced(t0, self.now, inst, inst.steps - steps0, running, waiting, self.policy.cfg.slots,
                              versions)

    def _start(self, inst: Instance) -> None:
        self._stop(inst)
        runnable = not (inst.loading or inst.paused or inst.asleep)
        if runnable:
            inst.fill()
            inst.preempt()
        state = ("loading" if inst.loading else "paused" if inst.paused or inst.asleep
                 else "busy" if inst.reqs else "idle")
        self._set_state(inst, state)
        if state != "busy":
            return
        self._mark()
        inst.t_run = self.now
        self.running += 1
        self._at(self.now + inst.run_length(), "run", inst.idx, inst.epoch)

    def _set_state(self, inst: Instance, state: str) -> None:
        fill = -(-4 * len(inst.reqs) // self.policy.cfg.slots) if state == "busy" else 0
        key = (state, inst.version, fill)
        if key != inst.state:
            if self.timeline_on and self.now > inst.since:
                self.timeline.append((inst.idx, inst.since, self.now, *inst.state))
            inst.state, inst.since = key, self.now

    def _close_timeline(self) -> None:
        for inst in self.inst:
            self._stop(inst)
            self._set_state(inst, "end")

    def _mark(self) -> None:
        dt = self.now - self._last_mark
        if not self.trainer_busy and dt > 0:
            self.wait_s[kind := self.policy.train_wait() or "start"] += dt
            self.log.waiting_for(self._last_mark, self.now, kind)
        self._last_mark = self.now

    def _check_kv(self, inst: Instance) -> None:
        frac = inst.kv_tokens() / max(inst.cost.kv_capacity_tokens, 1.0)
        self.kv_peak = max(self.kv_peak, frac)
        hot = frac >= self.cfg.dora.kv_threshold
        if hot and inst.idx not in self._kv_hot:
            self._kv_hot.add(inst.idx)
            self._feed(KvPressure(inst.idx, frac))
        elif not hot:
            self._kv_hot.discard(inst.idx)

    # -- commands ----------------------------------------------------------------------------------
    def _load_share(self, inst: Instance, src: int) -> float:
        """The share of the weights' bytes a load moves: ``sim.hardware.delta_ratio`` for a load from the
        trainers onto an instance that holds a version (``train.publish_delta``, as the runtime sends it),
        else all of them (a peer's whole weights, a first load, a borrowed instance waking)."""
        holds = inst.version is not None and not inst.loading and not inst.asleep
        delta = self.cfg.train.publish_delta and src == TRAINER and holds
        return self.cfg.sim.hardware.delta_ratio if delta else 1.0

    def _execute(self, cmd) -> None:
        match cmd:
            case Retire(i, v):
                inst = self.inst[i]
                if any(self.trajs[r.traj].segments[-1] == v for r in (*inst.reqs.values(), *inst.waiting,
                                                                      *inst.held.values())):
                    raise SimError(f"{cmd}: a request of v{v} is still on instance {i}")
                inst.resident.discard(v)
            case AssignVersion():
                self._assign(cmd)
            case Dispatch(t, g, _s, v, i):
                inst = self.inst[i]
                if not inst.hosts(v):
                    raise SimError(f"{cmd}: instance {i} does not host v{v}")
                if t in self.trajs:
                    raise SimError(f"trajectory {t} dispatched twice")
                self.trajs[t] = TrajRecord(g, [v])
                self.log.dispatched_to(self.now, t, i)
                prompt = self.work.prompt_len(g)
                self.episodes[t] = self.work.episode(t, prompt)
                self._stopped(i).admit(Req(t, prompt, self.episodes[t][0].tokens, group=g))
                self._start(inst)
                self._check_kv(inst)
            case Migrate(t, _, _, _) | Offload(t, _) | Restore(t, _) if self.trajs[t].finished:
                pass  # it finished in the same macro step; its RequestFinished is next in line
            case Migrate(t, src, dst, carry_kv):
                self._migrate(t, src, dst, carry_kv)
            case Abort(t, i):
                self.trajs[t].aborted = True
                self._stopped(i).remove(t)
                self._start(self.inst[i])
            case Drop(g, reason):
                self.dropped.add(g)
                self.log.dropped(self.now, g, reason)
            case StartTrain(step, groups):
                self._train(step, groups)
            case Offload(t, i) | Restore(t, i):
                (self._offload if isinstance(cmd, Offload) else self._restore)(t, i)
            case Sleep(i):
                self._sleep(i)
            case _:
                raise SimError(f"unknown command {cmd!r}")

    def _assign(self, cmd: AssignVersion) -> None:
        """A weight load: an adapter beside those hosted (``add``: nothing stops, an adapter's bytes move), or a
        whole version (the instance stops until it is ready; with ``keep_requests`` its requests re-prefill)."""
        i, v, src = cmd.instance, cmd.version, cmd.source
        inst = self.inst[i] if cmd.add else self._stopped(i)
        if cmd.add:
            share = self.adapter_share
            load_s = share * self.cost.weight_load_s
        else:
            if inst.has_work() and not cmd.keep_requests:
                raise SimError(f"{cmd} on an instance with live requests")
            for r in inst.invalidate_kv() if cmd.keep_requests else []:
                tokens = r.prompt + r.gen_at_join
                self.trajs[r.traj].reprefill += tokens
                self.counts["reprefill_tokens"] += tokens
            for r in list(inst.reqs.values()) + list(inst.waiting) + list(inst.held.values()):
                self.trajs[r.traj].segments.append(v)  # the first segment stays the group's tag
            share = self._load_share(inst, src)
            load_s = share * self.cost.weight_load_s + (self.cfg.sim.hardware.engine_wake_s if inst.asleep else 0)
            inst.loading, inst.version, inst.asleep, inst.resident = True, None, False, set()
            inst.load_epoch += 1  # an adapter load under way is superseded
        self.log.assigned(self.now, i, v, src)
        self.ops["weight_sync"] += load_s
        self.counts["weight_syncs"] += 1
        if src != FOLDER:  # the model folder's v0 takes as long to load, but nothing crosses the network
            self.counts["trainer_load_bytes" if src == TRAINER else "peer_load_bytes"] += (
                share * self.cfg.sim.model.weight_bytes)
        self.counts["weight_load_s"] += share * self.cost.weight_load_s
        if not cmd.add:
            self._start(inst)
        self._at(self.now + load_s, "added" if cmd.add else "ready", i, v, inst.load_epoch)

    def _stopped(self, i: int) -> Instance:
        self._stop(self.inst[i])
        return self.inst[i]

    def _migrate(self, t: int, src: int, dst: int, carry_kv: bool) -> None:
        if t in self.in_transit:  # re-routed while still moving: it lands on the new destination
            self.in_transit[t][0] = dst
            return
        req = self._stopped(src).remove(t)
        self._start(self.inst[src])
        tokens = req.prompt + req.gen_at_join
        rec = self.trajs[t]
        self.log.migrating(self.now, t, src, dst, carry_kv)
        rec.migrations += 1
        if req.waiting_env:
            self.counts["waiting_migrations"] += 1
        dt = 0.0
        if req.owes == OWES_HOST or req.owes == OWES_NOTHING:  # it has KV somewhere
            if carry_kv:
                dt = self.cost.kv_transfer_time(tokens)
                self.ops["migration"] += dt
                req.owes = OWES_NOTHING
            else:
                rec.reprefill += tokens
                self.counts["reprefill_tokens"] += tokens
                req.owes = OWES_REPREFILL
        if src >= len(self.inst) - self.n_borrowed:  # a drain: its KV must leave before training starts
            self.counts["drain_migrations"] += 1
            self._drain(src, dt)
            dt = self.drain_end[src] - self.now
        self._send(t, dst, req, dt)

    def _send(self, t: int, dst: int, req: Req, dt: float) -> None:
        """``req`` reaches instance ``dst`` in ``dt`` seconds (each send has its own arrival event)."""
        seq = next(self._seq)
        self.in_transit[t] = [dst, req, seq]
        self._at(self.now + dt, "arrive", t, seq)

    def _train(self, step: int, groups: tuple[int, ...]) -> None:
        if self.trainer_busy or step != len(self.steps):
            raise SimError(f"StartTrain({step}) while the trainer is busy or out of order")
        g_size = self.cfg.batch.group_size
        tokens = 0
        stale = []
        for g in groups:
            self.consumed[g] += 1
            versions = set()
            for t in range(g * g_size, (g + 1) * g_size):
                rec = self.trajs[t]
                if not rec.finished:
                    raise SimError(f"step {step} consumes unfinished trajectory {t}")
                versions.update(rec.segments)
                tokens += self.work.prompt_len(g) + sum(x.tokens + x.env_tokens for x in self.episodes[t])
            stale.append(step - min(versions))
        self._mark()
        self.trainer_busy = True
        dur = self.cost.train_time(tokens, self.train_accels)
        if self.colocated:
            dur += self.cost.colocated_switch_s
            for inst in self.inst:
                self._stopped(inst.idx).paused = True
                self._start(inst)
        drained = max([self.now, *self.drain_end.values()])  # borrowed instances drained and asleep
        begin = max(drained, self.cfg.sim.hardware.trainer_start_s)  # and the trainer's model built
        self.drain_end.clear()
        self.steps.append({"step": step, "t_start": self.now, "t_end": None, "tokens": tokens,
                           "train_s": dur, "drain_s": drained - self.now, "staleness": stale,
                           "admission_cap": self.policy.admission_cap()})
        trained = sum(x.tokens for g in groups for t in range(g * g_size, (g + 1) * g_size) for x in self.episodes[t])
        self.log.train(self.now, begin, step, groups, self.trajs, trained, self.policy.admission_cap())
        self._at(begin + dur, "trained", step)

    def write_logs(self, run_dir) -> None:
        """The run's HDF5 logs (sim/logs.py) into ``run_dir``, once it has run."""
        cfg = self.cfg.model_copy(update={"mode": self.mode})
        self.log.write(run_dir, cfg.model_dump_json(), f"sim-{self.mode}-seed{self.cfg.seed}", len(self.inst))
