"""Calling a generated module's entry point: directly in eager mode, through torch.library
custom ops (namespace `attngen`) under torch.compile or autograd.

`prefill`, `varlen` and `decode` take the module key chosen by dispatch (a string: selection
happens outside the ops, so a compiled graph holds a fixed module). An eager call with no
input that needs a gradient calls the module's entry point itself: the op layer's own
dispatch costs tens of microseconds per call, more than the rest of a small call's host time.
Under torch.compile (and for inputs that need a gradient, or tensor subclasses) the call goes
through the op, whose fake implementation gives the output shapes and strides, so
torch.compile(fullgraph=True) traces through it without running a kernel. Either way
`run_counts()` counts the kernel calls per module, including calls from compiled graphs.

    attngen::prefill  q [B, HQ, M, D], k/v [B, HKV, N, D]  -> out [B, HQ, M, DV], lse [B, HQ, M]
    attngen::varlen   q [Tq, HQ, D], k/v [Tk, HKV, D]       -> out [Tq, HQ, DV], lse [HQ, Tq]
    attngen::decode   q [B, HQ, Nq, D], caches contiguous [B, HKV, L, D] or paged
                      [pages, page_size, HKV, D]; appends k_new/v_new into the caches in
                      place (mutates_args) -> out [B, HQ, Nq, DV], lse [B, HQ, Nq]

`heads_last` (prefill, decode): the module writes a contiguous [B, M, HQ, DV] output
(flash-attn's layout) through its `attention_flash_out` / `decode_flash_out` entry point (or
`attention_flash` / `decode_flash` on flash-attn's [B, N, H, D] tensors: plans.run_flash,
decode_ops' flash_layout), asked only of a module that takes `out=` (Dispatch.writes_out);
the ops return its view. The LSE is always an op output (empty when not asked for: an op's
outputs cannot be optional); the functions here return None instead.

prefill and varlen have an autograd formula, the module's own (docs/architecture.md, "One
autograd per kernel kind"), so torch.compile(fullgraph=True) traces forward and backward;
rng_state and `deterministic` are op inputs saved for the backward. Decode mutates its
caches, which torch allows no formula for: `decode()` (decode_ops.py) raises in backward.
"""

from __future__ import annotations

import collections
import functools
import os
import threading
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from attngen.runtime.registry import current_registry

_custom_op = torch.library.custom_op  # each op's body stays a plain function (_eager)
_counts: collections.Counter[str] = collections.Counter()
_counts_lock = threading.Lock()


def count_run(key: str) -> None:
    """Count one kernel call of the module `key` (run_counts)."""
    with _counts_lock:
        _counts[key] += 1


def run_counts() -> dict[str, int]:
    """{module key: number of kernel calls} since the last reset_run_counts()."""
    with _counts_lock:
        return dict(_counts)


def reset_run_counts() -> None:
    with _counts_lock:
        _counts.clear()


def _no_lse(q: Tensor) -> Tensor:
    return q.new_empty((0,), dtype=torch.float32)


