"""GRPO on the tiny model with real rollouts from the built-in engine."""

import importlib.util

import pytest
import torch
from engine_util import run_all

from dora_hpc.core.trajectory import Trajectory
from dora_hpc.engine.engine import Engine
from dora_hpc.engine.local_models import build_tiny_model
from dora_hpc.engine.sampling import SamplingParams
from dora_hpc.train.grpo import GRPOConfig, GRPOTrainer, group_advantages
from dora_hpc.train.publish import checksum_of


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def even_reward(tokens):
    return sum(t % 2 == 0 for t in tokens) / len(tokens)


def rollout(engine, version, n_groups, g, step, max_tokens=12):
    prompts = [[3 + (7 * i + step) % 200, 5, 9] for i in range(n_groups)]
    for gi, p in enumerate(prompts):
        for s in range(g):
            engine.add((step * 1000 + gi) * g + s, p, SamplingParams(max_tokens=max_tokens, ignore_eos=True), version)
    out = []
    while engine.has_work():
        for f in engine.step():
            gid = f.req_id // g
            out.append(Trajectory(f.req_id, gid, -1, f.prompt, f.response, f.logprobs, even_reward(f.response)))
    return out


def test_group_advantages_are_within_group():
    s = [Trajectory(i, g, -1, [1], [2], [0.0], r) for i, (r, g) in enumerate([(1, 0), (0, 0), (5, 1), (5, 1)])]
    adv = group_advantages(s)
    assert adv[0] > 0 > adv[1] and adv[2] == adv[3] == 0.0


def test_engine_logprobs_equal_trainer_logprobs_so_the_first_ratio_is_one(tiny):
    engine = Engine(tiny, kv_blocks=128, seed=1)
    samples = rollout(engine, 0, n_groups=2, g=4, step=0)
    trainer = GRPOTrainer(tiny, GRPOConfig(lr=1e-3))
    m = trainer.train_step(samples)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and m["clip_frac"] == 0.0
    assert m["tokens"] == sum(len(s.response) for s in samples) and m["grad_norm"] > 0


def test_trainer_logprobs_equal_the_engines_when_prompts_differ_in_length(tiny):
    """The trainer's LM head runs from the batch's first response position only; every row's response
    logprobs are still the engine's, whatever its prompt's length."""
    engine = Engine(tiny, kv_blocks=256, seed=2)
    for i, n in enumerate((2, 5, 11, 17)):
        engine.add(i, [3 + (5 * j + i) % 200 for j in range(n)], SamplingParams(max_tokens=6 + i, ignore_eos=True), 0)
    samples = []
    while engine.has_work():
        samples += [Trajectory(f.req_id, f.req_id, -1, f.prompt, f.response, f.logprobs, 0.0) for f in engine.step()]
    with torch.no_grad():
        lp, mask = GRPOTrainer(tiny, GRPOConfig())._token_logprobs(samples)
    for row, m, s in zip(lp, mask, samples, strict=True):
        assert int(m.sum()) == len(s.response)
        assert row[: len(s.response)].tolist() == pytest.approx(s.logprobs, abs=1e-4)


def test_decoupled_takes_the_ppo_clip_step_on_fresh_samples_and_every_step_reports_its_statistics(tiny):
    """Staleness 0 (the engine sampled under the trainer's weights, float32): the decoupled objective's
    step equals PPO-clip's to float noise; the step's new statistics are there and sane."""
    from dora_hpc.train.losses import LossConfig

    samples = rollout(Engine(tiny, kv_blocks=128, seed=3), 0, n_groups=2, g=4, step=0)
    steps = {}
    for name in ("ppo_clip", "decoupled"):
        trainer = GRPOTrainer(tiny, GRPOConfig(lr=1e-3, loss=LossConfig(policy_loss=name, is_correction="truncate")))
        steps[name] = (trainer.train_step(samples), trainer.state_dict())
    (a, wa), (b, wb) = steps["ppo_clip"], steps["decoupled"]
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    # Adam turns the float noise (the engine-vs-trainer gap, ~1e-7) in near-zero gradients into small moves
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-4
    assert b["is_weight_mean"] == pytest.approx(1.0, abs=1e-4) and b["is_weight_max"] < 1.01
    assert b["is_truncated_frac"] == 0.0 and b["is_masked_frac"] == 0.0 and b["clip_frac"] == 0.0
    assert b["dual_clip_frac"] == 0.0  # the dual clip is off
    assert 0 < b["entropy"] < torch.log(torch.tensor(512.0)).item()  # nats, below a uniform vocabulary's
    assert b["response_len_max"] == 12 and b["response_len_mean"] == 12.0


