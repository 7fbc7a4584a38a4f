"""The block-sparse backward compiled for the GPU (the H200): `pytest -m gpu`.

tests/test_block_sparse_backward.py checks the meaning under the interpreter; here both
gradient kernels' listed loops are compiled for sm90 with the derived tiles, at 128-blocks
(torch's default), on both backward paths, against the float64 reference of Flex's meaning
(inputs and the reference on the CPU); hostile lists must not fault (run this file under
compute-sanitizer once, as tests/test_block_sparse_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernel_harness import load_kernel, make_inputs
from tests.test_block_sparse import _hostile, disturb, exact_block_mask, mask_mod_values
from tests.test_block_sparse_backward import check_gradients
from tests.test_expression_backward import expression_backward_spec
from tests.test_expression_kernels import case_tensors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the H200"),
]


@pytest.mark.parametrize("case", ["document", "relative_bias"])
@pytest.mark.parametrize("deterministic", [True, False])
def test_block_sparse_gradients_on_the_gpu(case: str, deterministic: bool) -> None:
    spec = expression_backward_spec(case, "bf16", causal=False)
    module = load_kernel(spec)
    batch, seqlen_q, seqlen_k = 2, 700, 1000
    q, k, v, _ = make_inputs(spec, batch, seqlen_q, seqlen_k, seed=31)
    tensors = case_tensors(case, batch, seqlen_k, 31)
    values = mask_mod_values(spec, tensors, batch, seqlen_q, seqlen_k)
    gen = torch.Generator().manual_seed(31)
    block_mask = disturb(exact_block_mask(values, 128, 128, gen=gen), gen, 0.3, 0.3)
    params = dict(case=case, dtype="bf16", causal=False, deterministic=deterministic)
    check_gradients(params, module, q, k, v, tensors, block_mask, device="cuda")


def test_hostile_lists_in_the_backward_on_the_gpu() -> None:
    spec = expression_backward_spec("document", "bf16", causal=False)
    q, k, v, _ = make_inputs(spec, 1, 48 * 8, 48 * 8, seed=32)
    tensors = case_tensors("document", 1, 48 * 8, 32)
    for kind in ("negative", "huge", "counts_beyond_the_row", "negative_counts"):
        num, indices = _hostile(kind, torch.int32)
        full = (num.clone().zero_(), indices.clone())
        params = dict(case="document", dtype="bf16", causal=False, deterministic=False)
        block_mask = (num, indices, *full, 128, 128)
        check_gradients(params, load_kernel(spec), q, k, v, tensors, block_mask, device="cuda")


def test_the_functional_backward_with_a_block_mask_on_the_gpu() -> None:
    """attention_backward(..., block_mask=) compiled: autograd's bits (deterministic=True)."""
    spec = expression_backward_spec("document", "bf16", causal=False)
    module = load_kernel(spec)
    q, k, v, _ = make_inputs(spec, 2, 700, 1000, seed=33, device="cuda")
    tensors = {n: t.cuda() for n, t in case_tensors("document", 2, 1000, 33).items()}
    values = mask_mod_values(spec, {n: t.cpu() for n, t in tensors.items()}, 2, 700, 1000)
    gen = torch.Generator().manual_seed(33)
    block_mask = disturb(exact_block_mask(values, 128, 128, gen=gen), gen, 0.3, 0.3)
    block_mask = tuple(t.cuda() if isinstance(t, torch.Tensor) else t for t in block_mask)
    dout = torch.randn(q.shape, device="cuda").to(q.dtype)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = module.attention(*leaves, tensors=tensors, block_mask=block_mask, return_lse=True)
    out.backward(dout)
    got = module.attention_backward(
        dout, q, k, v, out.detach(), lse.detach(), tensors=tensors, block_mask=block_mask
    )
    assert all(torch.equal(a, t.grad) for a, t in zip(got, leaves, strict=True))


@pytest.mark.parametrize("deterministic", [True, False])
def test_varlen_block_sparse_gradients_on_the_gpu(deterministic: bool) -> None:
    """attention_varlen(..., block_mask=) with gradients compiled (the derived tiles, 128-blocks,
    GQA): each sequence against the float64 reference of its block mask's meaning."""
    from tests.backward_harness import packed_inputs
    from tests.test_block_sparse_varlen_backward import gradient_problems_of, run_varlen_backward

    spec = expression_backward_spec("relative_bias", "bf16", False, kernels=("varlen",))
    lengths = ([700, 300, 1], [1000, 257, 129])
    q, k, v, dout, _ = packed_inputs(spec, *lengths, 4, 2, seed=34)
    tensors = case_tensors("relative_bias", 3, 1000, 34)
    values = mask_mod_values(spec, tensors, 3, 700, 1000)
    gen = torch.Generator().manual_seed(34)
    block_mask = disturb(exact_block_mask(values, 128, 128, gen=gen), gen, 0.3, 0.3)
    params = dict(case="relative_bias", dtype="bf16", causal=False, deterministic=deterministic)
    on_gpu = [t.cuda() if isinstance(t, torch.Tensor) else t for t in (q, k, v, dout, *block_mask)]
    module = load_kernel(spec, kind="varlen")
    gpu_tensors = {n: t.cuda() for n, t in tensors.items()}
    _, grads = run_varlen_backward(
        params, module, *on_gpu[:4], lengths, gpu_tensors, tuple(on_gpu[4:])
    )
    grads = [g.cpu() for g in grads[:3]] + [{n: t.cpu() for n, t in grads[3].items()}]
    inputs = (q, k, v, dout, tensors, block_mask)
    assert not gradient_problems_of(params, grads, inputs, lengths)
