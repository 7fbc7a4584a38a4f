"""Writing files the way every attngen output is written: atomically, and only when changed.

A write goes to a temporary file in the target's folder, is flushed to disk, then replaces the
target with os.replace, so a reader (or a crash) never sees half a file; a target that already
holds exactly the new bytes is left alone, so rebuilding is idempotent and leaves timestamps
as they were. `locked` holds an exclusive lock file while a block runs (the index merge, a
module built on demand), across threads and processes alike. `user_cache_dir` is where
attngen's caches live by default (kernels built on demand, the templates' bytecode).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

# The cache root's setting: kernels built on demand (attngen/runtime/registry.py) and the
# templates' bytecode (attngen/render/template_env.py) live under it.
ENV_CACHE = "ATTNGEN_CACHE"
# Builds of the Gluon variants not yet verified on a GPU (attngen/tiling/gluon.py,
# GLUON_UNVERIFIED) under ATTNGEN_GLUON_VARIANTS=1; their on-demand cache is a folder apart.
VARIANTS_ENV = "ATTNGEN_GLUON_VARIANTS"


def unverified_variants_on() -> bool:
    """Whether this process builds the GLUON_UNVERIFIED variants (ATTNGEN_GLUON_VARIANTS=1)."""
    return os.environ.get(VARIANTS_ENV) == "1"


def write_if_different(path: Path, text: str) -> bool:
    """Atomically replace `path` with `text` unless it already holds exactly that; True when
    it wrote."""
    data = text.encode("utf-8")
    with contextlib.suppress(FileNotFoundError):
        if path.read_bytes() == data:
            return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return True


@contextlib.contextmanager
def locked(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `lock_path` (created if missing) for the block. Each call
    opens the file anew, so two threads of one process exclude each other as two processes
    do."""
    with open(lock_path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def user_cache_dir() -> Path:
    """The user's cache directory for attngen, by the platform's convention
    (`$XDG_CACHE_HOME/attngen`, else `~/.cache/attngen`; `~/Library/Caches/attngen` on macOS,
    `%LOCALAPPDATA%\\attngen\\Cache` on Windows: what platformdirs does, without the
    dependency)."""
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "attngen"
    if os.name == "nt":
        base = os.environ.get("LOCALAPPDATA") or str(Path.home() / "AppData" / "Local")
        return Path(base) / "attngen" / "Cache"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "attngen"
