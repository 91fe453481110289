"""The transport over one MPI_COMM_WORLD: roles, control messages (messages.py) and the data plane.

Invariants:
* roles come from the world rank only: 0 = orchestrator, 1..T = trainers, T+1.. = rollout ranks
  (rollout instance i is rank T+1+i; with cluster.elastic the trainers host instances too: roles.py);
* control messages are small picklable dataclasses sent with ``isend``/``recv`` on TAG_CTRL;
* bulk data (weights, KV) goes as flat buffers over the data plane (data_plane.py: MPI ``Isend``/``Recv``
  on its own tag, or a torch.distributed gloo/NCCL group beside the MPI world), never pickled tensors;
  a buffer is always announced by a control message that carries its shape and dtype, and is sent
  right after it by the same sender, which keeps the buffer alive (and goes on generating or training)
  until the send completes.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from .data_plane import make_plane
from .messages import Fenced, Heartbeat, MigrateIn, StopRequest, WeightsHeader
from .roles import Roles

if TYPE_CHECKING:
    import torch

    from ..train.publish import Delta

TAG_CTRL, TAG_WEIGHTS, TAG_KV, TAG_FENCE = 1, 2, 3, 4  # TAG_FENCE: Fenced notices, read even mid-send


# ---------------------------------------------------------------- transport
class SourceFenced(RuntimeError):
    """A buffer's sender was fenced (dead or hung) before the buffer arrived: it never will."""

    def __init__(self, rank: int) -> None:
        super().__init__(f"rank {rank} was fenced before its buffer arrived")
        self.rank = rank


