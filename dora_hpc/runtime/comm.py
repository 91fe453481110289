"""The transport over one MPI_COMM_WORLD: roles, control messages (messages.py) and the data plane.

Invariants:
* roles come from the world rank only: 0 = orchestrator, 1..T = trainers, T+1.. = rollout ranks
  (rollout instance i is rank T+1+i; with cluster.elastic the trainers host instances too: roles.py);
* control messages are small picklable dataclasses, sent over a *link* to their destination (runtime/link.py:
  gloo, not MPI, so a rank that dies fails the sends to it and takes no sender along) with ``isend`` on
  TAG_CTRL, and read with ``recv``; MPI itself carries only the start-up, the barriers of ``close`` and the
  trainers' own communicator;
* bulk data (weights, KV) goes as flat buffers over the data plane (data_plane.py: a torch.distributed
  gloo/NCCL group beside the MPI world, or MPI ``Isend``/``Recv`` on its own tag), never pickled tensors;
  a buffer is always announced by a control message that carries its shape and dtype, and is sent
  right after it by the same sender, which keeps the buffer alive (and goes on generating or training)
  until the send completes;
* a replacement (runtime/join.py) is not in the world: it takes a fenced rank's number and every live rank
  reaches it over a link of its own (a gloo pair; its buffers go over it too), as it reaches every one of
  them; ``route`` hides which, so roles and rank numbers stay.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from .data_plane import MPIPlane, PeerLost, make_plane, world_store
from .link import Link, close_links, world_links
from .messages import Fenced, Heartbeat, Joined, Linked, MigrateIn, StopRequest, WeightsHeader
from .roles import Roles

if TYPE_CHECKING:
    import torch

    from ..train.publish import Delta

TAG_CTRL, TAG_WEIGHTS, TAG_KV, TAG_FENCE = 1, 2, 3, 4  # TAG_FENCE: Fenced/Joined notices, read even mid-send
CLOSE_TIMEOUT_S = 5.0  # after close()'s barriers every live rank closes its links at once: seconds at most



class SourceFenced(RuntimeError):
    """A buffer's sender was fenced (dead or hung) before the buffer arrived: it never will."""

    def __init__(self, rank: int) -> None:
        super().__init__(f"rank {rank} was fenced before its buffer arrived")
        self.rank = rank


