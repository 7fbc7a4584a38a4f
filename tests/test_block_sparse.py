"""Block sparsity in the prefill kernel of expression modules (`block_mask=`, CPU interpreter).

A block mask (torch's BlockMask fields as a tuple) lists per (b, h, q-block) the key blocks a
tile visits: partial ones (mask_mod evaluated) and full ones (mask_mod not evaluated). Its
meaning is FlexAttention's, which the float64 reference here spells out element by element: a
key is kept where its block is listed as partial and mask_mod holds, or listed as full, and
the spec's built-in mask holds (reference_spec: the same spec with mask_mod replaced by a
`keep` tensor of exactly that). Block masks are built from the mask_mod's own values
(exact_block_mask: any / all per block, as torch's create_block_mask does), by torch's
create_block_mask, and then disturbed (blocks dropped, partial blocks promoted to full, order
shuffled, hostile entries). Every launch runs under tests/memory_watch.py.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from attngen.reference import compare_to_reference
from attngen.spec.expressions import declared, parsed
from attngen.spec.masks import expression_values
from tests.kernel_harness import load_kernel, make_inputs, make_spec
from tests.memory_watch import tensor_span, watching
from tests.test_expression_kernels import CASES, case_tensors, expression_spec

HEADS = 4  # make_spec's query heads (2 KV heads: GQA)


def mask_mod_values(spec, tensors, batch: int, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """[B, HQ, Nq, Nk] bool: mask_mod's values (all True for a spec without one)."""
    tree = parsed(spec, "mask_mod")
    if tree is None:
        return torch.ones(batch, HEADS, seqlen_q, seqlen_k, dtype=torch.bool)
    shape = (batch, HEADS, seqlen_q, seqlen_k)
    return expression_values("mask_mod", tree, declared(spec), tensors, shape).clone()


