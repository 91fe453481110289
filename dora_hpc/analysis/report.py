"""What ``dora-hpc analyze`` shows of its results: the rows of its table, and one self-contained HTML page
(the table, every figure inline as base64 PNG, the offenders of any broken invariant).

It only formats what analysis/basic.py computed; it reads nothing but the figures ``analyze`` drew.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from ..core.policy_base import TRAIN_WAITS


def summary_rows(results: list[dict]) -> list[tuple[str, list[str]]]:
    """(label, one value per run) for every figure of the table."""
    rows = [("train steps", "steps"), ("trajectories logged", "trajectories"), ("trajectories trained on", "consumed"),
            ("max staleness", lambda r: r["staleness"]["max"]),
            ("mean staleness", lambda r: f"{r['staleness']['mean']:.2f}"),
            ("migrations", "migrations"), ("re-prefilled tokens", "reprefill_tokens"),
            ("dropped groups", "dropped_groups"), ("filtered groups (equal rewards)", "filtered_groups"),
            ("reward errors", "reward_errors"),
            ("episode turns, mean / max", lambda r: f"{r['turns']['mean']:.2f} / {r['turns']['max']}"),
            ("environment time fraction (of episode time)", lambda r: f"{r['env_time_fraction']:.3f}"),
            ("environment errors: raised / timed out / worker died",
             lambda r: " / ".join(str(v) for v in r["env_errors_by_kind"].values())),
            ("episodes spanning versions (partial)", "multi_version_episodes"),
            ("fenced ranks (hung or dead; work started again elsewhere)",
             lambda r: ", ".join(_fence(f) for f in r["fenced"]) or "-"),
            ("replacements joined (rank at seconds)",
             lambda r: ", ".join(f"r{j['rank']} at {j['t']:.0f} s" for j in r["instances"]["joined"]) or "-"),
            ("fewest rollout instances live", lambda r: str(r["instances"]["fewest"])),
            ("max versions live at once", "max_live_versions"),
            ("slot utilization", lambda r: f"{r['slot_utilization']:.3f}"),
            ("bubble fraction (1 - slot utilization)", lambda r: f"{r['bubble_fraction']:.3f}"),
            ("inter-instance bubble (C.3)", lambda r: f"{r['inter_instance_bubble']:.3f}"),
            ("rollout-only fraction", lambda r: f"{r['rollout_only_fraction']:.3f}"),
            ("trainer waited for: capacity / tail / window",
             lambda r: " / ".join(f"{r['trainer_wait_fraction'][k]:.3f}" for k in TRAIN_WAITS)),
            ("trained tokens / s", lambda r: f"{r['throughput_tokens_per_s']:.1f}"),
            ("overheads, % of instance time", lambda r: ", ".join(f"{k} {100 * v:.2f}" for k, v in
                                                                 r["overheads"].items()) or "-"),
            ("reward first -> last step", lambda r: f"{r['reward_by_step'][0]:.3f} -> {r['reward_by_step'][-1]:.3f}"
             if r["reward_by_step"] else "-"),
            ("importance weight pi_prox/pi_behaviour, mean / max",
             lambda r: f"{r['is_weight']['mean']:.3f} / {r['is_weight']['max']:.2f}" if r["is_weight"]["mean"]
             is not None else "-"),
            ("entropy of sampled tokens, first -> last step",
             lambda r: f"{r['entropy']['first']:.3f} -> {r['entropy']['last']:.3f}" if r["entropy"]["first"]
             is not None else "-"),
            ("logprob gap rollout vs trainer, max (on-policy tokens)",
             lambda r: f"{r['logprob_gap']['max']:.2e} ({r['logprob_gap']['tokens']})"
             if r["logprob_gap"]["max"] is not None else "-")]
    rows += [(f"invariant: {k}", lambda r, k=k: r["invariants"][k])
             for k in results[0]["invariants"] if k != "offenders"]
    return [(label, [str(key(r) if callable(key) else r[key]) for r in results]) for label, key in rows]


STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}td:first-child,th:first-child{text-align:left}
img{max-width:100%;border:1px solid #eee;margin:.5em 0}.bad{color:#b00;font-weight:bold}"""


def write_html(path: Path, results: list[dict]) -> Path:
    """One page a person opens from a login node: nothing outside it is referenced."""
    head = "".join(f"<th>{html.escape(r['run_dir'])} ({html.escape(r['mode'])})</th>" for r in results)
    body = []
    for label, values in summary_rows(results):
        bad = label.startswith("invariant: ") and any(v != "0" for v in values)
        cells = "".join(f"<td>{html.escape(v)}</td>" for v in values)
        body.append(f"<tr{' class=bad' if bad else ''}><td>{html.escape(label)}</td>{cells}</tr>")
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>dora-hpc analyze</title><style>{STYLE}"
             f"</style></head><body><h1>dora-hpc analyze</h1><table><tr><th>figure</th>{head}</tr>{''.join(body)}"
             "</table>"]
    for r in results:
        parts.append(f"<h2>{html.escape(r['run_dir'])} ({html.escape(r['mode'])})</h2>")
        if r.get("missing"):
            parts.append(f"<p>partial logs, analysed without: {html.escape('; '.join(r['missing']))}</p>")
        for png in r.get("plots", []):
            data = base64.b64encode(Path(png).read_bytes()).decode()
            parts.append(f"<figure><img alt='{html.escape(Path(png).stem)}' src='data:image/png;base64,{data}'>"
                         f"<figcaption>{html.escape(Path(png).stem)}</figcaption></figure>")
        offenders = {k: v for k, v in r["invariants"].get("offenders", {}).items() if v}
        if offenders:
            parts.append("<h3>offenders</h3><pre>" + html.escape(json.dumps(offenders, indent=1)) + "</pre>")
    path.write_text("".join(parts) + "</body></html>\n")
    return path


def _fence(f: dict) -> str:
    """One fenced rank as the report names it: a rollout rank with the trajectories started again elsewhere,
    a trainer replica as such (its step was taken again by the replicas left)."""
    lost = "trainer replica" if f["role"] == "trainer" else f"{f['started_again']} trajectories"
    return f"r{f['rank']} ({f['cause']}, {lost})"
