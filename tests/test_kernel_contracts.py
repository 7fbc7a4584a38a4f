"""Contracts every kernel kind keeps alike (CPU interpreter): ALiBi's alignment, windows up to
flash-attn's "infinite" side 2**31 - 1, contiguous index and slope tensors, and numerics at
the edges (a key block that is all -inf for a row; fp32 scores scaled before the exponent).
"""

from __future__ import annotations

import pytest
import torch

from attngen.reference import reference_attention
from attngen.runtime.fallback import torch_attention
from attngen.spec.masks import alibi_distance
from tests.decode_harness import (
    decode_problems,
    load_decode,
    make_cache,
    make_decode_spec,
    make_queries,
    run_decode,
)
from tests.kernel_harness import assert_matches_reference, load_kernel, make_inputs, make_spec
from tests.test_varlen_properties import assert_each_sequence_matches, cu_seqlens, packed_inputs

ALIBI_NONE = dict(mask="none", alibi=True, num_q_heads=4, num_kv_heads=2)
LIMITS = [2**31 - 1, 2**31 - 2, 2**30]


def _varlen(spec):
    return load_kernel(spec, 16, 16, kind="varlen")


# -- ALiBi: |i' - j|, with i' aligned bottom-right when there is no mask -----------------------


def test_reference_alibi_distance_without_a_mask_is_bottom_right():
    none = make_spec(**ALIBI_NONE)
    assert alibi_distance(none.mask, none.causal_align, 2, 4).tolist() == [
        [2, 1, 0, 1],
        [3, 2, 1, 0],
    ]
    assert alibi_distance(none.mask, none.causal_align, 3, 2).tolist() == [[1, 2], [0, 1], [1, 0]]
    top_left = make_spec(mask="causal", causal_align="top_left", alibi=True)
    assert alibi_distance(top_left.mask, top_left.causal_align, 2, 4).tolist() == [
        [0, 1, 2, 3],
        [1, 0, 1, 2],
    ]


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(5, 37), (37, 5), (17, 16)])
def test_alibi_without_a_mask_prefill_and_varlen_match_the_reference(seqlen_q, seqlen_k):
    spec = make_spec(dtype="fp32", **ALIBI_NONE, kernels=["prefill", "varlen"])
    q, k, v, slopes = make_inputs(spec, 1, seqlen_q, seqlen_k, seed=1)
    out, lse = load_kernel(spec, 16, 16).attention(q, k, v, alibi_slopes=slopes, return_lse=True)
    assert_matches_reference(spec, out, lse, q, k, v, slopes=slopes)
    lengths_q, lengths_k = [seqlen_q, 3], [seqlen_k, 9]
    q, k, v, slopes = packed_inputs(spec, lengths_q, lengths_k, seed=2)
    out, lse = _varlen(spec).attention_varlen(
        q,
        k,
        v,
        cu_seqlens(lengths_q),
        cu_seqlens(lengths_k),
        max(lengths_q),
        max(lengths_k),
        alibi_slopes=slopes,
        return_lse=True,
    )
    assert_each_sequence_matches(spec, out, lse, q, k, v, lengths_q, lengths_k, slopes)


def test_alibi_without_a_mask_is_one_answer_across_kinds_and_the_fallback():
    """Decode's queries are the last tokens of their sequence; the prefill kind, the varlen
    kind and the torch fallback give the same attention for the same keys."""
    spec = make_decode_spec(
        "contiguous",
        None,
        dtype="fp32",
        max_query_tokens=4,
        kernels=["prefill", "varlen", "decode"],
        **ALIBI_NONE,
    )
    cache = make_cache(spec, [23], seed=3)
    q, _, _, slopes = make_queries(spec, 1, 4, seed=3)
    decoded, decoded_lse = run_decode(load_decode(spec, 16), cache, q, slopes=slopes)
    assert not decode_problems(spec, cache, decoded, decoded_lse, q, slopes=slopes)
    k, v = cache.dense_k[0][None], cache.dense_v[0][None]
    prefill = load_kernel(spec, 16, 16).attention(q, k, v, alibi_slopes=slopes)
    packed = _varlen(spec).attention_varlen(
        q[0].transpose(0, 1),
        k[0].transpose(0, 1),
        v[0].transpose(0, 1),
        cu_seqlens([4]),
        cu_seqlens([23]),
        4,
        23,
        alibi_slopes=slopes,
    )
    fallback = torch_attention(q, k, v, mask="none", alibi_slopes=slopes)
    # fp32 kernels against each other and fp32 torch: the same math, reassociated (key tiles
    # and splits): a few fp32 ulps of the output's magnitude (|out| < 4 here).
    for other in (prefill, packed.transpose(0, 1)[None], fallback):
        torch.testing.assert_close(other, decoded, rtol=0, atol=1e-5)


