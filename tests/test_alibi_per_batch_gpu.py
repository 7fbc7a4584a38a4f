"""tests/test_alibi_per_batch.py on CUDA (the H200): `pytest -m gpu`. The compiled kernels
read the per-batch slopes at their batch stride (an int argument Triton specializes: 0 for
[HQ] slopes, HQ for [B, HQ] ones), where the CPU run has the interpreter."""

from __future__ import annotations

import pytest
import torch

from tests.test_alibi_per_batch import *  # noqa: F403 (the same tests, collected here too)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the H200"),
]
