"""flash-attn 2.x's surface beyond flash_attn_func: the packed forms, and
flash_attn_with_kvcache's rotary embedding, cache_batch_idx, cache_leftpad and num_splits,
each against flash-attn's documented semantics (toy fp32 kernels, d16, causal)."""

from __future__ import annotations

import pytest
import torch

import attngen
from tests.ondemand_harness import on_demand  # noqa: F401
from tests.runtime_harness import toy_kernels  # noqa: F401

D = 16


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------ packed


def test_packed_forms_equal_the_unpacked_calls(toy_kernels):  # noqa: F811
    qkv = _randn(2, 9, 3, 4, D)
    out, lse, _ = attngen.flash_attn_qkvpacked_func(qkv, causal=True, return_attn_probs=True)
    ref, ref_lse, _ = attngen.flash_attn_func(*qkv.unbind(2), causal=True, return_attn_probs=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    q, kv = _randn(2, 5, 4, D, seed=1), _randn(2, 9, 2, 2, D, seed=2)  # GQA 4:2
    assert torch.equal(
        attngen.flash_attn_kvpacked_func(q, kv, causal=True),
        attngen.flash_attn_func(q, *kv.unbind(2), causal=True),
    )
    cu = torch.tensor([0, 4, 11], dtype=torch.int32)
    packed = _randn(11, 3, 4, D, seed=3)
    assert torch.equal(
        attngen.flash_attn_varlen_qkvpacked_func(packed, cu, 7, causal=True),
        attngen.flash_attn_varlen_func(*packed.unbind(1), cu, cu, 7, 7, causal=True),
    )
    cu_k = torch.tensor([0, 6, 13], dtype=torch.int32)
    q, kv = _randn(11, 4, D, seed=4), _randn(13, 2, 2, D, seed=5)
    assert torch.equal(
        attngen.flash_attn_varlen_kvpacked_func(q, kv, cu, cu_k, 7, 7, causal=True),
        attngen.flash_attn_varlen_func(q, *kv.unbind(1), cu, cu_k, 7, 7, causal=True),
    )


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: attngen.flash_attn_qkvpacked_func(torch.zeros(2, 9, 2, 4, D)),
            r"qkv: expected a rank-5 tensor \[batch, seqlen, 3, nheads, headdim\], got \[2, 9, 2",
        ),
        (
            lambda: attngen.flash_attn_kvpacked_func(
                torch.zeros(1, 2, 4, D), torch.zeros(1, 2, 2, D)
            ),
            r"kv: expected a rank-5 tensor \[batch, seqlen_k, 2, nheads_k, headdim\]",
        ),
        (
            lambda: attngen.flash_attn_varlen_qkvpacked_func(None, None, 1),
            r"qkv: expected a rank-4 tensor \[total, 3, nheads, headdim\], got NoneType",
        ),
    ],
)
def test_packed_forms_name_a_wrong_packed_tensor(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---------------------------------------------------------------------- kvcache options


def _cache(batch=2, length=12, seed=0):
    k_cache, v_cache = (
        _randn(batch, length, 2, D, seed=seed),
        _randn(batch, length, 2, D, seed=seed + 1),
    )
    return k_cache, v_cache


def _rotate_half_reference(x, cos, sin, positions, interleaved):
    """flash-attn's apply_rotary_emb_torch: x * cos + rotate_half(x) * sin on the first
    rotary_dim dims, in float64 (cos/sin repeated per pair, or per half)."""
    rd = 2 * cos.shape[1]
    c, s = cos.double()[positions][:, :, None], sin.double()[positions][:, :, None]
    if interleaved:
        c, s = c.repeat_interleave(2, -1), s.repeat_interleave(2, -1)
        x1, x2 = x[..., :rd:2].double(), x[..., 1:rd:2].double()
        rotated_half = torch.stack((-x2, x1), -1).flatten(-2)
    else:
        c, s = torch.cat((c, c), -1), torch.cat((s, s), -1)
        x1, x2 = x[..., : rd // 2].double(), x[..., rd // 2 : rd].double()
        rotated_half = torch.cat((-x2, x1), -1)
    out = x.double().clone()
    out[..., :rd] = x[..., :rd].double() * c + rotated_half * s
    return out.to(x.dtype)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_rotates_q_and_the_appended_k_as_flash_attn(toy_kernels, interleaved):  # noqa: F811
    k_cache, v_cache = _cache()
    q, k, v = _randn(2, 2, 4, D, seed=7), _randn(2, 2, 2, D, seed=8), _randn(2, 2, 2, D, seed=9)
    angles = _randn(12, 4, seed=10)  # rotary_dim 8 of 16
    cos, sin = angles.cos(), angles.sin()
    lengths = torch.tensor([3, 7], dtype=torch.int32)
    positions = lengths.long()[:, None] + torch.arange(2)
    plain_k, plain_v = k_cache.clone(), v_cache.clone()
    out = attngen.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cos, sin, lengths, causal=True, rotary_interleaved=interleaved
    )
    k_rot = _rotate_half_reference(k, cos, sin, positions, interleaved)
    q_rot = _rotate_half_reference(q, cos, sin, positions, interleaved)
    for b in range(2):  # the cache holds the rotated keys, exactly as the reference rounds them
        # fp32: the rotation in float then cast, against the reference's own rounding: one or two
        # ulps of |k| < 8 (2e-6).
        torch.testing.assert_close(
            k_cache[b, lengths[b] : lengths[b] + 2], k_rot[b], rtol=0, atol=2e-6
        )
    expected = attngen.flash_attn_with_kvcache(
        q_rot, plain_k, plain_v, k_rot, v, None, None, lengths, causal=True
    )
    # fp32 attention over inputs that differ by those ulps (q rotated in the call vs before it):
    # the softmax carries them to a few ulps of the logits' scale, well under 1e-5 at |out| < 4.
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)


