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
import threading
import time
import uuid
from pathlib import Path

from ..config import RunConfig
from ..runtime.roles import Roles


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
    # -disable-auto-cleanup: mpiexec leaves the job to us when a rank dies, so DeathWatch sees exactly
    # which rank died first and then ends the whole job itself (within milliseconds)
    cmd = [mpiexec(), "-disable-auto-cleanup", "-n", str(n),
           sys.executable, "-m", "dora_hpc.runtime.main", str(run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TRANSFORMERS_VERBOSITY": "error",
           "DORA_HPC_TTY": "1" if sys.stderr.isatty() else "0"}  # rank 0 draws a live dashboard on a TTY
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watcher = DeathWatch(run_dir / "pids", n, on_death=proc.terminate)
    watcher.start()
    for line in proc.stdout:  # pass everything through
        sys.stderr.write(line)
    code = proc.wait()
    watcher.stop()
    if code != 0 and watcher.first_dead is not None:
        r = watcher.first_dead
        role = Roles(n, cfg.cluster.trainer_ranks).role(r)
        sys.stderr.write(f"dora-hpc: rank {r} ({role}) died first; mpiexec ended the whole job\n")
    return code


class DeathWatch(threading.Thread):
    """Polls the ranks' processes; the first one to die (or turn zombie) while the job runs is the
    rank to blame -- mpiexec's own message names only a PID of its choosing. Ranks that raised leave a
    ``.failed`` marker and ranks torn down by mpiexec a ``.cleanup`` one, so a rank that vanished
    without either (killed) is preferred when several die within one poll."""

    def __init__(self, pid_dir: Path, n: int, on_death=None) -> None:
        super().__init__(daemon=True)
        self.pid_dir, self.n, self.on_death = pid_dir, n, on_death
        self.first_dead: int | None = None
        self._halt = threading.Event()

    @staticmethod
    def _alive(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] not in ("Z", "X")
        except (OSError, IndexError):
            return False

    def run(self) -> None:
        pids: dict[int, int] = {}
        while not self._halt.is_set() and self.first_dead is None:
            for f in self.pid_dir.glob("rank-*"):
                name = f.name.removeprefix("rank-")
                if name.isdigit() and int(name) not in pids and f.read_text().strip():
                    pids[int(name)] = int(f.read_text())
            if len(pids) == self.n:
                dead = [r for r, pid in pids.items()
                        if not self._alive(pid) and not (self.pid_dir / f"rank-{r}.done").exists()]
                if dead:  # a rank killed by a signal leaves no marker; prefer it over secondary failures
                    def marked(r: int, kind: str) -> bool:
                        return (self.pid_dir / f"rank-{r}.{kind}").exists()

                    silent = [r for r in dead if not marked(r, "cleanup") and not marked(r, "failed")]
                    self.first_dead = min(silent or [r for r in dead if not marked(r, "cleanup")] or dead)
                    if self.on_death is not None:
                        self.on_death()
            time.sleep(0.002)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=1)

