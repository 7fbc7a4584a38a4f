"""The draws of the KV-cache property tests (tests/test_api_kvcache.py, test_api_gpu.py):
which calls (`KvCase`, `kv_cases`), the caches they run on (`make_cache`: flash-attn layout,
contiguous or paged, NaN in every slot no sequence holds) and which sequences a call's index
tensors put outside their memory (`bad_sequences`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from tests.api_harness import MAX_QUERY_TOKENS, PAGE_SIZE, Expect, draw_mistake

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class KvFlavor:
    """A kind of call and the modules that serve it: a decode module per layout (spec name,
    or None), and a varlen module (the route without a decode module)."""

    dtype: str
    head_dim: int
    causal: bool
    window_size: tuple[int, int]
    softcap: float
    alibi: bool
    decode_contiguous: str | None
    decode_paged: str | None
    varlen: str | None
    page_size: int = PAGE_SIZE
    one_token_only: bool = False  # the modules serve it only with one query token
    max_query_tokens: tuple[int, int] = (MAX_QUERY_TOKENS, MAX_QUERY_TOKENS)  # contig, paged

    def decode_module(self, paged: bool) -> str | None:
        return self.decode_paged if paged else self.decode_contiguous

    def query_tokens(self, paged: bool) -> int:
        """The most query tokens the decode module of this layout takes."""
        return self.max_query_tokens[paged]


FLAVORS = (
    KvFlavor("fp32", 16, True, (-1, -1), 0.0, False, "api", "api_paged", "api"),
    KvFlavor("fp32", 16, False, (-1, -1), 0.0, True, None, "api_alibi", "api_alibi"),
    KvFlavor("fp32", 16, False, (3, -1), 0.0, False, "api_right", None, "api_right"),
    KvFlavor("fp16", 16, True, (3, -1), 5.0, False, "api_win", None, "api_win"),
    KvFlavor("fp16", 32, True, (-1, -1), 0.0, False, None, None, "api_h32"),
    # flash-attn's default causal=False: one query token sees every key, as causal does
    KvFlavor(
        "fp32", 16, False, (-1, -1), 0.0, False, "api", "api_paged", "api", one_token_only=True
    ),
)
LENGTHS = (0, 1, 3, 4, 5, 8, 15, 16, 17)
HEADS = ((4, 2), (4, 4), (4, 1), (2, 2))
MISTAKES = {
    "none": (None, ()),
    "seqlens_negative": (None, ("cache_seqlens",)),
    "seqlens_over": (None, ("cache_seqlens",)),
    "table_out": (None, ("block_table",)),
    "seqlens_none_with_new": (Expect.REFUSE, ("cache_seqlens",)),
    "seqlens_full": (None, ()),  # cache_seqlens=None without new keys: the caches are full
    "seqlens_int": (None, ()),  # a Python int: every sequence that long
    "seqlens_strided": (Expect.EITHER, ("cache_seqlens",)),
    "table_strided": (Expect.EITHER, ("block_table",)),
    "slopes_strided": (Expect.EITHER, ("alibi_slopes",)),
    "seqlens_int64": (Expect.EITHER, ("cache_seqlens",)),
    "new_heads": (Expect.REFUSE, ("k", "head")),
    "cache_dtype": (Expect.REFUSE, ("dtype",)),
    "gqa_ratio": (Expect.REFUSE, ("head",)),
    "k_without_v": (Expect.REFUSE, ("v",)),
}
INDEX_MISTAKES = {"seqlens_negative", "seqlens_over", "table_out"}


@dataclass(frozen=True)
class KvCase:
    """One drawn call: structure only (tensors come from `seed`)."""

    api: str = "flash_attn_with_kvcache"  # or "decode": the flavor's module's decode()
    flavor: KvFlavor = FLAVORS[0]
    paged: bool = False
    heads: tuple[int, int] = (4, 2)
    lengths: tuple[int, ...] = (5, 17)  # keys already cached, per sequence
    num_new: int = 1
    seqlen_q: int = 1
    room: int = 0  # capacity beyond the longest sequence after the append
    mistake: str = "none"
    bad: int = 0  # the sequence an index mistake hits
    bad_page: int = 0  # block_table's out-of-range value (0: num_pages)
    checked: bool = False  # ATTNGEN_CHECKS=1
    splits: int | None = None  # the decode modules' forced split count
    heads_major: bool = False  # a contiguous cache stored [B, HKV, L, D], passed transposed
    gap: int = 0  # sentinel elements between cache rows
    fallback: bool = False
    seed: int = 0


@st.composite
def kv_cases(
    draw, flavors=FLAVORS, lengths=LENGTHS, heads=HEADS, apis=("flash_attn_with_kvcache", "decode")
):
    flavor = draw(st.sampled_from(flavors))
    paged = draw(st.booleans())
    api = draw(st.sampled_from(apis))
    max_query_tokens = flavor.query_tokens(paged)
    if api == "decode" and (flavor.decode_module(paged) is None or flavor.one_token_only):
        api = "flash_attn_with_kvcache"
    mistake = draw(draw_mistake(MISTAKES))
    if mistake in ("table_out", "table_strided") and not paged:
        mistake = "none"
    if api == "decode" and mistake in (
        "seqlens_full",
        "seqlens_int",
        "seqlens_none_with_new",
        "k_without_v",
    ):
        mistake = "none"  # flash-attn conveniences: decode() takes an int32 tensor
    batch = draw(st.sampled_from((1, 2, 3, 3, 0)))
    if mistake in INDEX_MISTAKES:
        batch = max(batch, 1)
    seq_lengths = [draw(st.sampled_from(lengths)) for _ in range(batch)]
    num_new = draw(st.sampled_from((0, 0, 1, 2, 5)))
    if mistake in ("seqlens_none_with_new", "k_without_v", "new_heads"):
        num_new = max(num_new, 1)  # mistakes in the new keys need new keys
    if mistake == "seqlens_full":
        num_new = 0
    if mistake == "seqlens_int" and batch:
        seq_lengths = [seq_lengths[0]] * batch
    bad = draw(st.integers(0, max(batch - 1, 0)))
    if mistake == "table_out":
        seq_lengths[bad] = max(seq_lengths[bad], 1)  # a sequence that uses a page
    return KvCase(
        api=api,
        flavor=flavor,
        paged=paged,
        heads=(4, 3) if mistake == "gqa_ratio" else draw(st.sampled_from(heads)),
        lengths=tuple(seq_lengths),
        num_new=num_new,
        seqlen_q=draw(st.sampled_from((1, 1, 2, max_query_tokens, max_query_tokens + 1))),
        room=draw(st.sampled_from((0, 1, flavor.page_size))),
        mistake=mistake,
        bad=bad,
        bad_page=draw(st.sampled_from((-1, 2**31 - 1, 0))),
        checked=mistake in INDEX_MISTAKES and draw(st.booleans()),
        splits=draw(st.sampled_from((None, None, 2, 3))),
        heads_major=draw(st.booleans()),
        gap=draw(st.sampled_from((0, 0, 3))),
        fallback=api != "decode" and draw(st.integers(0, 4)) == 0,
        seed=draw(st.integers(0, 2**16)),
    )


@dataclass
class Cache:
    """Flash-attn layout values: caches [B, L, HKV, D] or pages [P, page, HKV, D]."""

    k: torch.Tensor
    v: torch.Tensor
    table: torch.Tensor | None
    seqlens: list[int]  # what the caller passes (mistakes applied)
    lengths: list[int]  # what the caches really hold
    capacity: int


def make_cache(case: KvCase, device="cpu") -> tuple[Cache, dict]:
    gen = torch.Generator().manual_seed(case.seed)
    page_size = case.flavor.page_size
    flavor = case.flavor
    dtype = DTYPES[flavor.dtype]
    hq, hkv = case.heads
    d = flavor.head_dim
    batch = len(case.lengths)
    longest = max([n + case.num_new for n in case.lengths], default=0) + case.room
    full = case.mistake == "seqlens_full"
    if case.paged:
        max_pages = max(1, -(-longest // page_size))
        capacity = max_pages * page_size
        num_pages = batch * max_pages + 2  # two pages nobody owns
        order = torch.randperm(num_pages, generator=gen).to(torch.int32)
        table = order[: batch * max_pages].view(batch, max_pages).clone()
        shape = (num_pages, page_size, hkv, d)
    else:
        capacity = max(longest, 1)
        table = None
        shape = (batch, capacity, hkv, d)
    lengths = [capacity] * batch if full else list(case.lengths)
    k = torch.full(shape, float("nan"), dtype=dtype)
    v = torch.full(shape, float("nan"), dtype=dtype)
    for b, n in enumerate(lengths):
        pos = torch.arange(n)
        rows = (table[b, pos // page_size].long(), pos % page_size) if case.paged else (b, pos)
        k[rows] = torch.randn(n, hkv, d, generator=gen).to(dtype)
        v[rows] = torch.randn(n, hkv, d, generator=gen).to(dtype)
    seqlens = list(lengths)
    if case.mistake == "seqlens_negative":
        seqlens[case.bad] = -2
    elif case.mistake == "seqlens_over":
        seqlens[case.bad] = capacity - case.num_new + 1
    elif case.mistake == "table_out":
        used = -(-(lengths[case.bad] + case.num_new) // page_size)
        table[case.bad, used - 1] = case.bad_page if case.bad_page else num_pages
    q = (torch.randn(batch, case.seqlen_q, hq, d, generator=gen)).to(dtype)
    k_new = v_new = None
    if case.num_new:
        k_new = torch.randn(batch, case.num_new, hkv, d, generator=gen).to(dtype)
        v_new = torch.randn(batch, case.num_new, hkv, d, generator=gen).to(dtype)
    slopes = (
        2.0 ** (-8.0 * torch.arange(1, hq + 1, dtype=torch.float32) / hq)
        if (flavor.alibi)
        else None
    )
    cache = Cache(
        k.to(device),
        v.to(device),
        None if table is None else table.to(device),
        seqlens,
        lengths,
        capacity,
    )
    values = {"q": q, "k": k_new, "v": v_new, "alibi_slopes": slopes}
    return cache, {n: None if t is None else t.to(device) for n, t in values.items()}


def bad_sequences(case: KvCase, cache: Cache) -> list[bool]:
    """A sequence whose request does not fit the memory it was given."""
    bad = []
    num_pages = cache.k.shape[0]
    for b, n in enumerate(cache.seqlens):
        wrong = n < 0 or n + case.num_new > cache.capacity
        if cache.table is not None and not wrong:
            used = -(-(n + case.num_new) // cache.k.shape[1])
            entries = cache.table[b, :used].tolist()
            wrong = any(not 0 <= p < num_pages for p in entries)
        bad.append(wrong)
    return bad
