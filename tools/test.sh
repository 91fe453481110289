#!/usr/bin/env bash
# The README's test command: set up .venv/ (skipped when it is up to date) and run a test tier (plus ruff).
#   bash tools/test.sh            the README tier: every subsystem once for real -- one real multi-process DORA
#                                 run, the simulator, analysis, config errors, a stop and its resume, a fault and
#                                 its fencing, the docs check -- and no test marked `slow`; budget 10 min on 2 cores,
#                                 4:23 measured (351 passed, 2026-12-07: results/tests/README.md)
#   bash tools/test.sh --full     everything, Slurm jobs (a local cluster, as root) and every backend included;
#                                 budget 30 min serial on 2 cores, 33:26 measured (433 passed; --rest 29:03)
#   bash tools/test.sh --rest     the full tier's tests the README tier leaves out (`slow`): CI runs the README
#                                 tier, then this, so nothing runs twice
# vLLM's tests (marked `vllm`) skip unless vLLM is installed (DORA_HPC_VLLM=1 bash tools/setup.sh). Measured
# times: results/tests/README.md. Further arguments go to pytest (e.g. -k resume, -x). --quick: the README tier.
set -euo pipefail
cd "$(dirname "$0")/.."
MARKS=(-m "not slow and not vllm")
case "${1:-}" in
  --full) shift; MARKS=() ;;
  --rest) shift; MARKS=(-m "slow and not vllm") ;;
  --quick) shift ;;
esac
bash tools/setup.sh
.venv/bin/ruff check dora_hpc tests tools
.venv/bin/python -m pytest -q --durations=15 "${MARKS[@]}" "$@"
