"""On-demand builds turned on for one test, with a cache in the test's own folder.

The suite runs with on-demand builds off (conftest.py); `on_demand` turns them on with
configure(), points the cache at a fresh folder, starts from the default registry (the
bundled generated/ and that empty cache), and restores the settings and the registry after.
`child` runs a Python snippet in a new interpreter with the same settings (the cache, the
interpreter on CPU, this checkout first on the path), for tests that need real processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from attngen.runtime import registry
from attngen.runtime.registry import configure, current_registry, load_kernels, use_registry

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture()
def on_demand(tmp_path: Path):
    """The cache folder; on-demand builds are on for the test."""
    saved = current_registry()
    cache = tmp_path / "cache"
    configure(on_demand=True, cache_dir=cache)
    load_kernels()
    try:
        yield cache
    finally:
        registry.reset_overrides()
        use_registry(saved)


def child_env(cache: Path) -> dict[str, str]:
    env = {
        **os.environ,
        "ATTNGEN_ON_DEMAND": "1",
        "ATTNGEN_CACHE": str(cache),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    if os.environ.get("TRITON_INTERPRET") == "1":
        env["TRITON_INTERPRET"] = "1"
    return env


def child(code: str, cache: Path, timeout: int = 300) -> subprocess.Popen:
    """A new interpreter running `code` (dedented) with on-demand builds into `cache`."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=child_env(cache),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def module_files(cache: Path) -> list[Path]:
    return sorted(cache.glob("*/*/*.py"))
