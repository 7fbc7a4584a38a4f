"""Gradients through attngen.flex_attention (CPU interpreter): dq, dk, dv and a trainable
captured tensor's gradient against float64 autograd through a dense torch evaluation of the
same score_mod and mask_mod, by RELIABILITY.md's rule for gradients (|attngen - float64| <= 3x
|torch in the input's dtype - float64| + floor). torch's own flex_attention has no backward on
the CPU ("FlexAttention does not support backward on CPU"), so the dense evaluation is the
reference: every (b, h, q_idx, kv_idx) on index grids, as torch's eager math does.

Cases: causal, document, prefix-LM, a relative bias table that requires grad (its gradient
too), ALiBi slopes that require grad, softcap, rows that see no key (zero gradients); GQA and
batch-1 keys (dk, dv summed over the broadcast batch); fp32, fp16, bf16; a block mask (the
gradient kernels visit its listed blocks); a tensor read only by the mask gets none.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import and_masks

import attngen
from attngen.runtime import last_dispatch
from tests import test_flex_api as api
from tests.ondemand_harness import on_demand  # noqa: F401 - a fixture
from tests.test_flex_api import DV, HKV, HQ, B, D, L, S, causal, document, late_keys, prefix_lm

torch.manual_seed(1)
table = torch.randn(HQ, L + S) * 0.5  # a relative bias, trainable in the calls below
slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])


def relative(score, b, h, q_idx, kv_idx):
    return score + table[h, q_idx - kv_idx + S]


def alibi(score, b, h, q_idx, kv_idx):
    return score + slopes[h] * (kv_idx - q_idx)


def softcap(score, b, h, q_idx, kv_idx):
    return 3.0 * torch.tanh(score / 3.0)


def dense(q, k, v, score_mod, mask_mod, kept=None):
    """(out, lse) in q's dtype, differentiable: every key per element; a row that sees no
    key gives out 0, lse -inf (and no gradient), as flex_attention's. kept: a list that gets
    the modded, masked scores (their .grad is dS after the backward)."""
    k, v = (t.expand(q.shape[0], -1, -1, -1).repeat_interleave(HQ // HKV, 1) for t in (k, v))
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32  # the softmax's
    s = (q @ k.transpose(-1, -2)).to(wide) / q.shape[-1] ** 0.5
    grid = [torch.arange(n).view([-1 if i == d else 1 for i in range(4)]) for d, n in
            enumerate(s.shape)]  # fmt: skip
    if score_mod is not None:
        s = score_mod(s, *grid).to(wide)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(*grid).expand(s.shape), -torch.inf)
    if kept is not None:
        s.retain_grad()
        kept.append(s)
    top = s.amax(-1, keepdim=True).detach()
    top = torch.where(torch.isinf(top), 0, top)
    p = torch.exp(s - top)
    total = p.sum(-1, keepdim=True)
    out = (p / total.clamp_min(torch.finfo(wide).tiny)).to(v.dtype) @ v
    return out, (torch.log(total) + top).squeeze(-1)


def _leaves(tensors, dtype):
    return [t.detach().to(dtype).requires_grad_() for t in tensors]


def _gradients(call, inputs, trained, dtype, douts):
    """(out, lse, [dq, dk, dv, *d trained]) of call(q, k, v) in dtype (captured tensors
    stay fp32 below float64, as the module reads them)."""
    leaves = _leaves(inputs, dtype)
    extra = _leaves(trained.values(), torch.float64 if dtype == torch.float64 else torch.float32)
    saved = {n: globals()[n] for n in trained}
    globals().update(zip(trained, extra, strict=True))
    try:
        out, lse = call(*leaves)
        finite = torch.isfinite(lse)
        loss = (out * douts[0].to(dtype)).sum() + (
            lse[finite] * douts[1][finite].to(lse.dtype)
        ).sum()
        loss.backward()
    finally:
        globals().update(saved)
    return out.detach(), lse.detach(), [t.grad for t in (*leaves, *extra)]


def _check(got, want, lowp, factor=3.0, summed=None):
    """RELIABILITY.md's rule; `summed`: per element, the extra error of a sum in fp32 (below)."""
    assert not got.isnan().any()
    err, bound = (got.double() - want).abs(), (lowp.double() - want).abs()
    floor = 2 * torch.finfo(got.dtype).eps * want.abs().max().clamp_min(1)
    if summed is not None:
        err = (err - summed).clamp_min(0)
    assert err.max() <= factor * bound.max() + floor, (err.max(), bound.max(), floor)
    assert err.mean() <= 1.5 * factor * bound.mean() + floor, (err.mean(), bound.mean())


