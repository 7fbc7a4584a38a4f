"""The kernel registry: which generated modules exist, and loading them by file path.

A folder of generated kernels is what `attngen build` writes: `<arch>/<module>.py` files and
an `index.json` describing each (kind, arch, spec). The registry reads the index only; a
module is imported (importlib, from its file: Triton's JIT needs real source files) the first
time a call is dispatched to it. Modules are identified by a key string, the absolute path of
their file, which is what the torch.library ops take: selection happens outside the ops.

The default folder is `$ATTNGEN_KERNELS`, else the repository's `generated/` (present in a
source checkout). `load_kernels(path, ...)` replaces the registry with other folders.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

ENV_KERNELS = "ATTNGEN_KERNELS"
_REPO_GENERATED = Path(__file__).resolve().parent.parent.parent / "generated"


class RegistryError(RuntimeError):
    """The kernel folder is missing or is not an attngen build."""


@dataclass(frozen=True)
class KernelEntry:
    """One generated module, as its index entry describes it."""

    key: str  # absolute path of the module file; what the ops take
    module: str  # module name, e.g. llama3_8b_varlen_bf16_d128_causal_br
    arch: str  # sm80, sm90, ...
    kind: str  # prefill | varlen | decode
    spec: dict[str, Any]  # the canonical spec (dtype, head_dim, mask, ...)

    def describe(self) -> str:
        return f"{self.arch}/{self.module}"


class Registry:
    def __init__(self, folders: list[Path], entries: list[KernelEntry]):
        self.folders = folders
        self.entries = entries
        self._modules: dict[str, ModuleType] = {}
        self._lock = threading.Lock()

    def module(self, key: str) -> ModuleType:
        """The imported module for a key (imported once, then cached)."""
        module = self._modules.get(key)
        if module is None:
            with self._lock:
                module = self._modules.get(key) or _import_file(Path(key))
                self._modules[key] = module
        return module


def read_folder(folder: str | Path) -> list[KernelEntry]:
    folder = Path(folder).resolve()
    index = folder / "index.json"
    if not index.is_file():
        raise RegistryError(f"{folder}: no index.json; expected a folder written by "
                            "`attngen build --out FOLDER`")
    try:
        modules = json.loads(index.read_text(encoding="utf-8"))["modules"]
        entries = []
        for item in modules:
            path = (folder / item["path"]).resolve()
            if not path.is_relative_to(folder):
                raise RegistryError(f"{index}: module path {item['path']!r} leaves the folder")
            entries.append(KernelEntry(str(path), item["module"], item["arch"], item["kind"],
                                       dict(item["spec"])))
    except (ValueError, KeyError, TypeError) as exc:
        raise RegistryError(f"{index}: not an attngen index ({exc!r})") from None
    return entries


def _import_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise RegistryError(f"{path}: listed in index.json but missing; rebuild the folder")
    # A unique, stable name per file: two folders may hold modules of the same name.
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:10]
    name = f"attngen_kernels_{digest}_{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:  # pragma: no cover
        raise RegistryError(f"{path}: cannot be imported")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # Triton and inspect look modules up by name
    module_spec.loader.exec_module(module)
    return module


_current: Registry | None = None
_current_lock = threading.Lock()


def load_kernels(*folders: str | Path) -> Registry:
    """Use the generated kernels in these folders (each an `attngen build --out` folder).

    Without arguments: `$ATTNGEN_KERNELS` (folders separated by os.pathsep), else the
    repository's generated/. Replaces the registry in use and returns it.
    """
    global _current
    paths = [Path(f) for f in folders] or _default_folders()
    entries = [entry for path in paths for entry in read_folder(path)]
    registry = Registry([p.resolve() for p in paths], entries)
    with _current_lock:
        _current = registry
    return registry


def current_registry() -> Registry:
    """The registry in use, loaded from the default folders on first use."""
    current = _current
    if current is None:
        with _current_lock:
            current = _current
        if current is None:
            current = load_kernels()
    return current


def _default_folders() -> list[Path]:
    env = os.environ.get(ENV_KERNELS)
    if env:
        return [Path(p) for p in env.split(os.pathsep) if p]
    if (_REPO_GENERATED / "index.json").is_file():
        return [_REPO_GENERATED]
    raise RegistryError(
        f"no generated kernels: set {ENV_KERNELS} to a folder written by `attngen build "
        "--out FOLDER`, or call attngen.runtime.load_kernels(FOLDER)")
