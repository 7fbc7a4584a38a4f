"""score_mod / mask_mod kernels compiled for the GPU (the H200): `pytest -m gpu`.

The CPU suite (tests/test_expression_kernels.py) runs the same cases under the interpreter,
which does not compile: here each case's module is compiled by Triton for sm90, with the
derived tile configs, at lengths that cross several blocks, against the float64 reference
computed on the GPU. bf16 takes wgmma and, for D 128 prefill, K/V through TMA.
"""

from __future__ import annotations

import pytest
import torch

from attngen.reference import compare_to_reference
from tests.kernel_harness import load_kernel, make_inputs, make_spec
from tests.test_expression_kernels import CASES, case_tensors, expression_spec
from tests.test_varlen_properties import cu_seqlens, packed_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the H200"),
]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_expressions_match_the_reference_on_the_gpu(case: str, dtype: str, causal: bool) -> None:
    spec = expression_spec(case, dtype, causal)
    kernel = load_kernel(spec)
    scale = 8.0 if case == "softcap" else 1.0
    q, k, v, _ = make_inputs(spec, 2, 700, 1000, seed=11, scale=scale, device="cuda")
    tensors = {n: t.cuda() for n, t in case_tensors(case, 2, 1000, 11).items()}
    out, lse = kernel.attention(q, k, v, return_lse=True, tensors=tensors or None)
    problems = compare_to_reference(spec, out, lse, q, k, v, tensors=tensors)
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("case", ["document", "relative_bias"])
def test_varlen_expressions_on_the_gpu(case: str) -> None:
    spec = make_spec(
        name="flex", dtype="bf16", mask="causal", causal_align="top_left", kernels=["varlen"],
        **CASES[case],
    )  # fmt: skip
    kernel = load_kernel(spec, kind="varlen")
    lengths_q, lengths_k = [300, 0, 513, 77], [300, 20, 600, 200]
    q, k, v, _ = packed_inputs(spec, lengths_q, lengths_k, seed=12)
    q, k, v = q.cuda(), k.cuda(), v.cuda()
    tensors = {n: t.cuda() for n, t in case_tensors(case, 4, 600, 12).items()}
    cu_q, cu_k = cu_seqlens(lengths_q).cuda(), cu_seqlens(lengths_k).cuda()
    out, lse = kernel.attention_varlen(
        q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), return_lse=True, tensors=tensors
    )
    for b in range(len(lengths_q)):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        problems = compare_to_reference(
            spec,
            out[rows].transpose(0, 1)[None],
            lse[:, rows][None],
            *(t[s].transpose(0, 1)[None] for t, s in ((q, rows), (k, keys), (v, keys))),
            tensors=tensors,
            first_b=b,
        )
        assert not problems, (b, problems)
