"""The K/V cache's rows: flash_attn_with_kvcache's cache_seqlens as an int32 tensor, and for
route 2 (kvcache.py) which sequences' requests fit their cache, decided on the device without
a host sync (ATTNGEN_CHECKS=1: on the host, as a ValueError), and the append of the new keys
for those that fit, with torch index writes, in place.

Paged K/V for flash_attn_varlen_func: flash-attn's block_table read by gathering pages.
"""

from __future__ import annotations

import os

import torch

from attngen.runtime.kvcache_options import CacheOptions


def paged_keys(k_cache, v_cache, block_table, cu_seqlens_k, q):
    """(keys, values, cu_seqlens_k, seqused_k, capacity) of the varlen kind over paged caches
    k_cache/v_cache [pages, page_size, HKV, D]: sequence b's pages block_table[b] gathered
    into rows [b * capacity, (b + 1) * capacity), capacity = max_pages * page_size, and
    seqused_k[b] its length cu_seqlens_k[b + 1] - cu_seqlens_k[b], or -1 (NaN for it) when
    that length is negative or past the capacity, or a page it needs is not the cache's.
    No host sync: every check is a tensor operation."""
    _check_paged_inputs(k_cache, v_cache, block_table, cu_seqlens_k, q)
    batch, max_pages = block_table.shape
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    capacity = max_pages * page_size
    lengths = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
    fits = (lengths >= 0) & (lengths <= capacity)
    ends = torch.where(fits, lengths, 0)
    fits = fits & pages_in_cache(block_table, torch.zeros_like(ends), ends, num_pages, page_size)
    pages = block_table.long().clamp(0, num_pages - 1)  # a bad entry is read nowhere that counts
    keys = k_cache[pages].reshape(batch * capacity, *k_cache.shape[2:])
    values = v_cache[pages].reshape(batch * capacity, *v_cache.shape[2:])
    starts = torch.arange(batch + 1, device=q.device, dtype=torch.int32) * capacity
    used = torch.where(fits, lengths, -1).to(torch.int32)
    return keys, values, starts, used, capacity


def _check_paged_inputs(k_cache, v_cache, block_table, cu_seqlens_k, q) -> None:
    """k/v: paged caches [pages, page_size, HKV, D] of one shape, at least one page;
    block_table int32 [B, max_pages] on q's device; cu_seqlens_k int32 [B + 1]."""
    for name, cache in (("k", k_cache), ("v", v_cache)):
        if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
            got = tuple(cache.shape) if isinstance(cache, torch.Tensor) else type(cache).__name__
            layout = "a paged cache [pages, page_size, HKV, D]"
            raise ValueError(f"{name}: with block_table, expected {layout}, got {got}")
    if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[0] == 0:
        raise ValueError(
            f"k, v: expected paged caches with the same (pages, page_size, HKV), "
            f"at least one page, got {tuple(k_cache.shape)} and "
            f"{tuple(v_cache.shape)}"
        )
    if (
        not isinstance(block_table, torch.Tensor)
        or block_table.dim() != 2
        or block_table.dtype != torch.int32
        or block_table.device != q.device
    ):
        got = (
            f"{tuple(block_table.shape)} {block_table.dtype} on {block_table.device}"
            if isinstance(block_table, torch.Tensor)
            else type(block_table).__name__
        )
        raise ValueError(
            f"block_table: expected an int32 tensor [B, max_pages] on {q.device}, got {got}"
        )
    if (
        not isinstance(cu_seqlens_k, torch.Tensor)
        or cu_seqlens_k.dtype != torch.int32
        or cu_seqlens_k.shape != (block_table.shape[0] + 1,)
    ):
        got = (
            f"{tuple(cu_seqlens_k.shape)} {cu_seqlens_k.dtype}"
            if isinstance(cu_seqlens_k, torch.Tensor)
            else type(cu_seqlens_k).__name__
        )
        raise ValueError(
            f"cu_seqlens_k: expected int32 [{block_table.shape[0] + 1}] (one more "
            f"than block_table's rows), got {got}"
        )


