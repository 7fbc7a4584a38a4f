"""The public attention functions: SDPA-shaped and flash-attn 2.x-compatible.

Each function turns its arguments into a `Need` (dispatch.py), selects a generated module
(outside the ops, so torch.compile traces a fixed module) and calls the `attngen::*` op; with
fallback="sdpa" (the argument, or attngen.runtime.set_fallback) a call no module serves runs in
torch after a warning. Features no generated kernel has (a dense attn_mask tensor, dropout,
rotary inside the call) are refused with an error that names them.
"""

from __future__ import annotations

import math

import torch

from attngen.runtime import ops
from attngen.runtime.dispatch import Dispatch, choose
from attngen.runtime.fallback import torch_attention

ALIGNS = ("top_left", "bottom_right")
INFINITE = 2**31 - 1  # flash-attn's -1 window side, as the spec's largest window
_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def need_fields(kind, q, v, mask, align, window, softcap, alibi_slopes, seqlen_q, seqlen_k,
                same_lengths, kv_layout=None, page_size=None) -> tuple:
    """Need's fields in order, without the arch (dispatch.choose adds it): plain values."""
    if mask == "none":
        align, window = None, None
    dtype = _DTYPES[q.dtype] if q.dtype in _DTYPES else str(q.dtype)
    return (kind, dtype, int(q.shape[-1]), int(v.shape[-1]), mask, align,
            None if window is None else (int(window[0]), int(window[1])),
            float(softcap or 0.0), alibi_slopes is not None, int(seqlen_q), int(seqlen_k),
            bool(same_lengths), kv_layout, page_size)


def dispatch_call(api, fields, q, fallback, refusal=None) -> Dispatch:
    return choose(api, fields, q.device.type, q.device.index, fallback, refusal)


def _scale(scale, q) -> float:
    if scale is None:
        return 1.0 / math.sqrt(q.shape[-1])
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (
            math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: expected a finite float > 0 or None, got {scale!r}")
    return float(scale)


def _check_4d(**tensors) -> None:
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected a rank-4 tensor, got {got}")


def run_dense(api, q, k, v, *, mask, align, window, softcap, alibi_slopes, scale, return_lse,
              fallback, refusal=None, attn_mask=None, dropout_p=0.0):
    """[B, H, N, D] attention through the prefill kind; (out, lse or None)."""
    fields = need_fields("prefill", q, v, mask, align, window, softcap, alibi_slopes,
                         q.shape[2], k.shape[2], q.shape[2] == k.shape[2])
    dispatch = dispatch_call(api, fields, q, fallback, refusal)
    if dispatch.fallback:
        result = torch_attention(q, k, v, mask=mask, align=align, window=window, softcap=softcap,
                                 alibi_slopes=alibi_slopes, scale=scale, attn_mask=attn_mask,
                                 dropout_p=dropout_p, return_lse=return_lse)
        return result if return_lse else (result, None)
    out, lse = ops.prefill(dispatch.key, q, k, v, _scale(scale, q), alibi_slopes, return_lse)
    return out, (lse if return_lse else None)


def run_varlen(api, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, mask,
               align, window, softcap, alibi_slopes, scale, return_lse, fallback,
               seqused_k=None, refusal=None, dropout_p=0.0, length_bounds=None):
    """Packed [T, H, D] attention through the varlen kind; (out, lse [H, Tq] or None).

    The kernel is chosen with lengths the tensors guarantee, never max_seqlen_q/k (the
    caller's claim, which only sizes the grid): `length_bounds` (Nq, Nk) when the caller
    knows tighter ones from shapes (a cache's capacity), else the packed totals."""
    same = cu_seqlens_q is cu_seqlens_k and seqused_k is None
    bound_q, bound_k = length_bounds or (q.shape[0], k.shape[0])
    fields = need_fields("varlen", q, v, mask, align, window, softcap, alibi_slopes,
                         bound_q, bound_k, same)
    dispatch = dispatch_call(api, fields, q, fallback, refusal)
    if dispatch.fallback:
        return _varlen_in_torch(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, mask=mask,
                                align=align, window=window, softcap=softcap,
                                alibi_slopes=alibi_slopes, scale=scale, return_lse=return_lse,
                                dropout_p=dropout_p)
    out, lse = ops.varlen(dispatch.key, q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                          int(max_seqlen_k), _scale(scale, q), alibi_slopes, seqused_k,
                          return_lse)
    return out, (lse if return_lse else None)


def _varlen_in_torch(q, k, v, cu_q, cu_k, seqused_k, *, return_lse, **kwargs):
    """The fallback, one sequence at a time (it reads the lengths on the host)."""
    out = q.new_zeros((q.shape[0], q.shape[1], v.shape[-1]))
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device)
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    used = seqused_k.tolist() if seqused_k is not None else None
    for b in range(len(starts_q) - 1):
        q0, q1 = starts_q[b], starts_q[b + 1]
        k0 = starts_k[b]
        k1 = k0 + used[b] if used is not None else starts_k[b + 1]
        seq = [t.transpose(0, 1)[None] for t in (q[q0:q1], k[k0:k1], v[k0:k1])]
        result = torch_attention(*seq, return_lse=return_lse, **kwargs)
        o = result[0] if return_lse else result
        out[q0:q1] = o[0].transpose(0, 1)
        if return_lse:
            lse[:, q0:q1] = result[1][0]
    return out, (lse if return_lse else None)


# ---------------------------------------------------------------------------- SDPA-shaped


def scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False, *, window=None, softcap=None,
                                 alibi_slopes=None, causal_align="top_left", fallback=None):
    """torch.nn.functional.scaled_dot_product_attention through generated kernels.

    q [B, HQ, Nq, D], k/v [B, HKV, Nk, D] (HQ != HKV needs enable_gqa=True, as in torch).
    is_causal is top-left aligned as in torch (causal_align="bottom_right" for the KV-cache
    diagonal); window=(left, right) keeps key j for i' - left <= j <= i' + right; softcap and
    alibi_slopes ([HQ] fp32) as in the spec. attn_mask tensors and dropout_p > 0 are refused
    (no generated kernel has them) unless fallback="sdpa". fallback=None uses
    attngen.runtime.set_fallback's mode ("error" unless changed).
    """
    _check_4d(q=q, k=k, v=v)
    if causal_align not in ALIGNS:
        raise ValueError(f"causal_align: got {causal_align!r}; allowed: {', '.join(ALIGNS)}")
    if q.shape[1] != k.shape[1] and not enable_gqa:
        raise ValueError(f"heads: q has {q.shape[1]} heads and k {k.shape[1]}; pass "
                         "enable_gqa=True for grouped-query attention (as torch does)")
    if window is not None:
        if is_causal:
            raise ValueError("is_causal: must be False with window=(left, right); the window "
                             "says which keys each query sees (right=0 is causal)")
        left, right = _window_pair(window, "window")
        mask, win = "sliding_window", (left, right)
    else:
        mask, win = ("causal" if is_causal else "none"), None
    refusal = None
    if attn_mask is not None:
        refusal = ("attn_mask: a dense mask tensor is not served by generated kernels; use "
                   "is_causal, window, alibi_slopes or softcap")
    elif dropout_p:
        refusal = f"dropout_p: got {dropout_p}; generated kernels are inference-only (0.0)"
    out, _ = run_dense("scaled_dot_product_attention", q, k, v, mask=mask, align=causal_align,
                       window=win, softcap=softcap, alibi_slopes=alibi_slopes, scale=scale,
                       return_lse=False, fallback=fallback, refusal=refusal, attn_mask=attn_mask,
                       dropout_p=dropout_p)
    return out


def _window_pair(window, name) -> tuple[int, int]:
    ok = (isinstance(window, (tuple, list)) and len(window) == 2
          and all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in window))
    if not ok:
        raise ValueError(f"{name}: got {window!r}; allowed: (left, right), ints >= 0")
    return int(window[0]), int(window[1])


# ---------------------------------------------------------------------- flash-attn 2.x


def flash_mask(causal, window_size) -> tuple[str, tuple[int, int] | None]:
    """flash-attn's (causal, window_size) as a spec mask; -1 is an unbounded side."""
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and w >= -1 for w in window_size)):
        raise ValueError(f"window_size: got {window_size!r}; allowed: (left, right), ints >= -1 "
                         "(-1: unbounded)")
    left, right = window_size
    if causal:
        return ("causal", None) if left < 0 else ("sliding_window", (left, 0))
    if left < 0 and right < 0:
        return "none", None
    return "sliding_window", (INFINITE if left < 0 else left, INFINITE if right < 0 else right)


def _flash_refusal(dropout_p, alibi_slopes) -> str | None:
    if dropout_p:
        return f"dropout_p: got {dropout_p}; generated kernels are inference-only (0.0)"
    if alibi_slopes is not None and alibi_slopes.dim() != 1:
        return (f"alibi_slopes: got shape {tuple(alibi_slopes.shape)}; generated kernels take "
                "[nheads] fp32 (one slope per head for the whole batch)")
    return None


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """flash-attn 2.x `flash_attn_func`: q [B, Nq, HQ, D], k/v [B, Nk, HKV, D] -> out
    [B, Nq, HQ, DV]; causal is bottom-right aligned (flash-attn >= 2.1). With
    return_attn_probs, returns (out, lse [B, HQ, Nq], None): the probabilities are never formed.
    `deterministic` is accepted: the forward is always deterministic."""
    _check_4d(q=q, k=k, v=v)
    mask, window = flash_mask(causal, window_size)
    out, lse = run_dense("flash_attn_func", q.transpose(1, 2), k.transpose(1, 2),
                         v.transpose(1, 2), mask=mask, align="bottom_right", window=window,
                         softcap=softcap, alibi_slopes=alibi_slopes, scale=softmax_scale,
                         return_lse=return_attn_probs, fallback=None,
                         refusal=_flash_refusal(dropout_p, alibi_slopes), dropout_p=dropout_p)
    out = out.transpose(1, 2).contiguous()  # flash-attn returns a contiguous [B, N, H, D]
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    """flash-attn 2.x `flash_attn_varlen_func`: packed q [Tq, HQ, D], k/v [Tk, HKV, D],
    cu_seqlens int32 [B + 1]; with return_attn_probs, (out, lse [HQ, Tq], None)."""
    if block_table is not None:
        raise ValueError("block_table: paged K/V in flash_attn_varlen_func is not supported; "
                         "use flash_attn_with_kvcache")
    mask, window = flash_mask(causal, window_size)
    out, lse = run_varlen("flash_attn_varlen_func", q, k, v, cu_seqlens_q, cu_seqlens_k,
                          max_seqlen_q, max_seqlen_k, mask=mask, align="bottom_right",
                          window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                          scale=softmax_scale, return_lse=return_attn_probs, fallback=None,
                          refusal=_flash_refusal(dropout_p, alibi_slopes), dropout_p=dropout_p)
    return (out, lse, None) if return_attn_probs else out