def test_rotary_without_causal_or_window_puts_every_query_at_cache_seqlens(on_demand):  # noqa: F811
    k_cache, v_cache = _cache()
    q, k, v = _randn(2, 2, 4, D, seed=7), _randn(2, 2, 2, D, seed=8), _randn(2, 2, 2, D, seed=9)
    angles = _randn(12, 8, seed=10)  # rotary over all 16 dims
    cos, sin = angles.cos(), angles.sin()
    lengths = torch.tensor([3, 7], dtype=torch.int32)
    plain_k, plain_v = k_cache.clone(), v_cache.clone()
    out = attngen.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, lengths)
    still = _rotate_half_reference(q, cos, sin, lengths.long()[:, None].expand(-1, 2), True)
    k_rot = _rotate_half_reference(k, cos, sin, lengths.long()[:, None] + torch.arange(2), True)
    expected = attngen.flash_attn_with_kvcache(
        still, plain_k, plain_v, k_rot, v, cache_seqlens=lengths
    )
    # As above: rotated-input ulps carried through an fp32 softmax.
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)


def test_cache_batch_idx_reads_and_appends_the_indexed_rows(toy_kernels):  # noqa: F811
    k_cache, v_cache = _cache(batch=3)
    idx = torch.tensor([2, 0], dtype=torch.int32)
    q, k, v = _randn(2, 1, 4, D, seed=3), _randn(2, 1, 2, D, seed=4), _randn(2, 1, 2, D, seed=5)
    lengths = torch.tensor([5, 9], dtype=torch.int32)
    gathered_k, gathered_v = k_cache[idx.long()].clone(), v_cache[idx.long()].clone()
    untouched = k_cache[1].clone()
    out = attngen.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=lengths, cache_batch_idx=idx, causal=True
    )
    expected = attngen.flash_attn_with_kvcache(
        q, gathered_k, gathered_v, k, v, cache_seqlens=lengths, causal=True
    )
    assert torch.equal(out, expected)
    assert torch.equal(k_cache[2, 5], k[0, 0]) and torch.equal(k_cache[0, 9], k[1, 0])
    assert torch.equal(k_cache[1], untouched)


def test_cache_leftpad_starts_each_sequence_at_its_pad(toy_kernels):  # noqa: F811
    k_cache, v_cache = _cache()
    leftpad = torch.tensor([2, 0], dtype=torch.int32)
    lengths = torch.tensor([7, 5], dtype=torch.int32)
    q, k, v = _randn(2, 1, 4, D, seed=6), _randn(2, 1, 2, D, seed=7), _randn(2, 1, 2, D, seed=8)
    shifted_k, shifted_v = k_cache.clone(), v_cache.clone()
    shifted_k[0, :10], shifted_v[0, :10] = k_cache[0, 2:], v_cache[0, 2:]  # row 0 from its pad
    out = attngen.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=lengths, cache_leftpad=leftpad, causal=True
    )
    expected = attngen.flash_attn_with_kvcache(
        q, shifted_k, shifted_v, k, v, cache_seqlens=lengths - leftpad, causal=True
    )
    # fp32, the same keys read from another offset: the same sums in another tile order,
    # a few ulps of |out| < 4 (1e-6).
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    assert torch.equal(k_cache[0, 7], k[0, 0])  # appended at cache_seqlens, not after the pad


