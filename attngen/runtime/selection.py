"""Selection: which generated module serves a request, and the record of it. Plain Python.

A call states what it needs as a `Need` (kernel kind, dtype, head dims, mask, alignment,
window, softcap, ALiBi, the device's arch, and lengths its tensors guarantee); `best_entry`
finds the module that serves it, and `mismatches` says why any other one does not.

Masks are compared by meaning at the call's lengths: when Nq == Nk the two causal alignments
are the same mask; a sliding window whose reach covers every key is plain causal (or no
mask); one query token at the bottom-right end sees every key under causal. The lengths are
bounds the call's tensor shapes guarantee (padded lengths, packed totals, cache capacity),
never a caller's max_seqlen claim. dispatch.py is the torch side: it builds a Need from
tensors and records the choice.

The route cache (`routes`): everything the runtime derives from a registry's entries for the
calls it serves, in one dictionary held here, bound to the registry in use and bounded
(ROUTE_CACHE_SIZE: a full cache drops its older half); docs/architecture.md ("The caches")
gives its keys.

The record, per thread: `last_dispatch()` is this thread's latest Dispatch, and `with
dispatch_log() as log:` collects its dispatches inside the block (logs nest). Recording is
one attribute store per call, so it is always on (under torch.compile, once per trace).
"""

from __future__ import annotations

import contextlib
import threading
from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass, replace
from itertools import islice
from typing import Any, NamedTuple

from attngen.runtime.registry import (
    KernelEntry,
    Registry,
    cache_entry,
    cached_build,
    current_registry,
)
from attngen.spec import (
    AttnSpec,
    CausalAlign,
    Dtype,
    KernelKind,
    KvDtype,
    KvLayout,
    Mask,
    SpecError,
    specs_from_data,
)
from attngen.spec.expressions import expression_key

INTERPRETER = "interpreter"  # CPU tensors under TRITON_INTERPRET=1: any arch's module runs
FALLBACKS = ("error", "sdpa")
ROUTE_CACHE_SIZE = 4096  # a full route cache drops its older half (lengths vary per call)
NO_BACKWARD = (
    "backward: needs true (the inputs require grad: gradient kernels), module has false "
    "(forward-only)"
)


class NoKernelError(RuntimeError):
    """No generated module serves a call (and no fallback was asked for)."""


class Need(NamedTuple):
    """What a call needs from a kernel, in the spec's vocabulary; built by field name.

    A NamedTuple: immutable, hashable at a tuple's cost (dispatch caches by it on every
    call), and its fields are plain constants that torch.compile can hand to a function it
    does not trace. seqlen_q/seqlen_k bound every sequence's lengths and must be guaranteed
    by the call's tensor shapes (padded lengths, packed totals, the cache's capacity), not
    taken from a caller's max_seqlen: mask equivalence is decided with them."""

    kind: KernelKind
    dtype: Dtype | None  # None: q's dtype has no generated kernels (the call is refused)
    head_dim: int
    head_dim_v: int
    mask: Mask
    causal_align: CausalAlign | None  # None with mask none
    window: tuple[int, int] | None  # (left, right) with mask sliding_window
    softcap: float
    alibi: bool
    arch: str  # sm<major><minor>, INTERPRETER, or the device type no kernel runs on
    seqlen_q: int
    seqlen_k: int
    same_lengths: bool  # every sequence has Nq == Nk, so the alignments coincide
    kv_layout: KvLayout | None = None  # decode only
    page_size: int | None = None  # decode only, paged
    backward: bool = False  # the call runs the module's gradient kernels (spec backward: true)
    sinks: bool = False  # the call passes learned sinks [HQ] (gpt-oss)
    chunk_size: int | None = None  # with mask chunked
    sink_tokens: int | None = None  # with mask sliding_window: the first keys always seen
    dropout: bool = False  # dropout_p > 0: a module built with dropout: true (name *_bwd_drop)
    # score_mod / mask_mod: attngen.spec.expressions.expression_key of the spec the call asks for
    # ("": none). A module with expressions serves only calls that ask for its own.
    expressions: str = ""
    kv_dtype: KvDtype | None = None  # decode only: an fp8 cache (kv_dtype: fp8_e4m3)

    def describe(self) -> str:
        mask = self.mask.value
        if self.mask is not Mask.none:
            align = self.causal_align.value if self.causal_align else None
            extra = f", window={self.window}" if self.window else ""
            extra += f", chunk_size={self.chunk_size}" if self.chunk_size else ""
            extra += f", sink_tokens={self.sink_tokens}" if self.sink_tokens else ""
            mask += f"({align}{extra})"
        dims = str(self.head_dim)
        dims += f"/{self.head_dim_v}" if self.head_dim_v != self.head_dim else ""
        dtype = self.dtype.value if self.dtype else "unsupported"
        text = (
            f"kind={self.kind.value} dtype={dtype} head_dim={dims} mask={mask} "
            f"softcap={self.softcap:g} alibi={self.alibi} arch={self.arch}"
        )
        text += " sinks=True" if self.sinks else ""
        text += f" kv_layout={self.kv_layout.value}" if self.kv_layout else ""
        text += f" kv_dtype={self.kv_dtype.value}" if self.kv_dtype else ""
        text += " backward=True" if self.backward else ""
        return text + (" dropout_p>0" if self.dropout else "")


