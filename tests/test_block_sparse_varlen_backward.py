"""The varlen block-sparse backward (`attention_varlen(..., block_mask=)` with gradients, and
`attention_varlen_backward(..., block_mask=)`; CPU interpreter).

The block mask is the varlen forward's (tests/test_block_sparse_varlen.py): per sequence,
stacked over the sequences. Its meaning per sequence is compiled Flex's (an unlisted block
adds to no gradient, full blocks skip mask_mod); each sequence's dq, dk, dv are judged against
float64 autograd through the reference of that meaning (tests/test_block_sparse_backward.py's
rule), the trainable table's gradient as the sum over sequences. Both backward paths, GQA (4
query heads, 2 KV heads), broadcast B and H. Every launch runs under tests/memory_watch.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from attngen.reference import lowp_reference, reference_attention
from attngen.reference.backward import (
    compare_gradients,
    golden_backward,
    lowp_backward,
    tensor_gradient_sigmas,
    tensor_problems,
)
from tests.backward_harness import Blocks, cu_seqlens, module_for, packed_inputs
from tests.memory_watch import watching
from tests.test_backward_properties import EXAMPLES
from tests.test_block_sparse import (
    HEADS,
    _hostile,
    dense_keep,
    disturb,
    exact_block_mask,
    lists_of,
    mask_mod_values,
    sampled_block_mask,
    score_mod_tensors,
)
from tests.test_block_sparse_backward import reference_backward_spec
from tests.test_expression_backward import TRAINABLE, expression_backward_spec, leaves_of
from tests.test_expression_kernels import case_tensors

KV_HEADS = 2


def run_varlen_backward(params, module, q, k, v, dout, lengths, tensors, block_mask):
    """out and (dq, dk, dv, {name: grad}) through attention_varlen under the memory watch."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    passed = leaves_of(params["case"], tensors)
    (lengths_q, lengths_k), (cu_q, cu_k) = lengths, (cu_seqlens(n).to(q.device) for n in lengths)
    with watching():
        out = module.attention_varlen(
            *leaves, cu_q, cu_k, max(lengths_q), max(lengths_k), tensors=passed,
            block_mask=block_mask, deterministic=params["deterministic"],
        )  # fmt: skip
        out.backward(dout)
    trained = {n: t.grad for n, t in passed.items() if t.requires_grad}
    return out.detach(), [*(t.grad for t in leaves), trained]


def sequence_gradient_problems(params, grads, q, k, v, dout, lengths, tensors, block_mask):
    """Each sequence's dq, dk, dv against the reference of its block mask's meaning, and the
    trainable table's gradient against the sum of the sequences'; [] if nothing is wrong."""
    case, dtype, causal = params["case"], params["dtype"], params["causal"]
    (lengths_q, lengths_k), (cu_q, cu_k) = lengths, map(cu_seqlens, lengths)
    spec = expression_backward_spec(case, dtype, causal, kernels=("varlen",))
    count, max_q, max_k = len(lengths_q), max(lengths_q), max(lengths_k)
    keep = dense_keep(block_mask, mask_mod_values(spec, tensors, count, max_q, max_k), max_q, max_k)
    read = {t["name"]: tensors[t["name"]] for t in score_mod_tensors(case)}
    problems, sums = [], [0, 0, 0]
    for b, (nq, nk) in enumerate(zip(lengths_q, lengths_k, strict=True)):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        args = [t[r].transpose(0, 1)[None] for t, r in ((q, rows), (k, keys), (v, keys))]
        mine = [
            g[r].transpose(0, 1)[None] for g, r in zip(grads[:3], (rows, keys, keys), strict=True)
        ]
        if nq == 0:  # no query: its keys get no gradient
            problems += [f"sequence {b}: dk, dv not 0" for g in mine[1:] if g.any()]
            continue
        do = dout[rows].transpose(0, 1)[None]
        ref = reference_backward_spec(case, dtype, causal, keep[:, :, :nq, :nk])
        exprs = {"tensors": {**read, "keep": keep[:, :, :nq, :nk]}, "first_b": b}
        found = compare_gradients(ref, mine, *args, do, **exprs)
        problems += [f"sequence {b}: {p}" for p in found]
        if case in TRAINABLE:
            sums = [a + b for a, b in zip(sums, table_gradients(ref, args, do, exprs), strict=True)]
    if case in TRAINABLE:
        golden, lowp, sigma2 = sums
        problems += tensor_problems("bias", grads[3]["bias"], golden, lowp, sigma2**0.5)
    return problems  # fmt: skip


