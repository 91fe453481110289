"""The paper, figure by figure: results/paper/README.md from the committed summaries, without re-running any
measurement. Each row names the paper's figure, ours, where ours comes from, the command that measured it,
whether the two are like for like, and a verdict. Every number is read from committed JSON, and every verdict
is written by ``judge`` from a comparison's outcome (tests/test_paper_report.py holds the file to that).

    .venv/bin/python tools/paper_report.py           # rewrite results/paper/README.md and summary.json
    .venv/bin/python tools/paper_report.py --check   # exit 1 if the committed report is out of date
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "paper"
SIM = ".venv/bin/dora-hpc simulate configs/sim/{0}.yaml --out results/sim/{0}"
ABLATION = ".venv/bin/dora-hpc bench ablation configs/bench-modes.yaml --out results/bench/ablation"
ABLATION_LONG = (".venv/bin/dora-hpc bench ablation configs/bench-long-context.yaml "
                 "--out results/bench/ablation-long-context")
SMOLLM2_ABLATION = "results/bench/ablation-long-context-smollm2"
ABLATION_SMOLLM2 = (".venv/bin/dora-hpc bench ablation configs/bench-long-context-smollm2.yaml --set batch.tbs=4 "
                    "--set batch.rbs=16 --set cluster.max_num_seqs=4 --set train.max_steps=24 "
                    f"--set train.micro_batch=2 --repeats 2 --run-timeout 3600 --out {SMOLLM2_ABLATION}")
LEARNING = "results/bench/staleness/learning"
LEARNING_CMD = (".venv/bin/dora-hpc bench convergence configs/bench-convergence.yaml --losses decoupled+truncate,"
                "ppo_clip --cases sync,dora-k3-eager,dora-k3-lean --seeds 0,1,2,3,4,5 --eval 200")
OFFPOLICY_CMD = (".venv/bin/dora-hpc bench convergence configs/bench-convergence.yaml --losses ppo_clip,"
                 "decoupled+truncate --seeds 0,1,2 --set train.lr=0.002")
PPO_CLIP = "results/bench/convergence-smollm2-ppo_clip"
TABLES = "see results/paper/tables/README.md"
SOURCES = {"sim": "simulator", "toy": "CPU runtime, tiny model", "real": "CPU runtime, SmolLM2-135M",
           "none": "not measured"}
MIN_SEEDS = 5  # a claim that two runs' rewards match is tested on this many seeds or more
MARGIN = 0.05  # "tracks sync": the equivalence margin on a final or held-out reward (0-1 scale), 5 points
SMALL_SHARE = 0.01  # a ratio whose denominator is under this share of a step is shown, not judged
# Student's t, one-sided 95% quantile by degrees of freedom (the standard table); past 30, the normal's 1.645
T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833, 10: 1.812,
       11: 1.796, 12: 1.782, 13: 1.771, 14: 1.761, 15: 1.753, 16: 1.746, 17: 1.740, 18: 1.734, 19: 1.729, 20: 1.725,
       21: 1.721, 22: 1.717, 23: 1.714, 24: 1.711, 25: 1.708, 26: 1.706, 27: 1.703, 28: 1.701, 29: 1.699, 30: 1.697}
SIM_LIKE = "same metric, simulated (assumed hardware, split and workload: configs/sim/)"


@cache  # several rows read one summary: each file is read once (nothing mutates what it returns)
def load(path: str) -> dict | None:
    p = ROOT / path
    return json.loads(p.read_text()) if p.exists() else None


@dataclass
class Row:
    item: str
    paper: str
    ours: str
    source: str   # a SOURCES key
    command: str
    like: str     # whether the paper's measurement and ours are the same: "yes", or what differs
    verdict: str


def judge(holds: bool | None, why: str = "", like: bool = True, paper_gives: bool = True,
          measured: bool = True, comparable: bool = True, judged: bool = True) -> str:
    """Every verdict of the report is written here, from a comparison's outcome. ``holds``: ours agrees with the
    paper's figure or claim (True), does not (False), or the data cannot decide (None). An agreement that is not
    like for like is never called a reproduction. Not ``comparable``: the row itself says only ratios compare
    (an absolute figure on assumed hardware). Not ``judged``: a diagnostic the paper never ran, or a ratio over
    a denominator under SMALL_SHARE of a step; the figure is shown, ``why`` says which."""
    if not measured:
        word = "not yet measured"
    elif not comparable:
        word = "not comparable"
    elif not judged:
        word = "shown, not judged"
    elif not paper_gives:
        word = "ours only (the paper's text gives no figure)"
    elif holds is None:
        word = "inconclusive"
    elif holds:
        word = "reproduced" if like else "agrees, not like for like"
    else:
        word = "differs"
    return f"{word}: {why}" if why else word


def close_to(ours: float, paper: float, effect: bool = False) -> bool:
    """Within 10% of the paper's figure. With ``effect`` (a ratio whose point is how far it is from 1, as the
    ablation's 1.10x) the effect itself must be within 10%: ours - 1 against the paper's - 1."""
    return abs((ours - 1) / (paper - 1) - 1) <= 0.10 if effect else abs(ours / paper - 1) <= 0.10


def equivalent(gap: float, se: float, df: int, margin: float) -> bool | None:
    """Two one-sided tests (TOST) at 5% each: True when the 90% interval ``gap`` +- t * ``se`` lies inside
    +-``margin`` (equivalence shown); False when it lies wholly outside (the gap is larger than the margin, shown
    alike); None when the interval straddles the margin: the data cannot decide."""
    half = T95.get(df, 1.645) * se
    if abs(gap) + half <= margin:
        return True
    return False if abs(gap) - half > margin else None


def interval(gap: float, se: float, df: int) -> str:
    half = T95.get(df, 1.645) * se
    return f"90% interval [{gap - half:+.3f}, {gap + half:+.3f}] against +-{MARGIN}"


def tracks(gap: float, se: float, seeds: int) -> bool | None:
    """Whether a reward gap to sync is equivalent to 0 within MARGIN (``equivalent``, seeds - 1 degrees of
    freedom); None on fewer than MIN_SEEDS."""
    return None if seeds < MIN_SEEDS else equivalent(gap, se, seeds - 1, MARGIN)


def tracks_why(gap: float, se: float, seeds: int) -> str:
    """What a ``tracks`` verdict rests on: too few seeds, or the interval against the margin."""
    return f"{seeds} seeds, fewer than {MIN_SEEDS}" if seeds < MIN_SEEDS else interval(gap, se, seeds - 1)


def ratio_row(item: str, paper: float, ours: float | None, source: str, command: str, why: str = "",
              fmt: str = "{:.2f}x", effect: bool = False, like: str = SIM_LIKE, paper_text: str = "",
              ours_text: str = "", seeds: list[float] | None = None, denominator: float | None = None,
              diagnostic: str = "") -> Row:
    """A row whose verdict compares ours with the paper's figure (``close_to``); ``why`` says why they differ.
    The comparison is like for like when ``like`` says "yes" or starts "same metric". ``seeds``: the per-seed
    figures ``ours`` is the median of; when it misses but they straddle the paper's figure, the data cannot
    decide. Shown and not judged: a ``diagnostic`` the paper never ran (the text says why), a ``denominator``
    (a share of a step) under SMALL_SHARE. A row whose ``like`` says only ratios compare is not comparable."""
    if ours is None:
        return Row(item, paper_text or fmt.format(paper), "—", "none", command, like, judge(None, measured=False))
    close = close_to(ours, paper, effect)
    straddle = seeds is not None and not close and min(seeds) <= paper <= max(seeds)
    holds = None if straddle else close
    if straddle:
        why = f"its {len(seeds)} seeds span {min(seeds):.3f}-{max(seeds):.3f}, across the paper's figure; " + why
    small = denominator is not None and denominator < SMALL_SHARE
    if small:
        why = f"the denominator is {denominator:.2%} of a step, under {SMALL_SHARE:.0%}"
    return Row(item, paper_text or fmt.format(paper), ours_text or fmt.format(ours), source, command, like,
               judge(holds, diagnostic or why if (diagnostic or small or holds is not True) else "",
                     like=like == "yes" or like.startswith("same metric"), comparable="only ratios compare" not in like,
                     judged=not (diagnostic or small)))


def _mode(summary: dict | None, mode: str, key: str) -> float | None:
    return summary["modes"][mode][key] if summary else None


def _rollout_min(s: dict, mode: str) -> float:
    """Rollout-only minutes a step (the part of a step that no training overlaps)."""
    return _mode(s, mode, "rollout_only_fraction") * _mode(s, mode, "mean_step_time_s") / 60


PAPER_FIG10 = {64: dict(tput=23327, sync=1.65, partial=1.17, ro_sync=0.65, ro_dora=0.12, ro_x=8.2, step=1.56,
                        minutes=(14.9, 1.8)),
               128: dict(tput=34135, sync=2.12, partial=1.11, ro_sync=0.73, ro_dora=0.24, ro_x=5.9, step=1.93,
                         minutes=None)}


def _sensitivity(s64: dict | None) -> str:
    """DORA / sync over the simulator's sensitivity sweep at 64 GPUs (results/sim/paper-64/sensitivity.json)."""
    sweep = load("results/sim/paper-64/sensitivity.json")
    if not sweep:
        return ""
    k = s64["modes"]["dora"]["max_staleness"] if s64 else 3
    all_ = [v["dora_over_sync"] for v in sweep]
    k2 = [v["dora_over_sync"] for v in sweep if v["changes"].get("dora.k", k) >= 2]
    return (f"; sensitivity sweep {min(all_):.2f}-{max(all_):.2f}x over {len(all_)} variants, {min(k2):.2f}-"
            f"{max(k2):.2f}x at K >= 2 (results/sim/paper-64/sensitivity.md)")


