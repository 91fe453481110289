"""Run under ``mpiexec -n R``: R data-parallel GRPO trainer ranks (replicated ``torch`` or sharded ``fsdp``),
each given the groups it owns, take the same steps as one replicated trainer given every sample; then the
distributed trainer's checkpoint resumes a one-rank trainer, and both take one more equal step (the
checkpoint is backend- and rank-count-independent). Prints one JSON line from rank 0.

    mpiexec -n 2 python tests/dp_equivalence.py MODEL_DIR [loss_agg] [backend] [tensor_parallel]

With ``megatron`` the ranks form TP groups of ``tensor_parallel`` (default: all of them); it also reports the
largest difference of its logits from the Hugging Face model's on a right-padded batch. ``DORA_AC=1``
turns on activation checkpointing in the distributed trainer (the one-rank reference keeps it off);
``DORA_MP=bf16`` its bf16 mixed precision; ``DORA_MINI=N`` gives both N mini-batches (optimizer steps)
per train step, the replicas cutting the batch where the one rank does; ``DORA_LOSS=policy_loss,is_correction``
(e.g. ``decoupled,truncate``) their objective; ``DORA_LORA=R`` trains a rank-R LoRA adapter on both (checkpoints
are then the adapter's), and reports how far the lead's published rows (the adapter's) are from the one rank's.
"""

import json
import os
import sys
from dataclasses import replace

import torch
from mpi4py import MPI

from dora_hpc.core.trajectory import Trajectory
from dora_hpc.train.dp import DataParallel
from dora_hpc.train.grpo import GRPOConfig, GRPOTrainer
from dora_hpc.train.lora import LoraSpec
from dora_hpc.train.losses import LossConfig
from dora_hpc.train.publish import checksum_of, piece


def batch(step: int, n_groups: int = 5, g: int = 4) -> list[Trajectory]:
    """Deterministic groups of unequal lengths and rewards (no engine needed: behaviour logprobs are
    made up, which only moves the ratio away from 1 and exercises the clip)."""
    gen = torch.Generator().manual_seed(step)
    out = []
    for gid in range(n_groups):
        prompt = torch.randint(3, 200, (4 + gid,), generator=gen).tolist()
        for _ in range(g):
            n = int(torch.randint(2, 14, (1,), generator=gen))
            resp = torch.randint(3, 200, (n,), generator=gen).tolist()
            lps = (-torch.rand(n, generator=gen) * 6).tolist()
            out.append(Trajectory(-1, step * 100 + gid, -1, prompt, resp, lps, float(torch.rand(1, generator=gen))))
    return out


def main(model_dir: str, loss_agg: str, backend: str, tensor_parallel: int | None) -> None:
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    policy, correction = os.environ.get("DORA_LOSS", "ppo_clip,none").split(",")
    cfg = GRPOConfig(lr=1e-2, micro_batch=3, loss_agg=loss_agg, mini_batches=int(os.environ.get("DORA_MINI", "1")),
                     loss=LossConfig(policy_loss=policy, is_correction=correction))
    dp = DataParallel(world)
    ac = os.environ.get("DORA_AC") == "1"  # activation checkpointing on the distributed trainer only
    mp = os.environ.get("DORA_MP", "no")  # mixed precision likewise
    shared = os.environ.get("DORA_SHARED") == "1"  # train.shared_prompt on the distributed trainer only
    rank = int(os.environ.get("DORA_LORA", "0"))
    lora = LoraSpec(rank, 16.0, "all-linear") if rank else None
    replica = GRPOTrainer(model_dir, replace(cfg, shared_prompt=shared), seed=0, dp=dp, backend=backend,
                          tensor_parallel=tensor_parallel, activation_checkpointing=ac, mixed_precision=mp, lora=lora)
    single = GRPOTrainer(model_dir, cfg, seed=0, lora=lora) if dp.lead else None
    gen = torch.Generator().manual_seed(7)  # the same right-padded batch on every rank
    ids, attn = torch.randint(3, 200, (3, 12), generator=gen), torch.ones(3, 12, dtype=torch.long)
    attn[1, 9:] = attn[2, 5:] = 0
    logits = replica.backend.logits(ids, attn)
    logits_diff = None
    if single is not None:
        ref = single.backend.logits(ids, attn)
        logits_diff = float(((logits - ref).abs() * attn[:, :, None]).max().detach())
    metrics = []
    for step in range(3):
        samples = batch(step, n_groups=5 if step != 1 else 1)  # step 1: one group, so a rank gets none
        mine = [s for s in samples if s.group_id % dp.size == dp.rank]
        m = replica.train_step(mine, list(dict.fromkeys(s.group_id for s in samples)))
        dp.check_replicas(checksum_of(replica.state_dict(), 1, torch.float32), step)
        if single is not None:
            metrics.append((m, single.train_step(samples)))
    weights, rest = replica.checkpoint_state()  # a collective for fsdp
    mine = replica.backend.shard_state_dict(dp.rank, dp.size, torch.float32)  # this rank's published rows
    samples = batch(3)
    m = replica.train_step([s for s in samples if s.group_id % dp.size == dp.rank],
                           list(dict.fromkeys(s.group_id for s in samples)))
    a = replica.state_dict()  # a collective for fsdp
    if single is not None:
        diff = max(float((weights[k] - v).abs().max()) for k, v in single.state_dict().items())
        published = max(float((mine[k] - piece(v, dp.rank, dp.size)).abs().max())
                        for k, v in single.backend.shard_state_dict(0, 1, torch.float32).items())
        resumed = GRPOTrainer(model_dir, cfg, seed=1, lora=lora)
        resumed.load_checkpoint(weights, rest)
        metrics.append((m, resumed.train_step(samples)))
        c = resumed.state_dict()
        keys = ("loss", "clip_frac", "ratio_mean", "grad_norm", "tokens", "reward_mean")
        print(json.dumps({"backend": backend, "activation_checkpointing": ac, "mixed_precision": mp,
                          "shared_prompt": shared, "mini_batches": cfg.mini_batches, "loss": [policy, correction],
                          "master_dtypes": sorted({str(p.dtype) for p in replica.backend.parameters()}),
                          "max_abs_weight_diff": diff, "lora": rank, "adapter": sorted(a) == sorted(weights)
                          and all(".lora_" in k for k in a), "published_max_abs_diff": published,
                          "max_abs_logits_diff": logits_diff,
                          "resumed_max_abs_weight_diff": max(float((a[k] - c[k]).abs().max()) for k in a),
                          "replicas": dp.size,
                          "metrics": [[{k: x[k] for k in keys} for x in pair] for pair in metrics]}))
    dp.close()


if __name__ == "__main__":
    args = sys.argv[1:] + [None] * 4
    main(args[0], args[1] or "token", args[2] or "torch", int(args[3]) if args[3] else None)
