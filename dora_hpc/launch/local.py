"""Local launch: one ``mpiexec`` with 1 orchestrator + T trainer + R rollout ranks on this machine.

Invariants:
* everything a rank needs is in ``RUN_DIR/launch.json`` (the validated config, the model folder, the
  run id, the shared clock origin, whether to resume), written before any rank starts; a resume keeps
  the run id and clock origin, and refuses a config that changes what the checkpoint depends on;
* mpiexec and the ranks run in a session of their own: SIGTERM/SIGINT to the launcher (or to its
  process group: a terminal's Ctrl-C) become one SIGTERM to rank 0 (commit a checkpoint, then end);
  a second one kills the job's session; if the launcher itself is killed, mpiexec and every rank die with it;
* a dead rollout rank does not end the job while rank 0 and another rollout rank live: DeathWatch leaves
  ``pids/rank-N.dead`` and rank 0 fences it (its work starts again elsewhere). Any other death ends the
  whole job at once, naming the rank that died first. mpiexec's own notice of a death (SIGUSR1 to every
  survivor, under -disable-auto-cleanup) is ignored by the ranks (DORA_HPC_HYDRA=1).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from .. import quiet_hf
from ..config import RunConfig, validate
from ..runtime.dashboard import LiveView
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


# config keys a resumed run may change; any other difference from the checkpointed run is refused. The
# allocation may change too (a resume onto other nodes): checkpoints hold whole weights and optimizer
# state whatever the rank counts, and the groups in flight are regenerated whole on the new instances
RESUMABLE_CHANGES = ("train.max_steps", "train.checkpoint_every", "train.keep_checkpoints",
                     "train.activation_checkpointing", "runtime.", "slurm.", "metrics.",
                     "cluster.rollout_instances", "cluster.trainer_ranks", "cluster.elastic", "engine.")
PREEMPTED = 3  # exit code: stopped by a signal after committing a checkpoint; continue with --resume
RESUMABLE = 75  # exit code (sysexits' EX_TEMPFAIL): stopped by a cause outside the run (a full disk, a hung
#                 rank); fix it,
#                 then continue with --resume from the last committed checkpoint


# each rank's parent under mpiexec: it ignores the signals the rank handles itself (the rank installs
# its own handlers) and exits with the rank's status (128+N when signal N killed it), never by a signal;
# a status over 128 it also leaves in pids/rank-N.status, so the launcher can name the signal
RANK_SHELL = ("trap '' INT TERM USR1; \"$0\" \"$@\"; s=$?; "
              "[ $s -gt 128 ] && echo $s > \"$DORA_HPC_PID_DIR/rank-$PMI_RANK.status\"; exit $s")


class LaunchError(RuntimeError):
    """A launch that would lose or mix up a run's data (the message says what to do instead)."""


