"""Edge cases of RELIABILITY.md for the backward: NaN where no query looks, fully masked rows,
empty problems, determinism, strided inputs, argument errors, and the spec fields."""

from __future__ import annotations

import pytest
import torch

from attngen.spec import KernelKind, SpecError, module_name
from tests.backward_harness import backward_spec, module_for, padded_inputs, run_padded
from tests.kernel_harness import load_kernel, make_spec


@pytest.mark.parametrize(
    "align, seqlen_q, seqlen_k", [("top_left", 17, 40), ("bottom_right", 40, 17)]
)
def test_nan_in_unseen_keys_and_blind_rows_changes_no_bit(align, seqlen_q, seqlen_k):
    """Top-left causal with Nk > Nq: keys past Nq - 1 are seen by no query; bottom-right with
    Nq > Nk: the first Nq - Nk rows see no key. NaN stored there gives bitwise the gradients
    zeros give, and those keys' and rows' gradients are 0."""
    spec = backward_spec(causal_align=align, alibi=True, num_q_heads=2, num_kv_heads=1)
    module = module_for(spec)
    q, k, v, dout, slopes = padded_inputs(spec, 1, 2, 1, seqlen_q, seqlen_k, seed=2)
    runs = []
    for fill in (float("nan"), 0.0):
        qf, kf, vf = q.clone(), k.clone(), v.clone()
        if align == "top_left":
            kf[:, :, seqlen_q:] = fill
            vf[:, :, seqlen_q:] = fill
        else:
            qf[:, :, : seqlen_q - seqlen_k] = fill
        runs.append(run_padded(module, qf, kf, vf, dout, slopes))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *runs, strict=True):
        assert torch.equal(a, b), name
    _, _, dq, dk, dv = runs[0]
    if align == "top_left":
        assert torch.all(dk[:, :, seqlen_q:] == 0) and torch.all(dv[:, :, seqlen_q:] == 0)
    else:
        assert torch.all(dq[:, :, : seqlen_q - seqlen_k] == 0)


def test_window_that_sees_nothing():
    """Rows past Nk see no key (window 0/0, top-left): LSE -inf, zero gradients, no NaN."""
    spec = backward_spec(
        dtype="fp32",
        mask="sliding_window",
        causal_align="top_left",
        window_left=0,
        window_right=0,
        num_q_heads=1,
        num_kv_heads=1,
    )
    q, k, v, dout, slopes = padded_inputs(spec, 1, 1, 1, 33, 5, seed=3)
    out, lse, dq, dk, dv = run_padded(module_for(spec), q, k, v, dout, slopes)
    assert torch.all(torch.isinf(lse[..., 5:])) and torch.all(dq[..., 5:, :] == 0)
    assert not any(torch.isnan(t).any() for t in (out, dq, dk, dv))


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(0, 7), (7, 0), (0, 0)])
def test_empty_lengths(seqlen_q, seqlen_k):
    spec = backward_spec(dtype="fp32", mask="none")
    q, k, v, dout, slopes = padded_inputs(spec, 2, 4, 2, seqlen_q, seqlen_k, seed=0)
    out, lse, dq, dk, dv = run_padded(module_for(spec), q, k, v, dout, slopes)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert torch.all(dk == 0) and torch.all(dv == 0) and torch.all(dq == 0)
    assert torch.all(out == 0)


def test_backward_is_bitwise_deterministic():
    spec = backward_spec(dropout=True)
    module = module_for(spec)
    q, k, v, dout, slopes = padded_inputs(spec, 1, 4, 2, 33, 33, seed=1)
    state = torch.tensor([11, 0], dtype=torch.int64)
    first = run_padded(module, q, k, v, dout, slopes, dropout_p=0.3, rng_state=state)
    second = run_padded(module, q, k, v, dout, slopes, dropout_p=0.3, rng_state=state)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_strided_inputs_and_gradient():
    """[B, N, H, D] storage for q, k, v and a non-contiguous dO: bitwise the contiguous
    gradients."""
    spec = backward_spec(dtype="fp32", softcap=30.0, num_q_heads=2, num_kv_heads=1)
    module = module_for(spec)
    q, k, v, dout, slopes = padded_inputs(spec, 2, 2, 1, 17, 20, seed=4)
    contiguous = run_padded(module, q, k, v, dout, slopes)
    storage = torch.zeros(*dout.shape[:-1], 2 * dout.shape[-1], dtype=dout.dtype)
    storage[..., ::2] = dout
    leaves = [t.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    module.attention(*leaves).backward(storage[..., ::2])
    for a, b in zip(contiguous[2:], (t.grad for t in leaves), strict=True):
        assert torch.equal(a, b)


def test_no_grad_and_forward_only_modules():
    """Without inputs that need a gradient the forward runs alone (no autograd node); a module
    built without backward has no autograd Function: its output has no grad_fn."""
    spec = backward_spec(dtype="fp32")
    q, k, v, _, _ = padded_inputs(spec, 1, 4, 2, 16, 16, seed=0)
    assert module_for(spec).attention(q, k, v).grad_fn is None
    forward_only = load_kernel(make_spec(dtype="fp32"))
    assert not hasattr(forward_only, "attention_backward")


def test_spec_fields_are_strict():
    with pytest.raises(SpecError, match="dropout: got True; allowed: true only with backward"):
        make_spec(dropout=True)
    with pytest.raises(SpecError, match="backward: got True; allowed: true only with prefill"):
        make_spec(backward=True, kernels=["decode"], kv_layout="contiguous")
    with pytest.raises(SpecError, match="backward"):
        make_spec(backward="yes")
    plain, trained = make_spec(), make_spec(backward=True)
    assert "backward" not in plain.canonical() and trained.canonical()["backward"] is True
    assert module_name(trained, KernelKind.prefill).endswith("_bwd")
    assert module_name(make_spec(backward=True, dropout=True), KernelKind.prefill).endswith(
        "_bwd_drop"
    )


def test_explain_and_header_show_the_backward_derivation():
    from attngen.cli.explain import explain_lines
    from attngen.tiling.backward import derive_backward_tiles

    spec = make_spec(backward=True, dtype="bf16", head_dim=128)
    text = "\n".join(explain_lines([spec], ["sm90"]))
    backward = derive_backward_tiles(spec, "sm90")
    assert "backward (prefill and varlen modules)" in text
    chosen = backward.dkdv.chosen
    assert f"dK/dV kernel: {chosen.block_m}x{chosen.block_n}, {chosen.num_warps} warps" in text
    module = load_kernel(spec)
    assert module.BWD_DKDV_CONFIG == chosen.as_dict()
    assert module.BWD_DQ_CONFIG == backward.dq.chosen.as_dict()