def test_mini_batches_take_one_optimizer_step_per_mini_batch_against_the_start_of_step_policy(tiny):
    """train.mini_batches=2 on a 2-group batch: under ppo_clip it is exactly two one-group steps (each
    normalised by its own tokens, Adam's state carried); under decoupled on fresh samples the second
    mini-batch is clipped against the *start-of-step* weights (which sampled them), so it equals ppo_clip's
    two steps too -- a proximal policy taken from the moved weights would not."""
    from dora_hpc.train.grpo import split_groups
    from dora_hpc.train.losses import LossConfig

    samples = rollout(Engine(tiny, kv_blocks=128, seed=5), 0, n_groups=2, g=4, step=0)
    a, b = split_groups(samples, 2)
    assert {s.group_id for s in a} == {0} and {s.group_id for s in b} == {1}

    def weights(loss: str, mini: int, steps) -> dict:
        t = GRPOTrainer(tiny, GRPOConfig(lr=3e-2, mini_batches=mini, loss=LossConfig(policy_loss=loss)))
        metrics = [t.train_step(batch) for batch in steps]
        return t.state_dict(), metrics

    two, m2 = weights("ppo_clip", 2, [samples])
    seq, _ = weights("ppo_clip", 1, [a, b])
    assert max(float((two[k] - seq[k]).abs().max()) for k in two) < 1e-6
    assert m2[0]["ratio_mean"] != pytest.approx(1.0, abs=1e-3)  # the second mini-batch saw moved weights
    dec, _ = weights("decoupled", 2, [samples])
    def dist(x: dict, y: dict) -> float:
        return sum(float((x[k] - y[k]).norm()) for k in x)

    # measured: 2.5e-3 (Adam turns the engine-vs-trainer float noise into small moves) against 83
    assert dist(dec, two) < 0.01
    moved, _ = weights("decoupled", 1, [a, b])  # its second step's proximal policy is the moved weights
    assert dist(moved, two) > 1.0


def test_grpo_raises_the_reward_and_published_weights_arrive_bit_exactly(tiny):
    torch.manual_seed(0)
    engine = Engine(tiny, kv_blocks=256, seed=2)
    trainer = GRPOTrainer(tiny, GRPOConfig(lr=5e-3, micro_batch=16))
    first = last = None
    for step in range(12):
        samples = rollout(engine, step, n_groups=4, g=8, step=step)
        r = sum(s.reward for s in samples) / len(samples)
        first = r if first is None else first
        last = r
        trainer.train_step(samples)
        state = trainer.state_dict()
        engine.load_weights(state, version=step + 1)
        loaded = {k: v for k, v in engine.model.state_dict().items() if k in state}
        assert checksum_of(loaded, 1, torch.float32) == checksum_of({k: state[k] for k in loaded}, 1, torch.float32)
    assert last > first + 0.2, (first, last)  # measured: 0.49 -> 0.85