@dataclass(frozen=True)
class Dispatch:
    """What ran for one call: a generated module (key, name) or a fallback, and why."""

    api: str  # the public function that was called
    need: Need
    module: str | None  # "<arch>/<module name>", None for a fallback
    key: str | None  # the module file; what the ops take
    reason: str
    fallback: str | None = None  # "sdpa" when torch ran instead of a generated kernel
    writes_out: bool = False  # the module writes a given output in place (its `out=`)
    source: str | None = None  # the module's layer: "folder", "cache" (on demand), "bundled"
    built: bool = False  # this call rendered the module on demand (key: where it lives)
    # A prefill or varlen module's forward kernel: "gluon warp-specialized" or "tile-level:
    # <why not>"; what the module expects when selected, what it ran in last_dispatch().
    forward: str | None = None


def check_fallback(mode: object, name: str) -> str:
    if mode not in FALLBACKS:
        raise ValueError(f"{name}: got {mode!r}; allowed: {', '.join(map(repr, FALLBACKS))}")
    return str(mode)


# ----------------------------------------------------------------------- masks by meaning


def effective_mask(spec_like: dict[str, Any], need: Need, *, at_lengths: bool = True) -> tuple:
    """(mask, align, window, chunk_size, sink_tokens) as it acts at the need's lengths: the
    form two masks compare in. With at_lengths=False, only what holds at every length (the
    alignments agree when every sequence has Nq == Nk)."""
    mask, align = spec_like["mask"], spec_like.get("causal_align")
    window = spec_like.get("window")
    chunk, sink_tokens = spec_like.get("chunk_size"), spec_like.get("sink_tokens")
    if at_lengths and mask != "none":
        if mask == "chunked" and chunk is not None and chunk >= max(need.seqlen_q, need.seqlen_k):
            mask, chunk = "causal", None  # one chunk holds every aligned position
        mask, window = _mask_at_lengths(mask, align, window, need)
    if mask != "sliding_window":
        sink_tokens = None  # a window that reaches every key has no keys to add back
    if mask != "chunked":
        chunk = None
    # Without a mask, ALiBi's distance is taken at bottom-right positions: a mask that excludes
    # nothing at these lengths but aligns top-left keeps its top-left distance, so with ALiBi
    # it is mask none only when the alignments coincide.
    top_left_bias = need.alibi and align == "top_left" and spec_like["mask"] != "none"
    if need.same_lengths or (mask == "none" and not top_left_bias):
        align = None
    return mask, align, window, chunk, sink_tokens


def length_thresholds(entries: list[KernelEntry]) -> tuple[int, ...]:
    """Every length t at which some module's mask changes what it means (sorted): effective_mask
    compares m = max(Nq, Nk) with the entries' windows (m <= left + 1, m <= right + 1; with one
    query token the right side counts as 0) and chunk sizes (m <= chunk) and with nothing else
    of the key length. Needs whose m lies on the same side of every threshold, and equal in
    every other field, select the same module (dispatch.py caches by that)."""
    found = {1}
    for entry in entries:
        spec = entry.spec
        if spec["mask"] == "sliding_window":
            found.update((spec["window_left"] + 1, (spec.get("window_right") or 0) + 1))
        elif spec["mask"] == "chunked" and spec.get("chunk_size"):
            found.add(int(spec["chunk_size"]))
    return tuple(sorted(found))


def registry_thresholds(registry: Registry) -> tuple[int, ...]:
    """length_thresholds of the registry's entries now: computed once per entries list (add()
    replaces the list, so a module built on demand is counted from then on)."""
    entries = registry.entries
    cached = routes(registry).get(_THRESHOLDS)
    if cached is not None and cached[0] is entries:
        return cached[1]
    thresholds = length_thresholds(entries)
    keep(registry, _THRESHOLDS, (entries, thresholds))  # one value: a whole pair
    return thresholds


