"""LoRA (train.lora, train/lora.py): the trainer trains a peft adapter on the tiny model with real rollouts; the
adapted policy an engine loads gives the trainer's logprobs; a checkpoint is the adapter and resumes exactly; bad
input is refused with one line naming the key."""

import pytest
import torch
from test_grpo import rollout

from dora_hpc.core.trajectory import Trajectory
from dora_hpc.engine.engine import Engine
from dora_hpc.engine.local_models import build_tiny_model
from dora_hpc.train.grpo import GRPOConfig, GRPOTrainer
from dora_hpc.train.lora import LoraError, LoraSpec, is_adapter

SPEC = LoraSpec(rank=4, alpha=32.0, target_modules="all-linear")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def published(trainer: GRPOTrainer) -> dict[str, torch.Tensor]:
    return trainer.backend.shard_state_dict(0, 1, torch.float32)


def test_only_the_adapter_trains_and_the_engine_serves_the_adapted_policy(tiny):
    trainer = GRPOTrainer(tiny, GRPOConfig(lr=1e-2), lora=SPEC)
    model = trainer.backend.model
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert {id(p) for g in trainer.opt.param_groups for p in g["params"]} == \
        {id(p) for n, p in model.named_parameters() if p.requires_grad}
    base = trainer.backend.shard_state_dict(0, 1, torch.float32, base=True)  # version 0: the frozen base
    engine = Engine(tiny, kv_blocks=128, seed=1, lora_scale=SPEC.scale)
    assert all(torch.equal(base[k], v) for k, v in engine.weights().items())
    first = published(trainer)
    assert first and all(".lora_" in k for k in first) and \
        all(not v.any() for k, v in first.items() if ".lora_B." in k)  # B = 0: the policy is the base

    for step in range(3):
        samples = rollout(engine, step, n_groups=2, g=4, step=step)
        gap = max(abs(a - b) for s, lp in zip(samples, trainer._logprobs_no_grad(samples), strict=True)
                  for a, b in zip(s.logprobs, lp, strict=True))
        assert gap < 1e-5, step  # the engine sampled the trainer's policy under its adapter (float noise)
        assert trainer.train_step(samples)["ratio_mean"] == pytest.approx(1.0, abs=1e-4), step
        engine.load_weights(published(trainer), version=step + 1, add=True)
        engine.retire(step)
    now = published(trainer)
    assert set(now) == set(first)  # the adapter, under the engines' names
    assert any(not torch.equal(now[k], first[k]) for k in now if ".lora_B." in k)
    assert all(torch.equal(base[k], v) for k, v in trainer.backend.shard_state_dict(0, 1, torch.float32,
                                                                                     base=True).items())  # frozen


def test_a_lora_checkpoint_is_the_adapter_and_resumes_exactly(tiny):
    engine = Engine(tiny, kv_blocks=128, seed=3)
    batches = [rollout(engine, 0, n_groups=2, g=4, step=s) for s in range(3)]
    a = GRPOTrainer(tiny, GRPOConfig(lr=1e-2), seed=5, lora=SPEC)
    a.train_step(batches[0])
    weights, rest = a.checkpoint_state()
    layers = a.backend.model.config.num_hidden_layers
    assert is_adapter(weights) and len(weights) == 2 * 7 * layers  # A and B of 7 linears in each layer
    assert sum(v.numel() for v in weights.values()) < 0.05 * sum(v.numel() for v in a.backend.model.parameters())
    b = GRPOTrainer(tiny, GRPOConfig(lr=1e-2), seed=9, lora=SPEC)
    b.load_checkpoint(weights, rest)
    for batch in batches[1:]:
        ma, mb = a.train_step(batch), b.train_step(batch)
        assert ma["loss"] == mb["loss"] and ma["grad_norm"] == mb["grad_norm"]
    wa, wb = published(a), published(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_weights_of_the_other_kind_are_refused(tiny):
    lora = GRPOTrainer(tiny, GRPOConfig(), lora=SPEC)
    full = GRPOTrainer(tiny, GRPOConfig())
    with pytest.raises(LoraError, match="not a LoRA adapter"):
        lora.load_checkpoint(*full.checkpoint_state())
    with pytest.raises(LoraError, match="without train.lora"):
        full.load_checkpoint(*lora.checkpoint_state())
    other = GRPOTrainer(tiny, GRPOConfig(), lora=LoraSpec(rank=2, alpha=32.0, target_modules=("q_proj", "v_proj")))
    with pytest.raises(LoraError, match="does not fit"):
        other.load_checkpoint(*lora.checkpoint_state())


def test_target_modules_that_match_nothing_are_named(tiny):
    with pytest.raises(LoraError, match=r"train.lora.target_modules \('qkv',\)"):
        GRPOTrainer(tiny, GRPOConfig(), lora=LoraSpec(rank=4, alpha=8.0, target_modules=("qkv",)))


# -- a real run under train.lora ------------------------------------------------------------------------------------
def cli(*args, timeout=300):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, "-m", "dora_hpc.cli", *args], cwd=repo, capture_output=True, text=True,
                          timeout=timeout)


