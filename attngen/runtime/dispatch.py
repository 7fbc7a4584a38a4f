"""Dispatch: from a call's tensors to the generated module that serves it, recorded.

`need_for` states what a call needs (a `Need`, selection.py) from its tensors and arguments;
`choose` returns the `Dispatch` naming the module that serves it and why, or, when none does,
raises `NoKernelError` naming what the call needs and the nearest modules with what differs,
unless a fallback was asked for: then the Dispatch says "fallback" and a warning names the
reason. Nothing falls back silently. Every Dispatch is recorded per thread (records.py).

A repeated call costs one dictionary lookup: served Dispatches are cached on the registry
that chose them, keyed by (api, Need), and once more by the api and the Need with its key
length replaced by its length class: the lengths change a selection only where max(Nq, Nk)
crosses a module's window or chunk (selection.length_thresholds), so a decode loop whose
key count grows every step selects once per class, not once per step (`cached_dispatch`);
the Dispatch recorded carries the call's own Need. A registry replaced by load_kernels takes
its cache with it, so a replaced registry never serves a later call. Refusals and fallbacks
are not cached: they warn or raise on every call.

When no loaded module serves a call and on-demand builds are on (kernel_cache.py), `select`
has ondemand.py build the module the call needs into the cache and add it to the registry:
the Dispatch says so (source "cache", built=True, its key the file), and later calls find it
like any loaded module. A call no spec can state, or a build that fails (no tile fits), is
refused as before, with the reason added.

Under torch.compile, `choose` hands the Need's fields to a function dynamo does not trace
(`torch.compiler.assume_constant_result`): selection runs once while tracing and the compiled
graph holds the chosen module's key as a constant.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from attngen.runtime import kernel_cache
from attngen.runtime.arguments import softcap_value
from attngen.runtime.devices import device_arch, device_problem
from attngen.runtime.registry import KernelEntry, Registry, current_registry
from attngen.runtime.selection import (
    INTERPRETER,
    Dispatch,
    Need,
    NoKernelError,
    best_entry,
    check_fallback,
    length_class,
    no_kernel_message,
    record,
    registry_thresholds,
)
from attngen.spec import CausalAlign, Dtype, KernelKind, KvDtype, KvLayout, Mask

# A module whose entry point takes `out=` (an output of the call's shape, dtype and device,
# any strides, written in place and returned) says so with this constant set to True.
ACCEPTS_OUT = "ACCEPTS_OUT"
DISPATCH_CACHE_SIZE = 4096  # per registry; a full cache starts over (lengths vary per call)
_fallback = "error"


def _class_key(api: str, need: Need, registry: Registry) -> tuple:
    """The dispatch cache's second key of a call: every field of its Need but the key length,
    which enters as its class among the registry's length thresholds
    (selection.length_class); the thresholds themselves are in the key, so a module built on
    demand with a new window never meets a choice made before it."""
    thresholds = registry_thresholds(registry)
    return api, need._replace(seqlen_k=-1), thresholds, length_class(need, thresholds)


def cached_dispatch(api: str, need: Need, registry: Registry) -> Dispatch | None:
    """The cached Dispatch of a call: under (api, Need) for a Need seen before, else under
    its length class (the record then gets the call's own Need and is kept under it too)."""
    hit = registry.dispatches.get((api, need))
    if hit is None:
        hit = registry.dispatches.get(_class_key(api, need, registry))
        if hit is not None:
            hit = dataclasses.replace(hit, need=need)
            _keep(registry, (api, need), hit)
    return hit


def _keep(registry: Registry, key: tuple, dispatch: Dispatch) -> None:
    if len(registry.dispatches) >= DISPATCH_CACHE_SIZE:
        registry.dispatches.clear()
    registry.dispatches[key] = dispatch


def set_fallback(mode: str) -> None:
    """What to do when no generated kernel serves a call: "error" (default) or "sdpa"."""
    global _fallback
    _fallback = check_fallback(mode, "mode")


def get_fallback() -> str:
    return _fallback


# ------------------------------------------------------------------------ the request


# The torch dtype of each Dtype, derived from the one vocabulary once at import: a plain dict
# lookup, which torch.compile traces (dynamo 2.11 cannot iterate an Enum class while tracing).
_KERNEL_DTYPES: dict[torch.dtype, Dtype] = {getattr(torch, d.torch_name): d for d in Dtype}
_cuda_archs: dict[int | None, str] = {}
_interpreting = False  # CPU tensors were found served by Triton's interpreter (see arch_of)


def kernel_dtype(dtype: torch.dtype) -> Dtype | None:
    """The Dtype of a torch dtype (None: no kernels for it)."""
    return _KERNEL_DTYPES.get(dtype)


@torch.compiler.assume_constant_result
def arch_of(device_type: str, device_index: int | None) -> str:
    """devices.device_arch of a device, remembered: a CUDA device's arch is fixed, and once
    CPU tensors are served by Triton's interpreter they stay so (triton decides at import
    whether it interprets); until then the CPU's answer is asked each time."""
    global _interpreting
    if device_type == "cuda":
        arch = _cuda_archs.get(device_index)
        if arch is None:
            arch = _cuda_archs[device_index] = device_arch(_device(device_type, device_index))
        return arch
    if device_type == "cpu" and _interpreting:
        return INTERPRETER
    arch = device_arch(_device(device_type, device_index))
    if arch == INTERPRETER:
        _interpreting = True
    return arch


def _device(device_type: str, device_index: int | None) -> torch.device:
    return (
        torch.device(device_type)
        if device_index is None
        else torch.device(device_type, device_index)
    )


@dataclass(frozen=True, slots=True)
class Call:
    """A call's options, built once by each public function after its checks and handed whole
    to the launch (launch.py): they give the dispatch's Need (`need`) and the fallback's
    arguments (`torch_options`). alibi_slopes and sinks are the call's tensors (their presence
    picks the module); heads_last asks flash-attn's [B, N, H, D] output."""

    mask: Mask = Mask.none
    align: CausalAlign | None = None
    window: tuple[int, int] | None = None
    softcap: float | None = None
    alibi_slopes: torch.Tensor | None = None
    scale: float | None = None
    return_lse: bool = False
    fallback: str | None = None
    dropout_p: float = 0.0
    deterministic: bool = True
    heads_last: bool = False
    sinks: torch.Tensor | None = None
    chunk_size: int | None = None
    sink_tokens: int | None = None

    def need(self, kind, q, v, lengths: tuple[int, int], same_lengths: bool, **layout) -> Need:
        """need_for with this call's options; lengths (seqlen_q, seqlen_k) as need_for's."""
        return need_for(
            kind,
            q,
            v,
            mask=self.mask,
            align=self.align,
            window=self.window,
            softcap=self.softcap,
            alibi=self.alibi_slopes is not None,
            seqlen_q=lengths[0],
            seqlen_k=lengths[1],
            same_lengths=same_lengths,
            sinks=self.sinks is not None,
            chunk_size=self.chunk_size,
            sink_tokens=self.sink_tokens,
            dropout=self.dropout_p > 0,
            **layout,
        )

    def torch_options(self, scale: float) -> dict[str, Any]:
        """The fallback's (torch_attention's) options of this call, at the softmax scale."""
        names = ("mask", "align", "window", "softcap", "alibi_slopes", "dropout_p", "sinks")
        options = {name: getattr(self, name) for name in names}
        return options | dict(chunk_size=self.chunk_size, sink_tokens=self.sink_tokens, scale=scale)


def need_for(
    kind: KernelKind,
    q: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Mask,
    align: CausalAlign | None,
    window: tuple[int, int] | None,
    softcap: float | None,
    alibi: bool,
    seqlen_q: int,
    seqlen_k: int,
    same_lengths: bool,
    kv_layout: KvLayout | None = None,
    page_size: int | None = None,
    backward: bool = False,
    kv_dtype: KvDtype | None = None,
    sinks: bool = False,
    chunk_size: int | None = None,
    sink_tokens: int | None = None,
    dropout: bool = False,
) -> Need:
    """The Need of a call with these tensors: dtype and head dims from q and v, the arch from
    q's device. seqlen_q/seqlen_k must be lengths the tensors' shapes guarantee; backward:
    the call runs the module's gradient kernels; dropout: the call has dropout_p > 0; softcap
    as arguments.softcap_value takes it (<= 0 or None: off; NaN, inf: ValueError)."""
    if mask is Mask.none:
        align, window = None, None
    if mask is not Mask.chunked:
        chunk_size = None
    if mask is not Mask.sliding_window or not sink_tokens:
        sink_tokens = None
    device = q.device
    return Need(
        kind=kind,
        dtype=kernel_dtype(q.dtype),
        head_dim=int(q.shape[-1]),
        head_dim_v=int(v.shape[-1]),
        mask=mask,
        causal_align=align,
        window=None if window is None else (int(window[0]), int(window[1])),
        softcap=softcap_value(softcap),
        alibi=alibi,
        arch=arch_of(device.type, device.index),
        seqlen_q=int(seqlen_q),
        seqlen_k=int(seqlen_k),
        same_lengths=same_lengths,
        kv_layout=kv_layout,
        page_size=page_size,
        backward=backward,
        sinks=bool(sinks),
        chunk_size=None if chunk_size is None else int(chunk_size),
        sink_tokens=None if sink_tokens is None else int(sink_tokens),
        dropout=dropout,
        kv_dtype=kv_dtype,
    )


def unsupported_dtype(q: torch.Tensor) -> str:
    allowed = ", ".join(f"torch.{d.torch_name}" for d in Dtype)
    return f"q: dtype {q.dtype} has no generated kernels; allowed: {allowed}"


# ------------------------------------------------------------------------ choosing


def choose(
    api: str,
    need: Need,
    fallback: str | None = None,
    refusal: str | None = None,
    heads: tuple[int, int] | None = None,
) -> Dispatch:
    """The Dispatch for a call (recorded); refusal names a feature no kernel has (a dense
    mask tensor, dropout): then NoKernelError, or a warned fallback. heads (query, KV) are
    the call's, for a module built on demand (ondemand.py)."""
    if torch.compiler.is_compiling():
        return _choose_constant(api, fallback, refusal, heads, **need._asdict())
    return _choose(api, need, fallback, refusal, heads)


@torch.compiler.assume_constant_result
def _choose_constant(
    api: str,
    fallback: str | None,
    refusal: str | None,
    heads: tuple[int, int] | None,
    **fields: Any,
) -> Dispatch:
    """choose() from plain constants, run (not traced) once while torch.compile traces."""
    return _choose(api, Need(**fields), fallback, refusal, heads)


def _choose(
    api: str, need: Need, fallback: str | None, refusal: str | None, heads: tuple[int, int] | None
) -> Dispatch:
    if fallback is not None and fallback != "error" and fallback != "sdpa":
        check_fallback(fallback, "fallback")  # raises, naming the value
    # Asked on every call, not cached: the device's answer may change (a bf16 shim).
    refusal = refusal or device_problem(api, need.arch, need.dtype)
    if refusal is not None:
        return refuse(api, need, refusal, fallback)
    registry = current_registry()
    hit = cached_dispatch(api, need, registry)
    if hit is not None:
        return record(hit)
    return select(api, need, fallback, registry, heads)


def select(
    api: str,
    need: Need,
    fallback: str | None = None,
    registry: Registry | None = None,
    heads: tuple[int, int] | None = None,
) -> Dispatch:
    """The module that serves `need` (built on demand when none does and that is on),
    recorded and cached on the registry that chose it; or a fallback (warned), or
    NoKernelError. One registry (the current one unless given) answers every question of
    one selection."""
    mode = _fallback if fallback is None else check_fallback(fallback, "fallback")
    registry = registry or current_registry()
    entry, built = best_entry(registry, need), False
    if entry is None:
        entry, built, not_built = build_on_demand(need, heads, registry)
        if entry is None:
            message = no_kernel_message(need, registry, not_built)
            if mode == "error":
                raise NoKernelError(message)
            warnings.warn(f"attngen: falling back to torch SDPA: {message}", stacklevel=6)
            return record(Dispatch(api, need, None, None, message, fallback=mode))
    return served(api, need, registry, entry, built)


def served(api: str, need: Need, registry: Registry, entry: KernelEntry, built: bool) -> Dispatch:
    """The Dispatch of `entry` serving `need`, recorded and cached on `registry`."""
    module = registry.module(entry.key)
    writes_out = getattr(module, ACCEPTS_OUT) is True
    reason = f"{entry.describe()} serves {need.describe()}" + (
        "; it writes the caller's output layout in place (out=)"
        if writes_out
        else "; its entry point takes no out=, so an output in another layout than the kernel's "
        "is copied"
    )
    dispatch = Dispatch(
        api,
        need,
        entry.describe(),
        entry.key,
        reason + _cache_words(entry, built),
        writes_out=writes_out,
        source=entry.source,
        built=built,
        forward=expected_forward(module),
    )
    # Later calls reuse the module: they did not build it, and their reason says so.
    kept = dispatch
    if built:
        found = reason + _cache_words(entry, False)
        kept = dataclasses.replace(dispatch, built=False, reason=found)
    _keep(registry, (api, need), kept)
    _keep(registry, _class_key(api, need, registry), kept)
    return record(dispatch)


def expected_forward(module: Any) -> str | None:
    """The forward kernel a prefill or varlen module runs a call with: its
    expected_forward_path() (a module with the Gluon forward: the path a call that fits takes
    here), else its forward_path() (tile-level, with why); None for decode modules (by kind)."""
    expected = getattr(module, "expected_forward_path", None) or getattr(
        module, "forward_path", None
    )
    return None if expected is None else str(expected())


def _cache_words(entry: KernelEntry, built: bool) -> str:
    """How a cache module came to serve the call: rendered by this call, or found built."""
    if entry.source != "cache":
        return ""
    if built:
        return f"; built on demand now into {entry.key}"
    return f"; built on demand earlier, from the cache: {entry.key}"


def build_on_demand(
    need: Need, heads: tuple[int, int] | None, registry: Registry
) -> tuple[KernelEntry | None, bool, str]:
    """(entry, rendered now, "") for the module ondemand.py builds for `need`, or
    (None, False, why not)."""
    if not kernel_cache.settings().on_demand:
        return (
            None,
            False,
            (
                "On-demand builds are off (attngen.configure(on_demand=False) "
                f"or {kernel_cache.ENV_ON_DEMAND}=0)."
            ),
        )
    from attngen.build import BuildError  # the build path (sympy, jinja): on first build only
    from attngen.runtime import ondemand

    try:
        entry, built = ondemand.build_for(need, heads, registry)
    except (ondemand.NotExpressible, BuildError) as exc:
        return None, False, f"Not built on demand: {exc}."
    return entry, built, ""


def probe(api: str, need: Need, heads: tuple[int, int] | None = None) -> Dispatch | None:
    """choose() for an optional route (the decode kind): the Dispatch, or None, no error.
    With on-demand builds on, a module the call needs is built when a spec can state it."""
    if torch.compiler.is_compiling():
        return _probe_constant(api, heads, **need._asdict())
    return _probe(api, need, heads)


@torch.compiler.assume_constant_result
def _probe_constant(api: str, heads: tuple[int, int] | None, **fields: Any) -> Dispatch | None:
    return _probe(api, Need(**fields), heads)


def _probe(api: str, need: Need, heads: tuple[int, int] | None) -> Dispatch | None:
    if device_problem(api, need.arch, need.dtype):
        return None  # the route that follows refuses the call, with the reason
    registry = current_registry()
    hit = cached_dispatch(api, need, registry)
    if hit is not None:
        return record(hit)
    entry, built = best_entry(registry, need), False
    if entry is None:
        entry, built, _ = build_on_demand(need, heads, registry)
        if entry is None:
            return None  # the route that follows serves the call, or says why not
    return served(api, need, registry, entry, built)


def refuse(api: str, need: Need, why: str, fallback: str | None) -> Dispatch:
    """A call no generated kernel can serve for a reason outside the spec (a dense mask
    tensor, dropout, a device the kernels cannot run on): NoKernelError, or a warned
    fallback."""
    mode = _fallback if fallback is None else check_fallback(fallback, "fallback")
    if mode == "error":
        raise NoKernelError(f"attngen.{api}: {why}; pass fallback='sdpa' to run torch instead")
    warnings.warn(f"attngen: falling back to torch SDPA: {why}", stacklevel=6)
    return record(Dispatch(api, need, None, None, why, fallback=mode))
