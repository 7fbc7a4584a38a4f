"""score_mod and mask_mod compiled into the decode kernels (CPU interpreter).

A decode step's queries are the last NQ tokens of their sequences: the expressions read b the
sequence, h each packed row's own query head (GQA packs q_per_kv heads in one tile), q_idx the
query token's position L_b - NQ + t (after the step's append) and kv_idx the key's position in
the sequence, for paged caches too (not its page slot). Against the float64 reference that
evaluates the same tree with those positions (decode_harness.decode_problems: first_q), by the
rule of shared/RELIABILITY.md, on contiguous and paged caches, with forced splits (the split
kernel applies the expressions, the combine merges), fp8 caches and tree_mask. Every launch
runs under tests/memory_watch.py: a read outside a declared tensor fails the test.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from attngen.build import plan_build
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
from tests.test_decode_fp8 import draw_descale, fp8_cache, fp8_problems, quantize
from tests.test_decode_tree import random_tree

REL = 8  # the relative bias table's half width: bias[h, q_idx - kv_idx + REL]
CASES = {
    "document": dict(
        mask_mod="doc[b, kv_idx] == doc[b, q_idx]",
        tensors=[{"name": "doc", "dtype": "int32", "shape": ["B", "N"]}],
    ),
    # keys farther than REL read outside the table: masked (-inf), as elsewhere
    "relative_bias": dict(
        score_mod=f"score + bias[h, q_idx - kv_idx + {REL}]",
        tensors=[{"name": "bias", "dtype": "float32", "shape": ["H", 2 * REL + 1]}],
    ),
    "softcap": dict(score_mod="20 * tanh(score / 20)"),
    "alibi": dict(  # per query head: each packed row's own slope
        score_mod="score - slopes[h] * abs(q_idx - kv_idx)",
        tensors=[{"name": "slopes", "dtype": "float32", "shape": ["H"]}],
    ),
    # queries at positions >= 20 read nothing: every key is masked for them
    "out_of_range": dict(
        score_mod="score + rows[q_idx]",
        mask_mod="kv_idx % 3 != 1",
        tensors=[{"name": "rows", "dtype": "bf16", "shape": [20]}],
    ),
}


def case_tensors(case: str, batch: int, heads: int, length: int, seed: int):
    """The tensors `case` reads (None where it reads none): documents of random lengths over
    every position of the cache, a bias table, per-head slopes, a short row table."""
    gen = torch.Generator().manual_seed(seed)
    if case == "document":
        cuts = torch.rand(batch, length, generator=gen) < 0.25
        return {"doc": cuts.cumsum(1).to(torch.int32)}
    if case == "relative_bias":
        return {"bias": torch.randn(heads, 2 * REL + 1, generator=gen)}
    if case == "alibi":
        return {"slopes": torch.rand(heads, generator=gen)}
    if case == "out_of_range":
        return {"rows": torch.randn(20, generator=gen).to(torch.bfloat16)}
    return None


@st.composite
def expression_case(draw):
    layout = draw(st.sampled_from(["contiguous", "paged"]))
    kv_heads = draw(st.integers(1, 2))
    fields = dict(
        dtype=draw(st.sampled_from(["bf16", "fp16", "fp32"])),
        head_dim=16,
        mask=draw(st.sampled_from(["none", "causal"])),
        num_kv_heads=kv_heads,
        num_q_heads=kv_heads * draw(st.sampled_from([1, 2, 4])),
        max_query_tokens=4,
    )
    if fields["mask"] == "causal":
        fields["causal_align"] = "bottom_right"
    lengths = draw(st.lists(st.sampled_from([0, 1, 4, 15, 16, 17, 37]), min_size=1, max_size=3))
    num_q = draw(st.integers(1, 4))
    return dict(
        case=draw(st.sampled_from(sorted(CASES))),
        layout=layout,
        page_size=draw(st.sampled_from([4, 16])) if layout == "paged" else None,
        fields=fields,
        block_n=draw(st.sampled_from([16, 32])),
        lengths=lengths,
        num_q=num_q,
        num_new=draw(st.sampled_from([0, num_q])),
        splits=draw(st.sampled_from([None, 1, 2, 3])),
        seed=draw(st.integers(0, 2**16)),
    )


def run_case(params, device="cpu"):
    """(problems against the float64 reference, out, lse) of one expression_case."""
    spec = make_decode_spec(params["layout"], params["page_size"], **params["fields"],
                            **CASES[params["case"]])  # fmt: skip
    kernel = load_decode(spec, params["block_n"])
    num_q, num_new, lengths = params["num_q"], params["num_new"], params["lengths"]
    cache = make_cache(spec, lengths, seed=params["seed"], room=num_new)
    batch = len(lengths)
    q, k_new, v_new, _ = make_queries(spec, batch, num_q, seed=params["seed"], num_new=num_new)
    tensors = case_tensors(params["case"], batch, spec.num_q_heads, max(lengths) + num_new + 1,
                           params["seed"])  # fmt: skip

    def on(t):
        return None if t is None else t.to(device)

    kernel.FORCE_NUM_SPLITS = params["splits"]
    try:
        with watching() if device == "cpu" else torch.no_grad():
            moved = tensors and {n: on(t) for n, t in tensors.items()}
            out, lse = run_decode(kernel, cache.clone().to(device), on(q), on(k_new), on(v_new),
                                  tensors=moved)  # fmt: skip
    finally:
        kernel.FORCE_NUM_SPLITS = None
    out, lse = out.cpu(), lse.cpu()
    return decode_problems(spec, cache, out, lse, q, k_new, v_new, tensors=tensors), out, lse


@given(params=expression_case())
@example(params=dict(  # a document mask over a paged cache, GQA 4:1, appended drafts, 3 splits
    case="document", layout="paged", page_size=4, block_n=16, lengths=[5, 0, 37], num_q=4,
    num_new=4, splits=3, seed=1, fields=dict(dtype="bf16", head_dim=16, mask="causal",
    causal_align="bottom_right", num_kv_heads=2, num_q_heads=8, max_query_tokens=4),
))  # fmt: skip
@example(params=dict(  # the bias table per packed head, contiguous, no mask
    case="relative_bias", layout="contiguous", page_size=None, block_n=32, lengths=[37, 17],
    num_q=3, num_new=0, splits=2, seed=2, fields=dict(dtype="fp16", head_dim=16, mask="none",
    num_kv_heads=1, num_q_heads=4, max_query_tokens=4),
))  # fmt: skip
@example(params=dict(  # queries past the row table see no key
    case="out_of_range", layout="paged", page_size=16, block_n=16, lengths=[17, 37], num_q=2,
    num_new=2, splits=None, seed=3, fields=dict(dtype="fp32", head_dim=16, mask="causal",
    causal_align="bottom_right", num_kv_heads=2, num_q_heads=4, max_query_tokens=4),
))  # fmt: skip
def test_decode_expressions_match_the_reference(params) -> None:
    problems, _, _ = run_case(params)
    assert not problems, "; ".join(problems)


def test_queries_past_the_table_give_zero_and_minus_inf() -> None:
    """q_idx is the query's position in its sequence: rows[q_idx] is out of range from 20 on."""
    params = dict(case="out_of_range", layout="contiguous", page_size=None, block_n=16,
                  lengths=[17, 30], num_q=4, num_new=0, splits=2, seed=4,
                  fields=dict(dtype="bf16", head_dim=16, mask="none", num_kv_heads=2,
                              num_q_heads=2, max_query_tokens=4))  # fmt: skip
    problems, out, lse = run_case(params)
    assert not problems, "; ".join(problems)
    assert torch.isfinite(lse[0]).all()  # positions 13 .. 16
    assert torch.all(lse[1] == float("-inf")) and torch.all(out[1] == 0)  # positions 26 .. 29


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_flash_entries_take_tensors_bit_for_bit(layout: str) -> None:
    spec = make_decode_spec(layout, 4, dtype="bf16", head_dim=16, max_query_tokens=4,
                            **CASES["document"])  # fmt: skip
    kernel = load_decode(spec, 16)
    cache = make_cache(spec, [9, 21], seed=5, room=2)
    q, k_new, v_new, _ = make_queries(spec, 2, 2, seed=5, num_new=2)
    tensors = case_tensors("document", 2, 4, 24, 5)
    args = dict(block_table=cache.block_table, return_lse=True, tensors=tensors)
    expected = kernel.decode(q, cache.clone().k, cache.clone().v, cache.lengths, k_new=k_new,
                             v_new=v_new, **args)  # fmt: skip
    paged = layout == "paged"
    k, v = (cache.k, cache.v) if paged else (cache.k.transpose(1, 2), cache.v.transpose(1, 2))
    flash = kernel.decode_flash(q.transpose(1, 2), k.clone(), v.clone(), cache.lengths,
                                k_new=k_new.transpose(1, 2), v_new=v_new.transpose(1, 2),
                                **args)  # fmt: skip
    out = kernel.decode_flash_out(q, cache.clone().k, cache.clone().v, cache.lengths,
                                  k_new=k_new, v_new=v_new, **args)  # fmt: skip
    for got in (flash, out):
        assert same_bits(got[0], expected[0].transpose(1, 2)) and same_bits(got[1], expected[1])
    with pytest.raises(ValueError, match=r"^tensors: got the names \[\]"):
        kernel.decode_flash(q.transpose(1, 2), k, v, cache.lengths, **{**args, "tensors": {}})


