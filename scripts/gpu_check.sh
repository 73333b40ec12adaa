#!/usr/bin/env bash
# The GPU checks, in one run (< 10 min): the `cuda` tests (tests/test_cuda.py), then one speed row
# (benchmarks/gpu_speed.py: a Qwen3-8B-shaped target and a Qwen3-0.6B-shaped draft, random bf16 weights,
# synthetic acceptance; speculation against plain decoding, and the step against the memory roofline).
#
#   bash scripts/gpu_check.sh             # on the device machine, through the session's `device` tool
#   bash scripts/gpu_check.sh --dry-run   # on any machine: everything but the device (tests collected, the
#                                         # speed row on tiny shapes on the CPU); tests/test_gpu_check.py runs it
#
# That machine's python3 has torch (CUDA), transformers, safetensors, scipy, pytest; what it lacks
# (pydantic, gguf, ...) travels as wheels in .whl/ (see /work/.library/device/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "${1:-}" = "--dry-run" ]; then
  shift
  "$py" -m pytest -q -m cuda -p no:cacheprovider --collect-only tests/test_cuda.py "$@" | tail -1
  exec "$py" benchmarks/gpu_speed.py --dry-run --tokens 16 --prompt-tokens 32
fi
if [ -d .whl ]; then
  "$py" -m pip install -q --no-index --find-links .whl pydantic gguf accelerate 2>&1 | tail -2 || true
fi
"$py" - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.device_count(), "GPU(s)")
assert torch.cuda.is_available(), "no CUDA device: this script is for the GPU machine (or use --dry-run)"
PY
status=0
timeout 390 "$py" -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda.py "$@" || status=$?
# the speed row runs even when a test failed: the device time is short, and both results matter
timeout 180 "$py" benchmarks/gpu_speed.py || status=$?
exit $status
