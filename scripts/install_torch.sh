#!/usr/bin/env bash
# Install torch into the venv: the CPU build on a machine without an NVIDIA GPU (torch==2.13.0 is the
# CPU wheel this project's machines carry; a plain `torch` requirement would pull a 5 GB CUDA build),
# and PyPI's default CUDA build where `nvidia-smi` sees a GPU.
set -euo pipefail
PY=${1:-.venv/bin/python}
if "$PY" -c "import torch" 2>/dev/null; then
  echo "torch already installed: $("$PY" -c 'import torch; print(torch.__version__)')"
  exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "NVIDIA GPU found: installing a CUDA build of torch"
  "$PY" -m pip install -q "torch>=2.4"
else
  echo "no NVIDIA GPU: installing the CPU build torch==2.13.0"
  "$PY" -m pip install -q torch==2.13.0 || "$PY" -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
fi