LORA_RUN = ["--set", "train.lora={rank: 4, alpha: 16}", "--set", "train.lr=0.05", "--set", "batch.tbs=4",
            "--set", "batch.rbs=6", "--set", "train.checkpoint_every=2"]


@pytest.mark.slow
def test_a_lora_run_resumes_from_its_adapter_and_exports_an_adapter_and_a_merged_model(tmp_path):
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from dora_hpc.analysis.basic import analyze

    run = tmp_path / "run"
    p = cli("run", "configs/tiny-cpu.yaml", *LORA_RUN, "--set", "train.max_steps=2", "--run-dir", str(run))
    assert p.returncode == 0, p.stderr[-3000:]
    p = cli("run", "configs/tiny-cpu.yaml", *LORA_RUN, "--set", "train.max_steps=4", "--run-dir", str(run), "--resume")
    assert p.returncode == 0, p.stderr[-3000:]
    a = analyze(run)
    assert a["steps"] == 4 and not any(v for k, v in a["invariants"].items() if k != "offenders")
    assert a["logprob_gap"]["max"] < 1e-5  # the engines serve the trainer's adapted policy
    # versions are adapters: every instance hosts each live one, batches them together, and nothing migrates
    assert a["multi_version_batches"] > 0 and a["migrations"] == 0
    with __import__("safetensors").safe_open(run / "checkpoints" / "step-4" / "weights.safetensors", "pt") as f:
        assert all(".lora_" in k for k in f.keys())  # a checkpoint is the adapter

    assert cli("export", str(run), "--out", str(tmp_path / "adapter")).returncode == 0
    assert cli("export", str(run), "--out", str(tmp_path / "merged"), "--merged").returncode == 0
    info = json.loads((tmp_path / "adapter" / "dora_hpc_export.json").read_text())
    assert info["kind"] == "adapter" and info["step"] == 4
    ids = torch.tensor([list(range(5, 21))])
    base = AutoModelForCausalLM.from_pretrained(info["source_model"], dtype=torch.float32)
    with torch.no_grad():
        plain = base(ids).logits
        adapted = PeftModel.from_pretrained(base, tmp_path / "adapter")(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)(ids).logits
    assert (adapted - merged).abs().max().item() < 1e-4
    assert (adapted - plain).abs().max().item() > 1e-3  # trained, not the base

    full = cli("export", str(run), "--out", str(tmp_path / "x"), "--merged", "--step", "0")
    assert full.returncode == 0  # step 0: the fresh adapter, merged: the base model


def test_lora_bad_input_is_one_line_naming_the_key(tmp_path):
    for sets, key in ((["train.lora={target_modules: [qkv]}"], "train.lora.target_modules"),
                      (["train.lora={rank: 4096}"], "train.lora.rank"),
                      (["train.lora={rank: 1024}", "engine.backend=vllm"], "train.lora.rank=1024: engine.backend=vllm"),
                      (["train.lora={rank: 4}", "train.backend=megatron"], "train.lora is for the torch and fsdp"),
                      (["train.lora={rank: 0}"], "train.lora.rank")):
        p = cli("run", "configs/tiny-cpu.yaml", *[x for s in sets for x in ("--set", s)], "--run-dir",
                str(tmp_path / "r"), timeout=120)
        assert p.returncode == 2 and key in p.stderr and "Traceback" not in p.stderr, (sets, p.stderr[-2000:])
        assert not list((tmp_path / "r").glob("*.h5"))


