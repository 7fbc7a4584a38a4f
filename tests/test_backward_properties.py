"""dQ, dK, dV of the generated backward kernels against float64 autograd through the reference,
by the rule of shared/RELIABILITY.md (attngen.reference.backward): within 3x the error of the
same math in the kernel's dtype plus a floor of two ulps (four for fp32).

Hypothesis draws the spec (dtype, head dims with padding, mask, alignment, window, softcap,
ALiBi), the GQA ratio, independent block sizes for the forward, dQ and dK/dV kernels (the
ranges must not depend on them), lengths at block boundaries and Nq > Nk (fully masked rows
under bottom-right causal), and a seed for the data.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.backward_harness import Blocks, backward_spec, check_padded, padded_inputs

# A few examples per property in CI (each renders a module and runs three interpreted kernels).
EXAMPLES = max(4, settings.default.max_examples // 4)
BLOCKS = st.sampled_from([16, 32])
LENGTHS = st.sampled_from([1, 15, 16, 17, 31, 32, 33, 48])
HEADS = st.sampled_from([(1, 1), (2, 1), (7, 1), (4, 2)])


@st.composite
def spec_fields(draw, dtypes=("fp32", "fp16")):
    mask = draw(st.sampled_from(["none", "causal", "sliding_window"]))
    head_dim = draw(st.sampled_from([16, 40, 64, 80]))
    fields = dict(
        dtype=draw(st.sampled_from(dtypes)),
        head_dim=head_dim,
        head_dim_v=draw(st.sampled_from([head_dim, 16, 40])),
        mask=mask,
        softcap=draw(st.sampled_from([0.0, 0.0, 5.0, 30.0])),
        alibi=draw(st.booleans()),
    )
    if mask != "none":
        fields["causal_align"] = draw(st.sampled_from(["bottom_right", "top_left"]))
    if mask == "sliding_window":
        fields.update(window_left=draw(st.integers(0, 40)), window_right=draw(st.integers(0, 40)))
    return fields


@st.composite
def blocks(draw):
    return Blocks(
        (draw(BLOCKS), draw(BLOCKS)), (draw(BLOCKS), draw(BLOCKS)), (draw(BLOCKS), draw(BLOCKS))
    )


@st.composite
def cases(draw):
    hq, hkv = draw(HEADS)
    return (
        draw(spec_fields()),
        draw(blocks()),
        draw(st.integers(1, 2)),
        hq,
        hkv,
        draw(LENGTHS),
        draw(LENGTHS),
        draw(st.integers(0, 2**16)),
    )


def _check(fields, blocks, batch, hq, hkv, seqlen_q, seqlen_k, seed, **options):
    spec = backward_spec(num_q_heads=hq, num_kv_heads=hkv, **fields)
    q, k, v, dout, slopes = padded_inputs(
        spec, batch, hq, hkv, seqlen_q, seqlen_k, seed, scale=options.pop("scale", 1.0)
    )
    problems = check_padded(spec, blocks, q, k, v, dout, slopes, **options)
    assert not problems, "; ".join(problems)


@settings(max_examples=EXAMPLES)
@given(cases())
@example(
    (dict(dtype="fp16", mask="causal", causal_align="bottom_right"), Blocks(), 1, 7, 1, 33, 17, 0)
).via("GQA 7:1, more queries than keys: the first 16 rows see no key")
@example(
    (
        dict(
            dtype="fp32",
            head_dim=40,
            head_dim_v=80,
            mask="sliding_window",
            causal_align="top_left",
            window_left=3,
            window_right=1,
            softcap=30.0,
            alibi=True,
        ),
        Blocks((16, 16), (32, 16), (16, 32)),
        2,
        2,
        1,
        17,
        33,
        1,
    )
).via("padded head dims, window, softcap, ALiBi, every block different")
@example((dict(dtype="fp16", mask="none", alibi=True), Blocks(), 1, 2, 2, 31, 48, 2)).via(
    "no mask: ALiBi's distance is bottom-right"
)
def test_gradients_match_float64(case):
    _check(*case)


@pytest.mark.parametrize("head_dim", [80, 96])
def test_padded_head_dims(head_dim):
    """80 and 96 -> 128 of padding, masked on every load and store; GQA 7:1."""
    _check(
        dict(dtype="fp16", head_dim=head_dim, mask="causal", causal_align="bottom_right"),
        Blocks(),
        1,
        7,
        1,
        17,
        20,
        5,
    )


def test_bf16_through_the_interpreter_shim():
    """bf16 (window and softcap) with the test shim (the interpreter's own bf16 math is wrong)."""
    _check(
        dict(
            dtype="bf16",
            mask="sliding_window",
            causal_align="bottom_right",
            window_left=8,
            softcap=30.0,
        ),
        Blocks(),
        1,
        2,
        1,
        33,
        33,
        6,
    )


def test_large_logits_stay_finite():
    """Scores near 1e3 (q scaled by 100): no inf or NaN in any gradient, within the rule."""
    _check(
        dict(dtype="fp32", mask="causal", causal_align="bottom_right"),
        Blocks(),
        1,
        1,
        1,
        17,
        17,
        7,
        scale=100.0,
    )


def test_gradient_through_the_lse():
    """return_lse's LSE is differentiable too (d LSE / d S = P: delta - dLSE)."""
    dlse = torch.randn(1, 2, 33, generator=torch.Generator().manual_seed(9))
    _check(
        dict(dtype="fp32", mask="causal", causal_align="bottom_right", softcap=5.0),
        Blocks(),
        1,
        2,
        1,
        33,
        17,
        8,
        dlse=dlse,
    )
