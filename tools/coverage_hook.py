"""Names the test behind each line a subprocess runs under tools/coverage.sh.

`python tools/coverage_hook.py` installs this file's ``label()`` as a ``.pth`` in the venv's site-packages,
read at every Python start after coverage's own ``a1_coverage.pth`` (which starts coverage when
COVERAGE_PROCESS_CONFIG or COVERAGE_PROCESS_START is set). In such a process started while a test runs --
a ``dora-hpc`` CLI, mpiexec's ranks, a Slurm task, an environment worker -- it sets coverage's context to
that test, read from the inherited PYTEST_CURRENT_TEST and named as pytest-cov's ``--cov-context=test``
names it in the pytest process (``tests/test_x.py::test_y[p]|run``). Elsewhere it does nothing. A .pth and
not sitecustomize: some tests overwrite PYTHONPATH for their children.
"""

from __future__ import annotations

import inspect
import sysconfig
from pathlib import Path

PTH = "dora_hpc_coverage_context.pth"  # sorts after a1_coverage.pth


def label() -> None:
    import os

    test = os.environ.get("PYTEST_CURRENT_TEST")  # "tests/test_x.py::test_y[p] (call)"
    if not test or not (os.environ.get("COVERAGE_PROCESS_CONFIG") or os.environ.get("COVERAGE_PROCESS_START")):
        return
    try:
        import coverage

        cov = coverage.process_startup() or coverage.Coverage.current()
        if cov is not None:
            nodeid, _, phase = test.rpartition(" (")
            cov.switch_context(f"{nodeid}|{ {'call)': 'run'}.get(phase, phase.rstrip(')')) }")
    except Exception:  # noqa: BLE001 - never break a process for its coverage label
        pass


def install() -> Path:
    """Write the .pth (idempotent); its one line defines and runs label() without naming this file."""
    pth = Path(sysconfig.get_paths()["purelib"]) / PTH
    pth.write_text(f"import sys; exec({inspect.getsource(label) + 'label(); del label'!r})\n")
    return pth


if __name__ == "__main__":
    print(install())
