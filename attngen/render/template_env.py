"""The Jinja environment of every render: the template sources, with Jinja's bytecode cache in
the user's cache folder.

Jinja turns a template into Python once per process (it lexes and parses the template,
generates Python source and compiles it): about 100 ms for the templates of one module on a
2-core CPU, most of a process's first render, which a kernel built on demand pays on the call
that needs it. Jinja's own FileSystemBytecodeCache keeps each template's compiled code
(marshalled), so a later process loads it instead of compiling again. An entry is used only for
the same template (its name and file) with the same source (Jinja checks the source's sha1),
written by the same Python (Jinja's header records it); the folder's name carries the Jinja2
version. The cache changes only how fast a template loads: a render's bytes are the sources'.

The folder: `<cache root>/templates_jinja2-<version>/`, where the cache root is the one kernels
built on demand use (attngen/runtime/registry.py): `attngen.configure(cache_dir=...)` when
the runtime is loaded and set it, else `$ATTNGEN_CACHE`, else the user's cache directory
(attngen/spec/files.py). It is found without importing the runtime: the build path (spec, tiling,
render, build) imports neither torch nor Triton. Where the folder cannot be made or written,
templates are compiled as without a cache and `template_loading()` says why.
"""

from __future__ import annotations

import os
import sys
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.bccache import Bucket

from attngen.spec.files import ENV_CACHE, user_cache_dir

OPTIONS: dict[str, Any] = {
    "autoescape": False,  # Python source, not HTML; no user text
    "trim_blocks": True,
    "lstrip_blocks": True,
    "keep_trailing_newline": True,
}


def cache_root() -> Path:
    """The cache root of attngen's caches in force: the runtime's settings when it is loaded
    (configure(cache_dir=...) included), else `$ATTNGEN_CACHE`, else the user's cache folder."""
    runtime = sys.modules.get("attngen.runtime.registry")
    if runtime is not None:
        return Path(runtime.settings().cache_root)
    return Path(os.environ.get(ENV_CACHE) or user_cache_dir()).expanduser()


def bytecode_folder() -> Path:
    """The folder of the templates' bytecode cache, for this Jinja2."""
    return cache_root() / f"templates_jinja2-{jinja2.__version__}"


class TemplateBytecodeCache(jinja2.FileSystemBytecodeCache):
    """Jinja's file cache in bytecode_folder(), found on each load (a template is loaded once
    per process) and made when first written. A folder that cannot be read or written leaves
    the render as without a cache (the template compiled from its source); `error` records
    the last such failure."""

    def __init__(self) -> None:
        super().__init__(directory=str(bytecode_folder()), pattern="%s.cache")
        self.error: str | None = None

    def load_bytecode(self, bucket: Bucket) -> None:
        try:
            self.directory = str(bytecode_folder())
            super().load_bytecode(bucket)
        except OSError as exc:
            self.error = f"not read: {type(exc).__name__}: {exc}"

    def dump_bytecode(self, bucket: Bucket) -> None:
        try:
            Path(self.directory).mkdir(parents=True, exist_ok=True)
            super().dump_bytecode(bucket)
        except OSError as exc:
            self.error = f"not written: {type(exc).__name__}: {exc}"


def environment() -> jinja2.Environment:
    """The renders' environment (one per process)."""
    return _environment()


def template_loading() -> str:
    """Where the renders' templates come from in this process."""
    bytecode = _environment().bytecode_cache
    assert isinstance(bytecode, TemplateBytecodeCache)
    where = f"sources, Jinja2 {jinja2.__version__}, bytecode cache {bytecode.directory}"
    if bytecode.error is not None:
        return f"{where} ({bytecode.error})"
    return where


def source_environment(bytecode_cache: jinja2.BytecodeCache | None = None) -> jinja2.Environment:
    """An environment of the template sources (with `bytecode_cache`, or none)."""
    return jinja2.Environment(
        loader=jinja2.PackageLoader("attngen", "templates"),
        undefined=jinja2.StrictUndefined,
        bytecode_cache=bytecode_cache,
        **OPTIONS,
    )


@cache
def _environment() -> jinja2.Environment:
    return source_environment(TemplateBytecodeCache())
