"""Paged K/V for flash_attn_varlen_func: flash-attn's block_table read by gathering pages."""

from __future__ import annotations

import torch


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
            raise ValueError(
                f"{name}: with block_table, expected a paged cache [pages, "
                f"page_size, HKV, D], got {got}"
            )
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
