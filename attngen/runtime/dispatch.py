"""Dispatch: from a call's tensors to the generated module that serves it, recorded.

`need_for` states what a call needs (a `Need`, selection.py) from its tensors and arguments;
`choose` returns the `Dispatch` naming the module that serves it and why, or, when none does,
raises `NoKernelError` naming what the call needs and the nearest modules with what differs,
unless a fallback was asked for: then the Dispatch says "fallback" and a warning names the
reason. Nothing falls back silently. Every Dispatch is recorded per thread (selection.record).

A repeated call costs one dictionary lookup: served Dispatches are kept in the route cache
(selection.routes, whose docstring gives the keys), so a decode loop whose key count grows
selects once per length class (`cached_dispatch`). Refusals and fallbacks are not cached:
they warn or raise on every call.

With on-demand builds on, a call no loaded module serves has its module built into the cache
(Dispatch source "cache", built=True), or is refused with the reason.

Under torch.compile, `choose` hands the Need's fields to a function dynamo does not trace
(assume_constant_result's mark): selection runs once while tracing, its key a constant.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from attngen.runtime.arguments import softcap_value
from attngen.runtime.registry import (
    ENV_ON_DEMAND,
    KernelEntry,
    Registry,
    current_registry,
    settings,
)
from attngen.runtime.selection import (
    INTERPRETER,
    Dispatch,
    Need,
    NoKernelError,
    NotExpressible,
    best_entry,
    build_for,
    check_fallback,
    keep,
    length_class,
    no_kernel_message,
    record,
    registry_thresholds,
    routes,
)
from attngen.spec import CausalAlign, Dtype, KernelKind, KvDtype, KvLayout, Mask

# A module whose entry point takes `out=` (an output of the call's shape, dtype and device,
# any strides, written in place and returned) says so with this constant set to True.
ACCEPTS_OUT = "ACCEPTS_OUT"
_fallback = "error"


def _class_key(api: str, need: Need, registry: Registry) -> tuple:
    """The route cache's second dispatch key of a call: every field of its Need but the key length,
    which enters as its class among the registry's length thresholds
    (selection.length_class); the thresholds themselves are in the key, so a module built on
    demand with a new window never meets a choice made before it."""
    thresholds = registry_thresholds(registry)
    return api, need._replace(seqlen_k=-1), thresholds, length_class(need, thresholds)


def cached_dispatch(api: str, need: Need, registry: Registry) -> Dispatch | None:
    """The cached Dispatch of a call: under (api, Need) for a Need seen before, else under
    its length class (the record then gets the call's own Need and is kept under it too)."""
    table = routes(registry)
    hit = table.get((api, need))
    if hit is None:
        hit = table.get(_class_key(api, need, registry))
        if hit is not None:
            hit = dataclasses.replace(hit, need=need)
            keep(registry, (api, need), hit)
    return hit


def set_fallback(mode: str) -> None:
    """What to do when no generated kernel serves a call: "error" (default) or "sdpa"."""
    global _fallback
    _fallback = check_fallback(mode, "mode")


def get_fallback() -> str:
    return _fallback


# ---------------------------------------------------------------------------- the request


# The torch dtype of each Dtype, derived from the one vocabulary once at import: a plain dict
# lookup, which torch.compile traces (dynamo 2.11 cannot iterate an Enum class while tracing).
_KERNEL_DTYPES: dict[torch.dtype, Dtype] = {getattr(torch, d.torch_name): d for d in Dtype}
_cuda_archs: dict[int | None, str] = {}
_interpreting = False  # CPU tensors were found served by Triton's interpreter (see arch_of)


def _constant_when_compiled(fn: Any) -> Any:
    """torch.compiler.assume_constant_result, whose only work is this mark, without its import
    of torch._dynamo (about 1 s, paid at a first attention call that may never compile)."""
    fn._dynamo_marked_constant = True
    return fn


def eager_only(reason: str) -> Any:
    """torch.compiler.disable(fn, reason=reason), made at the first call once torch._dynamo is
    imported (under torch.compile too: dynamo runs that call eagerly, as the disabled function);
    until then nothing can be tracing the call, and fn runs as it is."""

    def decorate(fn: Any) -> Any:
        disabled: list[Any] = []

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not disabled:
                if "torch._dynamo" not in sys.modules:
                    return fn(*args, **kwargs)
                disabled.append(torch.compiler.disable(fn, reason=reason))
            return disabled[0](*args, **kwargs)

        return call

    return decorate


def kernel_dtype(dtype: torch.dtype) -> Dtype | None:
    """The Dtype of a torch dtype (None: no kernels for it)."""
    return _KERNEL_DTYPES.get(dtype)


@_constant_when_compiled
def arch_of(device_type: str, device_index: int | None) -> str:
    """device_arch of a device, remembered: a CUDA device's arch is fixed, and once
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


def need_for(kind: KernelKind, q: torch.Tensor, v: torch.Tensor, *, mask: Mask,
             align: CausalAlign | None, window: tuple[int, int] | None,
             softcap: float | None, alibi: bool, seqlen_q: int, seqlen_k: int,
             same_lengths: bool, kv_layout: KvLayout | None = None,
             page_size: int | None = None, backward: bool = False,
             kv_dtype: KvDtype | None = None, sinks: bool = False,
             chunk_size: int | None = None, sink_tokens: int | None = None,
             dropout: bool = False) -> Need:  # fmt: skip
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


# ------------------------------------------------------------------------------- choosing


def choose(
    api: str,
    need: Need,
    fallback: str | None = None,
    refusal: str | None = None,
    heads: tuple[int, int] | None = None,
) -> Dispatch:
    """The Dispatch for a call (recorded); refusal names a feature no kernel has (a dense
    mask tensor, dropout): then NoKernelError, or a warned fallback. heads (query, KV) are
    the call's, for a module built on demand (selection.spec_for)."""
    if torch.compiler.is_compiling():
        return _choose_constant(api, fallback, refusal, heads, **need._asdict())
    return _choose(api, need, fallback, refusal, heads)


@_constant_when_compiled
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
    recorded and kept in the route cache of the registry that chose it; or a fallback (warned), or
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
    """The Dispatch of `entry` serving `need`, recorded and kept in `registry`'s routes."""
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
    keep(registry, (api, need), kept)
    keep(registry, _class_key(api, need, registry), kept)
    return record(dispatch)


def expected_forward(module: Any) -> str | None:
    """The forward kernel a prefill or varlen module runs a call with: its
    expected_forward_path() (a module with the Gluon forward: the path a call that fits takes
    here), else its forward_path() (tile-level, with why); None for decode modules (by kind)."""
    expected = getattr(module, "expected_forward_path", None)
    expected = expected or getattr(module, "forward_path", None)
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
    """(entry, rendered now, "") for the module selection.build_for builds for `need`, or
    (None, False, why not)."""
    if not settings().on_demand:
        off = f"(attngen.configure(on_demand=False) or {ENV_ON_DEMAND}=0)"
        return None, False, f"On-demand builds are off {off}."
    from attngen.build import BuildError  # the build path (sympy, jinja): on first build only

    try:
        entry, built = build_for(need, heads, registry)
    except (NotExpressible, BuildError) as exc:
        return None, False, f"Not built on demand: {exc}."
    return entry, built, ""


def probe(api: str, need: Need, heads: tuple[int, int] | None = None) -> Dispatch | None:
    """choose() for an optional route (the decode kind): the Dispatch, or None, no error.
    With on-demand builds on, a module the call needs is built when a spec can state it."""
    if torch.compiler.is_compiling():
        return _probe_constant(api, heads, **need._asdict())
    return _probe(api, need, heads)


@_constant_when_compiled
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


# -------------------------------------------------------------------------------- devices
#
# Which device a call's tensors are on, and whether generated kernels can run there.
#
# CUDA tensors run on the module built for the device's arch (sm<major><minor>). CPU tensors run
# under Triton's interpreter, which triton enables when it is imported with TRITON_INTERPRET=1
# (its own @triton.jit helpers are made interpreted or compiled at that moment, so setting the
# variable later leaves a half-interpreted triton that fails inside the first kernel).
#
# bf16 under the interpreter: Triton 3.6's interpreter computes bf16 dots and arithmetic on the
# raw uint16 bit patterns (triton-lang/triton#11584), so every kernel returns garbage for bf16. The
# runtime does not patch triton (a library must not change how other people's kernels run);
# it refuses bf16 on the interpreter with an error saying why, unless bf16 math has been made
# correct there: a tiny probe kernel (below) is run once and must give torch's
# bits. The test suite's shim (tests/interpreter_bf16.py) passes the probe, and so will a Triton
# release that fixes the issue.
#
# The probe: one 16 x 16 tile exercises what attention kernels do with bf16: a dot with an fp32
# accumulator, elementwise bf16 arithmetic, a row sum, and the fp32 -> bf16 cast (round to
# nearest even). The results must equal torch's bit for bit; Triton 3.6's interpreter fails
# all four, a correct one (or the tests' shim) passes.

_bf16_ok = False  # only a passed probe is remembered: a shim may be installed later


def interpreter_wanted() -> bool:
    """TRITON_INTERPRET=1, as the generated modules read it."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_interprets() -> bool:
    """Whether the imported triton runs kernels in its interpreter (importing it if needed:
    then the variable's value now decides)."""
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.cdiv, InterpretedFunction)


def device_arch(device) -> str:
    """sm<major><minor> of a CUDA device; INTERPRETER for CPU tensors when Triton's interpreter
    is on; otherwise the device type (device_problem says why nothing runs there)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"sm{major}{minor}"
    if device.type == "cpu" and interpreter_wanted() and triton_interprets():
        return INTERPRETER
    return device.type


def device_problem(api: str, arch: str, dtype: Dtype | None) -> str | None:
    """Why no generated kernel can run a call on this device (arch from device_arch), or
    None."""
    if arch == "cpu":
        if not interpreter_wanted():
            return (
                "q is a CPU tensor: generated kernels run on CUDA tensors, or on CPU "
                "tensors under Triton's interpreter: set TRITON_INTERPRET=1 in the "
                "environment before triton is imported (before importing attngen, torch "
                "libraries that import triton, or the generated modules)"
            )
        return (
            "q is a CPU tensor and TRITON_INTERPRET=1 is set, but triton was imported "
            "before it was set, so triton is not in interpreter mode (it decides at "
            "import) and its kernels would fail; set TRITON_INTERPRET=1 before anything "
            "imports triton (in the shell, or first thing in the script)"
        )
    if arch != INTERPRETER and not arch.startswith("sm"):
        return f"q is on device type {arch!r}: generated kernels run on CUDA tensors"
    if arch == INTERPRETER and dtype is Dtype.bf16 and not bf16_interpreter_ok():
        return (
            "dtype bf16 on CPU tensors: Triton's interpreter computes bfloat16 dots and "
            "arithmetic on the raw bit patterns (triton-lang/triton#11584) and returns garbage; "
            "use fp16 or fp32 on the CPU, or CUDA for bf16"
        )
    return None


def problem_may_change(arch: str, dtype: Dtype | None) -> bool:
    """Whether device_problem's answer for (arch, dtype) may change in this process: bf16
    under the interpreter, which a shim (or a probe that passes later) makes correct, and a
    test may make incorrect again. Every other answer is fixed by the arch and the dtype."""
    return arch == INTERPRETER and dtype is Dtype.bf16


def bf16_interpreter_ok() -> bool:
    """Whether the interpreter computes bf16 correctly now (a probe kernel, cached once it
    passes)."""
    global _bf16_ok
    if not _bf16_ok:
        _bf16_ok = bf16_math_is_correct()
    return _bf16_ok


@triton.jit
def _bf16_probe_kernel(A, B, Dot, Prod, RowSum, Cast, N: tl.constexpr):
    rows = tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :]
    a = tl.load(A + rows)
    b = tl.load(B + rows)
    tl.store(Dot + rows, tl.dot(a, b, input_precision="ieee"))
    tl.store(Prod + rows, a * b)
    tl.store(RowSum + tl.arange(0, N), tl.sum(a.to(tl.float32), 1))
    tl.store(Cast + rows, (a.to(tl.float32) / 3.0).to(tl.bfloat16))


def bf16_math_is_correct() -> bool:
    n = 16
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, n, generator=gen).to(torch.bfloat16)
    dot = torch.empty(n, n)
    prod = torch.empty(n, n, dtype=torch.bfloat16)
    row_sum = torch.empty(n)
    cast = torch.empty(n, n, dtype=torch.bfloat16)
    _bf16_probe_kernel[(1,)](a, b, dot, prod, row_sum, cast, N=n)
    # The dot's summation order may differ from torch's: a relative 1e-5 separates that from
    # bit-pattern garbage (wrong by orders of magnitude). The rest is exact in any order.
    expected_dot = a.float() @ b.float()
    return bool(
        torch.allclose(dot, expected_dot, rtol=1e-5, atol=1e-5)
        and torch.equal(prod, a * b)
        and torch.allclose(row_sum, a.float().sum(1), rtol=1e-6, atol=1e-6)
        and torch.equal(cast, (a.float() / 3.0).to(torch.bfloat16))
    )