def fig10_scale(n: int) -> list[Row]:
    """Throughput and rollout-only time at one scale, against the paper's Fig. 10."""
    s, cmd, p = load(f"results/sim/paper-{n}/summary.json"), SIM.format(f"paper-{n}"), PAPER_FIG10[n]
    if not s:
        return [ratio_row(f"DORA / sync throughput, {n} GPUs", p["sync"], None, "sim", cmd)]
    dora, sync = s["modes"]["dora"], s["modes"]["sync"]
    step_x = sync["mean_step_time_s"] / dora["mean_step_time_s"]
    bound = (f"DORA reaches {dora['limit_share']:.0%} of its trainer-bound limit here: training scales "
             "perfectly in the simulator" if dora["limit_share"] > 0.95 else "")
    ro_sync, ro_dora = _rollout_min(s, "sync"), max(_rollout_min(s, "dora"), 1e-12)  # 0: shown, not judged
    minutes = p["minutes"]
    rows = [
        ratio_row(f"DORA throughput, {n} GPUs (tokens/s trained)", p["tput"], dora["throughput_tokens_per_s"], "sim",
                  cmd, f"{dora['throughput_tokens_per_s'] / p['tput']:.2f}x the paper's: absolute tokens/s follow "
                  "the assumed hardware and response lengths", fmt="{:,.0f}",
                  like="no: simulated hardware and an assumed workload; only ratios compare"),
        Row(f"DORA / sync throughput and step time, {n} GPUs", f"{p['sync']:.2f}x (step time {p['step']:.2f}x)",
            f"{s['dora_over_sync']:.2f}x (step time {step_x:.2f}x)" + (_sensitivity(s) if n == 64 else ""), "sim",
            cmd, SIM_LIKE + "; a step here trains a fixed number of tokens, so throughput and step time are one "
            f"ratio, where the paper's two differ ({p['sync']}x, {p['step']}x)",
            judge(close_to(s["dora_over_sync"], p["sync"]) and close_to(step_x, p["step"]),
                  "; ".join(f"{what} {x:.2f}x against {y}x" for what, x, y in
                            (("throughput", s["dora_over_sync"], p["sync"]), ("step time", step_x, p["step"]))
                            if not close_to(x, y)) + (f"; {bound}" if bound else ""))),
        Row(f"DORA / one-step off-policy throughput, {n} GPUs", "bars in Fig. 10, no number in the text",
            f"{s['dora_over_one_step']:.2f}x", "sim", cmd, SIM_LIKE, judge(None, paper_gives=False)),
        ratio_row(f"sync rollout-only share of a step, {n} GPUs", p["ro_sync"], sync["rollout_only_fraction"], "sim",
                  cmd, fmt="{:.0%}"),
        ratio_row(f"DORA rollout-only share of a step, {n} GPUs", p["ro_dora"], dora["rollout_only_fraction"], "sim",
                  cmd, bound, fmt="{:.0%}"),
        ratio_row(f"rollout-only time, sync / DORA, {n} GPUs", p["ro_x"], ro_sync / ro_dora, "sim", cmd,
                  f"the time no train step overlaps, summed directly: sync's {sync['rollout_only_fraction']:.0%} "
                  f"of a {sync['mean_step_time_s'] / 60:.1f}-minute step against DORA's "
                  f"{dora['rollout_only_fraction']:.0%} of a {dora['mean_step_time_s'] / 60:.1f}-minute one"
                  + (f"; {bound}" if bound else ""), fmt="{:.1f}x", denominator=dora["rollout_only_fraction"],
                  paper_text=f"{p['ro_x']:.1f}x" + (f" ({minutes[0]} -> {minutes[1]} min)" if minutes else ""),
                  ours_text=f"{ro_sync / ro_dora:.1f}x ({ro_sync:.1f} -> {ro_dora:.2f} min)"),
    ]
    return rows


