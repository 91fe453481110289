#!/usr/bin/env bash
# The README's test command: set up .venv/ and run the test suite (plus ruff).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
.venv/bin/ruff check dora_hpc tests
.venv/bin/python -m pytest -q --durations=15 "$@"
