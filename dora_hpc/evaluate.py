"""``dora-hpc eval``: score a model folder, or a run's checkpoint, on held-out prompts of a task.

    dora-hpc eval runs/smollm2 --step 20 --n 200 --json after.json     # a run's checkpoint, its own task
    dora-hpc eval runs/smollm2 --step 0 --json before.json             # the model the run started from
    dora-hpc eval smollm2 --config configs/smollm2-addition.yaml       # a model folder (or tiny/smollm2)

Invariants:
* held out: eval prompts come from the task built with seed ``run seed + EVAL_SEED_OFFSET`` (a jsonl
  task reads ``task.eval_path``); a prompt that is also one of the training task's first
  ``train_prompts`` prompts (every reasoning-gym item and every jsonl row the run can draw) is skipped
  and counted, so no eval prompt is a training prompt; each eval prompt is scored once (a small task
  space may hold fewer than ``--n``);
* generation uses the built-in engine: greedy decoding (temperature 0) is deterministic, sampled
  decoding's noise depends only on (eval seed, request, position), so an eval is reproducible;
* the scores are the task's own reward (the reward shaping of ``reward.*`` is left out), and
  ``pass@1`` is the share of responses scoring 1 (a fully correct answer);
* with ``env.name`` set each prompt is a multi-turn episode, run as the rollout ranks run it
  (runtime/episodes.py: its environment's steps in worker processes, its KV kept between turns); its score is
  its environment's summed reward, and ``pass@1`` the share scoring 1 (retry: right at the first attempt).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from .config import ConfigError, RunConfig, load_config, parse_overrides, validate, with_overrides
from .errors import fail

EVAL_SEED_OFFSET = 1_000_003


class EvalError(ValueError):
    """A bad target, step or task: the CLI prints it on one line and exits 2."""


@dataclass
class Target:
    cfg: RunConfig
    model_dir: Path
    weights: dict | None   # a checkpoint's weights over the model folder's (None: the folder's own)
    step: int | None       # the run's version these weights are (None: a model folder)
    label: str
    adapter: dict | None = None  # under train.lora: the checkpoint's adapter (``weights`` is it merged)


def resolve(target: str, step: int | None, config: str | None, overrides: list[str]) -> Target:
    """A run directory (its launch.json: config and model; ``step``: a checkpoint, 0 the initial model,
    default the newest that verifies) or a model folder / 'tiny' / 'smollm2' with ``config``'s task."""
    from .launch.local import resolve_model
    from .store import checkpoint

    path = Path(target)
    if (path / "launch.json").is_file():
        meta = json.loads((path / "launch.json").read_text())
        if config:
            raise EvalError(f"--config: {target} is a run directory; its own config is used (change keys with --set)")
        cfg = with_overrides(validate(meta["config"], saved=True), dict(parse_overrides(overrides)))
        model_dir = Path(meta["model_dir"])
        if not (model_dir / "config.json").is_file():
            raise EvalError(f"{target}: its model folder {model_dir} is gone (launch.json names it)")
        if step == 0 and not (path / "checkpoints" / "step-0").is_dir():
            return Target(cfg, model_dir, None, 0, f"{target} step 0 (the initial model)")
        root = path / "checkpoints"
        if step is not None and not (root / f"step-{step}").is_dir():
            have = sorted(int(p.name.removeprefix("step-")) for p in root.glob("step-*")
                          if p.name.removeprefix("step-").isdigit()) if root.is_dir() else []
            raise EvalError(f"{target}: no checkpoint step-{step} (checkpoints: {have or 'none'}; step 0 is the "
                            "initial model)")
        try:
            ckpt = checkpoint.latest(path) if step is None else checkpoint.load(root / f"step-{step}")
        except checkpoint.CheckpointError as e:
            raise EvalError(str(e)) from None
        if ckpt is None:
            raise EvalError(f"{target}: no checkpoint yet (give --step 0 for the initial model)")
        label = f"{target} step {ckpt.step}"
        return policy_target(cfg, model_dir, ckpt.weights(), ckpt.step, label)
    if step is not None:
        raise EvalError(f"--step {step}: {target} is a model folder, not a run directory (no launch.json)")
    cfg = load_config(config, [*overrides, f"model.path={target}"])
    if target not in ("tiny", "smollm2") and not (path / "config.json").is_file():
        raise EvalError(f"{target}: neither a run directory (launch.json) nor a model folder (config.json)")
    return Target(cfg, resolve_model(cfg), None, None, target)


