#!/usr/bin/env bash
# The prepared GPU check (issue 8): on one GPU machine, in under 8 minutes, measure the built-in engine,
# KV migration vs re-prefill (4k-32k contexts), weight publish, one FSDP2 and one megatron-core GRPO step,
# and vLLM where it is installed; write results/gpu/gpu_check.json (+ log.txt, nvidia-smi.csv).
#
#   bash tools/gpu_check.sh --fetch        # here (PyPI reachable): the wheels the GPU image lacks -> .whl/
#   bash tools/gpu_check.sh [OUT]          # there: install .whl/ into /tmp/site, run every section -> OUT
#   bash tools/gpu_check.sh --dry-run OUT  # anywhere: the same sections on CPU with a small model
#
# The GPU image (see the device notes) has python3 3.12 with CUDA torch, transformers, h5py, mpi4py, rich;
# it lacks megatron-core and mbridge, and vLLM's wheels are too large to carry (its section then records
# "skipped"). Each section runs in its own process under its own time limit; one failing section is
# recorded and the others still run. Never part of CI.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [ "${1:-}" = "--fetch" ]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  exec "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl megatron-core==0.16.1 mbridge==0.15.1 \
    mpi4py==4.1.2 mpich==5.0.2 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
fi

DRY=()
if [ "${1:-}" = "--dry-run" ]; then
  DRY=(--small --device cpu)
  shift
fi
OUT=${1:-results/gpu}
WORK=${WORK:-/tmp/dora-gpu-check}
rm -rf "$WORK" && mkdir -p "$WORK" "$OUT"
if ls .whl/*.whl >/dev/null 2>&1 && [ ${#DRY[@]} -eq 0 ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} PATH=/tmp/site/bin:$PATH
  # mpi4py 4 loads whichever MPI it finds; point it at the carried MPICH
  [ -e /tmp/site/lib/libmpi.so.12 ] && export MPI4PY_LIBMPI=/tmp/site/lib/libmpi.so.12
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia-smi.csv"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
{
  echo "gpu_check $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo ?)"
  # section:seconds -- 470 s in all, so the whole check ends inside 8 minutes
  for spec in model:40 engine:50 kv:75 weights:25 fsdp:55 megatron:55 vllm:70 runtime:100; do
    name=${spec%%:*}
    timeout "${spec##*:}" "$PY" tools/gpu_check.py "$name" --work "$WORK" "${DRY[@]}" \
      || echo "section $name: exit $? (timeout 124: it ran past its ${spec##*:} s)"
  done
  "$PY" tools/gpu_check.py summary --work "$WORK" --out "$OUT"
} 2>&1 | tee "$OUT/log.txt"
