"""An environment worker process (envs/pool.py starts it): it builds the run's task once, so scorers score
here as on the rollout rank, then runs one environment step per request until its parent goes away.

Protocol on the socket (fd argv[1]): the boot dict (pickled) in, a warning or "" out (ready); then per step
(env, action) in, ("ok" | "error", env after the step, output, error text, seconds) out."""

from __future__ import annotations

import pickle
import sys
import time
import traceback
from multiprocessing.connection import Connection


def boot(cfg_json: str, vocab_size: int, model_dir: str | None, network: bool = False) -> str:
    """Bind the run's task (its scorer of final answers) in this process and, unless ``network``, cut this
    process (and every tool it starts) off the network. Returns "" or why the network stays reachable."""
    from ..config import RunConfig
    from ..data.tasks import make_task
    from .base import bind_task
    from .sandbox import CLONE_NEWNET, CLONE_NEWUSER, _unshare

    bind_task(make_task(RunConfig.model_validate_json(cfg_json), vocab_size, model_dir))
    if network or _unshare(CLONE_NEWNET) or _unshare(CLONE_NEWUSER | CLONE_NEWNET):
        return ""
    return "no network namespace here (needs root or user namespaces): environment steps can reach the network"


def main(fd: int) -> None:
    conn = Connection(fd)
    conn.send_bytes(pickle.dumps(boot(**pickle.loads(conn.recv_bytes()))))  # ready: "" or a warning
    while True:
        try:
            env, action = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        t = time.monotonic()
        try:
            output = env.step(action)
            reply = ("ok", env, dict(output), "", time.monotonic() - t)
            data = pickle.dumps(reply)
        except Exception as e:  # noqa: BLE001 - an environment may raise anything: the episode records it
            last = traceback.extract_tb(e.__traceback__)[-1:]
            where = f" ({last[0].filename.rsplit('/', 1)[-1]}:{last[0].lineno})" if last else ""
            data = pickle.dumps(("error", None, None, f"{type(e).__name__}: {e}{where}", time.monotonic() - t))
        conn.send_bytes(data)


if __name__ == "__main__":
    main(int(sys.argv[1]))