# Note: a captured tensor's gradient is a sum over every (b, h, q_idx, kv_idx) pair that reads
# an element (3330 pairs per ALiBi slope here) of dS x d score_mod / d T. The kernels add the
# pairs' terms by fp32 atomics in tile order; torch's fp32 yardstick by a blocked reduction,
# whose error is far smaller, so 3x the yardstick does not bound an honest fp32 sum (measured:
# a slope's error 2.2e-4, the yardstick's 4.9e-5, the floor 5.7e-5). Each element's bound
# adds eps32 x sum over its pairs |dS x d score_mod / d T| (the first-order error of a
# summation in that order, well below the worst case n x eps32 x sum |term|). A wrong pair
# set or derivative is off by the gradient's own magnitude, which that sum dwarfs only where
# the terms cancel.
def _summed(score_mod, name, ds):
    """Per element of the captured tensor `name`: the float64 sum over the pairs reading it
    of |dS x d score_mod / d T| (the test's score_mods are linear in T, one read per pair:
    d/dT of sum |dS| x |score_mod(0) at T = 1| is that sum)."""
    ones = torch.ones_like(globals()[name], dtype=torch.float64, requires_grad=True)
    saved = globals()[name]
    globals()[name] = ones
    try:
        grid = [torch.arange(n).view([-1 if i == d else 1 for i in range(4)]) for d, n in
                enumerate(ds.shape)]  # fmt: skip
        reach = score_mod(torch.zeros(ds.shape, dtype=torch.float64), *grid).abs()
        (weights,) = torch.autograd.grad((ds.abs() * reach).sum(), ones)
    finally:
        globals()[name] = saved
    return weights


def _compare(score_mod, mask_mod, dtype=torch.float32, trained=(), kv_batch=B, block=False):
    """attngen's gradients against float64 and the dtype's dense torch; returns the first's."""
    torch.manual_seed(2)
    inputs = [torch.randn(B, HQ, L, D), torch.randn(kv_batch, HKV, S, D)]
    inputs.append(torch.randn(kv_batch, HKV, S, DV))
    douts = (torch.randn(B, HQ, L, DV), torch.randn(B, HQ, L))
    blocks = _blocks(mask_mod) if block else None

    def ours(q, k, v):
        return attngen.flex_attention(
            q, k, v, score_mod, blocks if block else _blocks(mask_mod), enable_gqa=True,
            return_lse=True,
        )  # fmt: skip

    kept: list[torch.Tensor] = []

    def reference(q, k, v):
        return dense(q, k, v, score_mod, mask_mod, kept)

    tensors = {name: globals()[name] for name in trained}
    got = _gradients(ours, inputs, tensors, dtype, douts)
    assert last_dispatch().module.endswith("_bwd")
    want = _gradients(reference, inputs, tensors, torch.float64, douts)
    lowp = _gradients(reference, inputs, tensors, dtype, douts)
    sums = [torch.zeros(())] * 3 + [_summed(score_mod, n, kept[0].grad) for n in tensors]
    for a, b, c, terms in zip(got[2], want[2], lowp[2], sums, strict=True):
        assert a is not None and a.shape == b.shape
        _check(a, b, c, 3.0, torch.finfo(torch.float32).eps * terms)
    _check(got[0], want[0], lowp[0], 3.0 if score_mod is softcap else 2.0)
    return got


def _blocks(mask_mod):
    device = torch.get_default_device()  # the GPU test's torch.device("cuda") context
    return None if mask_mod is None else attngen.create_block_mask(mask_mod, B, None, L, S, device)


CASES = [
    (None, causal, ()),
    (None, document, ()),
    (None, prefix_lm, ()),
    (relative, and_masks(causal, document), ("table",)),
    (alibi, None, ("slopes",)),
    (softcap, None, ()),
]


@pytest.mark.parametrize(
    ("score_mod", "mask_mod", "trained"), CASES, ids=lambda f: getattr(f, "__name__", str(f))
)
def test_gradients_equal_float64s(on_demand, score_mod, mask_mod, trained) -> None:  # noqa: F811
    _compare(score_mod, mask_mod, trained=trained)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_gradients(on_demand, dtype) -> None:  # noqa: F811
    _, _, grads = _compare(relative, causal, dtype, trained=("table",))
    assert grads[0].dtype == dtype and grads[3].dtype == torch.float32