def policy_target(cfg: RunConfig, model_dir: Path, weights: dict, step: int, label: str) -> Target:
    """A checkpoint's policy: its weights, or under ``train.lora`` its adapter merged into the model folder's."""
    from .train.lora import LoraError, LoraSpec, is_adapter, merged_model

    spec = LoraSpec.of(cfg)
    if spec is None and not is_adapter(weights):
        return Target(cfg, model_dir, weights, step, label)
    if spec is None:
        raise EvalError(f"{label}: the checkpoint is a LoRA adapter but the run's config has no train.lora")
    try:
        merged = merged_model(model_dir, spec, weights).state_dict()
    except LoraError as e:
        raise EvalError(f"{label}: {e}") from None
    return Target(cfg, model_dir, merged, step, label, adapter=weights)


def heldout(cfg: RunConfig, model_dir: Path, vocab: int, n: int, train_prompts: int):
    """(eval task, [(eval group id, prompt ids)] of ``n`` held-out prompts, training prompts skipped)."""
    from .data.tasks import make_task

    if cfg.task.name == "jsonl":
        if not cfg.task.eval_path:
            raise EvalError("task.eval_path: a jsonl task is evaluated on a held-out file "
                            "(--set task.eval_path=heldout.jsonl)")
        eval_cfg = cfg.model_copy(update={"task": cfg.task.model_copy(update={"path": cfg.task.eval_path})})
    else:  # a reasoning-gym pool large enough to find n prompts outside the training items
        eval_cfg = cfg.model_copy(update={"seed": cfg.seed + EVAL_SEED_OFFSET, "task": cfg.task.model_copy(
            update={"size": max(cfg.task.size, 20 * n)})})
    try:  # a task that cannot be built (a missing file, a bad generator setting) says why in one line
        train = make_task(cfg, vocab, model_dir) if cfg.task.name != "jsonl" or cfg.task.path else None
        task = make_task(eval_cfg, vocab, model_dir)
    except ValueError as e:
        raise EvalError(str(e)) from None
    limit = min(_pool_size(train) or train_prompts, train_prompts) if train is not None else 0
    seen = {tuple(train.prompt(g)) for g in range(limit)}
    out, skipped, g, drawn = [], 0, 0, set()
    size = _pool_size(task)
    while len(out) < n and (size is None or g < size):
        p = tuple(task.prompt(g))
        if p in seen:
            skipped += 1
        elif p not in drawn:  # each held-out prompt once
            drawn.add(p)
            out.append((g, list(p)))
        g += 1
    if not out:
        raise EvalError(f"task {cfg.task.name}: every eval prompt is also a training prompt")
    return task, out, skipped


def _pool_size(task) -> int | None:
    """How many prompts a task cycles over (a reasoning-gym dataset's items, a jsonl file's rows); None for
    a generated stream (even_tokens)."""
    pool = getattr(task, "ds", None) or getattr(task, "rows", None)
    return len(pool) if pool is not None else None


def generate(engine, task, prompts, temperature: float, top_p: float, samples: int, seed_base: int, on_done):
    """Responses to every prompt (``samples`` each): {(group id, sample): output token ids}."""
    from .engine.sampling import SamplingParams

    out = {}
    for i, (_g, p) in enumerate(prompts):
        for s in range(samples):
            req = seed_base + i * samples + s
            engine.add(req, p, SamplingParams(temperature=temperature, top_p=top_p, max_tokens=task.max_tokens(req),
                                              ignore_eos=task.ignore_eos), engine.version)
    keys = {seed_base + i * samples + s: (g, s) for i, (g, _) in enumerate(prompts) for s in range(samples)}
    while engine.has_work():
        for f in engine.step():
            out[keys[f.req_id]] = f.response
            on_done()
    return out