def length_class(need: Need, thresholds: tuple[int, ...]) -> tuple[int, tuple[bool, ...]]:
    """Where m = max(Nq, Nk) lies among `thresholds` (how many are >= m) and, for the need's
    own window or chunk, whether m is within each of its thresholds."""
    m = max(need.seqlen_q, need.seqlen_k)
    own: tuple[int, ...] = ()
    if need.window is not None:
        own = (need.window[0] + 1, need.window[1] + 1, 1)
    if need.chunk_size is not None:
        own += (need.chunk_size,)
    return len(thresholds) - bisect_left(thresholds, m), tuple(m <= t for t in own)


def _mask_at_lengths(
    mask: str, align: str | None, window: tuple[int, int] | None, need: Need
) -> tuple[str, tuple[int, int] | None]:
    # One query token at the bottom-right end sits at i' = Nk - 1: every key is at or before
    # it, so a window's right side excludes nothing and causal excludes nothing. (Not with
    # ALiBi: a mask-none module's bias distance is not the bottom-right one in every kind.)
    last_query_only = (
        need.seqlen_q <= 1 and not need.alibi and (align == "bottom_right" or need.same_lengths)
    )
    if mask == "sliding_window" and window is not None:
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


def spec_view(entry: KernelEntry) -> dict[str, Any]:
    """The entry's spec with its window as one (left, right) value, like a Need's."""
    spec = entry.spec
    window = None
    if spec["mask"] == "sliding_window":
        window = (spec["window_left"], spec.get("window_right") or 0)
    return {**spec, "window": window}


def _asked(need: Need) -> dict[str, Any]:
    return {
        "mask": need.mask.value,
        "causal_align": need.causal_align,
        "window": need.window,
        "chunk_size": need.chunk_size,
        "sink_tokens": need.sink_tokens,
    }


# ------------------------------------------------------------------------------ selection


def mismatches(entry: KernelEntry, need: Need) -> list[str]:
    """Why `entry` cannot serve `need`: one 'field: needs X, module has Y' per difference."""
    spec = spec_view(entry)
    problems = []
    if entry.kind != need.kind:
        problems.append(f"kind: needs {need.kind.value}, module is {entry.kind}")
    if need.arch != INTERPRETER and entry.arch != need.arch:
        problems.append(f"arch: needs {need.arch}, module is for {entry.arch}")
    dtype = need.dtype.value if need.dtype else "unsupported"
    dims = (("head_dim", need.head_dim), ("head_dim_v", need.head_dim_v))
    for field, value in (("dtype", dtype), *dims, ("alibi", need.alibi)):
        if spec.get(field) != value:
            problems.append(f"{field}: needs {value}, module has {spec.get(field)}")
    if bool(spec.get("sinks")) != need.sinks:  # absent from specs without sinks
        problems.append(f"sinks: needs {need.sinks}, module has {bool(spec.get('sinks'))}")
    if float(spec.get("softcap") or 0.0) != float(need.softcap):
        problems.append(f"softcap: needs {need.softcap:g}, module has {spec.get('softcap'):g}")
    if effective_mask(spec, need) != effective_mask(_asked(need), need):
        problems.append(f"mask: needs {_mask_text(_asked(need))}, module has {_mask_text(spec)}")
    if need.dropout and not spec.get("dropout"):
        built = "built with dropout: true (and backward: true; its name ends _bwd_drop)"
        problems.append(f"dropout_p: needs a module {built}, module has dropout: false")
    served = expression_key(spec)
    if served != need.expressions:
        problems.append(
            f"score_mod/mask_mod: needs {need.expressions or 'none'}, module has {served or 'none'}"
        )
    if need.kind is KernelKind.decode:
        problems += _decode_mismatches(spec, need)
    if need.backward and not spec.get("backward"):
        problems.append(NO_BACKWARD)
    return problems


