"""Running untrusted tool code (a model's Python) in a subprocess that cannot reach the network, with a
wall-clock limit, a CPU-time limit, an address-space limit and bounded output.

Invariants:
* the code never runs with network access: its process is placed in a network namespace of its own
  (only a loopback, down) before it starts; where no namespace can be made, nothing runs
  (``SandboxError``), rather than running unisolated;
* it never outlives ``timeout_s``: its whole process group is killed at the wall-clock limit (a CPU-time
  limit of twice that is a backstop for the case the parent cannot act);
* its output never grows past ``max_output`` bytes: stdout and stderr go to files the kernel caps
  (RLIMIT_FSIZE), so a runaway print is stopped, not buffered in our memory.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000


class SandboxError(RuntimeError):
    """The sandbox cannot be set up here (no network namespace): the code is not run."""


@dataclass(frozen=True)
class ToolResult:
    stdout: str
    stderr: str
    exit_code: int | None   # None: killed at the wall-clock limit
    timed_out: bool
    truncated: bool         # stdout or stderr reached max_output and was cut there


def _unshare(flags: int) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.unshare(flags) == 0


def _isolate(mem_bytes: int, cpu_s: int, max_output: int) -> None:
    """In the child, before exec: a network namespace of its own (as root, or in a user namespace where the
    kernel allows one), then the resource limits. Exits 125 when the network cannot be cut off."""
    if not (_unshare(CLONE_NEWNET) or _unshare(CLONE_NEWUSER | CLONE_NEWNET)):
        os.write(2, b"sandbox: cannot make a network namespace here\n")
        os._exit(125)
    resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_output, max_output))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_python(code: str, timeout_s: float = 10.0, mem_mb: int = 512, max_output: int = 16_384) -> ToolResult:
    """Run ``code`` with this interpreter in isolated mode (``-I``: no user site, no PYTHON* variables), in a
    fresh temporary directory, and return what it printed (each stream cut at ``max_output`` bytes)."""
    with tempfile.TemporaryDirectory(prefix="dora-tool-") as tmp, tempfile.TemporaryDirectory() as logs:
        out_path, err_path = Path(logs) / "stdout", Path(logs) / "stderr"  # out of the code's reach
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", code], cwd=tmp, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, start_new_session=True,
                preexec_fn=lambda: _isolate(mem_mb << 20, int(2 * timeout_s) + 1, max_output))  # CPU: a backstop
            try:
                status = proc.wait(timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                status, timed_out = None, True
        if status == 125 and b"cannot make a network namespace" in err_path.read_bytes():
            raise SandboxError("cannot run tool code without network access here: no network namespace "
                               "(needs root, or unprivileged user namespaces)")
        raw_out, raw_err = out_path.read_bytes()[:max_output], err_path.read_bytes()[:max_output]
        # Python ignores SIGXFSZ: a write past the cap raises OSError (EFBIG) in the tool's code instead
        truncated = len(raw_out) >= max_output or len(raw_err) >= max_output or status == -signal.SIGXFSZ
        return ToolResult(raw_out.decode(errors="replace"), raw_err.decode(errors="replace"), status, timed_out,
                          truncated)
