"""The autograd formulas of the `attngen::prefill` and `attngen::varlen` ops (ops.py): the
backward ops `attngen::prefill_backward` and `attngen::varlen_backward` call the module's
`attention_backward` / `attention_varlen_backward` (modules built from a spec with
`backward: true`). A module built without backward raises NotImplementedError at the
backward, naming the module and the spec field. The forward's dropout_p and rng_state are
saved for the backward, which so regenerates the forward's mask. Learned sinks that require
grad get theirs from the same backward (the ops return d sinks as a fourth tensor, empty
without sinks: an op's outputs cannot be optional).

`deterministic` (saved from the forward op, as flash-attn's argument): True runs the module's
atomics-free kernels (seven products, bitwise reproducible); False the same kernels unless
ATTNGEN_ATOMIC_DQ=1 (atomic_dq_enabled: the atomic path measured slower), which runs the
atomic-dQ path (five products: the dK/dV kernel adds dQ by fp32 atomics, whose order varies
on a GPU). There a module
built before that path (no BWD_DKDV_ATOMIC_CONFIG), or one where no atomic config fits
(BWD_DKDV_ATOMIC_CONFIG None: D 256 on sm90), runs its deterministic kernels with a
warning. `last_backward()` and `backward_runs()` say which path each backward call took.

Importing this module registers the formulas (attngen.runtime does, at import).
"""

from __future__ import annotations

import collections
import os
import threading
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from attngen.runtime.ops import _dropout_options, _no_lse, _sinks, count_run
from attngen.runtime.registry import current_registry

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
        warnings.warn(f"{key}: {reason}", stacklevel=3)
        run, options = BackwardRun(key, False, DETERMINISTIC, reason), {}
    with _runs_lock:
        _runs[key, run.path] += 1
        _last[:] = [run]
    return options


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


def _sink_grad_or_none(ctx, dsinks: Tensor, index: int) -> Tensor | None:
    """d sinks for the forward op's input `index` when it asked for one."""
    return dsinks if ctx.has_sinks and ctx.needs_input_grad[index] else None


def prefill_backward(
    key: str,
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dlse: Tensor | None,
    sm_scale: float,
    alibi_slopes: Tensor | None,
    dropout_p: float = 0.0,
    rng_state: Tensor | None = None,
    sinks: Tensor | None = None,
    deterministic: bool = True,
) -> tuple:
    """(dq, dk, dv) from the gradient kernels of the prefill module `key`, called directly:
    eager callers that hold the output and LSE themselves (context parallelism runs them per
    chunk pair with the whole sequence's LSE) and record no autograd graph. dropout_p and
    rng_state: the forward's, for a module built with dropout: true. With sinks (a module
    built with sinks: true), (dq, dk, dv, dsinks). deterministic: the module docstring."""
    backward = _backward_of(key, "attention_backward")
    path = _path_options(key, current_registry().module(key), deterministic)
    count_run(key)
    return tuple(
        backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            sm_scale=sm_scale,
            alibi_slopes=alibi_slopes,
            dlse=dlse,
            **_dropout_options(dropout_p, rng_state),
            **_sinks(sinks),
            **path,
        )
    )


