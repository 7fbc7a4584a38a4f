"""The backward of score_mod and mask_mod (CPU interpreter): dQ, dK, dV and a trainable
tensor's gradient against float64 autograd through the reference that evaluates the same
trees (attngen.reference.backward, by the rule of shared/RELIABILITY.md; the trainable
gradient by tensor_gradient_problems, a sum over many pairs like d sinks).

The cases are tests/test_expression_kernels.py's (a document mask, prefix-LM, a relative bias
table, here trainable, a softcap and ALiBi written as expressions, a read past its tensor),
with and without the built-in causal mask, on both backward paths (deterministic, and dQ by
atomics). Every launch runs under tests/memory_watch.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from attngen.build import plan_build
from attngen.reference import lowp_reference, reference_attention
from attngen.reference.backward import (
    compare_gradients,
    golden_backward,
    lowp_backward,
    tensor_gradient_sigmas,
    tensor_problems,
)
from attngen.spec import SpecError
from tests.backward_harness import Blocks, cu_seqlens, module_for, packed_inputs
from tests.kernel_harness import load_kernel, make_inputs, make_spec
from tests.memory_watch import watching
from tests.test_backward_properties import EXAMPLES
from tests.test_expression_kernels import CASES, case_tensors

TRAINABLE = {"relative_bias"}  # its table is declared trainable: true here


def backward_fields(case: str) -> dict:
    fields = dict(CASES[case])
    if case in TRAINABLE:
        fields["tensors"] = [dict(t, trainable=True) for t in fields["tensors"]]
    return fields


def expression_backward_spec(case: str, dtype: str, causal: bool, kernels=("prefill",)):
    mask = dict(mask="causal", causal_align="top_left") if causal else dict(mask="none")
    return make_spec(
        name="flexbwd", dtype=dtype, backward=True, kernels=list(kernels), **mask,
        **backward_fields(case),
    )  # fmt: skip


def leaves_of(case: str, tensors: dict) -> dict:
    """The tensors as the call passes them: a trainable one as a leaf that requires grad."""
    return {
        n: t.clone().requires_grad_() if case in TRAINABLE and t.is_floating_point() else t
        for n, t in tensors.items()
    }


def run(module, q, k, v, dout, tensors, **options):
    """out and the gradients through attention(): dq, dk, dv, then {name: grad} of the
    trainable tensors (where the spec has some)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with watching():
        out = module.attention(*leaves, tensors=tensors, **options)
        out.backward(dout)
    trained = {n: t.grad for n, t in tensors.items() if t.requires_grad}
    return out.detach(), [*(t.grad for t in leaves), *((trained,) if trained else ())]


@st.composite
def dense_case(draw):
    return dict(
        case=draw(st.sampled_from(sorted(CASES))),
        dtype=draw(st.sampled_from(["fp16", "bf16", "fp32"])),
        causal=draw(st.booleans()),
        blocks=Blocks(*((draw(st.sampled_from([16, 32])), 16) for _ in range(3))),
        seqlen_q=draw(st.sampled_from([1, 15, 17, 33])),
        seqlen_k=draw(st.sampled_from([1, 16, 17, 31])),
        batch=draw(st.integers(1, 2)),
        seed=draw(st.integers(0, 2**16)),
        deterministic=draw(st.booleans()),
    )


@settings(max_examples=EXAMPLES)
@given(params=dense_case())
@example(params=dict(case="relative_bias", dtype="bf16", causal=True, blocks=Blocks(),
                     seqlen_q=33, seqlen_k=31, batch=2, seed=1, deterministic=True))  # fmt: skip
@example(params=dict(case="document", dtype="fp16", causal=True, blocks=Blocks(),
                     seqlen_q=33, seqlen_k=33, batch=2, seed=2, deterministic=False))  # fmt: skip
@example(params=dict(case="softcap", dtype="fp32", causal=False, blocks=Blocks((32, 16)),
                     seqlen_q=17, seqlen_k=31, batch=1, seed=3, deterministic=True))  # fmt: skip
@example(params=dict(case="relative_bias", dtype="fp32", causal=False, blocks=Blocks(),
                     seqlen_q=17, seqlen_k=33, batch=1, seed=4, deterministic=False))  # fmt: skip
@example(params=dict(case="relative_bias", dtype="fp16", causal=False, blocks=Blocks(),
                     seqlen_q=33, seqlen_k=17, batch=1, seed=5, deterministic=True))  # fmt: skip
def test_expression_gradients_match_the_reference(params) -> None:
    case = params["case"]
    spec = expression_backward_spec(case, params["dtype"], params["causal"])
    module = module_for(spec, params["blocks"])
    batch, seqlen_q, seqlen_k = params["batch"], params["seqlen_q"], params["seqlen_k"]
    scale = 8.0 if case == "softcap" else 1.0  # scores past the cap
    q, k, v, _ = make_inputs(spec, batch, seqlen_q, seqlen_k, seed=params["seed"], scale=scale)
    dout = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=torch.Generator().manual_seed(7))
    tensors = case_tensors(case, batch, max(seqlen_q, seqlen_k), params["seed"])
    out, grads = run(
        module, q, k, v, dout.to(q.dtype), leaves_of(case, tensors),
        deterministic=params["deterministic"],
    )  # fmt: skip
    problems = compare_gradients(spec, grads, q, k, v, dout.to(q.dtype), tensors=tensors)
    assert not problems, "; ".join(problems)
    assert all(torch.isfinite(g).all() for g in grads[:3])


