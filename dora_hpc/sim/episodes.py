"""The simulator's multi-turn episodes: an environment step ends (an ``env`` event) and the episode's next turn
starts where the episode is -- held on an instance, moving, or parked in host memory; the step after the last
turn (the environment says done, as in the runtime) ends the episode there. Part of ``Simulator``
(sim/cluster.py), which it extends."""

from __future__ import annotations

import heapq

from ..core.events import RequestFinished
from .instance import SimError


class EpisodeSteps:
    def _env_done_at(self, inst, secs: float) -> float:
        """When an environment step that ``inst`` starts now ends: at once on a free worker, else after the
        earliest busy one (``workload.env_workers``; unset: never waits). The step runs where it started,
        so a migration does not move it (the runtime runs it again at the destination: ``env_reruns``)."""
        workers = self.cfg.workload.env_workers
        if workers is None:
            return self.now + secs
        while inst.env_free and inst.env_free[0] <= self.now:
            heapq.heappop(inst.env_free)
        start = heapq.heappop(inst.env_free) if len(inst.env_free) >= workers else self.now
        heapq.heappush(inst.env_free, start + secs)
        return start + secs

    def _ev_env(self, t: int, turn: int) -> None:
        """Trajectory ``t``'s environment step after ``turn`` ended: its next turn starts where it is, or, after
        its last turn (the environment said done), it ends there."""
        rec = self.trajs[t]
        if rec.aborted:
            return
        if turn != rec.turn or rec.finished or rec.said_done:
            raise SimError(f"environment step {turn} of trajectory {t} ended twice")
        last = turn == len(self.episodes[t]) - 1
        rec.env_s += self.episodes[t][turn].env_s
        where = self.in_transit.get(t) or self.parked.get(t)
        if where is not None:  # moving, or parked in host memory: it goes on (or ends) where it lands
            self._said_done(where[1]) if last else self._next_turn(where[1])
            return
        inst = next(x for x in self.inst if t in x.held)
        self._stop(inst)
        r = inst.unhold(t)
        if last:
            rec.finished = True
            self._start(inst)
            self._feed(RequestFinished(t, inst.idx, tokens=self._model_tokens(t)))
            return
        self._next_turn(r)
        inst.admit(r, front=True)
        self._start(inst)
        self._check_kv(inst)

    def _said_done(self, r) -> None:
        """The last environment step of an episode that is moving or parked ended: it has no tokens left, so it
        finishes as soon as it is back in a batch."""
        rec = self.trajs[r.traj]
        rec.said_done = True
        r.target = r.gen_at_join
        r.waiting_env = False

    def _next_turn(self, r) -> None:
        rec = self.trajs[r.traj]
        done, nxt = self.episodes[r.traj][rec.turn], self.episodes[r.traj][rec.turn + 1]
        rec.turn += 1
        r.gen_at_join += done.env_tokens
        r.env_owed += done.env_tokens
        r.target = r.gen_at_join + nxt.tokens
        r.waiting_env = False
