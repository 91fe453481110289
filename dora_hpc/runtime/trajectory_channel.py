"""Trajectories to fault-tolerant trainer replicas (``train.replicas``) over gloo, outside MPI.

Why: MPICH's OFI netmod aborts a process whose message to a process that died was still in flight
(slurm/NOTES.md), and every rollout rank streams every trajectory to every replica, so over MPI a
replica's death took rollout ranks on other nodes with it. Gloo turns a dead peer into an exception.

Invariants:
* the channel is one gloo group over every rank but rank 0 (group rank = world rank - 1; rank 0's few
  trajectories, re-queued at a resume, go over MPI before any step), built at start-up;
* per (sender, trainer) pair a trajectory is a header (its pickled length) then its bytes, sent by one
  thread per destination in the order ``send`` was called, and received by one thread per sender on the
  trainer, which queues it whole for ``poll``; so per pair trajectories arrive in order, like MPI's;
* a send that fails (the trainer died) marks the trainer ``dead`` here: nothing more is sent to it, and
  rank 0 fences it; a receive that fails (the sender died) ends that sender's thread;
* every thread is a daemon: a rank ends without waiting for them (runtime/main.py exit_now).
"""

from __future__ import annotations

import datetime
import pickle
import queue
import threading

import numpy as np


class TrajectoryChannel:
    def __init__(self, world, trainers: list[int], senders: list[int], timeout_s: float = 600.0) -> None:
        """Every rank but rank 0 calls it (collective over them); ``trainers`` receive from ``senders``."""
        import torch.distributed as dist

        from ..train.dp import rendezvous

        self.rank = world.Get_rank()
        sub = world.Split(0, self.rank)  # every rank but 0 (which calls world.Split with MPI.UNDEFINED)
        host, port = rendezvous(sub)
        size = sub.Get_size()
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, size, sub.Get_rank() == 0, timeout=timeout)
        self.pg = dist.ProcessGroupGloo(store, sub.Get_rank(), size, timeout)
        sub.Free()
        self.inbox: queue.Queue = queue.Queue()
        self.outboxes: dict[int, queue.Queue] = {}
        self.dead: set[int] = set()
        if self.rank in trainers:
            for s in senders:
                threading.Thread(target=self._receive, args=(s,), name=f"traj-from-{s}", daemon=True).start()

    @staticmethod
    def split_out(world) -> None:
        """Rank 0's part of the channel's start-up: it stays out of the group."""
        from mpi4py import MPI

        world.Split(MPI.UNDEFINED, world.Get_rank())

    def send(self, obj, dst: int) -> bool:
        """Queue ``obj`` for trainer ``dst``; False when ``dst`` is known dead (nothing is sent)."""
        if dst in self.dead:
            return False
        box = self.outboxes.get(dst)
        if box is None:
            box = self.outboxes[dst] = queue.Queue()
            threading.Thread(target=self._send, args=(dst, box), name=f"traj-to-{dst}", daemon=True).start()
        box.put(obj)
        return True

    def poll(self) -> tuple[object, int] | None:
        """The next trajectory that arrived whole, and its sender, or None."""
        try:
            return self.inbox.get_nowait()
        except queue.Empty:
            return None

    def _send(self, dst: int, box: queue.Queue) -> None:
        import torch

        while True:
            payload = np.frombuffer(pickle.dumps(box.get(), protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
            try:
                self.pg.send([torch.tensor([len(payload)], dtype=torch.int64)], dst - 1, 0).wait()
                self.pg.send([torch.from_numpy(payload.copy())], dst - 1, 0).wait()
            except RuntimeError:  # the trainer is gone: rank 0 fences it
                self.dead.add(dst)
                return

    def _receive(self, src: int) -> None:
        import torch

        while True:
            try:
                n = torch.empty(1, dtype=torch.int64)
                self.pg.recv([n], src - 1, 0).wait()
                buf = torch.empty(int(n[0]), dtype=torch.uint8)
                self.pg.recv([buf], src - 1, 0).wait()
            except RuntimeError:  # the sender is gone
                return
            self.inbox.put((pickle.loads(buf.numpy().tobytes()), src))
