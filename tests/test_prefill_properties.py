"""Property tests: generated prefill kernels against the float64 reference (CPU interpreter).

Hypothesis draws structure (spec fields, block sizes, shapes biased to block boundaries, a
seed), never data; tensors come from the seed. Block sizes are forced small (16/32) so that
small sequences cross several block boundaries. Every failure found is kept as an @example.
"""

from __future__ import annotations

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from tests.kernel_harness import assert_matches_reference, load_kernel, make_inputs, make_spec

HEAD_DIMS = (16, 40, 64, 80, 96, 128, 200)
GROUPS = (1, 2, 7, 8)  # query heads per KV head: MHA, GQA 2:1 and 7:1 and 8:1


@st.composite
def spec_fields(draw):
    mask = draw(st.sampled_from(["none", "causal", "sliding_window"]))
    fields = dict(
        dtype=draw(st.sampled_from(["fp16", "bf16", "fp32"])),
        head_dim=draw(st.sampled_from(HEAD_DIMS)),
        mask=mask,
    )
    if draw(st.booleans()):
        fields["head_dim_v"] = draw(st.sampled_from(HEAD_DIMS))
    kv_heads = draw(st.integers(1, 2))
    fields["num_kv_heads"] = kv_heads
    fields["num_q_heads"] = kv_heads * draw(st.sampled_from(GROUPS))
    if mask != "none":
        fields["causal_align"] = draw(st.sampled_from(["top_left", "bottom_right"]))
    if mask == "sliding_window":
        # 2**31 - 1 is flash-attn's unbounded side (int32 arithmetic must not overflow)
        fields["window_left"] = draw(st.sampled_from([0, 1, 15, 16, 17, 40, 2**31 - 1]))
        fields["window_right"] = draw(st.sampled_from([0, 0, 3, 16, 2**31 - 1]))
    if draw(st.integers(0, 3)) == 0:
        fields["softcap"] = draw(st.sampled_from([5.0, 30.0, 50.0]))
    if draw(st.integers(0, 3)) == 0:
        fields["alibi"] = True
    return fields


@st.composite
def seqlen(draw, block: int):
    """Lengths at block boundaries, small primes, and 1."""
    return draw(st.sampled_from([1, block - 1, block, block + 1, 2 * block + 1, 37, 3]))


@st.composite
def case(draw):
    fields = draw(spec_fields())
    block_m = draw(st.sampled_from([16, 32]))
    block_n = draw(st.sampled_from([16, 32]))
    seqlen_q = draw(seqlen(block_m))
    seqlen_k = draw(st.one_of(seqlen(block_n), st.just(seqlen_q)))
    batch = draw(st.integers(1, 2))
    scale = draw(st.sampled_from([1.0, 1.0, 8.0]))  # 8x: scores of a few hundred
    seed = draw(st.integers(0, 2**16))
    return fields, block_m, block_n, batch, seqlen_q, seqlen_k, scale, seed


@given(case())
@example(  # GQA 7:1, Nq > Nk under bottom-right causal: the first rows see no key
    (
        dict(
            dtype="fp16",
            head_dim=64,
            mask="causal",
            causal_align="bottom_right",
            num_kv_heads=1,
            num_q_heads=7,
        ),
        16,
        16,
        1,
        33,
        17,
        1.0,
        0,
    )
)
@example(  # a window narrower than a block, not a power-of-two head dim, softcap and ALiBi
    (
        dict(
            dtype="bf16",
            head_dim=80,
            mask="sliding_window",
            causal_align="top_left",
            window_left=1,
            window_right=3,
            num_kv_heads=1,
            num_q_heads=2,
            softcap=30.0,
            alibi=True,
        ),
        32,
        16,
        2,
        17,
        31,
        1.0,
        1,
    )
)
@example(  # found by Hypothesis: the LSE's roundings in log2 units (see kernel_harness)
    (
        dict(
            dtype="fp16",
            head_dim=128,
            mask="causal",
            num_kv_heads=1,
            num_q_heads=1,
            causal_align="top_left",
            softcap=5.0,
            alibi=True,
        ),
        16,
        16,
        1,
        3,
        3,
        1.0,
        0,
    )
)
@example(  # found by Hypothesis: a one-key window with ALiBi, LSE at a small magnitude
    (
        dict(
            dtype="fp16",
            head_dim=64,
            mask="sliding_window",
            num_kv_heads=1,
            num_q_heads=1,
            causal_align="top_left",
            window_left=0,
            window_right=0,
            alibi=True,
        ),
        16,
        16,
        1,
        3,
        3,
        1.0,
        0,
    )
)
@example(  # found by Hypothesis: fp32 with large scores, the dot's sequential accumulation
    (
        dict(dtype="fp32", head_dim=80, mask="none", head_dim_v=64, num_kv_heads=2, num_q_heads=2),
        16,
        16,
        2,
        3,
        15,
        8.0,
        60,
    )
)
def test_prefill_matches_reference(params):
    fields, block_m, block_n, batch, seqlen_q, seqlen_k, scale, seed = params
    spec = make_spec(**fields)
    kernel = load_kernel(spec, block_m, block_n)
    q, k, v, slopes = make_inputs(spec, batch, seqlen_q, seqlen_k, seed=seed, scale=scale)
    out, lse = kernel.attention(q, k, v, alibi_slopes=slopes, return_lse=True)
    assert_matches_reference(spec, out, lse, q, k, v, slopes=slopes)


@given(st.sampled_from([0.05, 0.3, 2.0]), st.integers(0, 100))
def test_explicit_scale(sm_scale, seed):
    spec = make_spec(dtype="fp32", head_dim=40, mask="causal", causal_align="top_left")
    kernel = load_kernel(spec, 16, 16)
    q, k, v, _ = make_inputs(spec, 1, 19, 23, seed=seed)
    out, lse = kernel.attention(q, k, v, sm_scale=sm_scale, return_lse=True)
    assert_matches_reference(spec, out, lse, q, k, v, sm_scale=sm_scale)
    default = kernel.attention(q, k, v)
    assert not torch.equal(out, default)
