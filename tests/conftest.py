"""Shared test setup: Triton's CPU interpreter, Hypothesis profiles, and kernel helpers.

Without a GPU, kernels run under TRITON_INTERPRET=1 on CPU tensors; the variable must be set
before any module defines a @triton.jit function, so it is set here, first. On a machine with
CUDA (the H200 run, `pytest -m gpu`), the interpreter stays off.
"""

from __future__ import annotations

import os
import tempfile

import pytest

try:  # torch is a test dependency; the build-path tests would run without it
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    HAS_CUDA = False

# On-demand builds (attngen/runtime/selection.py) are off for the suite: the runtime tests
# assert which loaded module serves a call, or that none does. The tests of on-demand builds
# (tests/ondemand_harness.py) turn them on for themselves, with a cache in a temporary folder;
# nothing is written to the user's cache.
os.environ["ATTNGEN_ON_DEMAND"] = "0"
os.environ["ATTNGEN_CACHE"] = tempfile.mkdtemp(prefix="attngen-test-cache-")

if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
    from tests import interpreter_bf16

    interpreter_bf16.install()

from hypothesis import HealthCheck, settings  # noqa: E402

# Profiles (ATTNGEN_HYPOTHESIS_PROFILE picks one; otherwise "ci" when CI is set, else "dev"):
# - ci, dev: derandomized, no example database. A plain `python -m pytest` (the README's
#   command) draws the same examples on every machine and every run, so a newcomer's first run
#   cannot go red on a random draw, and no failure is written to .hypothesis/ to be replayed.
#   dev draws more examples than ci (which keeps the suite fast on 2 CI cores).
# - explore: random draws, failures kept in .hypothesis/ and replayed until fixed, for hunting
#   bugs locally; keep every failure it finds as an @example in the test.
# - gpu: random and larger, for the H200 runs.
# Every profile starts from Hypothesis's "default" (random, with a database): with CI set,
# Hypothesis's own defaults are its derandomized "ci" ones, which explore must not inherit.
_QUIET = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    parent=settings.get_profile("default"),
)
settings.register_profile("ci", max_examples=25, derandomize=True, database=None, **_QUIET)
settings.register_profile("dev", max_examples=40, derandomize=True, database=None, **_QUIET)
settings.register_profile("explore", max_examples=100, **_QUIET)
settings.register_profile("gpu", max_examples=200, **_QUIET)


def hypothesis_profile(environ) -> str:
    return environ.get("ATTNGEN_HYPOTHESIS_PROFILE", "ci" if environ.get("CI") else "dev")


settings.load_profile(hypothesis_profile(os.environ))

# The quick subset (`python -m pytest -m quick`, tests/README.md): the files a contributor runs
# while editing, about 1-2 minutes on 2 cores where the whole CPU suite takes 9-10. Spec,
# tiling, render and templates, registry, dispatch and the public functions' arguments; not the
# kernels' property suites, the CLI's subprocess builds or the compiled-tiling comparison.
QUICK_FILES = frozenset(
    {
        "test_spec.py",
        "test_hostile_specs.py",
        "test_hf_spec.py",
        "test_tiling.py",
        "test_decode_tiling.py",
        "test_render.py",
        "test_template_env.py",
        "test_explain.py",
        "test_reference.py",
        "test_registry_integrity.py",
        "test_registry_layers.py",
        "test_runtime.py",
        "test_runtime_plans.py",
        "test_softcap_arguments.py",
        "test_line_budget.py",
        "test_hypothesis_profiles.py",
    }
)


def pytest_configure(config: pytest.Config) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    missing = sorted(f for f in QUICK_FILES if not os.path.exists(os.path.join(here, f)))
    if missing:  # a renamed file would drop out of the quick subset unnoticed
        raise pytest.UsageError(f"tests/conftest.py QUICK_FILES names missing files: {missing}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of QUICK_FILES `quick`, but not their gpu or slow ones (`-m quick`
    replaces the default `-m "not gpu and not slow"`)."""
    for item in items:
        if (
            item.path.name in QUICK_FILES
            and item.get_closest_marker("gpu") is None
            and item.get_closest_marker("slow") is None
        ):
            item.add_marker(pytest.mark.quick)


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


# The runtime's toy kernels (after TRITON_INTERPRET is set: loading them defines Triton kernels).
from tests.runtime_harness import toy_folder, toy_kernels  # noqa: E402, F401