def _plain(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Eager mode and plain tensors: the module may be called without the op's dispatch."""
    return not torch.compiler.is_compiling() and type(q) is type(k) is type(v) is Tensor


def _direct(q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Tensor | None) -> bool:
    """Whether the module can be called without the op layer: _plain and no autograd to
    record (the op's formula is what refuses backward)."""
    grads = q.requires_grad or k.requires_grad or v.requires_grad
    grads = grads or (alibi_slopes is not None and alibi_slopes.requires_grad)
    return _plain(q, k, v) and not (grads and torch.is_grad_enabled())


def _untracked(q: Tensor, k: Tensor, v: Tensor, alibi_slopes, sinks) -> bool:
    """_direct for a call with sinks (a tensor that may train too)."""
    return _direct(q, k, v, alibi_slopes) and (sinks is None or _direct(q, k, v, sinks))


def _heads_last(q: Tensor, dim_v: int) -> Tensor:
    """An uninitialized contiguous [B, M, HQ, DV] tensor for q [B, HQ, M, D]."""
    batch, heads, rows, _ = q.shape
    return q.new_empty((batch, rows, heads, dim_v))


def _sinks(sinks: Tensor | None) -> dict[str, Tensor]:
    """The entry point's `sinks=` keyword, only for a module built with sinks (older modules'
    entry points do not take the keyword; dispatch matched the module to the call)."""
    return {} if sinks is None else {"sinks": sinks}


# -------------------------------------------------------------------------------- prefill


def _dropout_options(dropout_p: float, rng_state: Tensor | None) -> dict:
    """The module's dropout arguments: none without dropout (forward-only modules take none)."""
    return {"dropout_p": dropout_p, "rng_state": rng_state} if dropout_p else {}


def run_prefill(
    key: str, q: Tensor, k: Tensor, v: Tensor, sm_scale: float, alibi_slopes: Tensor | None,
    return_lse: bool, heads_last: bool, sinks: Tensor | None = None, dropout_p: float = 0.0,
    rng_state: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """(out, lse or None); out [B, M, HQ, DV] with heads_last (the module's
    attention_flash_out), else [B, HQ, M, DV] (its attention)."""
    module = current_registry().module(key)
    count_run(key)
    entry = module.attention_flash_out if heads_last else module.attention
    extra = _sinks(sinks) | _dropout_options(dropout_p, rng_state)
    result = entry(
        q, k, v, sm_scale=sm_scale, alibi_slopes=alibi_slopes, return_lse=return_lse, **extra
    )
    return result if return_lse else (result, None)


def prefill(
    key: str, q: Tensor, k: Tensor, v: Tensor, sm_scale: float, alibi_slopes: Tensor | None,
    return_lse: bool, heads_last: bool = False, sinks: Tensor | None = None,
    dropout_p: float = 0.0, rng_state: Tensor | None = None, deterministic: bool = True,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """(out, lse or None) of the prefill module `key`; see the module docstring."""
    args = (sinks, dropout_p, rng_state)
    if _untracked(q, k, v, alibi_slopes, sinks):
        return run_prefill(key, q, k, v, sm_scale, alibi_slopes, return_lse, heads_last, *args)
    # The LSE is always computed here: the backward needs it.
    run = _EagerPrefill.apply if _plain(q, k, v) else prefill_op
    out, lse = run(key, q, k, v, sm_scale, alibi_slopes, True, heads_last, *args, deterministic)
    return (out.transpose(1, 2) if heads_last else out), (lse if return_lse else None)


def prefill_flash(
    key: str, q: Tensor, k: Tensor, v: Tensor, sm_scale: float, alibi_slopes: Tensor | None,
    return_lse: bool, sinks: Tensor | None = None, deterministic: bool = True,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """prefill(..., heads_last=True) for q, k, v in [B, N, H, D] themselves (not [B, H, N, D]
    views of them): out [B, N, H, D]. An eager call that trains takes the views inside its
    autograd node, so a step records that one node where views outside add a TransposeBackward
    each (four, host time the GPU waits for at short sequences)."""
    if _untracked(q, k, v, alibi_slopes, sinks) or not _plain(q, k, v):
        views = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return prefill(key, *views, sm_scale, alibi_slopes, return_lse, True, sinks,
                       deterministic=deterministic)  # fmt: skip
    out, lse = _EagerPrefillFlash.apply(key, q, k, v, sm_scale, alibi_slopes, True, True, sinks,
                                        0.0, None, deterministic)  # fmt: skip
    return out, (lse if return_lse else None)


def _prefill_forward(
    key: str, q: Tensor, k: Tensor, v: Tensor, sm_scale: float, alibi_slopes: Tensor | None,
    return_lse: bool, heads_last: bool, sinks: Tensor | None = None, dropout_p: float = 0.0,
    rng_state: Tensor | None = None, deterministic: bool = True,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    with torch.no_grad():  # the op's autograd formula records the backward, not the module
        out, lse = run_prefill(key, q, k, v, sm_scale, alibi_slopes, return_lse, heads_last,
                               sinks, dropout_p, rng_state)  # fmt: skip
    return (out.transpose(1, 2) if heads_last else out), (_no_lse(q) if lse is None else lse)


prefill_op = _custom_op("attngen::prefill", mutates_args=())(_prefill_forward)


@prefill_op.register_fake
def _(key, q, k, v, sm_scale, alibi_slopes, return_lse, heads_last, *_):
    batch, heads, seqlen_q, _ = q.shape
    if heads_last:
        out = _heads_last(q, v.shape[-1]).transpose(1, 2)
    else:
        out = q.new_empty((batch, heads, seqlen_q, v.shape[-1]))
    lse = q.new_empty((batch, heads, seqlen_q), dtype=torch.float32) if return_lse else _no_lse(q)
    return out, lse


# --------------------------------------------------------------------------------- varlen


def run_varlen(
    key: str, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    max_seqlen_q: int, max_seqlen_k: int, sm_scale: float, alibi_slopes: Tensor | None,
    seqused_k: Tensor | None, return_lse: bool, sinks: Tensor | None = None,
    dropout_p: float = 0.0, rng_state: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    module = current_registry().module(key)
    count_run(key)
    lengths = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    extra = _sinks(sinks) | _dropout_options(dropout_p, rng_state)
    result = module.attention_varlen(q, k, v, *lengths, sm_scale=sm_scale,
                                     alibi_slopes=alibi_slopes, return_lse=return_lse,
                                     seqused_k=seqused_k, **extra)  # fmt: skip
    return result if return_lse else (result, None)


def varlen(
    key: str, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    max_seqlen_q: int, max_seqlen_k: int, sm_scale: float, alibi_slopes: Tensor | None,
    seqused_k: Tensor | None, return_lse: bool, sinks: Tensor | None = None,
    dropout_p: float = 0.0, rng_state: Tensor | None = None, deterministic: bool = True,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """(out, lse or None) of the varlen module `key`; see the module docstring."""
    args = (key, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sm_scale,
            alibi_slopes, seqused_k)  # fmt: skip
    if _untracked(q, k, v, alibi_slopes, sinks):
        return run_varlen(*args, return_lse, sinks, dropout_p, rng_state)
    # the LSE is always computed: the backward needs it
    run = _EagerVarlen.apply if _plain(q, k, v) else varlen_op
    out, lse = run(*args, True, sinks, dropout_p, rng_state, deterministic)
    return out, (lse if return_lse else None)


def _varlen_forward(
    key: str, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    max_seqlen_q: int, max_seqlen_k: int, sm_scale: float, alibi_slopes: Tensor | None,
    seqused_k: Tensor | None, return_lse: bool, sinks: Tensor | None = None,
    dropout_p: float = 0.0, rng_state: Tensor | None = None, deterministic: bool = True,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    with torch.no_grad():  # the op's autograd formula records the backward, not the module
        out, lse = run_varlen(key, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                              max_seqlen_k, sm_scale, alibi_slopes, seqused_k, return_lse, sinks,
                              dropout_p, rng_state)  # fmt: skip
    return out, (_no_lse(q) if lse is None else lse)


varlen_op = _custom_op("attngen::varlen", mutates_args=())(_varlen_forward)


@varlen_op.register_fake
def _(key, q, k, v, cu_q, cu_k, max_q, max_k, scale, slopes, seqused_k, return_lse, *_):
    total_q, heads, _ = q.shape
    out = q.new_empty((total_q, heads, v.shape[-1]))
    lse = q.new_empty((heads, total_q), dtype=torch.float32) if return_lse else _no_lse(q)
    return out, lse


# ------------------------------------------------------------------ the autograd formulas
#
# The ops' autograd is the module's own (docs/architecture.md, "One autograd per kernel
# kind"): setup_context hands the op's inputs and outputs to the module's `_save` and the
# formula calls its `_gradients`, with the backward op (`attngen::prefill_backward` /
# `attngen::varlen_backward`, opaque to torch.compile) as the entry point. Each formula here
# only gives the op's inputs their gradients (d sinks as a fourth tensor, empty without sinks:
# an op's outputs cannot be optional). `deterministic` picks the kernels (_path_options: the
# Gluon dK/dV kernel's dQ by TMA reduce-adds where the module has it, the atomic-dQ path only
# under ATTNGEN_ATOMIC_DQ=1); `last_backward()` and `backward_runs()` say which path each
# backward call took. Importing ops.py registers the formulas (attngen.runtime does).

ATOMIC, DETERMINISTIC = "atomic", "deterministic"


@dataclass(frozen=True)
class BackwardRun:
    """Which gradient kernels one backward call of the module `key` ran: `path` ATOMIC (dQ
    added by fp32 atomics in the dK/dV kernel) or DETERMINISTIC (the dQ kernel, no atomics),
    for a call that asked `deterministic`; `reason` says why."""

    key: str
    deterministic: bool
    path: str
    reason: str


_runs: collections.Counter[tuple[str, str]] = collections.Counter()
_last: list[BackwardRun] = []
_runs_lock = threading.Lock()


def last_backward() -> BackwardRun | None:
    """The latest backward call's BackwardRun, in any thread (autograd runs a GPU backward
    on its own device thread, so a per-thread record would miss it)."""
    with _runs_lock:
        return _last[-1] if _last else None


def backward_runs() -> dict[tuple[str, str], int]:
    """{(module key, path): backward calls} since the last reset_backward_runs()."""
    with _runs_lock:
        return dict(_runs)


def reset_backward_runs() -> None:
    with _runs_lock:
        _runs.clear()
        _last.clear()


# The atomic-dQ path measured slower than the two-kernel backward on the H200 (0.81x over the
# grid at N 1k/4k, docs/performance.md "The atomic-dQ backward"): the five products do not pay
# for the fp32 atomics' traffic in these tile-level kernels. Until a kernel makes it pay,
# deterministic=False runs the two kernels (deterministic too, which it allows), and
# ATTNGEN_ATOMIC_DQ=1 turns the atomic path on (to measure it, or where it wins).
ENV_ATOMIC_DQ = "ATTNGEN_ATOMIC_DQ"
ATOMIC_DQ_OFF = (
    "deterministic=False: the two-kernel backward ran (the atomic-dQ path measured 0.81x of "
    f"it on the H200; {ENV_ATOMIC_DQ}=1 runs the atomic path)"
)
# A module with the Gluon dK/dV backward (sm90 prefill, gluon_backward_gap) runs it for
# deterministic=False whatever ATTNGEN_ATOMIC_DQ says (short causal calls: its two kernels).
GLUON_DQ = (
    "deterministic=False: dQ by fp32 atomics in the module's Gluon dK/dV kernel where the call "
    "fits it, else in its tile-level kernels (the module's backward_path() says which)"
)


def atomic_dq_enabled() -> bool:
    """Whether deterministic=False may run the atomic-dQ path (ATTNGEN_ATOMIC_DQ=1)."""
    return os.environ.get(ENV_ATOMIC_DQ) == "1"


def check_deterministic(deterministic: object) -> bool:
    """The public functions' `deterministic` argument, a bool (never a truthy stand-in)."""
    if type(deterministic) is not bool:
        raise ValueError(f"deterministic: expected True or False, got {deterministic!r}")
    return deterministic


def _path_options(key: str, module, deterministic: bool) -> dict:
    """The entry point's `deterministic=` keyword, recording which path runs."""
    if deterministic:
        run = BackwardRun(key, True, DETERMINISTIC, "deterministic=True: no atomics")
        options: dict = {}  # the modules' default
    elif module.GLUON_BACKWARD:  # the sm90 Gluon dK/dV kernel
        run = BackwardRun(key, False, ATOMIC, GLUON_DQ)
        options = {"deterministic": False}
    elif not atomic_dq_enabled():
        run = BackwardRun(key, False, DETERMINISTIC, ATOMIC_DQ_OFF)
        options = {}
    elif module.BWD_DKDV_ATOMIC_CONFIG is not None:
        run = BackwardRun(key, False, ATOMIC, "deterministic=False: dQ by fp32 atomics")
        options = {"deterministic": False}
    else:
        reason = (
            "deterministic=False, but no atomic-dQ config fits this module's shared "
            "memory (BWD_DKDV_ATOMIC_CONFIG None): its deterministic kernels ran"
        )
        warnings.warn(f"{key}: {reason}", stacklevel=4)
        run, options = BackwardRun(key, False, DETERMINISTIC, reason), {}
    with _runs_lock:
        _runs[key, run.path] += 1
        _last[:] = [run]
    return options


SEQUSED_K_REFUSAL = (
    "seqused_k: no backward for a KV cache read in place; pass None when q, k or v requires grad"
)


def _save(ctx, key: str, backward_op, *args, **lengths) -> None:
    """A forward op's setup_context: the module `key`'s own save (`_save`), its formula
    (`_gradients`, kept as ctx.gradients) to call `backward_op` for the module."""
    ctx.gradients = _backward_of(key, "_gradients")
    _backward_of(key, "_save")(ctx, *args, backward=functools.partial(backward_op, key), **lengths)


def _wanted(ctx, grad: Tensor, index: int) -> Tensor | None:
    """grad for the forward op's input `index` when it asked for one (inputs the call left
    at their defaults are not among ctx.needs_input_grad)."""
    needs = ctx.needs_input_grad
    return grad if index < len(needs) and needs[index] else None


def _backward_of(key: str, name: str):
    """The module's backward entry point `name`, or NotImplementedError saying why not."""
    module = current_registry().module(key)
    backward = getattr(module, name, None)
    if backward is None:
        raise NotImplementedError(
            f"{key}: this module is forward-only (built from a spec without backward: true), "
            "so gradients cannot flow through it; add `backward: true` to the spec and "
            "rebuild, or train with another attention implementation"
        )
    return backward


def _sink_gradient(q: Tensor, grads: tuple, sinks: Tensor | None) -> Tensor:
    """The backward ops' fourth output: the module's d sinks, or an empty tensor."""
    return _no_lse(q) if sinks is None else grads[3]


def prefill_backward(key: str, dout: Tensor, q: Tensor, k: Tensor, v: Tensor,
                     out: Tensor, lse: Tensor, dlse: Tensor | None, sm_scale: float,
                     alibi_slopes: Tensor | None, dropout_p: float = 0.0,
                     rng_state: Tensor | None = None, sinks: Tensor | None = None,
                     deterministic: bool = True) -> tuple:  # fmt: skip
    """(dq, dk, dv) from the gradient kernels of the prefill module `key`, called directly:
    eager callers that hold the output and LSE themselves (context parallelism runs them per
    chunk pair with the whole sequence's LSE) and record no autograd graph. dropout_p and
    rng_state: the forward's, for a module built with dropout: true. With sinks (a module
    built with sinks: true), (dq, dk, dv, dsinks). deterministic: the module docstring."""
    args = (dout, q, k, v, out, lse)
    options = (dlse, sm_scale, alibi_slopes, dropout_p, rng_state, sinks, deterministic)
    return _run_backward(key, "attention_backward", args, *options)


def _run_backward(
    key: str, name: str, args: tuple, dlse, sm_scale, alibi_slopes, dropout_p, rng_state, sinks, det
) -> tuple:
    """The module `key`'s backward entry point `name` on args, counted and its path recorded."""
    backward = _backward_of(key, name)
    path = _path_options(key, current_registry().module(key), det)
    count_run(key)
    return tuple(backward(*args, sm_scale=sm_scale, alibi_slopes=alibi_slopes, dlse=dlse,
                          **_dropout_options(dropout_p, rng_state), **_sinks(sinks),
                          **path))  # fmt: skip


def _prefill_grads(key: str, dout: Tensor, q: Tensor, k: Tensor, v: Tensor,
                   out: Tensor, lse: Tensor, dlse: Tensor | None, sm_scale: float,
                   alibi_slopes: Tensor | None, dropout_p: float = 0.0,
                   rng_state: Tensor | None = None, sinks: Tensor | None = None,
                   deterministic: bool = True
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    grads = prefill_backward(key, dout, q, k, v, out, lse, dlse, sm_scale, alibi_slopes,
                             dropout_p, rng_state, sinks, deterministic)  # fmt: skip
    return grads[0], grads[1], grads[2], _sink_gradient(q, grads, sinks)


prefill_backward_op = _custom_op("attngen::prefill_backward", mutates_args=())(_prefill_grads)


@prefill_backward_op.register_fake
def _(key, dout, q, k, v, out, lse, dlse, sm_scale, alibi_slopes, dropout_p=0.0, rng_state=None,
      sinks=None, deterministic=True):  # fmt: skip
    dsinks = _no_lse(q) if sinks is None else torch.empty_like(sinks)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


def _prefill_setup(ctx, inputs, output, backward=prefill_backward_op):
    key, q, k, v, sm_scale, alibi_slopes, _, _, sinks, dropout_p, rng_state, deterministic = inputs
    args = (sm_scale, alibi_slopes, dropout_p, rng_state, sinks, deterministic)
    _save(ctx, key, backward, q, k, v, *output, *args)


def _prefill_backward(ctx, dout, dlse):
    dq, dk, dv, dsinks = ctx.gradients(ctx, dout, dlse)
    return None, dq, dk, dv, None, None, None, None, _wanted(ctx, dsinks, 8), None, None, None


def _varlen_grads(key: str, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                  lse: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                  max_seqlen_q: int, max_seqlen_k: int, dlse: Tensor | None,
                  sm_scale: float, alibi_slopes: Tensor | None, dropout_p: float = 0.0,
                  rng_state: Tensor | None = None, sinks: Tensor | None = None,
                  deterministic: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    args = (dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    options = (dlse, sm_scale, alibi_slopes, dropout_p, rng_state, sinks, deterministic)
    grads = _run_backward(key, "attention_varlen_backward", args, *options)
    return grads[0], grads[1], grads[2], _sink_gradient(q, grads, sinks)


varlen_backward_op = _custom_op("attngen::varlen_backward", mutates_args=())(_varlen_grads)


@varlen_backward_op.register_fake
def _(key, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      dlse, sm_scale, alibi_slopes, dropout_p=0.0, rng_state=None, sinks=None,
      deterministic=True):  # fmt: skip
    dsinks = _no_lse(q) if sinks is None else torch.empty_like(sinks)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


def _varlen_setup(ctx, inputs, output, backward=varlen_backward_op):
    key, q, k, v, cu_q, cu_k, max_q, max_k, scale, slopes, seqused_k, _, sinks, *rest = inputs
    ctx.refusal = None if seqused_k is None else SEQUSED_K_REFUSAL
    dropout_p, rng_state, deterministic = rest
    args = (scale, slopes, dropout_p, rng_state, sinks, deterministic)
    lengths = (cu_q, cu_k, max_q, max_k)
    _save(ctx, key, backward, q, k, v, *output, *args, lengths=lengths)


def _varlen_backward(ctx, dout, dlse):
    if ctx.refusal:  # at the backward: a forward with seqused_k may run in grad mode
        raise ValueError(ctx.refusal)
    dq, dk, dv, dsinks = ctx.gradients(ctx, dout, dlse)
    return (None, dq, dk, dv, *[None] * 8, _wanted(ctx, dsinks, 12), None, None, None)


torch.library.register_autograd("attngen::prefill", _prefill_backward, setup_context=_prefill_setup)
torch.library.register_autograd("attngen::varlen", _varlen_backward, setup_context=_varlen_setup)


def _eager(name: str, forward, setup, formula, grads) -> type[torch.autograd.Function]:
    """The op's forward, setup_context and formula as an autograd.Function whose backward
    calls the backward op's body (grads): an eager call with grad runs the same code without
    torch.library's dispatch (a forward of 159 -> 71 us on the CPU, 12 us without grad)."""

    def run(ctx, *inputs):
        output = forward(*inputs)
        setup(ctx, inputs, output, backward=grads)
        return output

    methods = {"forward": staticmethod(run), "backward": staticmethod(formula)}
    return type(name, (torch.autograd.Function,), methods)


_EagerPrefill = _eager(
    "_EagerPrefill", _prefill_forward, _prefill_setup, _prefill_backward, _prefill_grads
)
_EagerVarlen = _eager(
    "_EagerVarlen", _varlen_forward, _varlen_setup, _varlen_backward, _varlen_grads
)


class _EagerPrefillFlash(torch.autograd.Function):
    """_EagerPrefill on q, k, v and out in [B, N, H, D]: the [B, H, N, D] views of its inputs,
    dO and the gradients are taken here, where autograd records none of them."""

    @staticmethod
    def forward(ctx, key, q, k, v, *rest):
        views = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        out, lse = _EagerPrefill.forward(ctx, key, *views, *rest)
        return out.transpose(1, 2), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        grads = _prefill_backward(ctx, None if dout is None else dout.transpose(1, 2), dlse)
        return tuple(g if i not in (1, 2, 3) or g is None else g.transpose(1, 2)
                     for i, g in enumerate(grads))  # fmt: skip
