#!/usr/bin/env bash
# Line coverage of dora_hpc under the tests, in every process a test starts (mpiexec's ranks, the CLI,
# Slurm tasks, environment workers), each line labelled with the tests that reached it. results/tests/COVERAGE.md.
#   COV_NAME=full bash tools/coverage.sh [pytest args]   -> results/tests/coverage-full.json (COV_NAME: run)
#   .venv/bin/python tools/cov_compare.py OLD.json NEW.json    lines lost, file by file
# The combined data stays in $COV_DATA (default runs/coverage-NAME/.coverage) for `coverage html`.
# Exits with pytest's status.
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=${COV_NAME:-run}
DATA=${COV_DATA:-$PWD/runs/coverage-$NAME}  # runs/: git ignores it; a shared filesystem where the run dirs are
PY=$PWD/.venv/bin/python
export COVERAGE_FILE=$DATA/.coverage  # absolute: every process writes its .coverage.HOST.PID... beside it
"$PY" -c "import coverage, pytest_cov" 2>/dev/null || "$PY" -m pip install -q "coverage>=7.10" "pytest-cov>=7"
"$PY" tools/coverage_hook.py >/dev/null  # labels each subprocess's lines with PYTEST_CURRENT_TEST
rm -rf "$DATA" && mkdir -p "$DATA"
# pytest-cov measures this process, one context per test phase; coverage's patch=subprocess passes the
# configuration on to every Python child through COVERAGE_PROCESS_CONFIG (pyproject.toml [tool.coverage])
status=0
"$PY" -m pytest --cov --cov-config=pyproject.toml --cov-context=test --cov-report= "$@" || status=$?
sleep 1  # a process still exiting after its test (ranks after mpiexec returned) writes its file
"$PY" -m coverage combine --rcfile=pyproject.toml --append -q >/dev/null 2>&1 || true  # pytest-cov combined the rest
"$PY" -m coverage json --rcfile=pyproject.toml --show-contexts -q -o "$DATA/raw.json"
mkdir -p results/tests
"$PY" tools/cov_compare.py --export "$DATA/raw.json" "results/tests/coverage-$NAME.json"
exit $status
