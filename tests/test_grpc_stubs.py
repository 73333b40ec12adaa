"""The committed gRPC stubs are exactly what scripts/gen_proto.sh generates from proto/tandem.proto."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_stubs_match_proto(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True, env=env)
    for name in ("tandem_pb2.py", "tandem_pb2_grpc.py"):
        assert (tmp_path / name).read_text() == (ROOT / "proto" / name).read_text(), \
            f"proto/{name} is stale: run scripts/gen_proto.sh"
