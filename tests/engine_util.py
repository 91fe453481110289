"""Helpers shared by the engine tests (built-in and vLLM backends)."""


def run_all(engine):
    """Step ``engine`` until it has no work; {request id: Finished}."""
    out = {}
    while engine.has_work():
        for f in engine.step():
            out[f.req_id] = f
    return out
