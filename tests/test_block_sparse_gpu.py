"""Block sparsity (`block_mask=`) compiled for the GPU (the H200): `pytest -m gpu`.

The CPU suite (tests/test_block_sparse.py) checks the meaning under the interpreter; here the
listed-blocks loop is compiled by Triton for sm90 with the derived tiles (bf16 D 128: K/V
through TMA, wgmma), with torch's create_block_mask on the device at its default 128-blocks,
against the float64 reference; hostile lists must not fault (compute-sanitizer stands in for
the interpreter's memory watch: run this file under it once); the call plans of a module
without tensors still serve calls without a block mask.
"""

from __future__ import annotations

import pytest
import torch

from attngen.reference import compare_to_reference
from tests.kernel_harness import load_kernel, make_inputs, make_spec
from tests.test_block_sparse import (
    disturb,
    exact_block_mask,
    flex_meaning_problems,
    hostile_block_mask,
    mask_mod_values,
)
from tests.test_expression_kernels import CASES, case_tensors, expression_spec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the H200"),
]


def _cuda(tensors):
    return {name: t.cuda() for name, t in tensors.items()}


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("causal", [False, True])
def test_torch_block_masks_on_the_gpu(dtype: str, causal: bool) -> None:
    from torch.nn.attention.flex_attention import create_block_mask

    spec = expression_spec("document", dtype, causal)
    kernel = load_kernel(spec)
    batch, seqlen = 2, 1000
    q, k, v, _ = make_inputs(spec, batch, seqlen, seqlen, seed=21, device="cuda")
    tensors = _cuda(case_tensors("document", batch, seqlen, 21))
    doc = tensors["doc"]

    def mask_mod(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    mask = create_block_mask(mask_mod, batch, None, seqlen, seqlen, device="cuda")
    fields = (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices)
    out, lse = kernel.attention(
        q, k, v, return_lse=True, tensors=tensors, block_mask=(*fields, *mask.BLOCK_SIZE)
    )
    problems = compare_to_reference(spec, out, lse, q, k, v, tensors=tensors)
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("case", sorted(CASES))
def test_disturbed_block_masks_on_the_gpu(case: str) -> None:
    """Dropped and promoted blocks (Flex's meaning), 128-blocks, every case of the gym."""
    spec = expression_spec(case, "bf16", causal=False)
    kernel = load_kernel(spec)
    batch, seqlen_q, seqlen_k = 2, 700, 1000
    scale = 8.0 if case == "softcap" else 1.0
    q, k, v, _ = make_inputs(spec, batch, seqlen_q, seqlen_k, seed=22, scale=scale)
    tensors = case_tensors(case, batch, seqlen_k, 22)
    values = mask_mod_values(spec, tensors, batch, seqlen_q, seqlen_k)
    gen = torch.Generator().manual_seed(22)
    block_mask = disturb(exact_block_mask(values, 128, 128, gen=gen), gen, 0.3, 0.3)
    out, lse = _run(kernel, q, k, v, tensors, block_mask)
    problems = flex_meaning_problems(case, "bf16", False, out, lse, q, k, v, tensors, block_mask)
    assert not problems, "; ".join(problems)


def _run(kernel, q, k, v, tensors, block_mask):
    """The kernel on the GPU with CPU inputs and block mask; (out, lse) back on the CPU."""
    cuda_mask = tuple(t.cuda() if isinstance(t, torch.Tensor) else t for t in block_mask)
    out, lse = kernel.attention(
        q.cuda(), k.cuda(), v.cuda(), return_lse=True, tensors=_cuda(tensors) or None,
        block_mask=cuda_mask,
    )  # fmt: skip
    torch.cuda.synchronize()
    return out.cpu(), lse.cpu()


def test_hostile_lists_on_the_gpu() -> None:
    """Negative, huge and duplicate indices and counts past the row: no fault (run under
    compute-sanitizer), and without duplicates the result the clamping rule gives."""
    spec = expression_spec("document", "bf16", causal=False)
    kernel = load_kernel(spec)
    q, k, v, _ = make_inputs(spec, 1, 512, 512, seed=23)
    tensors = case_tensors("document", 1, 512, 23)
    block_mask = hostile_block_mask()
    out, lse = _run(kernel, q, k, v, tensors, block_mask)
    problems = flex_meaning_problems("document", "bf16", False, out, lse, q, k, v, tensors,
                                     block_mask)  # fmt: skip
    assert not problems, "; ".join(problems)
    duplicates = (torch.tensor([[[2, 2, 2, 2]]], dtype=torch.int32), *block_mask[1:])
    out, _ = _run(kernel, q, k, v, tensors, duplicates)  # row 2 lists block 2 twice
    assert torch.isfinite(out).all()


def test_call_plans_and_block_masks_alternate() -> None:
    """A module without tensors keeps call plans: a plan serves calls without block_mask, a
    call with one takes the full path, and both stay right in any order."""
    spec = make_spec(
        name="flex", dtype="bf16", head_dim=128, mask="none", mask_mod="q_idx >= kv_idx"
    )
    kernel = load_kernel(spec)
    q, k, v, _ = make_inputs(spec, 2, 1024, 1024, seed=24, device="cuda")
    values = torch.ones(1, 1, 1024, 1024, dtype=torch.bool).tril()
    block_mask = tuple(
        t.cuda() if isinstance(t, torch.Tensor) else t for t in exact_block_mask(values, 128, 128)
    )
    for _ in range(2):
        for mask in (None, block_mask):
            out, lse = kernel.attention(q, k, v, return_lse=True, block_mask=mask)
            problems = compare_to_reference(spec, out, lse, q, k, v)
            assert not problems, (mask is not None, "; ".join(problems))
        assert kernel._CALL_PLANS  # the call without block_mask left (then took) a plan


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_block_masks_on_the_gpu(dtype: str, causal: bool) -> None:
    """The varlen kernel's listed loop compiled for sm90 with the derived tiles: per-sequence
    block masks at 128-blocks (dropped and promoted blocks, an empty sequence, sequences
    shorter than the lists), each sequence against the float64 reference of its meaning."""
    from tests.test_block_sparse_varlen import sequence_problems, varlen_spec
    from tests.test_varlen_properties import cu_seqlens, packed_inputs

    spec = varlen_spec("document", dtype, causal)
    kernel = load_kernel(spec, kind="varlen")
    lengths_q, lengths_k = [700, 0, 1000, 33], [1000, 200, 900, 513]
    q, k, v, _ = packed_inputs(spec, lengths_q, lengths_k, seed=23)
    tensors = case_tensors("document", 4, 1000, 23)
    values = mask_mod_values(spec, tensors, 4, 1000, 1000)
    gen = torch.Generator().manual_seed(23)
    block_mask = disturb(exact_block_mask(values, 128, 128, gen=gen), gen, 0.3, 0.3)
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    on_gpu = [t.cuda() if isinstance(t, torch.Tensor) else t for t in block_mask]
    out, lse = kernel.attention_varlen(
        *(t.cuda() for t in (q, k, v, cu_q, cu_k)), 1000, 1000, return_lse=True,
        tensors=_cuda(tensors), block_mask=tuple(on_gpu),
    )  # fmt: skip
    params = dict(case="document", dtype=dtype, causal=causal)
    problems = sequence_problems(
        params, out.cpu(), lse.cpu(), q, k, v, cu_q, cu_k, lengths_k, tensors, block_mask
    )
    assert not problems, "; ".join(problems)
