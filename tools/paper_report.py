"""The paper, figure by figure (issue 33): results/paper/README.md from the committed summaries, without
re-running any measurement. Each row names the paper's figure, ours, where ours comes from, the command
that measured it and a verdict; the verdict is computed where the paper gives a number to compare
(within 10% of it: reproduced), and stated, with the reason, where it does not.

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
TABLES = "see results/paper/tables/README.md"
SOURCES = {"sim": "simulator", "toy": "CPU runtime, tiny model", "real": "CPU runtime, SmolLM2-135M",
           "none": "not measured"}


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
    verdict: str


def close_to(ours: float, paper: float, effect: bool = False) -> bool:
    """Within 10% of the paper's figure. With ``effect`` (a ratio whose point is how far it is from 1, as the
    ablation's 1.10x) the effect itself must be within 10%: ours - 1 against the paper's - 1."""
    return abs((ours - 1) / (paper - 1) - 1) <= 0.10 if effect else abs(ours / paper - 1) <= 0.10


def ratio_row(item: str, paper: float, ours: float | None, source: str, command: str, why: str = "",
              fmt: str = "{:.2f}x", effect: bool = False) -> Row:
    """A row whose verdict is computed (``close_to``): reproduced, or differs and why."""
    if ours is None:
        return Row(item, fmt.format(paper), "—", "none", command, "not yet measured")
    close = close_to(ours, paper, effect)
    return Row(item, fmt.format(paper), fmt.format(ours), source, command,
               "reproduced" if close else f"differs: {why}" if why else "differs")


def _mode(summary: dict | None, mode: str, key: str) -> float | None:
    return summary["modes"][mode][key] if summary else None


def _rollout_time(s: dict | None, mode: str) -> float | None:
    return _mode(s, mode, "rollout_only_fraction") * _mode(s, mode, "mean_step_time_s") if s else None


def fig10() -> list[Row]:
    rows: list[Row] = []
    why_partial = ("our partial rollout is fast (1.65x sync at 64) because our prefill model makes re-prefill "
                   "cheap: 3.6% of its wall time (results/sim/README.md, sensitivity: at 10% prefill MFU "
                   "DORA / partial is 1.15x)")
    pp = load("results/paper/partial-placement.json")
    if pp:
        d = pp["disaggregated"]
        why_partial += (f"; on DORA's own split partial rollout reaches {d['throughput_tokens_per_s']:,.0f} tokens/s, "
                        f"more than DORA: its re-prefill costs {d['overheads']['reprefill']:.1%} of its time, DORA's "
                        "trainer waits 11% for the window (results/paper/partial_placement.py)")
    why_128 = "at 128 our DORA is trainer-bound (99% of its limit): training scales perfectly in the simulator"
    for n, paper in ((64, dict(sync=1.65, partial=1.17, ro_sync=0.65, ro_dora=0.12, ro_x=8.2, step=1.56)),
                     (128, dict(sync=2.12, partial=1.11, ro_sync=0.73, ro_dora=0.24, ro_x=5.9, step=1.93))):
        s, cmd = load(f"results/sim/paper-{n}/summary.json"), SIM.format(f"paper-{n}")
        rows += [
            ratio_row(f"DORA / sync throughput, {n} GPUs", paper["sync"], s and s["dora_over_sync"], "sim", cmd),
            ratio_row(f"DORA / partial rollout throughput, {n} GPUs", paper["partial"], s and s["dora_over_partial"],
                      "sim", cmd, why_partial),
            ratio_row(f"sync rollout-only share of a step, {n} GPUs", paper["ro_sync"],
                      _mode(s, "sync", "rollout_only_fraction"), "sim", cmd, fmt="{:.0%}"),
            ratio_row(f"DORA rollout-only share of a step, {n} GPUs", paper["ro_dora"],
                      _mode(s, "dora", "rollout_only_fraction"), "sim", cmd,
                      why_128 if n == 128 else "", fmt="{:.0%}"),
            ratio_row(f"rollout-only time, sync / DORA, {n} GPUs", paper["ro_x"],
                      s and _rollout_time(s, "sync") / _rollout_time(s, "dora"), "sim", cmd,
                      "DORA's rollout-only time is a small difference of large numbers: "
                      + ("10% at 64 GPUs is 0.74 min against 7.5" if n == 64 else why_128), fmt="{:.1f}x"),
            ratio_row(f"end-to-end step time, sync / DORA, {n} GPUs", paper["step"],
                      s and _mode(s, "sync", "mean_step_time_s") / _mode(s, "dora", "mean_step_time_s"), "sim", cmd,
                      why_128 if n == 128 else ""),
        ]
    rows += convergence()
    return rows


def convergence() -> list[Row]:
    off = load("results/bench/convergence-offpolicy/lr0.002/summary.json")
    gap = load("results/paper/k3-gap/summary.json")
    cmd = ".venv/bin/dora-hpc bench convergence configs/bench-convergence.yaml --losses ppo_clip,decoupled+truncate"
    rows = []
    if off:
        v, spread = off["verdict"], off["sync_seed_spread"]
        for k in (1, 3):
            plain, fixed = v[f"dora-k{k} ppo_clip"]["gap_to_sync"], v[f"dora-k{k} decoupled+truncate"]["gap_to_sync"]
            rows.append(Row(f"convergence: DORA K={k} tracks sync (final reward, toy, lr 2e-3, seeds 0-2)",
                            "tracks sync, plain PPO-clip", f"ppo_clip {plain:+.3f}, decoupled+truncate {fixed:+.3f} "
                            f"(sync spread {spread:.3f})", "toy", cmd + " --seeds 0,1,2 --set train.lr=0.002",
                            "reproduced with the correction" if abs(fixed) <= spread and abs(plain) > spread
                            else "reproduced" if abs(plain) <= spread else "differs"))
    if gap:
        rows.append(Row(f"convergence: DORA K=3 with decoupled+truncate, final reward, {len(gap['seeds'])} seeds "
                        "(0-8), toy, lr 2e-3", "tracks sync", f"{gap['dora_k3_mean']:.3f} vs sync "
                        f"{gap['sync_mean']:.3f}: {gap['gap']:+.3f} (se {gap['gap_se']:.3f}; sync sd "
                        f"{gap['sync_sd']:.3f})", "toy", gap["command"],
                        "reproduced" if abs(gap["gap"]) <= 2 * gap["gap_se"] else
                        f"differs: K=3 costs {-gap['gap']:.3f} of final reward here, "
                        f"{abs(gap['gap']) / gap['gap_se']:.1f} standard errors (results/paper/k3-gap/README.md)"))
    cap = (load("results/paper/k3-gap/variants.json") or {}).get("variants", {}).get("is_cap 1")
    if cap:
        rows.append(Row("convergence: DORA K=3 with decoupled+truncate at is_cap 1 (the setting for K >= 2), final "
                        "reward, 6 seeds (3-8), toy, lr 2e-3", "tracks sync", f"{cap['dora_k3_mean']:.3f} vs its sync "
                        f"{cap['sync_mean']:.3f}: {cap['gap_to_own_sync']:+.3f} (se {cap['gap_se']:.3f}); "
                        f"{cap['minus_base_dora_k3']:+.3f} over is_cap 2", "toy",
                        "see results/paper/k3-gap/variants.py",
                        "reproduced" if abs(cap["gap_to_own_sync"]) <= 2 * cap["gap_se"] else
                        f"differs: the cap halves K=3's cost, {-cap['gap_to_own_sync']:.3f} of final reward is left "
                        f"({abs(cap['gap_to_own_sync']) / cap['gap_se']:.1f} standard errors)"))
    real = load("results/bench/convergence-smollm2/combined.json")
    if real:
        sync, dora = real["sync"], real["dora-k2"]
        gap = dora["heldout_mean"] - sync["heldout_mean"]
        rows.append(Row("convergence on a real model: DORA K=2 vs sync, held-out greedy reward after 30 steps "
                        "(SmolLM2, addition, decoupled+truncate, 4 seeds)", "tracks sync",
                        f"{dora['heldout_mean']:.3f} vs {sync['heldout_mean']:.3f} ({gap:+.3f}; sync sd "
                        f"{sync['heldout_sd']:.3f})", "real", "see results/bench/convergence-smollm2/README.md",
                        "reproduced" if abs(gap) <= sync["heldout_sd"] else "differs"))
    return rows + smollm2_ppo_clip()


PPO_CLIP = "results/bench/convergence-smollm2-ppo_clip"


def ppo_clip_heldout() -> dict[str, list[float]] | None:
    """Held-out greedy reward by seed of each case of the SmolLM2 plain-PPO-clip benchmark."""
    s = load(f"{PPO_CLIP}/summary.json")
    return s and {c: list(v["heldout_final_by_seed"].values()) for c, v in s["cases"].items()}


def smollm2_ppo_clip() -> list[Row]:
    """The paper's claim as it states it: DORA at k=1 and k=3 under plain PPO-clip (no correction) tracks
    sync; on SmolLM2, held out, where "tracks" is not below sync's mean by more than sync's seed sd."""
    s, held = load(f"{PPO_CLIP}/summary.json"), ppo_clip_heldout()
    ref = load("results/bench/convergence-smollm2/combined.json")
    cmd = (".venv/bin/dora-hpc bench convergence configs/smollm2-addition.yaml --cases sync,dora-k1,dora-k3 "
           "--losses ppo_clip --seeds 0,1,2 --eval 200")
    rows = []
    for k in (1, 3):
        item = (f"convergence on a real model: DORA K={k} vs sync under plain ppo_clip, held-out greedy reward "
                "after 30 steps (SmolLM2, addition, 3 seeds)")
        if held is None:
            rows.append(Row(item, "tracks sync", "not yet measured", "real", cmd, "not yet measured"))
            continue
        sync, dora = statistics.fmean(held["sync"]), statistics.fmean(held[f"dora-k{k}"])
        sd, gap = statistics.stdev(held["sync"]), dora - sync
        train = s["verdict"][f"dora-k{k}"]["gap_to_sync"]
        above = (f"; above a weak sync: sync under ppo_clip ended at {sync:.3f}, under decoupled+truncate at "
                 f"{ref['sync']['heldout_mean']:.3f} (4 seeds)" if ref and gap > sd else "")
        rows.append(Row(item, "tracks sync", f"{dora:.3f} vs {sync:.3f} ({gap:+.3f}; sync sd {sd:.3f}); training "
                        f"reward, last 5 steps {train:+.3f} (sync spread {s['sync_seed_spread']:.3f})", "real", cmd,
                        f"reproduced{above}" if gap >= -sd else f"differs: {gap:+.3f} held out, {-gap / sd:.1f} "
                        f"of sync's seed sd ({PPO_CLIP}/README.md)"))
    return rows


def smollm2_ablation() -> list[Row]:
    """Fig. 13's ablation on the real model with ~650-token migrated contexts: its step-interval ratio with
    the per-repeat values (the spread), and what the repeats migrated."""
    item = "KV-reuse ablation: step interval re-prefill / KV (SmolLM2, ~650-token contexts)"
    a = load(f"{SMOLLM2_ABLATION}/summary.json")
    if a is None:
        return [ratio_row(item, 183 / 166, None, "real", ABLATION_SMOLLM2, fmt="{:.3f}x")]
    kv, re_ = a["variants"]["kv-migration"], a["variants"]["reprefill"]
    by_repeat = [1 / r for r in a["ratios_by_repeat"]["kv-migration/reprefill mean_step_time_s"]]
    ours = statistics.median(by_repeat)
    saved = 1 - a["ratios"]["kv-migration/reprefill engine_s_per_trained_token"]
    row = ratio_row(item, 183 / 166, ours, "real", ABLATION_SMOLLM2, effect=True, fmt="{:.3f}x")
    row.ours = f"{ours:.3f}x (repeats {', '.join(f'{r:.3f}' for r in by_repeat)})"
    if row.verdict.startswith("differs"):
        migs = [r["migrations"] for v in (kv, re_) for r in v["runs"]]
        kv_re = max(r["reprefill_tokens"] for r in kv["runs"])
        noise = max(max(x) / min(x) - 1 for v in (kv, re_) if (x := [r["mean_step_time_s"] for r in v["runs"]]))
        row.verdict = (f"differs: the same direction, smaller: {min(migs)}-{max(migs)} migrations a run, each "
                       f"re-prefilling ~{re_['reprefill_tokens'] / re_['migrations']:,.0f} tokens without KV "
                       f"({re_['reprefill_tokens']:,.0f} a run; {kv_re:,.0f} with KV), a small share of rollout here: "
                       f"the interval is {ours - 1:.1%} longer without KV (one variant's runs differ by up to "
                       f"{noise:.1%}) and KV saves {saved:.1%} of engine-seconds per trained token; the paper's "
                       f"contexts are thousands of tokens ({a['repeats']} interleaved repeats; "
                       f"{SMOLLM2_ABLATION}/README.md)")
    return [row]


def fig13() -> list[Row]:
    a = load("results/bench/ablation/summary.json")
    rows = []
    if a:
        kv, re_ = a["variants"]["kv-migration"], a["variants"]["reprefill"]
        rows.append(ratio_row("KV-reuse ablation: step interval re-prefill / KV (toy, ~35-token contexts)", 183 / 166,
                              re_["mean_step_time_s"] / kv["mean_step_time_s"], "toy", ABLATION,
                              "a migrated request carries ~35 tokens: re-prefill costs nothing to save", effect=True))
    lc = load("results/bench/ablation-long-context/summary.json")
    if lc:
        kv, re_ = lc["variants"]["kv-migration"], lc["variants"]["reprefill"]
        rows.append(ratio_row("KV-reuse ablation: step interval re-prefill / KV (toy, ~500-token contexts, "
                              "5x slower pacing)", 183 / 166, re_["mean_step_time_s"] / kv["mean_step_time_s"], "toy",
                              ABLATION_LONG, "KV saves rollout time (engine-seconds per trained token "
                              f"{lc['ratios']['kv-migration/reprefill engine_s_per_trained_token'] - 1:+.1%}, "
                              f"{re_['reprefill_tokens']:,.0f} re-prefilled tokens -> 0), but the trainer's real "
                              "CPU step is most of the interval and hides it", effect=True))
    sk = load("results/sim/kv-ablation/summary.json")
    if sk:
        r64, r128 = (sk["scenarios"][n]["step_time_ratio_reprefill_over_kv"] for n in ("paper-64", "paper-128"))
        rows.append(ratio_row("KV-reuse ablation: step time re-prefill / KV, paper-64 ("
                              "median of 3 seeds)", 183 / 166, r64, "sim", ".venv/bin/python "
                              "results/sim/kv-ablation/kv_ablation.py", f"the same direction ({r128:.3f}x at 128), a "
                              "tenth of the margin: our re-prefill is compute-bound at 50% MFU, ~1% of instance "
                              "time", fmt="{:.3f}x", effect=True))
    rows += smollm2_ablation()
    s64, s128 = load("results/sim/paper-64/summary.json"), load("results/sim/paper-128/summary.json")
    if s64 and s128:
        o64, o128 = s64["modes"]["dora"]["overheads"], s128["modes"]["dora"]["overheads"]
        rows.append(Row("overheads, 64 / 128 GPUs: load balancing (weights)", "0.4% / 1.5%",
                        f"{o64['weight_sync']:.1%} / {o128['weight_sync']:.1%}", "sim", SIM.format("paper-64"),
                        "differs: lower; our planner and weight loads are modelled, P2P at full bandwidth"))
        rows.append(Row("overheads, 64 / 128 GPUs: request transfer (KV migration)", "3.6% / 2.1%",
                        f"{o64['migration']:.1%} / {o128['migration']:.1%}", "sim", SIM.format("paper-64"),
                        "differs: lower, same trend (falls at scale)"))
        rows.append(Row("overheads, 64 / 128 GPUs: free-cache (offload)", "< 0.03%",
                        f"{o64['offload']:.2%} / {o128['offload']:.2%}", "sim", SIM.format("paper-64"),
                        "differs: higher; our offload moves KV to host under pressure, the paper's frees it"))
    rows += production()
    return rows


def production() -> list[Row]:
    """§4.5: LongCat-Flash on 4,096 accelerators; the simulator's hardware, batch and split are assumptions."""
    p, ks = load("results/sim/production-4096/summary.json"), load("results/sim/production-4096/ksweep.json")
    rows = []
    for workload, paper in (("reasoning", 3.6), ("agentic", 6.2)):
        item = f"production scale: rollout speed-up over sync, ~500B MoE, 4,096 accelerators, {workload}"
        config = "production-4096" + ("-agentic" if workload == "agentic" else "")
        command = (f".venv/bin/dora-hpc simulate configs/sim/{config}.yaml --modes sync,dora --out out/{config}"
                   "; 3 seeds: results/sim/production-4096/production.py")
        if not p:
            rows.append(ratio_row(item, paper, None, "sim", command))
            continue
        dora, elastic = (p[workload][c]["median"]["rollout_speedup"] for c in ("dora", "dora elastic"))
        wait = statistics.median(r["trainer_wait_fraction"]["window"] for r in p[workload]["dora"]["seeds"])
        at_k = ", ".join(f"K={k}: {r['rollout_speedup']:.2f}x" for k, r in (ks or {}).get(workload, {}).items())
        bound = (f"tail-bound: DORA's trainer waits {wait:.0%} of the time for the window's oldest groups, so a "
                 f"step lasts at least the longest trajectory / (K + 1) and the speed-up stays under K + 1"
                 + (f" ({at_k}, seed 0)" if at_k else ""))
        verdict = (f"agrees, under an assumed batch, split and hardware (the paper gives none): not a reproduction; "
                   f"{bound}" if close_to(dora, paper) else f"differs: {bound}; the paper's production K is not stated")
        rows.append(Row(item + " (median of 3 seeds; cluster.elastic in brackets)", f"{paper:.1f}x",
                        f"{dora:.2f}x ({elastic:.2f}x)", "sim", command, verdict))
    return rows