def pages_in_cache(block_table, first_key, end_key, num_pages: int, page_size: int):
    """[B] bool: every block-table entry of row b that holds keys [first_key[b], end_key[b])
    is a page of the cache, [0, num_pages). No host sync."""
    page = torch.arange(block_table.shape[1], device=block_table.device)[None, :]
    needed = (page >= (first_key // page_size)[:, None]) & (page * page_size < end_key[:, None])
    entries = block_table.long()
    return ~(needed & ((entries < 0) | (entries >= num_pages))).any(1)


def cache_seqlens_tensor(cache_seqlens, batch, capacity, new, device) -> torch.Tensor:
    """cache_seqlens as int32 [B]; what the host can tell without reading the device is
    checked here (a device tensor is bounded by the kernels, or by _fits)."""
    if cache_seqlens is None:
        if new:
            raise ValueError(
                "cache_seqlens: required with new keys k, v (None means the caches "
                "are full, so there is no room to append), as in flash-attn"
            )
        return torch.full((batch,), capacity, dtype=torch.int32, device=device)
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if not 0 <= cache_seqlens <= capacity - new:
            raise ValueError(
                f"cache_seqlens: got {cache_seqlens}; allowed: 0..{capacity - new} "
                f"(the cache's capacity {capacity} less {new} new keys)"
            )
        return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    if (
        not isinstance(cache_seqlens, torch.Tensor)
        or cache_seqlens.shape != (batch,)
        or cache_seqlens.dtype != torch.int32
    ):
        got = (
            f"{tuple(cache_seqlens.shape)} {cache_seqlens.dtype}"
            if isinstance(cache_seqlens, torch.Tensor)
            else repr(cache_seqlens)
        )
        raise ValueError(f"cache_seqlens: expected an int or int32 [{batch}], got {got}")
    if new > capacity:
        raise ValueError(f"k: {new} new keys exceed the cache's capacity {capacity}")
    return cache_seqlens


def append_fitting(
    k_cache, v_cache, k, v, cache_seqlens, block_table, capacity: int, seqlen_q: int, window,
    options: CacheOptions,
):  # fmt: skip
    """[B] bool, which sequences fit (_fits), after appending k/v [B, Nnew, HKV, D] for those;
    ATTNGEN_CHECKS=1 refuses a sequence that does not fit first (_validate)."""
    new = 0 if k is None else k.shape[1]
    fits = _fits(cache_seqlens, new, capacity, block_table, k_cache, seqlen_q, window, options)
    if os.environ.get("ATTNGEN_CHECKS") == "1":
        _validate(cache_seqlens, new, capacity, block_table, k_cache, seqlen_q, window, options)
    if new and cache_seqlens.shape[0]:  # cache_seqlens is [B] (cache_seqlens_tensor)
        _append(k_cache, v_cache, k, v, cache_seqlens, block_table, fits, options.batch_idx)
    return fits


def _fits(
    cache_seqlens, new, capacity, block_table, k_cache, seqlen_q, window, options: CacheOptions
):
    """[B] bool, without a host sync: sequence b's request fits its memory, as the decode
    kernels decide it (they give the others NaN): 0 <= cache_seqlens[b] <= capacity - new,
    cache_batch_idx[b] a row of the cache, 0 <= cache_leftpad[b] <= cache_seqlens[b], and
    every block-table entry it appends to or reads (from the window's first key) is a page."""
    cached = cache_seqlens.long()
    fits = (cached >= 0) & (cached <= capacity - new)
    if options.batch_idx is not None:
        rows = options.batch_idx.long()
        fits = fits & (rows >= 0) & (rows < k_cache.shape[0])
    if options.leftpad is not None:
        pad = options.leftpad.long()
        fits = fits & (pad >= 0) & (pad <= cached)
    if block_table is None:
        return fits
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    total = torch.where(fits, cached + new, 0)
    first = torch.zeros_like(total)
    if window is not None:  # keys left of every query's window are never read
        first = (total - seqlen_q - window[0]).clamp(min=0)
    first = torch.minimum(first, torch.where(fits, cached, 0))  # the appended keys count too
    return fits & pages_in_cache(block_table, first, total, num_pages, page_size)


def _validate(
    cache_seqlens, new, capacity, block_table, k_cache, seqlen_q, window, options: CacheOptions
) -> None:
    """ATTNGEN_CHECKS=1: what _fits decides, on the host (a device sync), as a ValueError
    naming the tensor, the sequence and the value (as the generated decode modules do)."""
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    lengths = cache_seqlens.tolist()
    for b, cached in enumerate(lengths):
        if not 0 <= cached <= capacity - new:
            raise ValueError(
                f"cache_seqlens[{b}] = {cached}: expected 0..{capacity - new} "
                f"(the capacity {capacity} less {new} new keys)"
            )
    for name, index, high in (
        ("cache_batch_idx", options.batch_idx, k_cache.shape[0] - 1),
        ("cache_leftpad", options.leftpad, None),
    ):
        for b, value in enumerate([] if index is None else index.tolist()):
            top = lengths[b] if high is None else high
            if not 0 <= value <= top:
                what = f"cache_seqlens[{b}]" if high is None else "the cache's last row"
                raise ValueError(f"{name}[{b}] = {value}: expected 0..{top} ({what})")
    table = [] if block_table is None else block_table.tolist()
    for b, row in enumerate(table):
        total = lengths[b] + new
        first = 0 if window is None else min(max(total - seqlen_q - window[0], 0), lengths[b])
        for page in range(first // page_size, -(-total // page_size)):
            if not 0 <= row[page] < num_pages:
                raise ValueError(
                    f"block_table[{b}, {page}] = {row[page]}: expected a page in "
                    f"0..{num_pages - 1} (sequence {b} reads or appends there)"
                )


def _append(k_cache, v_cache, k, v, cache_seqlens, block_table, fits, batch_idx=None) -> None:
    """Write k/v [B, Nnew, HKV, D] at positions cache_seqlens[b] + t of cache row
    batch_idx[b] (else b), in place, for the sequences that fit (_fits); nothing else
    changes.

    Note: without a host sync the write cannot skip the others, so each of their tokens is
    pointed at the first fitting token's slot and writes the same bytes as that token (or,
    when none fits, slot 0 of the cache gets its own bytes back): repeated indices with equal
    values, so the result is deterministic and no other byte changes."""
    batch, new = k.shape[0], k.shape[1]
    ok = fits[:, None].expand(batch, new).reshape(-1)
    positions = cache_seqlens.long()[:, None] + torch.arange(new, device=k.device)
    positions = torch.where(fits[:, None], positions, 0)  # in range: an index never faults
    if block_table is None:
        rows = (
            torch.arange(batch, device=k.device)
            if batch_idx is None
            else batch_idx.long().clamp(0, k_cache.shape[0] - 1)
        )  # bad rows: see _fits
        outer = rows[:, None].expand(batch, new)
        inner = positions
    else:
        page_size = k_cache.shape[1]
        outer = block_table.long().gather(1, positions // page_size)
        outer = outer.clamp(0, k_cache.shape[0] - 1)
        inner = positions % page_size
    first = ok.int().argmax(0, keepdim=True)  # [1]: the first fitting token, 0 if none
    any_ok = ok.any()
    outer, inner = outer.reshape(-1), inner.reshape(-1)
    spare_outer = torch.where(any_ok, outer.index_select(0, first), 0)
    spare_inner = torch.where(any_ok, inner.index_select(0, first), 0)
    outer = torch.where(ok, outer, spare_outer)
    inner = torch.where(ok, inner, spare_inner)
    for cache, values in ((k_cache, k), (v_cache, v)):
        values = values.reshape(batch * new, *values.shape[2:])
        spare = torch.where(any_ok, values.index_select(0, first), cache[spare_outer, spare_inner])
        cache[outer, inner] = torch.where(ok[:, None, None], values, spare)
