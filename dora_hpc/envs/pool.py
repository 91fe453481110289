"""The environment worker pool of one rollout rank: ``env.workers`` processes that run environment steps, so
the rank's engine goes on decoding while tools run.

Invariants:
* a step is (environment, action) in and (environment after the step, its output) out: workers keep no
  episode state, so any worker can take any step and a dead worker loses nothing but the step it ran;
* every submitted job gets exactly one result (``poll``) unless it is cancelled: its output, or an error
  when the environment raised, ran past ``timeout_s`` of unpaused time (the worker is killed; ``pause`` stops
  a job's clock while it waits on the rank, ``resume`` restarts it) or its worker died; a killed
  or dead worker is replaced before the pool takes the next step;
* workers are plain child processes (``python -m dora_hpc.envs.worker``), not MPI processes: the MPI
  launcher's variables are removed from their environment.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

MPI_VARS = ("PMI_", "PMIX_", "HYDRA_", "MPIR_", "MPICH_", "OMPI_", "I_MPI_")


@dataclass(frozen=True)
class StepResult:
    job: int
    env: Any            # the environment after the step (None on an error)
    output: dict | None  # the step's StepOutput (None on an error)
    error: str           # "" when the step ran
    seconds: float       # wall time of the step in its worker


class _Worker:
    def __init__(self, boot: bytes) -> None:
        ours, theirs = socket.socketpair()
        env = {k: v for k, v in os.environ.items() if not k.startswith(MPI_VARS)} | {"OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "dora_hpc.envs.worker", str(theirs.fileno())],
                                     pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send_bytes(boot)
        self.ready = False
        self.job: tuple[int, float] | None = None  # (job, when it was sent)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the worker and whatever its tool started
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.conn.close()


class EnvPool:
    def __init__(self, workers: int, timeout_s: float, boot: dict) -> None:
        """``boot``: what a worker needs to score as the rank does (dora_hpc.envs.worker.boot's arguments)."""
        self.timeout_s, self._boot = timeout_s, pickle.dumps(boot)
        self.workers = [_Worker(self._boot) for _ in range(workers)]
        self.queue: deque[tuple[int, bytes]] = deque()
        self.cancelled: set[int] = set()
        self.paused: set[int] = set()  # jobs whose clock is stopped (pause/resume)
        self.replaced = 0
        self.warnings: list[str] = []
        self._next = 0

    def submit(self, env: Any, action: str) -> int:
        """Queue a step; returns its job id."""
        self._next += 1
        self.queue.append((self._next, pickle.dumps((env, action))))
        return self._next

    def cancel(self, job: int) -> None:
        """Its result, whenever it comes, is dropped (the episode moved on or ended)."""
        self.cancelled.add(job)

    def pause(self, job: int) -> None:
        """Stop ``job``'s clock (an agent's run waits on a call the rank serves): no timeout while paused."""
        self.paused.add(job)

    def resume(self, job: int) -> None:
        """Restart ``job``'s clock from now: ``timeout_s`` bounds its time since it was last resumed."""
        self.paused.discard(job)
        for w in self.workers:
            if w.job is not None and w.job[0] == job:
                w.job = (job, time.monotonic())

    def poll(self, timeout: float = 0.0, budget_s: float = 0.005) -> list[StepResult]:
        """Results that came in (waiting up to ``timeout`` s for the first), after starting queued steps on free
        workers. While steps finish and more are queued it keeps feeding the workers, for up to ``budget_s``:
        fast steps (a scorer) then take one call, not one call each."""
        out = self._poll(timeout)
        end = time.monotonic() + budget_s
        while out and self.queue and (left := end - time.monotonic()) > 0:
            more = self._poll(left)
            if not more:
                break
            out += more
        return out

    def _poll(self, timeout: float) -> list[StepResult]:
        self._dispatch()
        out: list[StepResult] = []
        ready = wait([w.conn for w in self.workers], timeout) if self.workers else []
        for i, w in enumerate(self.workers):
            if w.conn in ready:
                try:
                    msg = w.conn.recv_bytes()
                except (EOFError, OSError):
                    if not w.ready:  # it could not even start: every replacement would die the same way
                        raise RuntimeError(f"environment worker failed to start (exit code {w.proc.wait()}); "
                                           "its error is above") from None
                    try:
                        code = w.proc.wait(timeout=5)  # its socket closed: it is exiting
                    except subprocess.TimeoutExpired:
                        code = None
                    out.append(self._replace(i, f"environment worker died (exit code {code})"))
                    continue
                if not w.ready:  # its boot message: "" or a warning
                    w.ready = True
                    warning = pickle.loads(msg)
                    if warning and warning not in self.warnings:
                        self.warnings.append(warning)
                        print(f"dora-hpc: environment workers: {warning}", file=sys.stderr, flush=True)
                    continue
                job, _ = w.job or (-1, 0.0)
                w.job = None
                status, env, output, error, secs = pickle.loads(msg)
                out.append(StepResult(job, env, output, error, secs))
            elif w.job is not None and w.job[0] not in self.paused and time.monotonic() - w.job[1] > self.timeout_s:
                out.append(self._replace(i, f"environment step timed out after {self.timeout_s:g}s"))
        self._dispatch()
        self.paused.difference_update(r.job for r in out)
        kept = [r for r in out if r.job not in self.cancelled]
        self.cancelled.difference_update(r.job for r in out)
        return kept

    def _replace(self, i: int, error: str) -> StepResult:
        w = self.workers[i]
        job, sent = w.job or (-1, time.monotonic())
        w.kill()
        self.workers[i] = _Worker(self._boot)
        self.replaced += 1
        return StepResult(job, None, None, error, time.monotonic() - sent)

    def _dispatch(self) -> None:
        for w in self.workers:
            if not self.queue:
                return
            if w.ready and w.job is None:
                job, payload = self.queue.popleft()
                if job in self.cancelled:
                    self.cancelled.discard(job)
                    continue
                w.conn.send_bytes(payload)
                w.job = (job, time.monotonic())

    def close(self) -> None:
        for w in self.workers:
            w.kill()
        self.workers = []
