"""Links: how control messages travel between two ranks -- over gloo, outside MPI. Every pair of ranks of
the job has one over a gloo group spanning the MPI world (``world_links``); a replacement (runtime/join.py)
has one to each rank over a two-rank group of its own (``Link.pair``, ``Link.connect``). A link has the
few calls of an MPI communicator that Comm makes on a route (``isend``/``send``/``Iprobe``/``recv`` for
control messages, ``Isend``/``Irecv`` for a replacement's buffers).

Why not MPI: MPICH's OFI netmod aborts a process whose message to a process that died was in flight --
any message over about a hundred bytes, posted at once or a second after the death, across nodes in one
world as between two worlds, whatever the error handler (slurm/NOTES.md). So over MPI rank 0 ordering work
from a rollout rank that had just died, or a trainer sending a replacement its weights, took the job down.
Over gloo a dead peer is an exception: ``PeerLost``, as on the torch data plane.

Invariants:
* per direction one sender thread writes the messages in the order they were queued, each a header (tag,
  kind, length) and its bytes; one receiver thread reads them and files them by tag. So per tag messages
  arrive in the order they were sent (MPI's non-overtaking rule, which Comm relies on), and a buffer
  goes to the oldest ``Irecv`` posted for its tag;
* a send completes when gloo has taken its bytes; once a transfer failed (the peer is gone) every request,
  probe and receive on the link raises ``PeerLost``, after the messages already filed are read;
* a replacement hosts its pairs' TCPStore (its address is in its offer); the pair with rank ``r`` is under
  the prefix ``str(r)``, ``r`` its rank 0 and the replacement its rank 1;
* a side's own CLOSE has left before it waits for the peer's (``close_links``), so a rank never ends with
  its CLOSE still queued while its peer waits for it;
* the threads are daemons: a rank ends without waiting for them (a hung peer's send blocks its thread),
  with ``os._exit`` after MPI_Finalize (runtime/main.py exit_now): Python's own teardown of a gloo group
  whose receive is still pending aborts the process.
"""

from __future__ import annotations

import collections
import datetime
import pickle
import queue
import sys
import threading
import time

import numpy as np

from .data_plane import WORLD_TIMEOUT, PeerLost

CONNECT_TIMEOUT_S = 60  # a replacement links to its peers one after another, each within seconds
FOREVER = datetime.timedelta(days=365)  # a wait on the link: gloo's own timeout would end a quiet one
OBJECT, BUFFER = 0, 1  # what a message's bytes are: a pickled object, or a buffer's raw bytes
CLOSE = -1  # the tag of the last message a side sends (``close``): the other's receiver thread ends on it


def store(host: str, port: int, master: bool = False, timeout_s: float = CONNECT_TIMEOUT_S):
    """The TCPStore a link rendezvouses through: hosted by the replacement (``master``, ``port`` 0: one the OS
    picks, ``store.port``), reached by its peers; raises RuntimeError when it cannot be reached within
    ``timeout_s``."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, None, master, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def close_links(links: dict[int, Link], timeout_s: float, rank: int) -> list[str]:
    """Rank ``rank``'s end of ``links`` (peer rank -> link): send every CLOSE, wait until each has left, then
    wait for each peer's, all within ``timeout_s``. Past it the rank ends anyway, naming on stderr what it
    waited for (returned too): a peer's CLOSE that never came means the peer is gone or stuck."""
    end = time.monotonic() + timeout_s
    sends = {r: link.close() for r, link in links.items()}
    waited = [f"its CLOSE to rank {r}" for r, link in links.items() if not link.sent(sends[r], end - time.monotonic())]
    waited += [f"rank {r}'s CLOSE" for r, link in links.items() if not link.closed(max(0.0, end - time.monotonic()))]
    if waited:
        print(f"dora-hpc: rank {rank} ends after {timeout_s:g} s of waiting for {', '.join(waited)}",
              file=sys.stderr, flush=True)
    return waited


