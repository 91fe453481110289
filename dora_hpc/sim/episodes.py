"""The simulator's multi-turn episodes: an environment step ends (an ``env`` event) and the episode's next turn
starts where the episode is -- held on an instance, moving, or parked in host memory. Part of ``Simulator``
(sim/cluster.py), which it extends."""

from __future__ import annotations

from .instance import SimError


class EpisodeSteps:
    def _ev_env(self, t: int, turn: int) -> None:
        """Trajectory ``t``'s environment step after ``turn`` ended: its next turn starts where it is."""
        rec = self.trajs[t]
        if rec.aborted:
            return
        if turn != rec.turn or rec.finished:
            raise SimError(f"environment step {turn} of trajectory {t} ended twice")
        where = self.in_transit.get(t) or self.parked.get(t)
        if where is not None:  # moving, or parked in host memory: its next turn starts where it lands
            self._next_turn(where[1])
            return
        inst = next(x for x in self.inst if t in x.held)
        self._stop(inst)
        r = inst.unhold(t)
        self._next_turn(r)
        inst.admit(r, front=True)
        self._start(inst)
        self._check_kv(inst)

    def _next_turn(self, r) -> None:
        rec = self.trajs[r.traj]
        done, nxt = self.episodes[r.traj][rec.turn], self.episodes[r.traj][rec.turn + 1]
        rec.turn += 1
        rec.env_s += done.env_s
        r.gen_at_join += done.env_tokens
        r.env_owed += done.env_tokens
        r.target = r.gen_at_join + nxt.tokens
        r.waiting_env = False
