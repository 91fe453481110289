"""The trainer rank: a TransferQueue of streamed trajectories, GRPO steps, and published versions.

Invariants:
* a train step consumes exactly the groups the orchestrator named, each complete, each once; it
  waits (still receiving trajectories) until all their samples have arrived;
* data parallel over T trainer ranks: every rank gets every Train, trains on the groups it owns
  (``Roles.trainers_of_group``: rollout ranks stream each trajectory to its owner) and the replicas
  sum gradients, so all hold bit-identical weights after each step (checked); the lead trainer
  alone logs the step, reports Published, writes checkpoints; every replica serves weights;
* fault-tolerant replicas (``train.replicas``, train/ft.py): every rank of every replica group gets every
  group, and a replica group keeps each version (a shard a rank); each step's quorum splits the batch over
  the replicas alive then (``Replicas.share``), a step a replica was lost in is taken again by the others,
  and a replica that recovered a later version from a peer takes the step its peer was taking (from the
  recovered state: its Train and the trajectories its peer held untrained, merged by id with what arrives)
  and skips the Trains before it. A replacement replica (``dora-hpc join``, ``joining``) asks for a quorum
  as soon as it joins and is such a replica there. Every group's first rank logs the step and all it
  consumed (readers keep one of each row) and reports Published (rank 0 takes the first and learns who
  holds the version). A group of several ranks fails as a whole: once rank 0 fenced a rank of it, its other
  ranks leave (``leave``). The weights live in a trainer backend
  (``train.backend``: replicated torch, FSDP2 or megatron-core); every collective of a sharded backend (a
  step, gathering the weights to publish, gathering the optimizer for a checkpoint) is reached by every
  rank it shards over (every trainer rank, or every rank of a replica group) in the same message order;
* weights are served while a step computes (``runtime.serve_weights_while_training``): a helper thread
  answers SendWeights for versions already held, queues arriving trajectories (the step has taken its
  own out of the queue) and sets every other message aside, in arrival order, for after the step; it
  is the only thread touching MPI while it runs (the step itself uses none). So ``deferred`` never
  holds a trajectory: a step waiting for its stragglers finds them in the queue or in MPI;
* every consumed trajectory is logged with its staleness = consume_step - version;
* versions are published in order: after step n the trainer holds v_{n+1}; of every version still live
  (the last ``keep_versions`` ones) each trainer rank keeps only its shard in the publish dtype
  (train/publish.py), and an instance loading from the trainers gets every rank's shard. A shard goes as a
  delta against the version the instance holds where ``train.publish_delta`` is on, this rank still keeps
  that version's shard, and the delta is smaller. The version's checksum comes from the ranks' shard
  digests; replicated trainers (every rank holds the whole model) also prove they are bit-identical;
* a Checkpoint(v) is written only when the trainer holds exactly v_v (its steps are ordered before it)
  and renamed only on the orchestrator's Commit(v); on resume it starts from that checkpoint's weights,
  optimizer and RNG state, and the groups it consumed stay consumed;
* with ``cluster.elastic`` the rank also hosts a borrowed rollout instance (``self.rollout``, a
  RolloutRank on the same Comm): rollout messages go to it and its engine steps whenever no message
  waits. Rank 0 sends a borrowed instance its drain (MigrateOut, Park) and SleepEngine before the Train
  that follows, and one sender's messages arrive in order, so the engine is empty when a step starts;
  a parked request's KV is sent on when asked, even during a step (by the weight-serving thread); at a
  wake-up its own trainer's shard is handed over in memory, the other ranks' come over MPI. A borrowed vLLM engine
  runs in this process and builds its (one-rank) groups on the trainers' torch.distributed world when
  the backend made one: every trainer rank builds its engine at start-up, as new groups need, and
  closes it before the backend's world goes.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from ..core.policies import traits_of
from ..core.trajectory import Trajectory
from ..store import checkpoint as ckpt_store
from ..store.shards import ShardWriter
from ..train.dp import DataParallel
from ..train.grpo import GRPOTrainer, group_advantages, grpo_config
from ..train.lora import LoraSpec
from ..train.publish import delta, publish_dtype, shard_digest, shard_of, version_checksum
from .clock import RankClock
from .comm import Comm
from .messages import (
    AbortTraj,
    Checkpoint,
    Checkpointed,
    Commit,
    Flush,
    Forget,
    Generate,
    Holds,
    Initial,
    LoadVersion,
    MigrateIn,
    MigrateOut,
    NotCheckpointed,
    Park,
    Published,
    SendWeights,
    Shutdown,
    SleepEngine,
    Train,
    WeightsHeader,
)

ROLLOUT_MESSAGES = (Generate, LoadVersion, MigrateOut, MigrateIn, AbortTraj, Flush, WeightsHeader, Park, SleepEngine)

# train-step metrics logged as they are (store/shards.py: TRAIN_STEPS)
STEP_STATS = ("logprob_gap", "gap_tokens", "clip_frac_low", "clip_frac_high", "clip_band_frac", "dual_clip_frac",
              "entropy", "is_weight_mean", "is_weight_max", "is_truncated_frac", "is_masked_frac", "response_len_mean",
              "response_len_max")


class TrainerRank(RankClock):
    def __init__(self, comm: Comm, cfg, run_dir: Path, model_dir: Path, run_id: str, t0: float, attempt: int = 0,
                 resume: ckpt_store.Checkpoint | None = None, task=None, lighthouse: str | None = None,
                 joining: bool = False) -> None:
        """``lighthouse``: torchft's lighthouse (rank 0 serves it) where ``train.replicas`` > 1; ``joining``: a
        replacement replica (runtime/replacement.py), which recovers a live replica's state at the quorum it
        asks for first (``join``)."""
        self.comm, self.cfg, self.t0, self.run_dir, self.attempt = comm, cfg, t0, run_dir, attempt
        t = cfg.train
        self.replicated = comm.roles.replicated
        self.dp = self.data_parallel(lighthouse)
        self.lead = comm.rank == comm.roles.lead_trainer
        # logs each step's row, reports Initial and Published: the lead, or each replica group's first rank
        self.reports = self.lead or self.replicated and self.dp.shard_rank == 0
        lora = LoraSpec.of(cfg)
        self.lora = lora is not None  # a version is the adapter
        self.trainer = GRPOTrainer(model_dir, grpo_config(cfg), seed=cfg.seed, dp=self.dp, backend=t.backend,
                                   tensor_parallel=t.tensor_parallel,
                                   activation_checkpointing=t.activation_checkpointing,
                                   mixed_precision=t.mixed_precision, lora=lora)
        self.log = ShardWriter(run_dir, "train", comm.rank, "trainer", run_id, cfg.model_dump_json(),
                               cfg.store.rows_per_shard, attempt)
        self.version = 0
        self.consumed: set[int] = set()
        if resume is not None:
            rest = resume.optimizer()
            self.trainer.load_checkpoint(resume.weights(), rest)
            self.version = resume.step
            ledger = resume.state["orchestrator"]["ledger"]
            self.consumed = {g for g, _v, state, *_ in ledger["groups"] if state == 2}
        # this rank's shard of each version (a fault-tolerant replica group keeps a whole copy: it may be the only
        # one left)
        self.shard = self.dp.shard_rank if self.replicated else comm.rank - 1
        self.shards = comm.roles.publish_shards
        self.dtype = publish_dtype(t.publish_dtype, cfg.engine.dtype)
        self.versions: dict[int, tuple[dict, str]] = {}  # version -> (this rank's shard, its checksum)
        self.traits = traits_of(cfg.mode, cfg.dora.k)
        self.keep_versions = self.traits.keep_versions
        self.healed = False  # a replica that took a later version from a peer at a quorum (load_replica_state)
        self.recovered: Train | None = None  # ... and the Train its peer was taking then
        self.taking: Train | None = None  # the Train this replica's quorum is taking (a peer recovering takes it)
        self.joining = joining
        self.early_asks: list[SendWeights] = []  # a replica asked for a version before its step made it
        initial = self.publish(self.version, -1)
        if self.reports and not joining:  # rank 0 checks the instances that took v0 from the model folder against it
            self.comm.send(Initial(self.version, initial), 0)
        self.queue: dict[int, dict[int, Trajectory]] = {}  # group -> traj_id -> trajectory
        self.deferred: list[tuple[object, int]] = []
        self.forgotten: set[int] = set()  # groups never to be trained on: their late samples are not kept
        self.running = True
        self.rollout = None  # cluster.elastic: the borrowed instance this rank hosts
        if comm.roles.borrowed:
            from .rollout import RolloutRank

            self.rollout = RolloutRank(comm, cfg, run_dir, model_dir, task, run_id, t0, attempt)

    def data_parallel(self, lighthouse: str | None):
        """The trainer ranks' data parallelism: all of them (``DataParallel``), or this rank's fault-tolerant
        replica group among the others (``Replicas``, over the group's own split of the trainers' world)."""
        comm, t = self.comm, self.cfg.train
        collectives = "nccl" if self.cfg.runtime.device == "cuda" else "gloo"
        if not self.replicated:
            return DataParallel(comm.trainer_comm, collectives=collectives)
        from ..train.ft import Replicas

        ranks = comm.roles.replica_ranks(comm.rank)  # this rank's replica group (sharding inside it)
        group = None
        if len(ranks) > 1:
            sub = comm.trainer_comm.Split(ranks[0], comm.rank)
            group = DataParallel(sub, collectives=collectives)  # a lost peer: its rank leaves when fenced
        return Replicas(lighthouse, f"trainer{ranks[0]}", t.replica_timeout_s, self.replica_state,
                        self.load_replica_state, group=group)

    def run(self) -> None:
        try:
            self.serve()
        except Exception as e:
            if self.group_lost(wait=True):
                self.leave(f"{type(e).__name__}: {str(e)[:200]}")
            raise

    def group_lost(self, wait: bool = False) -> bool:
        """Whether rank 0's notices fenced a rank of this rank's replica group of several ranks (such a group fails
        as a whole; a replacement's group-mates were fenced before it joined, so only notices count); ``wait``:
        after a failure, for such a notice, up to the time rank 0 takes to fence a silent rank."""
        roles = self.comm.roles
        if not roles.replicated or roles.replica_size == 1:
            return False
        group = set(roles.replica_ranks(self.comm.rank))
        end = time.monotonic() + (self.cfg.runtime.hang_timeout_s + 2 * self.cfg.runtime.heartbeat_s if wait else 0)
        while not group & self.comm.told_fenced and time.monotonic() < end:
            self.comm.poll()  # takes rank 0's Fenced notices in; what else arrives is of no use now
            time.sleep(0.05)
        return bool(group & self.comm.told_fenced)

    def leave(self, why: str) -> None:
        """End this process, taking nothing down: rank 0 fenced its replica group, whose other ranks leave
        likewise, and the other groups train on. Immediate (no MPI_Finalize, which waits for the ranks still
        running), so a rank blocked in its group's quorum or collective does not hold up the others' quorum."""
        ranks = self.comm.roles.replica_ranks(self.comm.rank)
        print(f"dora-hpc: rank {self.comm.rank} leaves: its trainer replica group (ranks {ranks}) was fenced ({why})",
              file=sys.stderr, flush=True)
        self.comm.finish_sends(timeout_s=5.0)  # weights it was sending reach their instance (or are given up on)
        os._exit(0)

    def serve(self) -> None:
        if self.joining:
            self.join()
        while self.running:
            got = self.next_message()
            if got is None:
                if self.group_lost():  # fenced with its group while it waited: nothing will come
                    self.leave("while it waited for a step")
                if self.rollout is None or not self.rollout.work():
                    time.sleep(0.001)
                continue
            self.route(*got)
        if self.rollout is not None:
            self.rollout.close()
        self.log.flush()
        self.dp.close()

    def next_message(self):
        if self.deferred:
            return self.deferred.pop(0)
        if self.rollout is not None and self.rollout.deferred:  # set aside while it loaded weights
            return self.rollout.deferred.pop(0)
        return self.comm.poll()

    def route(self, msg, src: int) -> None:
        if self.rollout is not None and isinstance(msg, ROLLOUT_MESSAGES):
            self.rollout.handle(msg, src)
            return
        if self.rollout is not None and isinstance(msg, Shutdown):
            self.rollout.handle(msg, src)
        self.handle(msg, src)

    def handle(self, msg, src: int) -> None:
        match msg:
            case Trajectory():
                if msg.group_id not in self.forgotten:
                    self.queue.setdefault(msg.group_id, {})[msg.traj_id] = msg
            case Forget():  # dropped or filtered: its samples (some may still be on their way) are not kept
                self.forgotten.add(msg.group_id)
                self.queue.pop(msg.group_id, None)
            case SendWeights() if self.replicated and msg.version > self.version:  # its step will make it
                self.early_asks.append(msg)
            case SendWeights():
                if msg.version not in self.versions:
                    raise RuntimeError(f"trainer rank {self.comm.rank}: asked for v{msg.version}, holds "
                                       f"{sorted(self.versions)}")
                self.send_shard(msg)
            case Train():
                self.train(msg)
            case Checkpoint() if self.replicated and msg.version != self.version:  # it recovered a later one
                if msg.state is not None:  # the writer: rank 0 abandons this checkpoint
                    self.comm.send(NotCheckpointed(msg.version, self.version), src)
            case Checkpoint():
                if msg.version != self.version:
                    raise RuntimeError(f"trainer: checkpoint of v{msg.version} asked while holding v{self.version}")
                weights, rest = self.trainer.checkpoint_state()  # a collective for a sharded backend
                if msg.state is not None:  # the writer (the lead; one live replica)
                    ckpt_store.write(self.run_dir, msg.version, weights, rest, msg.state)
            case Commit():
                path = ckpt_store.commit(self.run_dir, msg.version, keep=self.cfg.train.keep_checkpoints)
                self.comm.send(Checkpointed(msg.version, str(path)), src)
            case Shutdown():
                self.running = False
                self.comm.fenced = msg.fenced
            case _:
                raise RuntimeError(f"trainer: unexpected message {msg!r}")

    def publish(self, version: int, step: int) -> str:
        """Keep this rank's shard of the weights it holds now as ``version`` (dropping versions no longer
        live) and return the version's checksum (a collective over the trainer ranks)."""
        base = version == 0 and self.lora  # v0 is the model folder's base: a fresh adapter is the identity
        shard = self.trainer.backend.shard_state_dict(self.shard, self.shards, self.dtype, base=base)
        digests = self.dp.allgather(shard_digest(shard))
        if self.trainer.backend.whole and self.shards > 1:  # a replica checks its neighbour's shard as well
            nxt = (self.shard + 1) % self.shards
            mine = shard_digest(shard_of(self.trainer.backend.published(base), nxt, self.shards, self.dtype))
            if self.dp.allgather(mine) != digests[1:] + digests[:1]:
                raise RuntimeError(f"trainer replicas diverged after step {step}: shard digests by trainer rank "
                                   f"{dict(enumerate(d[:16] for d in digests))}")
        checksum = version_checksum(digests)
        self.versions[version] = (shard, checksum)
        for old in [v for v in self.versions if v <= version - self.keep_versions]:
            del self.versions[old]
        asks, self.early_asks = self.early_asks, []
        for ask in asks:  # a replica's asks for versions it now holds
            self.handle(ask, 0)
        return checksum

    def send_shard(self, msg: SendWeights) -> None:
        """This rank's shard of ``msg.version``, each piece as a delta against ``msg.base`` where that is
        smaller; to this rank's own borrowed instance it is handed over in memory, whole."""
        shard, checksum = self.versions[msg.version]
        if msg.dst == self.comm.rank and self.rollout is not None:
            names = sorted(shard)
            header = WeightsHeader(msg.version, names, [tuple(shard[n].shape) for n in names], checksum, [],
                                   str(self.dtype).removeprefix("torch."), self.shard, self.shards)
            self.rollout.early.append((header, self.comm.rank, dict(shard)))
            return
        base = self.versions.get(msg.base, (None,))[0] if self.cfg.train.publish_delta else None
        pieces = shard if base is None else {n: (delta(p, base[n]) if n in base else None) or p  # (v0's adapter: none)
                                             for n, p in shard.items()}
        self.comm.send_weights(pieces, msg.version, checksum, msg.dst, shard=self.shard, shards=self.shards,
                               base=-1 if base is None else msg.base)

    @contextmanager
    def serving_weights(self):
        """While the body runs, a helper thread answers SendWeights (rollout ranks loading from this
        trainer would otherwise wait for the whole step) and defers every other message."""
        if not self.cfg.runtime.serve_weights_while_training:
            yield
            return
        stop = threading.Event()
        failed: list[BaseException] = []

        def serve() -> None:
            try:
                while not stop.is_set():
                    got = self.comm.poll()
                    if self.group_lost():  # the step cannot end: a rank of this group is gone
                        self.leave("while a step or its quorum was under way")
                    if got is None:
                        time.sleep(0.001)
                    elif isinstance(got[0], Trajectory):
                        self.handle(*got)
                    elif isinstance(got[0], SendWeights) and got[0].version in self.versions:
                        self.handle(*got)
                        self.comm.wait_bulk()  # a large send progresses only inside its sender's MPI calls
                    elif self.parked_restore(got):  # its borrowed instance's parked KV, restored elsewhere
                        self.comm.wait_bulk()
                    else:
                        self.deferred.append(got)
            except BaseException as e:  # noqa: BLE001 - re-raised in the main thread below
                failed.append(e)

        helper = threading.Thread(target=serve, name="weight-server", daemon=True)
        helper.start()
        try:
            yield
        finally:
            stop.set()
            helper.join()
        if failed:
            raise failed[0]

    def parked_restore(self, got: tuple) -> bool:
        """A MigrateOut of a request its borrowed instance parked: sent on now, even while a step runs (the
        KV waits in this rank's memory, the engine is not involved), so it never waits for the step."""
        msg, src = got
        if self.rollout is None or not isinstance(msg, MigrateOut) or msg.traj_id not in self.rollout.parked:
            return False
        self.rollout.handle(msg, src)
        return True

    def _complete(self, g: int) -> bool:
        return len(self.queue.get(g, {})) == self.cfg.batch.group_size

    def await_groups(self, groups, limit_s: float | None = None) -> None:
        """Until every one of ``groups`` is complete here (stragglers' messages are in flight). ``limit_s``: a
        replica that recovered a step from a peer gives up after that long (a trajectory the peer had not
        yet received when it gave its state, and sent before this replica was linked, never comes here):
        it fails, and rank 0 fences it like any lost replica."""
        end = None if limit_s is None else time.monotonic() + limit_s
        while not all(self._complete(g) for g in groups):
            if end is not None and time.monotonic() > end:
                missing = sorted(g for g in groups if not self._complete(g))
                raise RuntimeError(f"trainer rank {self.comm.rank}: groups {missing[:8]} of the step it recovered "
                                   f"did not arrive within {limit_s:g} s")
            got = self.comm.poll()
            if got is None:
                if self.group_lost():
                    self.leave("while it waited for its step's trajectories")
                time.sleep(0.001)
            elif isinstance(got[0], Trajectory | SendWeights):
                self.handle(*got)
            elif self.parked_restore(got):
                pass
            else:  # e.g. a Checkpoint of the version this step makes: after the step
                self.deferred.append(got)

    def train(self, msg: Train, joined: bool = False) -> None:
        """``joined``: a replacement replica's first step, whose quorum it is already in (``join``)."""
        if self.replicated and msg.step < self.version:  # taken by the others while this replica was away
            self.skip(msg)
            return
        if msg.step != self.version:
            raise RuntimeError(f"trainer: step {msg.step} asked while holding v{self.version}")
        dup = self.consumed.intersection(msg.group_ids)
        if dup:
            raise RuntimeError(f"trainer: step {msg.step} would consume groups {sorted(dup)} a second time")
        self.await_groups(self.mine(msg.group_ids))
        self.comm.wait_bulk()  # weights sent to rollout ranks must not stall behind this step
        t_start = self.now()
        msg, trajs, metrics = self.replica_step(msg, joined) if self.replicated else self.owned_step(msg)
        for g in msg.group_ids:
            self.queue.pop(g, None)
        version = self.version = msg.step + 1
        checksum = self.publish(version, msg.step)
        self.consumed.update(msg.group_ids)
        # a replica logs the whole step (every replica does: the step is logged while one lives; readers keep
        # one of each row, store/shards.py read_table); a data-parallel rank its own groups, the lead the step
        advantages = group_advantages(trajs, self.trainer.cfg.adv_std_norm) if self.replicated else \
            metrics["advantages"]
        for t, adv in zip(trajs, advantages, strict=True) if self.reports or not self.replicated else ():
            self.log.append("consumed", {"traj_id": t.traj_id, "group_id": t.group_id, "consume_step": msg.step,
                                         "version": t.version, "staleness": msg.step - t.version,
                                         "advantage": adv, "reward": t.reward, "traj_attempt": t.attempt})
        row = {"step": msg.step, "t_start": t_start, "t_end": self.now(), "loss": metrics["loss"],
               "reward_mean": metrics["reward_mean"], "clip_frac": metrics["clip_frac"], "kl": metrics["kl"],
               "tokens": metrics["tokens"], "weights_checksum": checksum, **{k: metrics[k] for k in STEP_STATS}}
        if self.reports:
            self.log.append("steps", row)
        self.log.flush()
        if self.reports:  # the row as logged: rank 0's metric sinks show exactly the HDF5 table
            self.comm.send(Published(version, checksum, {k: v for k, v in row.items() if k != "weights_checksum"}),
                           0)

    def mine(self, groups) -> list[int]:
        """The groups of a step this rank holds: its own (data parallel), or all of them (a replica)."""
        return list(groups) if self.replicated else [g for g in groups
                                                     if self.comm.roles.trainers_of_group(g) == [self.comm.rank]]

    def samples(self, groups) -> tuple[list[Trajectory], list[Trajectory]]:
        """The trajectories of ``groups`` (left in the queue: a replica's step may be taken again) and the
        samples a step trains on: under partial rollout a trajectory's tokens may span versions, so none
        counts as sampled under one."""
        trajs = [t for g in groups for t in sorted(self.queue[g].values(), key=lambda x: x.traj_id)]
        return trajs, trajs if self.traits.single_version else [replace(t, version=-1) for t in trajs]

    def owned_step(self, msg: Train) -> tuple[Train, list[Trajectory], dict]:
        """Data parallel: this rank's own groups; the gradient sums reach every rank."""
        trajs, samples = self.samples(self.mine(msg.group_ids))
        with self.serving_weights():
            metrics = self.trainer.train_step(samples, msg.group_ids)
        return msg, trajs, metrics

    def replica_step(self, msg: Train, joined: bool = False) -> tuple[Train, list[Trajectory], dict]:
        """A fault-tolerant replica: the step's quorum, then this replica's share of the batch (the quorum's
        ``rank``-th of every ``size`` groups); a step a replica was lost in is taken again in a new quorum,
        from the weights of its start. Returns the Train it took (a later one where this replica recovered a
        later version at the quorum) and the whole batch's trajectories. ``joined``: its quorum is formed
        (a replacement's first step, ``join``)."""
        from ..train.dp import StepAborted

        while True:
            if joined:
                joined = False
            else:
                self.take_arrived()  # what has arrived is in the queue when a peer recovering takes it
                self.taking = msg
                with self.serving_weights():
                    self.dp.start_step()  # a replica new to the quorum recovers the others' state here
                if self.healed:  # it took version self.version from a peer: Trains before it are the others' past
                    msg = self.resume_at(msg)
            groups = list(msg.group_ids)
            share = set(self.dp.share(groups))
            before = self.trainer.replica_state() if self.trainer.cfg.mini_batches > 1 else None
            trajs, samples = self.samples(groups)
            try:
                with self.serving_weights():
                    metrics = self.trainer.train_step([s for s in samples if s.group_id in share], groups)
            except StepAborted:
                if before is not None:  # earlier mini-batches of it stepped: back to the step's start
                    self.trainer.load_replica_state(before)
                self.op_abort(msg.step)
                continue
            return msg, trajs, metrics

    def op_abort(self, step: int) -> None:
        print(f"dora-hpc: trainer rank {self.comm.rank}: a replica was lost in step {step}; taking it again with "
              "those left", file=sys.stderr, flush=True)

    def skip(self, msg: Train) -> None:
        """A step the other replicas took while this one was away: its groups are consumed (their late
        samples are not kept)."""
        for g in msg.group_ids:
            self.queue.pop(g, None)
        self.consumed.update(msg.group_ids)
        self.forgotten.update(msg.group_ids)

    def join(self) -> None:
        """A replacement replica (``joining``), once rank 0 took its Hello: into the quorum of the others'
        next step at once, not at its first Train (a replica that heartbeats to the lighthouse but asks for
        no quorum keeps a lone survivor from forming one: torchft's majority rule), waiting for it up to
        ``runtime.join_timeout_s``. There it recovers a live replica's state and takes that step with them."""
        self.joining = False
        self.taking = None
        with self.serving_weights():
            self.dp.start_step(timeout_s=self.cfg.runtime.join_timeout_s)
        if not self.healed:  # the others had committed no step: nothing to take (it cannot happen after a fence)
            raise RuntimeError(f"trainer rank {self.comm.rank}: joined a quorum with nothing to recover")
        self.train(self.resumed(), joined=True)

    def resume_at(self, msg: Train) -> Train:
        """After recovering version v from a peer at ``msg``'s quorum: the Train the peer was taking (step v);
        ``msg`` is skipped where it is older, and kept for after where it is newer."""
        train = self.resumed()
        if msg.step < self.version:
            self.skip(msg)
        elif msg.step > self.version:
            self.deferred.insert(0, (msg, 0))
        return train

    def resumed(self) -> Train:
        """Right after recovering version v from a peer: say so to rank 0 (the version's holders) and return
        the Train the peer was taking (step v), once its groups are complete here."""
        self.healed = False
        checksum = self.publish(self.version, self.version - 1)  # a collective within a replica group
        if self.reports:
            self.comm.send(Holds(self.version, checksum), 0)
        train, self.recovered = self.recovered, None
        if train is None or train.step != self.version:
            raise RuntimeError(f"trainer rank {self.comm.rank}: recovered v{self.version} without its step")
        print(f"dora-hpc: trainer rank {self.comm.rank}: recovered v{self.version} from a live replica at step "
              f"{train.step}'s quorum", file=sys.stderr, flush=True)
        self.await_groups(train.group_ids, limit_s=self.cfg.train.replica_timeout_s)
        return train

    def take_arrived(self) -> None:
        """Take in every message that has arrived: trajectories into the queue, the rest set aside in order."""
        while (got := self.comm.poll()) is not None:
            if isinstance(got[0], Trajectory | Forget | SendWeights):
                self.handle(*got)
            else:
                self.deferred.append(got)

    def replica_state(self) -> dict:
        """What a replica joining the quorum takes from this one (torchft's live recovery): the weights and
        optimizer at this step's start, the version, the groups consumed, and (pickled: torchft moves tensors
        and plain containers) the step being taken, the trajectories held untrained and the groups forgotten.
        Read while the weight-serving thread may add trajectories: each dict is copied whole first."""
        queue = {g: dict(ts) for g, ts in list(self.queue.items())}
        pending = pickle.dumps({"train": self.taking, "queue": queue, "forgotten": set(self.forgotten)})
        return {"trainer": self.trainer.replica_state(), "version": self.version, "consumed": sorted(self.consumed),
                "pending": torch.frombuffer(bytearray(pending), dtype=torch.uint8)}

    def load_replica_state(self, state: dict) -> None:
        self.trainer.load_replica_state(state["trainer"])
        self.healed = state["version"] != self.version
        self.version = state["version"]
        self.consumed = set(state["consumed"])
        pending = pickle.loads(state["pending"].numpy().tobytes())
        self.recovered = pending["train"]
        self.forgotten |= pending["forgotten"]
        for g, trajs in pending["queue"].items():  # merged by trajectory id with what arrived here
            if g not in self.consumed and g not in self.forgotten:
                self.queue.setdefault(g, {}).update({i: t for i, t in trajs.items()
                                                     if i not in self.queue.get(g, {})})
        for g in [g for g in self.queue if g in self.consumed or g in self.forgotten]:
            del self.queue[g]