# -- windows up to 2**31 - 1: no int32 overflow ---------------------------------------------


@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
@pytest.mark.parametrize(
    "left, right",
    [(LIMITS[0], LIMITS[0]), (LIMITS[1], 0), (0, LIMITS[1]), (LIMITS[2], 3), (5, LIMITS[2])],
)
def test_prefill_windows_at_the_int32_limit(align, left, right):
    spec = make_spec(
        mask="sliding_window", causal_align=align, window_left=left, window_right=right
    )
    q, k, v, _ = make_inputs(spec, 1, 20, 37, seed=4)
    out, lse = load_kernel(spec, 16, 16).attention(q, k, v, return_lse=True)
    assert_matches_reference(spec, out, lse, q, k, v)


@pytest.mark.parametrize("left, right", [(LIMITS[0], LIMITS[0]), (LIMITS[1], 0), (LIMITS[2], 1)])
def test_varlen_windows_at_the_int32_limit(left, right):
    spec = make_spec(
        mask="sliding_window",
        causal_align="bottom_right",
        window_left=left,
        window_right=right,
        kernels=["varlen"],
    )
    lengths_q, lengths_k = [20, 1, 17], [37, 16, 3]
    q, k, v, _ = packed_inputs(spec, lengths_q, lengths_k, seed=5)
    out, lse = _varlen(spec).attention_varlen(
        q, k, v, cu_seqlens(lengths_q), cu_seqlens(lengths_k), 20, 37, return_lse=True
    )
    assert_each_sequence_matches(spec, out, lse, q, k, v, lengths_q, lengths_k, None)


@pytest.mark.parametrize("layout, page_size", [("contiguous", None), ("paged", 4)])
@pytest.mark.parametrize("left", LIMITS)
def test_decode_windows_at_the_int32_limit(layout, page_size, left):
    spec = make_decode_spec(
        layout,
        page_size,
        mask="sliding_window",
        causal_align="bottom_right",
        window_left=left,
        window_right=left,
        max_query_tokens=2,
    )
    kernel = load_decode(spec, 16)
    cache = make_cache(spec, [37, 1, 0], seed=6, room=3)
    q, k_new, v_new, _ = make_queries(spec, 3, 2, seed=6, num_new=3)
    reference_cache = cache.clone()
    for splits in (1, 3):
        kernel.FORCE_NUM_SPLITS = splits
        try:
            out, lse = run_decode(kernel, cache.clone(), q, k_new, v_new)
        finally:
            kernel.FORCE_NUM_SPLITS = None
        assert not decode_problems(spec, reference_cache, out, lse, q, k_new, v_new), splits


