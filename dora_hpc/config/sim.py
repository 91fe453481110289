"""The simulator's sections of RunConfig: the workload's length distributions, the model and hardware
it prices, and the simulation's own settings (sim/)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import Section


class LengthDist(Section):
    """Lognormal token lengths: median * exp(sigma * N(0,1)), clipped to [min, max]."""

    median: float = Field(gt=0)
    sigma: float = Field(0.0, ge=0)
    max: int = Field(gt=0)
    min: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> LengthDist:
        if not self.min <= self.median <= self.max:
            raise ValueError(f"need min <= median <= max, got {self.min}, {self.median}, {self.max}")
        return self


class SecondsDist(Section):
    """Lognormal durations: median * exp(sigma * N(0,1)), capped at max."""

    median: float = Field(ge=0)
    sigma: float = Field(0.0, ge=0)
    max: float = Field(gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> SecondsDist:
        if self.median > self.max:
            raise ValueError(f"need median <= max, got {self.median}, {self.max}")
        return self


class WorkloadConfig(Section):
    """What one trajectory is. A multi-turn episode (``turns.max`` > 1) has a number of turns, each of
    ``response_len`` model tokens followed, except the last, by an environment step of ``env_latency_s``
    seconds that adds ``env_tokens`` tokens to the context; prompt + every turn's tokens stop at
    ``max_episode_tokens``; an instance runs ``env_workers`` environment steps at once. ``turns.max: 1`` (the
    default) is single-turn: prompt -> response."""

    prompt_len: LengthDist = LengthDist(median=128, sigma=0.3, max=512)
    response_len: LengthDist = LengthDist(median=256, sigma=1.0, max=4096)
    turns: LengthDist = LengthDist(median=1, sigma=0.0, max=1)
    env_latency_s: SecondsDist = SecondsDist(median=0.0, max=1.0)
    env_tokens: LengthDist = LengthDist(median=1, sigma=0.0, max=1)
    shared_prefix_tokens: int = Field(0, ge=0, description="a prefix every prompt starts with (a system prompt, "
                                      "tool descriptions), before its own prompt_len tokens: the simulator and "
                                      "the even_tokens task (toy_turns too) put it there")
    max_episode_tokens: int = Field(1 << 20, ge=2, description="prompt + every turn's model and environment tokens")
    env_workers: int | None = Field(None, ge=1, description="environment steps one instance runs at once (the "
                                    "runtime's env.workers of a rollout rank); more wait for a free worker, first "
                                    "come first served. Unset: every step starts at once (a pool larger than the "
                                    "episodes in flight)")


class ModelSpec(Section):
    """The policy model as the simulator's cost model sees it. A mixture of experts stores, loads and
    (at decode batch sizes, where nearly every expert gets a token) reads all ``params_b`` each step,
    but computes with ``active_params_b`` a token."""

    params_b: float = Field(0.5, gt=0, description="parameters, billions (all experts: weight bytes)")
    active_params_b: float | None = Field(None, gt=0, description="MoE: parameters active per token, billions "
                                          "(prefill and training FLOPs); unset: a dense model, params_b")
    layers: int = Field(24, ge=1, description="attention layers (each caches KV)")
    hidden: int = Field(896, ge=1, description="hidden size (attention FLOPs of prefill)")
    kv_heads: int = Field(2, ge=1)
    head_dim: int = Field(64, ge=1)
    kv_latent: int | None = Field(None, ge=1, description="MLA: values cached per token per layer "
                                  "(kv_lora_rank + qk_rope_head_dim), in place of 2 x kv_heads x head_dim")
    bytes_per_param: int = Field(2, ge=1)
    intermediate: int | None = Field(None, ge=1, description="the MLP's width (train.lora's adapter size; unset: "
                                     "4 x hidden)")

    def adapter_bytes(self, rank: int) -> float:
        """train.lora: a rank-``rank`` adapter on every linear of every layer (all-linear: q, k, v, o and a gated
        MLP), rank x (in + out) per linear, in the publish dtype."""
        kv, i = self.kv_heads * self.head_dim, self.intermediate or 4 * self.hidden
        return rank * self.layers * (9 * self.hidden + 2 * kv + 3 * i) * self.bytes_per_param

    @model_validator(mode="after")
    def _active_within_total(self) -> ModelSpec:
        if self.active_params_b is not None and self.active_params_b > self.params_b:
            raise ValueError(f"active_params_b ({self.active_params_b}) exceeds params_b ({self.params_b})")
        return self

    @property
    def weight_bytes(self) -> float:
        return self.params_b * 1e9 * self.bytes_per_param

    @property
    def flops_params(self) -> float:
        """Parameters a token's forward pass multiplies by: the active ones."""
        return (self.active_params_b or self.params_b) * 1e9

    @property
    def kv_bytes_per_token(self) -> float:
        per_layer = self.kv_latent or 2 * self.kv_heads * self.head_dim
        return self.layers * per_layer * self.bytes_per_param