def _decode_mismatches(spec: dict[str, Any], need: Need) -> list[str]:
    problems = []
    layout = need.kv_layout.value if need.kv_layout else None
    if spec.get("kv_layout") != layout:
        problems.append(f"kv_layout: needs {layout}, module has {spec.get('kv_layout')}")
    if need.kv_layout is KvLayout.paged and spec.get("page_size") != need.page_size:
        problems.append(f"page_size: needs {need.page_size}, module has {spec.get('page_size')}")
    kv_dtype = need.kv_dtype.value if need.kv_dtype else None
    if spec.get("kv_dtype") != kv_dtype:
        problems.append(f"kv_dtype: needs {kv_dtype}, module has {spec.get('kv_dtype')}")
    if need.seqlen_q > int(spec.get("max_query_tokens") or 1):
        problems.append(
            f"max_query_tokens: needs {need.seqlen_q}, module has {spec.get('max_query_tokens')}"
        )
    return problems


def _mask_text(spec: dict[str, Any]) -> str:
    mask = str(getattr(spec["mask"], "value", spec["mask"]))
    if mask == "none":
        return "none"
    align = spec.get("causal_align")
    window = f" window={tuple(spec['window'])}" if spec.get("window") else ""
    window += f" chunk_size={spec['chunk_size']}" if spec.get("chunk_size") else ""
    window += f" sink_tokens={spec['sink_tokens']}" if spec.get("sink_tokens") else ""
    return f"{mask}({getattr(align, 'value', align)}{window})"


def best_entry(registry: Registry, need: Need) -> KernelEntry | None:
    """The module that serves `need`, or None. Among several, the one of the first layer and
    folder (registry.py: explicit folders, the on-demand cache, generated/), then the one
    whose own mask is the asked one (a causal kernel over a window kernel that equals causal
    at these lengths), then the newest arch, then the name."""
    serving = [e for e in same_kernel_fields(registry, need) if not mismatches(e, need)]
    if not serving:
        return None
    asked = effective_mask(_asked(need), need, at_lengths=False)
    return min(
        serving,
        key=lambda e: (
            e.rank,
            effective_mask(spec_view(e), need, at_lengths=False) != asked,
            -int(e.arch[2:]),
            e.module,
        ),
    )


def same_kernel_fields(registry: Registry, need: Need) -> list[KernelEntry]:
    """The entries that agree with `need` on everything but the mask, in the route cache: a
    decode loop asks with a new key length at each step, so the scan of every module is done
    once per kind of call instead."""
    key = (_SAME_FIELDS, need.kind, need.arch, need.dtype, need.head_dim, need.head_dim_v,
           need.alibi, float(need.softcap), need.kv_layout, need.page_size, need.sinks)  # fmt: skip
    dtype = need.dtype.value if need.dtype else None

    def agrees(entry: KernelEntry) -> bool:
        spec = entry.spec
        return (
            entry.kind == need.kind
            and (need.arch == INTERPRETER or entry.arch == need.arch)
            and (
                spec.get("dtype"),
                spec.get("head_dim"),
                spec.get("head_dim_v"),
                spec.get("alibi"),
                bool(spec.get("sinks")),
            )
            == (dtype, need.head_dim, need.head_dim_v, need.alibi, need.sinks)
            and float(spec.get("softcap") or 0.0) == float(need.softcap)
        )

    # The entries are read once: add() replaces the list, so a list computed from old entries
    # is stored with them and never served after it.
    entries = registry.entries
    cached = routes(registry).get(key)
    if cached is not None and cached[0] is entries:
        return cached[1]
    hit = [entry for entry in entries if agrees(entry)]
    keep(registry, key, (entries, hit))  # a racing thread stores an equal list: harmless
    return hit


def no_kernel_message(need: Need, registry: Registry, not_built: str = "") -> str:
    ranked = sorted(
        registry.entries,
        key=lambda e: (len(mismatches(e, need)), e.kind != need.kind, e.describe()),
    )
    shown: dict[str, KernelEntry] = {}
    for entry in ranked:  # one line per module name (its other archs would repeat it)
        if len(shown) < 3:
            shown.setdefault(entry.module, entry)
    nearest = (
        "; ".join(f"{e.describe()} ({', '.join(mismatches(e, need))})" for e in shown.values())
        or "none: the registry is empty"
    )
    folders = ", ".join(str(f) for f in registry.folders)
    # No fallback computes gradients from a given LSE (need.backward): none is offered; a
    # forward whose inputs require grad needs none when run under torch.no_grad().
    fallback = (
        "; a call that needs no gradient runs on forward-only modules under torch.no_grad()"
        if need.backward
        else ", or ask for fallback='sdpa'"
    )
    return (
        f"no generated kernel serves {need.describe()} (kernels from {folders}); "
        f"nearest: {nearest}. {not_built or 'Not built on demand.'} Build a spec for it "
        "(attngen spec-from-hf, attngen build) and load it (attngen.load_kernels or "
        f"ATTNGEN_KERNELS){fallback}"
    )


