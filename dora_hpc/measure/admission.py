"""Lean admission's cap on the pipeline's depth, as a run logged it (core/admission.py; the ``admission_cap`` op
of each train step in the runtime's and a simulated run's logs).

Pure: a dict in, figures out.
"""

from __future__ import annotations


def admission_caps(caps: dict[int, int], tbs: int, warmup_steps: int = 0) -> dict | None:
    """``caps``: the cap (groups) at each train step's start. By step, the last, and ``mean_tbs``: the mean over
    the steps from ``warmup_steps`` on (the measured window's; all of them when there are no more), in units of
    TBS. None when the run's admission has no cap (eager, or another mode)."""
    if not caps:
        return None
    steps = sorted(caps)
    steady = [caps[s] for s in steps[warmup_steps:]] or [caps[s] for s in steps]
    return {"by_step": {str(s): caps[s] for s in steps}, "last": caps[steps[-1]],
            "mean_tbs": sum(steady) / len(steady) / tbs}