def block_grid(keep: torch.Tensor, q_block: int, kv_block: int):
    """(any, all) per block of a [B, H, Nq, Nk] bool mask: [B, H, rows, cols] each."""
    b, h, nq, nk = keep.shape
    rows, cols = -(-nq // q_block), -(-nk // kv_block)
    padded = torch.zeros(b, h, rows * q_block, cols * kv_block, dtype=torch.int32)
    valid = torch.zeros_like(padded)
    padded[..., :nq, :nk] = keep.int()
    valid[..., :nq, :nk] = 1
    blocks = padded.view(b, h, rows, q_block, cols, kv_block).sum((3, 5))
    sizes = valid.view(b, h, rows, q_block, cols, kv_block).sum((3, 5))
    return blocks > 0, blocks == sizes


def lists_of(chosen: torch.Tensor, gen: torch.Generator | None = None, dtype=torch.int32):
    """(counts [.., rows], indices [.., rows, cols]) listing the True blocks of `chosen` per row,
    in a random order (gen) or ascending; unused slots hold garbage (cols + 7)."""
    cols = chosen.shape[-1]
    counts = chosen.sum(-1).to(dtype)
    indices = torch.full(chosen.shape, cols + 7, dtype=dtype)
    flat, out = chosen.reshape(-1, cols), indices.view(-1, cols)
    for r in range(flat.shape[0]):
        found = flat[r].nonzero().flatten()
        if gen is not None:
            found = found[torch.randperm(found.numel(), generator=gen)]
        out[r, : found.numel()] = found.to(dtype)
    return counts, indices


def exact_block_mask(values, q_block, kv_block, *, gen=None, dtype=torch.int32):
    """The block mask torch's create_block_mask makes of mask_mod's values: blocks with some
    kept element listed, those with every element kept as full."""
    some, every = block_grid(values, q_block, kv_block)
    partial, full = lists_of(some & ~every, gen, dtype), lists_of(every, gen, dtype)
    return (*partial, *full, q_block, kv_block)


def dense_keep(block_mask, values, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """FlexAttention's meaning of a block mask as a [B, HQ, Nq, Nk] bool mask: partial blocks
    where mask_mod holds, full blocks entirely. Counts are clamped to [0, cols] and indices
    outside [0, cols) name no block (the kernel's rule for hostile lists)."""
    num, indices, full_num, full_indices, q_block, kv_block = block_mask
    keep = torch.zeros(values.shape, dtype=torch.bool)
    for counts, listed, partial in ((num, indices, True), (full_num, full_indices, False)):
        if counts is None:
            continue
        cols = listed.shape[-1]
        counts, listed = counts.long().clamp(0, cols), listed.long()
        for b in range(values.shape[0]):
            for h in range(values.shape[1]):
                c = counts[min(b, counts.shape[0] - 1), min(h, counts.shape[1] - 1)]
                row_lists = listed[min(b, listed.shape[0] - 1), min(h, listed.shape[1] - 1)]
                for r in range(row_lists.shape[0]):
                    for index in row_lists[r, : c[r]].tolist():
                        if 0 <= index < cols:
                            rows = slice(r * q_block, (r + 1) * q_block)
                            keys = slice(index * kv_block, (index + 1) * kv_block)
                            part = values[b, h, rows, keys] if partial else True
                            keep[b, h, rows, keys] |= part
    return keep[..., :seqlen_q, :seqlen_k]


def reference_spec(case: str, dtype: str, causal: bool, keep: torch.Tensor):
    """The case's spec with mask_mod replaced by `keep` (a bool [B, HQ, Nq, Nk] tensor): its
    reference is the block mask's meaning, computed by attngen.reference."""
    fields = dict(CASES[case])
    fields.pop("mask_mod", None)
    keep_decl = {"name": "keep", "dtype": "bool", "shape": list(keep.shape)}
    fields["tensors"] = [*score_mod_tensors(case), keep_decl]
    mask = dict(mask="causal", causal_align="top_left") if causal else dict(mask="none")
    return make_spec(
        name="ref", dtype=dtype, mask_mod="keep[b, h, q_idx, kv_idx]", **mask, **fields
    )


def score_mod_tensors(case: str) -> list[dict]:
    """The case's tensor declarations that score_mod reads (mask_mod's are in `keep`)."""
    score_mod = CASES[case].get("score_mod", "")
    return [t for t in CASES[case].get("tensors", []) if t["name"] + "[" in score_mod]


def flex_meaning_problems(case, dtype, causal, out, lse, q, k, v, tensors, block_mask):
    """What is wrong with (out, lse) against the reference of the block mask's meaning (the
    inputs on the CPU); [] if nothing."""
    batch, _, seqlen_q, _ = q.shape
    seqlen_k = k.shape[2]
    spec = expression_spec(case, dtype, causal)
    values = mask_mod_values(spec, tensors, batch, seqlen_q, seqlen_k)
    keep = dense_keep(block_mask, values, seqlen_q, seqlen_k)
    ref = reference_spec(case, dtype, causal, keep)
    read = {t["name"]: tensors[t["name"]] for t in score_mod_tensors(case)}
    return compare_to_reference(ref, out, lse, q, k, v, tensors={**read, "keep": keep})


def check_against_flex_meaning(case, dtype, causal, kernel, q, k, v, tensors, block_mask):
    """Run the kernel with block_mask under the memory watch and compare to the reference of
    the block mask's meaning; returns (out, lse)."""
    with watching():
        out, lse = kernel.attention(
            q, k, v, return_lse=True, tensors=tensors or None, block_mask=block_mask
        )
    problems = flex_meaning_problems(case, dtype, causal, out, lse, q, k, v, tensors, block_mask)
    assert not problems, "; ".join(problems)
    return out, lse


def chosen_of(counts: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """[.., rows, cols] bool: the blocks a list names (lists_of's inverse)."""
    cols = indices.shape[-1]
    used = torch.arange(cols) < counts[..., None].long()
    return ((indices.long()[..., None] == torch.arange(cols)) & used[..., None]).any(-2)


def hostile_block_mask() -> tuple:
    """Lists over 4 x 4 blocks of 128 with negative, huge and duplicate indices and counts past
    the row (no full blocks)."""
    big = torch.iinfo(torch.int32).max
    num = torch.tensor([[[big, 2, -3, 1]]], dtype=torch.int32)
    indices = torch.tensor(
        [[[[0, 3, -1, big], [1, 4, 0, 0], [2, 2, 2, 2], [3, 1, 0, 0]]]], dtype=torch.int32
    )
    return num, indices, torch.zeros_like(num), indices.clone(), 128, 128


def disturb(block_mask, gen: torch.Generator, drop: float, promote: float):
    """Flex's meaning beyond mask_mod's: drop listed blocks (they contribute nothing) and
    promote partial blocks to full (mask_mod is then not evaluated on them)."""
    num, indices, full_num, full_indices, q_block, kv_block = block_mask
    listed = []
    for counts, idx in ((num, indices), (full_num, full_indices)):
        chosen = chosen_of(counts, idx)
        listed.append(chosen & (torch.rand(chosen.shape, generator=gen) >= drop))
    moved = listed[0] & (torch.rand(listed[0].shape, generator=gen) < promote)
    partial, full = listed[0] & ~moved, listed[1] | moved
    return (*lists_of(partial, gen, num.dtype), *lists_of(full, gen, num.dtype), q_block, kv_block)


def sampled_block_mask(values: torch.Tensor, params: dict, heads: int):
    """The block mask the property tests draw from mask_mod's `values` [B, H, M, N]: B and H
    broadcast as params["broadcast"] says, exact for its blocks, then disturbed (blocks
    dropped and promoted); with params["full"] False every chosen block in the partial
    lists and no full lists."""
    one_b, one_h = params["broadcast"]
    values = values[: 1 if one_b else values.shape[0], : 1 if one_h else heads]
    gen = torch.Generator().manual_seed(params["seed"])
    qb, kb = params["q_block"], params["kv_block"]
    block_mask = exact_block_mask(values, qb, kb, gen=gen, dtype=params["index_dtype"])
    block_mask = disturb(block_mask, gen, params["drop"], params["promote"])
    if not params["full"]:
        num, indices, full_num, full_indices, _, _ = block_mask
        both = chosen_of(num, indices) | chosen_of(full_num, full_indices)
        block_mask = (*lists_of(both, gen, num.dtype), None, None, qb, kb)
    return block_mask


@st.composite
def sparse_case(draw):
    block_m, block_n = draw(st.sampled_from([16, 32])), draw(st.sampled_from([16, 32]))
    return dict(
        case=draw(st.sampled_from(sorted(CASES))),
        dtype=draw(st.sampled_from(["fp16", "bf16", "fp32"])),
        causal=draw(st.booleans()),
        blocks=(block_m, block_n),
        q_block=block_m * draw(st.sampled_from([1, 2])),
        kv_block=block_n * draw(st.sampled_from([1, 2])),
        seqlen_q=draw(st.sampled_from([1, 17, 33, 48])),
        seqlen_k=draw(st.sampled_from([1, 16, 31, 50])),
        batch=draw(st.integers(1, 2)),
        broadcast=(draw(st.booleans()), draw(st.booleans())),  # B, H of the mask 1
        full=draw(st.booleans()),  # full lists, or every listed block partial
        drop=draw(st.sampled_from([0.0, 0.3])),
        promote=draw(st.sampled_from([0.0, 0.5])),
        index_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        seed=draw(st.integers(0, 2**16)),
    )


def build_case(params):
    """(kernel, q, k, v, tensors, block_mask) of a sparse_case draw."""
    spec = expression_spec(params["case"], params["dtype"], params["causal"])
    kernel = load_kernel(spec, *params["blocks"])
    batch, seqlen_q, seqlen_k = params["batch"], params["seqlen_q"], params["seqlen_k"]
    scale = 8.0 if params["case"] == "softcap" else 1.0
    q, k, v, _ = make_inputs(spec, batch, seqlen_q, seqlen_k, seed=params["seed"], scale=scale)
    tensors = case_tensors(params["case"], batch, max(seqlen_q, seqlen_k), params["seed"])
    values = mask_mod_values(spec, tensors, batch, seqlen_q, seqlen_k)
    one_b, one_h = params["broadcast"]
    values = values[: 1 if one_b else batch, : 1 if one_h else HEADS]
    gen = torch.Generator().manual_seed(params["seed"])
    block_mask = exact_block_mask(
        values, params["q_block"], params["kv_block"], gen=gen, dtype=params["index_dtype"]
    )
    block_mask = disturb(block_mask, gen, params["drop"], params["promote"])
    if not params["full"]:  # every listed block partial: mask_mod evaluated on all of them
        num, indices, full_num, full_indices, q_block, kv_block = block_mask
        both = chosen_of(num, indices) | chosen_of(full_num, full_indices)
        block_mask = (*lists_of(both, gen, num.dtype), None, None, q_block, kv_block)
    return kernel, q, k, v, tensors, block_mask


@given(params=sparse_case())
@example(params=dict(case="document", dtype="bf16", causal=False, blocks=(16, 16), q_block=32,
                     kv_block=16, seqlen_q=48, seqlen_k=50, batch=2, broadcast=(False, True),
                     full=True, drop=0.0, promote=0.0, index_dtype=torch.int32,
                     seed=1))  # fmt: skip
@example(params=dict(case="prefix_lm", dtype="fp32", causal=True, blocks=(16, 32), q_block=16,
                     kv_block=64, seqlen_q=33, seqlen_k=50, batch=1, broadcast=(True, True),
                     full=True, drop=0.3, promote=0.5, index_dtype=torch.int64,
                     seed=2))  # fmt: skip
@example(params=dict(case="relative_bias", dtype="fp16", causal=False, blocks=(32, 16),
                     q_block=32, kv_block=32, seqlen_q=17, seqlen_k=31, batch=2,
                     broadcast=(True, False), full=False, drop=0.3, promote=0.0,
                     index_dtype=torch.int32, seed=3))  # fmt: skip
def test_block_masks_mean_what_flex_means(params) -> None:
    kernel, q, k, v, tensors, block_mask = build_case(params)
    check_against_flex_meaning(
        params["case"], params["dtype"], params["causal"], kernel, q, k, v, tensors, block_mask
    )


def _document_kernel(dtype="fp32", causal=False, blocks=(16, 16)):
    return load_kernel(expression_spec("document", dtype, causal), *blocks)


def _document_inputs(batch=2, seqlen_q=48, seqlen_k=48, seed=7, dtype="fp32", causal=False):
    spec = expression_spec("document", dtype, causal)
    q, k, v, _ = make_inputs(spec, batch, seqlen_q, seqlen_k, seed=seed)
    tensors = case_tensors("document", batch, max(seqlen_q, seqlen_k), seed)
    values = mask_mod_values(spec, tensors, batch, seqlen_q, seqlen_k)
    return spec, q, k, v, tensors, values


def test_full_lists_skip_mask_mod_with_the_same_result() -> None:
    """The exact block mask with full lists, and the same blocks all partial in the same
    order: the same tiles in the same order, mask_mod True on the full ones, so bit for bit
    the same output; both agree with the element mask's reference (no block_mask)."""
    spec, q, k, v, tensors, values = _document_inputs()
    kernel = _document_kernel()
    num, indices, full_num, full_indices, qb, kb = exact_block_mask(values, 16, 16)
    assert int(full_num.sum()) > 0 and int(num.sum()) > 0  # both kinds of blocks occur
    joined_num, joined = num + full_num, torch.zeros_like(indices)
    for at in itertools.product(*map(range, num.shape)):
        n, f = int(num[at]), int(full_num[at])
        joined[at][: n + f] = torch.cat([indices[at][:n], full_indices[at][:f]])
    with watching():
        out, lse = kernel.attention(
            q,
            k,
            v,
            return_lse=True,
            tensors=tensors,
            block_mask=(num, indices, full_num, full_indices, qb, kb),
        )
        out_p, lse_p = kernel.attention(
            q,
            k,
            v,
            return_lse=True,
            tensors=tensors,
            block_mask=(joined_num, joined, None, None, qb, kb),
        )
    assert torch.equal(out, out_p) and torch.equal(lse, lse_p)
    problems = compare_to_reference(spec, out, lse, q, k, v, tensors=tensors)
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("case", ["document", "prefix_lm"])
def test_torch_create_block_mask(case: str) -> None:
    """torch's create_block_mask of the same mask_mod (written in Python) gives the element
    mask's result; its tensors go in as they are (int32, contiguous, B = 1 or B)."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, seqlen = 2, 64
    spec = expression_spec(case, "fp32", causal=False)
    q, k, v, _ = make_inputs(spec, batch, seqlen, seqlen, seed=9)
    tensors = case_tensors(case, batch, seqlen, 9)
    if case == "document":
        doc = tensors["doc"]

        def mask_mod(b, h, q_idx, kv_idx):
            return doc[b, q_idx] == doc[b, kv_idx]
    else:
        prefix = tensors["prefix"]

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx < prefix[b]) | (q_idx >= kv_idx)

    mask = create_block_mask(mask_mod, batch, 1, seqlen, seqlen, device="cpu", BLOCK_SIZE=32)
    fields = (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices)
    with watching():
        out, lse = load_kernel(spec, 16, 16).attention(
            q, k, v, return_lse=True, tensors=tensors, block_mask=(*fields, *mask.BLOCK_SIZE)
        )
    problems = compare_to_reference(spec, out, lse, q, k, v, tensors=tensors)
    assert not problems, "; ".join(problems)


def test_compiled_flex_attention_agrees_when_the_block_mask_drops_blocks() -> None:
    """torch's compiled flex_attention (CPU) with a block mask that drops and promotes blocks:
    the block mask wins in both (eager flex_attention evaluates mask_mod per element instead)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    batch, seqlen = 1, 128
    spec, q, k, v, tensors, values = _document_inputs(batch, seqlen, seqlen, seed=13)
    doc = tensors["doc"]

    def mask_mod(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    gen = torch.Generator().manual_seed(13)
    block_mask = disturb(exact_block_mask(values[:, :1], 32, 32), gen, drop=0.3, promote=0.5)
    torch_mask = BlockMask.from_kv_blocks(
        *block_mask[:4], BLOCK_SIZE=(32, 32), mask_mod=mask_mod, seq_lengths=(seqlen, seqlen)
    )
    try:
        compiled = torch.compile(flex_attention)  # (on CPU: no return_lse)
        flex_out = compiled(q, k, v, block_mask=torch_mask, enable_gqa=True)
    except Exception as error:
        if "compiler" not in str(error).lower() and "cpp" not in str(error).lower():
            raise
        pytest.skip(f"torch.compile(flex_attention) needs a C++ compiler here: {error!r}"[:300])
    out, _ = check_against_flex_meaning(
        "document", "fp32", False, _document_kernel(), q, k, v, tensors, block_mask
    )
    # fp32 on both sides over at most 48 keys of O(1) values: only the summation order differs
    # (a few fp32 ulps, ~1e-6); 1e-5 leaves room, a dropped or kept block moves O(0.1)
    torch.testing.assert_close(out, flex_out, atol=1e-5, rtol=1e-5)
    dense = _document_kernel().attention(q, k, v, tensors=tensors)
    assert (out - dense).abs().max() > 1e-2  # the block mask decides, not mask_mod alone


def test_a_row_with_empty_lists_gives_zero_and_minus_inf() -> None:
    spec, q, k, v, tensors, values = _document_inputs()
    num, indices, full_num, full_indices, qb, kb = exact_block_mask(values, 16, 16)
    num[0, :, 1] = 0
    full_num[0, :, 1] = 0  # batch 0's rows 16..31 see no block
    out, lse = check_against_flex_meaning(
        "document",
        "fp32",
        False,
        _document_kernel(),
        q,
        k,
        v,
        tensors,
        (num, indices, full_num, full_indices, qb, kb),
    )
    assert torch.all(out[0, :, 16:32] == 0) and torch.all(lse[0, :, 16:32] == float("-inf"))
    assert torch.isfinite(lse[0, :, :16]).all() and torch.isfinite(lse[1]).all()


def _hostile(kind: str, dtype: torch.dtype):
    """A block mask of 3 x 3 blocks (48 keys, 16-key blocks) with one kind of bad entries."""
    num = torch.tensor([[[2, 1, 3]]], dtype=dtype)
    indices = torch.tensor([[[[0, 2, 9], [1, 0, 2], [2, 1, 0]]]], dtype=dtype)
    big = torch.iinfo(dtype).max
    if kind == "negative":
        indices[..., 0, 1] = -1
        indices[..., 2, 0] = torch.iinfo(dtype).min
    elif kind == "huge":
        indices[..., 0, 0] = big
        indices[..., 2, 2] = 3  # one past the last block
    elif kind == "counts_beyond_the_row":
        num[..., 0] = big
        num[..., 1] = 4
    elif kind == "negative_counts":
        num[..., 1] = -5
        num[..., 2] = torch.iinfo(dtype).min
    return num, indices


@pytest.mark.parametrize("kind", ["negative", "huge", "counts_beyond_the_row", "negative_counts"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_hostile_lists_read_nothing_outside_and_skip_what_names_no_block(kind, dtype) -> None:
    """Counts clamped to [0, cols], indices outside [0, cols) skipped: the result is the block
    mask that rule leaves (dense_keep applies it), and no load leaves the tensors."""
    num, indices = _hostile(kind, dtype)
    _, q, k, v, tensors, _ = _document_inputs(batch=1)
    full = (num.clone().zero_(), indices.clone())  # full lists present, all empty
    check_against_flex_meaning(
        "document",
        "fp32",
        False,
        _document_kernel(),
        q,
        k,
        v,
        tensors,
        (num, indices, *full, 16, 16),
    )


def test_a_duplicate_block_is_read_inside_memory_and_checks_name_it(monkeypatch) -> None:
    """Lists must be unique (as torch's): a block listed twice (in one list, or in both) is
    visited twice and counts twice, inside memory; ATTNGEN_CHECKS=1 refuses it."""
    _, q, k, v, tensors, _ = _document_inputs(batch=1)
    kernel = _document_kernel()
    num = torch.tensor([[[2, 1, 1]]], dtype=torch.int32)
    indices = torch.tensor([[[[0, 0, 1], [1, 2, 2], [2, 0, 0]]]], dtype=torch.int32)
    full_num = torch.tensor([[[0, 1, 1]]], dtype=torch.int32)
    full_indices = torch.tensor([[[[0, 0, 0], [1, 0, 0], [0, 0, 0]]]], dtype=torch.int32)
    block_mask = (num, indices, full_num, full_indices, 16, 16)
    with watching():
        out = kernel.attention(q, k, v, tensors=tensors, block_mask=block_mask)
    assert torch.isfinite(out).all()
    monkeypatch.setenv("ATTNGEN_CHECKS", "1")
    with pytest.raises(ValueError, match=re.escape("block_mask: the row [0, 0, 0] (b, h, q-bl")):
        kernel.attention(q, k, v, tensors=tensors, block_mask=block_mask)
    unique = (torch.tensor([[[1, 1, 1]]], dtype=torch.int32), *block_mask[1:])
    with pytest.raises(ValueError, match=re.escape("block_mask: the row [0, 0, 1] (b, h, q-bl")):
        kernel.attention(q, k, v, tensors=tensors, block_mask=unique)  # row 1: in both lists


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            dict(index=(0, 0, 0, 1), value=-1),
            "block_mask: kv_indices[0, 0, 0, 1] is -1; allowed: 0 to 2",
        ),
        (
            dict(count=(0, 0, 2), value=4),
            "block_mask: kv_num_blocks[0, 0, 2] is 4; allowed: 0 to 3",
        ),
        (dict(full_count=(0, 0, 1), value=-1), "block_mask: full_kv_num_blocks[0, 0, 1] is -1"),
    ],
)
def test_checks_mode_validates_counts_and_indices(monkeypatch, change, message) -> None:
    _, q, k, v, tensors, values = _document_inputs(batch=1)
    num, indices, full_num, full_indices, qb, kb = exact_block_mask(values[:, :1], 16, 16)
    num[0, 0, :] = 2
    indices[0, 0, :, :2] = torch.tensor([0, 1], dtype=torch.int32)
    full_num.zero_()
    target = {"index": indices, "count": num, "full_count": full_num}
    for name, tensor in target.items():
        if name in change:
            tensor[change[name]] = change["value"]
    monkeypatch.setenv("ATTNGEN_CHECKS", "1")
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        _document_kernel().attention(
            q, k, v, tensors=tensors, block_mask=(num, indices, full_num, full_indices, qb, kb)
        )


def _bad_block_masks():
    i32 = dict(dtype=torch.int32)
    num, idx = torch.zeros(2, 4, 3, **i32), torch.zeros(2, 4, 3, 3, **i32)
    return [
        ([num, idx], "block_mask: got list; allowed: None or a tuple (kv_num_blocks"),
        ({"kv_num_blocks": num}, "block_mask: got dict; allowed: None or a tuple"),
        ((num, idx, None, None, 8, 16), "block_mask: q_block 8; allowed: a positive multiple of "
         "this module's BLOCK_M 16 (its launch config)"),
        ((num, idx, None, None, 16, 24), "block_mask: kv_block 24; allowed: a positive multiple "
         "of this module's BLOCK_N 16"),
        ((num, idx, None, None, 16.0, 16), "block_mask: q_block 16.0; allowed"),
        ((num, idx, None, None, 0, 16), "block_mask: q_block 0; allowed"),
        ((num, idx, num, None, 16, 16), "block_mask: full_kv_num_blocks and full_kv_indices: "
         "got one None; allowed: both tensors or both None"),
        ((num.float(), idx, None, None, 16, 16), "block_mask: kv_num_blocks: dtype torch.float32; "
         "allowed: torch.int32, torch.int64"),
        ((num.short(), idx, None, None, 16, 16), "block_mask: kv_num_blocks: dtype torch.int16"),
        ((num, idx[..., :2], None, None, 16, 16), "block_mask: kv_indices: shape (2, 4, 3, 2); "
         "allowed: (2 or 1, 4 or 1, 3, 3) (B, HQ, ceil(Nq / q_block), ceil(Nk / kv_block))"),
        ((num[:, :2], idx, None, None, 16, 16), "block_mask: kv_num_blocks: shape (2, 2, 3); "
         "allowed: (2 or 1, 4 or 1, 3) (B, HQ, ceil(Nq / q_block))"),
        ((num, idx, None, None, 32, 16), "block_mask: kv_num_blocks: shape (2, 4, 3); allowed: "
         "(2 or 1, 4 or 1, 2)"),
        ((num[0], idx, None, None, 16, 16), "block_mask: kv_num_blocks: shape (4, 3); allowed"),
        ((num, idx.tolist(), None, None, 16, 16), "block_mask: kv_indices: got list; allowed: a "
         "torch.Tensor"),
        ((num, idx, num, idx.to("meta"), 16, 16), "block_mask: full_kv_indices: device meta; "
         "allowed: cpu (q's)"),
    ]  # fmt: skip


@pytest.mark.parametrize(("block_mask", "message"), _bad_block_masks())
def test_block_masks_are_checked_naming_the_field(block_mask, message: str) -> None:
    _, q, k, v, tensors, _ = _document_inputs(batch=2)
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        _document_kernel().attention(q, k, v, tensors=tensors, block_mask=block_mask)


def test_broadcast_masks_are_accepted() -> None:
    """B and H of the lists may be 1 (stride 0 in the kernel); varlen block masks:
    tests/test_block_sparse_varlen.py."""
    spec, q, k, v, tensors, values = _document_inputs(batch=2)
    one = exact_block_mask(values[:1, :1], 16, 16)
    check_against_flex_meaning("document", "fp32", False, _document_kernel(), q, k, v, tensors, one)


def test_flash_layout_entries_take_block_mask() -> None:
    _, q, k, v, tensors, values = _document_inputs(batch=2, seqlen_q=40, seqlen_k=40)
    kernel = _document_kernel()
    block_mask = exact_block_mask(values, 16, 16)
    expected = kernel.attention(q, k, v, tensors=tensors, block_mask=block_mask)
    flash = kernel.attention_flash(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        tensors=tensors,
        block_mask=block_mask,
    )
    assert torch.equal(flash.transpose(1, 2), expected)
    out = kernel.attention_flash_out(q, k, v, tensors=tensors, block_mask=block_mask)
    assert torch.equal(out.transpose(1, 2), expected)


class KeyTileCounter:
    """Records, per program, the key tiles (row // BLOCK_N) whose K rows the kernel loads."""

    def __init__(self, k: torch.Tensor, block_n: int):
        self.start, self.end = tensor_span(k)
        self.row_bytes, self.block_n = k.stride(2) * k.element_size(), block_n
        self.seqlen = k.shape[2]
        self.tiles: dict[tuple, set[int]] = {}

    def __enter__(self):
        from triton.runtime import interpreter
        from triton.runtime.interpreter import InterpreterBuilder

        self.saved = load = InterpreterBuilder.create_masked_load
        counter = self

        def counting_load(builder, ptrs, mask, *args, **kwargs):
            import numpy as np

            addresses = np.asarray(ptrs.data).astype(np.uint64)
            if mask is not None:
                live = np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)
                addresses = addresses[live]
            inside = addresses[(addresses >= counter.start) & (addresses < counter.end)]
            rows = ((inside - counter.start) // counter.row_bytes) % counter.seqlen
            program = tuple(interpreter.interpreter_builder.grid_idx)
            counter.tiles.setdefault(program, set()).update(
                int(r) // counter.block_n for r in np.unique(rows)
            )
            return load(builder, ptrs, mask, *args, **kwargs)

        InterpreterBuilder.create_masked_load = counting_load
        return self

    def __exit__(self, *exc):
        from triton.runtime.interpreter import InterpreterBuilder

        InterpreterBuilder.create_masked_load = self.saved


def test_the_kernel_loads_only_the_listed_blocks() -> None:
    """Per program, the K tiles it loads are exactly the listed blocks' (2 tiles per 32-key
    block), and fewer than the dense kernel loads: block sparsity skips work, counted."""
    spec = make_spec(name="flex", dtype="fp32", mask="none", num_kv_heads=4, **CASES["document"])
    kernel = load_kernel(spec, 16, 16)
    batch, seqlen = 1, 96  # 6 query tiles, 6 key tiles; blocks of 32 x 32: 3 x 3
    q, k, v, _ = make_inputs(spec, batch, seqlen, seqlen, seed=3)
    tensors = {"doc": torch.tensor([[0] * 40 + [1] * 56], dtype=torch.int32)}
    values = mask_mod_values(spec, tensors, batch, seqlen, seqlen)
    block_mask = exact_block_mask(values[:, :1], 32, 32)
    with KeyTileCounter(k, 16) as sparse:
        kernel.attention(q, k, v, tensors=tensors, block_mask=block_mask)
    with KeyTileCounter(k, 16) as dense:
        kernel.attention(q, k, v, tensors=tensors)
    some, _ = block_grid(values[:, :1], 32, 32)  # [1, 1, 3, 3]: which blocks each row lists
    num_m_blocks = seqlen // 16
    for (pid, *_), tiles in sparse.tiles.items():
        m_block = num_m_blocks - 1 - pid % num_m_blocks
        listed = some[0, 0, m_block * 16 // 32].nonzero().flatten().tolist()
        assert tiles == {2 * block + t for block in listed for t in (0, 1)}, (pid, tiles)
    assert len(sparse.tiles) == len(dense.tiles) == HEADS * num_m_blocks
    visited = sum(map(len, sparse.tiles.values()))
    assert visited == HEADS * 2 * 2 * int(some.sum()) < sum(map(len, dense.tiles.values()))


def test_q_block_below_block_m_is_refused_not_unioned() -> None:
    """A q-block smaller than the kernel's query tile would need each row's own lists inside
    one tile: refused (torch's default BLOCK_SIZE, 128, is a multiple of every BLOCK_M)."""
    _, q, k, v, tensors, values = _document_inputs(batch=1)
    kernel = _document_kernel(blocks=(32, 16))
    block_mask = exact_block_mask(values, 16, 16)
    with pytest.raises(
        ValueError,
        match=r"^block_mask: q_block 16; allowed: a positive multiple "
        r"of this module's BLOCK_M 32",
    ):
        kernel.attention(q, k, v, tensors=tensors, block_mask=block_mask)


@pytest.mark.parametrize(
    "mask",
    [
        dict(mask="sliding_window", window_left=9, window_right=4),
        dict(mask="sliding_window", window_left=5, window_right=0, sink_tokens=3),
        dict(mask="chunked", chunk_size=12),
        dict(mask="causal", causal_align="bottom_right"),
    ],
)
def test_the_built_in_mask_holds_on_full_blocks(mask) -> None:
    """Full blocks skip mask_mod, never the spec's own mask: an exact block mask of the
    document mask_mod (blocks inside one document are full) with a window, chunks or
    bottom-right causal gives the element mask's result."""
    spec = make_spec(name="flex", dtype="fp32", **mask, **CASES["document"])
    batch, seqlen_q, seqlen_k = 2, 40, 56
    q, k, v, _ = make_inputs(spec, batch, seqlen_q, seqlen_k, seed=17)
    tensors = {"doc": (torch.arange(seqlen_k) // 30).repeat(batch, 1).to(torch.int32)}
    values = mask_mod_values(spec, tensors, batch, seqlen_q, seqlen_k)
    block_mask = exact_block_mask(values, 16, 16)
    assert int(block_mask[2].sum()) > 0  # full blocks occur
    with watching():
        out, lse = load_kernel(spec, 16, 16).attention(
            q, k, v, return_lse=True, tensors=tensors, block_mask=block_mask
        )
    problems = compare_to_reference(spec, out, lse, q, k, v, tensors=tensors)
    assert not problems, "; ".join(problems)
