"""API-level properties of decoding against a KV cache: attngen.flash_attn_with_kvcache
(contiguous and paged caches, with and without appended k/v, through a decode module or the
varlen route) and a generated module's decode().

Hypothesis draws batches (empty ones, empty sequences, lengths at the page and tile
boundaries), appended tokens, query tokens (beyond a decode module's max_query_tokens too),
GQA ratios, flash-attn masks, windows at the int32 limit, ALiBi, the split count, strided
caches inside larger tensors, and index tensors a caller can get wrong: cache_seqlens negative,
past the capacity, None with new keys, a Python int, strided or int64, block-table entries
outside [0, num_pages), with and without the checked mode (ATTNGEN_CHECKS=1).

Every cache, query, new-key and index tensor is a view into a sentinel-filled buffer; unused
cache slots and pages hold NaN. A call must raise ValueError / NoKernelError and change nothing,
or: each well-formed sequence gets the float64 reference's result and exactly its new keys
written at cache_seqlens[b]..; each sequence whose request does not fit its memory gets NaN
output and LSE and changes nothing outside its own cache row or pages; no other byte changes.
Each example runs in a forked child (tests/api_harness.py, isolated).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import attngen
from tests.api_harness import (
    MAX_QUERY_TOKENS,
    PAGE_SIZE,
    Expect,
    Layout,
    api_kernels,  # noqa: F401  (the module-scoped registry fixture)
    attempt,
    checked_mode,
    flash_semantics,
    guarded,
    isolated,
    reference_problems,
    unexpected_writes,
)
from tests.api_harness import (
    mistakes as draw_mistake,
)

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
    KvFlavor("fp32", 16, False, (-1, -1), 0.0, False, "api", "api_paged", "api",
             one_token_only=True),
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
def kv_cases(draw, flavors=FLAVORS, lengths=LENGTHS, heads=HEADS,
             apis=("flash_attn_with_kvcache", "decode")):
    flavor = draw(st.sampled_from(flavors))
    paged = draw(st.booleans())
    api = draw(st.sampled_from(apis))
    max_query_tokens = flavor.query_tokens(paged)
    if api == "decode" and (flavor.decode_module(paged) is None or flavor.one_token_only):
        api = "flash_attn_with_kvcache"
    mistake = draw(draw_mistake(MISTAKES))
    if mistake in ("table_out", "table_strided") and not paged:
        mistake = "none"
    if api == "decode" and mistake in ("seqlens_full", "seqlens_int", "seqlens_none_with_new",
                                       "k_without_v"):
        mistake = "none"  # flash-attn conveniences: decode() takes an int32 tensor
    batch = draw(st.sampled_from((1, 2, 3, 3, 0)))
    if mistake in INDEX_MISTAKES:
        batch = max(batch, 1)
    seq_lengths = [draw(st.sampled_from(lengths)) for _ in range(batch)]
    num_new = draw(st.sampled_from((0, 0, 1, 2, 5)))
    if mistake in ("seqlens_none_with_new", "k_without_v"):
        num_new = max(num_new, 1)
    if mistake == "seqlens_full":
        num_new = 0
    if mistake == "seqlens_int" and batch:
        seq_lengths = [seq_lengths[0]] * batch
    bad = draw(st.integers(0, max(batch - 1, 0)))
    if mistake == "table_out":
        seq_lengths[bad] = max(seq_lengths[bad], 1)  # a sequence that uses a page
    return KvCase(
        api=api, flavor=flavor, paged=paged,
        heads=(4, 3) if mistake == "gqa_ratio" else draw(st.sampled_from(heads)),
        lengths=tuple(seq_lengths), num_new=num_new,
        seqlen_q=draw(st.sampled_from((1, 1, 2, max_query_tokens, max_query_tokens + 1))),
        room=draw(st.sampled_from((0, 1, flavor.page_size))), mistake=mistake, bad=bad,
        bad_page=draw(st.sampled_from((-1, 2**31 - 1, 0))),
        checked=mistake in INDEX_MISTAKES and draw(st.booleans()),
        splits=draw(st.sampled_from((None, None, 2, 3))), heads_major=draw(st.booleans()),
        gap=draw(st.sampled_from((0, 0, 3))),
        fallback=api != "decode" and draw(st.integers(0, 4)) == 0,
        seed=draw(st.integers(0, 2**16)))


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
        table = order[:batch * max_pages].view(batch, max_pages).clone()
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
    slopes = 2.0 ** (-8.0 * torch.arange(1, hq + 1, dtype=torch.float32) / hq) if (
        flavor.alibi) else None
    cache = Cache(k.to(device), v.to(device), None if table is None else table.to(device),
                  seqlens, lengths, capacity)
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


def served_route(case: KvCase) -> bool:
    """Whether a module serves the call (a decode module for its layout and query count,
    else a varlen module), so that a well-formed call must not be refused."""
    flavor = case.flavor
    if flavor.one_token_only and case.seqlen_q != 1 and not case.fallback:
        return False
    decode = flavor.decode_module(case.paged)
    max_query_tokens = flavor.query_tokens(case.paged)
    if case.api == "decode":
        return case.seqlen_q <= max_query_tokens
    return (decode is not None and case.seqlen_q <= max_query_tokens) or (
        flavor.varlen is not None) or case.fallback


def kv_expectation(case: KvCase, cache: Cache):
    expect, names = MISTAKES[case.mistake]
    if case.api == "decode" and case.seqlen_q > case.flavor.query_tokens(case.paged):
        return Expect.REFUSE, ("max_query_tokens",)
    can_run = served_route(case)
    if expect is None:
        if any(bad_sequences(case, cache)):
            expect = Expect.REFUSE if case.checked else Expect.EITHER
        else:
            expect = Expect.SERVE if can_run else Expect.EITHER
    return expect, names if can_run else ()


def guard_call(case: KvCase, cache: Cache, values: dict) -> dict:
    """The call's tensors as views into sentinel buffers (mistakes in types and strides)."""
    strided = Layout((0,), 0, 2)
    order = (0, 2, 1, 3) if case.heads_major and not case.paged else (0, 1, 2, 3)
    cache_layout = Layout(order, case.gap)
    v_cache = cache.v
    if case.mistake == "cache_dtype":
        v_cache = v_cache.to(torch.float16 if v_cache.dtype == torch.float32 else torch.float32)
    guards = {"k_cache": guarded(cache.k, cache_layout), "v_cache": guarded(v_cache, cache_layout),
              "q": guarded(values["q"])}
    if cache.table is not None:
        guards["block_table"] = guarded(cache.table, Layout((0, 1), 0, 2) if (
            case.mistake == "table_strided") else None)
    if case.mistake not in ("seqlens_full", "seqlens_int", "seqlens_none_with_new"):
        dtype = torch.int64 if case.mistake == "seqlens_int64" else torch.int32
        guards["cache_seqlens"] = guarded(
            torch.tensor(cache.seqlens, dtype=dtype, device=cache.k.device),
            strided if case.mistake == "seqlens_strided" else None)
    if values["k"] is not None:
        k_new = values["k"]
        if case.mistake == "new_heads":
            k_new = torch.cat([k_new, k_new[:, :, :1]], dim=2)
        guards["k"] = guarded(k_new)
        if case.mistake != "k_without_v":
            guards["v"] = guarded(values["v"])
    if values["alibi_slopes"] is not None:
        guards["alibi_slopes"] = guarded(values["alibi_slopes"], strided if (
            case.mistake == "slopes_strided") else None)
    return guards