class Comm:
    def __init__(self, trainers: int, data_plane: str = "torch", weight_bucket_mb: float = 256,
                 stop: threading.Event | None = None, heartbeat_s: float = 2.0, elastic: bool = False,
                 identity: tuple[int, int] | None = None, replicated: bool = False, replica_size: int = 1) -> None:
        """``identity``: a replacement's (rank, world size) in the run's world, which it is not part of."""
        self.world = MPI.COMM_WORLD
        self.stop, self._stop_told = stop, False  # a signal's flag: poll() tells rank 0 once
        self.heartbeat_s, self._last_to_0 = heartbeat_s, time.monotonic()
        self.fenced: tuple[int, ...] = ()  # set from Shutdown: close() leaves these ranks out
        self.told_fenced: set[int] = set()  # ranks rank 0's Fenced notices named (since this Comm was made)
        self.gone: set[int] = set()  # world ranks whose process a replacement took over: never in close()
        self.links: dict[int, Link] = {}  # replacements: ranks reached over a link of their own (route)
        self.broken: set[int] = set()  # ranks a send to, or a link from, failed (their process is gone)
        self.rank, size = identity if identity else (self.world.Get_rank(), self.world.Get_size())
        self.roles = Roles(size, trainers, trainers if elastic else 0, replicated, replica_size)
        # the trainers' own communicator (data parallelism bootstraps over it); None on other ranks
        is_trainer = self.roles.role(self.rank) == "trainer"
        split = self.world.Split(0 if is_trainer else MPI.UNDEFINED, self.rank)
        self.trainer_comm = split if is_trainer else None
        # the world's links and torch plane, through one store (a replacement has neither: it is in no torch
        # group; its links come when it joins, and its buffers go over them)
        store = world_store(self.world) if identity is None else None
        self.peers: dict[int, Link] = world_links(self.world, store) if identity is None else {}
        self._pending: list[tuple[object, int]] = []  # control sends (requests) and their destination
        self.plane = make_plane("mpi" if identity else data_plane, self.world, (TAG_WEIGHTS, TAG_KV), self.mpi_route,
                                store)
        self.link_plane = MPIPlane(self.world, self.mpi_route)
        self.weight_bucket_bytes = int(weight_bucket_mb * 2**20)
        self._bulk: list[tuple[object, np.ndarray, int]] = []  # bulk sends (handles), their buffers, destinations
        # sends to a fenced rank never complete: their buffers are kept alive here, and never waited for
        self._abandoned: list[tuple[object, np.ndarray | None, int]] = []

    def _unfinished(self, sends: list) -> list:
        """The sends (request or handle first, destination last) not yet complete. One whose destination's
        process is gone fails: it is dropped and its destination is ``broken``."""
        out = []
        for e in sends:
            try:
                done = e[0].test()
            except (MPI.Exception, PeerLost) as err:
                self.broke(e[-1], err)
                continue
            if not done:
                out.append(e)
        return out

    def broke(self, rank: int, err: Exception) -> None:
        """A link, a data-plane transfer or an MPI call to ``rank`` failed: its process is gone. Rank 0 acts on
        it: it fences a rollout rank or a trainer replica (Orchestrator.died reads ``broken``), and any other
        rank's death ends the job (its launcher saw it die). Fatal here only when rank 0 is the one lost: the
        job is over. (At the run's end a replacement's peers may leave before it has read its Shutdown; rank 0
        waits for it, main.replacements_left.)"""
        if rank == 0:
            raise err
        self.broken.add(rank)

    def trainers_of(self, group_id: int) -> list[int]:
        """The live trainer ranks this group's trajectories and notices go to (Roles.trainers_of_group)."""
        return [t for t in self.roles.trainers_of_group(group_id) if t not in self.fenced]

    @property
    def live_trainers(self) -> list[int]:
        return [t for t in self.roles.trainer_ranks if t not in self.fenced]

    def route(self, rank: int) -> tuple[Link, int]:
        """The link that reaches ``rank`` (a replacement's own, else the world's) and the rank at its other end
        (always 0: the MPI calls' ``dest``/``source``). PeerLost where there is none: a replacement has no link
        to a rank that was fenced before it joined."""
        link = self.links.get(rank) or self.peers.get(rank)
        if link is None:
            raise PeerLost(f"no link to rank {rank}")
        return link, 0

    def mpi_route(self, rank: int):
        """(communicator, rank in it) for the MPI data plane: a replacement's link, or the world."""
        link = self.links.get(rank)
        return (link, 0) if link is not None else (self.world, rank)

    def plane_to(self, rank: int):
        """The data plane that reaches ``rank``: its link for a replacement (runtime/link.py), else the run's."""
        return self.link_plane if rank in self.links else self.plane

    def send(self, obj, dst: int, tag: int = TAG_CTRL) -> None:
        """Non-blocking. A destination whose process is gone (the send fails) is ``broken``."""
        if dst == 0:
            self._last_to_0 = time.monotonic()
        try:
            comm, at = self.route(dst)
            self._pending.append((comm.isend(obj, dest=at, tag=tag), dst))
        except (MPI.Exception, PeerLost) as err:
            self.broke(dst, err)
        self._pending = self._unfinished(self._pending)

    def poll(self, src: int | None = None) -> tuple[object, int] | None:
        """The next control message and its sender, or None when there is none right now. Every call is
        also this rank's sign of life: a stop request it received (a signal) is passed on to rank 0 once,
        and a Heartbeat goes to rank 0 when it has sent rank 0 nothing for heartbeat_s; a Fenced notice
        from rank 0 is acted on (``abandon``)."""
        self._keep_alive()
        if src is None:
            return self.poll_any()
        try:
            comm, at = self.route(src)
            return (comm.recv(source=at, tag=TAG_CTRL), src) if comm.Iprobe(source=at, tag=TAG_CTRL) else None
        except (MPI.Exception, PeerLost) as err:
            self.broke(src, err)
            return None

    def _keep_alive(self) -> None:
        """Tell rank 0 what it must know from this rank (a stop request, a heartbeat when due) and take in
        its Fenced notices (their own tag, so this never consumes another message)."""
        self._notices()
        if self.rank != 0:
            if self.stop is not None and self.stop.is_set() and not self._stop_told:
                self._stop_told = True
                self.send(StopRequest(self.rank), 0)
            if time.monotonic() - self._last_to_0 > self.heartbeat_s:
                self.send(Heartbeat(self.rank), 0)

    def _notices(self) -> None:
        """Rank 0's notices on TAG_FENCE: a rank fenced (stop waiting for it) or replaced (link to it)."""
        if self.rank == 0:
            return
        comm, at = self.route(0)
        while comm.Iprobe(source=at, tag=TAG_FENCE):
            notice = comm.recv(source=at, tag=TAG_FENCE)
            if isinstance(notice, Joined):
                self.link(notice.rank, notice.addr)
            else:
                self.told_fenced.add(notice.rank)
                self.abandon(notice.rank)

    def link(self, rank: int, addr: str) -> None:
        """Reach fenced ``rank``'s replacement from now on, over a link through its store at ``addr``, and tell
        rank 0 (``Linked``: it tells the next peer). A replacement that died meanwhile is given up on after
        CONNECT_TIMEOUT_S (``Linked(ok=False)``: rank 0 fences it again)."""
        link = Link.connect(addr, str(self.rank))
        if link is not None:
            self.linked(rank, link)
        self.send(Linked(rank, ok=link is not None), 0)

    def linked(self, rank: int, link: Link, live: bool = True) -> None:
        """``rank`` is its replacement over ``link`` from now on; its world process is gone for good. ``live``:
        no longer fenced here (rank 0 keeps it fenced until its Hello, then calls ``unfence``)."""
        self.links[rank] = link
        self.gone.add(rank)
        self.broken.discard(rank)
        if live:
            self.unfence(rank)

    def unfence(self, rank: int) -> None:
        self.fenced = tuple(r for r in self.fenced if r != rank)

    def announce(self, rank: int, addr: str, others: list[int]) -> None:
        """Rank 0: tell ``others`` that ``rank`` is replaced and its replacement's store is at ``addr``."""
        for r in others:
            self.send(Joined(rank, addr), r, TAG_FENCE)

    def fence(self, rank: int, others: list[int]) -> None:
        """Rank 0: tell ``others`` that ``rank`` is fenced, and stop waiting for sends to it here too."""
        for r in others:
            self.send(Fenced(rank), r, TAG_FENCE)
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
        """Orderly end: after the barrier nobody sends anything new; then every rank drains what is
        addressed to it (with the buffers a message announces) until every rank's own sends completed (a
        non-blocking barrier each enters once its own have: a rank whose sends are done may still have a
        message on its way to it), so MPI_Finalize finds no message in flight. Fenced ranks are left out
        (the barriers span the others; the caller then ends the job with MPI_Abort, which also ends the
        fenced ranks). Last, the links among the ranks left are closed (Link.close), so none has a receive
        pending when its process ends. Returns the number of messages discarded (late Done/Trajectory after
        Shutdown)."""
        for r in self.links if self.rank != 0 else ():  # a replacement leaves without the barriers
            self.abandon(r)
        self.group = self.world if not self.left_out else self.world.Create_group(
            self.world.Get_group().Excl(list(self.left_out)))
        self.group.Barrier()  # nobody sends anything new from here
        dropped, everyone = 0, None
        while everyone is None or not everyone.Test():  # a message may still be on its way when this rank's
            dropped += self._drain(0.0, notices=True)  # sends are done: drain until every rank's are
            if everyone is None and not (self._pending or self._bulk):
                everyone = self.group.Ibarrier()
            time.sleep(0.001)
        ours = {r: link for r, link in self.peers.items() if r not in self.left_out}
        close_links(ours, CLOSE_TIMEOUT_S, self.rank)
        return dropped

    def _drain(self, timeout_s: float, notices: bool) -> int:
        """Read and drop what comes (with the buffers it announces) until this rank's own sends completed,
        for at most ``timeout_s``; ``notices``: act on rank 0's notices meanwhile. The messages dropped."""
        end, dropped = time.monotonic() + timeout_s, 0
        while True:
            while got := self.poll_any():
                self.discard(*got)
                dropped += 1
            if notices:
                self._notices()
            self._pending = self._unfinished(self._pending)
            self._bulk = self._unfinished(self._bulk)
            if not (self._pending or self._bulk) or time.monotonic() >= end:
                return dropped
            time.sleep(0.001)

    @property
    def left_out(self) -> list[int]:
        """World ranks close() and the job's end leave out: fenced ones, and those a replacement took over."""
        return sorted({*self.fenced, *self.gone})

    def poll_any(self) -> tuple[object, int] | None:
        """The next control message from anyone, without this rank's keep-alive. A link that broke (its peer
        is gone) marks the peer ``broken``."""
        for r, link in {**self.peers, **self.links}.items():  # a replacement's link stands for the rank it took
            try:
                if link.Iprobe(source=0, tag=TAG_CTRL):  # what a dead peer sent before it died is still read
                    return link.recv(source=0, tag=TAG_CTRL), r
            except PeerLost as err:
                if r not in self.broken:
                    self.broke(r, err)
        return None

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
        try:
            self._bulk.append((self.plane_to(dst).isend(buf, dst, tag), buf, dst))
        except (MPI.Exception, PeerLost) as err:
            self.broke(dst, err)
        self._bulk = self._unfinished(self._bulk)

    def finish_sends(self, timeout_s: float) -> None:
        """A replacement at the run's end: complete its own sends (its peers are draining, close()), reading
        and dropping what still comes, for at most ``timeout_s``."""
        self._drain(timeout_s, notices=False)

    def wait_bulk(self) -> None:
        """Complete every bulk send of this rank (its receivers are waiting for them): a rank about to
        compute for a while without MPI calls -- the trainer before a train step -- calls this first,
        since a pending large send only progresses inside MPI calls of the sender. It keeps sending
        heartbeats, and gives up on sends to a rank that is fenced meanwhile."""
        while self._bulk:
            self._keep_alive()
            self._bulk = self._unfinished(self._bulk)
            if self._bulk:
                time.sleep(0.0005)

    def recv_array(self, shape: tuple[int, ...], dtype, src: int, tag: int) -> np.ndarray:
        """A buffer ``src`` announced. The wait polls: it keeps sending heartbeats, and raises SourceFenced
        when rank 0 gives up on ``src`` meanwhile (it died or hung mid-send; a transfer that failed because
        ``src`` died waits for that too)."""
        handle = self.plane_to(src).irecv(shape, dtype, src, tag)
        while True:
            try:
                if handle.test():
                    return handle.result()
            except PeerLost:
                pass  # src died: rank 0 fences it
            self._keep_alive()
            if src in self.fenced:
                handle.cancel()
                self._abandoned.append((handle, None, src))
                raise SourceFenced(src)
            time.sleep(0.0002)

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