def fig10_partial() -> list[Row]:
    """DORA against partial rollout at 64 GPUs, on three placements: the paper's (DORA on the config's split,
    partial colocated), DORA's best split, and partial on DORA's split."""
    rows = []
    for n in (64, 128):
        s = load(f"results/sim/paper-{n}/summary.json")
        why = ""
        sweep = load(f"results/sim/paper-{n}/sensitivity.json")
        if sweep:
            base = next(v for v in sweep if v["variant"] == "base")
            slow = next((v for v in sweep if v["changes"] == {"sim.hardware.prefill_mfu": 0.1}), None)
            why = (f"our partial rollout is fast: re-prefill is {base['partial_reprefill_share']:.1%} of its time"
                   + (f"; at 10% prefill MFU DORA / partial is {slow['dora_over_partial']:.2f}x" if slow else ""))
        rows.append(ratio_row(f"DORA / partial rollout throughput, {n} GPUs, the paper's placements (DORA on the "
                              "config's split, partial colocated)", PAPER_FIG10[n]["partial"],
                              s and s["dora_over_partial"], "sim", SIM.format(f"paper-{n}"), why, effect=True))
    s, split, pp = (load(p) for p in ("results/sim/paper-64/summary.json", "results/sim/paper-64/split.json",
                                      "results/paper/partial-placement.json"))
    if s and split and pp:
        best, colo, disagg = split["best"], pp["colocated"], pp["disaggregated"]
        dora = s["modes"]["dora"]
        paper = PAPER_FIG10[64]["partial"]
        rows.append(ratio_row("DORA / partial rollout throughput, 64 GPUs, DORA at its best split (partial colocated)",
                              paper, best["throughput_tokens_per_s"] / colo["throughput_tokens_per_s"], "sim",
                              SIM.format("paper-64") + " --suggest-split", "DORA's best split gains it little here",
                              effect=True, like="partly: the paper's DORA split is its own, ours the best of a "
                              "simulated sweep",
                              ours_text=f"{best['throughput_tokens_per_s'] / colo['throughput_tokens_per_s']:.2f}x "
                              f"({best['rollout_instances']} rollout instances: {best['throughput_tokens_per_s']:,.0f}"
                              f" against {colo['throughput_tokens_per_s']:,.0f} tokens/s)"))
        x = dora["throughput_tokens_per_s"] / disagg["throughput_tokens_per_s"]
        rows.append(ratio_row("DORA / partial rollout throughput, 64 GPUs, both on DORA's split", paper, x, "sim",
                              ".venv/bin/python results/paper/partial_placement.py",
                              f"partial rollout {'beats' if x < 1 else 'trails'} DORA on DORA's split: its re-prefill "
                              "costs "
                              f"{disagg['overheads']['reprefill']:.1%} of its time, while DORA's trainer waits "
                              f"{dora['trainer_wait_fraction']['window']:.0%} of the run for the window",
                              effect=True, like="no: the paper runs partial rollout colocated",
                              diagnostic="a diagnostic the paper never ran (partial rollout on DORA's split): "
                              f"partial rollout {'beats' if x < 1 else 'trails'} DORA there",
                              ours_text=f"{x:.2f}x ({dora['throughput_tokens_per_s']:,.0f} against "
                              f"{disagg['throughput_tokens_per_s']:,.0f} tokens/s, {disagg['rollout_instances']} "
                              "rollout instances)"))
    return rows


def convergence_toy() -> list[Row]:
    """The paper's claim (k=1 and k=3 track sync under plain PPO-clip, k=3 a little slower) on the toy."""
    rows = []
    learn = load(f"{LEARNING}/summary.json")
    if learn:
        n, v = len(learn["seeds"]), learn["verdict"]
        for loss, paper, like in (("ppo_clip", "tracks sync (plain PPO-clip)", "yes"),
                                  ("decoupled+truncate", "tracks sync (no correction needed)",
                                   "no: with a correction (decoupled+truncate) the paper does not use")):
            eager, lean = v[f"dora-k3-eager {loss}"], v[f"dora-k3-lean {loss}"]
            ok = tracks(eager["gap_to_sync"], eager["gap_se"], n)
            fix = v["dora-k3-eager decoupled+truncate"]
            why = tracks_why(eager["gap_to_sync"], eager["gap_se"], n) + "; " + (
                f"lean admission {lean['gap_to_sync']:+.3f} (se {lean['gap_se']:.3f})" if loss != "ppo_clip" else
                "the correction (decoupled+truncate) recovers "
                f"{fix['gap_to_sync'] - eager['gap_to_sync']:+.3f}, to {fix['gap_to_sync']:+.3f}; lean admission "
                f"recovers {lean['gap_to_sync'] - eager['gap_to_sync']:+.3f}")
            rows.append(Row(f"convergence: DORA K=3 vs sync under {loss}, final reward, toy, {n} seeds (eager "
                            "admission, the default)", paper, f"{eager['gap_to_sync']:+.3f} (paired se "
                            f"{eager['gap_se']:.3f})", "toy", LEARNING_CMD, like,
                            judge(ok, why if ok is not True else "", like=like == "yes")))
    off = load("results/bench/convergence-offpolicy/lr0.002/summary.json")
    if off:
        final = {c: off["cases"][f"{c} ppo_clip"]["final_by_seed"] for c in ("sync", "dora-k1", "dora-k3")}
        n = len(final["sync"])
        gap = [a - b for a, b in zip(final["dora-k1"], final["sync"], strict=True)]
        rows.append(Row(f"convergence: DORA K=1 vs sync under ppo_clip, final reward, toy, {n} seeds", "tracks sync",
                        f"{statistics.fmean(gap):+.3f} (paired se {statistics.stdev(gap) / n ** 0.5:.3f})", "toy",
                        OFFPOLICY_CMD, "yes", judge(tracks(statistics.fmean(gap), statistics.stdev(gap) / n ** 0.5, n),
                                                   tracks_why(statistics.fmean(gap), statistics.stdev(gap) / n ** 0.5,
                                                              n))))
        order = [a - b for a, b in zip(final["dora-k3"], final["dora-k1"], strict=True)]
        se = statistics.stdev(order) / n ** 0.5
        slower = None if n < MIN_SEEDS else statistics.fmean(order) < -2 * se
        rows.append(Row(f"convergence ordering: K=3 learns slower than K=1, ppo_clip, toy, {n} seeds",
                        "k=3 moderately slower than k=1", f"K=3 minus K=1 {statistics.fmean(order):+.3f} final reward "
                        f"(paired se {se:.3f}; lower on {sum(x < 0 for x in order)} of {n} seeds)", "toy",
                        OFFPOLICY_CMD, "yes", judge(slower, f"{n} seeds, fewer than {MIN_SEEDS}" if slower is None
                                                    else "")))
    return rows + convergence_k3_gap()