def _flat(tree: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def prepare(cfg: RunConfig, run_dir: Path, resume: str = "no") -> dict:
    """Write (or, on resume, update) ``launch.json``; returns it. ``resume``: no | required | if_any."""
    from ..engine.spec import read_spec
    from ..train.lora import LoraError, LoraSpec
    from ..train.lora import check as check_lora

    run_dir.mkdir(parents=True, exist_ok=True)
    meta_path = run_dir / "launch.json"
    (run_dir / "preempted.json").unlink(missing_ok=True)
    if resume == "no":
        if (run_dir / "attempts.jsonl").exists() or list(run_dir.glob("*.h5")):
            raise LaunchError(f"{run_dir} already holds a run; continue it with --resume or pick a new --run-dir")
        model_dir = resolve_model(cfg)
        spec = read_spec(model_dir)
        if (lora := LoraSpec.of(cfg)) is not None:
            try:
                check_lora(model_dir, lora)
            except LoraError as e:
                raise LaunchError(str(e)) from None
        meta = {"model_dir": str(model_dir), "vocab_size": spec.vocab_size,
                "run_id": f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}", "t0": time.time()}
    else:
        if not meta_path.exists():
            raise LaunchError(f"nothing to resume in {run_dir}: no launch.json (was a run ever started there?)")
        meta = json.loads(meta_path.read_text())
        if resume == "required":
            from ..store.checkpoint import CheckpointError, latest

            try:
                found = latest(run_dir)  # warns, naming each corrupt checkpoint it skips
            except CheckpointError as e:
                raise LaunchError(f"{e}; pass --allow-fresh to start again from step 0") from None
            if found is None:
                raise LaunchError(f"no checkpoint under {run_dir / 'checkpoints'} to resume from; pass "
                                  "--allow-fresh to start the run again from step 0 (earlier logs are kept)")
        # the saved config in today's names (an older release's run may use deprecated ones)
        old = _flat(validate(meta["config"], saved=True).model_dump(mode="json"))
        new = _flat(cfg.model_dump(mode="json"))
        changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k)
                         and not k.startswith(RESUMABLE_CHANGES))
        if changed:
            raise LaunchError(f"resume with a different config: {', '.join(changed)} changed "
                              f"(only {', '.join(RESUMABLE_CHANGES)} may); omit CONFIG to reuse the run's own")
    meta.update({"config": cfg.model_dump(mode="json"), "resume": resume})
    tmp = meta_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, meta_path)
    return meta


def saved_config(run_dir: Path) -> dict:
    try:
        return json.loads((Path(run_dir) / "launch.json").read_text())["config"]
    except (OSError, ValueError, KeyError) as e:
        raise LaunchError(f"cannot read the config of the run in {run_dir}: {e}") from None


def _die_with_parent() -> None:  # runs in the child before exec: SIGKILL it when the launcher dies
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def check_device(cfg: RunConfig) -> None:
    if cfg.runtime.device == "cuda":
        import torch

        if torch.cuda.device_count() == 0:  # NVML: CUDA itself is not initialised here
            raise LaunchError("runtime.device=cuda, but this machine has no GPU that torch can use "
                              f"(torch {torch.__version__}); run with runtime.device=cpu")


def launch(cfg: RunConfig, run_dir: Path, resume: str = "no") -> int:
    """Run the job; returns mpiexec's exit code, or PREEMPTED when a signal stopped it at a checkpoint."""
    check_device(cfg)
    quiet_hf()  # before the model is converted or cached here, and for every rank mpiexec starts
    prepare(cfg, run_dir, resume)
    n = 1 + cfg.cluster.trainer_ranks + cfg.cluster.rollout_instances
    pid_dir = run_dir / "pids"
    shutil.rmtree(pid_dir, ignore_errors=True)  # markers of an earlier launch would mislead DeathWatch
    # -disable-auto-cleanup: mpiexec leaves the job to us when a rank exits, so DeathWatch sees exactly
    # which rank died first and decides (it fences a dead rollout rank, or ends the whole job itself
    # within milliseconds). mpiexec still ends every rank when one is killed by a signal, so each rank
    # runs under a shell that turns its death into an exit status (and leaves the signals to it)
    cmd = [mpiexec(), "-disable-auto-cleanup", "-n", str(n), "/bin/sh", "-c", RANK_SHELL,
           sys.executable, "-m", "dora_hpc.runtime.main", str(run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "DORA_HPC_HYDRA": "1",
           "DORA_HPC_PID_DIR": str(pid_dir),
           "DORA_HPC_TTY": "1" if sys.stderr.isatty() else "0"}  # rank 0 draws a live dashboard on a TTY
    env.pop("SLURM_JOB_ID", None)  # a local run inside an allocation is still a local run (signals)
    # a session of its own: a terminal's Ctrl-C or a signal to our process group reaches this launcher
    # alone, which turns it into one stop request to rank 0 (mpiexec would forward it to every rank)
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, preexec_fn=_die_with_parent)

    def end_job() -> None:  # every rank at once: ranks take SIGTERM as a stop request, not as an end
        pids = [int(f.read_text()) for f in pid_dir.glob("rank-*") if f.name[5:].isdigit() and f.read_text()]
        for pid in [*pids, proc.pid]:  # hydra starts each rank in a session of its own: one by one
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(pid, signal.SIGKILL)

    watcher = DeathWatch(pid_dir, Roles(n, cfg.cluster.trainer_ranks, replicated=cfg.train.replicas > 1),
                         on_death=end_job)
    watcher.start()
    asked = []

    def on_signal(signum, frame):
        asked.append(signum)
        rank0 = pid_dir / "rank-0"
        if len(asked) == 1 and rank0.exists():
            sys.stderr.write(f"dora-hpc: signal {signum}: committing a checkpoint, then stopping "
                             "(send it again to stop at once)\n")
            os.kill(int(rank0.read_text()), signal.SIGTERM)
        else:
            end_job()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    view = LiveView(tty=sys.stderr.isatty())
    try:
        for line in proc.stdout:  # rank 0's status lines drive the panel; everything else passes through
            if not view.feed(line):
                sys.stderr.write(line)
        code = proc.wait()
    finally:
        view.stop()  # before anything else is printed: the terminal is left clean, the cursor shown
        for s, h in previous.items():
            signal.signal(s, h)
        watcher.stop()
    return outcome(code, cfg, run_dir, watcher, asked, n)


