"""Dropout (spec `dropout: true`): the keep mask is a function of (seed, offset, batch, head,
row, key) only, keeps 1 - p of the probabilities within a binomial bound (each of the eight
16-bit lanes of a Philox call too), and the forward and gradients match a float64 reference
that applies the same mask (read back through the module's own RNG helper)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.backward_harness import (
    DROP_STEPS,
    Blocks,
    backward_spec,
    check_padded,
    check_per_sequence,
    keep_mask,
    module_for,
    packed_inputs,
    padded_inputs,
)


def rng(seed, offset=0):
    return torch.tensor([seed, offset], dtype=torch.int64)


def within_binomial(count, n, p, sigmas=5.0):
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


@pytest.mark.parametrize("dropout_p", [0.1, 0.5, 0.9])
def test_keep_rate_and_lanes(dropout_p):
    threshold = round(dropout_p * DROP_STEPS)
    keep_p = 1 - threshold / DROP_STEPS
    mask = keep_mask(rng(1234), 4, 64, 96, threshold)
    assert within_binomial(mask.sum().item(), mask.numel(), keep_p)
    for lane in range(8):  # each 16-bit half of each Philox word
        lane_mask = mask[..., lane::8]
        assert within_binomial(lane_mask.sum().item(), lane_mask.numel(), keep_p), lane
    # neighbouring keys (lanes of one call) and rows agree as often as independent draws
    for a, b in ((mask[..., 1:], mask[..., :-1]), (mask[:, 1:], mask[:, :-1])):
        same = (a == b).sum().item()
        assert within_binomial(same, a.numel(), keep_p**2 + (1 - keep_p) ** 2)


def test_mask_is_a_function_of_seed_offset_and_position():
    threshold = round(0.3 * DROP_STEPS)
    base = keep_mask(rng(7), 3, 40, 50, threshold)
    assert torch.equal(base, keep_mask(rng(7), 3, 40, 50, threshold))
    assert torch.equal(base, keep_mask(rng(7), 3, 64, 80, threshold)[:, :40, :50])
    assert torch.equal(base[1:], keep_mask(rng(7), 2, 40, 50, threshold, batch_head0=1))
    assert not torch.equal(base, keep_mask(rng(8), 3, 40, 50, threshold))
    assert not torch.equal(base, keep_mask(rng(7, 1), 3, 40, 50, threshold))
    # counters are separate 32-bit words: a head index past 2**31 neither wraps nor aliases
    far = keep_mask(rng(7), 1, 40, 50, threshold, batch_head0=2**31 + 5)
    assert not torch.equal(far[0], base[0])


@pytest.mark.parametrize(
    "fields, blocks, dropout_p",
    [
        (dict(dtype="fp16"), Blocks((32, 32), (16, 32), (32, 16)), 0.2),
        (
            dict(
                dtype="fp32",
                mask="sliding_window",
                window_left=9,
                window_right=2,
                softcap=5.0,
                alibi=True,
            ),
            Blocks(),
            0.5,
        ),
        (dict(dtype="fp32", mask="none"), Blocks(), 2**-16),  # one step: threshold 1, specialized
    ],
    ids=["three-tilings-one-mask", "window-softcap-alibi", "smallest-step"],
)
def test_dropout_gradients_match_masked_reference(fields, blocks, dropout_p):
    spec = backward_spec(dropout=True, num_q_heads=4, num_kv_heads=2, **fields)
    q, k, v, dout, slopes = padded_inputs(spec, 1, 4, 2, 33, 17, seed=3)
    problems = check_padded(
        spec, blocks, q, k, v, dout, slopes, dropout_p=dropout_p, rng_state=rng(7919, 1)
    )
    assert not problems, "; ".join(problems)


def test_dropout_varlen_per_sequence():
    """Sequence b draws with batch index b: the mask of a packed batch is per sequence."""
    spec = backward_spec(
        dtype="fp32",
        mask="sliding_window",
        window_left=6,
        window_right=2,
        dropout=True,
        num_q_heads=2,
        num_kv_heads=1,
    )
    lengths_q, lengths_k = [17, 0, 33], [20, 4, 31]
    inputs = packed_inputs(spec, lengths_q, lengths_k, 2, 1, seed=4)
    problems = check_per_sequence(
        spec, Blocks(), *inputs, lengths_q, lengths_k, dropout_p=0.25, rng_state=rng(99)
    )
    assert not problems, "; ".join(problems)


def test_default_rng_state_follows_torch_manual_seed():
    spec = backward_spec(dtype="fp32", mask="none", dropout=True)
    module = module_for(spec)
    q, k, v, _, _ = padded_inputs(spec, 1, 4, 2, 16, 16, seed=0)
    outs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        outs.append(module.attention(q, k, v, dropout_p=0.5))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


def test_dropout_p_zero_is_no_dropout_and_bad_p_is_refused():
    spec = backward_spec(dtype="fp32", dropout=True)
    module = module_for(spec)
    plain = module_for(backward_spec(dtype="fp32"))
    q, k, v, _, _ = padded_inputs(spec, 1, 4, 2, 17, 17, seed=1)
    assert torch.equal(module.attention(q, k, v, dropout_p=0.0), plain.attention(q, k, v))
    for bad in (1.0, -0.1, float("nan"), 1 - 2**-18, True):
        with pytest.raises(ValueError, match="dropout_p"):
            module.attention(q, k, v, dropout_p=bad)
    with pytest.raises(ValueError, match="built with dropout: false"):
        plain.attention(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="rng_state"):
        module.attention(q, k, v, dropout_p=0.1, rng_state=torch.zeros(2))
