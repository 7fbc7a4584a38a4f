"""Helpers for the decode tests: specs, KV caches (contiguous or paged, poisoned where unused),
and the float64 reference built by gathering each sequence's keys into a dense tensor.

The reference for sequence b is prefill attention of its NQ queries over its L_b keys with the
spec's mask aligned bottom-right (the decode step's queries are the last tokens), judged by
attngen.reference.compare_to_reference (shared/RELIABILITY.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attngen.reference import compare_to_reference
from attngen.spec import AttnSpec, KernelKind
from tests.kernel_harness import TORCH_DTYPES, load_kernel, make_spec

DECODE = KernelKind.decode


def make_decode_spec(layout: str = "paged", page_size: int | None = 16, **fields) -> AttnSpec:
    fields.setdefault("kernels", ["prefill", "decode"])
    fields["kv_layout"] = layout
    if layout == "paged":
        fields["page_size"] = page_size
    return make_spec(**fields)


def load_decode(spec: AttnSpec, block_n: int | None = None, arch: str = "sm90"):
    return load_kernel(spec, None, block_n, arch, DECODE)


@dataclass
class Cache:
    """A KV cache holding `lengths[b]` keys per sequence, and room for `room` more each."""

    k: torch.Tensor
    v: torch.Tensor
    block_table: torch.Tensor | None
    lengths: torch.Tensor  # int32 [B]: cache_seqlens
    dense_k: list[torch.Tensor]  # per sequence [HKV, L_b, D]: what the cache holds
    dense_v: list[torch.Tensor]

    def to(self, device) -> Cache:
        table = None if self.block_table is None else self.block_table.to(device)
        return Cache(
            self.k.to(device),
            self.v.to(device),
            table,
            self.lengths.to(device),
            self.dense_k,
            self.dense_v,
        )

    def clone(self) -> Cache:
        table = None if self.block_table is None else self.block_table.clone()
        return Cache(
            self.k.clone(), self.v.clone(), table, self.lengths.clone(), self.dense_k, self.dense_v
        )


def make_cache(
    spec: AttnSpec,
    lengths: list[int],
    *,
    seed: int,
    room: int = 0,
    num_kv_heads: int | None = None,
    fill: float = float("nan"),
    extra_capacity: int = 5,
) -> Cache:
    """Random keys for each sequence's first lengths[b] positions; every other slot (past the
    length, free slots of used pages, unused pages, the page unused block-table entries point
    at) holds `fill`. Pages are assigned in a shuffled order."""
    gen = torch.Generator().manual_seed(seed)
    dtype = TORCH_DTYPES[spec.dtype.value]
    hkv = num_kv_heads or spec.num_kv_heads
    d, dv = spec.head_dim, spec.value_head_dim
    batch = len(lengths)
    dense_k = [torch.randn(hkv, n, d, generator=gen).to(dtype) for n in lengths]
    dense_v = [torch.randn(hkv, n, dv, generator=gen).to(dtype) for n in lengths]
    capacity = max([n + room for n in lengths], default=0) + extra_capacity
    if spec.kv_layout.value == "contiguous":
        k = torch.full((batch, hkv, capacity, d), fill, dtype=dtype)
        v = torch.full((batch, hkv, capacity, dv), fill, dtype=dtype)
        for b, n in enumerate(lengths):
            k[b, :, :n], v[b, :, :n] = dense_k[b], dense_v[b]
        table = None
    else:
        page = spec.page_size
        max_pages = -(-capacity // page)
        needed = [-(-(n + room) // page) for n in lengths]
        num_pages = sum(needed) + 2  # two pages nobody owns; one is what unused entries name
        order = torch.randperm(num_pages, generator=gen).to(torch.int32)
        k = torch.full((num_pages, page, hkv, d), fill, dtype=dtype)
        v = torch.full((num_pages, page, hkv, dv), fill, dtype=dtype)
        table = torch.full((batch, max_pages), int(order[-1]), dtype=torch.int32)
        used = 0
        for b, n in enumerate(lengths):
            table[b, : needed[b]] = order[used : used + needed[b]]
            used += needed[b]
            pos = torch.arange(n)
            pages, slots = table[b, pos // page].long(), pos % page
            k[pages, slots] = dense_k[b].transpose(0, 1)
            v[pages, slots] = dense_v[b].transpose(0, 1)
    return Cache(k, v, table, torch.tensor(lengths, dtype=torch.int32), dense_k, dense_v)


def make_queries(
    spec: AttnSpec,
    batch: int,
    num_q_tokens: int,
    *,
    seed: int,
    num_q_heads: int | None = None,
    num_new: int = 0,
    num_kv_heads: int | None = None,
    scale: float = 1.0,
):
    """q [B, HQ, NQ, D], new keys/values [B, HKV, NNEW, D] (None when NNEW is 0), slopes."""
    gen = torch.Generator().manual_seed(seed + 7919)
    dtype = TORCH_DTYPES[spec.dtype.value]
    hq, hkv = num_q_heads or spec.num_q_heads, num_kv_heads or spec.num_kv_heads
    q = (torch.randn(batch, hq, num_q_tokens, spec.head_dim, generator=gen) * scale).to(dtype)
    k_new = v_new = None
    if num_new:
        k_new = torch.randn(batch, hkv, num_new, spec.head_dim, generator=gen).to(dtype)
        v_new = torch.randn(batch, hkv, num_new, spec.value_head_dim, generator=gen).to(dtype)
    slopes = None
    if spec.alibi:
        slopes = 2.0 ** (-8.0 * torch.arange(1, hq + 1, dtype=torch.float32) / hq)
    return q, k_new, v_new, slopes


def run_decode(kernel, cache: Cache, q, k_new=None, v_new=None, slopes=None, **kwargs):
    return kernel.decode(
        q,
        cache.k,
        cache.v,
        cache.lengths,
        block_table=cache.block_table,
        k_new=k_new,
        v_new=v_new,
        alibi_slopes=slopes,
        return_lse=True,
        **kwargs,
    )


def decode_problems(
    spec: AttnSpec,
    cache: Cache,
    out,
    lse,
    q,
    k_new=None,
    v_new=None,
    slopes=None,
    sm_scale=None,
    sinks=None,
    tree=None,
    tensors=None,
) -> list[str]:
    """Per sequence: the kernel's rows against the dense float64 reference (decode's queries
    are the last tokens: the spec's bottom-right mask, and ALiBi without a mask is aligned
    bottom-right too). tree: decode's tree_mask [B, NQ, NQ] (or [NQ, NQ]), ANDed into what
    the queries see of the sequence's last NQ keys. tensors: score_mod / mask_mod's, read with
    b the sequence and q_idx the queries' positions (L_b - NQ + t)."""
    problems = []
    for b in range(q.shape[0]):
        k, v = cache.dense_k[b], cache.dense_v[b]
        if k_new is not None:
            k, v = torch.cat([k, k_new[b]], dim=1), torch.cat([v, v_new[b]], dim=1)
        found = compare_to_reference(
            spec,
            out[b : b + 1],
            lse[b : b + 1],
            q[b : b + 1],
            k[None],
            v[None],
            sm_scale=sm_scale,
            alibi_slopes=slopes,
            sinks=sinks,
            key_mask=None if tree is None else tree_key_mask(tree, b, k.shape[1]),
            tensors=tensors,
            first_b=b,
            first_q=k.shape[1] - q.shape[2],
        )
        problems += [f"sequence {b} (L={k.shape[1]}): {p}" for p in found]
    return problems