# ------------------------------------------------------------------------ the route cache

_THRESHOLDS = ("length thresholds",)  # route keys of selection's own (no api is named so)
_SAME_FIELDS = "same kernel fields"


class _Routes:
    """The route cache and the registry it belongs to: replaced whole (one attribute store),
    so a reader holds one consistent pair."""

    __slots__ = ("registry", "table")

    def __init__(self, registry: Registry | None, table: dict[tuple, Any]) -> None:
        self.registry = registry
        self.table = table


_routes = _Routes(None, {})


def routes(registry: Registry) -> dict[tuple, Any]:
    """The route cache of `registry` (the module docstring): the one held when it belongs to
    it, a new one when `registry` is the one in use, else an empty dictionary no one keeps (a
    thread still holding a replaced registry: its choices serve no later call)."""
    global _routes
    held = _routes
    if held.registry is registry:
        return held.table
    if registry is not current_registry():
        return {}
    held = _routes = _Routes(registry, {})
    return held.table


def keep(registry: Registry, key: tuple, value: Any) -> None:
    """Keep `value` under `key` in `registry`'s route cache. Bounded (ROUTE_CACHE_SIZE): a
    full cache drops its older half, so what one call keeps in turn (its Need's Dispatch,
    then its plan, which looks that Dispatch up) survives the call."""
    table = routes(registry)
    if len(table) >= ROUTE_CACHE_SIZE:
        for old in list(islice(table, max(1, len(table) // 2))):
            table.pop(old, None)
    table[key] = value


class _ThreadRecords(threading.local):
    """Per thread: the latest Dispatch and the open dispatch_log() lists, innermost last."""

    def __init__(self) -> None:
        self.last: Dispatch | None = None
        self.logs: list[list[Dispatch]] = []


_records = _ThreadRecords()


def record(dispatch: Dispatch) -> Dispatch:
    records = _records
    records.last = dispatch
    if records.logs:
        for log in records.logs:
            log.append(dispatch)
    return dispatch


def last_dispatch() -> Dispatch | None:
    """This thread's most recent Dispatch: which module served its last call and why (or the
    fallback). Per thread, so a server's other threads never show up here. Its `forward` is
    the forward kernel the module ran for that call ("gluon warp-specialized", or
    "tile-level: <why>"), as the module's forward_path() reports it."""
    last = _records.last
    if last is None or last.forward is None or last.key is None:
        return last
    return _with_forward(last)


def _with_forward(dispatch: Dispatch) -> Dispatch:
    """`dispatch` itself when its module's last forward on this thread is the one the
    Dispatch expects, else (in the route cache) a copy whose `forward` is the one that ran."""
    registry = current_registry()
    try:
        module = registry.module(dispatch.key)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - a replaced registry: the record as it was made
        return dispatch
    taken = getattr(module, "forward_path", None)  # prefill and varlen modules only (kind)
    path = None if taken is None else str(taken())
    if path is None or path == dispatch.forward or path.endswith("no call yet"):
        return dispatch
    variant = routes(registry).get((dispatch, path))
    if variant is None:
        variant = replace(dispatch, forward=path)
        keep(registry, (dispatch, path), variant)
    return variant


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


# ---------------------------------------------------------------------- kernels on demand
#
# Kernels on demand (docs/integration.md says what a user sees): when no loaded module serves a
# call (dispatch.py asks, with the call's Need and head counts), `build_for` states the call as
# a spec, renders it through the build path (plan_build: the tiling model's config, or the
# tuning database's), writes it into the on-demand cache (registry.py) and adds it to the
# registry in use. No torch here: the build path stays torch-free, and this is its glue.
# The spec takes every field a kernel depends on from the Need (`backward: true` when the call
# runs gradient kernels; dropout_p > 0: `dropout: true` too) and the call's own head counts
# (the tiling model and the tuning key use them): its name `auto_h<HQ>kv<HKV>...` serves any
# counts later. A window side of 2**31 - 1 (flash-attn's -1) is unbounded: unbounded on both
# sides is no mask, unbounded left and closed right is causal. The arch is the device's, or
# INTERPRETER_ARCH under Triton's interpreter (the portable path every arch shares).

INTERPRETER_ARCH = "sm80"
UNBOUNDED = 2**31 - 1  # flash-attn's -1 window side, as arguments.INFINITE
NAME_PREFIX = "auto"


class NotExpressible(ValueError):
    """A call no spec can state (its message says which field, and why)."""


def build_for(
    need: Need, heads: tuple[int, int] | None, registry: Registry
) -> tuple[KernelEntry, bool]:
    """The cache's module for `need` (built now unless a valid one is there), added to
    `registry`; (entry, whether this call rendered it). NotExpressible or BuildError say why
    none can be built."""
    spec, kind, arch = spec_for(need, heads)
    folder, item, built = cached_build(spec, kind, arch)
    registry.add(cache_entry(folder, item), folder.resolve())
    return cache_entry(folder, item), built


def spec_for(
    need: Need, heads: tuple[int, int] | None, expressions: dict[str, Any] | None = None
) -> tuple[AttnSpec, KernelKind, str]:
    """The spec, kind and arch that serve `need` (the module docstring), with `expressions`'
    fields (score_mod, mask_mod, tensors: flex_attention's), or NotExpressible."""
    from attngen.arch import ARCHS

    arch = INTERPRETER_ARCH if need.arch == INTERPRETER else need.arch
    if need.kv_dtype is not None and need.arch == INTERPRETER:
        arch = "sm89"  # fp8 caches need sm89+ (the same pointer-load path as sm80)
    if arch not in ARCHS:
        raise NotExpressible(
            f"arch: {need.arch} has no row in attngen/arch.py (known: {', '.join(ARCHS)})"
        )
    if need.dtype is None:
        raise NotExpressible("dtype: no generated kernels for q's dtype")
    num_q, num_kv = _head_counts(heads)
    fields: dict[str, Any] = {
        "name": f"{NAME_PREFIX}_h{num_q}kv{num_kv}",
        "archs": [arch],
        "dtype": need.dtype.value,
        "head_dim": need.head_dim,
        "head_dim_v": need.head_dim_v,
        "num_q_heads": num_q,
        "num_kv_heads": num_kv,
        "softcap": float(need.softcap),
        "alibi": need.alibi,
        "kernels": [need.kind.value],
        **_mask_fields(need),
    }
    if need.sinks:
        fields["sinks"] = True
    if need.dropout:
        fields.update(backward=True, dropout=True)
    if need.kind is KernelKind.decode:
        fields["kv_layout"] = need.kv_layout.value if need.kv_layout else None
        if need.page_size is not None:
            fields["page_size"] = need.page_size
        fields["max_query_tokens"] = max(1, need.seqlen_q)
        if need.kv_dtype is not None:
            fields["kv_dtype"] = need.kv_dtype.value
    if need.backward:
        fields["backward"] = True
    fields.update(expressions or {})
    try:
        (spec,) = specs_from_data(fields)
    except SpecError as exc:
        raise NotExpressible(str(exc)) from None
    return spec, need.kind, arch


def _head_counts(heads: tuple[int, int] | None) -> tuple[int, int]:
    """The call's (query heads, KV heads) as valid spec fields: 1..1024 and a divisor."""
    if heads is None:
        return 1, 1
    num_q, num_kv = heads
    if num_kv < 1 or num_q < num_kv or num_q % num_kv:
        return 1, 1  # the module itself refuses such a call, naming the head counts
    ratio = num_q // num_kv
    num_kv = max(1, min(num_kv, 1024 // min(ratio, 1024)))
    return min(ratio, 1024) * num_kv, num_kv


def _mask_fields(need: Need) -> dict[str, Any]:
    mask, window = need.mask, need.window
    if mask is Mask.sliding_window and window is not None:
        left, right = window
        if left >= UNBOUNDED and right >= UNBOUNDED:
            mask = Mask.none
        elif left >= UNBOUNDED and right == 0:
            mask = Mask.causal
    if mask is Mask.none:
        return {"mask": "none"}
    align = need.causal_align.value if need.causal_align else None
    fields: dict[str, Any] = {"mask": mask.value, "causal_align": align}
    if mask is Mask.sliding_window and window is not None:
        fields.update(window_left=window[0], window_right=window[1])
        if need.sink_tokens:
            fields["sink_tokens"] = need.sink_tokens
    if mask is Mask.chunked:
        fields["chunk_size"] = need.chunk_size
    return fields


def cached_module(spec: AttnSpec, kind: KernelKind, arch: str) -> tuple[KernelEntry, bool]:
    """The cache's entry for (spec, kind, arch), rendered and written unless a valid one is
    there (cached_build); (entry, whether it was rendered now)."""
    folder, item, built = cached_build(spec, kind, arch)
    return cache_entry(folder, item), built