def table_gradients(ref, args, do, exprs):
    """(golden, low-precision gradient, sigma squared) of the trainable table for one sequence."""
    golden = golden_backward(ref, *args, do, **exprs)[-1]["bias"]
    lowp = lowp_backward(ref, *args, do, **exprs)[-1]["bias"]
    outs = [f(ref, *args, **exprs)[0] for f in (reference_attention, lowp_reference)]
    sigma = tensor_gradient_sigmas(ref, *args[:2], do, *outs, exprs=exprs)["bias"]
    return golden, lowp, sigma**2


def gradient_problems_of(params, grads, case_inputs, lengths):
    """sequence_gradient_problems, and a non-finite gradient inside the packed sequences."""
    problems = sequence_gradient_problems(
        params, grads, *case_inputs[:4], lengths, *case_inputs[4:]
    )
    rows, keys = sum(lengths[0]), sum(lengths[1])
    for name, g, n in zip(("dq", "dk", "dv"), grads[:3], (rows, keys, keys), strict=True):
        if not torch.isfinite(g[:n]).all():
            problems.append(f"{name}: not finite inside the sequences")
    return problems


@st.composite
def varlen_backward_case(draw):
    tiles = [(draw(st.sampled_from([16, 32])), draw(st.sampled_from([16, 32]))) for _ in range(3)]
    block_m, block_n = (max(tile[i] for tile in tiles) for i in (0, 1))
    count = draw(st.integers(1, 3))
    return dict(
        case=draw(st.sampled_from(["document", "prefix_lm", "relative_bias", "softcap"])),
        dtype=draw(st.sampled_from(["fp16", "bf16", "fp32"])),
        causal=draw(st.booleans()),
        blocks=Blocks(*tiles),
        q_block=block_m * draw(st.sampled_from([1, 2])),
        kv_block=block_n * draw(st.sampled_from([1, 2])),
        lengths_q=[40, *draw(st.lists(st.sampled_from([0, 1, 17, 33]), min_size=count - 1,
                                      max_size=count - 1))],
        lengths_k=draw(st.lists(st.sampled_from([1, 16, 31, 50]), min_size=count, max_size=count)),
        broadcast=(draw(st.booleans()), draw(st.booleans())),
        full=draw(st.booleans()),
        drop=draw(st.sampled_from([0.0, 0.3])),
        promote=draw(st.sampled_from([0.0, 0.5])),
        index_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        deterministic=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


def build_varlen_backward_case(params):
    """(module, q, k, v, dout, tensors, block_mask): each sequence's exact block mask
    (create_block_mask's of mask_mod, stacked), disturbed."""
    spec = expression_backward_spec(params["case"], params["dtype"], params["causal"], ("varlen",))
    module = module_for(spec, params["blocks"], kind="varlen")
    lengths_q, lengths_k = params["lengths_q"], params["lengths_k"]
    scale = 8.0 if params["case"] == "softcap" else 1.0
    q, k, v, dout, _ = packed_inputs(spec, lengths_q, lengths_k, HEADS, KV_HEADS, params["seed"])
    q, k = q * scale, k * scale
    count, max_q, max_k = len(lengths_q), max(lengths_q), max(lengths_k)
    tensors = case_tensors(params["case"], count, max(max_q, max_k), params["seed"])
    values = mask_mod_values(spec, tensors, count, max_q, max_k)
    for b, (nq, nk) in enumerate(zip(lengths_q, lengths_k, strict=True)):
        values[b, :, nq:] = values[b, :, :, nk:] = False  # blocks past it: none (torch's)
    block_mask = sampled_block_mask(values, params, HEADS)
    return module, q, k, v, dout, tensors, block_mask


@settings(max_examples=EXAMPLES)
@given(params=varlen_backward_case())
@example(params=dict(case="relative_bias", dtype="bf16", causal=True, blocks=Blocks(),
                     q_block=32, kv_block=16, lengths_q=[40, 0, 17], lengths_k=[50, 16, 31],
                     broadcast=(False, True), full=True, drop=0.3, promote=0.5,
                     index_dtype=torch.int32, deterministic=True, seed=1))  # fmt: skip
@example(params=dict(case="document", dtype="fp16", causal=False,
                     blocks=Blocks((16, 16), (32, 16), (16, 32)), q_block=32, kv_block=32,
                     lengths_q=[40, 33], lengths_k=[31, 50], broadcast=(True, False), full=True,
                     drop=0.3, promote=0.0, index_dtype=torch.int64, deterministic=False,
                     seed=2))  # fmt: skip
@example(params=dict(case="relative_bias", dtype="fp32", causal=False, blocks=Blocks(),
                     q_block=16, kv_block=32, lengths_q=[40, 1], lengths_k=[16, 50],
                     broadcast=(True, True), full=False, drop=0.3, promote=0.0,
                     index_dtype=torch.int32, deterministic=False, seed=3))  # fmt: skip
def test_varlen_block_sparse_gradients_mean_what_flex_means_per_sequence(params) -> None:
    module, q, k, v, dout, tensors, block_mask = build_varlen_backward_case(params)
    lengths = (params["lengths_q"], params["lengths_k"])
    _, grads = run_varlen_backward(params, module, q, k, v, dout, lengths, tensors, block_mask)
    problems = gradient_problems_of(params, grads, (q, k, v, dout, tensors, block_mask), lengths)
    assert not problems, "; ".join(problems)


DOCUMENT = dict(case="document", dtype="fp32", causal=False)
LENGTHS = ([20, 33, 5], [48, 17, 30])


def _document_varlen(seed=9):
    spec = expression_backward_spec("document", "fp32", False, kernels=("varlen",))
    q, k, v, dout, _ = packed_inputs(spec, *LENGTHS, HEADS, KV_HEADS, seed)
    return module_for(spec, kind="varlen"), q, k, v, dout, case_tensors("document", 3, 48, seed)


@pytest.mark.parametrize("kind", ["every_block", "negative", "huge", "counts_beyond_the_row",
                                  "negative_counts"])  # fmt: skip
@pytest.mark.parametrize("deterministic", [True, False])
def test_hostile_lists_in_the_varlen_backward(kind: str, deterministic: bool) -> None:
    """Lists naming blocks past a sequence's keys (every block of max_seqlen_k, or hostile
    entries broadcast over the sequences): both gradient kernels clamp counts to the lists'
    length and mask what lies past the sequence, so the gradients are those of the block mask
    that rule leaves, finite (the NaN rows after the packed sequences are never read), and
    no access leaves the tensors (the memory watch)."""
    module, q, k, v, dout, tensors = _document_varlen()
    if kind == "every_block":
        num, indices = lists_of(torch.ones(3, HEADS, 3, 3, dtype=torch.bool))
    else:
        num, indices = _hostile(kind, torch.int64 if deterministic else torch.int32)
    block_mask = (num, indices, num.clone().zero_(), indices.clone(), 16, 16)
    params = dict(DOCUMENT, deterministic=deterministic)
    _, grads = run_varlen_backward(params, module, q, k, v, dout, LENGTHS, tensors, block_mask)
    problems = gradient_problems_of(params, grads, (q, k, v, dout, tensors, block_mask), LENGTHS)
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("deterministic", [True, False])
def test_a_sequence_listing_nothing_gets_zero_gradients(deterministic: bool) -> None:
    """Sequence 1 lists no block: out, dq, dk, dv 0 in its rows; its neighbours keep theirs
    (the exact block mask of mask_mod: the dense gradients, to the rule)."""
    module, q, k, v, dout, tensors = _document_varlen(seed=4)
    every = torch.ones(3, 1, 3, 3, dtype=torch.bool)
    every[1] = False
    block_mask = (*lists_of(every), None, None, 16, 16)
    params = dict(DOCUMENT, deterministic=deterministic)
    out, grads = run_varlen_backward(params, module, q, k, v, dout, LENGTHS, tensors, block_mask)
    assert torch.all(out[20:53] == 0) and torch.all(grads[0][20:53] == 0)
    assert torch.all(grads[1][48:65] == 0) and torch.all(grads[2][48:65] == 0)
    problems = gradient_problems_of(params, grads, (q, k, v, dout, tensors, block_mask), LENGTHS)
    assert not problems, "; ".join(problems)
    assert bool(grads[1][:48].abs().sum() > 0)


@pytest.mark.parametrize("deterministic", [True, False])
def test_the_functional_varlen_backward_takes_the_block_mask(deterministic: bool) -> None:
    """attention_varlen_backward(..., block_mask=) under the memory watch: with
    deterministic=True the bits autograd gives; on both paths the gradients of the block
    mask's meaning (the rule)."""
    module, q, k, v, dout, tensors = _document_varlen(seed=3)
    spec = expression_backward_spec("document", "fp32", False, kernels=("varlen",))
    values = mask_mod_values(spec, tensors, 3, 33, 48)
    gen = torch.Generator().manual_seed(3)
    block_mask = disturb(exact_block_mask(values, 16, 16), gen, 0.3, 0.5)
    cu_q, cu_k = map(cu_seqlens, LENGTHS)
    out, lse = module.attention_varlen(q, k, v, cu_q, cu_k, 33, 48, return_lse=True,
                                       tensors=tensors, block_mask=block_mask)  # fmt: skip
    options = dict(tensors=tensors, block_mask=block_mask, deterministic=deterministic)
    with watching():
        got = module.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, 33, 48,
                                               **options)  # fmt: skip
    params = dict(DOCUMENT, deterministic=deterministic)
    problems = gradient_problems_of(params, got, (q, k, v, dout, tensors, block_mask), LENGTHS)
    assert not problems, "; ".join(problems)
    if deterministic:
        _, grads = run_varlen_backward(params, module, q, k, v, dout, LENGTHS, tensors, block_mask)
        assert all(torch.equal(a, b) for a, b in zip(got, grads[:3], strict=True))


