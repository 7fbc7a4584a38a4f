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
Each example runs in a forked child (tests/api_memory.py, isolated).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import example, given, settings

import attngen
from tests.api_harness import (
    Expect,
    api_kernels,  # noqa: F401  (the module-scoped registry fixture)
    attempt,
    flash_semantics,
    reference_problems,
)
from tests.api_kv_cases import FLAVORS, MISTAKES, Cache, KvCase, bad_sequences, kv_cases, make_cache
from tests.api_memory import Layout, guarded, isolated, unexpected_writes


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
    return (
        (decode is not None and case.seqlen_q <= max_query_tokens)
        or (flavor.varlen is not None)
        or case.fallback
    )


def kv_expectation(case: KvCase, cache: Cache):
    expect, names = MISTAKES[case.mistake]
    if case.api == "decode" and case.seqlen_q > case.flavor.query_tokens(case.paged):
        return Expect.REFUSE, ("max_query_tokens",)
    can_run = served_route(case)
    if case.num_new > cache.capacity:  # every path refuses it, even for an empty batch (or
        return Expect.REFUSE, ("capacity", *names)  # for the case's other mistake, found first)
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
    guards = {
        "k_cache": guarded(cache.k, cache_layout),
        "v_cache": guarded(v_cache, cache_layout),
        "q": guarded(values["q"]),
    }
    if cache.table is not None:
        guards["block_table"] = guarded(
            cache.table, Layout((0, 1), 0, 2) if (case.mistake == "table_strided") else None
        )
    if case.mistake not in ("seqlens_full", "seqlens_int", "seqlens_none_with_new"):
        dtype = torch.int64 if case.mistake == "seqlens_int64" else torch.int32
        guards["cache_seqlens"] = guarded(
            torch.tensor(cache.seqlens, dtype=dtype, device=cache.k.device),
            strided if case.mistake == "seqlens_strided" else None,
        )
    if values["k"] is not None:
        k_new = values["k"]
        if case.mistake == "new_heads":
            k_new = torch.cat([k_new, k_new[:, :, :1]], dim=2)
        guards["k"] = guarded(k_new)
        if case.mistake != "k_without_v":
            guards["v"] = guarded(values["v"])
    if values["alibi_slopes"] is not None:
        guards["alibi_slopes"] = guarded(
            values["alibi_slopes"], strided if (case.mistake == "slopes_strided") else None
        )
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

        caches = (
            (args["k_cache"], args["v_cache"])
            if case.paged
            else (heads_first(args["k_cache"]), heads_first(args["v_cache"]))
        )
        out, lse = module.decode(
            heads_first(args["q"]),
            *caches,
            seqlens,
            block_table=args.get("block_table"),
            k_new=heads_first(args.get("k")),
            v_new=heads_first(args.get("v")),
            alibi_slopes=args.get("alibi_slopes"),
            return_lse=True,
        )
        return out.transpose(1, 2), lse

    def fn():
        return attngen.flash_attn_with_kvcache(
            args["q"],
            args["k_cache"],
            args["v_cache"],
            k=args.get("k"),
            v=args.get("v"),
            cache_seqlens=seqlens,
            block_table=args.get("block_table"),
            causal=flavor.causal,
            window_size=flavor.window_size,
            softcap=flavor.softcap,
            alibi_slopes=args.get("alibi_slopes"),
            return_softmax_lse=True,
        )

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


def cache_problems(
    case: KvCase, cache: Cache, guards: dict, values: dict, bad: list[bool], page_size: int
) -> list[str]:
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


def sequence_problems(
    case: KvCase, cache: Cache, values: dict, out, lse, bad: list[bool], page_size: int
) -> list[str]:
    flavor = case.flavor
    sem = flash_semantics(flavor.causal, flavor.window_size, flavor.softcap, flavor.alibi)
    problems = []
    for b, wrong in enumerate(bad):
        if wrong:
            if not (out[b].isnan().all() and lse[b].isnan().all()):
                problems.append(
                    f"sequence {b}: its request does not fit its cache, but its "
                    "output and LSE are not NaN"
                )
            continue
        n = cache.seqlens[b]
        keys = cached_rows(cache, b, n, page_size, cache.k.cpu())
        vals = cached_rows(cache, b, n, page_size, cache.v.cpu())
        if values["k"] is not None:
            keys = torch.cat([keys, values["k"][b].cpu()])
            vals = torch.cat([vals, values["v"][b].cpu()])

        def heads_first(t):
            return t.transpose(0, 1)[None]

        found = reference_problems(
            sem,
            heads_first(out[b]),
            lse[b : b + 1],
            heads_first(values["q"][b]),
            heads_first(keys),
            heads_first(vals),
            slopes=values["alibi_slopes"],
        )
        problems += [f"sequence {b} (L={n}+{case.num_new}): {x}" for x in found]
    return problems