def test_num_splits_is_a_hint_where_only_the_varlen_kind_serves(toy_kernels):  # noqa: F811
    """The toy registry has no decode module: the varlen kind, which has no split of the
    keys, runs every count unsplit (tests/test_kvcache_splits.py: the decode kind's splits)."""
    k_cache, v_cache = _cache()
    q = _randn(2, 1, 4, D, seed=1)
    lengths = torch.tensor([4, 12], dtype=torch.int32)
    default = attngen.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lengths, causal=True
    )
    for requested in (1, 4):
        split = attngen.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=lengths, causal=True, num_splits=requested
        )
        assert torch.equal(split, default) and attngen.last_dispatch().need.kind.value == "varlen"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(rotary_cos=torch.ones(12, 4)), "rotary_sin: pass rotary_cos and rotary_sin together"),
        (
            dict(rotary_cos=torch.ones(12, 4), rotary_sin=torch.ones(12, 4)),
            "rotary_cos: rotary embedding is applied to the appended k",
        ),
        (dict(cache_batch_idx=torch.tensor([0, 1])), r"cache_batch_idx: expected an int32 tensor"),
        (
            dict(
                cache_leftpad=torch.zeros(2, dtype=torch.int32),
                block_table=torch.zeros(2, 3, dtype=torch.int32),
            ),
            "cache_leftpad: not supported with block_table",
        ),
        (dict(num_splits=-1), "num_splits: got -1; allowed: an int >= 0"),
    ],
)
def test_kvcache_options_name_what_is_wrong(toy_kernels, kwargs, message):  # noqa: F811
    k_cache, v_cache = _cache()
    if "block_table" in kwargs:
        k_cache, v_cache = k_cache.reshape(6, 4, 2, D), v_cache.reshape(6, 4, 2, D)
    with pytest.raises(ValueError, match=message):
        attngen.flash_attn_with_kvcache(_randn(2, 1, 4, D), k_cache, v_cache, **kwargs)


def test_rotary_needs_a_row_per_cache_position(toy_kernels):  # noqa: F811
    k_cache, v_cache = _cache()
    k = _randn(2, 1, 2, D)
    with pytest.raises(
        ValueError,
        match=r"rotary_cos: expected a torch.float32 tensor "
        r"\[seqlen_ro >= 12",
    ):
        attngen.flash_attn_with_kvcache(
            _randn(2, 1, 4, D), k_cache, v_cache, k, k, torch.ones(11, 4), torch.ones(11, 4), 3
        )


# ------------------------------------------------------------------------------ paged varlen


def test_varlen_block_table_reads_each_sequence_from_its_pages(toy_kernels):  # noqa: F811
    page_size, lengths = 4, [6, 0, 11]
    cu_k = torch.tensor([0, 6, 6, 17], dtype=torch.int32)
    cu_q = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    q = _randn(9, 4, D, seed=1)
    k_pages, v_pages = _randn(9, page_size, 2, D, seed=2), _randn(9, page_size, 2, D, seed=3)
    table = torch.tensor([[7, 2, 0], [1, 1, 1], [5, 8, 3]], dtype=torch.int32)
    packed_k = torch.cat(
        [k_pages[table[b].long()].reshape(-1, 2, D)[:n] for b, n in enumerate(lengths)]
    )
    packed_v = torch.cat(
        [v_pages[table[b].long()].reshape(-1, 2, D)[:n] for b, n in enumerate(lengths)]
    )
    expected = attngen.flash_attn_varlen_func(q, packed_k, packed_v, cu_q, cu_k, 5, 11, causal=True)
    out = attngen.flash_attn_varlen_func(
        q, k_pages, v_pages, cu_q, cu_k, 5, 11, causal=True, block_table=table
    )
    # fp32, pages gathered into rows: the same sums in another tile order, a few ulps of
    # |out| < 4 (1e-6).
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


def test_varlen_block_table_gives_nan_to_a_sequence_whose_pages_do_not_fit(toy_kernels):  # noqa: F811
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    q = _randn(6, 4, D, seed=1)
    k_pages, v_pages = _randn(4, 4, 2, D, seed=2), _randn(4, 4, 2, D, seed=3)
    table = torch.tensor([[0], [9]], dtype=torch.int32)  # page 9 is not the cache's
    out = attngen.flash_attn_varlen_func(
        q, k_pages, v_pages, cu, cu, 3, 3, causal=True, block_table=table
    )
    assert torch.isfinite(out[:3]).all() and torch.isnan(out[3:]).all()
    with pytest.raises(ValueError, match=r"block_table: expected an int32 tensor \[B, max_pages\]"):
        attngen.flash_attn_varlen_func(q, k_pages, v_pages, cu, cu, 3, 3, block_table=table.long())