def tree_key_mask(tree, b: int, seqlen_k: int) -> torch.Tensor:
    """[1, NQ, L] bool: sequence b's view of decode's tree_mask over its keys, every key
    before the last NQ visible, draft key j (at L - NQ + j, when that is >= 0) where
    tree[b, i, j]."""
    tree = tree.cpu() if tree.dim() == 3 else tree.cpu()[None].expand(b + 1, -1, -1)
    num_q = tree.shape[1]
    mask = torch.ones(1, num_q, seqlen_k, dtype=torch.bool)
    drafts = min(num_q, seqlen_k)
    mask[0, :, seqlen_k - drafts :] = tree[b, :, num_q - drafts :]
    return mask


def expected_cache_after_append(cache: Cache, k_new, v_new) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches with the new keys written at cache_seqlens[b] + t, nothing else changed."""
    k, v = cache.k.clone(), cache.v.clone()
    for b in range(k_new.shape[0]):
        pos = cache.lengths[b].item() + torch.arange(k_new.shape[2])
        if cache.block_table is None:
            k[b, :, pos], v[b, :, pos] = k_new[b], v_new[b]
        else:
            page = k.shape[1]
            pages, slots = cache.block_table[b, pos // page].long(), pos % page
            k[pages, slots], v[pages, slots] = k_new[b].transpose(0, 1), v_new[b].transpose(0, 1)
    return k, v


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN included (torch.equal says NaN != NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


def count_plan_hits(monkeypatch, module) -> list[bool]:
    """One bool per decode() call that found its layout's plan: whether the plan launched
    (False: the full path ran)."""
    hits, run_plan = [], module._run_plan

    def counted(*args):
        done = run_plan(*args)
        hits.append(done is not None)
        return done

    monkeypatch.setattr(module, "_run_plan", counted)
    return hits
