"""The trainer's step with each group's prompt computed once (train.shared_prompt) against the plain forward
(prompt + response per sample), on long prompts: GRPO groups of G samples of one P-token prompt, R-token
responses, one group per micro-batch. The two are timed in turns (A B A B ...) on one model; medians.

    .venv/bin/python results/bench/prefix/trainer_step.py [tiny|smollm2] [REPEATS] \
        > results/bench/prefix/trainer-step-MODEL.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from dora_hpc.core.trajectory import Trajectory
from dora_hpc.engine.local_models import build_tiny_model, convert_smollm2
from dora_hpc.train.grpo import GRPOConfig, GRPOTrainer

GROUPS, G, PROMPT, RESPONSE = 4, 8, 512, 32


def samples(vocab: int) -> list[Trajectory]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for g in range(GROUPS):
        prompt = torch.randint(3, vocab, (PROMPT,), generator=gen).tolist()
        for s in range(G):
            resp = torch.randint(3, vocab, (RESPONSE,), generator=gen).tolist()
            out.append(Trajectory(g * G + s, g, 0, prompt, resp, [-1.0] * RESPONSE, float(s % 2)))
    return out


def main(model: str = "tiny", repeats: str = "5") -> None:
    torch.set_num_threads(2)
    path = build_tiny_model() if model == "tiny" else convert_smollm2()
    trainers = {shared: GRPOTrainer(path, GRPOConfig(lr=1e-6, micro_batch=G, shared_prompt=shared))
                for shared in (False, True)}
    batch = samples(int(trainers[False].backend.model.config.vocab_size))
    times: dict[bool, list[float]] = {False: [], True: []}
    losses: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(int(repeats)):
        for shared, t in trainers.items():
            t0 = time.perf_counter()
            m = t.train_step(batch)
            times[shared].append(time.perf_counter() - t0)
            losses[shared].append(m["loss"])
    med = {k: statistics.median(v) for k, v in times.items()}
    json.dump({"model": model, "groups": GROUPS, "group_size": G, "prompt_tokens": PROMPT,
               "response_tokens": RESPONSE, "micro_batch": G, "repeats": int(repeats),
               "step_s": {"plain": times[False], "shared_prompt": times[True]},
               "median_step_s": {"plain": med[False], "shared_prompt": med[True]},
               "speedup": med[False] / med[True],
               "first_loss": {"plain": losses[False][0], "shared_prompt": losses[True][0]}}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main(*sys.argv[1:3])
