"""flash_attn_with_kvcache: attention of a few new query tokens against a KV cache.

Routing, in order:
1. A generated module of kind `decode` that serves the call: the `attngen::decode`
   op, which appends k/v into the caches in place and attends (its contract: q [B, HQ, Nq, D],
   contiguous caches [B, HKV, L, D] or paged [pages, page_size, HKV, D], cache_seqlens int32).
2. Otherwise the varlen kind, reading the cache in place: the new k/v are appended with torch
   index writes, then each batch row b is one packed "sequence" whose keys start at row
   b * L of the flattened cache, and `seqused_k` = cache_seqlens + Nnew says how many are
   used. No host sync. Paged caches are gathered through block_table first (a copy).
   This is the route of specs built without the decode kind; split-KV decode (route 1) is
   where small-batch speed comes from (docs/performance.md). Calls with cache_batch_idx,
   cache_leftpad or num_splits=1 take it (kvcache_options.py: rotary, those, num_splits).
"""

from __future__ import annotations

import torch

from attngen.runtime import arguments, ops
from attngen.runtime.arguments import flash_mask, flash_refusal
from attngen.runtime.dispatch import need_for, probe
from attngen.runtime.kvcache_options import cache_options, key_layout, rotate
from attngen.runtime.launch import run_varlen
from attngen.runtime.selection import Dispatch
from attngen.runtime.validate import check_kvcache_shapes
from attngen.spec import CausalAlign, KernelKind, KvLayout, Mask


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    """flash-attn 2.x `flash_attn_with_kvcache`: q [B, Nq, HQ, D]; k_cache/v_cache
    [B, L, HKV, D] or, with block_table int32 [B, max_pages], paged [pages, page_size, HKV, D];
    k/v [B, Nnew, HKV, D] are written into the caches at cache_seqlens (int32 [B] or int;
    None: the caches are full) before attending. Causal is bottom-right aligned. Returns out
    [B, Nq, HQ, DV] (and lse [B, HQ, Nq] with return_softmax_lse). rotary_cos/rotary_sin,
    cache_batch_idx, cache_leftpad and num_splits 0 or 1 as flash-attn's (kvcache_options.py;
    num_splits above 1 is refused by name). The output is contiguous when the decode
    module writes it in place (Dispatch.writes_out), else a [B, Nq, HQ, DV] view of the
    kernel's [B, HQ, Nq, DV] output (no copy either way)."""
    check_kvcache_shapes(q, k_cache, v_cache, k, v, block_table,  # in the caller's layout
                         any_cache_batch=cache_batch_idx is not None)
    batch, seqlen_q = q.shape[0], q.shape[1]
    paged = block_table is not None
    capacity = (block_table.shape[1] * k_cache.shape[1]) if paged else k_cache.shape[1]
    options = cache_options(q, k, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad,
                            block_table, rotary_interleaved, num_splits, capacity)
    cache_seqlens = _seqlens(cache_seqlens, batch, capacity, q.device)
    mask, window = flash_mask(causal, window_size)
    q, k = rotate(q, k, options, cache_seqlens, mask is not Mask.none)
    refusal = flash_refusal(0.0, alibi_slopes)
    new = 0 if k is None else k.shape[1]
    decode = None if not options.decode_route else _decode_module(
        q, v_cache, mask, window, softcap, alibi_slopes, seqlen_q, capacity,
        KvLayout.paged if paged else KvLayout.contiguous, k_cache.shape[1] if paged else None)
    if decode is not None and refusal is None:
        out, lse = _run_decode_module(decode, q, k_cache, v_cache, k, v, cache_seqlens,
                                      block_table, arguments.softmax_scale(softmax_scale, q),
                                      alibi_slopes, return_softmax_lse)
        return (out, lse) if return_softmax_lse else out
    if k is not None:
        _append(k_cache, v_cache, k, v, cache_seqlens, block_table, options.batch_idx)
    if paged:  # only without a decode module, which reads the pages in place
        k_cache, v_cache = k_cache[block_table.long()], v_cache[block_table.long()]
    keys = k_cache.reshape(-1, *k_cache.shape[-2:])  # rows of B (or cache_batch_idx) x L
    values = v_cache.reshape(-1, *v_cache.shape[-2:])
    steps = torch.arange(batch + 1, device=q.device, dtype=torch.int32)
    starts_k, used_k = key_layout(options, steps, capacity, cache_seqlens + new)
    out, lse = run_varlen(
        "flash_attn_with_kvcache", q.reshape(batch * seqlen_q, *q.shape[2:]), keys, values,
        steps * seqlen_q, starts_k, seqlen_q, capacity, mask=mask,
        align=CausalAlign.bottom_right, window=window, softcap=softcap,
        alibi_slopes=alibi_slopes, scale=softmax_scale,
        return_lse=return_softmax_lse, fallback=None, refusal=refusal,
        seqused_k=used_k, length_bounds=(seqlen_q, capacity))
    out = out.view(batch, seqlen_q, *out.shape[1:])
    if not return_softmax_lse:
        return out
    return out, lse.view(lse.shape[0], batch, seqlen_q).transpose(0, 1)


