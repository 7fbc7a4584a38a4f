"""From a call's tensors to a kernel run: the Need, dispatch, then the module (ops.py) or the
torch fallback. The public functions (api.py, kvcache.py, hf.py) and context parallelism
(attngen/distributed) run every kernel through `run_dense` and `run_varlen`; context
parallelism's backward runs the gradient kernels of each chunk pair through
`run_dense_backward`.

A caller that wants flash-attn's [B, N, H, D] output sets the Call's heads_last (dispatch.py):
a module that takes `out=` (Dispatch.writes_out; every module the templates render) allocates
and writes that layout itself through its `attention_flash_out` (ops.py); from one that does
not (a hand-written stand-in), its [B, H, N, D] output is copied into that layout.

dropout_p > 0 asks for a module built with dropout: true (Need.dropout); the call's Philox
state is drawn here (arguments.dropout_rng_state) and handed to the module's forward and,
through the op's autograd formula, to its backward. Such a call leaves no plan (plans.py):
a planned call would skip this draw. `deterministic` goes the same way to the backward
(backward_ops.py: False, dQ by atomics); a call that needs no gradient ignores it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from attngen.runtime import backward_ops, ops, plans
from attngen.runtime.arguments import (
    dropout_probability,
    dropout_rng_state,
    needs_gradients,
    seqlen_bound,
    softcap_value,
    softmax_scale,
)
from attngen.runtime.backward_ops import check_deterministic
from attngen.runtime.dispatch import Call, choose, need_for, unsupported_dtype
from attngen.runtime.fallback import fallback_dense, fallback_varlen
from attngen.runtime.selection import Dispatch
from attngen.spec import CausalAlign, KernelKind, Mask


def run_dense(
    api: str,
    q,
    k,
    v,
    call: Call,
    *,
    refusal: str | None = None,
    attn_mask=None,
    rng_state=None,
    plan_key: tuple | None = None,
):
    """[B, H, N, D] attention through the prefill kind; (out, lse or None). With
    call.heads_last, out is [B, N, H, DV], contiguous. plan_key: the caller's signature key,
    under which a call a module served leaves its plan (plans.py; the key must tell calls with
    sinks, chunk_size and sink_tokens apart). rng_state: the call's Philox state when the
    caller drew it (arguments.attn_probs_rng_state), else drawn here."""
    call = _checked(call)
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    backward = needs_gradients(q, k, v, call.sinks)
    need = call.need(
        KernelKind.prefill, q, v, (seqlen_q, seqlen_k), seqlen_q == seqlen_k, backward=backward
    )
    if need.dtype is None:
        refusal = refusal or unsupported_dtype(q)
    dispatch = choose(api, need, call.fallback, refusal, (q.shape[1], k.shape[1]))
    sm_scale = softmax_scale(call.scale, q)
    if dispatch.key is None:
        options = call.torch_options(sm_scale)
        result = fallback_dense(q, k, v, attn_mask=attn_mask, return_lse=call.return_lse, **options)
        out, lse = result if call.return_lse else (result, None)
        return (out.transpose(1, 2).contiguous() if call.heads_last else out), lse
    in_place = call.heads_last and dispatch.writes_out
    out, lse = ops.prefill(
        dispatch.key,
        q,
        k,
        v,
        sm_scale,
        call.alibi_slopes,
        call.return_lse,
        in_place,
        call.sinks,
        *_dropout(call.dropout_p, q, rng_state),
        deterministic=call.deterministic,
    )
    if call.heads_last and not in_place:  # the module wrote [B, H, N, D]: copied (no out=)
        out = out.transpose(1, 2).contiguous()
    if not call.dropout_p:  # dropout: no plan (a planned call would skip the seed's draw)
        plans.remember(plan_key, dispatch, sm_scale, call.return_lse, in_place)
    return out, lse


def _checked(call: Call) -> Call:
    """The call with dropout_p and softcap checked (softcap <= 0: off, for the fallback too, as
    in flash-attn) and `deterministic` a bool."""
    dropout_p = dropout_probability(call.dropout_p)
    softcap = softcap_value(call.softcap)
    check_deterministic(call.deterministic)
    return replace(call, dropout_p=dropout_p, softcap=softcap)


def run_dense_backward(
    api: str,
    dout,
    q,
    k,
    v,
    out,
    lse,
    dlse,
    *,
    mask: Mask,
    align: CausalAlign | None,
    window,
    softcap,
    alibi_slopes,
    scale,
):
    """(dq, dk, dv) of [B, H, N, D] attention through a prefill module's gradient kernels,
    given the forward's out and LSE (any LSE: context parallelism passes the whole sequence's)
    and the output's gradient dout (and the LSE's, dlse, or None). The Need asks for a module
    built with `backward: true`, so dispatch picks and records one, or raises NoKernelError:
    no torch fallback computes gradients from a given LSE."""
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    need = need_for(
        KernelKind.prefill,
        q,
        v,
        mask=mask,
        align=align,
        window=window,
        softcap=softcap,
        alibi=alibi_slopes is not None,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        same_lengths=seqlen_q == seqlen_k,
        backward=True,
    )
    refusal = unsupported_dtype(q) if need.dtype is None else None
    dispatch = choose(api, need, "error", refusal, (q.shape[1], k.shape[1]))
    assert dispatch.key is not None  # fallback "error": a Dispatch without a module raised
    return backward_ops.prefill_backward(
        dispatch.key, dout, q, k, v, out, lse, dlse, softmax_scale(scale, q), alibi_slopes
    )


def run_varlen(
    api: str,
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    call: Call,
    *,
    seqused_k=None,
    refusal: str | None = None,
    rng_state=None,
    length_bounds=None,
    dispatch: Dispatch | None = None,
    plan_key: tuple | None = None,
):
    """Packed [T, H, D] attention through the varlen kind; (out, lse [H, Tq] or None).

    The kernel is chosen with lengths the tensors guarantee, never max_seqlen_q/k (the
    caller's claim, which only sizes the grid): `length_bounds` (Nq, Nk) when the caller
    knows tighter ones from shapes (a cache's capacity), else the packed totals. A caller
    that must know the choice before it changes anything (the KV-cache route appends) passes
    the `dispatch` varlen_dispatch gave it. plan_key and rng_state: as run_dense's (a plan
    only for a call without seqused_k)."""
    call = _checked(call)
    if dispatch is None:
        same = cu_seqlens_q is cu_seqlens_k and seqused_k is None
        bounds = length_bounds or (q.shape[0], k.shape[0])
        backward = needs_gradients(q, k, v, call.sinks)
        heads = (q.shape[1], k.shape[1])
        dispatch = varlen_dispatch(api, q, v, call, bounds, same, refusal, heads, backward)
    max_seqlen_q = seqlen_bound(max_seqlen_q, "max_seqlen_q")
    max_seqlen_k = seqlen_bound(max_seqlen_k, "max_seqlen_k")
    sm_scale = softmax_scale(call.scale, q)
    lengths = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if dispatch.key is None:
        options = call.torch_options(sm_scale)
        return fallback_varlen(q, k, v, *lengths, seqused_k, return_lse=call.return_lse, **options)
    result = ops.varlen(
        dispatch.key,
        q,
        k,
        v,
        *lengths,
        sm_scale,
        call.alibi_slopes,
        seqused_k,
        call.return_lse,
        call.sinks,
        *_dropout(call.dropout_p, q, rng_state),
        deterministic=call.deterministic,
    )
    if seqused_k is None and not call.dropout_p:  # dropout: no plan (it would skip the draw)
        plans.remember(plan_key, dispatch, sm_scale, call.return_lse, False)
    return result


def _dropout(dropout_p: float, q, rng_state=None) -> tuple[float, Any]:
    """(dropout_p, the call's Philox state or None) for the ops: a fresh seed per call (the
    caller's, when it drew it)."""
    if not dropout_p:
        return dropout_p, None
    return dropout_p, (dropout_rng_state(q) if rng_state is None else rng_state)


def varlen_dispatch(
    api: str,
    q,
    v,
    call: Call,
    length_bounds: tuple[int, int],
    same_lengths: bool,
    refusal: str | None,
    heads: tuple[int, int],
    backward: bool = False,
) -> Dispatch:
    """The varlen module (or the warned fallback) that serves packed q [T, HQ, D] and values
    of v's head dim at lengths up to `length_bounds` (with learned sinks when call.sinks; with
    gradient kernels when `backward`); NoKernelError when none does."""
    need = call.need(KernelKind.varlen, q, v, length_bounds, same_lengths, backward=backward)
    if need.dtype is None:
        refusal = refusal or unsupported_dtype(q)
    return choose(api, need, call.fallback, refusal, heads)
