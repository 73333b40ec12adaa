import os

import pytest
import torch

# The tests are about the embedded GGUF models: never swap in a Hub download where a hub is reachable
# (tests/test_hub_download.py runs its resolutions with an environment of its own).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
GEMMA3 = "google/gemma-3-270m"


@pytest.fixture(scope="session")
def smollm2_plain():
    from engine import LLM

    return LLM(model=SMOLLM2, max_model_len=512)
