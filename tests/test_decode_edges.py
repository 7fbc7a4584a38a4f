"""Pinned edge cases of the decode kernel (shared/RELIABILITY.md), on the CPU interpreter.

tests/test_decode_gpu.py runs the same helpers at real sizes on the H200.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from attngen.tiling.decode import num_splits
from tests.decode_harness import (
    decode_problems,
    expected_cache_after_append,
    load_decode,
    make_cache,
    make_decode_spec,
    make_queries,
    run_decode,
    same_bits,
)

LAYOUTS = [("contiguous", None), ("paged", 4), ("paged", 32)]
CAUSAL = dict(mask="causal", causal_align="bottom_right")


def _spec(layout="paged", page_size=16, **fields):
    return make_decode_spec(layout, page_size, **{**CAUSAL, **fields})


@pytest.mark.parametrize("layout, page_size", LAYOUTS)
@pytest.mark.parametrize("splits", [None, 3])
def test_empty_cache_and_no_new_tokens_give_zero_and_minus_inf(layout, page_size, splits):
    spec = _spec(layout, page_size, max_query_tokens=2)
    kernel = load_decode(spec, 16)
    cache = make_cache(spec, [0, 0], seed=1, extra_capacity=40)
    q, *_ = make_queries(spec, 2, 2, seed=1)
    kernel.FORCE_NUM_SPLITS = splits
    try:
        out, lse = run_decode(kernel, cache, q)
    finally:
        kernel.FORCE_NUM_SPLITS = None
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


@pytest.mark.parametrize("layout, page_size", LAYOUTS)
def test_more_query_tokens_than_keys_gives_empty_rows(layout, page_size):
    spec = _spec(layout, page_size, max_query_tokens=4)
    cache = make_cache(spec, [2, 0], seed=2)
    q, *_ = make_queries(spec, 2, 4, seed=2)
    out, lse = run_decode(load_decode(spec, 16), cache, q)
    assert torch.all(torch.isneginf(lse[0, :, :2])) and torch.all(out[0, :, :2] == 0)
    assert torch.isfinite(lse[0, :, 2:]).all()
    assert not decode_problems(spec, cache, out, lse, q)


@pytest.mark.parametrize("layout, page_size", LAYOUTS)
@pytest.mark.parametrize(
    "fields",
    [
        CAUSAL,
        dict(mask="none"),
        dict(mask="sliding_window", causal_align="bottom_right", window_left=6, window_right=0),
    ],
)
def test_nan_in_unused_slots_and_pages_is_bitwise_like_zeros(layout, page_size, fields):
    spec = make_decode_spec(layout, page_size, **fields, max_query_tokens=2)
    kernel = load_decode(spec, 16)
    lengths = [33, 4, 0, 17]
    poisoned = make_cache(spec, lengths, seed=3, fill=float("nan"))
    clean = make_cache(spec, lengths, seed=3, fill=0.0)
    if layout == "paged":  # the same pages, so the same tensors but for the fill
        assert torch.equal(poisoned.block_table, clean.block_table)
    q, *_ = make_queries(spec, len(lengths), 2, seed=3)
    for splits in (2, None):  # the default (one split here) last: `expected` is its result
        kernel.FORCE_NUM_SPLITS = splits
        try:
            expected = run_decode(kernel, clean, q)
            got = run_decode(kernel, poisoned, q)
        finally:
            kernel.FORCE_NUM_SPLITS = None
        assert same_bits(expected[0], got[0]) and same_bits(expected[1], got[1])
    assert not decode_problems(spec, clean, *expected, q)
    if fields["mask"] == "sliding_window":  # NaN left of the window must not count either
        windowed = make_cache(spec, lengths, seed=3, fill=0.0)
        k = windowed.k
        if layout == "contiguous":
            k[0, :, :20] = float("nan")
        else:
            k[windowed.block_table[0, : 20 // page_size].long()] = float("nan")
        assert same_bits(run_decode(kernel, windowed, q)[0][0], expected[0][0])


@pytest.mark.parametrize("layout, page_size", LAYOUTS)
@pytest.mark.parametrize("lengths, num_new", [([0, 3, 31], 5), ([4, 7], 1), ([32, 1], 17)])
def test_append_writes_exactly_its_slots(layout, page_size, lengths, num_new):
    spec = _spec(layout, page_size, max_query_tokens=4)
    kernel = load_decode(spec, 16)
    cache = make_cache(spec, lengths, seed=4, room=num_new)
    before = cache.clone()
    q, k_new, v_new, _ = make_queries(spec, len(lengths), 2, seed=4, num_new=num_new)
    out, lse = run_decode(kernel, cache, q, k_new, v_new)
    k_expected, v_expected = expected_cache_after_append(before, k_new, v_new)
    assert same_bits(cache.k, k_expected) and same_bits(cache.v, v_expected)
    assert torch.equal(cache.lengths, before.lengths)  # cache_seqlens is not modified
    assert not decode_problems(spec, before, out, lse, q, k_new, v_new)
    if cache.block_table is not None:
        assert torch.equal(cache.block_table, before.block_table)


@pytest.mark.parametrize("layout, page_size", LAYOUTS)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_forced_splits_agree_with_one_split(layout, page_size, dtype):
    spec = _spec(layout, page_size, dtype=dtype, num_q_heads=8, num_kv_heads=2, softcap=30.0)
    kernel = load_decode(spec, 16)
    cache = make_cache(spec, [100, 47, 1], seed=5)
    q, *_ = make_queries(spec, 3, 1, seed=5)
    results = {}
    for splits in (1, 2, 5, 64):
        kernel.FORCE_NUM_SPLITS = splits
        try:
            results[splits] = run_decode(kernel, cache, q)
        finally:
            kernel.FORCE_NUM_SPLITS = None
        assert not decode_problems(spec, cache, *results[splits], q), splits
    one = results[1]
    for splits, (out, lse) in results.items():
        # The same softmax merged in another order: the partial outputs are fp32, rescaled by
        # exp2(lse_i - lse) and summed in another order, then rounded once to the output
        # dtype, so they differ by at most a couple of output ulps (4 eps x max|out|).
        tolerance = 4 * torch.finfo(out.dtype).eps * out.abs().max().item()
        assert (out.float() - one[0].float()).abs().max().item() <= tolerance, splits
        # The LSE is merged in fp32 as max + log2(sum 2**(lse_i - max)): a handful of roundings
        # at the LSE's magnitude (here |lse| < 10, an fp32 ulp < 1e-6), so 1e-6 absolute and
        # relative is about ten ulps.
        assert torch.allclose(lse, one[1], rtol=1e-6, atol=1e-6), splits


def test_the_rule_splits_a_single_long_sequence():
    spec = _spec("paged", 16)
    kernel = load_decode(spec, 16)
    splits, keys = kernel._num_splits(8, 4096, 64, 132)
    assert (splits, keys) == num_splits(8, 4096, 64, 132) == (16, 256)
    for programs in (1, 3, 8, 64, 100, 512, 5000):
        for span in (0, 1, 63, 64, 65, 1000, 4096, 32768, 10**6):
            for sm_count in (1, 84, 132):
                got = kernel._num_splits(programs, span, 64, sm_count)
                assert got == num_splits(programs, span, 64, sm_count)
                assert got[0] * got[1] >= span and (got[0] - 1) * got[1] < max(span, 1)


def test_bitwise_deterministic():
    spec = _spec(
        "paged", 4, dtype="bf16", num_q_heads=14, num_kv_heads=2, alibi=True, max_query_tokens=3
    )
    kernel = load_decode(spec, 16)
    cache = make_cache(spec, [61, 9], seed=6)
    q, _, _, slopes = make_queries(spec, 2, 3, seed=6)
    first = run_decode(kernel, cache, q, slopes=slopes)
    for _ in range(2):
        again = run_decode(kernel, cache, q, slopes=slopes)
        assert same_bits(first[0], again[0]) and same_bits(first[1], again[1])
    assert not decode_problems(spec, cache, *first, q, slopes=slopes)


def test_strided_inputs_match_contiguous():
    spec = _spec("contiguous", None, head_dim=40, max_query_tokens=2)
    kernel = load_decode(spec, 16)
    cache = make_cache(spec, [21, 30], seed=7)
    q, *_ = make_queries(spec, 2, 2, seed=7)
    expected = run_decode(kernel, cache, q)
    # [B, L, H, D] storage viewed as [B, H, L, D]; q transposed; a storage offset.
    strided = cache.clone()
    strided.k = cache.k.transpose(1, 2).contiguous().transpose(1, 2)
    big = torch.zeros(2, cache.v.shape[1] + 1, cache.v.shape[2], 48, dtype=cache.v.dtype)
    big[:, 1:, :, 4:44] = cache.v
    strided.v = big[:, 1:, :, 4:44]
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)
    got = run_decode(kernel, strided, q_t)
    assert same_bits(expected[0], got[0]) and same_bits(expected[1], got[1])


def test_empty_batch():
    spec = _spec("paged", 16)
    cache = make_cache(spec, [], seed=0)
    q, *_ = make_queries(spec, 0, 1, seed=0)
    out, lse = run_decode(load_decode(spec, 16), cache, q)
    assert out.shape == (0, 4, 1, 64) and lse.shape == (0, 4, 1)


def _bad_inputs(spec):
    cache = make_cache(spec, [5, 3], seed=0, room=2)
    q, k_new, v_new, _ = make_queries(spec, 2, 1, seed=0, num_new=2)
    return cache, q, k_new, v_new


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda c, q, kn, vn: dict(q=q.float()), "q: expected dtype"),
        (lambda c, q, kn, vn: dict(q=q[0]), r"q: expected a tensor \[B, HQ, NQ, 64\]"),
        (lambda c, q, kn, vn: dict(q=q[..., :32]), r"q: expected shape \[\*, \*, \*, 64\]"),
        (lambda c, q, kn, vn: dict(q=q.expand(2, 4, 3, 64)), "at most max_query_tokens=2"),
        (lambda c, q, kn, vn: dict(q=q[:, :3]), "multiple of the cache's KV heads"),
        (
            lambda c, q, kn, vn: dict(cache_seqlens=c.lengths.long()),
            "cache_seqlens: expected dtype",
        ),
        (lambda c, q, kn, vn: dict(cache_seqlens=c.lengths[:1]), r"cache_seqlens: expected shape"),
        (lambda c, q, kn, vn: dict(block_table=None), "block_table: expected int32"),
        (lambda c, q, kn, vn: dict(block_table=c.block_table[:1]), "block_table: expected shape"),
        (lambda c, q, kn, vn: dict(k_cache=c.k[:, :8]), r"k_cache: expected shape \[\*, 16"),
        (lambda c, q, kn, vn: dict(v_cache=c.v[:-1]), "v_cache: expected shape"),
        (lambda c, q, kn, vn: dict(k_new=kn), "k_new, v_new: expected both or neither"),
        (lambda c, q, kn, vn: dict(k_new=kn[:, :1], v_new=vn), "k_new: expected shape"),
        (lambda c, q, kn, vn: dict(k_new=kn, v_new=vn[:, :, :1]), "v_new: expected shape"),
        (lambda c, q, kn, vn: dict(sm_scale=0.0), "sm_scale"),
        (lambda c, q, kn, vn: dict(alibi_slopes=torch.ones(4)), "alibi_slopes"),
    ],
)
def test_bad_inputs_raise_value_errors_saying_what_was_expected(mutate, message):
    spec = _spec("paged", 16, max_query_tokens=2)
    cache, q, k_new, v_new = _bad_inputs(spec)
    args = dict(
        q=q,
        k_cache=cache.k,
        v_cache=cache.v,
        cache_seqlens=cache.lengths,
        block_table=cache.block_table,
    )
    args.update(mutate(cache, q, k_new, v_new))
    positional = [args.pop(n) for n in ("q", "k_cache", "v_cache", "cache_seqlens")]
    with pytest.raises(ValueError, match=message):
        load_decode(spec, 16).decode(*positional, **args)


def test_block_table_refused_for_a_contiguous_cache():
    spec = _spec("contiguous", None)
    cache, q, _, _ = _bad_inputs(spec)
    table = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_table: expected None for a contiguous cache"):
        load_decode(spec, 16).decode(q, cache.k, cache.v, cache.lengths, block_table=table)


def test_offsets_past_2_31_elements_do_not_wrap():
    code = "from tests.test_decode_edges import check_far_offsets; check_far_offsets()"
    child = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert "far offsets ok" in child.stdout


def check_far_offsets():
    # Cache rows 2**26 elements apart: row 40 sits past 2**31 elements, so an int32 row offset
    # would wrap. The storage is reserved but only the rows used are touched.
    spec = _spec("contiguous", None, num_q_heads=1, num_kv_heads=1)
    kernel = load_decode(spec, 16)
    cache = make_cache(spec, [40], seed=8, room=2, extra_capacity=0)
    q, k_new, v_new, _ = make_queries(spec, 1, 1, seed=8, num_new=2)
    row = 2**26
    storage = torch.empty(42 * row + 64, dtype=torch.float16)
    far = cache.clone()
    far.k = storage.as_strided((1, 1, 42, 64), (42 * row, 42 * row, row, 1))
    far.v = storage.as_strided((1, 1, 42, 64), (42 * row, 42 * row, row, 1), storage_offset=64)
    assert far.k.stride(2) * 41 > 2**31
    far.k.copy_(cache.k)
    far.v.copy_(cache.v)
    expected = run_decode(kernel, cache, q, k_new, v_new)
    got = run_decode(kernel, far, q, k_new, v_new)
    assert same_bits(expected[0], got[0]) and same_bits(expected[1], got[1])
    assert same_bits(far.k.clone(), cache.k) and same_bits(far.v.clone(), cache.v)
    print("far offsets ok")
