"""``dora-hpc bench agent-gateway``: what an agent's calls through the OpenAI-compatible endpoint cost against
an environment's steps, on the same episodes.

Both cases run one rollout host in this process (``dora-hpc eval``'s: the tiny model on the built-in engine, the
environment workers, the real endpoint) over the same prompts, seeds, turns and replies: ``env`` is
``toy_turns`` (4 reply tokens, no latency), ``agent`` is ``dora_hpc.envs.agents:fixed_replies`` (a 4-number reply)
through the openai client. Each turn decodes the same few tokens, so what differs is the path from a finished
turn to the next turn's tokens on the engine: the environment worker's round trip, or the HTTP answer, the
client, the agent's loop and the next HTTP call. Figures per case (medians over interleaved repeats):

* ``gap_ms`` p50 / p99: a turn's end to the next turn's tokens joining the engine (the added latency per call);
* ``first_ms`` p50 / p99: dispatch to the first turn on the engine (an agent starts in its worker, then calls);
* ``turns_per_s``: every episode's turns over the wall time of the batch (``episodes`` at once, one instance).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

CASES = {"env": ["env.name=toy_turns", "env.args={reply_tokens: 4, stop_prob: 0.0}"],
         "agent": ["env.name=openai_agent", "env.args={agent: 'dora_hpc.envs.agents:fixed_replies'}"]}


class _Probe:
    """The engine as the host sees it, timing when each request's tokens join it."""

    def __init__(self, engine, on_tokens) -> None:
        self._engine, self._on_tokens = engine, on_tokens

    def add(self, req_id, *a, **kw):
        self._on_tokens(req_id)
        return self._engine.add(req_id, *a, **kw)

    def extend(self, req_id, *a, **kw):
        self._on_tokens(req_id)
        return self._engine.extend(req_id, *a, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def run_case(case: str, model_dir: Path, episodes: int, turns: int) -> dict[str, Any]:
    from ..config import load_config
    from ..data.tasks import make_task
    from ..engine.engine import Engine
    from ..engine.model import load_model
    from ..evaluate import _EvalEpisodes

    cfg = load_config(None, [*CASES[case], f"env.max_turns={turns}", f"env.workers={episodes}",
                             f"cluster.max_num_seqs={episodes}", "workload.response_len={median: 4, sigma: 0, "
                             "max: 4, min: 4}", "workload.prompt_len={median: 8, sigma: 0, max: 8, min: 8}"])
    if case == "agent":
        cfg = cfg.model_copy(update={"env": cfg.env.model_copy(
            update={"args": {**cfg.env.args, "turns": turns}})})
    task = make_task(cfg, 512, model_dir)
    engine = Engine(load_model(model_dir), kv_blocks=64 * episodes, block_size=16, max_num_seqs=episodes,
                    max_batched_tokens=512, version=0)
    ended: dict[int, float] = {}
    started: dict[int, float] = {}
    gaps: list[float] = []
    first: list[float] = []

    def on_tokens(req: int) -> None:
        now = time.perf_counter()
        if req in ended:
            gaps.append(now - ended.pop(req))
        elif req in started:
            first.append(now - started.pop(req))

    host = _EvalEpisodes(cfg, _Probe(engine, on_tokens), task, model_dir)
    turn_ended, begin = host.episodes.turn_ended, host.episodes.begin

    def timed_turn_ended(f, info) -> None:
        ended[f.req_id] = time.perf_counter()
        turn_ended(f, info)

    def timed_begin(traj_id, *a) -> None:
        started[traj_id] = time.perf_counter()
        begin(traj_id, *a)

    host.episodes.turn_ended, host.episodes.begin = timed_turn_ended, timed_begin
    try:
        host.generate([(0, task.prompt(0))], 1.0, 1.0, 1, 10**6, lambda: None)  # warm: workers up, imports done
        gaps.clear()
        first.clear()
        t0 = time.perf_counter()
        out = host.generate([(g, task.prompt(g)) for g in range(episodes)], 1.0, 1.0, 1, 0, lambda: None)
        wall = time.perf_counter() - t0
    finally:
        host.close()
    done_turns = sum(t for _, t, _, _ in out.values())
    errors = [e for _, _, e, _ in out.values() if e]
    return {"episodes": len(out), "turns": done_turns, "errors": errors[:3], "wall_s": wall,
            "turns_per_s": done_turns / wall, "gap_ms": _pcts(gaps), "first_ms": _pcts(first)}


def _pcts(xs: list[float]) -> dict[str, float]:
    xs = sorted(x * 1e3 for x in xs)
    if not xs:
        return {"n": 0, "p50": float("nan"), "p99": float("nan")}
    return {"n": len(xs), "p50": xs[len(xs) // 2], "p99": xs[min(len(xs) - 1, int(0.99 * len(xs)))]}


def bench_agent_gateway(out: Path, episodes: int = 8, turns: int = 8, repeats: int = 3, console=None) -> dict:
    from ..engine.local_models import build_tiny_model

    model = build_tiny_model()
    runs: dict[str, list[dict]] = {c: [] for c in CASES}
    for r in range(repeats):  # A B A B: drift on the box hits both cases alike
        for case in CASES:
            if console:
                console.print(f"[{r + 1}/{repeats}] {case}: {episodes} episodes x {turns} turns")
            runs[case].append(run_case(case, model, episodes, turns))
    med = {c: {"turns_per_s": statistics.median(x["turns_per_s"] for x in rs),
               "gap_ms_p50": statistics.median(x["gap_ms"]["p50"] for x in rs),
               "gap_ms_p99": statistics.median(x["gap_ms"]["p99"] for x in rs),
               "first_ms_p50": statistics.median(x["first_ms"]["p50"] for x in rs),
               "first_ms_p99": statistics.median(x["first_ms"]["p99"] for x in rs)} for c, rs in runs.items()}
    summary = {"episodes": episodes, "turns": turns, "repeats": repeats, "medians": med, "runs": runs,
               "added_gap_ms_p50": med["agent"]["gap_ms_p50"] - med["env"]["gap_ms_p50"],
               "added_gap_ms_p99": med["agent"]["gap_ms_p99"] - med["env"]["gap_ms_p99"],
               "turns_per_s_ratio": med["agent"]["turns_per_s"] / med["env"]["turns_per_s"]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    _plot(runs, out / "agent-gateway.png")
    return summary


def _plot(runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
    for i, key in enumerate(("gap_ms", "first_ms")):
        for c, rs in runs.items():
            for r, x in enumerate(rs):
                ax[i].bar(f"{c}\n{r}", x[key]["p50"], color="C0" if c == "env" else "C1")
                ax[i].plot([f"{c}\n{r}"], [x[key]["p99"]], "k_", markersize=14)
        ax[i].set_ylabel("ms (bar p50, tick p99)")
        ax[i].set_title({"gap_ms": "turn end -> next turn's tokens", "first_ms": "dispatch -> first turn"}[key])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
