"""Importing a generated module only when it is the module its index entry describes.

Dispatch trusts index.json (it picks a module by its entry's spec), so before a module runs:
1. its bytes must hash to the sha256 `attngen build` recorded in the entry (a module edited,
   replaced or left over from another build is refused, naming the file);
2. the module is executed from exactly those bytes (and linecache holds them, so Triton's JIT,
   which reads a kernel's source through inspect, compiles what was verified);
3. its own constants (HEAD_DIM, MASK, WINDOW, DTYPE, KV_LAYOUT, ...) and entry point must
   agree with the entry's spec and kind.
"""

from __future__ import annotations

import hashlib
import importlib.util
import linecache
import sys
from pathlib import Path
from types import ModuleType

import torch

from attngen.runtime.registry import KernelEntry, RegistryError
from attngen.spec import Dtype

ENTRY_POINTS = {"prefill": "attention", "varlen": "attention_varlen", "decode": "decode"}


def import_verified(entry: KernelEntry) -> ModuleType:
    path = Path(entry.key)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise RegistryError(
            f"{path}: listed in index.json but missing; rebuild the folder with `attngen build`"
        ) from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry.sha256:
        raise RegistryError(
            f"{path}: its bytes do not match the sha256 in index.json (index {entry.sha256[:16]}, "
            f"file {digest[:16]}): the file changed after `attngen build` wrote it; rebuild "
            "the folder, or restore the file"
        )
    module = _execute(path, data, entry)
    problems = constant_mismatches(module, entry)
    if problems:
        raise RegistryError(
            f"{path}: the module disagrees with its index entry "
            f"({'; '.join(problems)}); rebuild the folder with `attngen build`"
        )
    return module


def _torch_dtype(name: object) -> torch.dtype | None:
    """The torch dtype of a spec's dtype name (None for a name attngen does not know)."""
    if name not in {d.value for d in Dtype}:
        return None
    return getattr(torch, Dtype(name).torch_name)


def expected_constants(entry: KernelEntry) -> dict[str, object]:
    """The module-level constants a generated module of this entry defines, and their values."""
    spec = entry.spec
    expected: dict[str, object] = {
        "HEAD_DIM": spec.get("head_dim"),
        "HEAD_DIM_V": spec.get("head_dim_v") or spec.get("head_dim"),
        "DTYPE": _torch_dtype(spec.get("dtype")),
        "MASK": spec.get("mask"),
        "SOFTCAP": float(spec.get("softcap") or 0.0),
        "ALIBI": bool(spec.get("alibi")),
    }
    if spec.get("causal_align"):
        expected["CAUSAL_ALIGN"] = spec["causal_align"]
    if spec.get("mask") == "sliding_window":
        expected["WINDOW"] = (spec.get("window_left"), spec.get("window_right") or 0)
    # Modules of specs with the newer models' fields say so; older modules lack the names.
    if spec.get("sinks"):
        expected["SINKS"] = True
    if spec.get("chunk_size"):
        expected["CHUNK_SIZE"] = spec["chunk_size"]
    if spec.get("sink_tokens"):
        expected["SINK_TOKENS"] = spec["sink_tokens"]
    if entry.kind == "decode":
        expected["KV_LAYOUT"] = spec.get("kv_layout")
        expected["PAGE_SIZE"] = spec.get("page_size") or 0
        expected["MAX_QUERY_TOKENS"] = spec.get("max_query_tokens") or 1
    return expected


def constant_mismatches(module: ModuleType, entry: KernelEntry) -> list[str]:
    """'NAME: module has X, index says Y' for each constant (and the entry point) that differs."""
    problems = []
    for name, want in expected_constants(entry).items():
        if not hasattr(module, name):
            problems.append(f"{name}: not defined by the module, index says {want!r}")
            continue
        got = getattr(module, name)
        if isinstance(want, tuple) and isinstance(got, list):
            got = tuple(got)
        if got != want:
            problems.append(f"{name}: module has {got!r}, index says {want!r}")
    entry_point = ENTRY_POINTS.get(entry.kind)
    if entry_point is None or not callable(getattr(module, entry_point, None)):
        problems.append(f"kind {entry.kind}: the module has no {entry_point}() entry point")
    return problems


def _execute(path: Path, data: bytes, entry: KernelEntry) -> ModuleType:
    # A unique, stable name per file and content: two folders may hold modules of one name.
    name = f"attngen_kernels_{hashlib.sha256(str(path).encode()).hexdigest()[:10]}_{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None:  # pragma: no cover - a .py path always gives a spec
        raise RegistryError(f"{path}: cannot be imported")
    module = importlib.util.module_from_spec(module_spec)
    text = data.decode("utf-8")
    # mtime None: linecache.checkcache never replaces these lines with the file's current ones.
    linecache.cache[str(path)] = (len(data), None, text.splitlines(keepends=True), str(path))
    code = compile(data, str(path), "exec", dont_inherit=True)
    sys.modules[name] = module  # Triton and inspect look modules up by name
    try:
        exec(code, module.__dict__)
    except Exception:
        sys.modules.pop(name, None)
        raise
    return module
