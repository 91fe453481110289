"""Run under ``mpiexec -n R``: R data-parallel GRPO replicas, each given the groups it owns, take the same
steps as one trainer given every sample. Prints one JSON line from rank 0.

    mpiexec -n 2 python tests/dp_equivalence.py MODEL_DIR [loss_agg]
"""

import json
import sys

import torch
from mpi4py import MPI

from dora_hpc.train.dp import DataParallel
from dora_hpc.train.grpo import GRPOConfig, GRPOTrainer, Sample, weights_checksum


def batch(step: int, n_groups: int = 5, g: int = 4) -> list[Sample]:
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
            out.append(Sample(prompt, resp, lps, float(torch.rand(1, generator=gen)), step * 100 + gid))
    return out


def main(model_dir: str, loss_agg: str) -> None:
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    cfg = GRPOConfig(lr=1e-2, micro_batch=3, loss_agg=loss_agg)
    dp = DataParallel(world)
    replica = GRPOTrainer(model_dir, cfg, seed=0, dp=dp)
    single = GRPOTrainer(model_dir, cfg, seed=0) if dp.lead else None
    metrics = []
    for step in range(3):
        samples = batch(step)
        mine = [s for s in samples if s.group_id % dp.size == dp.rank]
        m = replica.train_step(mine)
        dp.check_replicas(weights_checksum(replica.state_dict()), step)
        if single is not None:
            metrics.append((m, single.train_step(samples)))
    if single is not None:
        a, b = replica.state_dict(), single.state_dict()
        diff = max(float((a[k] - b[k]).abs().max()) for k in a)
        keys = ("loss", "clip_frac", "ratio_mean", "grad_norm", "tokens", "reward_mean")
        print(json.dumps({"max_abs_weight_diff": diff, "replicas": dp.size,
                          "metrics": [[{k: x[k] for k in keys} for x in pair] for pair in metrics]}))
    dp.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "token")