@pytest.mark.parametrize(("descale", "splits"), [("random", 2), ("mixed", None)])
def test_fp8_caches_compose_with_expressions(descale: str, splits) -> None:
    spec = make_decode_spec("paged", 4, dtype="bf16", head_dim=16, max_query_tokens=4,
                            kv_dtype="fp8_e4m3", **CASES["relative_bias"])  # fmt: skip
    kernel = load_decode(spec, 16)
    lengths = [6, 21]
    cache = fp8_cache(spec, lengths, seed=6, room=2)
    q, k_new, v_new, _ = make_queries(spec, 2, 2, seed=6, num_new=2)
    kd, vd = (draw_descale(descale, 2, spec.num_kv_heads, s) for s in (6, 7))
    tensors = case_tensors("relative_bias", 2, spec.num_q_heads, 24, 6)
    kernel.FORCE_NUM_SPLITS = splits
    try:
        with watching():
            out, lse = run_decode(kernel, cache.clone(), q, k_new, v_new, k_descale=kd,
                                  v_descale=vd, tensors=tensors)  # fmt: skip
    finally:
        kernel.FORCE_NUM_SPLITS = None
    k8, v8 = (quantize(t, d[:, :, None, None]) for t, d in ((k_new, kd), (v_new, vd)))
    problems = fp8_problems(spec, cache, out, lse, q, k8, v8, kd, vd, tensors=tensors)
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_tree_mask_is_anded_with_mask_mod(layout: str) -> None:
    spec = make_decode_spec(layout, 4, dtype="fp16", head_dim=16, max_query_tokens=8,
                            **CASES["document"])  # fmt: skip
    kernel = load_decode(spec, 16)
    cache = make_cache(spec, [3, 30], seed=7, room=8)
    q, k_new, v_new, _ = make_queries(spec, 2, 8, seed=7, num_new=8)
    gen = torch.Generator().manual_seed(7)
    tree = torch.stack([random_tree(8, gen) for _ in range(2)])
    tensors = case_tensors("document", 2, 4, 40, 7)
    kernel.FORCE_NUM_SPLITS = 2
    try:
        with watching():
            out, lse = run_decode(kernel, cache.clone(), q, k_new, v_new, tree_mask=tree,
                                  tensors=tensors)  # fmt: skip
    finally:
        kernel.FORCE_NUM_SPLITS = None
    problems = decode_problems(spec, cache, out, lse, q, k_new, v_new, tree=tree,
                               tensors=tensors)  # fmt: skip
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("splits", [1, 3])
def test_sinks_compose_with_expressions(splits: int) -> None:
    """Rows past the table see no key: output 0 and LSE the sink's, through the combine too."""
    spec = make_decode_spec("paged", 4, dtype="bf16", head_dim=16, max_query_tokens=2,
                            sinks=True, **CASES["out_of_range"])  # fmt: skip
    kernel = load_decode(spec, 16)
    cache = make_cache(spec, [12, 40], seed=11, room=2)
    q, k_new, v_new, _ = make_queries(spec, 2, 2, seed=11, num_new=2)
    sinks = torch.randn(spec.num_q_heads, generator=torch.Generator().manual_seed(11))
    tensors = case_tensors("out_of_range", 2, 4, 0, 11)
    kernel.FORCE_NUM_SPLITS = splits
    try:
        with watching():
            out, lse = run_decode(kernel, cache.clone(), q, k_new, v_new, sinks=sinks,
                                  tensors=tensors)  # fmt: skip
    finally:
        kernel.FORCE_NUM_SPLITS = None
    problems = decode_problems(spec, cache, out, lse, q, k_new, v_new, sinks=sinks,
                               tensors=tensors)  # fmt: skip
    assert not problems, "; ".join(problems)
    # (the LSE's value is the reference's to judge: the sink passes through the log2 domain)
    assert torch.isfinite(lse[1]).all() and torch.all(out[1] == 0)


