"""What every rank's logs share: one time axis and the op row.

Invariant: every time a rank logs is seconds since the launch's ``t0`` (rank 0's clock, broadcast at
start), so rows of different ranks and shards compare directly.
"""

from __future__ import annotations

import time


class RankClock:
    """A rank with the launch's time axis (``self.t0``)."""

    t0: float

    def now(self) -> float:
        return time.time() - self.t0


class OpLog(RankClock):
    """A rank that records ops (store/shards.py: OPS) into its events shard writer, ``self.log``."""

    def op(self, kind: str, traj_id: int = -1, peer: int = -1, version: int = -1, detail: str = "",
           t_start: float | None = None, nbytes: int = 0) -> None:
        now = self.now()
        self.log.append("ops", {"t_start": now if t_start is None else t_start, "t_end": now, "kind": kind,
                                "traj_id": traj_id, "peer": peer, "bytes": nbytes, "version": version,
                                "detail": detail})