class _EvalEpisodes:
    """What runtime/episodes.py drives on a rollout rank, for eval: the engine, the task, the requests' info;
    a finished episode is kept as (reward, turns, environment error, tokens after the prompt)."""

    def __init__(self, cfg: RunConfig, engine, task, model_dir: Path) -> None:
        from .runtime.episodes import make_episodes

        self.cfg, self.engine, self.task, self.info, self.done = cfg, engine, task, {}, {}
        self.episodes = make_episodes(self, model_dir)

    def finish(self, f, kv_frac: float) -> None:
        info = self.info.pop(f.req_id)
        reward = 0.0 if info["env_error"] else sum(info["env_rewards"])
        self.done[f.req_id] = (reward, info["turns"], info["env_error"], len(f.response))

    def generate(self, prompts, temperature: float, top_p: float, samples: int, seed_base: int, on_done) -> dict:
        """{(group id, sample): (reward, turns, error, length)} of one episode per prompt and sample."""
        from .engine.sampling import SamplingParams

        keys = {}
        for i, (g, p) in enumerate(prompts):
            for s in range(samples):
                req = seed_base + i * samples + s
                budget = max(1, min(self.task.max_tokens(req), self.cfg.env.max_episode_tokens - len(p)))
                self.info[req] = {}
                self.episodes.begin(req, p, SamplingParams(temperature=temperature, top_p=top_p, max_tokens=budget,
                                                           ignore_eos=self.task.ignore_eos), self.engine.version,
                                    self.info[req], g)
                keys[req] = (g, s)
        reported = 0
        while self.info:
            self.episodes.poll()
            if self.engine.has_work():
                for f in self.engine.step():
                    self.episodes.turn_ended(f, self.info[f.req_id])
            else:
                time.sleep(0.002)  # every episode waits on its environment
            for _ in range(len(self.done) - reported):
                on_done()
            reported = len(self.done)
        out = {keys[r]: d for r, d in self.done.items() if r in keys}
        self.done.clear()
        return out

    def close(self) -> None:
        self.episodes.close()


def score_episodes(outputs: dict) -> dict:
    rewards = [r for r, *_ in outputs.values()]
    return {"mean_reward": statistics.fmean(rewards), "pass_at_1": sum(r >= 1.0 for r in rewards) / len(rewards),
            "turns": {"mean": statistics.fmean(t for _, t, _, _ in outputs.values()),
                      "max": max(t for _, t, _, _ in outputs.values())},
            "response_len": {"mean": statistics.fmean(n for *_, n in outputs.values()),
                             "max": max(n for *_, n in outputs.values())},
            "env_errors": sum(bool(e) for _, _, e, _ in outputs.values()), "responses": len(rewards)}


def score(task, outputs: dict) -> dict:
    rewards, lengths, errors = [], [], 0
    for (g, _s), output in sorted(outputs.items()):
        r, err = task.safe_reward(g, output)
        rewards.append(r)
        lengths.append(len(output))
        errors += bool(err)
    return {"mean_reward": statistics.fmean(rewards), "pass_at_1": sum(r >= 1.0 for r in rewards) / len(rewards),
            "response_len": {"mean": statistics.fmean(lengths), "max": max(lengths)}, "reward_errors": errors,
            "responses": len(rewards)}


