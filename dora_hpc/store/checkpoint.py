"""Atomic checkpoints: ``RUN_DIR/checkpoints/step-{n}/`` (docs/hdf5-schema.md), the nanoGPT way -- resume is
just loading the dict back.

Invariants:
* a checkpoint is written into ``step-{n}.tmp``, every file fsync'd, a ``manifest.json`` with the
  sha256 of every file written last, then the folder is renamed: a ``step-{n}`` folder is complete.
  The two phases are separate calls (``write``, ``commit``) so the runtime can rename only once the
  rollout ranks confirmed that the trajectories the checkpoint relies on are on disk. A write that
  fails (a full disk: DiskFull, naming it) leaves no ``.tmp`` and every earlier checkpoint as it was;
* ``latest`` returns the newest checkpoint whose manifest and file hashes verify and whose optimizer
  pickle holds only tensors and plain data; a corrupt, partial or tampered one is skipped with a
  warning naming it, and the previous one is used. Loading never executes code: safetensors, JSON and
  ``torch.load(weights_only=True)``;
* only the newest ``keep`` complete checkpoints are kept.

Contents: ``weights.safetensors`` (HF names), ``optimizer.pt``, ``state.json`` (step, version, the
ledger, the window, the data cursor, RNG seeds and anything else JSON-able the caller adds).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from . import writing

if TYPE_CHECKING:
    import torch


class CheckpointError(RuntimeError):
    """No usable checkpoint (the message says which were tried and why)."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    state: dict

    def weights(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(self.path / "weights.safetensors")

    def optimizer(self) -> dict:
        import torch

        return torch.load(self.path / "optimizer.pt", weights_only=True, map_location="cpu")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def write(run_dir: Path, step: int, weights: dict[str, torch.Tensor], optimizer: dict, state: dict) -> Path:
    """Phase one: a complete, fsync'd ``step-{n}.tmp`` with its manifest (still invisible to ``latest``)."""
    import torch
    from safetensors.torch import save_file

    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"step-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with writing(root / f"step-{step}", tmp):
        tmp.mkdir()
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, tmp / "weights.safetensors")
        torch.save(optimizer, tmp / "optimizer.pt")
        (tmp / "state.json").write_text(json.dumps({"step": step, **state}))
        files = ["weights.safetensors", "optimizer.pt", "state.json"]
        for f in files:
            _fsync(tmp / f)
        (tmp / "manifest.json").write_text(json.dumps({f: _sha256(tmp / f) for f in files}))
        _fsync(tmp / "manifest.json")
    return tmp


def commit(run_dir: Path, step: int, keep: int = 3) -> Path:
    """Phase two: rename ``step-{n}.tmp`` to ``step-{n}`` (atomic), then keep only the newest ``keep``."""
    root = Path(run_dir) / "checkpoints"
    final, tmp = root / f"step-{step}", root / f"step-{step}.tmp"
    if not tmp.is_dir():
        raise CheckpointError(f"nothing to commit: {tmp} does not exist")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    dfd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    for old in _complete(root)[:-keep]:
        shutil.rmtree(old[1])
    return final


def save(run_dir: Path, step: int, weights: dict[str, torch.Tensor], optimizer: dict, state: dict,
         keep: int = 3) -> Path:
    write(run_dir, step, weights, optimizer, state)
    return commit(run_dir, step, keep)


def _complete(root: Path) -> list[tuple[int, Path]]:
    out = []
    for p in root.glob("step-*"):
        if p.is_dir() and not p.name.endswith(".tmp") and p.name[5:].isdigit():
            out.append((int(p.name[5:]), p))
    return sorted(out)


def verify(path: Path) -> str | None:
    """None if the checkpoint verifies, else why not."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError) as e:
        return f"no readable manifest ({e})"
    for f, digest in manifest.items():
        if not (path / f).is_file():
            return f"{f} is missing"
        if _sha256(path / f) != digest:
            return f"{f} does not match its hash (truncated or corrupt)"
    missing = {"weights.safetensors", "optimizer.pt", "state.json"} - set(manifest)
    if missing:
        return f"its manifest does not list {', '.join(sorted(missing))}"
    import torch

    try:  # mmap: the pickle is checked, the tensors' bytes are not read
        torch.load(path / "optimizer.pt", weights_only=True, mmap=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - whatever torch raises, the file is not a plain state dict
        return f"optimizer.pt holds more than tensors and plain data; loading it could run code ({type(e).__name__})"
    return None


def load(path: Path, verified: bool = False) -> Checkpoint:
    """One named checkpoint, verified (CheckpointError if it does not) unless the caller says it just was:
    hashing every file again on every rank that opens it would read the weights once per rank."""
    path = Path(path)
    why = None if verified else verify(path)
    if why is not None:
        raise CheckpointError(f"checkpoint {path}: {why}")
    return Checkpoint(path, int(path.name.removeprefix("step-")), json.loads((path / "state.json").read_text()))


def latest(run_dir: Path) -> Checkpoint | None:
    """The newest checkpoint that verifies, or None when there is none at all."""
    root = Path(run_dir) / "checkpoints"
    tried = []
    for step, path in reversed(_complete(root) if root.is_dir() else []):
        why = verify(path)
        if why is None:
            return Checkpoint(path, step, json.loads((path / "state.json").read_text()))
        warnings.warn(f"skipping checkpoint {path}: {why}; trying the previous one", stacklevel=2)
        tried.append(f"{path}: {why}")
    if tried:
        raise CheckpointError("no usable checkpoint: " + "; ".join(tried))
    return None
