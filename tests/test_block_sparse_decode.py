"""Block sparsity in decode (`decode(..., block_mask=)`, CPU interpreter).

A decode step's block mask is torch's BlockMask for Q_LEN = NQ (the step's tokens) and KV_LEN =
the cache's capacity, flex decode's convention: token t's q-block is t // q_block (q-block 0
for every token when q_block >= NQ), key block j the logical positions [j kv_block, (j + 1)
kv_block) (paged caches too: not the slots). mask_mod still reads q_idx = L_b - NQ + t. The
meaning is FlexAttention's (tests/test_block_sparse.py): a key counts where its block is
listed as partial and mask_mod holds, or listed as full, and the built-in mask holds. Judged
against the float64 reference of that meaning (the case's spec with mask_mod replaced by a
`keep` tensor over positions) on contiguous and paged caches, GQA, forced splits; hostile
lists; every launch under tests/memory_watch.py.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from attngen.spec.expressions import declared, parsed
from attngen.spec.masks import expression_values
from tests.decode_harness import (
    decode_problems,
    load_decode,
    make_cache,
    make_decode_spec,
    make_queries,
    run_decode,
    same_bits,
)
from tests.memory_watch import watching
from tests.test_block_sparse import (
    _hostile,
    chosen_of,
    dense_keep,
    disturb,
    exact_block_mask,
    lists_of,
)
from tests.test_expression_decode import CASES, case_tensors


def token_values(spec, tensors, totals, num_q, capacity):
    """[B, HQ, NQ, capacity] bool: mask_mod at (b, h, L_b - NQ + t, j) (True without one, and
    for a token before the sequence's start, which sees no key under the masks here)."""
    batch, heads = len(totals), spec.num_q_heads
    tree = parsed(spec, "mask_mod")
    values = torch.ones(batch, heads, num_q, capacity, dtype=torch.bool)
    if tree is None:
        return values
    shape = (batch, heads, capacity, capacity)
    every = expression_values("mask_mod", tree, declared(spec), tensors, shape)
    for b, total in enumerate(totals):
        for t in range(num_q):
            if total - num_q + t >= 0:
                values[b, :, t] = every[b, :, total - num_q + t]
    return values


def keep_of(block_mask, values, totals, num_q, capacity):
    """[B, HQ, capacity, capacity] bool over positions: the block mask's meaning at each
    token's row L_b - NQ + t (dense_keep's rule: counts clamped, bad indices name none)."""
    by_token = dense_keep(block_mask, values, num_q, capacity)
    keep = torch.zeros(*values.shape[:2], capacity, capacity, dtype=torch.bool)
    for b, total in enumerate(totals):
        for t in range(num_q):
            if total - num_q + t >= 0:
                keep[b, :, total - num_q + t] = by_token[b, :, t]
    return keep


def reference_spec(params, keep):
    """The case's decode spec with mask_mod replaced by keep[b, h, q_idx, kv_idx]."""
    fields = dict(CASES[params["case"]])
    fields.pop("mask_mod", None)
    score = fields.get("score_mod", "")
    reads = [t for t in fields.pop("tensors", []) if t["name"] + "[" in score]
    keep_decl = {"name": "keep", "dtype": "bool", "shape": list(keep.shape)}
    return make_decode_spec(
        params["layout"], params["page_size"], **params["fields"], **fields,
        mask_mod="keep[b, h, q_idx, kv_idx]", tensors=[*reads, keep_decl],
    )  # fmt: skip


def block_mask_problems(params, spec, cache, out, lse, q, k_new, v_new, tensors, block_mask):
    num_q, capacity = q.shape[2], cache_capacity(cache)
    totals = [int(n) + (0 if k_new is None else k_new.shape[2]) for n in cache.lengths]
    keep = keep_of(block_mask, token_values(spec, tensors, totals, num_q, capacity), totals,
                   num_q, capacity)  # fmt: skip
    ref = reference_spec(params, keep)
    reads = {n: t for n, t in (tensors or {}).items() if n + "[" in (ref.score_mod or "")}
    return decode_problems(ref, cache, out, lse, q, k_new, v_new, tensors={**reads, "keep": keep})


def cache_capacity(cache) -> int:
    if cache.block_table is None:
        return cache.k.shape[2]
    return cache.block_table.shape[1] * cache.k.shape[1]


@st.composite
def decode_sparse_case(draw):
    layout = draw(st.sampled_from(["contiguous", "paged"]))
    kv_heads = draw(st.integers(1, 2))
    mask = draw(st.sampled_from(["none", "causal"]))
    fields = dict(
        dtype=draw(st.sampled_from(["bf16", "fp16", "fp32"])), head_dim=16, mask=mask,
        num_kv_heads=kv_heads, num_q_heads=kv_heads * draw(st.sampled_from([1, 2, 4])),
        max_query_tokens=4, **({"causal_align": "bottom_right"} if mask == "causal" else {}),
    )  # fmt: skip
    num_q, block_n = draw(st.integers(1, 4)), draw(st.sampled_from([16, 32]))
    return dict(
        case=draw(st.sampled_from(["document", "relative_bias", "out_of_range"])),
        layout=layout,
        page_size=draw(st.sampled_from([4, 16])) if layout == "paged" else None,
        fields=fields,
        block_n=block_n,
        q_block=draw(st.sampled_from([1, 2, 128])),
        kv_block=block_n * draw(st.sampled_from([1, 2])),
        lengths=draw(st.lists(st.sampled_from([0, 4, 15, 16, 17, 37]), min_size=1, max_size=3)),
        num_q=num_q,
        num_new=draw(st.sampled_from([0, num_q])),
        splits=draw(st.sampled_from([None, 1, 2, 3])),
        broadcast=(draw(st.booleans()), draw(st.booleans())),
        full=draw(st.booleans()),
        drop=draw(st.sampled_from([0.0, 0.3])),
        promote=draw(st.sampled_from([0.0, 0.5])),
        index_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        seed=draw(st.integers(0, 2**16)),
    )


def build_case(params):
    """(kernel, spec, cache, q, k_new, v_new, tensors, block_mask): the block mask
    create_block_mask would make of mask_mod over the step's tokens, disturbed."""
    spec = make_decode_spec(params["layout"], params["page_size"], **params["fields"],
                            **CASES[params["case"]])  # fmt: skip
    kernel = load_decode(spec, params["block_n"])
    num_q, num_new, lengths = params["num_q"], params["num_new"], params["lengths"]
    cache = make_cache(spec, lengths, seed=params["seed"], room=num_new)
    batch, capacity = len(lengths), cache_capacity(cache)
    q, k_new, v_new, _ = make_queries(spec, batch, num_q, seed=params["seed"], num_new=num_new)
    tensors = case_tensors(params["case"], batch, spec.num_q_heads, max(lengths) + num_new + 1,
                           params["seed"])  # fmt: skip
    totals = [n + num_new for n in lengths]
    values = token_values(spec, tensors, totals, num_q, capacity)
    for b, total in enumerate(totals):
        values[b, :, :, total:] = False  # keys past the sequence: no block (torch's)
    one_b, one_h = params["broadcast"]
    values = values[: 1 if one_b else batch, : 1 if one_h else spec.num_q_heads]
    gen = torch.Generator().manual_seed(params["seed"])
    qb, kb = params["q_block"], params["kv_block"]
    block_mask = exact_block_mask(values, qb, kb, gen=gen, dtype=params["index_dtype"])
    block_mask = disturb(block_mask, gen, params["drop"], params["promote"])
    if not params["full"]:
        num, indices, full_num, full_indices, _, _ = block_mask
        both = chosen_of(num, indices) | chosen_of(full_num, full_indices)
        block_mask = (*lists_of(both, gen, num.dtype), None, None, qb, kb)
    return kernel, spec, cache, q, k_new, v_new, tensors, block_mask


def run_sparse(kernel, cache, q, k_new, v_new, tensors, block_mask, splits=None):
    kernel.FORCE_NUM_SPLITS = splits
    try:
        with watching():
            return run_decode(kernel, cache.clone(), q, k_new, v_new, tensors=tensors,
                              block_mask=block_mask)  # fmt: skip
    finally:
        kernel.FORCE_NUM_SPLITS = None


@given(params=decode_sparse_case())
@example(params=dict(  # a document mask over a paged cache, GQA 4:1, appended drafts, 3 splits
    case="document", layout="paged", page_size=4, block_n=16, q_block=128, kv_block=16,
    lengths=[5, 0, 37], num_q=4, num_new=4, splits=3, broadcast=(False, True), full=True,
    drop=0.3, promote=0.5, index_dtype=torch.int32, seed=1,
    fields=dict(dtype="bf16", head_dim=16, mask="causal", causal_align="bottom_right",
                num_kv_heads=2, num_q_heads=8, max_query_tokens=4),
))  # fmt: skip
@example(params=dict(  # per-token q-blocks, a bias table, contiguous, blocks dropped
    case="relative_bias", layout="contiguous", page_size=None, block_n=16, q_block=1,
    kv_block=32, lengths=[37, 17], num_q=3, num_new=0, splits=2, broadcast=(True, False),
    full=False, drop=0.3, promote=0.0, index_dtype=torch.int64, seed=2,
    fields=dict(dtype="fp32", head_dim=16, mask="none", num_kv_heads=1, num_q_heads=4,
                max_query_tokens=4),
))  # fmt: skip
def test_decode_block_masks_mean_what_flex_means(params) -> None:
    kernel, spec, cache, q, k_new, v_new, tensors, block_mask = build_case(params)
    out, lse = run_sparse(kernel, cache, q, k_new, v_new, tensors, block_mask, params["splits"])
    problems = block_mask_problems(params, spec, cache, out, lse, q, k_new, v_new, tensors,
                                   block_mask)  # fmt: skip
    assert not problems, "; ".join(problems)


DOC = dict(case="document", page_size=4, fields=dict(dtype="fp32", head_dim=16, mask="none",
                                                     num_kv_heads=2, num_q_heads=4,
                                                     max_query_tokens=4))  # fmt: skip


def _doc_step(layout: str, lengths=(20, 37), seed=5):
    """A document-mask decode step of 3 tokens over caches of capacity in (32, 48] (3 key
    blocks of 16), NaN past every sequence's keys."""
    params = dict(DOC, layout=layout, page_size=4 if layout == "paged" else None)
    spec = make_decode_spec(layout, params["page_size"], **DOC["fields"], **CASES["document"])
    cache = make_cache(spec, list(lengths), seed=seed, room=3, extra_capacity=1)
    q, k_new, v_new, _ = make_queries(spec, len(lengths), 3, seed=seed, num_new=3)
    tensors = case_tensors("document", len(lengths), 4, 48, seed)
    return params, spec, load_decode(spec, 16), cache, q, k_new, v_new, tensors


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("kind", ["every_block", "negative", "huge", "counts_beyond_the_row",
                                  "negative_counts"])  # fmt: skip
def test_hostile_lists_never_read_past_a_sequence(layout: str, kind: str) -> None:
    """Lists naming every block of the capacity (past the shorter sequence's keys, which hold
    NaN), or hostile entries (one q-block per token: q_block 1): finite outputs equal to the
    reference of what the clamping rule leaves, and no access outside the tensors."""
    params, spec, kernel, cache, q, k_new, v_new, tensors = _doc_step(layout)
    assert cache_capacity(cache) in range(33, 49)
    if kind == "every_block":
        num, indices = lists_of(torch.ones(1, 1, 3, 3, dtype=torch.bool))
    else:
        num, indices = _hostile(kind, torch.int32)
    block_mask = (num, indices, num.clone().zero_(), indices.clone(), 1, 16)
    out, lse = run_sparse(kernel, cache, q, k_new, v_new, tensors, block_mask, splits=2)
    assert torch.isfinite(out).all()
    problems = block_mask_problems(params, spec, cache, out, lse, q, k_new, v_new, tensors,
                                   block_mask)  # fmt: skip
    assert not problems, "; ".join(problems)


def test_without_a_block_mask_and_with_every_block_the_bits_agree() -> None:
    """Lists naming every block as partial: the same tiles in the same order as no block mask,
    so the same bits; a step that lists nothing gets output 0 and LSE -inf."""
    _, _, kernel, cache, q, k_new, v_new, tensors = _doc_step("paged")
    every = (*lists_of(torch.ones(1, 1, 1, 3, dtype=torch.bool)), None, None, 4, 16)
    sparse = run_sparse(kernel, cache, q, k_new, v_new, tensors, every, splits=2)
    dense = run_sparse(kernel, cache, q, k_new, v_new, tensors, None, splits=2)
    assert same_bits(sparse[0], dense[0]) and same_bits(sparse[1], dense[1])
    nothing = (*lists_of(torch.zeros(2, 4, 1, 3, dtype=torch.bool)), None, None, 4, 16)
    out, lse = run_sparse(kernel, cache, q, k_new, v_new, tensors, nothing)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


@pytest.mark.parametrize("entry", ["decode_flash", "decode_flash_out"])
def test_flash_entries_take_the_block_mask_bit_for_bit(entry: str) -> None:
    _, _, kernel, cache, q, k_new, v_new, tensors = _doc_step("paged")
    gen = torch.Generator().manual_seed(3)
    block_mask = (*lists_of(torch.rand(2, 4, 1, 3, generator=gen) < 0.6), None, None, 4, 16)
    expected = run_sparse(kernel, cache, q, k_new, v_new, tensors, block_mask)
    flash = entry == "decode_flash"
    args = [t.transpose(1, 2) if flash else t for t in (q, k_new, v_new)]
    got = getattr(kernel, entry)(
        args[0], cache.clone().k, cache.clone().v, cache.lengths, block_table=cache.block_table,
        k_new=args[1], v_new=args[2], return_lse=True, tensors=tensors, block_mask=block_mask,
    )  # fmt: skip
    assert same_bits(got[0], expected[0].transpose(1, 2)) and same_bits(got[1], expected[1])


def _lists(shape, cols=3):
    return torch.zeros(shape, dtype=torch.int32), torch.zeros((*shape, cols), dtype=torch.int32)


@pytest.mark.parametrize(
    ("block_mask", "message"),
    [
        ((*_lists((2, 4, 1)), None, None, 4, 8), "block_mask: kv_block 8; allowed: a positive "
         "multiple of this module's BLOCK_N 16 (the decode split kernel's)"),
        ((*_lists((2, 4, 2)), None, None, 4, 16), "block_mask: kv_num_blocks: shape (2, 4, 2); "
         "allowed: (2 or 1, 4 or 1, 1) (B, HQ, ceil(NQ / q_block))"),
        ((*_lists((2, 4, 3), 2), None, None, 1, 16), "block_mask: kv_indices: shape (2, 4, 3, 2); "
         "allowed: (2 or 1, 4 or 1, 3, 3) (B, HQ, ceil(NQ / q_block), ceil(capacity / kv_block))"),
        ((_lists((2, 4, 1))[0].float(), _lists((2, 4, 1))[1], None, None, 4, 16),
         "block_mask: kv_num_blocks: dtype torch.float32; allowed: torch.int32, torch.int64"),
        ((*_lists((2, 4, 1)), _lists((2, 4, 1))[0], None, 4, 16), "block_mask: "
         "full_kv_num_blocks and full_kv_indices: got one None"),
        ((1, 2), "block_mask: got tuple; allowed: None or a tuple"),
    ],
)  # fmt: skip
def test_decode_block_mask_arguments_are_checked_before_the_append(block_mask, message) -> None:
    """Each refusal names block_mask and the argument, and comes before the step's append:
    the cache is unchanged."""
    _, _, kernel, cache, q, k_new, v_new, tensors = _doc_step("contiguous")
    k_before = cache.k.clone()
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        run_decode(kernel, cache, q, k_new, v_new, tensors=tensors, block_mask=block_mask)
    assert same_bits(cache.k, k_before)
