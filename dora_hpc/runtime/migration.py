"""A rollout rank's requests moving between instances: KV migration (or re-prefill), and a borrowed
instance's parked requests.

Invariants:
* a request leaves with its bookkeeping (info) and its KV (carry_kv) or only its tokens; the destination
  imports it under the version it hosts, which is the request's (the policy never migrates across
  versions); the KV's bytes and the time from export to import are logged on both sides;
* a request that arrives after the orchestrator moved it on (or aborted or parked it) is relayed untouched,
  dropped or parked, never imported;
* a source that dies mid-send loses the request here (migration_lost): rank 0 starts it again.
"""

from __future__ import annotations

import os
import time

import torch

from ..engine.engine import RequestError
from .comm import TAG_KV, SourceFenced
from .messages import MigrateIn, MigrateOut

FAULT = os.environ.get("DORA_HPC_FAULT", "")  # a fault-injection point for tests (see send_migration)


class Migrations:
    """Mixed into RolloutRank: its engine, comm, info and arrival sets are the rank's."""

    def park(self, meta: dict, kv) -> None:
        self.parked[meta["req_id"]] = (meta, kv)
        self.op("offload", traj_id=meta["req_id"], version=meta["version"],
                nbytes=kv.numel() * 4 if kv is not None else 0)

    def migrate_out(self, msg: MigrateOut) -> None:
        if msg.traj_id in self.parked:  # restored from host memory: onto this instance or another
            meta, kv = self.parked.pop(msg.traj_id)
            if msg.dst == self.comm.rank:
                self.import_here(meta, kv, self.comm.rank, self.now())
            else:
                self.send_migration(msg, meta, kv, self.now())
            return
        if not self.holds(msg.traj_id):
            if msg.traj_id not in self.gone:  # not here yet: pass it on the moment it arrives
                self.forward[msg.traj_id] = msg
            return  # else it finished first; its Done is on the way
        t = self.now()
        meta, kv = self.export(msg.traj_id)
        self.send_migration(msg, meta, kv, t)

    def send_migration(self, msg: MigrateOut, meta: dict, kv, t: float) -> None:
        meta["info"]["kv_s"] += self.now() - t  # exported (or received, to relay) since t; the sends overlap
        if msg.carry_kv and kv is not None:
            self.comm.send(MigrateIn(meta, tuple(kv.shape)), msg.dst)
            if FAULT == "die_mid_migration" and self.first_fault():  # tests only: the KV announced, never sent
                print(f"dora-hpc: rank {self.comm.rank}: injected fault: dying mid-migration of {msg.traj_id}",
                      flush=True)
                time.sleep(0.2)  # the header reaches the destination, which then waits for the KV
                os._exit(9)
            self.comm.send_array(kv.numpy(), msg.dst, TAG_KV)
        else:
            self.comm.send(MigrateIn(meta, None), msg.dst)
        self.op("migration_out", traj_id=msg.traj_id, peer=msg.dst, t_start=t,
                nbytes=kv.numel() * 4 if msg.carry_kv and kv is not None else 0, version=meta["version"],
                detail="waiting_env" if meta["info"].get("pending") is not None else "")

    def first_fault(self) -> bool:
        """Tests only: whether this rank is the first of the run to reach the fault-injection point."""
        try:
            os.close(os.open(self.run_dir / "pids" / "fault", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False

    def migrate_in(self, msg: MigrateIn, src: int) -> None:
        t = self.now()
        meta, info = dict(msg.meta), msg.meta["info"]
        kv = None  # migration by re-prefill: the engine rebuilds the KV from the tokens
        rid = meta["req_id"]
        if msg.kv_shape is not None:
            try:
                kv = torch.from_numpy(self.comm.recv_array(msg.kv_shape, "float32", src, TAG_KV))
            except SourceFenced:  # its source died (or hung) mid-send: rank 0 starts the request again
                self.forward.pop(rid, None)
                self.abort_on_arrival.discard(rid)
                self.op("migration_lost", traj_id=rid, peer=src, t_start=t, version=meta["version"])
                return
        if rid in self.abort_on_arrival:
            self.abort_on_arrival.discard(rid)
            self.gone.add(rid)
            return
        if rid in self.forward:  # moved on before it got here: relay it untouched (this rank may host
            info["path"] += f">{self.instance}"  # another version by now)
            self.park_on_arrival.discard(rid)
            self.send_migration(self.forward.pop(rid), meta, kv, t)
            return
        if rid in self.park_on_arrival:  # this borrowed instance was drained while it travelled
            self.park_on_arrival.discard(rid)
            info["path"] += f">{self.instance}"
            self.park(meta, kv)
            return
        self.import_here(meta, kv, src, t)

    def import_here(self, meta: dict, kv, src: int, t: float) -> None:
        """A migrated (or parked) request continues on this instance's engine."""
        info = meta.pop("info")
        before = self.engine.stats()["reprefill_tokens"]
        try:
            if not meta.get("unstarted"):  # an agent episode before its first call has nothing on an engine
                self.engine.import_(meta, kv)
            elif meta["version"] not in self.engine.versions:
                raise RequestError(f"tagged v{meta['version']}, the engine hosts {sorted(self.engine.versions)}")
        except RequestError as e:
            raise RuntimeError(f"rank {self.comm.rank}: migration of {meta['req_id']} refused: {e}") from None
        info["reprefill"] += self.engine.stats()["reprefill_tokens"] - before  # what the engine recomputes
        info["n_migrations"] += 1
        info["path"] += f">{self.instance}"
        info["kv_s"] += self.now() - t  # received and imported
        self.info[meta["req_id"]] = info
        self.op("migration_in", traj_id=meta["req_id"], peer=src, t_start=t, version=self.engine.version,
                nbytes=kv.numel() * 4 if kv is not None else 0,
                detail=("unstarted" if meta.get("unstarted") else f"reprefill={kv is None}") + (
                    " waiting_env" if info.get("pending") is not None else ""))
        if self.episodes:
            self.episodes.arrived(meta["req_id"], info)