def outcome(code: int, cfg: RunConfig, run_dir: Path, watcher: DeathWatch, asked: list[int], n: int) -> int:
    """The launcher's exit code for how the job ended, and the one line that says why."""
    pid_dir = run_dir / "pids"
    if code != 0 and watcher.fenced and (pid_dir / "rank-0.done").exists():
        code = 0  # rank 0 ended the job over the ranks it fenced (MPI_Abort(0)); mpiexec reports their deaths
    if len(asked) > 1:
        sys.stderr.write("dora-hpc: stopped at once by a second signal; the last committed checkpoint stands; "
                         f"continue with: dora-hpc run --resume --run-dir {run_dir}\n")
        return 128 + asked[-1]  # as a shell reports a process a signal ended
    failed = [m.read_text() for m in sorted(pid_dir.glob("rank-*.failed"))]
    for why, then in (("DiskFull", "free space, then continue"), ("RankHung", "continue")):
        found = [m.split(": ", 1)[1].split("] ", 1)[-1] for m in failed if m.startswith(f"{why}:")]
        if code != 0 and found:
            sys.stderr.write(f"dora-hpc: {found[0]}; every complete shard and checkpoint is intact: {then} "
                             f"with: dora-hpc run --resume --run-dir {run_dir}\n")
            return RESUMABLE
    if code != 0 and watcher.first_dead is not None:
        r = watcher.first_dead
        role = Roles(n, cfg.cluster.trainer_ranks).role(r)
        sys.stderr.write(f"dora-hpc: rank {r} ({role}) died first{killed_by(pid_dir / f'rank-{r}.status')}; "
                         "mpiexec ended the whole job\n")
    if code == 0 and (run_dir / "preempted.json").exists():
        step = json.loads((run_dir / "preempted.json").read_text())["checkpoint_step"]
        sys.stderr.write(f"dora-hpc: stopped at checkpoint step-{step}; continue with: "
                         f"dora-hpc run --resume --run-dir {run_dir}\n")
        return PREEMPTED
    return code


def killed_by(status_file: Path) -> str:
    """", killed by SIGNAME" from a rank's exit status as its shell left it ("" when it left none)."""
    try:
        sig = signal.Signals(int(status_file.read_text()) - 128)
    except (OSError, ValueError):
        return ""
    oom = " (the kernel's out-of-memory killer sends it: see dmesg)" if sig == signal.SIGKILL else ""
    return f", killed by {sig.name}{oom}"