@torch.library.custom_op("attngen::prefill_backward", mutates_args=())
def prefill_backward_op(
    key: str,
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dlse: Tensor | None,
    sm_scale: float,
    alibi_slopes: Tensor | None,
    dropout_p: float = 0.0,
    rng_state: Tensor | None = None,
    sinks: Tensor | None = None,
    deterministic: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    grads = prefill_backward(
        key,
        dout,
        q,
        k,
        v,
        out,
        lse,
        dlse,
        sm_scale,
        alibi_slopes,
        dropout_p,
        rng_state,
        sinks,
        deterministic,
    )
    return grads[0], grads[1], grads[2], _sink_gradient(q, grads, sinks)


@prefill_backward_op.register_fake
def _(
    key,
    dout,
    q,
    k,
    v,
    out,
    lse,
    dlse,
    sm_scale,
    alibi_slopes,
    dropout_p=0.0,
    rng_state=None,
    sinks=None,
    deterministic=True,
):
    dsinks = _no_lse(q) if sinks is None else torch.empty_like(sinks)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


def _prefill_setup(ctx, inputs, output):
    (key, q, k, v, sm_scale, alibi_slopes, _, _, sinks, dropout_p, rng_state, deterministic) = (
        inputs
    )
    ctx.key, ctx.sm_scale, ctx.dropout_p = key, sm_scale, dropout_p
    ctx.deterministic = deterministic
    ctx.has_sinks = sinks is not None
    ctx.save_for_backward(q, k, v, alibi_slopes, rng_state, sinks, *output)


def _prefill_backward(ctx, dout, dlse):
    q, k, v, alibi_slopes, rng_state, sinks, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dsinks = prefill_backward_op(
        ctx.key,
        dout,
        q,
        k,
        v,
        out,
        lse,
        dlse,
        ctx.sm_scale,
        alibi_slopes,
        ctx.dropout_p,
        rng_state,
        sinks,
        ctx.deterministic,
    )
    return (
        None,
        dq,
        dk,
        dv,
        None,
        None,
        None,
        None,
        _sink_grad_or_none(ctx, dsinks, 8),
        None,
        None,
        None,
    )


@torch.library.custom_op("attngen::varlen_backward", mutates_args=())
def varlen_backward_op(
    key: str,
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dlse: Tensor | None,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    sm_scale: float,
    alibi_slopes: Tensor | None,
    dropout_p: float = 0.0,
    rng_state: Tensor | None = None,
    sinks: Tensor | None = None,
    deterministic: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    backward = _backward_of(key, "attention_varlen_backward")
    path = _path_options(key, current_registry().module(key), deterministic)
    count_run(key)
    grads = backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        sm_scale=sm_scale,
        alibi_slopes=alibi_slopes,
        dlse=dlse,
        **_dropout_options(dropout_p, rng_state),
        **_sinks(sinks),
        **path,
    )
    return grads[0], grads[1], grads[2], _sink_gradient(q, grads, sinks)


@varlen_backward_op.register_fake
def _(
    key,
    dout,
    q,
    k,
    v,
    out,
    lse,
    dlse,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    sm_scale,
    alibi_slopes,
    dropout_p=0.0,
    rng_state=None,
    sinks=None,
    deterministic=True,
):
    dsinks = _no_lse(q) if sinks is None else torch.empty_like(sinks)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


def _varlen_setup(ctx, inputs, output):
    (
        key,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        sm_scale,
        alibi_slopes,
        seqused_k,
        _,
        sinks,
        dropout_p,
        rng_state,
        deterministic,
    ) = inputs
    if seqused_k is not None:
        ctx.refusal = (
            "seqused_k: no backward for a KV cache read in place; pass None when "
            "q, k or v requires grad"
        )
    else:
        ctx.refusal = None
    ctx.key, ctx.sm_scale, ctx.dropout_p = key, sm_scale, dropout_p
    ctx.deterministic = deterministic
    ctx.lengths = (max_seqlen_q, max_seqlen_k)
    ctx.has_sinks = sinks is not None
    ctx.save_for_backward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state, sinks, *output
    )


def _varlen_backward(ctx, dout, dlse):
    if ctx.refusal:
        raise ValueError(ctx.refusal)
    (q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state, sinks, out, lse) = (
        ctx.saved_tensors
    )
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dsinks = varlen_backward_op(
        ctx.key,
        dout,
        q,
        k,
        v,
        out,
        lse,
        dlse,
        cu_seqlens_q,
        cu_seqlens_k,
        *ctx.lengths,
        ctx.sm_scale,
        alibi_slopes,
        ctx.dropout_p,
        rng_state,
        sinks,
        ctx.deterministic,
    )
    return (
        None,
        dq,
        dk,
        dv,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        _sink_grad_or_none(ctx, dsinks, 12),
        None,
        None,
        None,
    )


torch.library.register_autograd("attngen::prefill", _prefill_backward, setup_context=_prefill_setup)
torch.library.register_autograd("attngen::varlen", _varlen_backward, setup_context=_varlen_setup)