def _run_decode_module(decode: Dispatch, q, k_cache, v_cache, k, v, cache_seqlens,
                       block_table, sm_scale: float, alibi_slopes, return_lse: bool):
    """(out [B, Nq, HQ, DV], lse or None) from the decode module, which appends k/v and
    reads the caches in place: the flash layout's [B, N, H, D] tensors are handed over as
    [B, H, N, D] views (paged caches as they are)."""
    def heads_first(t):
        return None if t is None else t.transpose(1, 2)

    assert decode.key is not None  # probe() answers served dispatches only
    caches = (k_cache, v_cache) if block_table is not None else (
        heads_first(k_cache), heads_first(v_cache))
    out, lse = ops.decode(decode.key, heads_first(q), *caches, cache_seqlens, block_table,
                          heads_first(k), heads_first(v), sm_scale, alibi_slopes, return_lse,
                          decode.writes_out)
    return (out if decode.writes_out else out.transpose(1, 2)), lse


def _seqlens(cache_seqlens, batch, capacity, device) -> torch.Tensor:
    if cache_seqlens is None:
        return torch.full((batch,), capacity, dtype=torch.int32, device=device)
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    if (not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.shape != (batch,)
            or cache_seqlens.dtype != torch.int32):
        got = (f"{tuple(cache_seqlens.shape)} {cache_seqlens.dtype}"
               if isinstance(cache_seqlens, torch.Tensor) else repr(cache_seqlens))
        raise ValueError(f"cache_seqlens: expected an int or int32 [{batch}], got {got}")
    return cache_seqlens


def _append(k_cache, v_cache, k, v, cache_seqlens, block_table, batch_idx=None) -> None:
    """Write k/v [B, Nnew, HKV, D] at positions cache_seqlens[b] + t of cache row
    batch_idx[b] (else b), in place."""
    positions = cache_seqlens.long()[:, None] + torch.arange(k.shape[1], device=k.device)
    if block_table is None:
        rows = (torch.arange(k.shape[0], device=k.device) if batch_idx is None
                else batch_idx.long())[:, None]
        k_cache[rows, positions] = k
        v_cache[rows, positions] = v
    else:
        page_size = k_cache.shape[1]
        pages = block_table.long().gather(1, positions // page_size)
        k_cache[pages, positions % page_size] = k
        v_cache[pages, positions % page_size] = v


def _decode_module(q, v_cache, mask, window, softcap, alibi_slopes, seqlen_q, capacity,
                   layout, page_size) -> Dispatch | None:
    """The decode-kind module that serves the call, recorded, or None (then step 2)."""
    need = need_for(KernelKind.decode, q, v_cache, mask=mask, align=CausalAlign.bottom_right,
                    window=window, softcap=softcap, alibi=alibi_slopes is not None,
                    seqlen_q=seqlen_q, seqlen_k=capacity, same_lengths=False,
                    kv_layout=layout, page_size=page_size)
    return probe("flash_attn_with_kvcache", need, (q.shape[2], v_cache.shape[2]))
