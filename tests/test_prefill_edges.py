"""Pinned edge cases of the prefill kernel (shared/RELIABILITY.md), on the CPU interpreter.

The same tests run on the H200 under `pytest -m gpu` through tests/test_prefill_gpu.py, which
reuses these helpers at real sizes.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernel_harness import assert_matches_reference, load_kernel, make_inputs, make_spec

CAUSAL_BR = dict(mask="causal", causal_align="bottom_right")


def run(spec, q, k, v, slopes=None, blocks=(16, 16), **kwargs):
    kernel = load_kernel(spec, *blocks)
    return kernel.attention(q, k, v, alibi_slopes=slopes, return_lse=True, **kwargs)


@pytest.mark.parametrize(
    "fields, seqlen_q, seqlen_k",
    [
        (CAUSAL_BR, 40, 17),  # Nq > Nk bottom-right: the first 23 rows see nothing
        (
            dict(mask="sliding_window", causal_align="top_left", window_left=0, window_right=0),
            30,
            5,
        ),
        (dict(mask="causal", causal_align="top_left"), 5, 0),  # zero-length keys
        (dict(mask="none"), 9, 0),
    ],
)
def test_fully_masked_rows_are_zero_with_lse_minus_inf(fields, seqlen_q, seqlen_k):
    spec = make_spec(**fields)
    q, k, v, _ = make_inputs(spec, 2, seqlen_q, seqlen_k, seed=3)
    out, lse = run(spec, q, k, v)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.isinf(lse).any()
    assert torch.all(out[torch.isinf(lse)] == 0)
    assert_matches_reference(spec, out, lse, q, k, v)


@pytest.mark.parametrize("batch, seqlen_q, seqlen_k", [(0, 8, 8), (2, 0, 8), (0, 0, 0)])
def test_empty_inputs_give_empty_outputs(batch, seqlen_q, seqlen_k):
    spec = make_spec(**CAUSAL_BR)
    q, k, v, _ = make_inputs(spec, batch, seqlen_q, seqlen_k, seed=0)
    out, lse = run(spec, q, k, v)
    assert out.shape == (batch, 4, seqlen_q, 64) and lse.shape == (batch, 4, seqlen_q)


@pytest.mark.parametrize("seqlen", [1, 15, 16, 17, 31])
@pytest.mark.parametrize("head_dim", [40, 80, 96, 200])
def test_lengths_at_block_boundaries_and_odd_head_dims(seqlen, head_dim):
    spec = make_spec(head_dim=head_dim, **CAUSAL_BR)
    q, k, v, _ = make_inputs(spec, 1, seqlen, seqlen + 2, seed=seqlen)
    assert_matches_reference(spec, *run(spec, q, k, v), q, k, v)


@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(7, 1), (14, 2), (8, 1), (3, 3)])
def test_gqa_and_mqa(num_q_heads, num_kv_heads):
    spec = make_spec(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, **CAUSAL_BR)
    q, k, v, _ = make_inputs(spec, 2, 20, 20, seed=1)
    assert_matches_reference(spec, *run(spec, q, k, v), q, k, v)
    # Query head h reads KV head h // group (repeat_interleave): swapping KV heads must matter.
    if num_kv_heads > 1:
        out_swapped, _ = run(spec, q, k.flip(1), v.flip(1))
        assert not torch.equal(out_swapped, run(spec, q, k, v)[0])


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_scores_near_1e4_stay_finite(dtype):
    spec = make_spec(dtype=dtype, **CAUSAL_BR)
    q, k, v, _ = make_inputs(spec, 1, 33, 33, seed=5)
    # |q.k| * scale reaches ~1e4: q scaled so that the largest score is 1e4.
    k_per_q = k.float().repeat_interleave(2, dim=1)
    scores = (q.float() @ k_per_q.transpose(-1, -2)).abs().max().item() / math.sqrt(64)
    q = (q.float() * (1e4 / scores)).to(q.dtype)
    out, lse = run(spec, q, k, v)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_matches_reference(spec, out, lse, q, k, v)


@pytest.mark.parametrize(
    "fields",
    [
        CAUSAL_BR,
        dict(mask="causal", causal_align="top_left"),
        dict(mask="sliding_window", causal_align="bottom_right", window_left=5, window_right=0),
        dict(mask="none"),
    ],
)
# Blocks: 16-row tiles load masked blocks through pointers; 64-row tiles (Hopper's wgmma path)
# through TMA, which reads the invisible keys too and must zero or mask them in registers.
@pytest.mark.parametrize("blocks", [(16, 16), (64, 32)])
def test_nan_beyond_lengths_and_in_masked_keys_leaves_output_bitwise_unchanged(fields, blocks):
    spec = make_spec(**fields)
    q, k, v, _ = make_inputs(spec, 1, 19, 35, seed=7)
    clean = run(spec, q, k, v, blocks=blocks)
    # The same tensors as views into NaN-padded buffers (beyond the logical lengths).
    k_pad = torch.full((1, 2, 64, 64), float("nan"), dtype=k.dtype)
    v_pad = torch.full((1, 2, 64, 64), float("nan"), dtype=v.dtype)
    k_pad[:, :, :35] = k
    v_pad[:, :, :35] = v
    padded = run(spec, q, k_pad[:, :, :35], v_pad[:, :, :35], blocks=blocks)
    assert torch.equal(clean[0], padded[0]) and torch.equal(clean[1], padded[1])
    # NaN in keys that no query row may see (top-left causal: keys past the last query row;
    # a window: keys left of every row's window) must not reach the output either.
    from attngen.reference import visible_mask

    unseen = ~visible_mask(spec, 19, 35).any(dim=0)
    if unseen.any():
        k_nan, v_nan = k.clone(), v.clone()
        k_nan[:, :, unseen] = float("nan")
        v_nan[:, :, unseen] = float("inf")
        poisoned = run(spec, q, k_nan, v_nan, blocks=blocks)
        assert torch.equal(clean[0], poisoned[0]) and torch.equal(clean[1], poisoned[1])


def test_forward_is_bitwise_deterministic():
    spec = make_spec(dtype="bf16", softcap=30.0, **CAUSAL_BR)
    q, k, v, _ = make_inputs(spec, 2, 45, 45, seed=11)
    first = run(spec, q, k, v)
    for _ in range(2):
        again = run(spec, q, k, v)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def test_strided_transposed_and_offset_inputs_match_contiguous():
    spec = make_spec(head_dim=40, **CAUSAL_BR)
    q, k, v, _ = make_inputs(spec, 2, 21, 26, seed=2)
    expected = run(spec, q, k, v)
    # [B, N, H, D] storage viewed as [B, H, N, D], plus a storage offset via slicing.
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)
    big = torch.zeros(2, 3, 26, 48, dtype=k.dtype)
    big[:, 1:, :, 4:44] = k
    k_off = big[:, 1:, :, 4:44]
    v_t = v.transpose(1, 2).contiguous().transpose(1, 2)
    got = run(spec, q_t, k_off, v_t)
    assert not k_off.is_contiguous() and k_off.storage_offset() > 0
    assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])
    print("far offsets ok")


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda q, k, v: (q.float(), k, v), "dtype"),
        (lambda q, k, v: (q[0], k, v), "rank 4"),
        (lambda q, k, v: (q[..., :32], k, v), "head dim"),
        (lambda q, k, v: (q[:, :3], k, v), "multiple of k/v heads"),
        (lambda q, k, v: (q, k[:1], v[:1]), "batch"),
        (lambda q, k, v: (q, k, v[:, :, :5]), "same heads and length"),
    ],
)
def test_bad_inputs_raise_value_errors_saying_what_was_expected(mutate, message):
    spec = make_spec(**CAUSAL_BR)
    q, k, v, _ = make_inputs(spec, 2, 8, 8, seed=0)
    with pytest.raises(ValueError, match=message):
        load_kernel(spec, 16, 16).attention(*mutate(q, k, v))


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), True, "0.1"])
def test_bad_sm_scale_is_refused(bad):
    spec = make_spec(**CAUSAL_BR)
    q, k, v, _ = make_inputs(spec, 1, 4, 4, seed=0)
    with pytest.raises(ValueError, match="sm_scale"):
        load_kernel(spec, 16, 16).attention(q, k, v, sm_scale=bad)


def test_alibi_slopes_required_exactly_when_built_with_alibi():
    with_alibi = make_spec(alibi=True, **CAUSAL_BR)
    without = make_spec(**CAUSAL_BR)
    q, k, v, slopes = make_inputs(with_alibi, 1, 4, 4, seed=0)
    with pytest.raises(ValueError, match="alibi_slopes"):
        load_kernel(with_alibi, 16, 16).attention(q, k, v)
    with pytest.raises(ValueError, match="alibi_slopes"):
        load_kernel(with_alibi, 16, 16).attention(q, k, v, alibi_slopes=slopes[:2])
    with pytest.raises(ValueError, match="alibi_slopes"):
        load_kernel(without, 16, 16).attention(q, k, v, alibi_slopes=slopes)


def test_offsets_past_2_31_elements_do_not_wrap():
    # A wrapped offset reads a wild address and can kill the interpreter, so the check runs in
    # a child process: a crash there is a clean failure here.
    code = "from tests.test_prefill_edges import check_far_offsets; check_far_offsets()"
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
    # Rows 2**26 elements apart: row 32 of K sits 2**31 elements from the start, so a row
    # offset computed in int32 (key_pos * stride) would wrap. The storage is reserved but only
    # the rows used are touched, so this needs a few pages of memory, not 6 GB.
    spec = make_spec(dtype="fp16", head_dim=64, num_q_heads=1, num_kv_heads=1, **CAUSAL_BR)
    q, k, v, _ = make_inputs(spec, 1, 40, 40, seed=8)
    row = 2**26
    storage = torch.empty(40 * row + 64, dtype=torch.float16)
    k_far = storage.as_strided((1, 1, 40, 64), (40 * row, 40 * row, row, 1))
    v_far = storage.as_strided((1, 1, 40, 64), (40 * row, 40 * row, row, 1), storage_offset=64)
    assert k_far.stride(2) * 39 > 2**31
    k_far.copy_(k)
    v_far.copy_(v)
    expected = run(spec, q, k, v)
    got = run(spec, q, k_far, v_far)
    assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])
    del storage, k_far, v_far
    # The same for the query rows read and the output rows written (row * stride_qm and
    # row * stride_om): a context-parallel rank's q and out pass 2**31 elements at long N.
    # (the module refuses an out sharing q's storage: two of them).
    q_far, out_far = (
        torch.empty(40 * row, dtype=torch.float16).as_strided((1, 1, 40, 64), (0, 0, row, 1))
        for _ in "qo"
    )
    assert q_far.stride(2) * 39 > 2**31 and out_far.stride(2) * 39 > 2**31
    q_far.copy_(q)
    got = run(spec, q_far, k, v, out=out_far)
    assert got[0] is out_far
    assert torch.equal(expected[0], out_far) and torch.equal(expected[1], got[1])
    print("far offsets ok")


@pytest.mark.parametrize("mask", [dict(mask="none"), CAUSAL_BR])
def test_hopper_modules_load_kv_by_tma_or_say_why_not(mask):
    """sm90 modules read the unmasked K/V blocks through tensor descriptors when the layout
    allows it, else through pointers; the module says which, and both paths are exact."""
    spec = make_spec(head_dim=64, **mask)
    kernel = load_kernel(spec, 16, 16)  # sm90
    q, k, v, _ = make_inputs(spec, 2, 50, 70, seed=11)
    assert kernel.kv_load_path(k, v) == "tma"
    # Rows 68 elements (136 B) apart: not a 16-byte multiple, so no descriptor can describe it.
    wide_k = torch.zeros(*k.shape[:3], 68, dtype=k.dtype)
    wide_k[..., :64] = k
    strided_k = wide_k[..., :64]
    assert kernel.kv_load_path(strided_k, v).startswith("pointers: k strides")
    assert kernel.kv_load_path(k.transpose(2, 3).contiguous().transpose(2, 3), v) == (
        f"pointers: k head-dim stride is {k.shape[2]}, not 1"
    )
    assert kernel.kv_load_path(k[:, :, :0], v[:, :, :0]) == "pointers: k has no keys"
    by_tma = kernel.attention(q, k, v, return_lse=True)
    by_pointers = kernel.attention(q, strided_k, v, return_lse=True)
    for out, lse in (by_tma, by_pointers):
        assert_matches_reference(spec, out, lse, q, k, v)
    assert torch.equal(by_tma[0], by_pointers[0])  # fp16 dots: the same products and sums
    assert not hasattr(
        load_kernel(make_spec(head_dim=64, archs=["sm80"], **mask), 16, 16, arch="sm80"),
        "kv_load_path",
    )  # no TMA before Hopper


@pytest.mark.parametrize("batch", [1, 5])  # 4 heads: one partial group; 16 + 4 heads: two
def test_grouped_causal_schedule_covers_every_tile_once(batch):
    """Causal sm90 modules with D > 128 order programs longest-processing-time first in groups
    of 16 heads; every (batch, head, query block) must still be computed once, the last group
    short or not: a missed tile leaves torch.empty garbage, a doubled one races."""
    spec = make_spec(head_dim=160, num_q_heads=4, num_kv_heads=2, **CAUSAL_BR)
    kernel = load_kernel(spec, 16, 16)
    assert "group_programs = 16 * num_m_blocks" in Path(kernel.__file__).read_text()
    q, k, v, _ = make_inputs(spec, batch, 41, 57, seed=12)  # 3 query blocks, 4 key blocks
    out, lse = kernel.attention(q, k, v, return_lse=True)
    assert_matches_reference(spec, out, lse, q, k, v)
    narrow = load_kernel(make_spec(head_dim=128, **CAUSAL_BR), 16, 16)
    assert "group_programs" not in Path(narrow.__file__).read_text()  # D <= 128: head by head
