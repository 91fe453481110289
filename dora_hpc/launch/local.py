"""Local launch: one ``mpiexec`` with 1 orchestrator + T trainer + R rollout ranks on this machine.

Invariant: everything a rank needs is in ``RUN_DIR/launch.json`` (the validated config, the model
folder, the run id, the shared clock origin), written before any rank starts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

from ..config import RunConfig


def resolve_model(cfg: RunConfig) -> Path:
    from ..engine.local_models import build_tiny_model, convert_smollm2

    if cfg.model.path == "tiny":
        return build_tiny_model(seed=0)
    if cfg.model.path == "smollm2":
        return convert_smollm2()
    return Path(cfg.model.path)


def mpiexec() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if not found:
        raise RuntimeError("no mpiexec: pip install mpi4py mpich (tools/setup.sh does)")
    return found


def launch(cfg: RunConfig, run_dir: Path) -> int:
    from ..engine.model import ModelSpec, load_hf_config

    run_dir.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model(cfg)
    spec = ModelSpec.from_hf(load_hf_config(model_dir))
    meta = {"config": cfg.model_dump(mode="json"), "model_dir": str(model_dir), "vocab_size": spec.vocab_size,
            "run_id": f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}", "t0": time.time()}
    (run_dir / "launch.json").write_text(json.dumps(meta, indent=2))
    n = 1 + cfg.cluster.trainer_ranks + cfg.cluster.rollout_ranks
    cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "dora_hpc.runtime.main", str(run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, env=env).returncode
