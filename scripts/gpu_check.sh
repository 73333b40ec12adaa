#!/usr/bin/env bash
# The GPU checks, in one run (< 8 min): the `cuda` tests (tests/test_cuda.py), then one speed row
# (benchmarks/gpu_speed.py, eager and CUDA graphs side by side, batch 1, 8 and 32: a Qwen3-8B-shaped target and a Qwen3-0.6B-shaped draft, random bf16 weights,
# synthetic acceptance; speculation against plain decoding, and the step against the memory roofline).
#
#   bash scripts/gpu_check.sh             # on the device machine, through the session's `device` tool
#   bash scripts/gpu_check.sh --dry-run   # on any machine: everything but the device (tests collected, the
#                                         # speed row on tiny shapes on the CPU); tests/test_gpu_check.py runs it
#
# That machine's python3 has torch (CUDA), transformers, safetensors, scipy, pytest; what it lacks
# (pydantic and its parts) travels as wheels in .whl/, installed to /tmp/site without their dependencies
# (see /work/.library/device/README.md). Ray is too large to carry (> 64 MiB): the Ray test skips there.
# Where $OUT is set (the device tool), the log and the speed row's JSON are copied there.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "${1:-}" = "--dry-run" ]; then
  shift
  "$py" -m pytest -q -m cuda -p no:cacheprovider --collect-only tests/test_cuda.py "$@" | tail -1
  exec "$py" benchmarks/gpu_speed.py --dry-run --tokens 16 --prompt-tokens 32
fi
if compgen -G ".whl/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site"  # only what the machine lacks (and a typing_extensions new enough)
fi
if [ -n "${OUT:-}" ]; then exec > >(tee "$OUT/gpu_check.log") 2>&1; fi
"$py" - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.device_count(), "GPU(s)")
assert torch.cuda.is_available(), "no CUDA device: this script is for the GPU machine (or use --dry-run)"
PY
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
export PYTHONUNBUFFERED=1
timeout 180 "$py" -m pytest -q -m cuda -p no:cacheprovider -rs --durations=8 tests/test_cuda.py "$@" || status=$?
# the speed row runs even when a test failed: the device time is short, and both results matter
timeout 280 "$py" benchmarks/gpu_speed.py ${OUT:+--profile "$OUT/gpu_profile.txt"} || status=$?
if [ -n "${OUT:-}" ] && [ -f benchmarks/results/gpu_speed.json ]; then cp benchmarks/results/gpu_speed.json "$OUT/"; fi
exit $status