def test_a_row_that_sees_no_key_gets_zero_gradients(on_demand) -> None:  # noqa: F811
    _, lse, (dq, dk, dv) = _compare(None, late_keys)
    assert torch.isinf(lse[:, :, :10]).all() and torch.isfinite(lse[:, :, 10:]).all()
    assert torch.equal(dq[:, :, :10], torch.zeros_like(dq[:, :, :10]))
    assert torch.equal(dk[:, :, :40], torch.zeros_like(dk[:, :, :40]))  # keys nobody sees
    assert dq[:, :, 10:].abs().amax() > 0


def test_batch_one_keys_sum_over_the_batch(on_demand) -> None:  # noqa: F811
    _, _, (_, dk, dv, dtable) = _compare(relative, causal, kv_batch=1, trained=("table",))
    assert dk.shape == (1, HKV, S, D) and dv.shape == (1, HKV, S, DV)


def test_a_block_mask_skips_blocks_with_gradients(on_demand) -> None:  # noqa: F811
    """The gradient call passes the block mask too (the backward's tiles divide 128): the
    kernels visit the listed blocks only, with the gradients of the dense reference."""
    _compare(None, prefix_lm, block=True)
    assert "listed key blocks only" in last_dispatch().reason
    assert "_bwd" in last_dispatch().module
    q, k, v = (torch.randn(B, h, 256, D) for h in (HQ, HKV, HKV))
    blocks = attngen.create_block_mask(causal, B, None, 256, 256, "cpu")
    with torch.no_grad():
        attngen.flex_attention(q, k, v, None, blocks, enable_gqa=True)
    assert "a built-in mask" in last_dispatch().reason  # causal: the kernels skip by themselves


def test_a_tensor_read_only_by_the_mask_gets_no_gradient(on_demand) -> None:  # noqa: F811
    """No gradient flows through a bool mask (torch's Flex gives none either): the tensor is
    passed as it is, not declared trainable; q, k, v still get theirs."""
    cut = torch.full((B,), 20.0, requires_grad=True)
    q, k, v = (torch.randn(B, h, n, d, requires_grad=True) for h, n, d in
               ((HQ, L, D), (HKV, S, D), (HKV, S, DV)))  # fmt: skip
    out = attngen.flex_attention(
        q, k, v, None, attngen.create_block_mask(lambda b, h, i, j: j < cut[b], B, None, L, S,
                                                 "cpu"), enable_gqa=True)  # fmt: skip
    out.sum().backward()
    assert cut.grad is None and q.grad is not None and k.grad[:, :, 20:].abs().max() == 0
    assert "_bwd" in last_dispatch().module


def test_the_trace_cache_keys_on_requires_grad(on_demand) -> None:  # noqa: F811
    """The same score_mod first without, then with a table that requires grad: the second
    call traces again, declares it trainable and the table gets its gradient."""
    bias = torch.randn(HQ, L + S)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + S]

    q, k, v = (torch.randn(B, h, n, d) for h, n, d in ((HQ, L, D), (HKV, S, D), (HKV, S, DV)))
    first = attngen.flex_attention(q, k, v, biased, enable_gqa=True)
    assert not last_dispatch().module.endswith("_bwd")
    bias.requires_grad_()
    second = attngen.flex_attention(q, k, v, biased, enable_gqa=True)
    assert last_dispatch().module.endswith("_bwd")
    # two fp32 kernels (the _bwd module's forward may take other tiles): the same sums in
    # another order, outputs of O(1), so a few fp32 ulps; 1e-6 is about 8 ulps at 1
    torch.testing.assert_close(second.detach(), first, rtol=0, atol=1e-6)
    second.sum().backward()
    assert bias.grad is not None and bias.grad.abs().sum() > 0
    with torch.no_grad():  # grad mode off: the forward module again, nothing declared trainable
        attngen.flex_attention(q, k, v, biased, enable_gqa=True)
    assert not last_dispatch().module.endswith("_bwd")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("score_mod", "mask_mod", "trained"), CASES, ids=lambda f: getattr(f, "__name__", str(f))
)
def test_gradients_on_the_gpu(on_demand, score_mod, mask_mod, trained) -> None:  # noqa: F811
    """bf16 on the GPU: the compiled backward kernels (the trainable tensors' atomics) against
    float64 autograd through the dense evaluation, by the same rule."""
    global table, slopes
    saved = api.prefix, api.docs, table, slopes
    api.prefix, api.docs, table, slopes = (t.cuda() for t in saved)
    try:
        with torch.device("cuda"):
            _compare(score_mod, mask_mod, torch.bfloat16, trained=trained)
        assert last_dispatch().module.startswith("sm")
    finally:
        api.prefix, api.docs, table, slopes = saved
