"""Migrations as the logs record them: a request's move counts when it arrives (a ``migration_in`` op on its
destination), not when it is ordered; a move that never arrives (its request parked, or the run ended first)
is not a migration. ``analyze`` and the simulator's summary both count them here."""

from __future__ import annotations

import numpy as np


def migration_figures(ops: dict[str, np.ndarray]) -> dict:
    """Arrived migrations: their count, the KV bytes they carried, the seconds from order to arrival summed,
    those that arrived without KV (to be prefilled again), and the weight loads."""
    is_mig = ops["kind"] == "migration_in"
    return {"count": int(is_mig.sum()), "kv_bytes": int(ops["bytes"][is_mig].sum()),
            "seconds": float((ops["t_end"] - ops["t_start"])[is_mig].sum()),
            "by_reprefill": int(sum(1 for d in ops["detail"][is_mig] if "reprefill=True" in str(d))),
            "weight_syncs": int((ops["kind"] == "weight_load").sum())}
