"""Helpers shared by the engine tests (built-in and vLLM backends)."""

import pytest

from dora_hpc.engine.engine import RequestError


def run_all(engine):
    """Step ``engine`` until it has no work; {request id: Finished}."""
    out = {}
    while engine.has_work():
        for f in engine.step():
            out[f.req_id] = f
    return out


def sleep_and_wake(engine, prompt, params, weights, refused: str, resident) -> tuple[int, int, int]:
    """The sleep contract of a borrowed instance (cluster.elastic), on either backend: ``sleep`` is refused
    (an error matching ``refused``) while a request is live; a slept engine refuses to step; the next
    version's ``weights`` wake it with the KV memory it had, and the same request then gives the same tokens.
    ``resident()``: the bytes of KV memory the engine holds now. Returns (bytes freed, resident before the
    sleep, resident while asleep)."""
    v = engine.version
    engine.add(0, prompt, params, v)
    engine.step()
    with pytest.raises(RequestError, match=refused):
        engine.sleep()
    before = run_all(engine)[0].response
    size = resident()
    freed = engine.sleep()
    asleep = resident()
    engine.add(1, prompt, params, v)
    with pytest.raises(RequestError, match="sleeps"):
        engine.step()
    engine.abort(1)
    engine.load_weights(weights, v + 1)  # the next version's weights wake it
    assert resident() == size
    engine.add(0, prompt, params, v + 1)  # same request, same seed: the same tokens as before it slept
    assert run_all(engine)[0].response == before
    return freed, size, asleep