def test_the_latent_decode_takes_expressions() -> None:
    """An absorbed MLA decode (q.k as two dots, 32 latent + 16 rope dims) with a bias table."""
    spec = make_decode_spec("paged", 16, dtype="bf16", head_dim=48, head_dim_v=32, num_kv_heads=1,
                            max_query_tokens=2, **CASES["relative_bias"])  # fmt: skip
    kernel = load_decode(spec, 16)
    cache = make_cache(spec, [5, 40], seed=8, room=1)
    q, k_new, v_new, _ = make_queries(spec, 2, 2, seed=8, num_new=1)
    tensors = case_tensors("relative_bias", 2, spec.num_q_heads, 42, 8)
    with watching():
        out, lse = run_decode(kernel, cache.clone(), q, k_new, v_new, tensors=tensors)
    problems = decode_problems(spec, cache, out, lse, q, k_new, v_new, tensors=tensors)
    assert not problems, "; ".join(problems)


def test_tensors_are_checked_naming_the_tensor() -> None:
    spec = make_decode_spec("contiguous", dtype="bf16", head_dim=16, max_query_tokens=2,
                            **CASES["document"])  # fmt: skip
    kernel = load_decode(spec, 16)
    cache = make_cache(spec, [4], seed=9)
    q, _, _, _ = make_queries(spec, 1, 1, seed=9)
    doc = torch.zeros(1, 8, dtype=torch.int32)
    for tensors, message in [
        (None, "tensors: got NoneType; allowed: a mapping of exactly ['doc']"),
        ({"doc": doc.long()}, "tensors['doc']: dtype torch.int64; allowed: torch.int32"),
        ({"doc": doc[0]}, "tensors['doc']: rank 1 (shape (8,)); allowed: rank 2"),
        ({"doc": doc.to("meta")}, "tensors['doc']: device meta; allowed: cpu"),
    ]:
        with pytest.raises(ValueError, match="^" + re.escape(message)):
            run_decode(kernel, cache, q, tensors=tensors)