def call_kv(kernels, case: KvCase, guards: dict, cache: Cache):
    """The call; returns (out [B, Nq, HQ, DV], lse [B, HQ, Nq]) in flash-attn's layout."""
    args = {name: g.view for name, g in guards.items()}
    seqlens = args.get("cache_seqlens")
    if case.mistake == "seqlens_int":
        seqlens = cache.seqlens[0] if cache.seqlens else 0
    flavor = case.flavor
    if case.api == "decode":
        module = kernels.module_for(flavor.decode_module(case.paged), "decode")

        def heads_first(t):
            return None if t is None else t.transpose(1, 2)

        caches = (args["k_cache"], args["v_cache"]) if case.paged else (
            heads_first(args["k_cache"]), heads_first(args["v_cache"]))
        out, lse = module.decode(heads_first(args["q"]), *caches, seqlens,
                                 block_table=args.get("block_table"),
                                 k_new=heads_first(args.get("k")),
                                 v_new=heads_first(args.get("v")),
                                 alibi_slopes=args.get("alibi_slopes"), return_lse=True)
        return out.transpose(1, 2), lse

    def fn():
        return attngen.flash_attn_with_kvcache(
            args["q"], args["k_cache"], args["v_cache"], k=args.get("k"), v=args.get("v"),
            cache_seqlens=seqlens, block_table=args.get("block_table"), causal=flavor.causal,
            window_size=flavor.window_size, softcap=flavor.softcap,
            alibi_slopes=args.get("alibi_slopes"), return_softmax_lse=True)

    if not case.fallback:
        return fn()
    with kernels.fallback_only(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return fn()


def cached_rows(cache: Cache, b: int, n: int, page_size: int, values: torch.Tensor):
    """Rows [0, n) of sequence b of a cache tensor holding `values` ([n, HKV, D])."""
    pos = torch.arange(n)
    if cache.table is None:
        return values[b, pos]
    return values[cache.table[b, pos // page_size].long().cpu(), pos % page_size]


def cache_problems(case: KvCase, cache: Cache, guards: dict, values: dict, bad: list[bool],
                   page_size: int) -> list[str]:
    """The caches hold exactly the good sequences' new keys at their positions; a bad
    sequence may have written inside its own row or pages only; nothing else changed."""
    problems = []
    for name, new in (("k_cache", values["k"]), ("v_cache", values["v"])):
        g = guards[name]
        expected = g.view_of(g.before).cpu().clone()
        free = torch.zeros(expected.shape, dtype=torch.bool)
        for b, wrong in enumerate(bad):
            if wrong and cache.table is None:
                free[b] = True
            elif wrong:
                own = [p for p in cache.table[b].tolist() if 0 <= p < expected.shape[0]]
                free[own] = True
            elif new is not None:
                pos = cache.seqlens[b] + torch.arange(case.num_new)
                if cache.table is None:
                    expected[b, pos] = new[b].cpu().to(expected.dtype)
                else:
                    pages = cache.table[b, pos // page_size].long().cpu()
                    expected[pages, pos % page_size] = new[b].cpu().to(expected.dtype)
        problems += unexpected_writes(name, g, expected, free)
    return problems


def sequence_problems(case: KvCase, cache: Cache, values: dict, out, lse, bad: list[bool],
                      page_size: int) -> list[str]:
    flavor = case.flavor
    sem = flash_semantics(flavor.causal, flavor.window_size, flavor.softcap, flavor.alibi)
    problems = []
    for b, wrong in enumerate(bad):
        if wrong:
            if not (out[b].isnan().all() and lse[b].isnan().all()):
                problems.append(f"sequence {b}: its request does not fit its cache, but its "
                                "output and LSE are not NaN")
            continue
        n = cache.seqlens[b]
        keys = cached_rows(cache, b, n, page_size, cache.k.cpu())
        vals = cached_rows(cache, b, n, page_size, cache.v.cpu())
        if values["k"] is not None:
            keys = torch.cat([keys, values["k"][b].cpu()])
            vals = torch.cat([vals, values["v"][b].cpu()])

        def heads_first(t):
            return t.transpose(0, 1)[None]

        found = reference_problems(sem, heads_first(out[b]), lse[b:b + 1],
                                   heads_first(values["q"][b]), heads_first(keys),
                                   heads_first(vals), slopes=values["alibi_slopes"])
        problems += [f"sequence {b} (L={n}+{case.num_new}): {x}" for x in found]
    return problems


def check_kvcache(kernels, case: KvCase, device: str = "cpu") -> None:
    page_size = case.flavor.page_size
    cache, values = make_cache(case, device)
    guards = guard_call(case, cache, values)
    expect, names = kv_expectation(case, cache)
    with checked_mode(case.checked), kernels.forced_splits(case.splits):
        result, _ = attempt(lambda: call_kv(kernels, case, guards, cache), expect, names)
    if result is None:  # refused: nothing may have changed
        problems = [x for name, g in guards.items() for x in unexpected_writes(name, g)]
        assert not problems, "a refused call changed memory: " + "; ".join(problems)
        return
    out, lse = (t.cpu() for t in result)
    hq = case.heads[0]
    batch = len(case.lengths)
    assert out.shape == (batch, case.seqlen_q, hq, case.flavor.head_dim), out.shape
    assert lse.shape == (batch, hq, case.seqlen_q), lse.shape
    bad = bad_sequences(case, cache)
    problems = cache_problems(case, cache, guards, values, bad, page_size)
    problems += [x for name, g in guards.items() if name not in ("k_cache", "v_cache")
                 for x in unexpected_writes(name, g)]
    problems += sequence_problems(case, cache, values, out, lse, bad, page_size)
    assert not problems, "; ".join(problems)


CAUSAL, ALIBI, RIGHT, WINDOW, VARLEN_ONLY, ONE_TOKEN = FLAVORS


@settings(max_examples=30)
@given(kv_cases())
# found: ALiBi without a mask used |i - j| on the varlen route when Nq != Nk
@example(KvCase(flavor=ALIBI, lengths=(8, 15)))
# found: a window side of 2**31 - 1 overflowed int32 in decode and on the varlen route
@example(KvCase(api="decode", flavor=RIGHT, lengths=(3,), num_new=0))
@example(KvCase(flavor=RIGHT, paged=True, seqlen_q=2))
# found: a strided cache_seqlens was read with stride 1 (a crash)
@example(KvCase(api="decode", lengths=(17, 5, 9), num_new=2, mistake="seqlens_strided"))
@example(KvCase(paged=True, lengths=(17, 5, 9), num_new=2, mistake="seqlens_strided"))
# found: requests that do not fit wrote into other sequences' rows or outside the cache, read
# the next sequence's keys, and were not NaN; cache_seqlens=None with new keys appended at the
# capacity; the checked mode let them pass
@example(KvCase(api="decode", flavor=WINDOW, lengths=(0, 0, 0), num_new=5, seqlen_q=4, room=4,
                mistake="seqlens_over", bad=1))
@example(KvCase(api="decode", num_new=2, mistake="seqlens_negative"))
@example(KvCase(api="decode", paged=True, num_new=0, seqlen_q=2, mistake="seqlens_negative",
                bad=1))
@example(KvCase(flavor=VARLEN_ONLY, paged=True, mistake="table_out", bad=1, bad_page=-1))
@example(KvCase(paged=True, mistake="table_out", bad=1))
@example(KvCase(flavor=VARLEN_ONLY, lengths=(17, 5), num_new=0, mistake="seqlens_over"))
@example(KvCase(mistake="seqlens_none_with_new"))
@example(KvCase(api="decode", mistake="seqlens_negative", checked=True))
# found: one query token with causal=False (flash-attn's default) found no kernel
@example(KvCase(flavor=ONE_TOKEN))
# found: a call refused on the varlen route had already appended its keys
@example(KvCase(flavor=ONE_TOKEN, seqlen_q=5, num_new=2))
# found: the varlen route and the fallback validated nothing (torch errors)
@example(KvCase(flavor=WINDOW, paged=True, seqlen_q=5, mistake="new_heads"))
@example(KvCase(mistake="cache_dtype", fallback=True, seqlen_q=4))
@example(KvCase(paged=True, mistake="gqa_ratio", heads=(4, 3), fallback=True))
# an empty batch; a strided block table (honoured)
@example(KvCase(lengths=(), paged=True))
@example(KvCase(paged=True, lengths=(17, 5, 9), num_new=2, mistake="table_strided"))
def test_kvcache(api_kernels, case):  # noqa: F811
    isolated(check_kvcache, api_kernels, case)