def evaluate(target: Target, n: int = 200, samples: int = 4, train_prompts: int = 10_000, console=None) -> dict:
    """Greedy and sampled scores of ``target`` on ``n`` held-out prompts of its task."""
    from rich.progress import Progress

    from .engine.engine import Engine
    from .engine.spec import read_spec

    cfg = target.cfg
    vocab = read_spec(target.model_dir).vocab_size
    task, prompts, skipped = heldout(cfg, target.model_dir, vocab, n, train_prompts)
    seed = cfg.seed + EVAL_SEED_OFFSET
    e = cfg.engine
    engine = Engine(target.model_dir, kv_blocks=e.kv_blocks, block_size=e.block_size,
                    max_num_seqs=cfg.cluster.max_num_seqs, max_batched_tokens=e.max_batched_tokens, seed=seed)
    if target.weights is not None:
        engine.load_weights(target.weights, version=target.step or 0)
    t0 = time.perf_counter()
    temp = cfg.sampling.temperature or 1.0
    episodes = _EvalEpisodes(task.cfg, engine, task, target.model_dir) if cfg.env.multi_turn else None

    def run(*args) -> dict:
        return episodes.generate(*args) if episodes else generate(engine, task, *args)

    def scored(outputs: dict) -> dict:
        return score_episodes(outputs) if episodes else score(task, outputs)

    try:
        with Progress(console=console, transient=True) as bar:
            job = bar.add_task(f"eval {target.label}", total=len(prompts) * (1 + samples))
            greedy = run(prompts, 0.0, 1.0, 1, 0, lambda: bar.advance(job))
            sampled = run(prompts, temp, cfg.sampling.top_p, samples, 10**9,
                          lambda: bar.advance(job)) if samples else {}
    finally:
        if episodes:
            episodes.close()
    out = {"target": target.label, "step": target.step, "model_dir": str(target.model_dir),
           "task": cfg.task.model_dump(), "env": cfg.env.model_dump(), "eval_seed": seed, "n": len(prompts),
           "skipped_training_prompts": skipped, "greedy": scored(greedy), "seconds": None}
    if samples:
        out["sampled"] = {"samples_per_prompt": samples, "temperature": temp, **scored(sampled)}
    out["seconds"] = time.perf_counter() - t0
    return out


def cmd_eval(args, console) -> int:

    from . import quiet_hf

    quiet_hf()
    try:
        target = resolve(args.target, args.step, args.config, args.overrides + (
            [f"task.name={args.task}"] if args.task else []))
        result = evaluate(target, n=args.n, samples=args.samples, console=console)
    except (EvalError, ConfigError) as e:
        return fail("eval", e)
    g, s = result["greedy"], result.get("sampled")
    line = (f"{result['target']}: {result['n']} held-out prompts of {result['task']['name']}; greedy mean reward "
            f"{g['mean_reward']:.3f}, pass@1 {g['pass_at_1']:.3f}, length {g['response_len']['mean']:.1f}")
    if s:
        line += (f"; sampled (T={s['temperature']}, {s['samples_per_prompt']}/prompt) mean reward "
                 f"{s['mean_reward']:.3f}, pass@1 {s['pass_at_1']:.3f}")
    console.print(line + f" ({result['seconds']:.0f} s)", soft_wrap=True, highlight=False, markup=False)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def add_parser(sub) -> None:
    ev = sub.add_parser("eval", help="score a model or a run's checkpoint on held-out prompts of its task")
    ev.add_argument("target", help="a run directory, a model folder, 'tiny' or 'smollm2'")
    ev.add_argument("--step", type=int, default=None, help="run dir: the checkpoint (0: the initial model; "
                    "default: the newest that verifies)")
    ev.add_argument("--config", default=None, help="model folder: the config whose task and sampling to use")
    ev.add_argument("--task", default=None, help="shorthand for --set task.name=TASK")
    ev.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ev.add_argument("--n", type=int, default=200, help="held-out prompts")
    ev.add_argument("--samples", type=int, default=4, help="sampled responses per prompt (0: greedy only)")
    ev.add_argument("--json", default=None, help="write the scores as JSON")
    ev.set_defaults(func=cmd_eval)
