"""The float64 reference itself, checked against torch's SDPA wherever SDPA can express the case."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attngen.reference import (
    compare_to_reference,
    lowp_reference,
    reference_attention,
    visible_mask,
)
from tests.kernel_harness import make_spec


def _inputs(hq=4, hkv=2, nq=13, nk=21, d=16, dv=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, hq, nq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(2, hkv, nk, d, generator=gen, dtype=torch.float64)
    v = torch.randn(2, hkv, nk, dv, generator=gen, dtype=torch.float64)
    return q, k, v


def _sdpa(q, k, v, **kwargs):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1], **kwargs)


def test_no_mask_and_gqa_match_sdpa():
    q, k, v = _inputs(hq=14, hkv=2)
    out, lse = reference_attention(make_spec(mask="none", num_q_heads=14, num_kv_heads=2), q, k, v)
    torch.testing.assert_close(out, _sdpa(q, k, v), rtol=1e-12, atol=1e-12)
    scores = q @ k.repeat_interleave(7, dim=1).transpose(-1, -2) / math.sqrt(16)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-12, atol=1e-12)


def test_top_left_causal_is_sdpa_is_causal():
    q, k, v = _inputs(nq=13, nk=21)
    out, _ = reference_attention(make_spec(mask="causal", causal_align="top_left"), q, k, v)
    torch.testing.assert_close(out, _sdpa(q, k, v, is_causal=True), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "fields",
    [
        dict(mask="causal", causal_align="bottom_right"),
        dict(mask="sliding_window", causal_align="bottom_right", window_left=3, window_right=2),
        dict(mask="sliding_window", causal_align="top_left", window_left=0, window_right=5),
    ],
)
def test_masks_match_sdpa_with_an_explicit_boolean_mask(fields):
    q, k, v = _inputs(nq=9, nk=21)
    spec = make_spec(**fields)
    mask = visible_mask(spec, 9, 21)
    out, _ = reference_attention(spec, q, k, v)
    torch.testing.assert_close(out, _sdpa(q, k, v, attn_mask=mask), rtol=1e-12, atol=1e-12)


def test_bottom_right_alignment_by_hand():
    spec = make_spec(mask="causal", causal_align="bottom_right")
    mask = visible_mask(spec, 2, 4)
    assert mask.tolist() == [[True, True, True, False], [True, True, True, True]]
    spec = make_spec(
        mask="sliding_window", causal_align="bottom_right", window_left=1, window_right=0
    )
    assert visible_mask(spec, 2, 4).tolist() == [
        [False, True, True, False],
        [False, False, True, True],
    ]


def test_alibi_matches_sdpa_with_a_float_bias():
    q, k, v = _inputs(hq=4, hkv=4, nq=7, nk=11)
    spec = make_spec(
        mask="causal", causal_align="bottom_right", num_q_heads=4, num_kv_heads=4, alibi=True
    )
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float32)
    i = torch.arange(7)[:, None] + 4
    j = torch.arange(11)[None, :]
    bias = -slopes.double()[:, None, None] * (i - j).abs()
    bias = bias.masked_fill(j > i, float("-inf"))
    out, _ = reference_attention(spec, q, k, v, alibi_slopes=slopes)
    torch.testing.assert_close(out, _sdpa(q, k, v, attn_mask=bias), rtol=1e-12, atol=1e-12)


def test_softcap_by_hand():
    q, k, v = _inputs(hq=2, hkv=2, nq=3, nk=5)
    spec = make_spec(mask="none", num_q_heads=2, num_kv_heads=2, softcap=2.0)
    scores = q @ k.transpose(-1, -2) / 4.0
    expected = torch.softmax(2.0 * torch.tanh(scores / 2.0), -1) @ v
    out, _ = reference_attention(spec, q, k, v)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_fully_masked_rows_give_zero_and_minus_inf():
    q, k, v = _inputs(nq=6, nk=2)
    out, lse = reference_attention(make_spec(mask="causal", causal_align="bottom_right"), q, k, v)
    assert torch.all(out[:, :, :4] == 0) and torch.all(torch.isneginf(lse[:, :, :4]))
    assert torch.isfinite(lse[:, :, 4:]).all()


def test_lowp_reference_has_a_small_nonzero_error():
    q, k, v = (t.to(torch.bfloat16) for t in _inputs(d=64, dv=64))
    spec = make_spec(dtype="bf16", mask="none")
    golden, _ = reference_attention(spec, q, k, v)
    lowp, _ = lowp_reference(spec, q, k, v)
    error = (lowp.double() - golden).abs().max().item()
    assert lowp.dtype == torch.bfloat16 and 0 < error < 3e-2


def test_the_lse_floor_follows_the_dot_products_partial_sums_and_still_catches_errors():
    """At a large head dim the LSE floor is set by the dot's partial sums (sm_scale x
    sum |q_i k_i|, about sqrt(D) x the scores): a few ulps there pass, a 1e-4 error does not."""
    q, k, v = (t.to(torch.bfloat16) for t in _inputs(hq=4, hkv=1, nq=1, nk=2, d=576, dv=512))
    spec = make_spec(
        dtype="bf16",
        mask="none",
        head_dim=576,
        head_dim_v=512,
        num_q_heads=4,
        num_kv_heads=1,
        kernels=["decode"],
        kv_layout="paged",
        page_size=64,
    )
    out, lse = reference_attention(spec, q, k, v)
    out, lse = out.to(torch.bfloat16), lse.float()
    assert compare_to_reference(spec, out, lse + 2e-6, q, k, v) == []
    problems = compare_to_reference(spec, out, lse + 1e-4, q, k, v)
    assert any(p.startswith("lse: max error") for p in problems), problems


def test_the_oracle_shares_the_runtime_masks_without_importing_the_runtime():
    """reference.py and the torch fallback read one definition of the masks (attngen.spec.masks);
    the oracle must not drag in the runtime package (its registry, Triton)."""
    code = (
        "import sys, attngen.reference; "
        "print(sorted(m for m in ('triton', 'attngen.runtime') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
        timeout=120,
    )
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
    from attngen import reference
    from attngen.spec.masks import visible

    assert reference.visible is visible
