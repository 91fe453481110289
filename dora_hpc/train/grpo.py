"""GRPO: group-relative advantages and the PPO-clip objective against each trajectory's own
behaviour logprobs (the version it was sampled under), on a causal LM held by a trainer backend
(backend.py: replicated torch, FSDP2 or megatron-core; the objective is the same code for all three).

Invariants:
* advantages are computed within a GRPO group only (all samples of one prompt, one version), one per
  sample: a multi-turn episode's reward is its environment's rewards summed;
* the loss covers the model's tokens only: a multi-turn episode's environment tokens (``env_spans``) are
  context, masked out of the loss and every statistic, their logprobs unused;
* the importance ratio of a token is pi_theta(token) / pi_behaviour(token) with the behaviour
  logprob recorded at sampling time -- a well-defined single-policy ratio because a trajectory is
  generated under one version (DORA); losses.py corrects for the weights moving since (staleness);
* ``train_step`` computes a real gradient and takes ``mini_batches`` optimizer steps (default one, the
  proximal policy is the weights at the step's start throughout); ``state_dict`` returns
  Hugging Face parameter names, ready for ``Engine.load_weights``;
* ``logprob_gap`` measures the rollout engine against the trainer: the mean |log pi_theta - log
  pi_behaviour| over the tokens of samples generated under the weights the trainer holds when the step
  starts (``Trajectory.version == step``), i.e. the same policy computed twice; it is float noise (~1e-6 in
  float32) unless the engine samples from other weights than it was sent;
* data parallel: each replica gets whole groups, normalises its loss by the global token (or sample)
  count and the gradients are summed over replicas, so R replicas take the same step as one rank
  on the union of their samples (up to float summation order), whichever backend holds the weights.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from ..core.trajectory import Trajectory
from .backend import BackendName, BackendOptions, build_backend
from .dp import DataParallel, StepAborted
from .lora import LoraSpec
from .losses import LossConfig, aggregate, k3, policy_loss

# what a train step sums over its tokens (every replica's), in this order
SUMS = ("loss", "kl", "ratio", "entropy", "clip_band", "clip_low", "clip_high", "dual_clip", "is_weight",
        "is_truncated", "is_masked", "gap_sum", "gap_tokens")


@dataclass(frozen=True)
class GRPOConfig:
    lr: float = 1e-5
    kl_coef: float = 0.0             # > 0: k3 KL penalty to the initial (reference) weights
    kl_clamp: float | None = 10.0    # the k3 value is clamped to [-kl_clamp, kl_clamp] (None: not)
    # token: DAPO's token-level mean; sequence: GRPO's mean of per-sample means; constant: Dr. GRPO's sum
    # over tokens / (max_len * samples)
    loss_agg: Literal["token", "sequence", "constant"] = "token"
    max_len: int = 256               # loss_agg=constant: the response budget
    adv_std_norm: bool = True        # False: Dr. GRPO's advantages (reward - group mean)
    temperature: float = 1.0         # must equal the sampling temperature
    max_grad_norm: float = 1.0
    micro_batch: int = 8
    mini_batches: int = 1            # optimizer steps per train batch (whole groups each)
    weight_decay: float = 0.0
    loss: LossConfig = LossConfig()  # the policy loss, its clip band (0.2 / 0.28) and correction (losses.py)
    shared_prompt: bool = False      # each distinct prompt of a micro-batch is computed once (backend.prefix_logits)


def grpo_config(cfg) -> GRPOConfig:
    """The GRPO settings of a RunConfig (train section; the ratio's temperature is the sampling one)."""
    t = cfg.train
    max_len = cfg.workload.response_len.max if cfg.task.name == "even_tokens" else cfg.sampling.max_tokens
    return GRPOConfig(lr=t.lr, kl_coef=t.kl_coef, loss_agg=t.loss_agg,
                      max_len=max_len, adv_std_norm=t.adv_norm == "group_std", kl_clamp=t.kl_clamp,
                      temperature=cfg.sampling.temperature or 1.0, micro_batch=t.micro_batch,
                      mini_batches=t.mini_batches, shared_prompt=t.shared_prompt,
                      loss=LossConfig(t.policy_loss, t.clip_low, t.clip_high, t.clip_ratio_c, t.is_correction,
                                      t.is_cap, tuple(t.is_band), t.is_level, t.is_m2))


def padded_ids(rows: list[list[int]], left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [N, longest] padded with 0 on the right (or ``left``), and the attention mask (1: a token)."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        cols = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, cols] = torch.tensor(r)
        attn[i, cols] = 1
    return ids, attn


# the stand-in of an empty micro-batch (its loss is multiplied by 0)
EMPTY = Trajectory(-1, -1, -1, [0], [0], [0.0], 0.0)


def split_groups(samples: list[Trajectory], n: int,
                 batch_groups: Sequence[int] | None = None) -> list[list[Trajectory]]:
    """``samples`` cut into ``n`` mini-batches of whole groups: the group at position i of ``batch_groups``
    (the whole train batch's group ids, in order; default: this share's, by first appearance) goes to
    mini-batch ``i * n // len``, so data-parallel replicas cut the batch where one rank would. A mini-batch
    may be empty on a replica holding none of its groups, never on all of them: a batch of fewer than ``n``
    groups gets one mini-batch per group (an optimizer step on no sample would still move Adam's weights)."""
    groups = list(batch_groups) if batch_groups is not None else list(dict.fromkeys(s.group_id for s in samples))
    n = min(n, len(groups))
    if n <= 1:
        return [samples]
    part = {g: i * n // len(groups) for i, g in enumerate(groups)}
    out: list[list[Trajectory]] = [[] for _ in range(n)]
    for s in samples:
        out[part[s.group_id]].append(s)
    return out


def padded(rows: list[list[float]], like: torch.Tensor) -> torch.Tensor:
    """Right-padded [B, L] tensor of ``rows`` (zeros beyond each row), shaped and placed like ``like``."""
    out = torch.zeros_like(like)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out


def group_advantages(samples: list[Trajectory], std_norm: bool = True, eps: float = 1e-6) -> list[float]:
    by_group: dict[int, list[float]] = defaultdict(list)
    for s in samples:
        by_group[s.group_id].append(s.reward)
    stats = {}
    for g, rs in by_group.items():
        mean = sum(rs) / len(rs)
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / max(len(rs) - 1, 1))
        stats[g] = (mean, std)
    return [(s.reward - stats[s.group_id][0]) / ((stats[s.group_id][1] + eps) if std_norm else 1.0)
            for s in samples]


class GRPOTrainer:
    def __init__(self, model_dir: str | Path, cfg: GRPOConfig = GRPOConfig(), seed: int = 0,
                 dp: DataParallel | None = None, backend: BackendName = "torch",
                 tensor_parallel: int | None = None, activation_checkpointing: bool = False,
                 mixed_precision: str = "no", lora: LoraSpec | None = None) -> None:
        torch.manual_seed(seed)
        self.cfg = cfg
        self.dp = dp or DataParallel()
        self.backend = build_backend(backend, model_dir, self.dp, BackendOptions(
            reference=cfg.kl_coef > 0, activation_checkpointing=activation_checkpointing,
            mixed_precision=mixed_precision, tensor_parallel=tensor_parallel, lora=lora))
        self.opt = torch.optim.AdamW(self.backend.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.step = 0

    def _token_logprobs(self, batch: list[Trajectory], reference: bool = False,
                        entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Response-token logprobs [B, Lr] (temperature-scaled) under the policy or the reference, and the mask
        of the model's tokens (environment tokens and padding 0); with ``entropy`` ([B, Lr], filled in place,
        no gradient) each position's policy entropy."""
        logits, starts = self._response_logits(batch, reference)
        logits = logits / self.cfg.temperature
        dev = logits.device  # the backend's
        r_max = max(len(s.response) for s in batch)
        out = torch.zeros(len(batch), r_max, device=dev)
        mask = torch.zeros(len(batch), r_max, device=dev)
        for i, (s, a) in enumerate(zip(batch, starts, strict=True)):
            r = len(s.response)
            lp = torch.log_softmax(logits[i, a : a + r], dim=-1)
            out[i, :r] = lp.gather(1, torch.tensor(s.response, device=dev)[:, None])[:, 0]
            mask[i, :r] = torch.tensor(s.model_mask(), device=dev) if s.env_spans else 1
            if entropy is not None:
                with torch.no_grad():
                    entropy[i, :r] = -(lp.exp() * lp).sum(-1).to(entropy.device)
        return out, mask

    def _response_logits(self, batch: list[Trajectory], reference: bool) -> tuple[torch.Tensor, list[int]]:
        """Logits [B, L, V] and, per sample, the row that predicts its first response token (the rows after it
        predict the rest). With ``shared_prompt`` each distinct prompt of the batch is computed once
        (``backend.prefix_logits``: two forwards on every micro-batch, as sharded ranks must agree); else prompt
        + response in one forward."""
        if self.cfg.shared_prompt:
            prompts: dict[tuple[int, ...], int] = {}
            index = [prompts.setdefault(tuple(s.prompt), len(prompts)) for s in batch]
            p_ids, p_attn = padded_ids([list(p) for p in prompts], left=True)
            r_ids, r_attn = padded_ids([s.response for s in batch])
            return self.backend.prefix_logits(p_ids, p_attn, torch.tensor(index), r_ids, r_attn,
                                              reference), [0] * len(batch)
        ids, attn = padded_ids([s.prompt + s.response for s in batch])
        first = min(len(s.prompt) for s in batch) - 1  # no logits before the first response position
        logits = self.backend.logits(ids, attn, reference, keep=ids.shape[1] - first)
        return logits, [len(s.prompt) - 1 - first for s in batch]

    def train_step(self, samples: list[Trajectory], batch_groups: Sequence[int] | None = None) -> dict:
        """``cfg.mini_batches`` optimizer steps on ``samples`` (this replica's share of the train batch: whole
        groups, split into mini-batches of whole groups, each micro-batched); returns metrics of the whole
        batch (over all replicas) and this share's advantages. A replica may get no samples in a step (or in
        a mini-batch); it still joins the gradient sums. ``batch_groups``: the whole batch's group ids in
        order (data parallel with mini-batches: every replica cuts the batch at the same groups).
        Raises ``StepAborted`` when fault-tolerant replicas lost one in the step (train/ft.py): the optimizer
        did not step for the mini-batch under way, earlier mini-batches' steps stand (the caller restores)."""
        if any(not s.response or len(s.response) != len(s.logprobs) for s in samples):
            raise ValueError("every sample needs a non-empty response with one behaviour logprob per token")
        cfg = self.cfg
        adv_all = group_advantages(samples, cfg.adv_std_norm)
        n_tokens, n_samples, reward_sum = self.dp.sum_floats(
            sum(s.model_tokens for s in samples), len(samples), sum(s.reward for s in samples))
        if not n_samples:
            raise ValueError("a train step needs at least one sample")
        parts = split_groups(samples, cfg.mini_batches, batch_groups)
        mine = [self.backend.gather_batch(p) for p in parts]  # tensor parallel: the union of the TP peers' shares
        if len(parts) == 1:
            counts = [(n_tokens, n_samples)]
        else:  # each mini-batch normalises by its own global counts: one all-reduce for all of them
            flat = self.dp.sum_floats(*(x for p in parts for x in (sum(s.model_tokens for s in p), len(p))))
            counts = list(zip(flat[::2], flat[1::2], strict=True))
        # the proximal policy: the weights at the step's start; with one optimizer step, the weights being trained
        prox = None if len(parts) == 1 else [self._logprobs_no_grad(m) for m in mine]
        tot = torch.zeros(len(SUMS), dtype=torch.float64)
        top = torch.zeros(2, dtype=torch.float64)  # is_weight max, response length max
        norms = []
        for part, batch_all, (tokens, count) in zip(range(len(parts)), mine, counts, strict=True):
            self.opt.zero_grad(set_to_none=True)
            adv_part = group_advantages(batch_all, cfg.adv_std_norm)
            for start, batch, weight in self._micro(batch_all):
                ent = torch.zeros(len(batch), max(len(s.response) for s in batch))
                new_lp, mask = self._token_logprobs(batch, entropy=ent)
                adv = torch.tensor(adv_part[start : start + cfg.micro_batch] or [0.0], device=new_lp.device)[:, None]
                old_lp = padded([s.logprobs for s in batch], new_lp)
                prox_lp = new_lp.detach() if prox is None else padded(
                    prox[part][start : start + cfg.micro_batch] or [[0.0]], new_lp)
                per_tok, st = policy_loss(new_lp, prox_lp, old_lp, adv, mask, cfg.loss)
                kl = torch.zeros_like(per_tok)
                if self.backend.ref is not None:
                    with torch.no_grad():
                        ref_lp, _ = self._token_logprobs(batch, reference=True)
                    kl = k3(ref_lp, new_lp, cfg.kl_clamp)
                    per_tok = per_tok + cfg.kl_coef * kl
                loss = aggregate(per_tok, mask, cfg.loss_agg, tokens, count, cfg.max_len)
                (loss * weight).backward()
                if not weight:
                    continue
                with torch.no_grad():
                    sums, tops = self._micro_stats(batch, loss, prox_lp, old_lp, mask, kl, ent, st)
                    tot += sums
                    top = torch.maximum(top, tops)
            self._optimizer_step(part == len(parts) - 1, tot, top, norms)
        self.step += 1
        return step_metrics(dict(zip(SUMS, (float(x) for x in tot), strict=True)), top, norms, len(parts),
                            n_tokens, n_samples, reward_sum) | {"advantages": adv_all}

    def _optimizer_step(self, last: bool, tot: torch.Tensor, top: torch.Tensor, norms: list[float]) -> None:
        """The gradients summed and clipped, and the optimizer stepped on a committed step only; the step's
        figures (``tot``, ``top``) are reduced before its last commit."""
        if last:
            self.dp.sum_(tot if self.backend.counts_metrics else tot.zero_())
            self.dp._all_reduce(top, "max")
        self.backend.finish_grads()
        norms.append(self.backend.clip_grad_norm(self.cfg.max_grad_norm))
        if not self.dp.commit():  # a replica was lost in this optimizer step's collectives
            raise StepAborted(f"step {self.step}: a replica was lost in its collectives")
        self.opt.step()

    def _micro_stats(self, batch, loss, prox_lp, old_lp, mask, kl, ent, st) -> tuple[torch.Tensor, torch.Tensor]:
        """A micro-batch's sums (SUMS order) and maxima (importance weight, response length)."""
        same = torch.tensor([float(s.version == self.step) for s in batch], device=mask.device)[:, None]
        on_policy = mask * same  # tokens sampled under the step's starting weights
        per = {"loss": float(loss), "gap_sum": float(((prox_lp - old_lp).abs() * on_policy).sum()),
               "gap_tokens": float(on_policy.sum()), "kl": float((kl * mask).sum()),
               "entropy": float((ent.to(mask.device) * mask).sum()),
               **{k: float((v * mask).sum()) for k, v in st.items()}}
        return (torch.tensor([per[k] for k in SUMS], dtype=torch.float64),
                torch.tensor([float((st["is_weight"] * mask).max()), float(mask.sum(1).max())], dtype=torch.float64))



    def _micro(self, samples: list[Trajectory]):
        """(offset, micro-batch, weight) over ``samples``; sharded backends run as many as their busiest rank,
        an empty one as the stand-in EMPTY with weight 0 (it joins the collectives, moves nothing)."""
        mb = self.cfg.micro_batch
        for start in range(0, self.backend.micro_batches(-(-len(samples) // mb)) * mb, mb):
            batch = samples[start : start + mb]
            yield start, batch or [EMPTY], 1.0 if batch else 0.0

    def _logprobs_no_grad(self, samples: list[Trajectory]) -> list[list[float]]:
        """Each sample's response-token logprobs under the current weights (the proximal policy of a step)."""
        out: list[list[float]] = []
        with torch.no_grad():
            for _, batch, weight in self._micro(samples):
                lp, _ = self._token_logprobs(batch)
                if weight:
                    out += [lp[i, : len(s.response)].tolist() for i, s in enumerate(batch)]
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The current weights, whole, with Hugging Face names (detached CPU copies; every trainer rank); under
        LoRA the adapter's (train/lora.py)."""
        return self.backend.full_state_dict()

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(weights, the rest): what a checkpoint needs to continue this trainer exactly. A collective for
        sharded backends: every trainer rank calls it; the optimizer state is keyed by parameter name, so
        a checkpoint resumes under any backend and rank count."""
        return self.state_dict(), {"optimizer": self.backend.optimizer_state(self.opt), "step": self.step,
                                   "torch_rng": torch.get_rng_state()}

    def replica_state(self) -> dict:
        """What a replica group new to a quorum takes from this rank (torchft's live recovery, train/ft.py): its
        part of the weights and optimizer (no collective: ranks of a group are asked at once), the step
        counter and the RNG."""
        return {**self.backend.local_state(self.opt), "step": self.step, "torch_rng": torch.get_rng_state()}

    def load_replica_state(self, state: dict) -> None:
        self.backend.load_local_state(self.opt, state)
        self.step = state["step"]
        torch.set_rng_state(state["torch_rng"])

    def load_checkpoint(self, weights: dict[str, torch.Tensor], rest: dict) -> None:
        self.backend.load_full_state_dict(weights)
        self.backend.load_optimizer_state(self.opt, rest["optimizer"])
        self.step = rest["step"]
        torch.set_rng_state(rest["torch_rng"])


def step_metrics(m: dict[str, float], top: torch.Tensor, norms: list[float], n_parts: int, n_tokens: float,
                 n_samples: float, reward_sum: float) -> dict:
    """A step's metrics over all replicas, from its summed figures ``m`` (SUMS) and maxima ``top``."""
    per_token = {k: m[k] / n_tokens for k in ("kl", "ratio", "entropy", "clip_band", "clip_low", "clip_high",
                                              "dual_clip", "is_weight", "is_truncated", "is_masked")}
    return {"loss": m["loss"] / n_parts, "clip_frac": per_token["clip_low"] + per_token["clip_high"],
            "clip_frac_low": per_token["clip_low"], "clip_frac_high": per_token["clip_high"],
            "clip_band_frac": per_token["clip_band"], "dual_clip_frac": per_token["dual_clip"], "kl": per_token["kl"],
            "ratio_mean": per_token["ratio"],
            "entropy": per_token["entropy"], "is_weight_mean": per_token["is_weight"],
            "is_weight_max": float(top[0]), "is_truncated_frac": per_token["is_truncated"],
            "is_masked_frac": per_token["is_masked"], "response_len_mean": n_tokens / n_samples,
            "response_len_max": int(top[1]), "grad_norm": sum(norms) / len(norms), "tokens": int(n_tokens),
            "reward_mean": reward_sum / n_samples, "gap_tokens": int(m["gap_tokens"]),
            "logprob_gap": m["gap_sum"] / m["gap_tokens"] if m["gap_tokens"] else math.nan}