def test_varlen_gradients_take_a_block_mask_and_refuse_tiles_that_do_not_divide_it() -> None:
    """block_mask_problem(..., backward=True) of a varlen module names the backward's
    configs; attention_varlen with gradients refuses a q_block its dK/dV tile does not
    divide when the call is made, and the functional backward too."""
    _, q, k, v, dout, tensors = _document_varlen()
    spec = expression_backward_spec("document", "fp32", False, kernels=("varlen",))
    module = module_for(spec, Blocks((16, 16), (16, 16), (32, 16)), kind="varlen")
    assert module.block_mask_problem(32, 16, 48, backward=True) is None
    assert module.block_mask_problem(16, 16, 48, backward=True) == (
        "q_block 16; allowed: a positive multiple of this module's BLOCK_M 32 (the backward's "
        "BWD_DKDV_CONFIG)"
    )
    cu_q, cu_k = map(cu_seqlens, LENGTHS)
    block_mask = (*lists_of(torch.ones(1, 1, 3, 3, dtype=torch.bool)), None, None, 16, 16)
    message = r"^block_mask: q_block 16; allowed: .* BLOCK_M 32 \(the backward's BWD_DKDV_CONFIG\)$"
    with pytest.raises(ValueError, match=message):
        module.attention_varlen(q.requires_grad_(), k, v, cu_q, cu_k, 33, 48, tensors=tensors,
                                block_mask=block_mask)  # fmt: skip
    with pytest.raises(ValueError, match=message):
        module.attention_varlen_backward(dout, q, k, v, q, q[..., 0].T, cu_q, cu_k, 33, 48,
                                         tensors=tensors, block_mask=block_mask)  # fmt: skip
