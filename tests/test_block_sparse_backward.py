"""The block-sparse backward (`attention(..., block_mask=)` with gradients, CPU interpreter).

Compiled Flex's meaning, as tests/test_block_sparse.py spells it out for the forward: a key is
kept where its block is listed as partial and mask_mod holds, or listed as full, and the
built-in mask holds; an unlisted block adds to no gradient. The gradients (dq, dk, dv and the
trainable bias table's) are judged against float64 autograd through the reference of that
mask (the case's spec with mask_mod replaced by a `keep` tensor) by the rule of
shared/RELIABILITY.md (attngen.reference.backward). Block masks are made as torch's
create_block_mask makes them (full: mask_mod all true there), then disturbed (blocks dropped,
partial blocks promoted to full, order shuffled) and made hostile; both backward paths, GQA
(4 query heads, 2 KV heads), broadcast B and H. Every launch runs under tests/memory_watch.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from attngen.reference.backward import compare_gradients
from tests.backward_harness import Blocks, module_for
from tests.kernel_harness import make_inputs, make_spec
from tests.memory_watch import watching
from tests.test_backward_properties import EXAMPLES
from tests.test_block_sparse import (
    HEADS,
    _hostile,
    chosen_of,
    dense_keep,
    disturb,
    exact_block_mask,
    lists_of,
    mask_mod_values,
    score_mod_tensors,
)
from tests.test_expression_backward import (
    backward_fields,
    expression_backward_spec,
    leaves_of,
    run,
)
from tests.test_expression_kernels import CASES, case_tensors


def reference_backward_spec(case: str, dtype: str, causal: bool, keep: torch.Tensor):
    """The case's backward spec with mask_mod replaced by the bool tensor `keep` [B, HQ, Nq,
    Nk] (the block mask's meaning); score_mod's tensors as declared (the table trainable)."""
    fields = backward_fields(case)
    fields.pop("mask_mod", None)
    reads = {t["name"] for t in score_mod_tensors(case)}
    keep_decl = {"name": "keep", "dtype": "bool", "shape": list(keep.shape)}
    fields["tensors"] = [*(t for t in fields.get("tensors", []) if t["name"] in reads), keep_decl]
    mask = dict(mask="causal", causal_align="top_left") if causal else dict(mask="none")
    return make_spec(
        name="ref", dtype=dtype, backward=True, mask_mod="keep[b, h, q_idx, kv_idx]",
        **mask, **fields,
    )  # fmt: skip


def check_gradients(params, module, q, k, v, tensors, block_mask, keep=None, device="cpu"):
    """Run attention with block_mask and gradients (on `device`; under the memory watch on
    the CPU); the gradients against the reference of the block mask's meaning (on the CPU).
    Returns (out, grads)."""
    case, dtype, causal = params["case"], params["dtype"], params["causal"]
    batch, _, seqlen_q, _ = q.shape
    dout = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=torch.Generator().manual_seed(7))
    dout = dout.to(q.dtype)

    def on(t):
        return t.to(device) if isinstance(t, torch.Tensor) else t

    out, grads = run(
        module, on(q), on(k), on(v), on(dout),
        leaves_of(case, {n: on(t) for n, t in tensors.items()}),
        block_mask=tuple(map(on, block_mask)), deterministic=params["deterministic"],
    )  # fmt: skip
    out, grads = (
        out.cpu(),
        [g.cpu() for g in grads[:3]] + [{n: t.cpu() for n, t in d.items()} for d in grads[3:]],
    )
    if keep is None:
        spec = expression_backward_spec(case, dtype, causal)
        values = mask_mod_values(spec, tensors, batch, seqlen_q, k.shape[2])
        keep = dense_keep(block_mask, values, seqlen_q, k.shape[2])
    keep = keep.expand(batch, HEADS, -1, -1)
    ref = reference_backward_spec(case, dtype, causal, keep)
    read = {t["name"]: tensors[t["name"]] for t in score_mod_tensors(case)}
    problems = compare_gradients(ref, grads, q, k, v, dout, tensors={**read, "keep": keep})
    assert not problems, "; ".join(problems)
    assert all(torch.isfinite(g).all() for g in grads[:3])
    return out, grads


@st.composite
def sparse_backward_case(draw):
    tiles = [(draw(st.sampled_from([16, 32])), draw(st.sampled_from([16, 32]))) for _ in range(3)]
    block_m, block_n = (max(tile[i] for tile in tiles) for i in (0, 1))
    return dict(
        case=draw(st.sampled_from(sorted(CASES))),
        dtype=draw(st.sampled_from(["fp16", "bf16", "fp32"])),
        causal=draw(st.booleans()),
        blocks=Blocks(*tiles),
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
        deterministic=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def build_backward_case(params):
    """(module, q, k, v, tensors, block_mask) of a sparse_backward_case draw: the block mask
    create_block_mask would make of mask_mod, disturbed."""
    case, batch = params["case"], params["batch"]
    spec = expression_backward_spec(case, params["dtype"], params["causal"])
    module = module_for(spec, params["blocks"])
    seqlen_q, seqlen_k = params["seqlen_q"], params["seqlen_k"]
    scale = 8.0 if case == "softcap" else 1.0
    q, k, v, _ = make_inputs(spec, batch, seqlen_q, seqlen_k, seed=params["seed"], scale=scale)
    tensors = case_tensors(case, batch, max(seqlen_q, seqlen_k), params["seed"])
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
    return module, q, k, v, tensors, block_mask


@settings(max_examples=EXAMPLES)
@given(params=sparse_backward_case())
@example(params=dict(case="relative_bias", dtype="bf16", causal=True, blocks=Blocks(),
                     q_block=32, kv_block=16, seqlen_q=48, seqlen_k=50, batch=2,
                     broadcast=(False, False), full=True, drop=0.3, promote=0.5,
                     index_dtype=torch.int32, deterministic=True, seed=1))  # fmt: skip
@example(params=dict(case="document", dtype="fp16", causal=False,
                     blocks=Blocks((16, 16), (32, 16), (16, 32)), q_block=32, kv_block=32,
                     seqlen_q=33, seqlen_k=31, batch=2, broadcast=(True, False), full=True,
                     drop=0.3, promote=0.0, index_dtype=torch.int64, deterministic=False,
                     seed=2))  # fmt: skip
@example(params=dict(case="relative_bias", dtype="fp32", causal=False, blocks=Blocks(),
                     q_block=16, kv_block=32, seqlen_q=17, seqlen_k=50, batch=1,
                     broadcast=(True, True), full=False, drop=0.3, promote=0.0,
                     index_dtype=torch.int32, deterministic=False, seed=3))  # fmt: skip
@example(params=dict(case="prefix_lm", dtype="fp32", causal=True,
                     blocks=Blocks((32, 16), (16, 16), (32, 32)), q_block=64, kv_block=32,
                     seqlen_q=48, seqlen_k=31, batch=1, broadcast=(False, True), full=True,
                     drop=0.0, promote=0.5, index_dtype=torch.int64, deterministic=True,
                     seed=4))  # fmt: skip
def test_block_sparse_gradients_mean_what_flex_means(params) -> None:
    module, q, k, v, tensors, block_mask = build_backward_case(params)
    check_gradients(params, module, q, k, v, tensors, block_mask)


def _document(dtype="fp32", batch=2, seqlen=48, seed=7):
    spec = expression_backward_spec("document", dtype, causal=False)
    q, k, v, _ = make_inputs(spec, batch, seqlen, seqlen, seed=seed)
    tensors = case_tensors("document", batch, seqlen, seed)
    return spec, q, k, v, tensors, mask_mod_values(spec, tensors, batch, seqlen, seqlen)


DOCUMENT = dict(case="document", dtype="fp32", causal=False)


@pytest.mark.parametrize("deterministic", [True, False])
def test_unlisted_rows_and_columns_get_zero_gradients(deterministic: bool) -> None:
    """Batch 0's q-block 1 lists nothing (out 0, dq 0 there) and no q-block of batch 1 lists
    key block 2 (dk, dv 0 there, though mask_mod keeps some of its keys)."""
    _, q, k, v, tensors, values = _document()
    num, indices, full_num, full_indices, qb, kb = exact_block_mask(values, 16, 16)
    num[0, :, 1] = 0
    full_num[0, :, 1] = 0
    partial, full = chosen_of(num, indices), chosen_of(full_num, full_indices)
    partial[1, ..., 2] = False
    full[1, ..., 2] = False
    block_mask = (*lists_of(partial), *lists_of(full), qb, kb)
    params = dict(DOCUMENT, deterministic=deterministic)
    module = module_for(expression_backward_spec("document", "fp32", False))
    out, (dq, dk, dv) = check_gradients(params, module, q, k, v, tensors, block_mask)
    assert torch.all(out[0, :, 16:32] == 0) and torch.all(dq[0, :, 16:32] == 0)
    assert torch.all(dk[1, :, 32:48] == 0) and torch.all(dv[1, :, 32:48] == 0)
    assert bool(values[1, :, :, 32:48].any())  # mask_mod alone would keep some of them


def test_the_functional_backward_zeroes_the_rows_an_empty_q_block_holds() -> None:
    """attention_backward(..., block_mask=) gives the gradients autograd gives through
    attention(..., block_mask=), bitwise (the autograd calls it with the same lists); batch
    0's q-block 1 lists nothing, so its dq rows are 0 there, unlike without the lists."""
    _, q, k, v, tensors, values = _document()
    num, indices, full_num, full_indices, q_block, kv_block = exact_block_mask(values, 16, 16)
    num[0, :, 1] = 0
    full_num[0, :, 1] = 0
    block_mask = (num, indices, full_num, full_indices, q_block, kv_block)
    module = module_for(expression_backward_spec("document", "fp32", False))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    _, grads = run(module, q, k, v, dout, tensors, block_mask=block_mask)
    out, lse = module.attention(q, k, v, tensors=tensors, block_mask=block_mask, return_lse=True)
    direct = module.attention_backward(
        dout, q, k, v, out, lse, tensors=tensors, block_mask=block_mask
    )
    assert all(torch.equal(a, b) for a, b in zip(direct, grads, strict=True))
    assert torch.all(direct[0][0, :, 16:32] == 0)
    out, lse = module.attention(q, k, v, tensors=tensors, return_lse=True)
    dense = module.attention_backward(dout, q, k, v, out, lse, tensors=tensors)
    assert bool(dense[0][0, :, 16:32].abs().sum() > 0)  # mask_mod alone keeps keys there


@pytest.mark.parametrize("kind", ["negative", "huge", "counts_beyond_the_row", "negative_counts"])
@pytest.mark.parametrize("deterministic", [True, False])
def test_hostile_lists_in_the_backward(kind: str, deterministic: bool) -> None:
    """Counts clamped to [0, cols], indices outside [0, cols) name no block, in both gradient
    kernels as in the forward (dense_keep applies that rule), and no access leaves the
    tensors (the memory watch)."""
    num, indices = _hostile(kind, torch.int64 if deterministic else torch.int32)
    _, q, k, v, tensors, _ = _document(batch=1)
    full = (num.clone().zero_(), indices.clone())  # full lists present, all empty
    params = dict(DOCUMENT, deterministic=deterministic)
    module = module_for(expression_backward_spec("document", "fp32", False))
    check_gradients(params, module, q, k, v, tensors, (num, indices, *full, 16, 16))


def test_full_blocks_skip_mask_mod_in_the_gradients() -> None:
    """A block of mixed mask_mod values listed as full: every element counts (its gradient
    differs from the partial listing's, which the reference of each meaning confirms)."""
    _, q, k, v, tensors, values = _document(batch=1)
    num, indices, full_num, full_indices, qb, kb = exact_block_mask(values, 16, 16)
    promoted = chosen_of(num, indices) | chosen_of(full_num, full_indices)
    assert bool(chosen_of(num, indices).any())  # some block is mixed
    params = dict(DOCUMENT, deterministic=True)
    module = module_for(expression_backward_spec("document", "fp32", False))
    empty = lists_of(torch.zeros_like(promoted))
    _, as_full = check_gradients(
        params, module, q, k, v, tensors, (*empty, *lists_of(promoted), qb, kb)
    )
    _, as_partial = check_gradients(
        params, module, q, k, v, tensors, (num, indices, full_num, full_indices, qb, kb)
    )
    assert not torch.allclose(as_full[0], as_partial[0])


def test_attngen_create_block_mask_gives_the_mask_mod_gradients() -> None:
    """attngen.create_block_mask's lists of the mask_mod the spec has (full blocks: mask_mod
    all true there): the same gradients as the dense backward, to the rule."""
    from attngen import create_block_mask

    spec, q, k, v, tensors, _ = _document(batch=2, seqlen=64)
    docs = tensors["doc"]

    def mask_mod(b, h, q_idx, kv_idx):
        return docs[b, q_idx] == docs[b, kv_idx]

    mask = create_block_mask(mask_mod, 2, 1, 64, 64, device="cpu", BLOCK_SIZE=32)
    block_mask = (
        mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices,
        *mask.BLOCK_SIZE,
    )  # fmt: skip
    module = module_for(spec)
    dout = torch.randn(2, HEADS, 64, 64).to(q.dtype)
    _, sparse = run(module, q, k, v, dout, tensors, block_mask=block_mask)
    assert not compare_gradients(spec, sparse, q, k, v, dout, tensors=tensors)


def test_tiles_that_do_not_divide_the_blocks_are_refused() -> None:
    """q_block 16 under a dK/dV kernel's BLOCK_M of 32: refused when the call is made, naming
    block_mask, q_block and the backward's config."""
    spec, q, k, v, tensors, values = _document(batch=1)
    module = module_for(spec, Blocks((16, 16), (16, 16), (32, 16)))
    q.requires_grad_()
    message = (
        r"^block_mask: q_block 16; allowed: a positive multiple of this module's BLOCK_M 32 "
        r"\(the backward's BWD_DKDV_CONFIG\)"
    )
    with pytest.raises(ValueError, match=message):
        module.attention(q, k, v, tensors=tensors, block_mask=exact_block_mask(values, 16, 16))


def test_flex_passes_its_block_mask_only_where_the_backward_tiles_divide_it() -> None:
    """flex_attention's _sparsity asks the module (block_mask_problem): with gradients the
    backward's tiles must divide the blocks too (else every key block runs with mask_mod per
    element, the reason recorded); without, only the forward's."""
    from types import SimpleNamespace

    from attngen.runtime.flex.attention import _sparsity

    spec = expression_backward_spec("document", "fp32", causal=False)
    module = module_for(spec, Blocks((32, 32), (32, 32), (32, 64)))
    lists = torch.zeros(1, 1, 8, dtype=torch.int32), torch.zeros(1, 1, 8, 8, dtype=torch.int32)
    blocks = SimpleNamespace(
        BLOCK_SIZE=(32, 32), kv_num_blocks=lists[0], kv_indices=lists[1],
        full_kv_num_blocks=None, full_kv_indices=None,
    )  # fmt: skip
    q = torch.zeros(1, 1, 256, 8)
    sparsity, why = _sparsity(module, blocks, q, q, False)
    assert sparsity == (*lists, None, None, 32, 32)
    assert why == "block mask: listed key blocks only"
    sparsity, why = _sparsity(module, blocks, q, q, True)
    assert sparsity is None
    assert why == (
        "block mask not used to skip blocks: its kv_block 32; allowed: a positive multiple of "
        "this module's BLOCK_N 64 (the backward's BWD_DKDV_CONFIG)"
    )
    blocks.BLOCK_SIZE = (32, 64)
    assert _sparsity(module, blocks, q, q, True)[0] is not None


def test_block_mask_problem_is_the_one_rule() -> None:
    """The module's block_mask_problem: None where every launch's tiles divide the blocks,
    else the reason the launchers raise; the forward alone, the backward alone, both, and the
    atomic path's config only on deterministic=False (a host rule: bf16, whose sm90 module
    has an atomic config; fp32's atomic term, a loose bound off wgmma, leaves it none)."""
    spec = expression_backward_spec("document", "bf16", causal=False)
    module = module_for(spec, Blocks((16, 16), (32, 16), (16, 32)))
    module.BWD_DKDV_ATOMIC_CONFIG.update(BLOCK_N=64)
    problem = module.block_mask_problem
    assert problem(16, 16, 48) is None
    assert problem(16, 32, 48, forward=False, backward=True) == (
        "q_block 16; allowed: a positive multiple of this module's BLOCK_M 32 (the backward's "
        "BWD_DQ_CONFIG)"
    )
    assert problem(32, 32, 48, backward=True) is None
    assert problem(32, 32, 48, backward=True, deterministic=False).endswith(
        "BLOCK_N 64 (the backward's BWD_DKDV_ATOMIC_CONFIG)"
    )
    assert problem(0, 16, 48) == (
        "q_block 0; allowed: a positive multiple of this module's BLOCK_M 16 (its launch config)"
    )
    assert problem(16.0, 16, 48).startswith("q_block 16.0; allowed")


@pytest.mark.parametrize("deterministic", [True, False])
def test_the_functional_backward_takes_the_block_mask(deterministic: bool) -> None:
    """attention_backward(..., block_mask=) under the memory watch: the gradients of the
    block mask's meaning (the rule), and with deterministic=True the bits autograd through
    attention(..., block_mask=) gives; its tile refusal names the backward's config."""
    spec, q, k, v, tensors, values = _document()
    gen = torch.Generator().manual_seed(3)
    block_mask = disturb(exact_block_mask(values, 16, 16), gen, 0.3, 0.5)
    module = module_for(spec)
    dout = torch.randn(q.shape, generator=gen).to(q.dtype)
    out, lse = module.attention(q, k, v, tensors=tensors, block_mask=block_mask, return_lse=True)
    options = dict(tensors=tensors, block_mask=block_mask, deterministic=deterministic)
    with watching():
        got = module.attention_backward(dout, q, k, v, out, lse, **options)
    keep = dense_keep(block_mask, values, 48, 48).expand(2, HEADS, -1, -1)
    ref = reference_backward_spec("document", "fp32", False, keep)
    assert not compare_gradients(ref, got, q, k, v, dout, tensors={"keep": keep})
    if deterministic:
        _, grads = run(module, q, k, v, dout, tensors, block_mask=block_mask)
        assert all(torch.equal(a, b) for a, b in zip(got, grads, strict=True))
    module = module_for(spec, Blocks((16, 16), (32, 16), (16, 16)))
    message = r"^block_mask: q_block 16; allowed: .* BLOCK_M 32 \(the backward's BWD_DQ_CONFIG\)$"
    with pytest.raises(ValueError, match=message):
        module.attention_backward(dout, q, k, v, out, lse, **options)
