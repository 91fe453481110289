"""Speculative decoding as the engine steps record it: per step, the sequences that decoded (``decodes``: one
target forward each), the tokens their drafts proposed (``drafted``) and those the target accepted
(``accepted``). A decode makes one token of its own plus each accepted one, so tokens per forward is
(decodes + accepted) / decodes. ``analyze`` and the simulator's summary both count them here."""

from __future__ import annotations

import numpy as np

BATCH_BINS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 64), (65, 1 << 30))  # decodes in a step


def speculation_figures(esteps: dict[str, np.ndarray]) -> dict:
    """Drafted and accepted tokens, the decodes they rode on, acceptance per drafted token and tokens per
    target forward, in all and by the step's decode batch (``by_batch``: "lo-hi" -> the same figures). A run
    without speculation (or logs from before schema 11) reads drafted 0 and tokens_per_forward 1."""
    decodes, drafted, accepted = (esteps[c].clip(min=0).astype(np.int64) for c in ("decodes", "drafted", "accepted"))

    def figures(m: np.ndarray) -> dict:
        d, dr, ac = int(decodes[m].sum()), int(drafted[m].sum()), int(accepted[m].sum())
        return {"decodes": d, "drafted": dr, "accepted": ac, "acceptance": ac / dr if dr else 0.0,
                "tokens_per_forward": (d + ac) / d if d else 1.0}

    out = figures(np.ones(len(decodes), dtype=bool))
    out["by_batch"] = {f"{lo}-{hi}" if hi < 1 << 30 else f"{lo}+": figures(m) for lo, hi in BATCH_BINS
                       if (m := (decodes >= lo) & (decodes <= hi)).any()}
    return out
