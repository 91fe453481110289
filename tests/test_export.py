"""``dora-hpc export``: a tiny run's checkpoint as a Hugging Face folder that transformers loads with the
checkpoint's logits and the built-in engine's greedy tokens; sharding, bfloat16, and clear errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_util import run_all
from safetensors.torch import load_file

from dora_hpc.engine.engine import Engine
from dora_hpc.engine.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "dora_hpc.cli"]
PROMPT = list(range(5, 21))


def cli(*args, timeout=300):
    return subprocess.run([*CLI, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("export") / "run"
    p = cli("run", "configs/tiny-cpu.yaml", "--set", "train.max_steps=4", "--set", "train.checkpoint_every=2",
            "--set", "batch.tbs=4", "--set", "batch.rbs=6", "--set", "train.lr=0.01", "--run-dir", str(d))
    assert p.returncode == 0, p.stderr[-3000:]
    return d


def logits(model_or_dir, state=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_or_dir, dtype=torch.float32)
    if state is not None:
        model.load_state_dict(state, strict=False)
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0]


@pytest.mark.slow
def test_an_exported_checkpoint_loads_in_transformers_with_its_logits_and_generates_as_the_engine(run_dir, tmp_path):
    out = tmp_path / "hf"
    p = cli("export", str(run_dir), "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    info = json.loads((out / "dora_hpc_export.json").read_text())
    assert info["step"] == 4 and info["dtype"] == "float32"  # the newest checkpoint: the run's last step
    assert {"config.json", "generation_config.json", "tokenizer.json", "model.safetensors"} <= {
        f.name for f in out.iterdir()}
    model_dir = Path(json.loads((run_dir / "launch.json").read_text())["model_dir"])
    state = load_file(run_dir / "checkpoints" / "step-4" / "weights.safetensors")
    got, want = logits(out), logits(model_dir, state)
    assert (got - want).abs().max().item() <= 1e-6
    assert (got - logits(model_dir)).abs().max().item() > 1e-3  # the trained weights, not the initial ones
    engine = Engine(model_dir, kv_blocks=64, block_size=16, max_num_seqs=4, max_batched_tokens=256, seed=0)
    engine.load_weights(state, version=4)
    engine.add(0, PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), 4)
    tokens = run_all(engine)[0].response
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[0]
    assert ids[len(PROMPT):].tolist() == list(tokens)


@pytest.mark.slow
def test_export_shards_and_writes_bfloat16(run_dir, tmp_path):
    out = tmp_path / "bf16"
    p = cli("export", str(run_dir), "--step", "2", "--out", str(out), "--dtype", "bfloat16", "--max-shard-size", "1MB")
    assert p.returncode == 0, p.stderr[-3000:]
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) >= 2 and (out / "model.safetensors.index.json").is_file()
    assert all(t.dtype == torch.bfloat16 for s in shards for t in load_file(s).values())
    state = load_file(run_dir / "checkpoints" / "step-2" / "weights.safetensors")
    model_dir = Path(json.loads((run_dir / "launch.json").read_text())["model_dir"])
    assert (logits(out) - logits(model_dir, state)).abs().max().item() < 0.1  # bf16 rounding only


@pytest.mark.slow
def test_export_errors_name_the_step_the_run_or_the_folder(run_dir, tmp_path):
    p = cli("export", str(run_dir), "--step", "3", "--out", str(tmp_path / "a"))
    assert p.returncode == 2 and "no checkpoint step-3" in p.stderr and "Traceback" not in p.stderr
    p = cli("export", str(tmp_path), "--out", str(tmp_path / "b"))
    assert p.returncode == 2 and "not a run directory" in p.stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    p = cli("export", str(run_dir), "--out", str(tmp_path / "full"))
    assert p.returncode == 2 and "not empty" in p.stderr
    # a corrupt newest checkpoint: named when asked for, skipped (with a warning) by default
    broken = tmp_path / "broken"
    subprocess.run(["cp", "-r", str(run_dir), str(broken)], check=True)
    weights = broken / "checkpoints" / "step-4" / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    p = cli("export", str(broken), "--step", "4", "--out", str(tmp_path / "c"))
    assert p.returncode == 2 and "step-4" in p.stderr and not (tmp_path / "c").exists()
    p = cli("export", str(broken), "--out", str(tmp_path / "d"))
    assert p.returncode == 0 and "skipping checkpoint" in p.stderr, p.stderr[-2000:]
    assert json.loads((tmp_path / "d" / "dora_hpc_export.json").read_text())["step"] == 2
