"""Dispatch: which generated module serves a call, and a record of why.

A call states what it needs (`Need`: kernel kind, dtype, head dims, mask, alignment, window,
softcap, ALiBi, the device's arch). `select` returns a `Dispatch` naming the module that
serves it and why, or, when none does, raises `NoKernelError` naming what the call needs and
the nearest modules with what differs, unless a fallback was asked for: then the Dispatch says
"fallback" and a warning names the reason. Nothing falls back silently.

Masks are compared by meaning at the call's lengths, not only by name: when Nq == Nk the two
causal alignments are the same mask; a sliding window whose reach covers every key is plain
causal (or no mask); and one query token at the bottom-right end sees every key under causal
(flash_attn_with_kvcache's default causal=False decode step runs on a causal decode kernel).
The lengths used are bounds the call's tensor shapes guarantee (padded lengths, packed
totals, cache capacity), never a caller's max_seqlen claim: a wrong claim must not turn a
causal call into a window kernel's call.

Every Dispatch is recorded, per thread: `last_dispatch()` is this thread's latest, and
`with dispatch_log() as log:` collects this thread's dispatches inside the block (logs nest).
Under torch.compile, selection runs while tracing, so it is recorded once per trace; the kernel
runs themselves are counted by the ops (`attngen.runtime.ops.run_counts`).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from attngen.runtime.devices import INTERPRETER, device_arch, device_problem
from attngen.runtime.registry import KernelEntry, Registry, current_registry

FALLBACKS = ("error", "sdpa")
_fallback = "error"


class NoKernelError(RuntimeError):
    """No generated module serves a call (and no fallback was asked for)."""


@dataclass(frozen=True)
class Need:
    """What a call needs from a kernel. seqlen_q/seqlen_k bound every sequence's lengths and
    must be guaranteed by the call's tensor shapes (padded lengths, packed totals, the cache's
    capacity), not taken from a caller's max_seqlen: mask equivalence is decided with them."""

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


def effective_mask(spec_like: dict, need: Need, *, at_lengths: bool = True) -> tuple:
    """(mask, align, window) as it acts at the need's lengths: the form two masks compare in.
    With at_lengths=False, only what holds at every length (the alignments agree when every
    sequence has Nq == Nk)."""
    mask, align = spec_like["mask"], spec_like.get("causal_align")
    window = spec_like.get("window")
    if at_lengths and mask != "none":
        mask, window = _mask_at_lengths(mask, align, window, need)
    if mask == "none" or need.same_lengths:
        align = None
    return mask, align, window


def _mask_at_lengths(mask: str, align: str | None, window, need: Need) -> tuple:
    # One query token at the bottom-right end sits at i' = Nk - 1: every key is at or before
    # it, so a window's right side excludes nothing and causal excludes nothing. (Not with
    # ALiBi: a mask-none module's bias distance is not the bottom-right one in every kind.)
    last_query_only = (need.seqlen_q <= 1 and not need.alibi
                       and (align == "bottom_right" or need.same_lengths))
    if mask == "sliding_window":
        left, right = window
        if last_query_only:
            right = 0
        reach = max(need.seqlen_q, need.seqlen_k) - 1  # the largest |i' - j| at these lengths
        if left >= reach and right >= reach:
            return "none", None
        if left >= reach and right == 0:
            mask = "causal"
        else:
            return mask, (left, right)
    if mask == "causal" and last_query_only:
        return "none", None
    return mask, None


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


def select(api: str, need: Need, fallback: str | None = None,
           registry: Registry | None = None) -> Dispatch:
    """The module that serves `need`, recorded; or a fallback (warned), or NoKernelError.
    One registry (the current one unless given) answers every question of one selection."""
    mode = _fallback if fallback is None else _check_fallback(fallback, "fallback")
    registry = registry or current_registry()
    serving = [e for e in _same_kernel_fields(registry, need) if not mismatches(e, need)]
    if serving:
        # Prefer the module whose own mask is the asked one (a causal kernel over a window
        # kernel that equals causal at these lengths), then the newest arch, then the name.
        asked = effective_mask({"mask": need.mask, "causal_align": need.causal_align,
                                "window": need.window}, need, at_lengths=False)
        best = min(serving, key=lambda e: (
            effective_mask(_spec_view(e), need, at_lengths=False) != asked,
            -int(e.arch[2:]), e.module))
        reason = f"{best.describe()} serves {need.describe()}"
        return _record(Dispatch(api, need, best.describe(), best.key, reason))
    message = _no_kernel_message(need, registry)
    if mode == "error":
        raise NoKernelError(message)
    warnings.warn(f"attngen: falling back to torch SDPA: {message}", stacklevel=3)
    return _record(Dispatch(api, need, None, None, message, fallback=mode))