@pytest.mark.parametrize("deterministic", [True, False])
def test_the_derived_backward_configs_run(deterministic: bool) -> None:
    """The tiling model counts no registers for an expression: the configs it derives (here
    sm80's, unchanged by the test) run the expressions and pass the rule."""
    spec = expression_backward_spec("relative_bias", "fp16", causal=True)
    module = load_kernel(spec, arch="sm80")
    q, k, v, _ = make_inputs(spec, 1, 70, 130, seed=9)
    dout = torch.randn(1, 4, 70, 64).to(q.dtype)
    tensors = case_tensors("relative_bias", 1, 130, 9)
    _, grads = run(module, q, k, v, dout, leaves_of("relative_bias", tensors),
                   deterministic=deterministic)  # fmt: skip
    assert not compare_gradients(spec, grads, q, k, v, dout, tensors=tensors)


def test_a_row_that_sees_no_key_gets_zero_gradients() -> None:
    """Rows past the table (q_idx >= 20) read nothing: every key masked, dQ 0 there, and their
    dO reaches no dK or dV (a NaN-free zero)."""
    spec = expression_backward_spec("out_of_range", "bf16", causal=False)
    module = module_for(spec)
    q, k, v, _ = make_inputs(spec, 1, 24, 16, seed=0)
    dout = torch.randn(1, 4, 24, 64).to(q.dtype)
    tensors = case_tensors("out_of_range", 1, 24, 0)
    out, (dq, dk, dv) = run(module, q, k, v, dout, tensors)
    assert torch.all(out[:, :, 20:] == 0) and torch.all(dq[:, :, 20:] == 0)
    _, (_, dk_blind, dv_blind) = run(module, q, k, v, torch.cat(
        [dout[:, :, :20], torch.full_like(dout[:, :, 20:], 1e4)], 2), tensors)  # fmt: skip
    assert torch.equal(dk, dk_blind) and torch.equal(dv, dv_blind)
    assert not compare_gradients(spec, (dq, dk, dv), q, k, v, dout, tensors=tensors)


def test_a_fully_masked_sequence_gets_zero_gradients_everywhere() -> None:
    """mask_mod kv_idx < prefix[b] with prefix 0 hides every key of sequence 0: its output
    and every gradient exactly 0; sequence 1's keys past its prefix get none."""
    spec = make_spec(
        name="flexbwd", dtype="fp16", mask="none", backward=True, mask_mod="kv_idx < prefix[b]",
        tensors=[{"name": "prefix", "dtype": "int64", "shape": ["B"]}],
    )  # fmt: skip
    q, k, v, _ = make_inputs(spec, 2, 17, 17, seed=3)
    tensors = {"prefix": torch.tensor([0, 5])}
    dout = torch.randn(2, 4, 17, 64).to(q.dtype)
    out, (dq, dk, dv) = run(module_for(spec), q, k, v, dout, tensors)
    assert torch.all(out[0] == 0) and torch.all(dq[0] == 0)
    assert torch.all(dk[0] == 0) and torch.all(dv[0] == 0)
    assert torch.all(dk[1, :, 5:] == 0) and bool(dk[1, :, :5].abs().sum() > 0)
    assert not compare_gradients(spec, (dq, dk, dv), q, k, v, dout, tensors=tensors)


def test_the_functional_backward_returns_the_trainable_gradients() -> None:
    """attention_backward(..., tensors=) gives what autograd gives, the trainable tensor's
    gradient last as {name: grad} in its dtype; deterministic=True reproduces dq, dk, dv."""
    spec = expression_backward_spec("relative_bias", "bf16", causal=True)
    module = module_for(spec)
    q, k, v, _ = make_inputs(spec, 2, 20, 20, seed=6)
    dout = torch.randn(2, 4, 20, 64).to(q.dtype)
    tensors = case_tensors("relative_bias", 2, 20, 6)
    _, grads = run(module, q, k, v, dout, leaves_of("relative_bias", tensors))
    out, lse = module.attention(q, k, v, tensors=tensors, return_lse=True)
    dq, dk, dv, dtensors = module.attention_backward(dout, q, k, v, out, lse, tensors=tensors)
    assert sorted(dtensors) == ["bias"] and dtensors["bias"].dtype == torch.float32
    for got, expected in zip(
        (dq, dk, dv, dtensors["bias"]), (*grads[:3], grads[3]["bias"]), strict=True
    ):
        assert torch.equal(got, expected)
    again = module.attention_backward(dout, q, k, v, out, lse, tensors=tensors)
    assert all(torch.equal(a, b) for a, b in zip(again[:3], (dq, dk, dv), strict=True))
    # tensor_grads=False (what the autograd passes when no trainable tensor requires grad):
    # no table gradient, the same dq, dk, dv bits
    *skipped, none = module.attention_backward(
        dout, q, k, v, out, lse, tensors=tensors, tensor_grads=False
    )
    assert none == {} and all(torch.equal(a, b) for a, b in zip(skipped, (dq, dk, dv), strict=True))


