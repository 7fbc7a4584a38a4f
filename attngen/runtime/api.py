"""The public attention functions: SDPA-shaped and flash-attn 2.x-compatible.

Each function checks its arguments once, turns them into a `Need` (dispatch.py), selects a
generated module (outside the ops, so torch.compile traces a fixed module) and runs it
(launch.py: the module's entry point in eager mode, the `attngen::*` op under torch.compile);
with fallback="sdpa" (the argument, or attngen.runtime.set_fallback) a call no module serves runs in
torch after a warning. Features no generated kernel has (a dense attn_mask tensor, rotary
inside the call) are refused with an error that names them.

dropout_p > 0 (applied whenever given, as in flash-attn and SDPA) needs a module built with
`backward: true, dropout: true`, else the call is refused naming dropout_p; each call draws a
fresh Philox seed from q's device's default generator (arguments.dropout_rng_state).

Each function first looks up its call signature's plan (plans.py), which a signature a module
served before runs without the checks, Need and selection above; a call with dropout_p != 0
is never planned (plans.plain): its seed is drawn on the full path.
"""

from __future__ import annotations

import torch

from attngen.runtime import plans
from attngen.runtime.arguments import (
    attn_probs_rng_state,
    check_causal_align,
    check_rank4,
    flash_mask,
    no_attn_probs,
    rank4,
    window_pair,
)
from attngen.runtime.dispatch import Call
from attngen.runtime.kvcache_append import paged_keys
from attngen.runtime.launch import run_dense, run_varlen
from attngen.spec import CausalAlign, Mask

SDPA, FLASH, VARLEN = "scaled_dot_product_attention", "flash_attn_func", "flash_attn_varlen_func"

# ---------------------------------------------------------------------------- SDPA-shaped


def scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *,
                                 window=None, softcap=None, alibi_slopes=None,
                                 causal_align="top_left", fallback=None):  # fmt: skip
    """torch.nn.functional.scaled_dot_product_attention through generated kernels.

    q [B, HQ, Nq, D], k/v [B, HKV, Nk, D] (HQ != HKV needs enable_gqa=True, as in torch).
    is_causal is top-left aligned as in torch (causal_align="bottom_right" for the KV-cache
    diagonal); window=(left, right) keeps key j for i' - left <= j <= i' + right; softcap and
    alibi_slopes ([HQ] or [B, HQ] fp32) as in the spec. dropout_p > 0 needs a module built
    with dropout: true (the module docstring). attn_mask tensors are refused (no generated
    kernel has them) unless fallback="sdpa". fallback=None uses attngen.runtime.set_fallback's
    mode ("error" unless changed). The backward is bitwise reproducible (no atomics) when
    torch.are_deterministic_algorithms_enabled(), else it adds dQ by fp32 atomics (faster)."""
    key = None
    grad = plans.grad_mode(q, k, v, alibi_slopes)
    if (
        attn_mask is None
        and grad is not None
        and plans.plain(scale, softcap, dropout_p)
        and type(is_causal) is bool
        and type(enable_gqa) is bool
        and (window is None or plans.pair(window))
        and type(causal_align) is str
        and (fallback is None or type(fallback) is str)
    ):
        deterministic = torch.are_deterministic_algorithms_enabled() if grad else None
        key = (SDPA, q.shape, k.shape, v.shape, q.dtype, q.device, is_causal, scale, enable_gqa,
               window, softcap, plans.slopes_rank(alibi_slopes), causal_align, fallback,
               deterministic)  # fmt: skip
        plan = plans.find(key)
        if plan is not None:
            ran = (
                plans.run_trained(
                    plan, q, k, v, alibi_slopes, bool(deterministic), flash=False, heads_last=False
                )
                if grad
                else plans.run_dense(plan, q, k, v, alibi_slopes, heads_last=False)
            )
            if ran is not None:
                return ran[0]
    options = (is_causal, window, softcap, alibi_slopes, scale, dropout_p, fallback)
    return _sdpa(q, k, v, attn_mask, enable_gqa, causal_align, options, key)


def _sdpa(q, k, v, attn_mask, enable_gqa, causal_align, options, key):
    """scaled_dot_product_attention's full path: its checks, its Call, run_dense. options:
    (is_causal, window, softcap, alibi_slopes, scale, dropout_p, fallback)."""
    is_causal, window, softcap, alibi_slopes, scale, dropout_p, fallback = options
    if not rank4(q, k, v):
        check_rank4(q, k, v)
    align = check_causal_align(causal_align)
    if q.shape[1] != k.shape[1] and not enable_gqa:
        raise ValueError(
            f"heads: q has {q.shape[1]} heads and k {k.shape[1]}; pass "
            "enable_gqa=True for grouped-query attention (as torch does)"
        )
    mask, win = _sdpa_mask(is_causal, window)
    deterministic = torch.are_deterministic_algorithms_enabled()
    call = Call(
        mask, align, win, softcap, alibi_slopes, scale, False, fallback, dropout_p, deterministic
    )
    out, _ = run_dense(
        SDPA, q, k, v, call, refusal=_sdpa_refusal(attn_mask), attn_mask=attn_mask, plan_key=key
    )
    return out