class HardwareSpec(Section):
    """One accelerator and its links (the simulator's roofline)."""

    hbm_gbps: float = Field(3350, gt=0, description="HBM bandwidth per accelerator, GB/s")
    peak_tflops: float = Field(989, gt=0, description="dense bf16 peak per accelerator, TFLOP/s")
    hbm_gb: float = Field(80, gt=0, description="memory per accelerator, GB")
    decode_bw_efficiency: float = Field(0.7, gt=0, le=1)
    prefill_mfu: float = Field(0.5, gt=0, le=1)
    train_mfu: float = Field(0.3, gt=0, le=1)
    reprefill: Literal["blocking", "chunked"] = Field(
        "blocking", description="how a re-prefill (partial rollout's, a migration without KV) is priced: "
        "blocking, the whole context at prefill_mfu while the instance's decodes wait; chunked, in chunks of "
        "prefill_chunk_tokens beside the decodes (vLLM's chunked prefill; Sarathi, arXiv 2308.16369): each "
        "chunk's compute at prefill_mfu less chunked_prefill_loss, the decodes piggybacking on it, so the "
        "batch loses only what the chunks take beyond a decode step")
    prefill_chunk_tokens: int = Field(512, ge=1, description="reprefill: chunked: tokens a chunk")
    chunked_prefill_loss: float = Field(0.10, ge=0, lt=1, description="reprefill: chunked: the prefill "
                                        "efficiency a chunk loses against one whole prefill (Sarathi, arXiv "
                                        "2308.16369: within 10% at 512-token chunks, 20% at 256)")
    step_overhead_ms: float = Field(5.0, ge=0, description="fixed cost of one engine step (scheduling, launch)")
    lora_step_ms: float = Field(2.0, ge=0, description="train.lora: what a decode step pays for the requests' "
                                "adapters, batched across versions (Punica, arXiv 2310.18547: SGMV adds about 2 ms "
                                "a token at 7B-70B)")
    kv_link_gbps: float = Field(25, gt=0, description="instance-to-instance KV transfer, GB/s")
    weight_link_gbps: float = Field(25, gt=0, description="trainer/peer weight transfer per accelerator, GB/s")
    host_link_gbps: float = Field(25, gt=0, description="device<->host KV copy per accelerator (PCIe), GB/s")
    delta_ratio: float = Field(1.0, gt=0, le=1, description="train.publish_delta: the bytes of a version sent as "
                               "deltas over its whole bytes (an assumption; results/bench/weights measures it)")
    colocated_switch_s: float = Field(20, ge=0, description="colocated: rollout<->train switch (offload, reshard)")
    trainer_start_s: float = Field(0.0, ge=0, description="seconds from the start until the trainer can run "
                                   "its first step (it builds its model while rollout loads version 0 from the "
                                   "model folder and generates); `plan` fits it from a run")
    engine_sleep_s: float = Field(2.0, ge=0, description="cluster.elastic: a borrowed instance frees its weights "
                                  "and KV pool before a train step (vLLM's sleep mode)")
    engine_wake_s: float = Field(5.0, ge=0, description="cluster.elastic: a borrowed instance re-allocates its KV "
                                 "pool after a step, before its weight load")
    trainer_state_bytes_per_param: float = Field(16, ge=0, description="cluster.elastic: training state kept on "
                                                 "the trainer's accelerators, sharded over them (bf16 weights and "
                                                 "grads, fp32 master and Adam moments); borrowed KV gets the rest")


class SimConfig(Section):
    steps: int = Field(20, ge=2, description="train steps to simulate")
    warmup_steps: int = Field(2, ge=1, description="steps excluded from the measured window")
    tick_s: float = Field(10.0, gt=0, description="temporal rebalancing trigger period, seconds")
    model: ModelSpec = ModelSpec()
    hardware: HardwareSpec = HardwareSpec()

    @model_validator(mode="after")
    def _warmup_fits(self) -> SimConfig:
        if self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be < steps ({self.steps})")
        return self
