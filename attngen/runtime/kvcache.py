"""flash_attn_with_kvcache: attention of a few new query tokens against a KV cache.

Routing, in order (docs/integration.md, "SDPA-shaped and flash-attn functions"):
1. A generated module of kind `decode` that serves the call: the `attngen::decode` op, which
   appends k/v into the caches in place and attends; an eager call hands the caller's
   tensors as they are to the module's `decode_flash` (flash-attn's layouts in and out).
   Its kernels rotate q and the appended keys (rotary).
2. Otherwise the varlen kind, reading the cache in place: the new k/v appended with torch
   index writes, each batch row one packed sequence starting at row b * L of the flattened
   cache, with `seqused_k` = cache_seqlens + Nnew (-1 for a sequence that does not fit: NaN,
   nothing written). No host sync; paged caches gathered through block_table first (a copy);
   rotary applied in torch first. Calls with cache_batch_idx or cache_leftpad take it
   (kvcache_options.py); num_splits is a hint there, as in flash-attn.

A decode step whose signature route 1 served before runs from its plan (plans.py): the key
holds every shape and option the checks decide with (num_splits, rotary's shapes and flag,
the caches' dtype and which fp8 descales are given), the other tensors' dtypes and devices
are compared on each call (kvcache_options.same_kinds), and calls with cache_batch_idx,
cache_leftpad or an int cache_seqlens (value checks) always take the full path.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from attngen.runtime import arguments, decode_ops, plans
from attngen.runtime.arguments import check_kvcache_shapes, flash_mask
from attngen.runtime.decode_ops import heads_first
from attngen.runtime.dispatch import Call, probe
from attngen.runtime.fallback import check_alibi
from attngen.runtime.kvcache_append import append_fitting, cache_seqlens_tensor
from attngen.runtime.kvcache_options import (
    CacheOptions,
    cache_options,
    check_tree,
    fp8_cache,
    fused_rotary,
    given_keywords,
    key_layout,
    plain_step,
    planned_keywords,
    refuse_fp8_without_module,
    rotary_key,
    rotate,
    same_kinds,
)
from attngen.runtime.launch import run_varlen, varlen_dispatch
from attngen.runtime.selection import Dispatch
from attngen.spec import CausalAlign, KernelKind, KvDtype, KvLayout, Mask

API = "flash_attn_with_kvcache"


def flash_attn_with_kvcache(
    q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
    cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
    window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
    return_softmax_lse=False, k_descale=None, v_descale=None, tree_mask=None,
):  # fmt: skip
    """flash-attn 2.x `flash_attn_with_kvcache`: q [B, Nq, HQ, D]; k_cache/v_cache [B, L, HKV, D]
    or, with block_table int32 [B, max_pages], paged [pages, page_size, HKV, D]; new keys k/v
    [B, Nnew, HKV, D] are written into the caches at cache_seqlens (int32 [B] or int; None: full
    caches, so not with k/v) before attending. Causal is bottom-right aligned. Returns out
    [B, Nq, HQ, DV] (and lse [B, HQ, Nq] with return_softmax_lse): contiguous, or a view of the
    kernel's [B, HQ, Nq, DV] output (no copy). rotary_*, cache_batch_idx, cache_leftpad,
    num_splits (flash-attn's), k_descale/v_descale (FA3's), tree_mask (attngen's draft trees):
    kvcache_options.py. Bad index tensors: NaN for their sequence (generated_modules.md)."""
    key = None
    if (
        type(cache_seqlens) is Tensor
        and plans.grad_mode(q, k_cache, v_cache, alibi_slopes) is False
        and plain_step(
            k, v, block_table, num_splits, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad
        )
        and plans.plain(softmax_scale, softcap)
        and type(causal) is bool
        and plans.pair(window_size)
        and type(return_softmax_lse) is bool
        and tree_mask is None
    ):
        key = (
            API, q.shape, k_cache.shape, v_cache.shape, None if k is None else k.shape,
            None if v is None else v.shape, cache_seqlens.shape,
            None if block_table is None else block_table.shape, q.dtype, q.device, causal,
            window_size, softcap, softmax_scale, plans.slopes_rank(alibi_slopes),
            return_softmax_lse, rotary_key(rotary_cos, rotary_sin, rotary_interleaved),
            k_cache.dtype, k_descale is None, v_descale is None, num_splits,
        )  # fmt: skip
        ran = _run_planned(
            plans.find(key), q, k_cache, v_cache, k, v, cache_seqlens, block_table, alibi_slopes,
            num_splits, planned_keywords(rotary_cos, rotary_sin, rotary_interleaved, causal,
                                         window_size, k_descale, v_descale),
        )  # fmt: skip
        if ran is not None:
            return ran if return_softmax_lse else ran[0]
    cache = (k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale, v_descale, tree_mask)
    step = (rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, rotary_interleaved, num_splits)
    flash = (softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax_lse)
    return _unplanned(q, cache, step, flash, key)


def _unplanned(q, cache: tuple, step: tuple, flash: tuple, key: tuple | None):
    """flash_attn_with_kvcache's full path: its checks, its Call, then the decode module
    (route 1) or the varlen route (route 2; not for fp8 caches). cache: (k_cache, v_cache, k,
    v, cache_seqlens, block_table, k_descale, v_descale, tree_mask); step: (rotary_cos, rotary_sin,
    cache_batch_idx, cache_leftpad, rotary_interleaved, num_splits); flash: (softmax_scale,
    causal, window_size, softcap, alibi_slopes, return_softmax_lse), as the caller gave them."""
    k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale, v_descale, tree_mask = cache
    fp8 = fp8_cache(k_cache, k_descale, v_descale)
    rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, rotary_interleaved, num_splits = step
    softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax_lse = flash
    # in the caller's layout
    check_kvcache_shapes(
        q, k_cache, v_cache, k, v, block_table, cache_batch_idx is not None, fp8 and k_cache.dtype
    )
    capacity = _capacity(k_cache, block_table)
    options = cache_options(
        q, k, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table,
        rotary_interleaved, num_splits, capacity,
    )  # fmt: skip
    new = 0 if k is None else k.shape[1]
    cache_seqlens = cache_seqlens_tensor(cache_seqlens, q.shape[0], capacity, new, q.device)
    mask, window = flash_mask(causal, window_size)
    align = CausalAlign.bottom_right
    call = Call(mask, align, window, softcap, alibi_slopes, softmax_scale, return_softmax_lse)
    decode = (
        _decode_module(q, k_cache, v_cache, block_table, call, capacity)
        if options.decode_route
        else None
    )
    check_tree(tree_mask, decode, options.rotary, alibi_slopes)
    if fp8:  # planned as others: the key holds the caches' dtype and which descales are given
        refuse_fp8_without_module(decode, q, k_cache, block_table)
    rotary = fused_rotary(options, decode, mask is not Mask.none)
    if rotary is None and options.rotary is not None:  # rotated in torch: no plan for the call
        q, k = rotate(q, k, options, cache_seqlens, mask is not Mask.none)
        key = None
    cache = (k_cache, v_cache, k, v, cache_seqlens, block_table)
    if decode is not None:
        extra = {**(rotary or {}), **given_keywords(k_descale, v_descale, tree_mask)}
        out, lse = _run_decode_module(decode, q, *cache, call, key, num_splits, extra)
    else:
        out, lse = _run_varlen_route(q, *cache, options, capacity, call)
    return (out, lse) if return_softmax_lse else out


def _capacity(k_cache, block_table) -> int:
    """How many keys each sequence's cache holds: L, or max_pages x page_size when paged (a
    paged cache needs at least one page)."""
    if block_table is None:
        return k_cache.shape[1]
    if k_cache.shape[0] == 0:
        shape = tuple(k_cache.shape)
        raise ValueError(f"k_cache: a paged cache needs at least one page, got shape {shape}")
    return block_table.shape[1] * k_cache.shape[1]


def _run_varlen_route(
    q, k_cache, v_cache, k, v, cache_seqlens, block_table, options: CacheOptions, capacity: int,
    call: Call,
):  # fmt: skip
    """Route 2: append with torch (only the sequences that fit), then the varlen kind over
    the cache rows in place (paged or cache_batch_idx rows gathered first: a copy)."""
    batch, seqlen_q = q.shape[0], q.shape[1]
    new = 0 if k is None else k.shape[1]
    packed_q = q.reshape(batch * seqlen_q, *q.shape[2:])
    dispatch = _varlen_module(packed_q, q, k_cache, v_cache, call, capacity)
    call = replace(call, scale=arguments.softmax_scale(call.scale, q))  # checked before the append
    fits = append_fitting(
        k_cache, v_cache, k, v, cache_seqlens, block_table, capacity, seqlen_q, call.window, options
    )
    keys, values = _cache_rows(k_cache, v_cache, block_table, options)
    steps = torch.arange(batch + 1, device=q.device, dtype=torch.int32)
    starts_k, used_k = key_layout(options, steps, capacity, cache_seqlens + new)
    out, lse = run_varlen(
        API, packed_q, keys, values, steps * seqlen_q, starts_k, seqlen_q, capacity, call,
        seqused_k=torch.where(fits, used_k, -1).to(torch.int32), dispatch=dispatch,
    )  # fmt: skip
    out = out.view(batch, seqlen_q, *out.shape[1:])
    return out, (None if lse is None else lse.view(lse.shape[0], batch, seqlen_q).transpose(0, 1))


def _varlen_module(packed_q, q, k_cache, v_cache, call: Call, capacity: int) -> Dispatch:
    """Route 2's varlen module (or fallback), chosen or refused before the append, and the
    alibi slopes checked then too: a refused call leaves the caches as they were."""
    batch, seqlen_q = q.shape[0], q.shape[1]
    bounds, heads = (seqlen_q, capacity), (q.shape[2], k_cache.shape[2])
    dispatch = varlen_dispatch(API, packed_q, v_cache, call, bounds, False, None, heads)
    # What the module (or the fallback) would refuse after the append, refused before it.
    check_alibi(call.alibi_slopes, packed_q, batch=batch)
    return dispatch


def _cache_rows(k_cache, v_cache, block_table, options: CacheOptions) -> tuple[Tensor, Tensor]:
    """The caches as packed key and value rows [B x L, HKV, D], sequence b's from row b * L:
    paged caches gathered through block_table, cache_batch_idx rows gathered (copies), else
    the caches themselves, reshaped."""
    if block_table is not None:  # only without a decode module, which reads pages in place
        pages = block_table.long().clamp(0, k_cache.shape[0] - 1)  # bad entries: kvcache_append
        k_cache, v_cache = k_cache[pages], v_cache[pages]
    elif options.batch_idx is not None:  # sequence b reads row cache_batch_idx[b]
        rows = options.batch_idx.long().clamp(0, k_cache.shape[0] - 1)  # bad rows: kvcache_append
        k_cache, v_cache = k_cache[rows], v_cache[rows]
    return k_cache.reshape(-1, *k_cache.shape[-2:]), v_cache.reshape(-1, *v_cache.shape[-2:])


def _run_decode_module(
    decode: Dispatch, q, k_cache, v_cache, k, v, cache_seqlens, block_table, call: Call,
    plan_key: tuple | None, num_splits: int, keywords: dict | None,
):  # fmt: skip
    """(out [B, Nq, HQ, DV], lse or None) from the decode module, which appends k/v and
    reads the caches in place: the flash layout's [B, N, H, D] tensors are handed as they are
    to its decode_flash (a module built before it gets [B, H, N, D] views: paged caches as
    they are; decode_ops.decode's flash_layout). The route is kept as the plan of `plan_key`
    (plans.py); num_splits: the call's (checked by cache_options); keywords: the module's rotary
    arguments when its kernels rotate (fused_rotary), and an fp8 cache's descales."""
    assert decode.key is not None  # probe() answers served dispatches only
    sm_scale = arguments.softmax_scale(call.scale, q)
    # the caller's [B, Nq, HQ, DV] output is written in place through the module's
    # decode_flash (every decode module has it: the registry's header check)
    in_place = decode.writes_out
    out, lse = decode_ops.decode(
        decode.key, q, k_cache, v_cache, cache_seqlens, block_table, k, v, sm_scale,
        call.alibi_slopes, call.return_lse, in_place, num_splits=num_splits,
        **(keywords or {}), flash_layout=True,
    )  # fmt: skip
    plans.remember(plan_key, decode, sm_scale, call.return_lse, in_place)
    return (out if in_place else out.transpose(1, 2)), lse


def _run_planned(
    plan: plans.Plan | None, q, k_cache, v_cache, k, v, cache_seqlens, block_table, alibi_slopes,
    num_splits: int, rotary: dict | None,
):  # fmt: skip
    """_run_decode_module from the signature's plan (plans.py): the tensors as they are to
    decode_flash when the plan writes through it, else [B, H, N, D] views; None without a
    plan, when a check its key leaves open fails (the full path then says what) or when the
    device refuses now. rotary: planned_keywords' (rotary's and the given descales)."""
    if plan is None or not same_kinds(
        q, k_cache, v_cache, k, v, cache_seqlens, block_table, rotary
    ):
        return None
    if not plan.flash_entry:
        q, k_cache, v_cache, k, v = heads_first(q, k_cache, v_cache, k, v, block_table)
    ran = plans.run_decode(
        plan, q, k_cache, v_cache, cache_seqlens, block_table, k, v, alibi_slopes, num_splits,
        rotary,
    )  # fmt: skip
    if ran is None:
        return None
    return (ran[0] if plan.in_place else ran[0].transpose(1, 2)), ran[1]


def _decode_module(q, k_cache, v_cache, block_table, call: Call, capacity: int) -> Dispatch | None:
    """The decode-kind module that serves the call, recorded, or None (then step 2)."""
    paged = block_table is not None
    layout = KvLayout.paged if paged else KvLayout.contiguous
    page_size = k_cache.shape[1] if paged else None
    lengths = (q.shape[1], capacity)
    kv_dtype = KvDtype.fp8_e4m3 if k_cache.dtype is torch.float8_e4m3fn else None
    need = call.need(
        KernelKind.decode, q, v_cache, lengths, False, kv_layout=layout, page_size=page_size,
        kv_dtype=kv_dtype,
    )  # fmt: skip
    return probe(API, need, (q.shape[2], v_cache.shape[2]))
