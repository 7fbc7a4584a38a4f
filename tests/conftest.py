"""Shared test setup: Triton's CPU interpreter, Hypothesis profiles, and kernel helpers.

Without a GPU, kernels run under TRITON_INTERPRET=1 on CPU tensors; the variable must be set
before any module defines a @triton.jit function, so it is set here, first. On a machine with
CUDA (the H200 run, `pytest -m gpu`), the interpreter stays off.
"""

from __future__ import annotations

import os

import pytest

try:  # torch is a test dependency; the build-path tests would run without it
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    HAS_CUDA = False

if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
    from tests import interpreter_bf16

    interpreter_bf16.install()

from hypothesis import HealthCheck, settings  # noqa: E402

# CI sets CI=true, which makes Hypothesis load its derandomized `ci` profile; ours add limits.
settings.register_profile(
    "ci", max_examples=25, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "gpu", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("ATTNGEN_HYPOTHESIS_PROFILE",
                                     "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


# The runtime's toy kernels (after TRITON_INTERPRET is set: loading them defines Triton kernels).
from tests.runtime_harness import toy_folder, toy_kernels  # noqa: E402, F401