# -- versions as adapters on the built-in engine ----------------------------------------------------------------------
def test_one_engine_batches_two_versions_adapters_with_each_versions_logprobs(tiny):
    """The trainer publishes its adapter (train/lora.py published_adapter); an engine holding the base once and
    the adapters of v1 and v2 runs requests of v0, v1 and v2 in the same forwards, and each request's logprobs are
    the trainer's forward under its own version's adapter."""
    from dora_hpc.engine.lora import AdapterError
    from dora_hpc.engine.sampling import SamplingParams

    spec = LoraSpec(4, 16.0, "all-linear")
    trainer = GRPOTrainer(tiny, GRPOConfig(lr=5e-2), lora=spec)
    engine = Engine(tiny, kv_blocks=128, seed=4, lora_scale=spec.scale)
    adapters, copies = {}, {}
    for v in (1, 2):
        trainer.train_step(rollout(Engine(tiny, kv_blocks=128, seed=v), 0, n_groups=2, g=4, step=v))
        adapters[v] = published(trainer)
        assert all(".lora_" in k for k in adapters[v])
        engine.load_weights(adapters[v], version=v, add=True)
        copies[v] = {k: t.clone() for k, t in trainer.backend.model.state_dict().items() if ".lora_" in k}
    assert engine.versions == {0, 1, 2} and engine.version == 2
    steps = []
    prompt = [3, 5, 9, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67]  # a block and more: cached
    for i in range(9):
        engine.add(i, prompt, SamplingParams(max_tokens=10, ignore_eos=True), version=i % 3)
    done = []
    while engine.has_work():
        done += engine.step()
        steps.append(len({s.version for s in engine.seqs.values()}))
    assert max(steps) == 3  # one forward held all three versions' requests
    assert {f.version for f in done} == {0, 1, 2}
    model = trainer.backend.model
    for v in (0, 1, 2):
        state = {k: (torch.zeros_like(t) if ".lora_B." in k else t) for k, t in copies[1].items()} if v == 0 \
            else copies[v]
        model.load_state_dict(state, strict=False)
        mine = [f for f in done if f.version == v]
        samples = [Trajectory(f.req_id, 0, v, f.prompt, f.response, f.logprobs, 0.0) for f in mine]
        got = trainer._logprobs_no_grad(samples)
        gap = max(abs(a - b) for s, lp in zip(samples, got, strict=True) for a, b in zip(s.logprobs, lp, strict=True))
        assert gap < 1e-5, v
    a, b = ([f.response for f in done if f.version == v] for v in (1, 2))
    assert a != b  # the versions really differ
    with pytest.raises(Exception, match="hosts"):
        engine.add(99, prompt, SamplingParams(max_tokens=2), version=3)
    with pytest.raises(AdapterError, match="adapts no linear"):
        engine.load_weights({"model.layers.0.nope.lora_A.weight": torch.zeros(4, 8),
                             "model.layers.0.nope.lora_B.weight": torch.zeros(8, 4)}, version=3, add=True)
    engine.retire(1)
    assert engine.versions == {0, 2} and 1 not in engine.adapters.by_version
    base = engine.model.state_dict()
    engine.retire(0)
    engine.load_weights({k: t.clone() for k, t in base.items()}, version=0, add=True)  # the base's version, again
    assert engine.versions == {0, 2} and engine.version == 2
    with pytest.raises(Exception, match="not the base"):
        engine.load_weights({k: t + 1 for k, t in base.items()}, version=0, add=True)
    with pytest.raises(Exception, match="live requests"):
        engine.add(100, prompt, SamplingParams(max_tokens=2), version=2)
        engine.load_weights(adapters[1], version=1)  # without add: it would replace what the live request runs
    engine.abort(100)
    engine.load_weights(adapters[1], version=1)  # a version that replaces the others (modes that do not share)
    assert engine.versions == {1} and set(engine.adapters.by_version) == {1}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "fsdp"])
def test_two_trainer_ranks_publish_the_adapter_in_shards(tmp_path, backend):
    """Two trainer ranks (replicas checking each other's shard, or FSDP2's own shards of the adapter) publish each
    version's adapter in the trainers' layout; the instances put it together, check its checksum and serve it."""
    from dora_hpc.analysis.basic import analyze

    run = tmp_path / "run"
    p = cli("run", "configs/tiny-cpu.yaml", *LORA_RUN, "--set", "train.max_steps=4", "--set", "cluster.trainer_ranks=2",
            "--set", f"train.backend={backend}", "--run-dir", str(run))
    assert p.returncode == 0, p.stderr[-3000:]
    a = analyze(run)
    assert a["steps"] == 4 and not any(v for k, v in a["invariants"].items() if k != "offenders")
    assert a["weights"]["mismatched_loads"] == 0 and a["logprob_gap"]["max"] < 1e-5
    assert a["multi_version_batches"] > 0 and a["migrations"] == 0