def appendix_c() -> list[Row]:
    t = load("results/paper/tables/summary.json")
    s64, s128 = load("results/sim/paper-64/summary.json"), load("results/sim/paper-128/summary.json")
    rows = []
    if t:
        tables = (("Table 1", "pass rate by staleness within difficulty bins (DORA K=3)", "gap < 0.6 pt", "table1"),
                  ("Table 2", "per-response staleness, partial rollout", "gap <= 0.33 pt", "table2"),
                  ("Table 3", "reward variance by difficulty", "highest in the middle bins (~1.0)", "table3"),
                  ("Fig. 14b", "median response length, staleness 1 / 0", "1,495 / 1,015 (+47%)", "fig14b"))
        rows += [Row(f"{n}: {what}", paper, t[key]["ours"], "real", TABLES, t[key]["verdict"])
                 for n, what, paper, key in tables]
        paced = t.get("rollout_bound", {})  # the DORA run's tables again, rollout-bound (no partial run: no Table 2)
        rows += [Row(f"{n}, rollout-bound (paced decode)", paper, paced[key]["ours"], "real", TABLES,
                     paced[key]["verdict"]) for n, _, paper, key in tables if key in paced]
    else:
        rows.append(Row("Tables 1-3, Fig. 14b", "see the paper", "—", "none", TABLES, "not yet measured"))
    if s64 and s128:
        b = [s["modes"]["sync"][k] for s in (s64, s128) for k in ("bubble_fraction", "inter_instance_bubble")]
        rows.append(Row("C.3: sync long-tail bubble, 64 / 128 GPUs, (max_i L_i - L_i) / max_i L_i", "75-89%",
                        f"{b[0]:.0%} / {b[2]:.0%} over decode slots; {b[1]:.0%} / {b[3]:.0%} over instances", "sim",
                        SIM.format("paper-64"), ("reproduced" if 0.75 <= b[0] <= 0.89 and 0.75 <= b[2] <= 0.89 else
                        f"reproduced at 64; {b[2]:.0%} at 128 is above the paper's range") + " over decode slots "
                        "(the paper does not define L_i further); over whole instances it is smaller: each holds "
                        "stragglers"))
    return rows


