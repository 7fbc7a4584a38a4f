"""Writing files the way every attngen output is written: atomically, and only when changed.

A write goes to a temporary file in the target's folder, is flushed to disk, then replaces the
target with os.replace, so a reader (or a crash) never sees half a file; a target that already
holds exactly the new bytes is left alone, so rebuilding is idempotent and leaves timestamps
as they were.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


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
