"""A rollout rank: one engine, hosting one policy version at a time.

Invariants:
* it generates whenever it has work and polls control messages between engine steps, so messages
  never stall generation for more than one step;
* while it waits for the weights of a new version it defers every other message (a Generate for
  the new version must not reach the engine before the weights); weights that overtake their
  LoadVersion (they come from another rank, so MPI does not order them) wait for it;
* every finished trajectory is rewarded here (a reward function that raises gives reward 0 and a
  recorded error), written to this rank's HDF5 shard, streamed to the trainer that owns its group,
  and reported to the orchestrator -- in that order;
* a MigrateOut, AbortTraj or Park may name a request that is still on its way here (the orchestrator
  moved it here and then on; MPI does not order messages from different senders): it waits for the
  request, which is then relayed untouched, dropped or parked -- never imported under another version;
* a borrowed instance (on a trainer rank, cluster.elastic) parks requests in its memory when drained
  (Park) and sends a parked one on, or imports it back, when a MigrateOut names it;
* with ``env.name`` set a request is a multi-turn episode (episodes.py): it is finished (above) when its
  episode ends, not when a turn does, and it migrates or parks between turns as within one.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from ..core.events import FOLDER
from ..core.trajectory import Trajectory
from ..data.tasks import overlong_penalty
from ..engine.interface import make_engine
from ..engine.sampling import SamplingParams
from ..store.shards import ShardWriter
from ..train.publish import assemble, checksum_of, publish_dtype, wire_bytes
from .clock import OpLog
from .comm import Comm, SourceFenced
from .episodes import make_episodes
from .messages import (
    AbortTraj,
    AgentCall,
    AgentEnd,
    AgentEnded,
    AgentHere,
    AgentTurn,
    DecodeProgress,
    Done,
    Flush,
    Flushed,
    Generate,
    LoadVersion,
    MigrateIn,
    MigrateOut,
    Park,
    Pause,
    Ready,
    Resume,
    RetireVersion,
    SendWeights,
    Shutdown,
    SleepEngine,
    WeightsHeader,
)
from .migration import Migrations

# speculative decoding's engine counters, logged per engine step (store/shards.py ENGINE_STEPS: column -> counter)
SPEC_COUNTS = {"decodes": "decodes", "drafted": "drafted_tokens", "accepted": "accepted_tokens"}


class RolloutRank(OpLog, Migrations):
    def __init__(self, comm: Comm, cfg, run_dir: Path, model_dir: Path, task, run_id: str, t0: float,
                 attempt: int = 0) -> None:
        self.comm, self.cfg, self.task, self.t0, self.attempt = comm, cfg, task, t0, attempt
        self.run_dir = run_dir
        self.instance = comm.roles.instance_of_rank(comm.rank)
        self.engine = make_engine(cfg, model_dir, borrowed=comm.roles.role(comm.rank) == "trainer")
        cj = cfg.model_dump_json()
        rows = cfg.store.rows_per_shard
        self.traj_log = ShardWriter(run_dir, "traj", comm.rank, "rollout", run_id, cj, rows, attempt)
        self.log = ShardWriter(run_dir, "events", comm.rank, "rollout", run_id, cj, rows, attempt)
        self.info: dict[int, dict] = {}
        self.deferred: list[tuple[object, int]] = []
        # weights that overtook their LoadVersion: received at once (header, source, state), so buffers
        # from one peer are always read in the order they were sent (NCCL's channels have no tags)
        self.early: list[tuple[WeightsHeader, int, dict]] = []
        self.checked: tuple[int, str] = (-1, "")  # the version load() last put in the engine, and its checksum
        self.running = True
        self.paused = False  # colocated placement: no engine steps while the trainer has the devices
        # requests in flight *to* this rank can be named by the orchestrator before they arrive (it moved
        # them here, then moved or aborted them again): such commands wait for the request itself
        self.gone: set[int] = set()                    # finished or aborted here: nothing will arrive
        self.forward: dict[int, MigrateOut] = {}       # migrate on at once when it arrives (never imported)
        self.abort_on_arrival: set[int] = set()
        self.parked: dict[int, tuple[dict, object]] = {}  # a borrowed instance's offloaded requests: (meta, KV)
        self.park_on_arrival: set[int] = set()  # parked while still migrating here: parked when it lands
        self.episodes = make_episodes(self, model_dir) if cfg.env.multi_turn else None
        # dora.planner: work weighs versions by decode tokens left: rank 0 hears each request's progress a tick
        self.progress_every = cfg.runtime.tick_s if cfg.dora.planner == "work" else None
        self.progress_at = 0.0

    def run(self) -> None:
        while self.running:
            while self.running and (msg := self.deferred.pop(0) if self.deferred else self.comm.poll()):
                self.handle(*msg)
            if not self.running:
                break
            if not self.work():
                time.sleep(0.001)
        self.close()

    def work(self) -> bool:
        """Between messages: apply the environment steps that finished (next turns, or ends of episodes),
        then one engine step if there is work; False if there was none. A trainer rank hosting a borrowed
        instance calls it while it waits for a Train."""
        if self.episodes:
            self.episodes.poll()
        if self.engine.has_work() and not self.paused:
            self.step()
            return True
        return False

    def close(self) -> None:
        for msg, src in self.deferred:  # set aside while loading weights; the run ended first
            self.comm.discard(msg, src)
        if self.episodes:
            self.episodes.close()
        self.engine.close()
        self.traj_log.flush()
        self.log.flush()

    # -- generation --------------------------------------------------------------------------------
    def step(self) -> None:
        t_start = self.now()
        before = self.engine.stats()
        finished = self.engine.step()
        st = self.engine.stats()
        new = (st["decode_tokens"] - before["decode_tokens"]) + (st["prefill_tokens"] - before["prefill_tokens"])
        self.log.append("steps", {"t_start": t_start, "t_end": self.now(), "batch_size": before["running"]
                                     + before["waiting"], "capacity": self.engine.max_num_seqs, "new_tokens": new,
                                     "kv_blocks_used": st["kv_blocks_used"], "version": self.engine.version,
                                     "prefill_tokens": st["prefill_tokens"] - before["prefill_tokens"],
                                     "prefix_hit_tokens": st["prefix_hit_tokens"] - before["prefix_hit_tokens"],
                                     "running": st["running"], "groups": self.live_groups(),
                                     "batch_versions": st.get("batch_versions", 1),
                                     **{c: st[k] - before[k] for c, k in SPEC_COUNTS.items()}})
        freed = st["free_cache_s"] - before["free_cache_s"]  # every backend keeps engine.COUNTERS
        if freed > 0:  # KV moved to host and back for space (the paper's free-cache overhead)
            self.op("free_cache", t_start=self.now() - freed,
                    detail=f"offloads={st['offloads'] - before['offloads']} tokens="
                           f"{st['offloaded_tokens'] - before['offloaded_tokens']}")
        for f in finished:
            if self.episodes and self.info[f.req_id].get("episode"):
                self.episodes.turn_ended(f, self.info[f.req_id])
            else:
                self.finish(f, st["kv_used_fraction"])
        if self.progress_every is not None and self.now() >= self.progress_at:
            self.progress_at = self.now() + self.progress_every
            live = [t for t in self.info if self.engine.has_request(t)]
            self.comm.send(DecodeProgress(self.instance, tuple((t, self.engine.progress(t)[1]) for t in live)), 0)

    def live_groups(self) -> int:
        """Groups with a sample on the engine (running, waiting, held or offloaded)."""
        return len({i["group_id"] for t, i in self.info.items() if "group_id" in i and self.engine.has_request(t)})

    def finish(self, f, kv_frac: float) -> None:
        """The engine's finished request becomes the trajectory record (rewarded): its HDF5 row, the
        trainer's sample and rank 0's Done all come from it."""
        info = self.info.pop(f.req_id)
        self.gone.add(f.req_id)
        if info.get("episode"):  # the environment's rewards, summed; 0 when it failed
            reward, error = (0.0 if info["env_error"] else sum(info["env_rewards"])), info["env_error"]
        else:
            reward, error = self.task.safe_reward(info["group_id"], f.response)
            shaping = self.cfg.reward
            reward += overlong_penalty(len(f.response), info["max_tokens"], shaping.overlong_buffer,
                                       shaping.overlong_penalty)
        spans = tuple(info.get("env_spans", ()))
        t = Trajectory(f.req_id, info["group_id"], f.version, f.prompt, f.response, f.logprobs, reward, self.attempt,
                       spans)
        self.traj_log.append("trajectories", {
            "traj_id": t.traj_id, "group_id": t.group_id, "sample_idx": info["sample_idx"], "version": t.version,
            "dispatch_version": info["dispatch_version"], "prompt_len": len(t.prompt), "response_len": len(t.response),
            "reward": t.reward, "finish_reason": f.finish_reason, "t_dispatch": info["t_dispatch"],
            "t_finish": self.now(), "n_migrations": info["n_migrations"], "reprefill_tokens": info["reprefill"],
            "instance_path": info["path"], "reward_error": "" if info.get("episode") else error,
            "response": t.response, "logprobs": t.logprobs, "segment_versions": info["segments"],
            "segment_turns": info["segment_turns"], "turns": info.get("turns", 1),
            "env_spans": [i for span in spans for i in span], "env_s": info.get("env_s", 0.0),
            "env_error": info.get("env_error", ""), "env_prefill_tokens": info.get("env_prefill", 0),
            "env_reruns": info.get("env_reruns", 0)})
        for trainer in self.comm.trainers_of(t.group_id):
            self.comm.send(t, trainer)
        self.comm.send(Done(t.traj_id, self.instance, len(t.response), reward, kv_frac, info["epoch"], info["kv_s"],
                            info.get("turns", 1), info.get("env_s", 0.0), self.now() - info["t_dispatch"],
                            bool(info.get("env_error")), len(t.prompt)), 0)

    # -- control -----------------------------------------------------------------------------------
    def handle(self, msg, src: int) -> None:
        match msg:
            case Generate():
                budget = msg.max_tokens
                if self.episodes:  # the first turn of an episode: within the episode's cap
                    budget = max(1, min(budget, self.cfg.env.max_episode_tokens - len(msg.prompt)))
                params = SamplingParams(temperature=self.cfg.sampling.temperature, top_p=self.cfg.sampling.top_p,
                                        max_tokens=budget, ignore_eos=self.task.ignore_eos)
                self.info[msg.traj_id] = info = {
                    "group_id": msg.group_id, "sample_idx": msg.sample_idx, "dispatch_version": msg.version,
                    "t_dispatch": self.now(), "n_migrations": 0, "kv_s": 0.0, "reprefill": 0,
                    "path": str(self.instance), "segments": [msg.version], "segment_turns": [0], "epoch": msg.epoch,
                    "max_tokens": msg.max_tokens}
                if self.episodes:
                    self.episodes.begin(msg.traj_id, msg.prompt, params, msg.version, info, msg.group_id)
                else:
                    self.engine.add(msg.traj_id, msg.prompt, params, msg.version)
            case LoadVersion():
                self.load(msg)
            case RetireVersion():
                self.engine.retire(msg.version)
            case SendWeights():
                self.send_whole(msg.dst)
            case MigrateOut():
                self.migrate_out(msg)
            case Park():  # a borrowed instance before a train step: the KV goes to host memory, kept here
                if self.holds(msg.traj_id):
                    self.park(*self.export(msg.traj_id))
                elif msg.traj_id not in self.gone:  # still on its way here (MPI orders no two senders)
                    self.park_on_arrival.add(msg.traj_id)
            case SleepEngine():  # the trainer takes the accelerators; a LoadVersion wakes it
                if self.engine.has_work():
                    raise RuntimeError(f"rank {self.comm.rank}: asked to sleep with requests running")
                self.op("sleep", nbytes=self.engine.sleep())  # the KV pool's memory goes back to the trainer
            case MigrateIn():
                self.migrate_in(msg, src)
            case AbortTraj():
                if self.holds(msg.traj_id):
                    if self.engine.has_request(msg.traj_id):
                        self.engine.abort(msg.traj_id)
                    self.take_info(msg.traj_id)
                    self.gone.add(msg.traj_id)
                elif msg.traj_id not in self.gone:  # still on its way here
                    self.abort_on_arrival.add(msg.traj_id)
            case Flush():  # a checkpoint relies on every trajectory reported so far being on disk
                self.traj_log.flush()
                self.log.flush()
                self.comm.send(Flushed(self.instance, msg.version), 0)
            case WeightsHeader():  # the source answered before the orchestrator's LoadVersion got here
                with contextlib.suppress(SourceFenced):  # else rank 0 names another source
                    self.early.append((msg, src, self.comm.recv_weights(msg, src)))
            case AgentCall() | AgentTurn() | AgentHere() | AgentEnd() | AgentEnded():
                self.episodes.on_message(msg, src)
            case Pause() | Resume():
                self.paused = isinstance(msg, Pause)
            case Shutdown():
                self.running = False
                self.comm.fenced = msg.fenced
            case _:
                raise RuntimeError(f"rollout rank {self.comm.rank}: unexpected message {msg!r}")

    def send_whole(self, dst: int) -> None:
        """A peer load: the engine's whole weights, in the publish dtype."""
        dtype = publish_dtype(self.cfg.train.publish_dtype, self.cfg.engine.dtype)
        state = {k: v.to(dtype) for k, v in self.engine.weights().items()}
        version, checksum = self.checked  # this engine's version, checked when it loaded (or took the folder's)
        if version != self.engine.version:
            raise RuntimeError(f"rank {self.comm.rank}: asked for v{self.engine.version}'s weights, checked v{version}")
        self.comm.send_weights(state, self.engine.version, checksum, dst)
        self.op("weight_send", peer=dst, version=self.engine.version)

    def take_folder(self, msg: LoadVersion, t: float) -> None:
        """Version 0 is what the engine loaded from the model folder at start: nothing is received; its checksum
        (in the trainer's layout) goes to rank 0 with Ready, which checks it against the trainer's."""
        if msg.version != 0 or self.engine.version != -1:
            raise RuntimeError(f"rank {self.comm.rank}: v{msg.version} from the model folder, which holds v0 "
                               f"only until the engine's first load")
        dtype = publish_dtype(self.cfg.train.publish_dtype, self.cfg.engine.dtype)
        got = checksum_of(self.engine.weights(), self.comm.roles.publish_shards, dtype)  # each shard cast there
        self.engine.version, self.checked = 0, (0, got)
        self.op("weight_load", peer=FOLDER, version=0, t_start=t, nbytes=0, detail=f"{got} from the model folder")
        self.comm.send(Ready(self.instance, 0, got, self.now() - t), 0)

    def load(self, msg: LoadVersion) -> None:
        """Wait for the weights of ``msg.version`` from its source (a peer's whole weights, or every trainer
        rank's shard), put them together (deltas against the version the engine holds), load them and check
        the engine now holds exactly the published version."""
        t = self.now()
        if msg.source == FOLDER:
            return self.take_folder(msg, t)
        parts: dict[int, tuple[WeightsHeader, dict]] = {}  # source rank -> its header and pieces
        while True:
            sources = self.comm.roles.weight_ranks(msg.source)
            for s in sources:  # messages from different ranks are not ordered: weights may come first
                i = next((i for i, e in enumerate(self.early) if e[1] == s), None)
                if s not in parts and i is not None:
                    header, _, pieces = self.early.pop(i)
                    parts[s] = (header, pieces)
            if all(s in parts for s in sources):
                break
            got = self.comm.poll()
            if got is None:
                time.sleep(0.0005)
            elif isinstance(got[0], WeightsHeader):  # from a source, or early from another one
                with contextlib.suppress(SourceFenced):  # the source died mid-send: LoadVersion follows
                    self.early.append((got[0], got[1], self.comm.recv_weights(*got)))
            elif isinstance(got[0], LoadVersion) and got[0].version == msg.version:
                msg = got[0]  # the source was fenced (hung): the same version comes from the trainers
            else:
                self.deferred.append(got)
        headers = [parts[s][0] for s in sources]
        if {h.version for h in headers} != {msg.version}:
            raise RuntimeError(f"rank {self.comm.rank}: v{[h.version for h in headers]} arrived for "
                               f"LoadVersion(v{msg.version})")
        if any(h.base >= 0 and (msg.add or h.base != self.engine.version) for h in headers):
            raise RuntimeError(f"rank {self.comm.rank}: a delta of v{msg.version} against v{headers[0].base} "
                               f"arrived at an engine holding v{self.engine.version}")
        dtype = getattr(torch, headers[0].dtype)
        state = assemble([(h.shard, h.shards, parts[s][1]) for s, h in zip(sources, headers, strict=True)],
                         self.engine.weights(), dtype)
        self.engine.load_weights(state, msg.version, keep_requests=msg.keep_requests, add=msg.add)
        got = checksum_of({k: v for k, v in self.engine.weights(msg.version).items() if k in state},
                          self.comm.roles.publish_shards, dtype)
        if got != headers[0].checksum:
            raise RuntimeError(f"rank {self.comm.rank}: weights of v{msg.version} arrived corrupted "
                               f"({got} != {headers[0].checksum})")
        self.checked = (msg.version, got)
        if msg.keep_requests:  # partial rollout: live requests continue under the new version, re-prefilled
            for tid, info in self.info.items():
                if info.get("unstarted"):  # an agent episode before its first call: it starts under this version
                    info["version"] = msg.version
                n_prompt, n_out = self.engine.progress(tid) if self.engine.has_request(tid) else (0, 0)
                info["segments"].append(msg.version)  # the first segment stays the group's tag
                info["segment_turns"].append(info.get("turns", 0))  # an episode's turn it switched in
                if n_out:  # tokens exist whose KV must be rebuilt under the new weights
                    info["reprefill"] += n_prompt + n_out
        pieces = [(shape, c) for h in headers if h.buckets for shape, c in zip(h.shapes, h.changed, strict=True)]
        whole = sum(wire_bytes(shape, -1, dtype.itemsize) for shape, _ in pieces)  # own shard: handed in memory
        self.op("weight_load", peer=msg.source, version=msg.version, t_start=t,
                nbytes=sum(wire_bytes(shape, c, dtype.itemsize) for shape, c in pieces),
                detail=f"{got} delta_pieces={sum(c >= 0 for _, c in pieces)}/{len(pieces)} whole_bytes={whole}")
        self.comm.send(Ready(self.instance, msg.version, got, self.now() - t), 0)

    def holds(self, traj_id: int) -> bool:
        """The request is on this rank: on the engine, or an agent episode waiting on its first call."""
        return self.engine.has_request(traj_id) or self.info.get(traj_id, {}).get("unstarted", False)

    def export(self, traj_id: int) -> tuple[dict, object]:
        """Take a request off this rank to send or park: (metadata with its info, its KV or None)."""
        if self.engine.has_request(traj_id):
            meta, kv = self.engine.export(traj_id)
        else:  # an agent episode before its first call: nothing is on the engine
            meta, kv = {"req_id": traj_id, "version": self.info[traj_id]["version"], "unstarted": True}, None
        meta["info"] = self.take_info(traj_id)
        return meta, kv

    def take_info(self, traj_id: int) -> dict:
        """A request's bookkeeping as it leaves this rank (migrated, parked or aborted); an episode's
        environment step in flight here is dropped (its destination runs it again)."""
        info = self.info.pop(traj_id)
        if self.episodes:
            self.episodes.left(info)
        return info