class Request:
    """A send or a receive on a link: ``Test`` is True once done; ``Wait`` blocks until then."""

    def __init__(self, link: Link, buf: np.ndarray | None = None) -> None:
        self.link, self.buf = link, buf
        self.done = threading.Event()

    def Test(self) -> bool:  # noqa: N802 - the name of MPI's request call, which Comm makes on either
        if self.done.is_set():
            return True
        if self.link.error is not None:
            raise PeerLost(self.link.error)
        return False

    test = Test

    def Wait(self) -> None:  # noqa: N802
        while not self.Test():
            time.sleep(0.0005)

    def Cancel(self) -> None:  # noqa: N802 - a receive from a peer that will never send: left posted
        pass


def world_links(world, st) -> dict[int, Link]:
    """A link to every rank of the MPI world ``world`` (collective over it; a Loopback to itself): one gloo
    group, built through ``st`` (data_plane.world_store)."""
    import torch.distributed as dist

    rank, size = world.Get_rank(), world.Get_size()
    pg = dist.ProcessGroupGloo(dist.PrefixStore("control", st), rank, size, WORLD_TIMEOUT)
    links = {r: Link(pg, r) if r != rank else Loopback() for r in range(size)}
    world.Barrier()  # rank 0's store outlives every rank's start-up
    return links


