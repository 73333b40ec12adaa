#!/usr/bin/env bash
# Regenerate proto/tandem_pb2.py and proto/tandem_pb2_grpc.py from proto/tandem.proto.
# tests/test_grpc.py fails when the committed stubs differ from what this produces.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/proto}"
py="${PYTHON:-$root/.venv/bin/python}"
"$py" -m grpc_tools.protoc -I"$root/proto" --python_out="$out" --grpc_python_out="$out" "$root/proto/tandem.proto"
# protoc assumes a top-level module `tandem_pb2`; the stubs import as the `tandem_proto` package
# (pyproject.toml). The message classes' module name matters too: Ray pickles requests.
sed -i 's/^import tandem_pb2 as tandem__pb2$/from tandem_proto import tandem_pb2 as tandem__pb2/' "$out/tandem_pb2_grpc.py"
sed -i "s/BuildTopDescriptorsAndMessages(DESCRIPTOR, 'tandem_pb2', _globals)/BuildTopDescriptorsAndMessages(DESCRIPTOR, 'tandem_proto.tandem_pb2', _globals)/" "$out/tandem_pb2.py"
