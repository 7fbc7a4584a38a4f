"""Block sparsity in the varlen kernel (`attention_varlen(..., block_mask=)`, CPU interpreter).

A packed batch's block mask is the per-sequence block mask, stacked: B is the number of
sequences (or 1), q-block r of sequence b holds its queries [r q_block, (r + 1) q_block)
counted from its first query, key block j its keys counted from its first key; the lists are
[S or 1, HQ or 1, ceil(max_seqlen_q / q_block)] and [.., ceil(max_seqlen_k / kv_block)]. The
meaning is FlexAttention's per sequence (tests/test_block_sparse.py: partial blocks where
mask_mod holds, full blocks entirely, the built-in mask everywhere), judged per sequence
against the float64 reference of that meaning. Blocks past a sequence's keys read nothing:
with seqused_k the rows after a sequence's used keys hold NaN, and lists that name every
block still give finite outputs equal to the reference. Every launch runs under
tests/memory_watch.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from attngen.reference import compare_to_reference
from tests.kernel_harness import load_kernel, make_spec
from tests.memory_watch import watching
from tests.test_block_sparse import (
    HEADS,
    _hostile,
    dense_keep,
    lists_of,
    mask_mod_values,
    reference_spec,
    sampled_block_mask,
    score_mod_tensors,
)
from tests.test_expression_kernels import CASES, case_tensors
from tests.test_varlen_properties import cu_seqlens, packed_inputs


def varlen_spec(case: str, dtype: str, causal: bool):
    mask = dict(mask="causal", causal_align="top_left") if causal else dict(mask="none")
    return make_spec(name="flex", dtype=dtype, kernels=["varlen"], **mask, **CASES[case])


def sequence_problems(params, out, lse, q, k, v, cu_q, cu_k, used, tensors, block_mask):
    """Each sequence's (out, lse) against the reference of its block mask's meaning."""
    case, dtype, causal = params["case"], params["dtype"], params["causal"]
    lengths_q = (cu_q[1:] - cu_q[:-1]).tolist()
    max_q, max_k = max(lengths_q), max(used)
    spec = varlen_spec(case, dtype, causal)
    values = mask_mod_values(spec, tensors, len(used), max_q, max_k)
    keep = dense_keep(block_mask, values, max_q, max_k)
    read = {t["name"]: tensors[t["name"]] for t in score_mod_tensors(case)}
    problems = []
    for b, (nq, nk) in enumerate(zip(lengths_q, used, strict=True)):
        if nq == 0:  # no row to judge
            continue
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b]) + nk)
        mine = keep[:, :, :nq, :nk]
        found = compare_to_reference(
            reference_spec(case, dtype, causal, mine),
            out[rows].transpose(0, 1)[None], lse[:, rows][None],
            *(t[s].transpose(0, 1)[None] for t, s in ((q, rows), (k, keys), (v, keys))),
            tensors={**read, "keep": mine}, first_b=b,
        )  # fmt: skip
        problems += [f"sequence {b}: {p}" for p in found]
    return problems


def run_varlen(kernel, q, k, v, cu_q, cu_k, used, tensors, block_mask, seqused=False):
    lengths_q = (cu_q[1:] - cu_q[:-1]).tolist()
    options = dict(seqused_k=torch.tensor(used, dtype=torch.int32)) if seqused else {}
    with watching():
        return kernel.attention_varlen(
            q, k, v, cu_q, cu_k, max(lengths_q), max(used), return_lse=True,
            tensors=tensors or None, block_mask=block_mask, **options,
        )  # fmt: skip


@st.composite
def varlen_case(draw):
    block_m, block_n = draw(st.sampled_from([16, 32])), draw(st.sampled_from([16, 32]))
    count = draw(st.integers(1, 3))
    return dict(
        case=draw(st.sampled_from(sorted(CASES))),
        dtype=draw(st.sampled_from(["fp16", "bf16", "fp32"])),
        causal=draw(st.booleans()),
        blocks=(block_m, block_n),
        q_block=block_m * draw(st.sampled_from([1, 2])),
        kv_block=block_n * draw(st.sampled_from([1, 2])),
        lengths_q=[
            40,
            *draw(
                st.lists(st.sampled_from([0, 1, 17, 33]), min_size=count - 1, max_size=count - 1)
            ),
        ],
        lengths_k=draw(st.lists(st.sampled_from([1, 16, 31, 50]), min_size=count, max_size=count)),
        broadcast=(draw(st.booleans()), draw(st.booleans())),
        full=draw(st.booleans()),
        drop=draw(st.sampled_from([0.0, 0.3])),
        promote=draw(st.sampled_from([0.0, 0.5])),
        index_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        seed=draw(st.integers(0, 2**16)),
    )


def build_varlen_case(params):
    """(kernel, q, k, v, cu_q, cu_k, tensors, block_mask) of a varlen_case draw: each
    sequence's exact block mask (create_block_mask's of mask_mod), disturbed."""
    spec = varlen_spec(params["case"], params["dtype"], params["causal"])
    kernel = load_kernel(spec, *params["blocks"], kind="varlen")
    lengths_q, lengths_k = params["lengths_q"], params["lengths_k"]
    q, k, v, _ = packed_inputs(spec, lengths_q, lengths_k, seed=params["seed"])
    count, max_q, max_k = len(lengths_q), max(lengths_q), max(lengths_k)
    tensors = case_tensors(params["case"], count, max(max_q, max_k), params["seed"])
    values = mask_mod_values(spec, tensors, count, max_q, max_k)
    for b, (nq, nk) in enumerate(zip(lengths_q, lengths_k, strict=True)):
        values[b, :, nq:] = values[b, :, :, nk:] = False  # blocks past it: none (torch's)
    block_mask = sampled_block_mask(values, params, HEADS)
    return kernel, q, k, v, cu_seqlens(lengths_q), cu_seqlens(lengths_k), tensors, block_mask


@given(params=varlen_case())
@example(params=dict(case="document", dtype="bf16", causal=True, blocks=(16, 16), q_block=32,
                     kv_block=16, lengths_q=[40, 0, 17], lengths_k=[50, 16, 31],
                     broadcast=(False, True), full=True, drop=0.3, promote=0.5,
                     index_dtype=torch.int32, seed=1))  # fmt: skip
@example(params=dict(case="relative_bias", dtype="fp32", causal=False, blocks=(32, 16),
                     q_block=32, kv_block=32, lengths_q=[40, 1], lengths_k=[16, 50],
                     broadcast=(True, False), full=False, drop=0.3, promote=0.0,
                     index_dtype=torch.int64, seed=2))  # fmt: skip
def test_varlen_block_masks_mean_what_flex_means_per_sequence(params) -> None:
    kernel, q, k, v, cu_q, cu_k, tensors, block_mask = build_varlen_case(params)
    used = params["lengths_k"]
    out, lse = run_varlen(kernel, q, k, v, cu_q, cu_k, used, tensors, block_mask)
    problems = sequence_problems(params, out, lse, q, k, v, cu_q, cu_k, used, tensors, block_mask)
    assert not problems, "; ".join(problems)


DOCUMENT = dict(case="document", dtype="fp32", causal=False)


@pytest.mark.parametrize("kind", ["every_block", "negative", "huge", "counts_beyond_the_row"])
def test_lists_never_read_past_a_sequence(kind: str) -> None:
    """Sequences shorter than max_seqlen_k whose lists name blocks past their keys (every
    block, or hostile entries): the rows after each sequence's used keys (seqused_k) hold NaN,
    yet every output is finite and each sequence matches its reference (counts clamped to the
    lists' length, an index outside [0, ceil(keys / kv_block)) naming no block)."""
    lengths_q, lengths_k, used = [20, 33, 5], [48, 48, 48], [13, 48, 30]
    spec = varlen_spec("document", "fp32", False)
    kernel = load_kernel(spec, 16, 16, kind="varlen")
    q, k, v, _ = packed_inputs(spec, lengths_q, lengths_k, seed=9)
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    for b, n in enumerate(used):
        k[int(cu_k[b]) + n : int(cu_k[b + 1])] = float("nan")
        v[int(cu_k[b]) + n : int(cu_k[b + 1])] = float("nan")
    tensors = case_tensors("document", 3, 48, 9)
    if kind == "every_block":
        every = torch.ones(3, HEADS, 3, 3, dtype=torch.bool)
        num, indices = lists_of(every)
    else:  # broadcast over the sequences and heads
        num, indices = _hostile(kind, torch.int32)
    block_mask = (num, indices, None, None, 16, 16)
    out, lse = run_varlen(kernel, q, k, v, cu_q, cu_k, used, tensors, block_mask, seqused=True)
    assert torch.isfinite(out[: int(cu_q[-1])]).all()
    problems = sequence_problems(DOCUMENT, out, lse, q, k, v, cu_q, cu_k, used, tensors, block_mask)
    assert not problems, "; ".join(problems)


def _lists(shape, cols=3):
    return torch.zeros(shape, dtype=torch.int32), torch.zeros((*shape, cols), dtype=torch.int32)


@pytest.mark.parametrize(
    ("block_mask", "message"),
    [
        ((*_lists((3, 4, 2)), None, None, 16, 16), r"^block_mask: kv_num_blocks: shape \(3, 4, "
         r"2\); allowed: \(2 or 1, 4 or 1, 3\) \(sequences, HQ, ceil\(max_seqlen_q / q_block\)\)$"),
        ((*_lists((2, 4, 3), 2), None, None, 16, 16), r"^block_mask: kv_indices: shape \(2, 4, 3, "
         r"2\); allowed: .* \(sequences, HQ, ceil\(max_seqlen_q / q_block\), "
         r"ceil\(max_seqlen_k / kv_block\)\)$"),
        ((*_lists((2, 4, 3)), None, None, 8, 16), r"^block_mask: q_block 8; allowed: a positive "
         r"multiple of this module's BLOCK_M 16 \(its launch config\)$"),
        ((1, 2), r"^block_mask: got tuple; allowed: None or a tuple"),
    ],
)  # fmt: skip
def test_varlen_block_mask_arguments_are_checked(block_mask, message) -> None:
    """Lists against the sequences, HQ, ceil(max_seqlen_q / q_block) and ceil(max_seqlen_k /
    kv_block); block sizes against the tile; the tuple's form."""
    spec = varlen_spec("document", "fp32", False)
    kernel = load_kernel(spec, 16, 16, kind="varlen")
    q, k, v, _ = packed_inputs(spec, [40, 7], [33, 48], seed=3)
    tensors = case_tensors("document", 2, 48, 3)
    with pytest.raises(ValueError, match=message):
        kernel.attention_varlen(
            q, k, v, cu_seqlens([40, 7]), cu_seqlens([33, 48]), 40, 48, tensors=tensors,
            block_mask=block_mask,
        )  # fmt: skip


def test_a_sequence_whose_lists_are_empty_sees_no_key() -> None:
    """The lists' batch axis is the sequence: sequence 1 listing nothing gets output 0 and LSE
    -inf; sequences 0 and 2 (the exact block mask of mask_mod) get the dense result bit for
    bit (the same tiles in the same order)."""
    lengths_q, lengths_k = [20, 33, 5], [48, 17, 30]
    spec = varlen_spec("document", "fp32", False)
    kernel = load_kernel(spec, 16, 16, kind="varlen")
    q, k, v, _ = packed_inputs(spec, lengths_q, lengths_k, seed=4)
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    tensors = case_tensors("document", 3, 48, 4)
    every = torch.ones(3, 1, 3, 3, dtype=torch.bool)
    every[1] = False
    block_mask = (*lists_of(every), None, None, 16, 16)
    out, lse = run_varlen(kernel, q, k, v, cu_q, cu_k, lengths_k, tensors, block_mask)
    dense, dense_lse = kernel.attention_varlen(
        q, k, v, cu_q, cu_k, 33, 48, return_lse=True, tensors=tensors
    )
    assert torch.all(out[20:53] == 0) and torch.all(lse[:, 20:53] == float("-inf"))
    assert torch.equal(out[:20], dense[:20]) and torch.equal(out[53:58], dense[53:58])
    assert torch.equal(lse[:, :20], dense_lse[:, :20])