def test_a_checkpoint_before_the_first_step_changes_neither_trainer(tiny):
    """Saving a trainer that has not stepped (a checkpoint at v0, a replica recovering from it) keeps it
    unstepped, and a trainer loaded from it takes the same first step: torch.distributed.checkpoint's getter
    would have initialised Adam by a step at lr 0, which its bias correction counts (0.74 lr, not lr)."""
    samples = [Trajectory(i, i // 4, -1, [3, 5, 9], [7 + i % 5, 11, 13], [-1.0, -2.0, -0.5], float(i % 3))
               for i in range(8)]
    plain, saved = GRPOTrainer(tiny, GRPOConfig(lr=1e-2)), GRPOTrainer(tiny, GRPOConfig(lr=1e-2))
    weights, rest = saved.checkpoint_state()
    loaded = GRPOTrainer(tiny, GRPOConfig(lr=1e-2), seed=5)
    loaded.load_checkpoint(weights, rest)
    for t in (plain, saved, loaded):
        t.train_step(samples)
    ref = checksum_of(plain.state_dict(), 1, torch.float32)
    assert checksum_of(saved.state_dict(), 1, torch.float32) == ref
    assert checksum_of(loaded.state_dict(), 1, torch.float32) == ref


def test_bad_samples_are_refused(tiny):
    trainer = GRPOTrainer(tiny)
    with pytest.raises(ValueError, match="behaviour logprob"):
        trainer.train_step([Trajectory(0, 0, -1, [1, 2], [3, 4], [0.0], 1.0)])


megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")


@pytest.mark.slow
@pytest.mark.parametrize("backend,tp,ac,mini,loss", [("torch", None, False, 2, "ppo_clip,none"),
                                                     ("fsdp", None, False, 1, "gspo,mask"),
                                                     ("fsdp", None, True, 2, "decoupled,truncate"),
                                                     pytest.param("megatron", 2, False, 2, "decoupled,truncate",
                                                                  marks=megatron),
                                                     pytest.param("megatron", 1, True, 1, "ppo_clip,truncate",
                                                                  marks=megatron)])
def test_distributed_trainers_take_the_single_rank_step(tiny, backend, tp, ac, mini, loss):
    """2 gloo trainer ranks over real MPI -- replicated, FSDP2-sharded, megatron-core tensor-parallel (TP=2)
    or megatron data-parallel (TP=1) -- each given the groups it owns (in one step a rank gets none), end
    bit-identical to each other (checked inside) and equal to one torch trainer given every sample, up to
    float summation order; their logits equal the HF model's; their checkpoint resumes a torch trainer.
    With activation checkpointing (``ac``: recomputed layers) the step is the same, and so are ``mini``
    mini-batches (optimizer steps) per train step, the replicas cutting the batch where one rank does, and
    under each policy loss and correction (``loss``)."""
    out = _distributed_against_single(tiny, backend, tp, {"DORA_AC": "1" if ac else "0", "DORA_MINI": str(mini),
                                                          "DORA_LOSS": loss})
    assert out["activation_checkpointing"] == ac and out["mini_batches"] == mini and out["loss"] == loss.split(",")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "fsdp"])
def test_distributed_trainers_computing_shared_prompts_once_take_the_single_rank_step(tiny, backend):
    """train.shared_prompt on 2 ranks (replicated and FSDP2-sharded) against one plain torch trainer: the same
    steps, to the same tolerances as the plain forward."""
    out = _distributed_against_single(tiny, backend, None, {"DORA_SHARED": "1"})
    assert out["shared_prompt"]


