import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
GEMMA3 = "google/gemma-3-270m"


@pytest.fixture(scope="session")
def smollm2_plain():
    from engine import LLM

    return LLM(model=SMOLLM2, max_model_len=512)
