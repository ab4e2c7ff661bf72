#!/usr/bin/env bash
# Creates ./.venv with the CPU build of torch and memory-server (add "test" to include test deps).
# torch comes first from PyTorch's CPU index: a bare `torch` requirement from PyPI pulls a
# multi-GB CUDA build. Set TORCH_INDEX_URL to use another index (e.g. a CUDA one on a GPU host).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  pip install --retries 0 --timeout 10 "torch==2.13.0" \
    --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" \
  || { echo "install.sh: PyTorch's CPU index is unreachable; taking torch==2.13.0 from PyPI" \
            "(on Linux that is a CUDA build of several GB unless a CPU build is cached locally)" >&2
       pip install "torch==2.13.0"; }
fi
if [ -n "$extras" ]; then pip install -e ".[$extras]"; else pip install -e .; fi