def table(rows: list[Row]) -> str:
    out = ["| figure | paper | ours | from | command | verdict |", "|---|---|---|---|---|---|"]
    cells = [[r.item, r.paper, r.ours, SOURCES[r.source], f"`{r.command}`", r.verdict] for r in rows]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in cells]
    return "\n".join(out)


INTRO = """# The paper, figure by figure

Every evaluation figure and table of DORA (arXiv 2604.26256, §4 and Appendix C) against what dora_hpc
measures. Ours come from three places: the simulator (`dora-hpc simulate`, the same `core/` policies at
the paper's scale, simulated time), the CPU runtime with the tiny model (real processes, paced engine) and
the CPU runtime with SmolLM2-135M (a real model). Nothing was tuned toward the paper's numbers. A verdict
is computed where the paper gives a number: within 10% of it is *reproduced*.

Every DORA figure below was measured under `dora.admission: eager` (the window fills: staleness at K), the
default. `dora.admission: lean` holds the pipeline shallower (docs/invariants.md, 2); results/sim/staleness/
and results/bench/staleness/ compare the two, and the report at lean's operating point is issue 46's.

This file is written by `tools/paper_report.py` from the committed summaries (the measurements
themselves take hours; each row's command re-runs one):

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
    out += ["* **Learning without corrections.** The paper trains k=1 and k=3 with plain PPO-clip. On the toy "
            "our K=3 under `ppo_clip` ends 0.106 below sync (seeds 0-2); `decoupled`+`truncate` closes most of "
            "that, not all: -0.069 over 9 seeds, 3.3 standard errors; a truncation cap of 1 instead of 2 halves "
            "what is left (-0.048 on seeds 3-8), M2PO does not help, a lower learning rate learns less (the Fig. 10 "
            "convergence rows; results/bench/convergence-offpolicy/, results/paper/k3-gap/)."]
    held, ref = ppo_clip_heldout(), load("results/bench/convergence-smollm2/combined.json")
    if held and ref:
        m = {c: statistics.fmean(v) for c, v in held.items()}
        out[-1] += (f" On SmolLM2 the claim holds at K=1 and K=3: under plain `ppo_clip` DORA ends at "
                    f"{m['dora-k1']:.3f} and {m['dora-k3']:.3f} held out ({len(held['sync'])} seeds), not below sync, "
                    f"whose own `ppo_clip` runs ended low ({m['sync']:.3f}; {ref['sync']['heldout_mean']:.3f} under "
                    f"decoupled+truncate; {PPO_CLIP}/).")
    return "\n".join(out)


def report() -> tuple[str, dict]:
    sections = {"Fig. 10: throughput, rollout-only time, step time, convergence": fig10(),
                "Fig. 13: the KV ablation, overheads, production scale": fig13(),
                "Appendix C: Tables 1-3, Fig. 14b, C.3 bubbles": appendix_c()}
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