def _same_kernel_fields(registry: Registry, need: Need) -> list[KernelEntry]:
    """The entries that agree with `need` on everything but the mask, cached on the registry:
    a decode loop asks once per layer and step with a new key length each time, so the scan
    of every module (most of a call's host time) is done once per kind of call instead."""
    key = (need.kind, need.arch, need.dtype, need.head_dim, need.head_dim_v, need.alibi,
           float(need.softcap), need.kv_layout, need.page_size)

    def agrees(entry: KernelEntry) -> bool:
        spec = entry.spec
        return (entry.kind == need.kind
                and (need.arch == INTERPRETER or entry.arch == need.arch)
                and (spec.get("dtype"), spec.get("head_dim"), spec.get("head_dim_v"),
                     spec.get("alibi")) == (need.dtype, need.head_dim, need.head_dim_v,
                                            need.alibi)
                and float(spec.get("softcap") or 0.0) == float(need.softcap))

    return registry.matching(key, agrees)


@torch.compiler.assume_constant_result
def choose(api: str, fields: tuple, device_type: str, device_index: int | None,
           fallback: str | None, refusal: str | None) -> Dispatch:
    """select() (or refuse() when `refusal` names a feature no kernel has) from plain values.

    torch.compile calls this once while tracing and keeps the Dispatch as a constant: its
    arguments are Python constants (Need's fields in order, the device), so the compiled
    graph holds the chosen module's key, and the selection code is never traced."""
    arch = device_arch(torch.device(device_type, device_index))
    need = Need(*fields[:9], arch, *fields[9:])
    refusal = refusal or device_problem(api, need.arch, need.dtype)
    if refusal:
        return refuse(api, need, refusal, fallback)
    return select(api, need, fallback)


@torch.compiler.assume_constant_result
def probe(api: str, fields: tuple, device_type: str, device_index: int | None
          ) -> Dispatch | None:
    """choose() for an optional route (the decode kind): the Dispatch, or None, no error."""
    need = Need(*fields[:9], device_arch(torch.device(device_type, device_index)), *fields[9:])
    if device_problem(api, need.arch, need.dtype):
        return None  # the route that follows refuses the call, with the reason
    registry = current_registry()
    if not any(not mismatches(e, need) for e in _same_kernel_fields(registry, need)):
        return None
    return select(api, need, registry=registry)


def refuse(api: str, need: Need, why: str, fallback: str | None) -> Dispatch:
    """A call no generated kernel can serve for a reason outside the spec (a dense mask
    tensor, dropout, a device the kernels cannot run on): NoKernelError, or a warned
    fallback."""
    mode = _fallback if fallback is None else _check_fallback(fallback, "fallback")
    if mode == "error":
        raise NoKernelError(f"attngen.{api}: {why}; pass fallback='sdpa' to run torch instead")
    warnings.warn(f"attngen: falling back to torch SDPA: {why}", stacklevel=3)
    return _record(Dispatch(api, need, None, None, why, fallback=mode))


def _no_kernel_message(need: Need, registry: Registry) -> str:
    ranked = sorted(registry.entries, key=lambda e: (len(mismatches(e, need)),
                                                     e.kind != need.kind, e.describe()))
    shown: dict[str, KernelEntry] = {}
    for entry in ranked:  # one line per module name (its other archs would repeat it)
        if len(shown) < 3:
            shown.setdefault(entry.module, entry)
    nearest = "; ".join(f"{e.describe()} ({', '.join(mismatches(e, need))})"
                        for e in shown.values()) or "none: the registry is empty"
    folders = ", ".join(str(f) for f in registry.folders)
    return (f"no generated kernel serves {need.describe()} (kernels from {folders}); "
            f"nearest: {nearest}. Build a spec for it (attngen spec-from-hf, attngen build) "
            "and load it (attngen.runtime.load_kernels or ATTNGEN_KERNELS), or ask for "
            "fallback='sdpa'")


class _ThreadRecords(threading.local):
    """Per thread: the latest Dispatch and the open dispatch_log() lists, innermost last."""

    def __init__(self) -> None:
        self.last: Dispatch | None = None
        self.logs: list[list[Dispatch]] = []


_records = _ThreadRecords()


def _record(dispatch: Dispatch) -> Dispatch:
    _records.last = dispatch
    for log in _records.logs:
        log.append(dispatch)
    return dispatch


def last_dispatch() -> Dispatch | None:
    """This thread's most recent Dispatch: which module served its last call and why (or the
    fallback). Per thread, so a server's other threads never show up here."""
    return _records.last


@contextlib.contextmanager
def dispatch_log() -> Iterator[list[Dispatch]]:
    """Collect every Dispatch this thread makes inside the block, in order. Logs nest: an
    outer log also gets what an inner one collects."""
    log: list[Dispatch] = []
    logs = _records.logs
    logs.append(log)
    try:
        yield log
    finally:
        # By identity: two logs with equal contents (both empty, say) are different logs.
        del logs[next(i for i, open_log in enumerate(logs) if open_log is log)]