class Link:
    def __init__(self, pg, peer: int) -> None:
        """The link to rank ``peer`` of the gloo group ``pg``."""
        self.pg, self.peer = pg, peer
        self.error: str | None = None  # why the link broke: the peer is gone
        self.lock = threading.Lock()
        self.filed: dict[int, collections.deque] = collections.defaultdict(collections.deque)  # tag -> arrived
        self.posted: dict[int, collections.deque] = collections.defaultdict(collections.deque)  # tag -> Irecvs
        self.outbox: queue.Queue | None = None  # its sender thread starts with the first send
        self.receiver = threading.Thread(target=self._recv_loop, name=f"link-recv-{peer}", daemon=True)
        self.receiver.start()

    @classmethod
    def pair(cls, st, prefix: str, me: int) -> Link:
        """A replacement's link to one rank of the job, over a two-rank group through the replacement's store
        ``st``: blocks until the other side builds its end (``prefix`` alike, ``me`` 0 on the job's rank and 1
        on the replacement), for at most CONNECT_TIMEOUT_S; raises RuntimeError after that."""
        import torch.distributed as dist

        pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, st), me, 2, datetime.timedelta(seconds=CONNECT_TIMEOUT_S))
        return cls(pg, 1 - me)

    @classmethod
    def connect(cls, addr: str, prefix: str, timeout_s: float = CONNECT_TIMEOUT_S) -> Link | None:
        """The job's side of a link to the replacement whose store is at ``addr`` (``host:port``), or None when
        the replacement cannot be reached within ``timeout_s`` (it died, or its offer is stale)."""
        host, port = addr.rsplit(":", 1)
        try:
            return cls.pair(store(host, int(port), timeout_s=timeout_s), prefix, 0)
        except RuntimeError:
            return None

    # -- MPI's calls, as Comm makes them on a route (source/dest: the other end, always 0) -------------
    def isend(self, obj, dest: int = 0, tag: int = 0) -> Request:
        return self._queue(tag, OBJECT, np.frombuffer(bytearray(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)), np.uint8))

    def send(self, obj, dest: int = 0, tag: int = 0) -> None:
        self.isend(obj, dest, tag).Wait()

    def Isend(self, buf: np.ndarray, dest: int = 0, tag: int = 0) -> Request:  # noqa: N802
        """``buf`` (contiguous) stays the caller's to keep alive until the request completes."""
        return self._queue(tag, BUFFER, buf.reshape(-1).view(np.uint8))

    def Iprobe(self, source: int = 0, tag: int = 0) -> bool:  # noqa: N802
        if self.filed[tag]:  # a deque's length is read atomically: no lock for the common "nothing yet"
            return True
        if self.error is not None:
            raise PeerLost(self.error)
        return False

    def recv(self, source: int = 0, tag: int = 0):
        while not self.Iprobe(source, tag):
            time.sleep(0.0005)
        with self.lock:
            return pickle.loads(self.filed[tag].popleft())

    def Irecv(self, buf: np.ndarray, source: int = 0, tag: int = 0) -> Request:  # noqa: N802
        req = Request(self, buf)
        with self.lock:
            self.posted[tag].append(req)
            self._match(tag)
        return req

    def close(self) -> Request | None:
        """The last message on this link, once both sides are done with it (Comm.close): the other side's
        receiver thread ends on it, as this side's does on the other's ``close``, so no receive is pending
        in gloo when a process exits (Python's teardown with one pending can abort the process). Returns the
        CLOSE's send (None on a broken link): the caller waits for it before its process may end, or the
        peer would wait for a CLOSE that never left."""
        if self.error is not None:
            return None
        return self._queue(CLOSE, OBJECT, np.zeros(0, np.uint8))

    def sent(self, req: Request | None, timeout_s: float) -> bool:
        """Whether the send ``req`` completed (or the link broke, or there was none) within ``timeout_s``."""
        return req is None or req.done.wait(max(0.0, timeout_s)) or self.error is not None

    def closed(self, timeout_s: float) -> bool:
        """Whether the receiver thread has ended (the other side closed, or the link broke) within ``timeout_s``."""
        self.receiver.join(timeout_s)
        return not self.receiver.is_alive()

    # -- the two threads ------------------------------------------------------------------------------
    def _queue(self, tag: int, kind: int, payload: np.ndarray) -> Request:
        if self.error is not None:
            raise PeerLost(self.error)
        req = Request(self)
        if self.outbox is None:
            self.outbox = queue.Queue()
            threading.Thread(target=self._send_loop, name=f"link-send-{self.peer}", daemon=True).start()
        self.outbox.put((tag, kind, payload, req))
        return req

    def _send_loop(self) -> None:
        import torch

        while True:
            tag, kind, payload, req = self.outbox.get()
            try:
                self.pg.send([torch.tensor([tag, kind, payload.size], dtype=torch.int64)], self.peer, 0).wait(FOREVER)
                if payload.size:
                    self.pg.send([torch.from_numpy(payload)], self.peer, 0).wait(FOREVER)
            except RuntimeError as err:  # the peer is gone: this and every later request fails
                self.error = f"link lost: {err}"
                return
            req.done.set()
            if tag == CLOSE:
                return

    def _recv_loop(self) -> None:
        import torch

        while True:
            head = torch.empty(3, dtype=torch.int64)
            try:
                self.pg.recv([head], self.peer, 0).wait(FOREVER)
                tag, kind, n = (int(x) for x in head)
                body = torch.empty(n, dtype=torch.uint8)
                if n:
                    self.pg.recv([body], self.peer, 0).wait(FOREVER)
            except RuntimeError as err:
                self.error = f"link lost: {err}"
                return
            if tag == CLOSE:
                return
            self._file(tag, kind, body.numpy())

    def _file(self, tag: int, kind: int, data: np.ndarray) -> None:
        """A message that arrived (its bytes, ``data``: this process's own) onto its tag's queue, a buffer into
        the oldest receive posted for it."""
        with self.lock:
            self.filed[tag].append(data.tobytes() if kind == OBJECT else data)
            if kind == BUFFER:
                self._match(tag)

    def _match(self, tag: int) -> None:
        """Arrived buffers into posted receives, oldest first (under the lock)."""
        while self.posted[tag] and self.filed[tag]:
            req, data = self.posted[tag].popleft(), self.filed[tag].popleft()
            req.buf.reshape(-1).view(np.uint8)[:] = data
            req.done.set()


class Loopback(Link):
    """A rank's link to itself (a trainer's borrowed instance sends its own trainer trajectories): what is
    sent is filed at once, a copy, as MPI delivers a message to its own rank."""

    def __init__(self) -> None:  # no group and no threads
        self.peer, self.error = -1, None
        self.lock = threading.Lock()
        self.filed = collections.defaultdict(collections.deque)
        self.posted = collections.defaultdict(collections.deque)

    def _queue(self, tag: int, kind: int, payload: np.ndarray) -> Request:
        self._file(tag, kind, payload.copy())
        req = Request(self)
        req.done.set()
        return req

    def close(self) -> None:
        return None

    def closed(self, timeout_s: float) -> bool:
        return True