def convergence_k3_gap() -> list[Row]:
    """The 9-seed K=3 gap under the correction, and at is_cap 1 (results/paper/k3-gap/)."""
    gap, rows = load("results/paper/k3-gap/summary.json"), []
    if gap:
        n = len(gap["seeds"])
        ok = tracks(gap["gap"], gap["gap_se"], n)
        rows.append(Row(f"convergence: DORA K=3 with decoupled+truncate, final reward, {n} seeds, toy, lr 2e-3",
                        "tracks sync (no correction needed)", f"{gap['dora_k3_mean']:.3f} vs sync "
                        f"{gap['sync_mean']:.3f}: {gap['gap']:+.3f} (se {gap['gap_se']:.3f})", "toy", gap["command"],
                        "no: with a correction the paper does not use",
                        judge(ok, "" if ok else tracks_why(gap["gap"], gap["gap_se"], n)
                              + " (results/paper/k3-gap/README.md)", like=False)))
    cap = (load("results/paper/k3-gap/variants.json") or {}).get("variants", {}).get("is_cap 1")
    if cap:
        n = len(cap["sync"])
        ok = tracks(cap["gap_to_own_sync"], cap["gap_se"], n)
        rows.append(Row(f"convergence: DORA K=3 with decoupled+truncate at is_cap 1, final reward, {n} seeds, toy",
                        "tracks sync (no correction needed)", f"{cap['dora_k3_mean']:.3f} vs its sync "
                        f"{cap['sync_mean']:.3f}: {cap['gap_to_own_sync']:+.3f} (se {cap['gap_se']:.3f}); "
                        f"{cap['minus_base_dora_k3']:+.3f} over is_cap 2", "toy",
                        "see results/paper/k3-gap/variants.py",
                        "no: with a correction the paper does not use",
                        judge(ok, "" if ok else tracks_why(cap["gap_to_own_sync"], cap["gap_se"], n), like=False)))
    return rows


