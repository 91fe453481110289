"""GRPO: group-relative advantages and the PPO-clip objective against each trajectory's own
behaviour logprobs (the version it was sampled under), on a causal LM held by a trainer backend
(backend.py: replicated torch, FSDP2 or megatron-core; the objective is the same code for all three).

Invariants:
* advantages are computed within a GRPO group only (all samples of one prompt, one version);
* the importance ratio of a token is pi_theta(token) / pi_behaviour(token) with the behaviour
  logprob recorded at sampling time -- a well-defined single-policy ratio because a trajectory is
  generated under one version (DORA) -- so no cross-version correction is needed;
* ``train_step`` computes a real gradient and takes one optimizer step; ``state_dict`` returns
  Hugging Face parameter names, ready for ``Engine.load_weights``;
* ``logprob_gap`` measures the rollout engine against the trainer: the mean |log pi_theta - log
  pi_behaviour| over the tokens of samples generated under the weights the trainer holds when the step
  starts (``Sample.version == step``), i.e. the same policy computed twice; it is float noise (~1e-6 in
  float32) unless the engine samples from other weights than it was sent;
* data parallel: each replica gets whole groups, normalises its loss by the global token (or sample)
  count and the gradients are summed over replicas, so R replicas take the same step as one rank
  on the union of their samples (up to float summation order), whichever backend holds the weights.
"""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from .backend import BackendName, build_backend
from .dp import DataParallel


@dataclass(frozen=True)
class GRPOConfig:
    lr: float = 1e-5
    clip_low: float = 0.2
    clip_high: float = 0.28          # DAPO's clip-higher
    kl_coef: float = 0.0             # > 0: k3 KL penalty to the initial (reference) weights
    loss_agg: Literal["token", "sequence"] = "token"  # token: DAPO token-level mean; sequence: GRPO
    adv_std_norm: bool = True
    temperature: float = 1.0         # must equal the sampling temperature
    max_grad_norm: float = 1.0
    micro_batch: int = 8
    weight_decay: float = 0.0


def grpo_config(cfg) -> GRPOConfig:
    """The GRPO settings of a RunConfig (train section; the ratio's temperature is the sampling one)."""
    t = cfg.train
    return GRPOConfig(lr=t.lr, clip_low=t.clip_low, clip_high=t.clip_high, kl_coef=t.kl_coef, loss_agg=t.loss_agg,
                      temperature=cfg.sampling.temperature or 1.0, micro_batch=t.micro_batch)


@dataclass(frozen=True)
class Sample:
    prompt: list[int]
    response: list[int]
    logprobs: list[float]   # behaviour logprob of each response token
    reward: float
    group_id: int
    version: int = -1       # the policy version it was sampled under (-1: unknown)


EMPTY = Sample([0], [0], [0.0], 0.0, -1)  # the stand-in of an empty micro-batch (its loss is multiplied by 0)


def group_advantages(samples: list[Sample], std_norm: bool = True, eps: float = 1e-6) -> list[float]:
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