def _sdpa_mask(is_causal, window) -> tuple[Mask, tuple[int, int] | None]:
    """(mask kind, window or None) of SDPA's is_causal and attngen's window=(left, right)."""
    if window is None:
        return (Mask.causal if is_causal else Mask.none), None
    if is_causal:
        raise ValueError(
            "is_causal: must be False with window=(left, right); the window "
            "says which keys each query sees (right=0 is causal)"
        )
    return Mask.sliding_window, window_pair(window, "window")


def _sdpa_refusal(attn_mask) -> str | None:
    """Why no generated kernel may serve the call (a dense attn_mask), or None."""
    if attn_mask is not None:
        return (
            "attn_mask: a dense mask tensor is not served by generated kernels; use "
            "is_causal, window, alibi_slopes or softcap"
        )
    return None


# ---------------------------------------------------------------------- flash-attn 2.x


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                    deterministic=False, return_attn_probs=False):  # fmt: skip
    """flash-attn 2.x `flash_attn_func`: q [B, Nq, HQ, D], k/v [B, Nk, HKV, D] -> out
    [B, Nq, HQ, DV]; causal is bottom-right aligned (flash-attn >= 2.1). With
    return_attn_probs, returns (out, lse [B, HQ, Nq], S_dmask) as flash-attn 2 does: without
    dropout S_dmask is an empty tensor; with dropout_p > 0 it is flash-attn's testing output,
    [B, HQ, round128(Nq), round128(Nk)] in q's dtype, the unnormalized probabilities with the
    dropped ones negated, read from the mask the kernels drew (attn_probs.py). That is a
    testing path: slow, memory O(B * HQ * Nq * Nk), eager only. dropout_p > 0 needs a module
    built with dropout: true (the module docstring).
    deterministic=False (flash-attn's default) adds dQ by fp32 atomics in the backward (five
    products, not seven; the order of the additions, and so dQ's last bits, vary on a GPU);
    True runs the atomics-free kernels (bitwise reproducible). The output is one
    contiguous tensor, which a module's `attention_flash` entry point allocates and writes
    from q, k, v as they are (a module built before it writes it in place through `out=`,
    Dispatch.writes_out; one with neither is copied from its [B, H, N, D] output)."""
    key = None
    grad = plans.grad_mode(q, k, v, alibi_slopes)
    if (
        grad is not None
        and plans.plain(softmax_scale, softcap, dropout_p)
        and type(causal) is bool
        and plans.pair(window_size)
        and type(return_attn_probs) is bool
        and type(deterministic) is bool
    ):
        # deterministic only with grad, whose calls run a module with gradient kernels
        key = (FLASH, q.shape, k.shape, v.shape, q.dtype, q.device, causal, window_size, softcap,
               softmax_scale, plans.slopes_rank(alibi_slopes), return_attn_probs,
               deterministic if grad else None)  # fmt: skip
        plan = plans.find(key)
        if plan is not None:
            ran = (
                plans.run_trained(plan, q, k, v, alibi_slopes, deterministic)
                if grad
                else plans.run_flash(plan, q, k, v, alibi_slopes)
            )
            if ran is not None:
                return (ran[0], ran[1], no_attn_probs(q)) if return_attn_probs else ran[0]
    options = (dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)
    return _flash(q, k, v, key, *options, deterministic, return_attn_probs)


def _flash(q, k, v, key, dropout_p, scale, causal, window_size, softcap, alibi_slopes, *rest):
    """flash_attn_func's full path: its checks, its Call, run_dense, S_dmask; rest:
    deterministic and return_attn_probs."""
    deterministic, return_attn_probs = rest
    if not rank4(q, k, v):
        check_rank4(q, k, v)
    rng_state = attn_probs_rng_state(return_attn_probs, dropout_p, q)
    flash = (causal, window_size, softcap, alibi_slopes, scale, return_attn_probs)
    call = _flash_call(*flash, dropout_p, deterministic, heads_last=True)
    qkv = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    out, lse = run_dense(FLASH, *qkv, call, rng_state=rng_state, plan_key=key)
    if not return_attn_probs:
        return out
    if rng_state is None:
        return out, lse, no_attn_probs(q)
    from attngen.runtime import attn_probs  # its Triton kernel is defined on first use

    return out, lse, attn_probs.dense_dmask(q, k, rng_state, call)


