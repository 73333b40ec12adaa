#!/usr/bin/env bash
# The GPU checks, in one run (< 8 min): the `cuda` tests (tests/test_cuda.py) on the device machine.
# Run through the session's `device` tool when a GPU is lent:  bash scripts/gpu_check.sh
# That machine's python3 has torch (CUDA), transformers, safetensors, scipy, pytest; what it lacks
# (pydantic, gguf, ...) travels as wheels in .whl/ (see /work/.library/device/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
if [ -d .whl ]; then
  "$py" -m pip install -q --no-index --find-links .whl pydantic gguf accelerate 2>&1 | tail -2 || true
fi
"$py" - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.device_count(), "GPU(s)")
assert torch.cuda.is_available(), "no CUDA device: this script is for the GPU machine"
PY
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 480 "$py" -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda.py "$@"