class DeathWatch(threading.Thread):
    """Polls the ranks' processes. A rollout rank (or a trainer replica, ``train.replicas``) that dies while
    rank 0 and another of its kind live gets a ``rank-N.dead`` marker, which rank 0 acts on (it fences the
    rank); the first other rank to die (or turn zombie) while the job runs is the rank to blame --
    mpiexec's own message names only a PID of its choosing -- and ``on_death`` ends the job. Ranks that
    raised leave a ``.failed`` marker and ranks torn down by mpiexec a ``.cleanup`` one, so a rank that
    vanished without either (killed) is preferred when several die within one poll; a rank that raised
    always ends the job."""

    def __init__(self, pid_dir: Path, roles: Roles, on_death=None) -> None:
        super().__init__(daemon=True)
        self.pid_dir, self.roles, self.on_death = pid_dir, roles, on_death
        self.first_dead: int | None = None
        self.fenced: list[int] = []  # ranks that died and were left to rank 0
        self.shells: dict[int, int | None] = {}  # each rank's parent: the RANK_SHELL that records its status
        self._halt = threading.Event()

    @staticmethod
    def _stat(pid: int) -> list[str]:
        """/proc/PID/stat's fields after the command name: state, parent pid, ... ([] once it is gone)."""
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()
        except OSError:
            return []

    @staticmethod
    def _alive(pid: int) -> bool:
        return DeathWatch._stat(pid)[:1] not in ([], ["Z"], ["X"])

    @staticmethod
    def _parent(pid: int) -> int | None:
        fields = DeathWatch._stat(pid)
        return int(fields[1]) if len(fields) > 1 else None

    def _marked(self, r: int, kind: str) -> bool:
        return (self.pid_dir / f"rank-{r}.{kind}").exists()

    def run(self) -> None:
        pids: dict[int, int] = {}
        while not self._halt.is_set() and self.first_dead is None:
            for f in self.pid_dir.glob("rank-*"):
                name = f.name.removeprefix("rank-")
                if name.isdigit() and int(name) not in pids and f.read_text().strip():
                    r = int(name)
                    pids[r] = int(f.read_text())
                    self.shells[r] = self._parent(pids[r])
            if len(pids) == self.roles.size:
                dead = [r for r, pid in pids.items() if r not in self.fenced
                        and not self._alive(pid) and not self._marked(r, "done")]
                if dead:
                    self.on_dead(dead, pids)
            time.sleep(0.002)

    def on_dead(self, dead: list[int], pids: dict[int, int]) -> None:
        lost = [r for r in dead if self.roles.fenceable(r) and not self._marked(r, "failed")]
        kinds = {self.roles.role(r): self.roles.rollout_ranks if self.roles.role(r) == "rollout"
                 else self.roles.trainer_ranks for r in lost}  # a trainer replica's kind: the trainers
        left = all(any(r not in self.fenced and r not in dead for r in ranks) for ranks in kinds.values())
        if len(lost) == len(dead) and left and self._alive(pids[0]) and not self._marked(0, "done"):
            for r in lost:  # rank 0 fences it and the run goes on without it
                self.fenced.append(r)
                (self.pid_dir / f"rank-{r}.dead").write_text(str(pids[r]))  # this start's process
            return
        # a rank killed by a signal leaves no marker; prefer it over secondary failures
        silent = [r for r in dead if not self._marked(r, "cleanup") and not self._marked(r, "failed")]
        self.first_dead = min(silent or [r for r in dead if not self._marked(r, "cleanup")] or dead)
        # its shell writes the signal to rank-N.status as it exits; ending the job first could kill it before
        shell, deadline = self.shells.get(self.first_dead), time.monotonic() + 2
        while shell is not None and self._alive(shell) and time.monotonic() < deadline:
            time.sleep(0.002)
        if self.on_death is not None:
            self.on_death()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=1)
