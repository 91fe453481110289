#!/usr/bin/env bash
# The README's test command: set up .venv/ and run the test suite (plus ruff).
#   bash tools/test.sh            everything (about 44 min here, 419 tests + 17 vLLM ones skipped, 2026-12-06: quick 4:33, slow 29:03, Slurm 10:41 in three runs, a simulation running beside them at low priority; over its ~25 min budget; CI (2 cores) ran it in 42 min within its 90 with the vLLM tier after; Slurm tests start a local cluster as root)
#   bash tools/test.sh --quick    the quick tier (under 5 min): core, config, engines, losses, analysis, docs,
#                                 and one real DORA run; no test marked `slow` (multi-process runs, Slurm
#                                 jobs, benchmarks) and no vLLM test
# Further arguments go to pytest (e.g. -k resume, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
MARKS=()
if [ "${1:-}" = "--quick" ]; then
  shift
  MARKS=(-m "not slow and not vllm")
fi
bash tools/setup.sh
.venv/bin/ruff check dora_hpc tests
.venv/bin/python -m pytest -q --durations=15 "${MARKS[@]}" "$@"
