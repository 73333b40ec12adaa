"""`tandem serve`: the seed's `vllm serve` line works with only the program name changed."""
import subprocess
import sys
from pathlib import Path

import pytest

from deployments.app import parse_args
from deployments.cli import serve_args_from_cli

TANDEM = str(Path(sys.executable).parent / "tandem")


def test_seed_serve_line_parses_into_the_same_config_as_yaml_and_offline():
    argv = ["Qwen/Qwen3-4B-Thinking-2507", "--host", "0.0.0.0", "--port", "8000", "--seed", "42", "-tp", "1",
            "--max-model-len", "2048", "--gpu-memory-utilization", "0.8", "--speculative-config",
            '{"model": "Qwen/Qwen3-0.6B", "num_speculative_tokens": 5, "method": "draft_model"}']
    parsed = serve_args_from_cli(argv)
    assert parsed["host"] == "0.0.0.0" and parsed["port"] == 8000
    args = parse_args(parsed["args"])
    assert args.seed == 42 and args.max_model_len == 2048 and args.tensor_parallel_size == 1
    spec = args.speculative_config
    assert spec.model == "Qwen/Qwen3-0.6B" and spec.num_speculative_tokens == 5 and spec.method == "draft_model"


@pytest.mark.parametrize("flag", ["--speculative-model", "--num-speculative-tokens"])
def test_old_flags_refused_with_pointer(flag):
    r = subprocess.run([TANDEM, "serve", "m", flag, "x"], capture_output=True, text=True)
    assert r.returncode != 0 and "--speculative-config" in r.stderr and flag in r.stderr


def test_bad_speculative_config_fails_before_starting():
    r = subprocess.run([TANDEM, "serve", "random:tiny-llama", "--speculative-config",
                        '{"model": "random:tiny-llama:2", "num_speculative_tokens": 2, "temperature": 0.5}'],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "sampling parameter, not speculative config" in r.stderr


def test_unknown_command():
    r = subprocess.run([TANDEM, "bench"], capture_output=True, text=True)
    assert r.returncode != 0 and "unknown command" in r.stderr