def test_a_call_with_tensors_never_takes_a_call_plan(monkeypatch) -> None:
    """softcap as an expression declares no tensors, so decode() keeps call plans (GPU only:
    test_expression_decode_gpu.py counts their hits); a call that passes tensors= skips the
    plan lookup and takes the full path, which refuses them."""
    spec = make_decode_spec("paged", 4, dtype="bf16", head_dim=16, max_query_tokens=2,
                            **CASES["softcap"])  # fmt: skip
    kernel = load_decode(spec, 16)
    cache = make_cache(spec, [7, 19], seed=10)
    q, _, _, _ = make_queries(spec, 2, 2, seed=10, scale=8.0)  # scores past the cap
    looked_up, call_key = [], kernel._call_key

    def counted(*args, **kwargs):
        looked_up.append(1)
        return call_key(*args, **kwargs)

    monkeypatch.setattr(kernel, "_call_key", counted)
    out, lse = run_decode(kernel, cache, q)
    assert looked_up == [1] and not decode_problems(spec, cache, out, lse, q)
    for entry in (kernel.decode, kernel.decode_flash_out):
        with pytest.raises(ValueError, match=r"allowed: None \(the spec declares no tensors\)"):
            entry(q, cache.k, cache.v, cache.lengths, block_table=cache.block_table,
                  tensors={"doc": q})  # fmt: skip
    assert looked_up == [1]


def test_the_build_renders_decode_with_expressions() -> None:
    spec = make_decode_spec("paged", 16, name="flex", kernels=["prefill", "varlen", "decode"],
                            **CASES["document"])  # fmt: skip
    paths = [a.relative_path for a in plan_build([spec])]
    assert len(paths) == 3 and any("decode" in p for p in paths)
