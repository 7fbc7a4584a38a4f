"""Dispatch: which generated module serves a call, and a record of why.

A call states what it needs (`Need`: kernel kind, dtype, head dims, mask, alignment, window,
softcap, ALiBi, the device's arch). `select` returns a `Dispatch` naming the module that
serves it and why, or, when none does, raises `NoKernelError` naming what the call needs and
the nearest modules with what differs, unless a fallback was asked for: then the Dispatch says
"fallback" and a warning names the reason. Nothing falls back silently.

Masks are compared by meaning at the call's lengths, not only by name: when Nq == Nk the two
causal alignments are the same mask, and a sliding window whose reach covers every key is
plain causal (or no mask). So SDPA's top-left `is_causal` on a square prefill runs on a
bottom-right kernel, and Mistral's window kernel serves sequences shorter than its window.

Every Dispatch is recorded: `last_dispatch()` and, inside `with dispatch_log() as log:`, in
`log`. Under torch.compile, selection runs while tracing, so it is recorded once per trace;
the kernel runs themselves are counted by the ops (`attngen.runtime.ops.run_counts`).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from attngen.runtime.registry import KernelEntry, current_registry

FALLBACKS = ("error", "sdpa")
INTERPRETER = "interpreter"  # CPU tensors under TRITON_INTERPRET=1: any arch's module runs
_fallback = "error"


class NoKernelError(RuntimeError):
    """No generated module serves a call (and no fallback was asked for)."""


@dataclass(frozen=True)
class Need:
    """What a call needs from a kernel. Lengths are upper bounds (max_seqlen for varlen)."""

    kind: str
    dtype: str
    head_dim: int
    head_dim_v: int
    mask: str  # none | causal | sliding_window
    causal_align: str | None  # top_left | bottom_right; None with mask none
    window: tuple[int, int] | None
    softcap: float
    alibi: bool
    arch: str
    seqlen_q: int
    seqlen_k: int
    same_lengths: bool  # every sequence has Nq == Nk, so the alignments coincide
    kv_layout: str | None = None  # decode only: contiguous | paged
    page_size: int | None = None  # decode only, paged

    def describe(self) -> str:
        mask = self.mask
        if self.mask != "none":
            mask += f"({self.causal_align}"
            mask += f", window={self.window})" if self.window else ")"
        text = (f"kind={self.kind} dtype={self.dtype} head_dim={self.head_dim}"
                f"{'' if self.head_dim_v == self.head_dim else f'/{self.head_dim_v}'} "
                f"mask={mask} softcap={self.softcap:g} alibi={self.alibi} arch={self.arch}")
        if self.kv_layout:
            text += f" kv_layout={self.kv_layout}"
        return text


@dataclass(frozen=True)
class Dispatch:
    """What ran for one call: a generated module (key, name) or a fallback, and why."""

    api: str  # the public function that was called
    need: Need
    module: str | None  # "<arch>/<module name>", None for a fallback
    key: str | None  # the module file; what the ops take
    reason: str
    fallback: str | None = None  # "sdpa" when torch ran instead of a generated kernel


def set_fallback(mode: str) -> None:
    """What to do when no generated kernel serves a call: "error" (default) or "sdpa"."""
    global _fallback
    _fallback = _check_fallback(mode, "mode")


def get_fallback() -> str:
    return _fallback


def _check_fallback(mode: object, name: str) -> str:
    if mode not in FALLBACKS:
        raise ValueError(f"{name}: got {mode!r}; allowed: {', '.join(map(repr, FALLBACKS))}")
    return str(mode)


def effective_mask(spec_like: dict, need: Need) -> tuple:
    """(mask, align, window) as it acts at the need's lengths: the form two masks compare in."""
    mask, align = spec_like["mask"], spec_like.get("causal_align")
    window = spec_like.get("window")
    if mask == "sliding_window":
        left, right = window
        reach = max(need.seqlen_q, need.seqlen_k) - 1  # the largest |i' - j| at these lengths
        if left >= reach and right >= reach:
            mask, window = "none", None
        elif left >= reach and right == 0:
            mask, window = "causal", None
    if mask == "none" or need.same_lengths:
        align = None
    return mask, align, window


