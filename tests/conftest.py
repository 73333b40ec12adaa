import os

import pytest
import torch

# The tests are about the embedded GGUF models: never swap in a Hub download where a hub is reachable
# (tests/test_hub_download.py runs its resolutions with an environment of its own).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))

from engine import kernels as cpu_kernels  # noqa: E402

# Every kernel test runs on every target this CPU executes (an AVX-512 machine tests its AVX2 build
# too); tests of whole models run on the best target and on AVX2, the lowest one, where the CPU has them.
KERNEL_TARGETS = cpu_kernels.runnable()
MODEL_TARGETS = list(dict.fromkeys(KERNEL_TARGETS[:1] + [t for t in KERNEL_TARGETS if t == "avx2"]))
NO_TARGET = "this CPU runs none of the kernels' targets (no AVX2/FMA/F16C, or not x86): PyTorch's path is tested"
needs_kernels = pytest.mark.skipif(not KERNEL_TARGETS, reason=NO_TARGET)


def _targets(names):
    return names or [pytest.param(None, marks=pytest.mark.skip(reason=NO_TARGET))]


@pytest.fixture(params=_targets(KERNEL_TARGETS))
def kernel(request):
    """The CPU kernels of one target (engine.kernels.Kernels), for each target this CPU runs."""
    k = cpu_kernels.load(request.param)
    assert k is not None, f"the CPU lists {request.param}'s instructions but its kernels don't build or run"
    return k


@pytest.fixture(params=_targets(MODEL_TARGETS))
def cpu_isa(request) -> str:
    """A cpu_isa for a whole-model test: the best target here, then AVX2."""
    return request.param


SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
GEMMA3 = "google/gemma-3-270m"
# the default app's pair (same tokenizer): larger, so only tests about that pair load it
QWEN_CODER = "Qwen/Qwen2.5-Coder-1.5B-Instruct"
QWEN_CODER_DRAFT = "Qwen/Qwen2.5-Coder-0.5B-Instruct"


@pytest.fixture(scope="session")
def smollm2_plain():
    from engine import LLM

    return LLM(model=SMOLLM2, max_model_len=512)