def assert_user_layout(case: KvCase, guards: dict, refusal: Exception) -> None:
    """flash_attn_with_kvcache's errors speak of the caller's [B, N, H, D] tensors, not of the
    [B, H, N, D] views it hands to a module."""
    if case.api != "flash_attn_with_kvcache" or case.mistake != "new_heads" or ("k" not in guards):
        return
    shape = list(guards["k"].view.shape)
    internal = [shape[0], shape[2], shape[1], shape[3]]
    text = str(refusal)
    assert internal == shape or not (str(internal) in text or str(tuple(internal)) in text), (
        f"the error shows k as {internal}, the caller passed {shape}: {text}"
    )


def check_kvcache(kernels, case: KvCase, device: str = "cpu") -> None:
    page_size = case.flavor.page_size
    cache, values = make_cache(case, device)
    guards = guard_call(case, cache, values)
    expect, names = kv_expectation(case, cache)
    with kernels.checked(case.checked) as active, active.forced_splits(case.splits):
        result, refusal = attempt(lambda: call_kv(active, case, guards, cache), expect, names)
    if result is None:  # refused: nothing may have changed
        problems = [x for name, g in guards.items() for x in unexpected_writes(name, g)]
        assert not problems, "a refused call changed memory: " + "; ".join(problems)
        assert_user_layout(case, guards, refusal)
        return
    out, lse = (t.cpu() for t in result)
    hq = case.heads[0]
    batch = len(case.lengths)
    assert out.shape == (batch, case.seqlen_q, hq, case.flavor.head_dim), out.shape
    assert lse.shape == (batch, hq, case.seqlen_q), lse.shape
    bad = bad_sequences(case, cache)
    problems = cache_problems(case, cache, guards, values, bad, page_size)
    problems += [
        x
        for name, g in guards.items()
        if name not in ("k_cache", "v_cache")
        for x in unexpected_writes(name, g)
    ]
    problems += sequence_problems(case, cache, values, out, lse, bad, page_size)
    assert not problems, "; ".join(problems)


CAUSAL, ALIBI, RIGHT, WINDOW, VARLEN_ONLY, ONE_TOKEN = FLAVORS


@settings(max_examples=25)
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
@example(
    KvCase(
        api="decode",
        flavor=WINDOW,
        lengths=(0, 0, 0),
        num_new=5,
        seqlen_q=4,
        room=4,
        mistake="seqlens_over",
        bad=1,
    )
)
@example(KvCase(api="decode", num_new=2, mistake="seqlens_negative"))
@example(KvCase(api="decode", paged=True, num_new=0, seqlen_q=2, mistake="seqlens_negative", bad=1))
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
# found: a strided alibi_slopes was read with stride 1
@example(KvCase(api="decode", flavor=ALIBI, paged=True, mistake="slopes_strided"))
# found: a shape error named the decode module's [B, H, N, D] view of the caller's k
@example(KvCase(paged=True, mistake="new_heads"))
# more new keys than the capacity is refused on every route, even for an empty batch
@example(KvCase(flavor=RIGHT, paged=True, lengths=(), num_new=5, room=4, fallback=True))
# an empty batch; a strided block table (honoured)
@example(KvCase(lengths=(), paged=True))
@example(KvCase(paged=True, lengths=(17, 5, 9), num_new=2, mistake="table_strided"))
def test_kvcache(api_kernels, case):  # noqa: F811
    isolated(check_kvcache, api_kernels, case)


@pytest.mark.slow
@settings(max_examples=300)
@given(kv_cases())
def test_kvcache_more(api_kernels, case):  # noqa: F811
    """test_kvcache with many more examples (`pytest -m slow`)."""
    isolated(check_kvcache, api_kernels, case)