def _distributed_against_single(tiny, backend: str, tp: int | None, env: dict[str, str]) -> dict:
    """tests/dp_equivalence.py on 2 ranks: the distributed trainer's steps against one torch rank's."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from dora_hpc.launch.local import mpiexec

    script = Path(__file__).parent / "dp_equivalence.py"
    p = subprocess.run([mpiexec(), "-n", "2", sys.executable, str(script), str(tiny), "token", backend,
                        str(tp or "")], capture_output=True, text=True, timeout=180, env={**os.environ, **env})
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["replicas"] == 2 and out["backend"] == backend and len(out["metrics"]) == 4
    mini = out["mini_batches"]
    for dp_m, single_m in out["metrics"]:
        assert dp_m["tokens"] == single_m["tokens"] and dp_m["clip_frac"] == single_m["clip_frac"]
        for k in ("loss", "ratio_mean", "grad_norm", "reward_mean"):
            # a later mini-batch runs on weights one Adam step on, which amplifies summation-order noise
            # (measured with 2 mini-batches: 2e-5 relative on grad_norm)
            assert dp_m[k] == pytest.approx(single_m[k], rel=1e-5 if mini == 1 else 1e-4), k
    # Adam's step is ~lr per weight whatever the gradient's size, so tiny gradients amplify summation-order
    # noise; measured 7e-5 after 3 steps at lr 1e-2 (a wrong normalisation or a missing share is ~1e-2)
    # measured after 3 steps: torch 9e-5, fsdp 8e-5, megatron TP=2 1.8e-4; resumed 1e-6
    # with 2 mini-batches (twice the Adam steps) torch 7.7e-4; replicas cutting the batch differently: 3e-2
    assert out["max_abs_weight_diff"] < (1e-3 if mini == 1 else 5e-3) and out["resumed_max_abs_weight_diff"] < 1e-3
    assert out["max_abs_logits_diff"] < 1e-5  # measured: 0 (torch, fsdp), 5e-7 (megatron TP=2)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "fsdp"])
def test_lora_on_two_ranks_takes_the_steps_of_one_rank(tiny, backend):
    """train.lora on 2 ranks (replicated, or FSDP2 with the adapter sharded beside the frozen base) against one
    rank: the same losses and adapter within the bounds above, a checkpoint that is the adapter and resumes, and
    the adapter rows each rank publishes (a version is the adapter) those of the one rank."""
    out = _distributed_against_single(tiny, backend, None, {"DORA_LORA": "4"})
    assert out["lora"] == 4 and out["adapter"]
    assert out["published_max_abs_diff"] < 1e-4  # measured: torch 1.6e-5, fsdp 1.1e-5


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "fsdp"])
def test_bf16_mixed_precision_keeps_float32_masters_and_the_step_close(tiny, backend):
    """train.mixed_precision=bf16 (torch: autocast; fsdp: MixedPrecisionPolicy) on 2 ranks against one
    float32 rank: float32 master weights; the first step's loss and ratio within 1e-3 (measured 5e-5), its
    gradient norm within bf16's unit roundoff 2^-8 (a gradient computed in bf16 is no closer than that by
    construction; measured 3e-4 when written, 1.2e-3 under fsdp with torch 2.13 and transformers 5.25), logits
    within 2e-2 (measured 6-8e-3). Later steps drift apart as Adam turns bf16 rounding into +-lr steps
    (weights 5e-2 apart after 3 steps at lr 1e-2), so only the first is bounded."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from dora_hpc.launch.local import mpiexec

    script = Path(__file__).parent / "dp_equivalence.py"
    p = subprocess.run([mpiexec(), "-n", "2", sys.executable, str(script), str(tiny), "token", backend],
                       capture_output=True, text=True, timeout=180, env={**os.environ, "DORA_MP": "bf16"})
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["mixed_precision"] == "bf16" and out["master_dtypes"] == ["torch.float32"]
    assert 1e-4 < out["max_abs_logits_diff"] < 2e-2  # bf16 compute really happened, and is close
    first, single = out["metrics"][0]
    for k, rel in (("loss", 1e-3), ("ratio_mean", 1e-3), ("grad_norm", 2**-8)):
        assert first[k] == pytest.approx(single[k], rel=rel), k


