"""score_mod / mask_mod kernels compiled for the GPU (the H200): `pytest -m gpu`.

The CPU suite (tests/test_expression_kernels.py) runs the same cases under the interpreter,
which does not compile: here each case's module is compiled by Triton for sm90, with the
derived tile configs, at lengths that cross several blocks, against the float64 reference
computed on the GPU. bf16 takes wgmma and, for D 128 prefill, K/V through TMA. The backward
cases build the same expressions with backward: true (tests/test_expression_backward.py's
specs: the bias table trainable) and judge the gradients by attngen.reference.backward.
"""

from __future__ import annotations

import pytest
import torch

from attngen.reference import compare_to_reference
from attngen.reference.backward import compare_gradients
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


# -- the backward ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("deterministic", [True, False])
def test_expression_gradients_on_the_gpu(case: str, dtype: str, causal: bool, deterministic):
    """dQ, dK, dV (and the trainable bias table's gradient) with the derived backward
    configs, against float64 autograd on the GPU; deterministic=True gives dq, dk, dv the same
    bits on a second run (the table's gradient, by atomics, by the rule only)."""
    from tests.test_expression_backward import expression_backward_spec, leaves_of, run

    spec = expression_backward_spec(case, dtype, causal)
    module = load_kernel(spec)
    scale = 8.0 if case == "softcap" else 1.0
    q, k, v, _ = make_inputs(spec, 2, 700, 1000, seed=13, scale=scale, device="cuda")
    dout = torch.randn(*q.shape[:-1], v.shape[-1], device="cuda").to(q.dtype)
    tensors = {n: t.cuda() for n, t in case_tensors(case, 2, 1000, 13).items()}
    _, grads = run(module, q, k, v, dout, leaves_of(case, tensors), deterministic=deterministic)
    problems = compare_gradients(spec, grads, q, k, v, dout, tensors=tensors)
    assert not problems, "; ".join(problems)
    if deterministic:
        _, again = run(module, q, k, v, dout, leaves_of(case, tensors), deterministic=True)
        assert all(torch.equal(a, b) for a, b in zip(grads[:3], again[:3], strict=True))


@pytest.mark.parametrize("case", ["document", "relative_bias"])
def test_varlen_expression_gradients_on_the_gpu(case: str) -> None:
    from tests.test_expression_backward import expression_backward_spec, leaves_of

    spec = expression_backward_spec(case, "bf16", causal=True, kernels=("varlen",))
    module = load_kernel(spec, kind="varlen")
    lengths_q, lengths_k = [300, 0, 513, 77], [300, 20, 600, 200]
    q, k, v, _ = packed_inputs(spec, lengths_q, lengths_k, seed=14)
    q, k, v = (t.cuda().requires_grad_() for t in (q, k, v))
    tensors = {n: t.cuda() for n, t in case_tensors(case, 4, 600, 14).items()}
    passed = leaves_of(case, tensors)
    cu_q, cu_k = cu_seqlens(lengths_q).cuda(), cu_seqlens(lengths_k).cuda()
    out = module.attention_varlen(
        q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), tensors=passed
    )
    dout = torch.randn_like(out)
    out.backward(dout)
    for b in range(len(lengths_q)):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        args = [t.detach()[s].transpose(0, 1)[None] for t, s in ((q, rows), (k, keys), (v, keys))]
        grads = [t.grad[s].transpose(0, 1)[None] for t, s in ((q, rows), (k, keys), (v, keys))]
        do = dout[rows].transpose(0, 1)[None]
        problems = compare_gradients(spec, grads, *args, do, tensors=tensors, first_b=b)
        assert not problems, (b, problems)