def _flash_call(causal, window_size, softcap, alibi_slopes, scale, return_lse, *rest, heads_last):
    """The Call of a flash-attn call (causal bottom-right aligned); rest: dropout_p and
    deterministic."""
    mask, window = flash_mask(causal, window_size)
    dropout_p, deterministic = rest
    return Call(
        mask,
        CausalAlign.bottom_right,
        window,
        softcap,
        alibi_slopes,
        scale,
        return_lse=return_lse,
        dropout_p=dropout_p,
        deterministic=deterministic,
        heads_last=heads_last,
    )


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                           max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                           causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):  # fmt: skip
    """flash-attn 2.x `flash_attn_varlen_func`: packed q [Tq, HQ, D], k/v [Tk, HKV, D], cu_seqlens
    int32 [B + 1]; with return_attn_probs, (out, lse [HQ, Tq], S_dmask). dropout_p, deterministic
    and return_attn_probs as in flash_attn_func; sequence b draws its dropout mask as batch b, and
    with dropout S_dmask is [B, HQ, round128(max_seqlen_q), round128(max_seqlen_k)], sequence b at
    [b, :, :len_q, :len_k] (the same testing path: it reads cu_seqlens on the host). With
    block_table int32 [B, max_pages], k/v are paged caches [pages, page_size, HKV, D] and sequence
    b's keys are the first cu_seqlens_k[b + 1] - cu_seqlens_k[b] positions of its pages
    (flash-attn's paged varlen). They are gathered into [B * max_pages * page_size] rows first (a
    copy of every listed page; flash_attn_with_kvcache reads pages in place); a sequence whose
    length or pages do not fit gets NaN, as in the kernels."""
    key: tuple | None = None
    grad = plans.grad_mode(q, k, v, alibi_slopes)
    if (
        block_table is None
        and grad is not None
        and plans.plain(softmax_scale, softcap, dropout_p)
        and type(causal) is bool
        and plans.pair(window_size)
        and type(return_attn_probs) is bool
        and type(deterministic) is bool
        and type(max_seqlen_q) is int
        and type(max_seqlen_k) is int
    ):
        key = (VARLEN, q.shape, k.shape, v.shape, q.dtype, q.device, causal, window_size, softcap)
        key += (softmax_scale, plans.slopes_rank(alibi_slopes), return_attn_probs)
        trains = deterministic if grad else None  # with grad: a module with gradient kernels
        key += (cu_seqlens_q is cu_seqlens_k, trains)
        plan = plans.find(key)
        if plan is not None:
            lengths = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
            ran = plans.run_varlen(plan, q, k, v, *lengths, alibi_slopes, trains)
            if ran is not None:
                return (ran[0], ran[1], no_attn_probs(q)) if return_attn_probs else ran[0]
    lengths = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    options = (dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes)
    return _varlen(q, k, v, lengths, block_table, key, *options, deterministic, return_attn_probs)


def _varlen(q, k, v, lengths, block_table, key, dropout_p, scale, causal, window, softcap, *rest):
    """flash_attn_varlen_func's full path: its Call, the paged keys, run_varlen, S_dmask; rest:
    alibi_slopes, deterministic and return_attn_probs."""
    alibi_slopes, deterministic, return_attn_probs = rest
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = lengths
    rng_state = attn_probs_rng_state(return_attn_probs, dropout_p, q)
    flash = (causal, window, softcap, alibi_slopes, scale, return_attn_probs)
    call = _flash_call(*flash, dropout_p, deterministic, heads_last=False)
    shape = (max_seqlen_q, max_seqlen_k)  # S_dmask's, as given (paged: not the capacity)
    seqused_k, bounds = None, None
    if block_table is not None:
        k, v, cu_seqlens_k, seqused_k, max_seqlen_k = paged_keys(k, v, block_table, cu_seqlens_k, q)
        bounds = (q.shape[0], max_seqlen_k)
    out, lse = run_varlen(
        VARLEN,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        call,
        seqused_k=seqused_k,
        rng_state=rng_state,
        length_bounds=bounds,
        plan_key=key,
    )
    if not return_attn_probs:
        return out
    if rng_state is None:
        return out, lse, no_attn_probs(q)
    from attngen.runtime import attn_probs  # its Triton kernel is defined on first use

    cu_seqlens = (cu_seqlens_q, cu_seqlens_k, seqused_k)
    return out, lse, attn_probs.varlen_dmask(q, k, *cu_seqlens, shape, rng_state, call)