def episodes(engine, n_groups, g, env_tokens=(7, 8, 9, 10)):
    """Two-turn episodes on the engine (KV kept between turns, the environment's tokens appended), as the
    rollout rank runs them; each records where its environment tokens are."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for gi in range(n_groups):
        for s in range(g):
            engine.add(gi * g + s, [3 + 7 * gi, 5, 9], params, 0, hold=True)
    out = {}
    for turn in range(2):
        while engine.has_work():
            for f in engine.step():
                out[f.req_id] = f
        if turn == 0:
            for rid in out:
                engine.extend(rid, list(env_tokens), 6)
    for rid in out:
        engine.abort(rid)
    return [Trajectory(f.req_id, f.req_id // g, 0, f.prompt, f.response, f.logprobs, even_reward(f.response[:6]),
                       env_spans=((6, 6 + len(env_tokens)),)) for f in out.values()]


def test_episodes_train_on_model_tokens_only_and_the_second_turn_is_on_policy(tiny):
    """Environment tokens are context: the step never looks at their logprobs, does not count them, and the
    engine's logprobs of the second turn (with them in context) equal the trainer's (gap: float noise)."""
    samples = episodes(Engine(tiny, kv_blocks=128, seed=4), n_groups=2, g=4)
    assert all(s.model_tokens == 12 and s.model_mask()[6:10] == [0.0] * 4 for s in samples)
    states, ms = [], []
    for env_lp in (0.0, -50.0):  # the environment tokens' recorded logprobs must not matter
        lps = [s.logprobs[:6] + [env_lp] * 4 + s.logprobs[10:] for s in samples]
        trainer = GRPOTrainer(tiny, GRPOConfig(lr=1e-3))
        ms.append(trainer.train_step([Trajectory(s.traj_id, s.group_id, 0, s.prompt, s.response, lp, s.reward,
                                                 env_spans=s.env_spans) for s, lp in zip(samples, lps, strict=True)]))
        states.append(trainer.state_dict())
    assert ms[0]["tokens"] == 8 * 12 and ms[0]["response_len_max"] == 12
    assert ms[0]["logprob_gap"] < 1e-4 and ms[0]["gap_tokens"] == 8 * 12
    assert ms[0]["ratio_mean"] == pytest.approx(1, abs=1e-4)
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_a_shared_prompt_computed_once_gives_the_same_logprobs_loss_and_step(tiny):
    """train.shared_prompt: each distinct prompt of a micro-batch is run once and its KV serves the group's
    samples. Prompts of different lengths (padded on the left), groups split across micro-batches, a KL
    reference and multi-turn samples (environment tokens in the response) give the logprobs, the loss, the
    gradient norm and the step of the plain forward, to float tolerance (measured: logprobs 1e-6)."""
    engine = Engine(tiny, kv_blocks=256, seed=3)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    prompts = [[3 + i for i in range(n)] for n in (5, 13, 9)]
    for gi, p in enumerate(prompts):
        for s in range(4):
            engine.add(gi * 4 + s, p, params, 0)
    samples = [Trajectory(f.req_id, f.req_id // 4, 0, f.prompt, f.response, f.logprobs, even_reward(f.response))
               for f in sorted(run_all(engine).values(), key=lambda f: f.req_id)]
    samples += [Trajectory(100 + s.traj_id, 10 + s.group_id, 0, s.prompt, s.response, s.logprobs, s.reward,
                           env_spans=s.env_spans) for s in episodes(Engine(tiny, kv_blocks=128, seed=4), 1, 4)]
    out = []
    for shared in (False, True):
        t = GRPOTrainer(tiny, GRPOConfig(lr=1e-3, micro_batch=6, kl_coef=0.1, shared_prompt=shared))
        lp, mask = t._token_logprobs(samples)
        out.append((lp, mask, t.train_step(samples), t.state_dict()))
    (lp0, m0, s0, w0), (lp1, m1, s1, w1) = out
    assert torch.equal(m0, m1) and (lp0 - lp1).abs().max() < 1e-5
    for k in ("loss", "grad_norm", "ratio_mean", "kl"):
        assert s1[k] == pytest.approx(s0[k], rel=1e-5, abs=1e-7), k
    # one Adam step turns float noise in tiny gradients into up to ~lr (measured 1.9e-5; a wrong gradient: 1e-3)
    assert max((w0[k] - w1[k]).abs().max() for k in w0) < 1e-4


def test_bf16_autocast_on_a_cpu_without_bfloat16_instructions_warns(tiny, monkeypatch, capsys):
    """Emulated bfloat16 makes a train step about 20x slower than float32 (an AVX2 EPYC): the trainer says so."""
    from dora_hpc.train import backend

    monkeypatch.setattr(backend, "cpu_has_bf16", lambda: False)
    GRPOTrainer(tiny, GRPOConfig(lr=1e-3), mixed_precision="bf16")
    assert "set train.mixed_precision=no" in capsys.readouterr().err
    monkeypatch.setattr(backend, "cpu_has_bf16", lambda: True)
    GRPOTrainer(tiny, GRPOConfig(lr=1e-3), mixed_precision="bf16")
    assert "mixed_precision" not in capsys.readouterr().err
