"""measure/history.py: which rows of a preempted-and-resumed run make up its history."""

import numpy as np

from dora_hpc.measure.history import history


def ops(*rows):
    kinds, attempts, versions, details = zip(*rows, strict=True)
    return {"kind": np.array(kinds, dtype=object), "attempt": np.array(attempts), "version": np.array(versions),
            "detail": np.array(details, dtype=object)}


def test_the_chain_follows_checkpoints_and_drops_lost_futures():
    # attempt 0 from scratch; attempt 1 resumed from its step-4 checkpoint; attempt 2 crashed before any
    # checkpoint of its own and resumed from attempt 1's step 6 -> chain 0, 1, 3 (2 continued nothing)
    h = history(ops(("start", 0, 0, "fresh"), ("start", 1, 4, "from_attempt=0 checkpoint=step-4"),
                    ("start", 2, 6, "from_attempt=1 checkpoint=step-6"),
                    ("start", 3, 6, "from_attempt=1 checkpoint=step-6")))
    assert h.chain == [0, 1, 3]
    attempts = np.array([0, 0, 0, 1, 1, 2, 3, 3])
    steps = np.array([3, 4, 5, 4, 6, 6, 6, 7])
    assert h.step_mask(attempts, steps).tolist() == [True, False, False, True, False, False, True, True]


def test_an_uninterrupted_run_keeps_every_row():
    h = history(ops(("start", 0, 0, "fresh"), ("publish", 0, 1, "")))
    assert h.chain == [0] and h.step_mask(np.array([0, 0]), np.array([0, 9])).all()