def _spec_view(entry: KernelEntry) -> dict:
    spec = entry.spec
    window = None
    if spec["mask"] == "sliding_window":
        window = (spec["window_left"], spec.get("window_right") or 0)
    return {**spec, "window": window}


def mismatches(entry: KernelEntry, need: Need) -> list[str]:
    """Why `entry` cannot serve `need`: one 'field: needs X, module has Y' per difference."""
    spec = _spec_view(entry)
    wanted = {"mask": need.mask, "causal_align": need.causal_align, "window": need.window}
    problems = []
    if entry.kind != need.kind:
        problems.append(f"kind: needs {need.kind}, module is {entry.kind}")
    if need.arch != INTERPRETER and entry.arch != need.arch:
        problems.append(f"arch: needs {need.arch}, module is for {entry.arch}")
    for field, value in (("dtype", need.dtype), ("head_dim", need.head_dim),
                         ("head_dim_v", need.head_dim_v), ("alibi", need.alibi)):
        if spec.get(field) != value:
            problems.append(f"{field}: needs {value}, module has {spec.get(field)}")
    if float(spec.get("softcap") or 0.0) != float(need.softcap):
        problems.append(f"softcap: needs {need.softcap:g}, module has {spec.get('softcap'):g}")
    if effective_mask(spec, need) != effective_mask(wanted, need):
        problems.append(f"mask: needs {_mask_text(wanted)}, module has {_mask_text(spec)}")
    if need.kind == "decode":
        if spec.get("kv_layout") != need.kv_layout:
            problems.append(f"kv_layout: needs {need.kv_layout}, module has "
                            f"{spec.get('kv_layout')}")
        if need.kv_layout == "paged" and spec.get("page_size") != need.page_size:
            problems.append(f"page_size: needs {need.page_size}, module has "
                            f"{spec.get('page_size')}")
        if need.seqlen_q > int(spec.get("max_query_tokens") or 1):
            problems.append(f"max_query_tokens: needs {need.seqlen_q}, module has "
                            f"{spec.get('max_query_tokens')}")
    return problems


def _mask_text(spec: dict) -> str:
    if spec["mask"] == "none":
        return "none"
    window = f" window={tuple(spec['window'])}" if spec.get("window") else ""
    return f"{spec['mask']}({spec.get('causal_align')}{window})"


def select(api: str, need: Need, fallback: str | None = None) -> Dispatch:
    """The module that serves `need`, recorded; or a fallback (warned), or NoKernelError."""
    mode = _fallback if fallback is None else _check_fallback(fallback, "fallback")
    entries = current_registry().entries
    serving = [e for e in _same_kernel_fields(entries, need) if not mismatches(e, need)]
    if serving:
        # Prefer the module whose own mask is the asked one (a causal kernel over a window
        # kernel that equals causal at these lengths), then the newest arch, then the name.
        # At lengths 0 no window reaches anything, so effective_mask leaves masks as named.
        bare = replace(need, seqlen_q=0, seqlen_k=0)
        asked = effective_mask({"mask": need.mask, "causal_align": need.causal_align,
                                "window": need.window}, bare)
        best = min(serving, key=lambda e: (effective_mask(_spec_view(e), bare) != asked,
                                           -int(e.arch[2:]), e.module))
        reason = f"{best.describe()} serves {need.describe()}"
        return _record(Dispatch(api, need, best.describe(), best.key, reason))
    message = _no_kernel_message(need, entries)
    if mode == "error":
        raise NoKernelError(message)
    warnings.warn(f"attngen: falling back to torch SDPA: {message}", stacklevel=3)
    return _record(Dispatch(api, need, None, None, message, fallback=mode))


_prefiltered: tuple[object, dict[tuple, list[KernelEntry]]] = (None, {})