def test_a_trainable_tensor_that_needs_no_grad_gets_none() -> None:
    """Without requires_grad the table gets no gradient (the kernel skips its atomics), and
    q, k, v's gradients are the same bits."""
    spec = expression_backward_spec("relative_bias", "fp32", causal=False)
    module = module_for(spec)
    q, k, v, _ = make_inputs(spec, 1, 17, 17, seed=8)
    dout = torch.randn(1, 4, 17, 64)
    tensors = case_tensors("relative_bias", 1, 17, 8)
    _, frozen = run(module, q, k, v, dout, tensors)
    _, trained = run(module, q, k, v, dout, leaves_of("relative_bias", tensors))
    assert len(frozen) == 3 and all(
        torch.equal(a, b) for a, b in zip(frozen, trained[:3], strict=True)
    )


def test_a_frozen_tensor_that_requires_grad_is_refused() -> None:
    spec = make_spec(
        name="flexbwd", backward=True, score_mod="score + bias[h]",
        tensors=[{"name": "bias", "dtype": "float32", "shape": ["H"]}],
    )  # fmt: skip
    q, k, v, _ = make_inputs(spec, 1, 8, 8, seed=0)
    bias = torch.zeros(4, requires_grad=True)
    with pytest.raises(ValueError, match=r"^tensors\['bias'\]: requires grad; allowed: a tensor"):
        module_for(spec).attention(q, k, v, tensors={"bias": bias})


@pytest.mark.parametrize("case", ["relative_bias", "document"])
@pytest.mark.parametrize("deterministic", [True, False])
def test_varlen_gradients_per_sequence(case: str, deterministic: bool) -> None:
    """b is the sequence and q_idx, kv_idx positions in it; the trainable table's gradient
    is the sum over sequences of each one's, judged against the sums."""
    spec = expression_backward_spec(case, "bf16", causal=True, kernels=("varlen",))
    module = module_for(spec, kind="varlen")
    lengths_q, lengths_k = [5, 0, 33, 17], [9, 4, 33, 20]
    q, k, v, dout, _ = packed_inputs(spec, lengths_q, lengths_k, 4, 2, seed=4)
    tensors = case_tensors(case, len(lengths_q), max(lengths_k), seed=4)
    passed = leaves_of(case, tensors)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    with watching():
        out = module.attention_varlen(
            *leaves, cu_q, cu_k, max(lengths_q), max(lengths_k), tensors=passed,
            deterministic=deterministic,
        )  # fmt: skip
        out.backward(dout)
    golden_sum, lowp_sum, sigma2 = 0, 0, 0
    for b in range(len(lengths_q)):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        args = [t[r].transpose(0, 1)[None] for t, r in ((q, rows), (k, keys), (v, keys))]
        grads = [
            t.grad[r].transpose(0, 1)[None] for t, r in zip(leaves, (rows, keys, keys), strict=True)
        ]
        do = dout[rows].transpose(0, 1)[None]
        problems = compare_gradients(spec, grads, *args, do, tensors=tensors, first_b=b)
        assert not problems, (b, problems)
        if case in TRAINABLE:
            golden = golden_backward(spec, *args, do, tensors=tensors, first_b=b)
            lowp = lowp_backward(spec, *args, do, tensors=tensors, first_b=b)
            exprs = {"tensors": tensors, "first_b": b}
            golden_out = reference_attention(spec, *args, **exprs)[0]
            lowp_out = lowp_reference(spec, *args, **exprs)[0]
            sigma = tensor_gradient_sigmas(spec, *args[:2], do, golden_out, lowp_out, exprs=exprs)
            golden_sum = golden_sum + golden[-1]["bias"]
            lowp_sum = lowp_sum + lowp[-1]["bias"]
            sigma2 = sigma2 + sigma["bias"] ** 2
    if case in TRAINABLE:
        got = passed["bias"].grad
        assert not tensor_problems("bias", got, golden_sum, lowp_sum, sigma2**0.5)


def test_the_build_renders_backward_expression_modules() -> None:
    spec = expression_backward_spec("relative_bias", "bf16", True, kernels=("prefill", "varlen"))
    paths = [a.relative_path for a in plan_build([spec])]
    assert len(paths) == 2 and all(p.endswith("_bwd.py") for p in paths)


@pytest.mark.parametrize("name", ["lse", "delta"])
def test_the_gradient_kernels_own_names_are_reserved(name: str) -> None:
    """A tensor named lse or delta would shadow the dK/dV kernel's lse_ptr / delta_ptr."""
    with pytest.raises(SpecError, match=f"^tensors: got '{name}'; allowed: unique names other"):
        make_spec(
            name="flexbwd", backward=True, score_mod=f"score + {name}[h]",
            tensors=[{"name": name, "dtype": "float32", "shape": ["H"]}],
        )  # fmt: skip