class Comm:
    def __init__(self, trainers: int, data_plane: str = "mpi", weight_bucket_mb: float = 256,
                 stop: threading.Event | None = None, heartbeat_s: float = 2.0, elastic: bool = False) -> None:
        self.world = MPI.COMM_WORLD
        self.stop, self._stop_told = stop, False  # a signal's flag: poll() tells rank 0 once
        self.heartbeat_s, self._last_to_0 = heartbeat_s, time.monotonic()
        self.fenced: tuple[int, ...] = ()  # set from Shutdown: close() leaves these ranks out
        self.rank = self.world.Get_rank()
        self.roles = Roles(self.world.Get_size(), trainers, trainers if elastic else 0)
        # the trainers' own communicator (data parallelism bootstraps over it); None on other ranks
        is_trainer = self.roles.role(self.rank) == "trainer"
        split = self.world.Split(0 if is_trainer else MPI.UNDEFINED, self.rank)
        self.trainer_comm = split if is_trainer else None
        self._pending: list[tuple[MPI.Request, int]] = []  # control isends and their destination
        self.plane = make_plane(data_plane, self.world, (TAG_WEIGHTS, TAG_KV))
        self.weight_bucket_bytes = int(weight_bucket_mb * 2**20)
        self._bulk: list[tuple[object, np.ndarray, int]] = []  # bulk sends (handles), their buffers, destinations
        # sends to a fenced rank never complete: their buffers are kept alive here, and never waited for
        self._abandoned: list[tuple[object, np.ndarray | None, int]] = []

    def send(self, obj, dst: int) -> None:
        if dst == 0:
            self._last_to_0 = time.monotonic()
        self._pending.append((self.world.isend(obj, dest=dst, tag=TAG_CTRL), dst))
        self._pending = [(r, d) for r, d in self._pending if not r.Test()]

    def poll(self, src: int | None = None) -> tuple[object, int] | None:
        """The next control message and its sender, or None when there is none right now. Every call is
        also this rank's sign of life: a stop request it received (a signal) is passed on to rank 0 once,
        and a Heartbeat goes to rank 0 when it has sent rank 0 nothing for heartbeat_s; a Fenced notice
        from rank 0 is acted on (``abandon``)."""
        self._keep_alive()
        status = MPI.Status()
        if not self.world.Iprobe(source=MPI.ANY_SOURCE if src is None else src, tag=TAG_CTRL, status=status):
            return None
        src = status.Get_source()
        return self.world.recv(source=src, tag=TAG_CTRL), src

    def _keep_alive(self) -> None:
        """Tell rank 0 what it must know from this rank (a stop request, a heartbeat when due) and take in
        its Fenced notices (their own tag, so this never consumes another message)."""
        while self.world.Iprobe(source=0, tag=TAG_FENCE):
            self.abandon(self.world.recv(source=0, tag=TAG_FENCE).rank)
        if self.rank != 0:
            if self.stop is not None and self.stop.is_set() and not self._stop_told:
                self._stop_told = True
                self.send(StopRequest(self.rank), 0)
            if time.monotonic() - self._last_to_0 > self.heartbeat_s:
                self.send(Heartbeat(self.rank), 0)

    def fence(self, rank: int, others: list[int]) -> None:
        """Rank 0: tell ``others`` that ``rank`` is fenced, and stop waiting for sends to it here too."""
        for r in others:
            self._pending.append((self.world.isend(Fenced(rank), dest=r, tag=TAG_FENCE), r))
        self.abandon(rank)

    def abandon(self, rank: int) -> None:
        """Rank 0 gave up on ``rank`` (hung): sends to it may never complete, so they are no longer waited
        for (their buffers stay alive: the rank might still read them) and close() leaves it out."""
        self.fenced = tuple(sorted({*self.fenced, rank}))
        self._abandoned += [(r, None, d) for r, d in self._pending if d == rank]
        self._abandoned += [e for e in self._bulk if e[2] == rank]
        self._pending = [(r, d) for r, d in self._pending if d != rank]
        self._bulk = [e for e in self._bulk if e[2] != rank]

    def close(self) -> int:
        """Orderly end: after the first barrier nobody sends anything new; then every rank drains what
        is addressed to it (with the buffers a message announces) until its own sends completed, so
        MPI_Finalize finds no message in flight. Fenced ranks are left out (the barriers span the others;
        the caller then ends the job with MPI_Abort, which also ends the fenced ranks).
        Returns the number of messages discarded (late Done/Trajectory after Shutdown)."""
        self.group = self.world if not self.fenced else self.world.Create_group(
            self.world.Get_group().Excl(list(self.fenced)))
        self.group.Barrier()
        dropped = 0
        while True:
            status = MPI.Status()
            while self.world.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_CTRL, status=status):
                src = status.Get_source()
                self.discard(self.world.recv(source=src, tag=TAG_CTRL), src)
                dropped += 1
            while self.world.Iprobe(source=0, tag=TAG_FENCE):
                self.abandon(self.world.recv(source=0, tag=TAG_FENCE).rank)
            self._pending = [(r, d) for r, d in self._pending if not r.Test()]
            self._bulk = [(h, b, d) for h, b, d in self._bulk if not h.test()]
            if not self._pending and not self._bulk:
                break
            time.sleep(0.001)
        self.group.Barrier()
        return dropped

    def discard(self, msg: object, src: int) -> None:
        """Drop a control message nobody will act on, receiving the buffers it announces: their sender
        waits for its sends to complete before it may finish (a weight or KV send to a rank that has
        already stopped would otherwise never complete)."""
        with contextlib.suppress(SourceFenced):  # a fenced sender's buffers never come
            if isinstance(msg, WeightsHeader):
                self.recv_weights(msg, src)
            elif isinstance(msg, MigrateIn) and msg.kv_shape is not None:
                self.recv_array(msg.kv_shape, np.float32, src, TAG_KV)

    def send_array(self, arr: np.ndarray, dst: int, tag: int) -> None:
        """Non-blocking: the receiver may be mid-step; the sender does not wait for it to post its Recv."""
        buf = np.ascontiguousarray(arr)
        self._bulk.append((self.plane.isend(buf, dst, tag), buf, dst))
        self._bulk = [(h, b, d) for h, b, d in self._bulk if not h.test()]

    def wait_bulk(self) -> None:
        """Complete every bulk send of this rank (its receivers are waiting for them): a rank about to
        compute for a while without MPI calls -- the trainer before a train step -- calls this first,
        since a pending large send only progresses inside MPI calls of the sender. It keeps sending
        heartbeats, and gives up on sends to a rank that is fenced meanwhile."""
        while self._bulk:
            self._keep_alive()
            self._bulk = [(h, b, d) for h, b, d in self._bulk if not h.test()]
            if self._bulk:
                time.sleep(0.0005)

    def recv_array(self, shape: tuple[int, ...], dtype, src: int, tag: int) -> np.ndarray:
        """A buffer ``src`` announced. The wait polls: it keeps sending heartbeats, and raises SourceFenced
        when rank 0 gives up on ``src`` meanwhile (it died or hung mid-send)."""
        handle = self.plane.irecv(shape, dtype, src, tag)
        while not handle.test():
            self._keep_alive()
            if src in self.fenced:
                handle.cancel()
                self._abandoned.append((handle, None, src))
                raise SourceFenced(src)
            time.sleep(0.0002)
        return handle.result()

    # -- weights: byte buckets announced by a WeightsHeader -------------------------------------------
    def send_weights(self, pieces: dict[str, torch.Tensor | Delta], version: int, checksum: str, dst: int, *,
                     shard: int = 0, shards: int = 1, base: int = -1) -> None:
        """A version's pieces (whole, or deltas against ``base``) in the publish dtype.
        Bucketed: no message exceeds ``weight_bucket_bytes`` unless one piece does (MPI counts are 32-bit:
        one flat buffer of a 7B model would not even be sendable), and the receiver unpacks bucket by
        bucket."""
        import torch

        from ..train.dp import buckets
        from ..train.publish import Delta, wire, wire_bytes

        names = sorted(pieces)
        dtype = next(((p.values if isinstance(p, Delta) else p).dtype for p in pieces.values()), torch.float32)
        changed = [pieces[n].values.numel() if isinstance(pieces[n], Delta) else -1 for n in names]
        shapes = [tuple(pieces[n].shape) for n in names]
        size = {n: wire_bytes(s, c, dtype.itemsize) for n, s, c in zip(names, shapes, changed, strict=True)}
        groups = buckets(names, size.__getitem__, self.weight_bucket_bytes) if names else []
        self.send(WeightsHeader(version, names, shapes, checksum, [len(b) for b in groups],
                                str(dtype).removeprefix("torch."), shard, shards, base, changed), dst)
        for bucket in groups:
            self.send_array(np.concatenate([wire(pieces[n]) for n in bucket]), dst, TAG_WEIGHTS)

    def recv_weights(self, header: WeightsHeader, src: int) -> dict[str, torch.Tensor | Delta]:
        import torch

        from ..train.publish import unwire, wire_bytes

        dtype = getattr(torch, header.dtype)
        out: dict[str, torch.Tensor | Delta] = {}
        first = 0
        for count in header.buckets:
            at = slice(first, first + count)
            names, shapes, counts = header.names[at], header.shapes[at], header.changed[at]
            sizes = [wire_bytes(s, c, dtype.itemsize) for s, c in zip(shapes, counts, strict=True)]
            flat = torch.from_numpy(self.recv_array((sum(sizes),), np.uint8, src, TAG_WEIGHTS))
            for name, shape, c, part in zip(names, shapes, counts, flat.split(sizes), strict=True):
                out[name] = unwire(shape, c, part, dtype)
            first += count
        return out

    def wait_for(self, kind: type, src: int | None = None, on_other=None):
        """Wait until a control message of ``kind`` (from ``src``) arrives; others go to on_other. Polls,
        so the wait keeps sending heartbeats."""
        while True:
            got = self.poll(src)
            if got is None:
                time.sleep(0.0005)
                continue
            msg, s = got
            if isinstance(msg, kind):
                return msg, s
            if on_other is None:
                raise RuntimeError(f"rank {self.rank}: expected {kind.__name__} from {src}, got {msg!r}")
            on_other(msg, s)
