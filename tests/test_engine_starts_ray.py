"""An engine that starts its own Ray cluster can always place its own groups, run the way a user
runs it: a fresh process, no cluster started by a test fixture, on this 2-core machine (tensor
parallel 2 for the target and the draft needs 4 bundles)."""
import json
import os
import shutil
import subprocess
import sys
import tempfile

from engine import LLM, SamplingParams

SCRIPT = """
import json
from engine import LLM, SamplingParams
llm = LLM(model="random:tiny-llama:1", tensor_parallel_size=2,
          speculative_config={"model": "random:tiny-llama:2", "num_speculative_tokens": 2})
out = llm.generate(["hello world", "the cat"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
print(json.dumps([o.outputs[0].token_ids for o in out]))
"""


def test_tensor_parallel_speculation_places_itself_on_a_small_machine():
    ray_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # a cluster of its own, nothing to join
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = ray_dir
    try:
        r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    finally:  # the cluster ray.init started goes down with its driver
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert r.returncode == 0, r.stderr[-2000:]
    served = json.loads(r.stdout.strip().splitlines()[-1])
    plain = LLM(model="random:tiny-llama:1").generate(
        ["hello world", "the cat"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert served == [o.outputs[0].token_ids for o in plain]