# -- index and slope tensors: contiguous, or a ValueError ------------------------------------


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values at stride 2."""
    wide = torch.zeros(2 * t.numel(), dtype=t.dtype, device=t.device)
    wide[::2] = t
    return wide[::2]


def test_prefill_refuses_non_contiguous_slopes():
    spec = make_spec(**ALIBI_NONE)
    q, k, v, slopes = make_inputs(spec, 1, 4, 4, seed=7)
    with pytest.raises(ValueError, match=r"alibi_slopes: expected a contiguous tensor"):
        load_kernel(spec, 16, 16).attention(q, k, v, alibi_slopes=_strided(slopes))


@pytest.mark.parametrize("name", ["cu_seqlens_q", "cu_seqlens_k", "seqused_k", "alibi_slopes"])
def test_varlen_refuses_non_contiguous_index_tensors(name):
    spec = make_spec(**ALIBI_NONE, kernels=["varlen"])
    q, k, v, slopes = packed_inputs(spec, [3, 4], [5, 6], seed=8)
    args = dict(
        cu_seqlens_q=cu_seqlens([3, 4]),
        cu_seqlens_k=cu_seqlens([5, 6]),
        seqused_k=torch.tensor([5, 6], dtype=torch.int32),
        alibi_slopes=slopes,
    )
    args[name] = _strided(args[name])
    with pytest.raises(ValueError, match=rf"{name}: expected a contiguous tensor"):
        _varlen(spec).attention_varlen(
            q, k, v, args.pop("cu_seqlens_q"), args.pop("cu_seqlens_k"), 4, 6, **args
        )


@pytest.mark.parametrize("name", ["cache_seqlens", "alibi_slopes"])
def test_decode_refuses_non_contiguous_index_tensors(name):
    spec = make_decode_spec("paged", 4, **ALIBI_NONE)
    cache = make_cache(spec, [5, 9], seed=9)
    q, _, _, slopes = make_queries(spec, 2, 1, seed=9)
    args = dict(cache_seqlens=cache.lengths, alibi_slopes=slopes)
    args[name] = _strided(args[name])
    with pytest.raises(ValueError, match=rf"{name}: expected a contiguous tensor"):
        load_decode(spec, 16).decode(
            q, cache.k, cache.v, args.pop("cache_seqlens"), block_table=cache.block_table, **args
        )


def test_decode_honours_block_table_strides():
    spec = make_decode_spec("paged", 4, max_query_tokens=2)
    kernel = load_decode(spec, 16)
    cache = make_cache(spec, [13, 30], seed=10)
    q, *_ = make_queries(spec, 2, 2, seed=10)
    expected = run_decode(kernel, cache, q)
    transposed = cache.clone()
    transposed.block_table = cache.block_table.t().contiguous().t()
    assert not transposed.block_table.is_contiguous()
    got = run_decode(kernel, transposed, q)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


# -- numerics ----------------------------------------------------------------------------------


def _minus_inf_first_block(spec, q, k):
    """Scores of keys 0..15 become -inf for every row: -inf in their first feature, and a
    positive first feature in every query. SDPA and the reference are finite there."""
    q = q.clone()
    k = k.clone()
    q[..., 0] = q[..., 0].abs() + 0.5
    k[..., :16, 0] = float("-inf")
    return q, k


def test_a_key_block_that_is_all_minus_inf_for_a_row_is_not_nan_in_prefill_and_varlen():
    spec = make_spec(mask="none", kernels=["prefill", "varlen"])
    q, k, v, _ = make_inputs(spec, 1, 5, 40, seed=11)
    q, k = _minus_inf_first_block(spec, q, k)
    out, lse = load_kernel(spec, 16, 16).attention(q, k, v, return_lse=True)
    golden, _ = reference_attention(spec, q, k, v)
    assert torch.isfinite(golden).all()
    assert_matches_reference(spec, out, lse, q, k, v)
    heads_last = [t[0].transpose(0, 1) for t in (q, k, v)]
    out, lse = _varlen(spec).attention_varlen(
        *heads_last, cu_seqlens([5]), cu_seqlens([40]), 5, 40, return_lse=True
    )
    assert_each_sequence_matches(spec, out, lse, *heads_last, [5], [40], None)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_fp32_kernels_launch_without_fp_contraction(monkeypatch, dtype):
    """Contracted, the exponent s x qk - m of the row's largest score is the rounding error of
    m, which overflows exp2 at fp32 scores near 1e10 on the GPU (tests/test_safety_gpu.py
    shows it; the interpreter never contracts, so here the launch option is what is checked).
    16-bit kernels keep the fused fast path."""
    spec = make_decode_spec(
        "contiguous", None, dtype=dtype, mask="none", kernels=["prefill", "varlen", "decode"]
    )
    prefill, varlen = load_kernel(spec, 16, 16), _varlen(spec)
    decode = load_decode(spec, 16)
    launches = []
    for module, kernel in (
        (prefill, "_attn_fwd_kernel"),
        (varlen, "_attn_fwd_kernel"),
        (decode, "_decode_split_kernel"),
    ):
        jit = getattr(module, kernel)
        monkeypatch.setattr(
            jit,
            "run",
            lambda *a, _run=jit.run, **kw: (
                launches.append(kw.get("enable_fp_fusion", True)),
                _run(*a, **kw),
            )[1],
        )
    q, k, v, _ = make_inputs(spec, 1, 3, 5, seed=12)
    prefill.attention(q, k, v)
    packed = [t[0].transpose(0, 1) for t in (q, k, v)]
    varlen.attention_varlen(*packed, cu_seqlens([3]), cu_seqlens([5]), 3, 5)
    decode.decode(q[:, :, :1], k, v, torch.tensor([5], dtype=torch.int32))
    assert launches == [dtype != "fp32"] * 3


def test_fp32_scores_near_1e10_match_the_reference():
    spec = make_spec(dtype="fp32", mask="none")
    q, k, v, _ = make_inputs(spec, 1, 32, 40, seed=12, scale=1e10)
    out, lse = load_kernel(spec, 16, 16).attention(q, k, v, return_lse=True)
    assert_matches_reference(spec, out, lse, q, k, v)