def weights_checksum(state: dict[str, torch.Tensor]) -> str:
    """A digest of every tensor's bytes (name order), to prove published weights arrive bit-exactly."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class GRPOTrainer:
    def __init__(self, model_dir: str | Path, cfg: GRPOConfig = GRPOConfig(), seed: int = 0,
                 dp: DataParallel | None = None, backend: BackendName = "torch",
                 tensor_parallel: int | None = None, activation_checkpointing: bool = False,
                 mixed_precision: str = "no") -> None:
        torch.manual_seed(seed)
        self.cfg = cfg
        self.dp = dp or DataParallel()
        self.backend = build_backend(backend, model_dir, self.dp, reference=cfg.kl_coef > 0,
                                     tensor_parallel=tensor_parallel, activation_checkpointing=activation_checkpointing,
                                     mixed_precision=mixed_precision)
        self.opt = torch.optim.AdamW(self.backend.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.step = 0

    def _token_logprobs(self, batch: list[Sample], reference: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Response-token logprobs [B, Lr] (temperature-scaled) under the policy or the reference, and their mask."""
        lens = [len(s.prompt) + len(s.response) for s in batch]
        width = max(lens)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        attn = torch.zeros(len(batch), width, dtype=torch.long)
        for i, s in enumerate(batch):
            ids[i, : lens[i]] = torch.tensor(s.prompt + s.response)
            attn[i, : lens[i]] = 1
        logits = self.backend.logits(ids, attn, reference) / self.cfg.temperature  # on the backend's device
        dev = logits.device
        r_max = max(len(s.response) for s in batch)
        out = torch.zeros(len(batch), r_max, device=dev)
        mask = torch.zeros(len(batch), r_max, device=dev)
        for i, s in enumerate(batch):
            p, r = len(s.prompt), len(s.response)
            lp = torch.log_softmax(logits[i, p - 1 : p + r - 1], dim=-1)
            out[i, :r] = lp.gather(1, torch.tensor(s.response, device=dev)[:, None])[:, 0]
            mask[i, :r] = 1
        return out, mask

    def train_step(self, samples: list[Sample]) -> dict:
        """One optimizer step on ``samples`` (this replica's share of the train batch: whole groups,
        micro-batched); returns metrics of the whole batch (over all replicas) and this share's
        advantages. A replica may get no samples in a step; it still joins the gradient sum."""
        if any(not s.response or len(s.response) != len(s.logprobs) for s in samples):
            raise ValueError("every sample needs a non-empty response with one behaviour logprob per token")
        cfg = self.cfg
        adv_all = group_advantages(samples, cfg.adv_std_norm)
        n_tokens, n_samples, reward_sum = self.dp.sum_floats(
            sum(len(s.response) for s in samples), len(samples), sum(s.reward for s in samples))
        if not n_samples:
            raise ValueError("a train step needs at least one sample")
        self.opt.zero_grad(set_to_none=True)
        tot = torch.zeros(6, dtype=torch.float64)  # loss, clip_frac, kl, ratio_mean, |gap| sum, gap tokens
        mine = self.backend.gather_batch(samples)  # tensor parallel: the union of the TP peers' shares
        adv_mine = adv_all if mine is samples else group_advantages(mine, cfg.adv_std_norm)
        for start in range(0, self.backend.micro_batches(-(-len(mine) // cfg.micro_batch)) * cfg.micro_batch,
                           cfg.micro_batch):
            batch = mine[start : start + cfg.micro_batch]
            weight = 1.0 if batch else 0.0  # an empty micro-batch (sharded backends): joins, moves nothing
            batch = batch or [EMPTY]
            new_lp, mask = self._token_logprobs(batch)
            adv = torch.tensor(adv_mine[start : start + cfg.micro_batch] or [0.0], device=new_lp.device)[:, None]
            old_lp = torch.zeros_like(new_lp)
            for i, s in enumerate(batch):
                old_lp[i, : len(s.logprobs)] = torch.tensor(s.logprobs)
            ratio = torch.exp(new_lp - old_lp)
            clipped = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high)
            per_tok = -torch.minimum(ratio * adv, clipped * adv)
            kl = torch.zeros_like(per_tok)
            if self.backend.ref is not None:
                with torch.no_grad():
                    ref_lp, _ = self._token_logprobs(batch, reference=True)
                d = ref_lp - new_lp
                kl = torch.exp(d) - d - 1  # k3 estimator, >= 0
                per_tok = per_tok + cfg.kl_coef * kl
            if cfg.loss_agg == "token":
                loss = (per_tok * mask).sum() / n_tokens
            else:
                loss = ((per_tok * mask).sum(1) / mask.sum(1)).sum() / n_samples
            (loss * weight).backward()
            if not weight:
                continue
            with torch.no_grad():
                same = torch.tensor([float(s.version == self.step) for s in batch], device=mask.device)[:, None]
                on_policy = mask * same  # tokens sampled under exactly these weights
                tot += torch.tensor([float(loss), float(((ratio != clipped).float() * mask).sum()) / n_tokens,
                                     float((kl * mask).sum()) / n_tokens, float((ratio * mask).sum()) / n_tokens,
                                     float(((new_lp - old_lp).abs() * on_policy).sum()), float(on_policy.sum())],
                                    dtype=torch.float64)
        self.backend.finish_grads()
        self.dp.sum_(tot if self.backend.counts_metrics else tot.zero_())
        grad_norm = self.backend.clip_grad_norm(cfg.max_grad_norm)
        self.opt.step()
        self.step += 1
        loss, clip_frac, kl, ratio_mean, gap_sum, gap_tokens = (float(x) for x in tot)
        return {"loss": loss, "clip_frac": clip_frac, "kl": kl, "ratio_mean": ratio_mean,
                "grad_norm": float(grad_norm), "tokens": int(n_tokens), "advantages": adv_all,
                "reward_mean": reward_sum / n_samples, "gap_tokens": int(gap_tokens),
                "logprob_gap": gap_sum / gap_tokens if gap_tokens else math.nan}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The current weights, whole, with Hugging Face names (detached CPU copies; every trainer rank)."""
        return self.backend.full_state_dict()

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(weights, the rest): what a checkpoint needs to continue this trainer exactly. A collective for
        sharded backends: every trainer rank calls it; the optimizer state is keyed by parameter name, so
        a checkpoint resumes under any backend and rank count."""
        return self.state_dict(), {"optimizer": self.backend.optimizer_state(self.opt), "step": self.step,
                                   "torch_rng": torch.get_rng_state()}

    def load_checkpoint(self, weights: dict[str, torch.Tensor], rest: dict) -> None:
        self.backend.load_full_state_dict(weights)
        self.backend.load_optimizer_state(self.opt, rest["optimizer"])
        self.step = rest["step"]
        torch.set_rng_state(rest["torch_rng"])
