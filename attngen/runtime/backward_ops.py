"""The autograd formulas of the `attngen::prefill` and `attngen::varlen` ops (ops.py): the
backward ops `attngen::prefill_backward` and `attngen::varlen_backward` call the module's
`attention_backward` / `attention_varlen_backward` (modules built from a spec with
`backward: true`). A module built without backward raises NotImplementedError at the
backward, naming the module and the spec field. The forward's dropout_p and rng_state are
saved for the backward, which so regenerates the forward's mask. Learned sinks that require
grad get theirs from the same backward (the ops return d sinks as a fourth tensor, empty
without sinks: an op's outputs cannot be optional).

Importing this module registers the formulas (attngen.runtime does, at import).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attngen.runtime.ops import _dropout_options, _no_lse, _sinks, count_run
from attngen.runtime.registry import current_registry


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
) -> tuple:
    """(dq, dk, dv) from the gradient kernels of the prefill module `key`, called directly:
    eager callers that hold the output and LSE themselves (context parallelism runs them per
    chunk pair with the whole sequence's LSE) and record no autograd graph. dropout_p and
    rng_state: the forward's, for a module built with dropout: true. With sinks (a module
    built with sinks: true), (dq, dk, dv, dsinks)."""
    backward = _backward_of(key, "attention_backward")
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
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    grads = prefill_backward(
        key, dout, q, k, v, out, lse, dlse, sm_scale, alibi_slopes, dropout_p, rng_state, sinks
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
):
    dsinks = _no_lse(q) if sinks is None else torch.empty_like(sinks)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


def _prefill_setup(ctx, inputs, output):
    key, q, k, v, sm_scale, alibi_slopes, _, _, sinks, dropout_p, rng_state = inputs
    ctx.key, ctx.sm_scale, ctx.dropout_p = key, sm_scale, dropout_p
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
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    backward = _backward_of(key, "attention_varlen_backward")
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
    ) = inputs
    if seqused_k is not None:
        ctx.refusal = (
            "seqused_k: no backward for a KV cache read in place; pass None when "
            "q, k or v requires grad"
        )
    else:
        ctx.refusal = None
    ctx.key, ctx.sm_scale, ctx.dropout_p = key, sm_scale, dropout_p
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
    )


torch.library.register_autograd("attngen::prefill", _prefill_backward, setup_context=_prefill_setup)
torch.library.register_autograd("attngen::varlen", _varlen_backward, setup_context=_varlen_setup)
