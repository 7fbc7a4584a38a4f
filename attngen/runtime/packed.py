"""flash-attn 2.x's packed forms: q, k and v (or k and v) stacked in one tensor.

Each function takes views of the packed tensor (no copy: the kernels read any strides) and
calls flash_attn_func or flash_attn_varlen_func with the same arguments, so masks, softcap,
ALiBi, GQA (kvpacked), dropout, return_attn_probs (flash-attn's S_dmask) and the errors are
theirs. A packed tensor of the wrong rank or with the wrong stack size is refused, naming it
and flash-attn's layout.
"""

from __future__ import annotations

import torch

from attngen.runtime.api import flash_attn_func, flash_attn_varlen_func


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attn 2.x `flash_attn_qkvpacked_func`: qkv [B, N, 3, H, D] -> out [B, N, H, D]
    (with return_attn_probs: (out, lse [B, H, N], S_dmask), S_dmask as flash_attn_func's)."""
    q, k, v = _unstack("qkv", qkv, 5, 3, "[batch, seqlen, 3, nheads, headdim]")
    return flash_attn_func(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attn 2.x `flash_attn_kvpacked_func`: q [B, Nq, HQ, D], kv [B, Nk, 2, HKV, D]
    -> out [B, Nq, HQ, D]; HQ a multiple of HKV (GQA)."""
    k, v = _unstack("kv", kv, 5, 2, "[batch, seqlen_k, 2, nheads_k, headdim]")
    return flash_attn_func(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attn 2.x `flash_attn_varlen_qkvpacked_func`: qkv [T, 3, H, D], cu_seqlens int32
    [B + 1] for queries and keys alike -> out [T, H, D] (lse [H, T])."""
    q, k, v = _unstack("qkv", qkv, 4, 3, "[total, 3, nheads, headdim]")
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attn 2.x `flash_attn_varlen_kvpacked_func`: q [Tq, HQ, D], kv [Tk, 2, HKV, D]
    -> out [Tq, HQ, D] (lse [HQ, Tq])."""
    k, v = _unstack("kv", kv, 4, 2, "[total_k, 2, nheads_k, headdim]")
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


def _unstack(
    name: str, packed: object, rank: int, count: int, layout: str
) -> tuple[torch.Tensor, ...]:
    """The `count` tensors stacked at dim rank - 3 of `packed`, as views."""
    if (type(packed) is torch.Tensor or isinstance(packed, torch.Tensor)) and (
        packed.dim() == rank and packed.shape[rank - 3] == count
    ):
        return packed.unbind(rank - 3)
    got = list(packed.shape) if isinstance(packed, torch.Tensor) else type(packed).__name__
    raise ValueError(f"{name}: expected a rank-{rank} tensor {layout}, got {got}")
