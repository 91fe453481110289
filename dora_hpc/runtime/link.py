"""A link: what joins a replacement (runtime/join.py) to one rank of the job it takes a place in -- a
two-rank gloo group outside MPI, with the few calls of an MPI communicator that Comm makes on a route
(``isend``/``send``/``Iprobe``/``recv`` for control messages, ``Isend``/``Irecv`` for buffers).

Why not MPI: the replacement is a process of another MPI world, and MPI's dynamic processes connect two
worlds only over MPICH's OFI netmod, which aborts a process whose message to a process that died was in
flight -- any message over about a hundred bytes, whatever the error handler (slurm/NOTES.md). A replacement
killed while a peer sent it weights, or rank 0 a command, took that peer, or rank 0 and the job, along.
Over gloo a dead peer is an exception: ``PeerLost``, as on the torch data plane.

Invariants:
* the replacement hosts the pair's TCPStore (its address is in its offer); the pair with rank ``r`` is
  under the prefix ``str(r)``, ``r`` its rank 0 and the replacement its rank 1;
* per direction one sender thread writes the messages in the order they were queued, each a header (tag,
  kind, length) and its bytes; one receiver thread reads them and files them by tag. So per tag messages
  arrive in the order they were sent (MPI's non-overtaking rule, which Comm relies on), and a buffer
  goes to the oldest ``Irecv`` posted for its tag;
* a send completes when gloo has taken its bytes; once a transfer failed (the peer is gone) every request,
  probe and receive on the link raises ``PeerLost``, after the messages already filed are read;
* both threads are daemons: a rank ends without waiting for them (a hung peer's send blocks its thread).
"""

from __future__ import annotations

import collections
import datetime
import pickle
import queue
import threading
import time

import numpy as np

from .data_plane import PeerLost

CONNECT_TIMEOUT_S = 60  # a replacement links to its peers one after another, each within seconds
FOREVER = datetime.timedelta(days=365)  # a wait on the link: gloo's own timeout would end a quiet one
OBJECT, BUFFER = 0, 1  # what a message's bytes are: a pickled object, or a buffer's raw bytes


def store(host: str, port: int, master: bool = False, timeout_s: float = CONNECT_TIMEOUT_S):
    """The TCPStore a link rendezvouses through: hosted by the replacement (``master``, ``port`` 0: one the OS
    picks, ``store.port``), reached by its peers; raises RuntimeError when it cannot be reached within
    ``timeout_s``."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, None, master, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


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


class Link:
    def __init__(self, st, prefix: str, me: int) -> None:
        """Blocks until the other side builds its end (``prefix`` alike, ``me`` 0 on the job's rank and 1 on
        the replacement), for at most CONNECT_TIMEOUT_S; raises RuntimeError after that."""
        import torch.distributed as dist

        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, st), me, 2,
                                        datetime.timedelta(seconds=CONNECT_TIMEOUT_S))
        self.peer = 1 - me
        self.error: str | None = None  # why the link broke: the peer is gone
        self.lock = threading.Lock()
        self.filed: dict[int, collections.deque] = collections.defaultdict(collections.deque)  # tag -> arrived
        self.posted: dict[int, collections.deque] = collections.defaultdict(collections.deque)  # tag -> Irecvs
        self.outbox: queue.Queue = queue.Queue()
        threading.Thread(target=self._send_loop, name="link-send", daemon=True).start()
        threading.Thread(target=self._recv_loop, name="link-recv", daemon=True).start()

    @classmethod
    def connect(cls, addr: str, prefix: str, timeout_s: float = CONNECT_TIMEOUT_S) -> Link | None:
        """The job's side of a link to the replacement whose store is at ``addr`` (``host:port``), or None when
        the replacement cannot be reached within ``timeout_s`` (it died, or its offer is stale)."""
        host, port = addr.rsplit(":", 1)
        try:
            return cls(store(host, int(port), timeout_s=timeout_s), prefix, 0)
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
        with self.lock:
            if self.filed[tag]:
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

    def Disconnect(self) -> None:  # noqa: N802 - nothing to release: the threads end with the process
        pass

    # -- the two threads ------------------------------------------------------------------------------
    def _queue(self, tag: int, kind: int, payload: np.ndarray) -> Request:
        if self.error is not None:
            raise PeerLost(self.error)
        req = Request(self)
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
            with self.lock:
                self.filed[tag].append(body.numpy().tobytes() if kind == OBJECT else body.numpy())
                if kind == BUFFER:
                    self._match(tag)

    def _match(self, tag: int) -> None:
        """Arrived buffers into posted receives, oldest first (under the lock)."""
        while self.posted[tag] and self.filed[tag]:
            req, data = self.posted[tag].popleft(), self.filed[tag].popleft()
            req.buf.reshape(-1).view(np.uint8)[:] = data
            req.done.set()