def _gap_se(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean of a minus mean of b, and its standard error (independent seeds)."""
    return (statistics.fmean(a) - statistics.fmean(b),
            (statistics.variance(a) / len(a) + statistics.variance(b) / len(b)) ** 0.5)


def convergence_real() -> list[Row]:
    """SmolLM2 on addition, held out: K=2 under the correction (4 seeds), K=1 and K=3 under plain ppo_clip."""
    rows, real = [], load("results/bench/convergence-smollm2/combined.json")
    if real:
        held = {c: [r["heldout"] for r in real[c]["by_seed"].values()] for c in ("sync", "dora-k2")}
        gap, se = _gap_se(held["dora-k2"], held["sync"])
        n = min(len(v) for v in held.values())
        rows.append(Row(f"convergence on a real model: DORA K=2 vs sync, held-out greedy reward after 30 steps "
                        f"(SmolLM2, addition, decoupled+truncate, {n} seeds)", "tracks sync (no correction needed)",
                        f"{statistics.fmean(held['dora-k2']):.3f} vs {statistics.fmean(held['sync']):.3f} ({gap:+.3f}, "
                        f"se {se:.3f})", "real", "see results/bench/convergence-smollm2/README.md",
                        "no: with a correction the paper does not use",
                        judge(tracks(gap, se, n), tracks_why(gap, se, n),
                              like=False)))
    s = load(f"{PPO_CLIP}/summary.json")
    if s:
        held = {c: list(v["heldout_final_by_seed"].values()) for c, v in s["cases"].items()}
        cmd = (".venv/bin/dora-hpc bench convergence configs/smollm2-addition.yaml --cases sync,dora-k1,dora-k3 "
               "--losses ppo_clip --seeds 0,1,2 --eval 200")
        spread = f"sync's seeds {min(held['sync']):.2f}-{max(held['sync']):.2f}"
        for k in (1, 3):
            gap, se = _gap_se(held[f"dora-k{k}"], held["sync"])
            n = len(held["sync"])
            above = statistics.fmean(held["dora-k3"]) > statistics.fmean(held["dora-k1"])
            order = f"; K=3 {'above' if above else 'below'} K=1 (the paper: K=3 slower)" if k == 3 else ""
            rows.append(Row(f"convergence on a real model: DORA K={k} vs sync under plain ppo_clip, held-out greedy "
                            f"reward after 30 steps (SmolLM2, addition, {n} seeds)", "tracks sync",
                            f"{statistics.fmean(held[f'dora-k{k}']):.3f} vs {statistics.fmean(held['sync']):.3f} "
                            f"({gap:+.3f}, se {se:.3f}; {spread})", "real", cmd, "yes",
                            judge(tracks(gap, se, n), tracks_why(gap, se, n) + order)))
    return rows


FIG13 = 183 / 166  # the paper's seconds per rollout without KV reuse / with it
FIG13_TEXT = "1.10x (183 -> 166 s a rollout)"


def fig13_sim() -> list[Row]:
    """The KV ablation at paper scale: rollout-only time a step (the paper's metric: time per rollout) first,
    step time second; the median over seeds of each seed's ratio."""
    sk, rows = load("results/sim/kv-ablation/summary.json"), []
    if not sk:
        return rows
    for name, sc in sk["scenarios"].items():
        runs = list(sc["runs"].values())
        by_seed = [(r["reprefill"]["rollout_only_fraction"] * r["reprefill"]["mean_step_time_s"])
                   / max(r["kv"]["rollout_only_fraction"] * r["kv"]["mean_step_time_s"], 1e-12) for r in runs]
        ro = statistics.median(by_seed)
        step = sc["step_time_ratio_reprefill_over_kv"]
        share = statistics.median(r["reprefill"]["overheads"]["reprefill"] for r in runs)
        kv_share = statistics.median(r["kv"]["rollout_only_fraction"] for r in runs)
        rows.append(ratio_row(f"KV-reuse ablation: rollout-only time a step, re-prefill / KV, {name} (median of "
                              f"{len(runs)} seeds)", FIG13, ro, "sim", ".venv/bin/python "
                              "results/sim/kv-ablation/kv_ablation.py", f"re-prefill is {share:.1%} of instance time "
                              "here (compute-bound at the simulator's prefill MFU)", effect=True,
                              seeds=by_seed, denominator=kv_share,
                              like=SIM_LIKE + "; the paper's 'seconds per rollout' is not defined further: ours is "
                              "the rollout time no training overlaps", paper_text=FIG13_TEXT,
                              ours_text=f"{ro:.3f}x (step time {step:.3f}x; seeds "
                              + ", ".join(f"{x:.2f}x" for x in sorted(by_seed)) + ")"))
    return rows


PER_TOKEN = {"engine_s_per_trained_token": "engine-seconds", "engine_steps_per_trained_token": "engine steps"}


def fig13_runtime() -> list[Row]:
    """The KV ablation on the CPU runtime: rollout work per trained token first, the step interval second."""
    rows = []
    for path, what, cmd, source in (("results/bench/ablation", "toy, ~35-token contexts", ABLATION, "toy"),
                                    ("results/bench/ablation-long-context", "toy, ~500-token contexts",
                                     ABLATION_LONG, "toy"),
                                    (SMOLLM2_ABLATION, "SmolLM2, ~650-token contexts", ABLATION_SMOLLM2, "real")):
        a = load(f"{path}/summary.json")
        if not a:
            rows.append(ratio_row(f"KV-reuse ablation: {what}", FIG13, None, source, cmd))
            continue
        kv, re_ = a["variants"]["kv-migration"], a["variants"]["reprefill"]
        per_token = "engine_s_per_trained_token" if "engine_s_per_trained_token" in kv else \
            "engine_steps_per_trained_token"
        work = re_[per_token] / kv[per_token]
        step = re_["mean_step_time_s"] / kv["mean_step_time_s"]
        rows.append(ratio_row(
            f"KV-reuse ablation: rollout {PER_TOKEN[per_token]} per trained token, re-prefill / KV ({what})", FIG13,
            work, source, cmd, f"{re_['reprefill_tokens']:,.0f} tokens re-prefilled in "
            f"{re_['migrations']:,.0f} migrations without KV (0 with it) are a small share of rollout here; "
            "the paper's contexts are thousands of tokens", effect=True,
            like="partly: rollout cost per trained token on a real runtime, not seconds per rollout",
            paper_text=FIG13_TEXT, ours_text=f"{work:.3f}x (step interval {step:.3f}x)"))
    return rows


def overheads() -> list[Row]:
    """§4.4's three overheads, as shares of execution time, at each scale."""
    rows = []
    for n, paper in ((64, dict(weight_sync=0.004, migration=0.036, offload=0.0003)),
                     (128, dict(weight_sync=0.015, migration=0.021, offload=0.0003))):
        s = load(f"results/sim/paper-{n}/summary.json")
        if not s:
            continue
        o, cmd = s["modes"]["dora"]["overheads"], SIM.format(f"paper-{n}")
        like = SIM_LIKE + "; weight loads and KV transfers at the modelled bandwidth"
        rows += [ratio_row(f"overhead, {n} GPUs: load balancing (P2P weight sync)", paper["weight_sync"],
                           o["weight_sync"], "sim", cmd, "lower" if o["weight_sync"] < paper["weight_sync"] else
                           "higher", fmt="{:.1%}", like=like),
                 ratio_row(f"overhead, {n} GPUs: request transfer (KV migration)", paper["migration"], o["migration"],
                           "sim", cmd, "lower" if o["migration"] < paper["migration"] else "higher", fmt="{:.1%}",
                           like=like),
                 Row(f"overhead, {n} GPUs: free-cache", "< 0.03%", f"{o['offload']:.2%}", "sim", cmd,
                     "partly: ours moves KV to host memory under pressure (offload), the paper's frees it",
                     judge(o["offload"] < paper["offload"], "" if o["offload"] < paper["offload"] else "higher",
                           like=False))]
    return rows


def production() -> list[Row]:
    """§4.5: LongCat-Flash on 4,096 accelerators; the simulator's hardware, batch and split are assumptions."""
    p, ks = load("results/sim/production-4096/summary.json"), load("results/sim/production-4096/ksweep.json")
    rows, like = [], "no: an assumed batch, split and hardware (the paper gives none), and K=3 (not stated)"
    for workload, paper in (("reasoning", 3.6), ("agentic", 6.2)):
        item = f"production scale: rollout speed-up over sync, ~500B MoE, 4,096 accelerators, {workload}"
        config = "production-4096" + ("-agentic" if workload == "agentic" else "")
        command = (f".venv/bin/dora-hpc simulate configs/sim/{config}.yaml --modes sync,dora --out out/{config}"
                   "; 3 seeds: results/sim/production-4096/production.py")
        if not p:
            rows.append(ratio_row(item, paper, None, "sim", command))
            continue
        dora, elastic = (p[workload][c]["median"]["rollout_speedup"] for c in ("dora", "dora elastic"))
        wait = {k: statistics.median(r["trainer_wait_fraction"][k] for r in p[workload]["dora"]["seeds"])
                for k in ("window", "tail")}
        at_k = ", ".join(f"K={k}: {r['rollout_speedup']:.2f}x" for k, r in (ks or {}).get(workload, {}).items())
        under = all(r["rollout_speedup"] < int(k) + 1 for k, r in (ks or {}).get(workload, {}).items())
        bound = (f"tail-bound: DORA's trainer waits {wait['window']:.0%} of the time for the window's oldest "
                 f"groups and {wait['tail']:.0%} for the batch's last requests"
                 + (f"; the speed-up {'stays under' if under else 'does not stay under'} K + 1 (seed 0: {at_k})"
                    if at_k else ""))
        rows.append(Row(item + " (median of 3 seeds; cluster.elastic in brackets)", f"{paper:.1f}x",
                        f"{dora:.2f}x ({elastic:.2f}x)", "sim", command, like,
                        judge(close_to(dora, paper), bound, like=False)))
    if p:
        e2e = {w: p[w]["dora"]["median"]["over_sync"] for w in ("reasoning", "agentic")}
        ok = all(2 <= x <= 4 for x in e2e.values())
        rows.append(Row("production scale: end-to-end speed-up over sync, \"with no quality degradation\" (§4.5)",
                        "2-4x", " / ".join(f"{w} {x:.2f}x" for w, x in e2e.items()), "sim",
                        "see results/sim/production-4096/production.py", like + "; quality is not simulated",
                        judge(ok, "the speed-up only: learning at this scale is not measured", like=False)))
    return rows


def _pt(x: float) -> str:
    return f"{x * 100:+.1f} pt"


def table12(name: str, t: dict, paper: str, bound: float) -> Row:
    """Tables 1 and 2: within each difficulty bin, staleness 1 against 0, an equivalence claim with the paper's
    own margin (``bound``), each bin tested by ``equivalent`` (hundreds of responses: the normal quantile).
    Inconclusive on a degenerate run or cells under ``few`` responses; differs where a bin's gap is shown larger
    than the bound; reproduced where every bin's is shown within it; else inconclusive."""
    measured = [b for b in t["bins"] if b["gap"] is not None]
    cells = ", ".join(f"{b['bin']} {_pt(b['gap'])} (se {b['se'] * 100:.1f}, n {b['n0']}/{b['n1']}"
                      f"{', too few' if b['few'] else ''})" for b in measured)
    naive = t["naive"]
    ours = (f"naive s=1 minus s=0 {_pt(naive['1']['pass_rate'] - naive['0']['pass_rate'])}; within bins "
            f"{cells or 'none has both'}" if "0" in naive and "1" in naive else "no staleness-0 or -1 responses")
    tests = {b["bin"]: equivalent(b["gap"], b["se"], 10**6, bound) for b in measured if not b["few"]}
    if not measured or t["degenerate"]:
        holds, why = None, t["degenerate"] or "no bin has responses at staleness 0 and 1"
    elif False in tests.values():
        holds, why = False, (f"the {', '.join(k for k, v in tests.items() if v is False)} bin's 90% interval lies "
                             f"past the paper's {bound * 100:.2g} pt")
    elif any(b["few"] for b in measured):
        holds, why = None, f"cells under {t['few']} responses"
    elif all(tests.values()):
        holds, why = True, ""
    else:
        holds, why = None, (f"no bin's gap shown past the paper's {bound * 100:.2g} pt, but errors up to "
                            f"{max(b['se'] for b in measured) * 100:.1f} pt: no interval lies within it")
    return Row(name, paper, ours, "real", TABLES, "yes: s=1 against s=0 within pass-rate bins (ours: a prompt's "
               "pass rate over the run, 4 bins)", judge(holds, why))


def table3(name: str, t: dict) -> Row:
    ours = ", ".join(f"{b['bin']}: var {b['reward_variance']:.3f}, len {b['mean_length']:.0f}, staleness "
                     f"{b['mean_staleness']:.2f} ({b['groups']} groups)" for b in t["bins"])
    claims = t["claims"]
    holds = None if any(v is None for v in claims.values()) else all(claims.values())
    why = "; ".join(f"{c}: {'yes' if v else 'no' if v is not None else 'too few bins'}" for c, v in claims.items())
    paper_bins = t["binning"].startswith("paper")  # the paper's edges; its G of 16 only a G >= 6 fills
    like = ("partly: the paper's bins (k of 16 right), filled by groups of 4 (Hard, 1-3 of 16, stays empty)"
            if paper_bins else f"no: {t['binning']} (groups of 4), not the paper's k of 16") + \
        "; rewards 0/1, so a group's variance is p(1-p), highest at 2 of 4 by construction"
    return Row(name, "variance highest in the middle bins (~1.0); length falls with ease (3,755 -> 2,711); "
               "staleness highest in the middle (1.01)", ours, "real", TABLES, like, judge(holds, why, like=False))


def fig14b(name: str, t: dict) -> Row:
    med, n = ({int(k): v for k, v in t[key].items()} for key in ("median_length_by_staleness", "n"))
    if 0 not in med or 1 not in med:
        return Row(name, "1,495 / 1,015 (+47%)", json.dumps(med), "real", TABLES, "yes",
                   judge(None, "no staleness-0 or staleness-1 responses"))
    more = med[1] / med[0] - 1
    few = min(n[0], n[1]) < t["few"]
    ours = " / ".join(f"s={s}: {v:.0f}" for s, v in sorted(med.items())) + f" tokens (s=1 vs 0: {more:+.0%})"
    return Row(name, "1,495 / 1,015 (+47%)", ours, "real", TABLES, "yes",
               judge(None if few else more > 0.10, f"{n[0]} / {n[1]} responses at staleness 0 / 1" if few else ""))


def appendix_tables() -> list[Row]:
    t = load("results/paper/tables/summary.json")
    if not t:
        return [Row("Tables 1-3, Fig. 14b", "see the paper", "—", "none", TABLES, "—", judge(None, measured=False))]
    rows = [table12("Table 1: pass rate by staleness (s=1 vs s=0) within difficulty bins (DORA K=3)", t["table1"],
                    "|gap| < 0.6 pt", 0.006),
            table12("Table 2: per-response staleness (s=1 vs s=0) within difficulty bins, partial rollout",
                    t["table2"], "|gap| <= 0.33 pt", 0.0033),
            table3("Table 3: reward variance, length and staleness by difficulty", t["table3"]),
            fig14b("Fig. 14b: median response length, staleness 1 / 0", t["fig14b"])]
    for key, what in (("rollout_bound", "rollout-bound (paced decode)"), ("eager", "the same run again, 2026-12-04"),
                      ("lean", "lean admission")):
        if key in t:
            rows += [table12(f"Table 1, {what}", t[key]["table1"], "|gap| < 0.6 pt", 0.006),
                     table3(f"Table 3, {what}", t[key]["table3"]),
                     fig14b(f"Fig. 14b, {what}", t[key]["fig14b"])]
    naive = t["table1"]["naive"]
    if "0" in naive and "1" in naive:
        gap, few = naive["1"]["pass_rate"] - naive["0"]["pass_rate"], min(naive["0"]["n"], naive["1"]["n"])
        rows.append(Row("C.1: naive pass rate, staleness 0 / 1 (stale looks worse before stratifying)",
                        "58.9% / 55.6% (-3.3 pt)", f"{naive['0']['pass_rate']:.1%} / {naive['1']['pass_rate']:.1%} "
                        f"({_pt(gap)}; n {naive['0']['n']} / {naive['1']['n']})", "real", TABLES, "yes",
                        judge(None if few < t["table1"]["few"] else gap < 0,
                              f"{few} responses at the smaller staleness" if few < t["table1"]["few"] else "")))
    return rows


def appendix_other() -> list[Row]:
    """C.1's improvement rate, Fig. 14a, Fig. 3's tail, the rollout share of a step and C.3's bubble."""
    rows, t = [], load("results/paper/tables/summary.json")
    learn = load(f"{LEARNING}/summary.json")
    if learn:
        curve = learn["cases"]["sync ppo_clip"]["mean"]
        half = curve[len(curve) // 2:]
        rate = statistics.linear_regression(range(len(half)), half).slope
        rows.append(Row("C.1: on-policy improvement a step, and K x it (the most staleness can cost)",
                        "0.113% a step (pass rate, steps 50-100); 3 x 0.113 = 0.34%",
                        f"{rate:.2%} a step (sync's batch reward, steps {len(curve) - len(half)}-{len(curve) - 1}); "
                        f"3 x {rate:.2%} = {3 * rate:.2%}", "toy", LEARNING_CMD,
                        "no: a toy task still learning fast at 30 steps; the paper's is a 32B model's pass rate late "
                        "in training, which needs a long run of a real model",
                        judge(None, "the rate is the task's and the horizon's, not DORA's", like=False)))
    if t:
        hist = t["staleness"]["dora"]
        rows.append(Row("Fig. 14a", "a figure; the text states no value", "staleness of the consumed trajectories "
                        + ", ".join(f"{s}: {c['n']} ({c['pass_rate']:.0%} pass)" for s, c in sorted(hist.items())),
                        "real", TABLES, "unknown: the figure's content is not in the text",
                        judge(None, paper_gives=False)))
    s64, s128 = load("results/sim/paper-64/summary.json"), load("results/sim/paper-128/summary.json")
    if s64:
        w = s64["workload"]
        tail = w["response_p99"] / w["response_p50"]
        rows.append(Row("Fig. 3: response length p99 / p50", "> 10x (a benchmark and a production workload)",
                        f"{tail:.1f}x ({w['response_p99']:,.0f} / {w['response_p50']:,.0f} tokens)", "sim",
                        SIM.format("paper-64"), "no: ours is the simulated workload's configured length distribution",
                        judge(tail > 10, like=False)))
    if s64 and s128:
        share = [s["modes"]["sync"]["rollout_only_fraction"] for s in (s64, s128)]
        rows.append(Row("§1: rollout is 50-80% of a step (sync)", "50-80%", " / ".join(f"{x:.0%}" for x in share)
                        + " at 64 / 128 GPUs", "sim", SIM.format("paper-64"),
                        "partly: sync's rollout-only share in the simulator; the paper cites others' measurements",
                        judge(all(0.5 <= x <= 0.8 for x in share), like=False)))
        rows.append(c3(s64, s128))
    return rows


def c3(s64: dict, s128: dict) -> Row:
    """C.3's sync bubble, (max_i L_i - L_i) / max_i L_i. Over requests' lengths the formula is ours over decode
    slots; the paper names it the inter-node bubble, which is ours over instances."""
    slots = [s["modes"]["sync"]["bubble_fraction"] for s in (s64, s128)]
    inst = [s["modes"]["sync"]["inter_instance_bubble"] for s in (s64, s128)]
    inside = [0.75 <= b <= 0.89 for b in slots]
    why = "; ".join(f"{b:.0%} at {n} {'inside' if ok else 'outside'} the range"
                    for b, n, ok in zip(slots, (64, 128), inside, strict=True))
    return Row("C.3: sync long-tail bubble, 64 / 128 GPUs, (max_i L_i - L_i) / max_i L_i", "75-89%",
               f"{slots[0]:.0%} / {slots[1]:.0%} over decode slots; {inst[0]:.0%} / {inst[1]:.0%} over instances",
               "sim", SIM.format("paper-64"), "partly: the formula over requests' lengths is ours over decode slots "
               "(the verdict's figure); the paper calls it the inter-node bubble, which is ours over instances, and "
               "smaller: each instance holds stragglers", judge(all(inside), why, like=False))


def table(rows: list[Row]) -> str:
    out = ["| figure | paper | ours | from | command | like for like | verdict |", "|---|---|---|---|---|---|---|"]
    cells = [[r.item, r.paper, r.ours, SOURCES[r.source], f"`{r.command}`", r.like, r.verdict] for r in rows]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in cells]
    return "\n".join(out)


INTRO = """# The paper, figure by figure

Every evaluation figure and table of DORA (arXiv 2604.26256, §1, §4 and Appendix C) against what dora_hpc
measures. Ours come from three places: the simulator (`dora-hpc simulate`, the same `core/` policies at
the paper's scale, simulated time), the CPU runtime with the tiny model (real processes, paced engine) and
the CPU runtime with SmolLM2-135M (a real model). Nothing was tuned toward the paper's numbers.

How a verdict is reached (every number and verdict is computed from the committed JSON):
- A figure is *reproduced* within 10% of the paper's (for the KV ablation, a ratio's effect, ratio - 1, within
  10%). A median over seeds that misses while its seeds straddle the paper's figure is *inconclusive*.
- An equivalence claim ("tracks sync", Tables 1-2's small gaps) is two one-sided tests at 5% each against a
  stated margin: reward within +-0.05 of sync's, the tables' gaps within the paper's own bound. It *holds*
  when the 90% interval lies inside the margin and *differs* when it lies wholly outside; an interval that
  straddles the margin, or fewer than 5 seeds, is *inconclusive*.
- Where the measurement is not the paper's (the *like for like* column), an agreement reads *agrees, not like
  for like*; an absolute figure whose row says only ratios compare is *not comparable*.
- A diagnostic the paper never ran, and a ratio whose denominator is under 1% of a step, are *shown, not
  judged*.

Admission: the simulator's paper-64, paper-128 and production rows were re-run on 2026-12-05 at the defaults,
so DORA there runs `dora.admission: lean`. Every other DORA figure (the sensitivity sweep, the KV ablation, the
runtime benches, learning) was measured under `dora.admission: eager` (the window fills: staleness at K), the
default when it ran, except the rows that name lean admission (results/sim/staleness/, results/bench/staleness/).

This file is written by `tools/paper_report.py` (the measurements themselves take hours; each row's command
re-runs one):

```bash
.venv/bin/python tools/paper_report.py            # rewrites this README and summary.json
.venv/bin/python tools/paper_report.py --check    # the test suite runs this: the report matches the summaries
```
"""


def rules() -> str:
    """The rules where dora_hpc and §3.3 differ, or differed, and what each costs."""
    out = ["## Where the rules differ from §3.3", "",
           "* **K.** The paper states the bound twice: §3 keeps a window of |W| <= K versions, its appendix "
           "bounds staleness by K. `dora.k` is the staleness bound (step n trains on versions n - K ... n, so "
           "K + 1 are live); §3's window of K versions is `dora.k` = K - 1 (docs/invariants.md). Our K=1 and K=3 "
           "rows use the staleness reading, the one that allows more staleness.",
           "* **Tiered supplementation.** On a publish the paper admits fresh work under the new version, "
           "migrates, then tops up legacy versions. dora_hpc did the top-up before the planner; since "
           "2026-12-03 it follows the paper (`dora.supplement: after_migration`, the default)."]
    sup = load("results/sim/supplement/summary.json")
    if sup:
        out += ["", "  | workload | DORA / sync, top-up after migration (paper) | before (old) | legacy groups "
                "topped up at a publish (after / before) | elsewhere |", "  |---|---:|---:|---:|---:|"]
        for name, rows in sup.items():
            a, b = rows["after_migration"], rows["before_rebalance"]
            at = [sum(r["topup_at_publish"] for r in x["seeds"]) for x in (a, b)]
            out.append(f"  | {name} | {a['median_over_sync']:.3f}x | {b['median_over_sync']:.3f}x | {at[0]} / "
                       f"{at[1]} | {sum(r['topup_elsewhere'] for r in a['seeds'])} |")
        out += ["", "  Identical runs in both orders (`.venv/bin/python results/sim/supplement/supplement.py`; "
                "results/sim/supplement/README.md)."]
    learning = learning_rule()
    if learning:
        out.append(learning)
    return "\n".join(out)


def learning_rule() -> str:
    """What learning without corrections costs on the toy, from the committed benchmarks."""
    off = load("results/bench/convergence-offpolicy/lr0.002/summary.json")
    gap = load("results/paper/k3-gap/summary.json")
    var = (load("results/paper/k3-gap/variants.json") or {}).get("variants", {})
    if not (off and gap and {"is_cap 1", "m2po", "lr 1e-3"} <= var.keys()):
        return ""
    plain = off["verdict"]["dora-k3 ppo_clip"]["gap_to_sync"]
    cap, m2po, lr = var["is_cap 1"], var["m2po"], var["lr 1e-3"]
    return ("* **Learning without corrections.** The paper trains k=1 and k=3 with plain PPO-clip. On the toy our K=3 "
            f"under `ppo_clip` ends {-plain:.3f} below sync (seeds 0-2); `decoupled`+`truncate` closes most of that, "
            f"not all: {gap['gap']:+.3f} over {len(gap['seeds'])} seeds, {abs(gap['gap']) / gap['gap_se']:.1f} "
            f"standard errors; a truncation cap of 1 instead of 2 leaves {cap['gap_to_own_sync']:+.3f} (seeds 3-8), "
            f"M2PO changes it by {m2po['minus_base_dora_k3']:+.3f} (se {m2po['minus_base_se']:.3f}), a learning "
            f"rate of 1e-3 closes the gap ({lr['gap_to_own_sync']:+.3f}) by learning less (sync "
            f"{lr['minus_base_sync']:+.3f}) (results/bench/convergence-offpolicy/, results/paper/k3-gap/).")


SECTIONS = {"Fig. 10 and §1: throughput, rollout-only time, step time, convergence":
            lambda: fig10_scale(64) + fig10_scale(128) + fig10_partial() + convergence_toy() + convergence_real(),
            "Fig. 13, §4.4, §4.5: the KV ablation, overheads, production scale":
            lambda: fig13_sim() + fig13_runtime() + overheads() + production(),
            "Appendix C and Fig. 3: Tables 1-3, Fig. 14, C.1, C.3 bubbles, the long tail":
            lambda: appendix_tables() + appendix_other()}


def report() -> tuple[str, dict]:
    sections = {title: rows() for title, rows in SECTIONS.items()}
    text = [INTRO]
    for title, rows in sections.items():
        text += [f"## {title}", "", table(rows), ""]
    text += [rules(), ""]
    summary = {title: [vars(r) for r in rows] for title, rows in sections.items()}
    return "\n".join(text), summary


def main(argv: list[str]) -> int:
    text, summary = report()
    readme, js = OUT / "README.md", OUT / "summary.json"
    js_text = json.dumps(summary, indent=1, ensure_ascii=False) + "\n"
    if "--check" in argv:
        stale = [p.name for p, t in ((readme, text), (js, js_text)) if not p.exists() or p.read_text() != t]
        if stale:
            print(f"results/paper/: {', '.join(stale)} out of date; run: .venv/bin/python tools/paper_report.py")
            return 1
        return 0
    readme.write_text(text)
    js.write_text(js_text)
    print(f"wrote {readme.relative_to(ROOT)} and {js.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
