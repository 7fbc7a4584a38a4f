"""The kernel registry: which generated modules exist, and loading them by file path.

A folder of generated kernels is what `attngen build` writes: `<arch>/<module>.py` files and
an `index.json` describing each (kind, arch, spec, and the sha256 of the file's bytes). The
registry reads the index only; a module is imported (from its file: Triton's JIT needs real
source files) the first time a call is dispatched to it, after two checks (integrity.py): its
bytes must hash to the index's sha256, and its own constants (HEAD_DIM, MASK, ...) must say
what its index entry says. Modules are identified by a key string, the absolute path of their
file, which is what the torch.library ops take: selection happens outside the ops.

The default folder is `$ATTNGEN_KERNELS`, else the repository's `generated/` (present in a
source checkout). `load_kernels(path, ...)` replaces the registry with other folders; a key
chosen from the registry it replaced is refused afterwards (RegistryError), never run.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # selection imports this module's types
    from attngen.runtime.selection import Dispatch, Need

ENV_KERNELS = "ATTNGEN_KERNELS"
_REPO_GENERATED = Path(__file__).resolve().parent.parent.parent / "generated"


class RegistryError(RuntimeError):
    """The kernel folder is missing, is not an attngen build, or a module fails its checks."""


@dataclass(frozen=True)
class KernelEntry:
    """One generated module, as its index entry describes it."""

    key: str  # absolute path of the module file; what the ops take
    module: str  # module name, e.g. llama3_8b_varlen_bf16_d128_causal_br
    arch: str  # sm80, sm90, ...
    kind: str  # prefill | varlen | decode
    spec: dict[str, Any]  # the canonical spec (dtype, head_dim, mask, ...)
    sha256: str = ""  # of the module file's bytes, recorded by `attngen build`

    def describe(self) -> str:
        return f"{self.arch}/{self.module}"


class Registry:
    """The modules of some folders. Everything derived from the entries (the imported modules,
    the dispatcher's prefiltered lists) is cached on the Registry itself, so a thread still
    holding a replaced registry can only ever fill that registry's caches."""

    def __init__(self, folders: list[Path], entries: list[KernelEntry]):
        self.folders = folders
        self.entries = entries
        self._by_key = {entry.key: entry for entry in entries}
        self._modules: dict[str, ModuleType] = {}
        self._matching: dict[tuple, list[KernelEntry]] = {}
        # dispatch.py's cache of served calls, (api, Need) -> Dispatch: it lives and dies with
        # this registry, so a replaced registry's choices never serve a later call.
        self.dispatches: dict[tuple[str, Need], Dispatch] = {}
        self._lock = threading.Lock()

    def module(self, key: str) -> ModuleType:
        """The imported, verified module for a key (imported once, then cached)."""
        module = self._modules.get(key)
        if module is None:
            entry = self._by_key.get(key)
            if entry is None:
                raise RegistryError(
                    f"{key}: not among the kernels loaded now ({_folder_list(self.folders)}); "
                    "load_kernels replaced the registry after this call chose it (a compiled "
                    "graph keeps its choice: recompile), so it is not run")
            from attngen.runtime.integrity import import_verified  # torch: runtime only

            with self._lock:
                module = self._modules.get(key)
                if module is None:
                    module = self._modules[key] = import_verified(entry)
        return module

    def matching(self, key: tuple, agrees: Callable[[KernelEntry], bool]) -> list[KernelEntry]:
        """The entries for which `agrees` holds, computed once per `key` for this registry."""
        hit = self._matching.get(key)
        if hit is None:
            hit = [entry for entry in self.entries if agrees(entry)]
            self._matching[key] = hit  # a racing thread stores an equal list: harmless
        return hit


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
            digest = item.get("sha256")
            if not isinstance(digest, str) or len(digest) != 64:
                raise RegistryError(
                    f"{index}: {item['path']} has no sha256 of its bytes (an index written "
                    "before attngen recorded them); rebuild the folder with `attngen build`")
            entries.append(KernelEntry(str(path), item["module"], item["arch"], item["kind"],
                                       dict(item["spec"]), digest))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RegistryError(f"{index}: not an attngen index ({exc!r})") from None
    return entries


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


def _folder_list(folders: list[Path]) -> str:
    return ", ".join(str(f) for f in folders) or "no folders"


def _default_folders() -> list[Path]:
    env = os.environ.get(ENV_KERNELS)
    if env:
        return [Path(p) for p in env.split(os.pathsep) if p]
    if (_REPO_GENERATED / "index.json").is_file():
        return [_REPO_GENERATED]
    raise RegistryError(
        f"no generated kernels: set {ENV_KERNELS} to a folder written by `attngen build "
        "--out FOLDER`, or call attngen.runtime.load_kernels(FOLDER)")