def _same_kernel_fields(entries, need: Need) -> list[KernelEntry]:
    """The entries that agree with `need` on everything but the mask, cached per registry:
    a decode loop asks once per layer and step with a new key length each time, so the scan
    of every module (most of a call's host time) is done once per kind of call instead."""
    global _prefiltered
    if _prefiltered[0] is not entries:
        _prefiltered = (entries, {})
    key = (need.kind, need.arch, need.dtype, need.head_dim, need.head_dim_v, need.alibi,
           float(need.softcap), need.kv_layout, need.page_size)
    hit = _prefiltered[1].get(key)
    if hit is None:
        def agrees(entry: KernelEntry) -> bool:
            spec = entry.spec
            return (entry.kind == need.kind
                    and (need.arch == INTERPRETER or entry.arch == need.arch)
                    and (spec.get("dtype"), spec.get("head_dim"), spec.get("head_dim_v"),
                         spec.get("alibi")) == (need.dtype, need.head_dim, need.head_dim_v,
                                                need.alibi)
                    and float(spec.get("softcap") or 0.0) == float(need.softcap))
        hit = _prefiltered[1][key] = [e for e in entries if agrees(e)]
    return hit


@torch.compiler.assume_constant_result
def choose(api: str, fields: tuple, device_type: str, device_index: int | None,
           fallback: str | None, refusal: str | None) -> Dispatch:
    """select() (or refuse() when `refusal` names a feature no kernel has) from plain values.

    torch.compile calls this once while tracing and keeps the Dispatch as a constant: its
    arguments are Python constants (Need's fields in order, the device), so the compiled
    graph holds the chosen module's key, and the selection code is never traced."""
    arch = device_arch(torch.device(device_type, device_index))
    need = Need(*fields[:9], arch, *fields[9:])
    if refusal:
        return refuse(api, need, refusal, fallback)
    return select(api, need, fallback)


@torch.compiler.assume_constant_result
def probe(api: str, fields: tuple, device_type: str, device_index: int | None
          ) -> Dispatch | None:
    """choose() for an optional route (the decode kind): the Dispatch, or None, no error."""
    need = Need(*fields[:9], device_arch(torch.device(device_type, device_index)), *fields[9:])
    if not any(not mismatches(e, need)
               for e in _same_kernel_fields(current_registry().entries, need)):
        return None
    return select(api, need)


def refuse(api: str, need: Need, why: str, fallback: str | None) -> Dispatch:
    """A call no generated kernel can serve for a reason outside the spec (a dense mask
    tensor, dropout): NoKernelError, or a warned fallback."""
    mode = _fallback if fallback is None else _check_fallback(fallback, "fallback")
    if mode == "error":
        raise NoKernelError(f"attngen.{api}: {why}; pass fallback='sdpa' to run torch instead")
    warnings.warn(f"attngen: falling back to torch SDPA: {why}", stacklevel=3)
    return _record(Dispatch(api, need, None, None, why, fallback=mode))


def _no_kernel_message(need: Need, entries: list[KernelEntry]) -> str:
    ranked = sorted(entries, key=lambda e: (len(mismatches(e, need)), e.kind != need.kind,
                                            e.describe()))
    shown: dict[str, KernelEntry] = {}
    for entry in ranked:  # one line per module name (its other archs would repeat it)
        if len(shown) < 3:
            shown.setdefault(entry.module, entry)
    nearest = "; ".join(f"{e.describe()} ({', '.join(mismatches(e, need))})"
                        for e in shown.values()) or "none: the registry is empty"
    folders = ", ".join(str(f) for f in current_registry().folders)
    return (f"no generated kernel serves {need.describe()} (kernels from {folders}); "
            f"nearest: {nearest}. Build a spec for it (attngen spec-from-hf, attngen build) "
            "and load it (attngen.runtime.load_kernels or ATTNGEN_KERNELS), or ask for "
            "fallback='sdpa'")


_last: Dispatch | None = None
_logs: list[list[Dispatch]] = []


def _record(dispatch: Dispatch) -> Dispatch:
    global _last
    _last = dispatch
    for log in _logs:
        log.append(dispatch)
    return dispatch


def last_dispatch() -> Dispatch | None:
    """The most recent Dispatch: which module served the last call and why (or the fallback)."""
    return _last


@contextlib.contextmanager
def dispatch_log() -> Iterator[list[Dispatch]]:
    """Collect every Dispatch made inside the block, in order."""
    log: list[Dispatch] = []
    _logs.append(log)
    try:
        yield log
    finally:
        _logs.remove(log)


def device_arch(device) -> str:
    """sm<major><minor> of a CUDA device; INTERPRETER for CPU tensors under TRITON_INTERPRET."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"sm{major}{minor}"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return INTERPRETER
    return device.type
