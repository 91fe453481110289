"""``dora-hpc bench convergence``: does DORA learn as fast as synchronous training? (paper Fig. 10)

The cases (default sync, dora K=1 and dora K=3) train from the same initial checkpoint with the same
seeds for the same number of steps; the mean reward of every step's batch is read back from the
trainer's HDF5 log. Several seeds give the noise: a case is "within noise" of sync when the gap between
their final rewards (mean of the last ``tail`` steps, averaged over seeds) is no larger than the spread
of sync's own final reward across seeds (max - min). With ``eval_n`` > 0 each run's final checkpoint,
and each seed's initial model once, are also scored on held-out prompts (``dora-hpc eval``), and the
same verdict is given on the held-out greedy mean reward.

Each run's ``analyze`` figures that say what the rollout did are kept beside its curve (``rollout``): versions
live at once, migrations, and for multi-turn runs (``env.name``) turns per episode, the environment's share of
episode time, environment errors, episodes that spanned versions (partial) and the share of episodes tagged
v0 that took at least 2 turns.

Invariant: every curve is a real run's log (``run_case``); runs of one seed are back to back.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from ..config import load_config
from .modes_bench import _fresh, machine, refuse_overridden, run_case

CASES: dict[str, list[str]] = {
    "sync": ["mode=sync"],
    "dora-k1": ["mode=dora", "dora.k=1"],
    "dora-k2": ["mode=dora", "dora.k=2"],
    "dora-k3": ["mode=dora", "dora.k=3"],
    "dora-k3-eager": ["mode=dora", "dora.k=3", "dora.admission=eager"],
    "dora-k3-lean": ["mode=dora", "dora.k=3", "dora.admission=lean"],
    "partial": ["mode=partial"],
    # train.lora (alpha 32, all-linear) at the config's lr x LORA_LR_SCALE: LoRA Without Regret (Thinking Machines,
    # 2025) and TRL's reproduction find LoRA's best lr about 10x full fine-tuning's, about the same at every rank
    "dora-k2-lora-r1": ["mode=dora", "dora.k=2", "train.lora={rank: 1}"],
    "dora-k2-lora-r8": ["mode=dora", "dora.k=2", "train.lora={rank: 8}"],
    "dora-k2-lora-r32": ["mode=dora", "dora.k=2", "train.lora={rank: 32}"],
}
LORA_LR_SCALE = 10
DEFAULT_CASES = ["sync", "dora-k1", "dora-k3"]
LOSSES: dict[str, list[str]] = {  # --losses: each runs every case (docs/training.md)
    "ppo_clip": ["train.policy_loss=ppo_clip", "train.is_correction=none"],
    "ppo_clip+truncate": ["train.policy_loss=ppo_clip", "train.is_correction=truncate"],
    "decoupled": ["train.policy_loss=decoupled", "train.is_correction=none"],
    "decoupled+truncate": ["train.policy_loss=decoupled", "train.is_correction=truncate"],
    "decoupled+mask": ["train.policy_loss=decoupled", "train.is_correction=mask"],
    "decoupled+m2po": ["train.policy_loss=decoupled", "train.is_correction=m2po"],
    "gspo": ["train.policy_loss=gspo", "train.is_correction=none"],
}


def cases(losses: list[str], which: list[str] | None = None) -> dict[str, list[str]]:
    """Every case of ``which`` (default DEFAULT_CASES, in CASES' order) under every loss; named by the case
    alone when there is one loss."""
    which = which or DEFAULT_CASES
    return {(c if len(losses) == 1 else f"{c} {loss}"): [*LOSSES[loss], *sets]
            for loss in losses for c, sets in CASES.items() if c in which}


REACH = 0.95  # "reaches sync's reward": the 3-step mean batch reward at 95% of sync's final


def final(curve: list[float], tail: int) -> float:
    return statistics.fmean(curve[-tail:])


def reach(curve: list[float], times: list[float], target: float, window: int = 3) -> dict | None:
    """The first step (and its end time, s since launch) whose ``window``-step mean reward is >= target."""
    for i in range(window - 1, len(curve)):
        if statistics.fmean(curve[i - window + 1: i + 1]) >= target:
            return {"step": i, "t": times[i]}
    return None


def run_dir(out: Path, case: str, seed: int) -> Path:
    return out / "runs" / f"{case.replace(' ', '_').replace('+', '-')}-s{seed}"


def heldout_path(out: Path, case: str, seed: int) -> Path:
    return run_dir(out, case, seed).with_suffix(".eval.json")


def summarize(out: Path, seeds: list[int], tail: int = 5, losses: list[str] | None = None,
              which: list[str] | None = None) -> dict:
    """Reward curves (per step and against wall time) of the runs in OUT/runs, from their train logs, and
    their held-out scores where OUT/runs holds them; the baseline is the first case (sync under the first
    loss)."""
    import numpy as np

    from ..store.shards import read_table

    found = {}
    for case in cases(losses or ["ppo_clip"], which):
        curves, times, clip, weight, held, rollout = {}, {}, [], [], {}, {}
        for seed in seeds:
            t = read_table(run_dir(out, case, seed), "train", "steps",
                           ["step", "t_end", "reward_mean", "clip_frac", "is_weight_mean"])
            order = t["step"].argsort()
            curves[str(seed)] = t["reward_mean"][order].tolist()
            times[str(seed)] = t["t_end"][order].tolist()
            clip.append(float(np.nanmean(t["clip_frac"])))
            weight.append(float(np.nanmean(t["is_weight_mean"])))
            rollout[str(seed)] = rollout_figures(run_dir(out, case, seed))
            if heldout_path(out, case, seed).is_file():
                held[str(seed)] = json.loads(heldout_path(out, case, seed).read_text())["greedy"]["mean_reward"]
        n = min(len(c) for c in curves.values())
        mean = [statistics.fmean(c[i] for c in curves.values()) for i in range(n)]
        finals = [final(c, tail) for c in curves.values()]
        found[case] = {"curves": curves, "times": times, "mean": mean, "first": mean[0],
                       "final": statistics.fmean(finals), "final_by_seed": finals,
                       "clip_frac": statistics.fmean(clip), "is_weight_mean": statistics.fmean(weight),
                       "seconds_per_step": statistics.median(
                           (ts[-1] - ts[0]) / max(len(ts) - 1, 1) for ts in times.values()),
                       "seconds": statistics.median(ts[-1] for ts in times.values()), "rollout": rollout}
        if len(held) == len(seeds):
            found[case]["heldout_final_by_seed"] = held
            found[case]["heldout_final"] = statistics.fmean(held.values())
    base = next(iter(found))
    target = REACH * found[base]["final"]
    for c in found.values():  # when each seed's batch reward (3-step mean) first reaches REACH x sync's final
        c["reach"] = {"reward": target, "by_seed": {
            seed: reach(c["curves"][seed], c["times"][seed], target) for seed in c["curves"]}}
        hit = [r for r in c["reach"]["by_seed"].values() if r is not None]
        c["reach"]["median_s"] = statistics.median(r["t"] for r in hit) if len(hit) == len(seeds) else None
        c["reach"]["median_step"] = statistics.median(r["step"] for r in hit) if len(hit) == len(seeds) else None
    noise = max(found[base]["final_by_seed"]) - min(found[base]["final_by_seed"])
    verdict = {c: {"gap_to_sync": found[c]["final"] - found[base]["final"],
                   "gap_se": paired_se(found[c]["final_by_seed"], found[base]["final_by_seed"]),
                   "within_noise": abs(found[c]["final"] - found[base]["final"]) <= noise}
               for c in found if c != base}
    summary = {"seeds": seeds, "tail_steps": tail, "baseline": base, "sync_seed_spread": noise,
               "verdict": verdict, "cases": found}
    if "heldout_final" in found[base]:
        summary["heldout"] = heldout_verdict(found, base, out, seeds)
    return summary


def paired_se(a: list[float], b: list[float]) -> float | None:
    """The standard error of the mean of the seed-by-seed differences a - b (None under two seeds)."""
    d = [x - y for x, y in zip(a, b, strict=True)]
    return statistics.stdev(d) / len(d) ** 0.5 if len(d) >= 2 else None


def rollout_figures(run: Path) -> dict:
    """What the rollout of one run did (its analyze figures; see the module docstring)."""
    import numpy as np

    from ..analysis.basic import analyze
    from ..store.shards import read_table

    a = analyze(run)
    t = read_table(run, "traj", "trajectories", ["dispatch_version", "turns"])
    v0 = np.maximum(t["turns"][t["dispatch_version"] == 0], 1)
    return {"max_live_versions": a["max_live_versions"], "migrations": a["migrations"], "turns": a["turns"],
            "env_time_fraction": a["env_time_fraction"], "env_errors": a["env_errors"],
            "multi_version_episodes": a["multi_version_episodes"],
            "two_turn_share_v0": float((v0 >= 2).mean()) if len(v0) else 0.0,
            "staleness_histogram": a["staleness"]["histogram"], "mean_staleness": a["staleness"]["mean"],
            "invariants": {k: v for k, v in a["invariants"].items() if k != "offenders"}}


def heldout_verdict(found: dict, base: str, out: Path, seeds: list[int]) -> dict:
    """Each case's held-out greedy reward against sync's (within its seed spread?) and each seed's initial."""
    initial = {str(s): json.loads(p.read_text())["greedy"]["mean_reward"] for s in seeds
               if (p := out / "runs" / f"initial-s{s}.eval.json").is_file()}
    noise = max(found[base]["heldout_final_by_seed"].values()) - min(found[base]["heldout_final_by_seed"].values())
    return {"initial_by_seed": initial, "sync_seed_spread": noise,
            "verdict": {c: {"gap_to_sync": found[c]["heldout_final"] - found[base]["heldout_final"],
                            "gap_se": paired_se([found[c]["heldout_final_by_seed"][str(s)] for s in seeds],
                                                [found[base]["heldout_final_by_seed"][str(s)] for s in seeds]),
                            "within_noise": abs(found[c]["heldout_final"] - found[base]["heldout_final"]) <= noise,
                            "gain_over_initial_by_seed": {s: v - initial[s] for s, v in
                                                          found[c]["heldout_final_by_seed"].items() if s in initial}}
                        for c in found if "heldout_final" in found[c]}}


def _eval(target: str, step: int | None, path: Path, n: int) -> None:
    from ..evaluate import evaluate, resolve

    path.write_text(json.dumps(evaluate(resolve(target, step, None, []), n=n), indent=2) + "\n")


def bench_convergence(config: str, out: Path, sets: list[str] | None = None, seeds: list[int] | None = None,
                      tail: int = 5, console=None, losses: list[str] | None = None,
                      which: list[str] | None = None, eval_n: int = 0) -> dict:
    from rich.progress import Progress

    sets, seeds, losses = list(sets or []), list(seeds or [0, 1]), list(losses or ["ppo_clip"])
    every = cases(losses, which)
    refuse_overridden(sets, {f"--losses {loss}": (LOSSES[loss], f"choose the objective with --losses (one of "
                                                             f"{', '.join(LOSSES)})") for loss in losses}
                      | {f"--cases {c}": (CASES[c], "choose the cases with --cases") for c in which or DEFAULT_CASES})
    if eval_n and not (train := load_config(config, sets).train).checkpoint_every:  # eval reads the last checkpoint
        sets.append(f"train.checkpoint_every={train.max_steps}")
    _fresh(out)
    (out / "runs").mkdir()
    with Progress(console=console) as bar:
        task = bar.add_task("convergence", total=len(seeds) * len(every) * (2 if eval_n else 1))
        for seed in seeds:
            for case, case_sets in every.items():
                if any(s.startswith("train.lora=") for s in case_sets):  # its lr: LORA_LR_SCALE x the config's
                    case_sets = [*case_sets, f"train.lr={load_config(config, sets).train.lr * LORA_LR_SCALE}"]
                bar.update(task, description=f"{case} (seed {seed})")
                run_case(config, [*sets, *case_sets, f"seed={seed}"], run_dir(out, case, seed), timeout_s=3600)
                bar.advance(task)
                if eval_n:
                    bar.update(task, description=f"{case} (seed {seed}): held-out eval")
                    if case == next(iter(every)):  # the initial model, once per seed
                        _eval(str(run_dir(out, case, seed)), 0, out / "runs" / f"initial-s{seed}.eval.json", eval_n)
                    _eval(str(run_dir(out, case, seed)), None, heldout_path(out, case, seed), eval_n)
                    bar.advance(task)
    title = f"{', '.join(every)}: same initial model and seeds ({config} {' '.join(sets)})"
    summary = summarize(out, seeds, tail, losses, which) | {
        "config": config, "sets": sets, "losses": losses, "eval_n": eval_n, "machine": machine(), "title": title}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    from .plots import plot_convergence

    plot_convergence(summary, out / "convergence.png")
    return summary
