"""Packed varlen sequences through the backward: gradients per sequence against float64
autograd, empty sequences, NaN in the packed padding never reaching a gradient, and a sequence
whose cu_seqlens do not fit getting NaN gradients with nothing outside the tensors touched."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests import memory_watch
from tests.backward_harness import (
    Blocks,
    backward_spec,
    check_per_sequence,
    cu_seqlens,
    module_for,
    packed_inputs,
    run_varlen,
)
from tests.test_backward_properties import EXAMPLES, HEADS, blocks, spec_fields


@st.composite
def cases(draw):
    hq, hkv = draw(HEADS)
    lengths = st.sampled_from([0, 1, 15, 16, 17, 33])
    batch = draw(st.integers(1, 3))
    lengths_q = draw(st.lists(lengths, min_size=batch, max_size=batch))
    lengths_k = (
        lengths_q
        if draw(st.booleans())
        else draw(st.lists(lengths, min_size=batch, max_size=batch))
    )
    return (
        draw(spec_fields()),
        draw(blocks()),
        hq,
        hkv,
        lengths_q,
        lengths_k,
        draw(st.integers(0, 2**16)),
    )


@settings(max_examples=EXAMPLES)
@given(cases())
@example(
    (
        dict(dtype="fp16", mask="causal", causal_align="bottom_right"),
        Blocks(),
        7,
        1,
        [33, 0, 1],
        [17, 0, 1],
        0,
    )
).via("GQA 7:1, Nq > Nk bottom-right, an empty and a one-token sequence")
@example(
    (
        dict(
            dtype="fp32",
            head_dim=80,
            mask="sliding_window",
            causal_align="top_left",
            window_left=1,
            window_right=3,
            softcap=30.0,
            alibi=True,
        ),
        Blocks(),
        2,
        1,
        [17, 5],
        [31, 0],
        1,
    )
).via("window, softcap, ALiBi, top-left; a sequence without keys")
def test_varlen_gradients_per_sequence(case):
    fields, blocks, hq, hkv, lengths_q, lengths_k, seed = case
    spec = backward_spec(num_q_heads=hq, num_kv_heads=hkv, **fields)
    inputs = packed_inputs(spec, lengths_q, lengths_k, hq, hkv, seed)
    problems = check_per_sequence(spec, blocks, *inputs, lengths_q, lengths_k)
    assert not problems, "; ".join(problems)


def test_nan_padding_changes_no_bit():
    """Packed padding holding NaN gives bitwise the gradients it gives holding zeros."""
    spec = backward_spec(
        mask="sliding_window",
        causal_align="bottom_right",
        window_left=5,
        window_right=2,
        alibi=True,
        num_kv_heads=1,
        num_q_heads=2,
    )
    module = module_for(spec, kind="varlen")
    lengths_q, lengths_k = [17, 0, 9], [20, 3, 33]
    runs = [
        run_varlen(
            module,
            *packed_inputs(spec, lengths_q, lengths_k, 2, 1, seed=3, fill=fill),
            lengths_q,
            lengths_k,
        )
        for fill in (float("nan"), 0.0)
    ]
    for name, a, b in zip(("out", "dq", "dk", "dv"), *runs, strict=True):
        assert torch.equal(a, b), name


def test_all_query_sequences_empty():
    spec = backward_spec(dtype="fp32", num_kv_heads=1, num_q_heads=2)
    module = module_for(spec, kind="varlen")
    q, k, v, dout, _ = packed_inputs(spec, [0, 0], [0, 5], 2, 1, seed=0, pad=0)
    out, dq, dk, dv = run_varlen(module, q, k, v, dout, None, [0, 0], [0, 5])
    assert out.shape == (0, 2, 64) and dq.shape == (0, 2, 64)
    assert torch.all(dk == 0) and torch.all(dv == 0)


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("bad", ["past_the_end", "decreasing", "longer_than_max_k"])
def test_sequence_that_does_not_fit_gets_nan(bad, deterministic):
    """cu_seqlens the caller got wrong: that sequence's gradients are NaN in its rows inside the
    tensors, the other sequences' are those of a correct call, and no load, store or atomic
    leaves the tensors (memory_watch); on both backward paths (deterministic=False: the dQ
    kernel writes the NaN rows into the fp32 dQ the atomics add to)."""
    spec = backward_spec(dtype="fp32", num_kv_heads=1, num_q_heads=2)
    module = module_for(spec, kind="varlen")
    lengths = [9, 40]
    q, k, v, dout, _ = packed_inputs(spec, lengths, lengths, 2, 1, seed=1, pad=0)
    cu = cu_seqlens(lengths)
    good = run_varlen(module, q, k, v, dout, None, lengths, lengths, deterministic=deterministic)
    cu_k, max_k = cu.clone(), 40
    if bad == "past_the_end":
        cu_k[2] = 60  # sequence 1 ends past the 49 rows of k
    elif bad == "decreasing":
        cu_k[2] = 5  # sequence 1 would end before it starts
    else:
        max_k = 9  # sequence 1 has 40 keys: more than the backward's grid covers (16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with memory_watch.watching():
        out = module.attention_varlen(*leaves, cu, cu_k, 40, max_k, deterministic=deterministic)
        out.backward(dout)
    grads = [t.grad for t in leaves]
    assert torch.isnan(grads[0][9:]).all()  # sequence 1's query rows
    for got, expected in zip(grads, good[1:], strict=True):  # sequence 0 as in a good call
        assert torch.equal(got[:9], expected[:9])
    if bad == "longer_than_max_k":  # its keys lie inside k: NaN there
        assert torch.isnan(grads[1][9:]).all() and torch.isnan(grads[2][9:]).all()
