"""Shape checks in the caller's layout, before any transpose: an error names the tensor, the
layout the caller passes (flash-attn's [batch, seqlen, nheads, headdim]), what was expected and
what was given, never the [B, H, N, D] layout the kernels are called with.

A call that passes is checked once, by comparisons only; the checks that name what is wrong
(and build the message) run only when one fails."""

from __future__ import annotations

import torch


def check_kvcache_shapes(
    q, k_cache, v_cache, k, v, block_table, any_cache_batch: bool = False
) -> None:
    """flash_attn_with_kvcache's tensors: q [B, Nq, HQ, D]; caches [B, L, HKV, D] (any
    number of rows with any_cache_batch: cache_batch_idx picks them; or pages
    [num_pages, page_size, HKV, D] with block_table int32 [B, max_pages]); k/v
    [B, Nnew, HKV, D/DV]; one dtype and device; HQ a multiple of HKV."""
    if not _kvcache_shapes_ok(q, k_cache, v_cache, k, v, block_table, any_cache_batch):
        _name_kvcache_problem(q, k_cache, v_cache, k, v, block_table, any_cache_batch)


def _kvcache_shapes_ok(q, k_cache, v_cache, k, v, block_table, any_cache_batch) -> bool:
    """The success path of check_kvcache_shapes: True only when every check of
    _name_kvcache_problem passes."""
    tensor = torch.Tensor
    if not (
        type(q) is tensor
        and type(k_cache) is tensor
        and type(v_cache) is tensor
        and q.dim() == 4
        and k_cache.dim() == 4
        and v_cache.dim() == 4
    ):
        return False
    batch, _, heads_q, dim = q.shape
    outer, rows, heads_kv, dim_k = k_cache.shape
    if block_table is None:
        if outer != batch and not any_cache_batch:
            return False
    elif not (
        type(block_table) is tensor
        and block_table.dim() == 2
        and block_table.shape[0] == batch
        and block_table.dtype == torch.int32
    ):
        return False
    dtype, device = q.dtype, q.device
    if not (
        dim_k == dim
        and v_cache.shape[:3] == k_cache.shape[:3]
        and heads_kv != 0
        and heads_q % heads_kv == 0
        and k_cache.dtype == dtype
        and v_cache.dtype == dtype
        and k_cache.device == device
        and v_cache.device == device
    ):
        return False
    if k is None and v is None:
        return True
    return (
        type(k) is tensor
        and type(v) is tensor
        and k.dim() == 4
        and v.dim() == 4
        and k.shape[0] == batch
        and k.shape[2] == heads_kv
        and k.shape[3] == dim
        and v.shape[:3] == k.shape[:3]
        and v.shape[3] == v_cache.shape[3]
        and k.dtype == dtype
        and v.dtype == dtype
        and k.device == device
        and v.device == device
    )


def _name_kvcache_problem(q, k_cache, v_cache, k, v, block_table, any_cache_batch) -> None:
    """Raise the error naming the first tensor check_kvcache_shapes refuses."""
    _rank4("q", q, "[batch, seqlen_q, nheads, headdim]")
    batch, _, heads_q, dim = q.shape
    paged = block_table is not None
    cache_layout = (
        "[num_blocks, page_block_size, nheads_k, headdim]"
        if paged
        else "[batch, seqlen_cache, nheads_k, headdim]"
    )
    _rank4("k_cache", k_cache, cache_layout)
    _rank4("v_cache", v_cache, cache_layout.replace("headdim]", "headdim_v]"))
    outer, rows, heads_kv, _ = k_cache.shape
    if paged:
        if (
            not isinstance(block_table, torch.Tensor)
            or block_table.dim() != 2
            or block_table.shape[0] != batch
            or block_table.dtype != torch.int32
        ):
            raise ValueError(
                f"block_table: expected an int32 tensor [batch={batch}, "
                f"max_num_blocks_per_seq], got {_describe(block_table)}"
            )
    elif outer != batch and not any_cache_batch:
        raise ValueError(
            f"k_cache: expected [batch={batch}, seqlen_cache, nheads_k, "
            f"headdim={dim}] (batch as q's, or pass cache_batch_idx), "
            f"got {list(k_cache.shape)}"
        )
    _expect("k_cache", k_cache, [outer, rows, heads_kv, dim], cache_layout)
    _expect(
        "v_cache",
        v_cache,
        [outer, rows, heads_kv, None],
        cache_layout.replace("headdim]", "headdim_v]"),
    )
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(
            f"nheads: q has {heads_q} heads (dim 2) and k_cache {heads_kv}; q's "
            "must be a multiple of k_cache's (grouped-query attention)"
        )
    if (k is None) != (v is None):
        raise ValueError("k, v: pass both new keys and values, or neither")
    if k is not None:
        _rank4("k", k, "[batch, seqlen_new, nheads_k, headdim]")
        _expect("k", k, [batch, None, heads_kv, dim], "[batch, seqlen_new, nheads_k, headdim]")
        _expect(
            "v",
            v,
            [batch, k.shape[1], heads_kv, v_cache.shape[3]],
            "[batch, seqlen_new, nheads_k, headdim_v]",
        )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if t is not None and (t.dtype != q.dtype or t.device != q.device):
            raise ValueError(
                f"{name}: expected dtype {q.dtype} on device {q.device} (as q), got "
                f"dtype {t.dtype} on device {t.device}"
            )


def _rank4(name, t, layout) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        raise ValueError(f"{name}: expected a rank-4 tensor {layout}, got {_describe(t)}")


def _expect(name, t, sizes, layout) -> None:
    if any(want is not None and want != got for want, got in zip(sizes, t.shape, strict=True)):
        wanted = "[" + ", ".join("*" if n is None else str(n) for n in sizes) + "]"
        raise ValueError(f"{name}: expected {wanted} ({layout}), got {list(t.shape)}")


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{list(t.shape)} {t.dtype}"
    return type(t).__name__
