"""dK and dV by two launches of the dK/dV kernel (BWD_DKDV_SPLIT: one accumulator each):
bitwise the fused kernel's gradients at the same tiles, and within the rule at other tiles,
for masks, GQA, ALiBi, softcap, dropout and packed sequences."""

from __future__ import annotations

import pytest
import torch

from attngen.reference.backward import compare_gradients
from tests.backward_harness import (
    Blocks,
    backward_spec,
    module_for,
    packed_inputs,
    padded_inputs,
    run_padded,
    run_varlen,
)

SPECS = {
    "causal_gqa_alibi": dict(mask="causal", num_q_heads=4, num_kv_heads=2, alibi=True),
    "window_softcap": dict(mask="sliding_window", window_left=9, window_right=3, softcap=20.0),
    "none_dropout": dict(mask="none", dropout=True),
}


class _CountingKernel:
    """The module's dK/dV kernel, recording each launch's GRADS and BLOCK_N."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((kwargs["GRADS"], kwargs["BLOCK_N"]))
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.fixture()
def counted(monkeypatch):
    """Counts the dK/dV launches of the modules given to it."""

    def count(module):
        counter = _CountingKernel(module._attn_bwd_dkdv_kernel)
        monkeypatch.setattr(module, "_attn_bwd_dkdv_kernel", counter)
        return counter.launches

    return count


def _split(module, dv_blocks, dk_blocks):
    """Set the module's split: (BLOCK_M, BLOCK_N) for the dV and the dK launch."""
    module.BWD_DKDV_SPLIT = tuple(
        dict(BLOCK_M=m, BLOCK_N=n, num_warps=4, num_stages=1) for m, n in (dv_blocks, dk_blocks)
    )


@pytest.mark.parametrize("name", sorted(SPECS))
def test_split_launches_give_the_fused_kernels_bits_at_the_same_tiles(name, counted):
    spec = backward_spec(dtype="fp32", head_dim=16, **SPECS[name])
    module = module_for(spec, Blocks(dkdv=(16, 32)))
    launches = counted(module)
    q, k, v, dout, slopes = padded_inputs(
        spec, 2, spec.num_q_heads, spec.num_kv_heads, 37, 45, seed=4
    )
    options = {}
    if spec.dropout:
        options = {"dropout_p": 0.25, "rng_state": torch.tensor([7, 0], dtype=torch.int64)}
    try:
        fused = run_padded(module, q, k, v, dout, slopes, **options)
        _split(module, (16, 32), (16, 32))
        split = run_padded(module, q, k, v, dout, slopes, **options)
    finally:
        module.BWD_DKDV_SPLIT = None
    assert launches == [(3, 32), (1, 32), (2, 32)]  # fused, then dV and dK
    for label, a, b in zip(("out", "lse", "dq", "dk", "dv"), fused, split, strict=True):
        assert torch.equal(a, b), label


def test_split_launches_at_their_own_tiles_are_within_the_rule(counted):
    """dV and dK at different key tiles (the dK/dV grid's block count per launch): each
    gradient within RELIABILITY.md's rule against float64."""
    spec = backward_spec(dtype="fp16", head_dim=32, mask="causal", num_q_heads=4, num_kv_heads=2)
    module = module_for(spec)
    launches = counted(module)
    q, k, v, dout, slopes = padded_inputs(spec, 1, 4, 2, 50, 50, seed=8)
    try:
        _split(module, (16, 32), (32, 16))
        _, _, *grads = run_padded(module, q, k, v, dout, slopes)
    finally:
        module.BWD_DKDV_SPLIT = None
    assert launches == [(1, 32), (2, 16)]
    assert not compare_gradients(spec, grads, q, k, v, dout, alibi_slopes=slopes)


def test_split_launches_on_packed_sequences_with_an_empty_one(counted):
    """varlen: the rows the dK/dV grids cover are the widest launch's tiles, so both launches
    bound a sequence alike; an empty sequence and NaN padding change nothing."""
    spec = backward_spec(dtype="fp32", head_dim=16, mask="causal")
    module = module_for(spec, Blocks(dkdv=(16, 16)), kind="varlen")
    launches = counted(module)
    lengths = [5, 0, 23]
    q, k, v, dout, slopes = packed_inputs(spec, lengths, lengths, 2, 2, seed=3)
    try:
        fused = run_varlen(module, q, k, v, dout, slopes, lengths, lengths)
        _split(module, (16, 16), (16, 16))
        split = run_varlen(module, q, k, v, dout, slopes, lengths, lengths)
        _split(module, (16, 32), (16, 16))
        widths = run_varlen(module, q, k, v, dout, slopes, lengths, lengths)
    finally:
        module.BWD_DKDV_SPLIT = None
    assert launches == [(3, 16), (1, 16), (2, 16), (1, 32), (2, 16)]
    for label, a, b in zip(("out", "dq", "dk", "dv"), fused, split, strict=True):
        assert torch.equal(a, b), label
    # Other tiles only change how the dots are cut: fp32, each element a sum of at most 46
    # terms (23 rows x 2 heads) of magnitude <= 3.1, so a reordered sum moves it by at most
    # about 46 ulps of the largest term (~1e-5 relative); atol covers elements near zero.
    # Measured under the interpreter: bitwise equal (numpy's matmul sums alike at both widths).
    for label, a, b in zip(("dk", "dv"), fused[2:], widths[2:], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=label)
