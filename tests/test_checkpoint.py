import pytest
import torch

from dora_hpc.core.ledger import Ledger
from dora_hpc.core.window import VersionWindow
from dora_hpc.store import checkpoint


def state_for(step):
    led = Ledger(group_size=2)
    for v in range(step + 1):
        led.new_group(v)
    win = VersionWindow(k=2, tbs=1)
    return {"version": step + 1, "ledger": led.to_dict(), "window": win.to_dict(), "data_cursor": led.next_group,
            "rng": {"torch": 1234 + step}}


def weights(step):
    g = torch.Generator().manual_seed(step)
    return {"model.embed_tokens.weight": torch.randn(8, 4, generator=g),
            "lm_head.weight": torch.randn(8, 4, generator=g)}


def test_round_trip_and_retention(tmp_path):
    for step in range(5):
        checkpoint.save(tmp_path, step, weights(step), {"adam": {"lr": 0.1 * step}}, state_for(step), keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-3", "step-4"]
    ck = checkpoint.latest(tmp_path)
    assert ck.step == 4 and ck.state["version"] == 5
    assert all(torch.equal(ck.weights()[k], weights(4)[k]) for k in weights(4))
    assert ck.optimizer() == {"adam": {"lr": 0.4}}
    led = Ledger.from_dict(ck.state["ledger"])
    assert led.next_group == ck.state["data_cursor"] == 5
    assert VersionWindow.from_dict(ck.state["window"]).k == 2


def test_a_truncated_checkpoint_is_skipped_with_a_warning(tmp_path):
    checkpoint.save(tmp_path, 1, weights(1), {}, state_for(1))
    p = checkpoint.save(tmp_path, 2, weights(2), {}, state_for(2))
    w = p / "weights.safetensors"
    w.write_bytes(w.read_bytes()[: len(w.read_bytes()) // 2])
    (tmp_path / "checkpoints" / "step-3.tmp").mkdir()  # a crash mid-write leaves only a .tmp
    with pytest.warns(UserWarning, match="step-2.*does not match its hash"):
        ck = checkpoint.latest(tmp_path)
    assert ck.step == 1


def test_no_checkpoint_and_only_corrupt_ones(tmp_path):
    assert checkpoint.latest(tmp_path) is None
    p = checkpoint.save(tmp_path, 1, weights(1), {}, state_for(1))
    (p / "manifest.json").unlink()
    with pytest.warns(UserWarning), pytest.raises(checkpoint.CheckpointError, match="no usable checkpoint"):
        checkpoint.latest(tmp_path)


class RunsCode:
    """What a tampered optimizer.pt could hold: unpickling it calls os.system."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_an_optimizer_pickle_that_would_run_code_is_refused_and_the_previous_checkpoint_used(tmp_path):
    import hashlib
    import json

    checkpoint.save(tmp_path, 1, weights(1), {"adam": {"lr": 0.1}}, state_for(1))
    p = checkpoint.save(tmp_path, 2, weights(2), {"adam": {"lr": 0.2}}, state_for(2))
    marker = tmp_path / "code-ran"
    torch.save({"adam": RunsCode(marker)}, p / "optimizer.pt")
    manifest = json.loads((p / "manifest.json").read_text())  # rewritten too: the hashes match
    manifest["optimizer.pt"] = hashlib.sha256((p / "optimizer.pt").read_bytes()).hexdigest()
    (p / "manifest.json").write_text(json.dumps(manifest))
    with pytest.warns(UserWarning, match=f"skipping checkpoint {p}: optimizer.pt holds more than tensors"):
        ck = checkpoint.latest(tmp_path)
    assert ck.step == 1 and ck.optimizer() == {"adam": {"lr": 0.1}}
    with pytest.raises(checkpoint.CheckpointError, match="could run code"):
        checkpoint.load(p)
    assert not marker.exists()
