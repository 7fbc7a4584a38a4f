"""score_mod and mask_mod compiled into the prefill and varlen kernels (CPU interpreter).

Each case is a spec built here (no example file): FlexAttention's gym of expressions (a
document mask over packed sequences, prefix-LM, a relative-position bias table, a softcap and
ALiBi written as expressions, a read past its tensor that must mask), with and without the
built-in causal mask, against the float64 reference that evaluates the same tree
(attngen.spec.masks.expression_values), by the rule of shared/RELIABILITY.md. Every launch runs
under tests/memory_watch.py: a read outside a declared tensor fails the test.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from attngen.build import plan_build
from attngen.reference import compare_to_reference
from attngen.spec import KernelKind
from tests.kernel_harness import load_kernel, make_inputs, make_spec
from tests.memory_watch import watching
from tests.test_varlen_properties import cu_seqlens, packed_inputs

REL = 16  # the relative bias table's half width: bias[h, q_idx - kv_idx + REL]
CASES = {
    "document": dict(
        mask_mod="doc[b, q_idx] == doc[b, kv_idx]",
        tensors=[{"name": "doc", "dtype": "int32", "shape": ["B", "N"]}],
    ),
    "prefix_lm": dict(
        mask_mod="kv_idx < prefix[b] or q_idx >= kv_idx",
        tensors=[{"name": "prefix", "dtype": "int64", "shape": ["B"]}],
    ),
    "relative_bias": dict(
        score_mod=f"score + bias[h, q_idx - kv_idx + {REL}]",
        tensors=[{"name": "bias", "dtype": "float32", "shape": ["H", 2 * REL + 1]}],
    ),
    "softcap": dict(score_mod="30 * tanh(score / 30)"),
    "alibi": dict(
        score_mod="score - slopes[h] * abs(q_idx - kv_idx)",
        tensors=[{"name": "slopes", "dtype": "float32", "shape": ["H"]}],
    ),
    # rows past the table read nothing: their keys are masked (-inf), so such a row sees none
    "out_of_range": dict(
        score_mod="score + rows[q_idx]",
        mask_mod="kv_idx % 3 != 1",
        tensors=[{"name": "rows", "dtype": "bf16", "shape": [20]}],
    ),
}


def expression_spec(case: str, dtype: str, causal: bool):
    mask = dict(mask="causal", causal_align="top_left") if causal else dict(mask="none")
    return make_spec(name="flex", dtype=dtype, **mask, **CASES[case])


def case_tensors(case: str, batch: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    """The tensors `case` reads, from a seed: documents of random lengths, prefixes within
    the sequence, a bias table, ALiBi's slopes."""
    gen = torch.Generator().manual_seed(seed)
    if case == "document":
        cuts = torch.rand(batch, length, generator=gen) < 0.2
        return {"doc": cuts.cumsum(1).to(torch.int32)}
    if case == "prefix_lm":
        return {"prefix": torch.randint(0, length + 2, (batch,), generator=gen)}
    if case == "relative_bias":
        return {"bias": torch.randn(4, 2 * REL + 1, generator=gen)}
    if case == "alibi":
        return {"slopes": 2.0 ** (-torch.arange(1, 5, dtype=torch.float32))}
    if case == "out_of_range":
        return {"rows": torch.randn(20, generator=gen).to(torch.bfloat16)}
    return {}


@st.composite
def dense_case(draw):
    return dict(
        case=draw(st.sampled_from(sorted(CASES))),
        dtype=draw(st.sampled_from(["fp16", "bf16", "fp32"])),
        causal=draw(st.booleans()),
        blocks=(draw(st.sampled_from([16, 32])), draw(st.sampled_from([16, 32]))),
        seqlen_q=draw(st.sampled_from([1, 15, 16, 17, 33, 37])),
        seqlen_k=draw(st.sampled_from([1, 16, 17, 31, 37])),
        batch=draw(st.integers(1, 2)),
        seed=draw(st.integers(0, 2**16)),
    )


@given(params=dense_case())
@example(params=dict(case="document", dtype="bf16", causal=True, blocks=(16, 16), seqlen_q=37,
                     seqlen_k=37, batch=2, seed=1))  # fmt: skip
@example(params=dict(case="out_of_range", dtype="fp32", causal=False, blocks=(16, 32),
                     seqlen_q=33, seqlen_k=17, batch=1, seed=2))  # fmt: skip
@example(params=dict(case="softcap", dtype="fp16", causal=True, blocks=(32, 16), seqlen_q=17,
                     seqlen_k=37, batch=2, seed=3))  # fmt: skip
def test_expressions_match_the_reference(params) -> None:
    spec = expression_spec(params["case"], params["dtype"], params["causal"])
    kernel = load_kernel(spec, *params["blocks"])
    batch, seqlen_q, seqlen_k = params["batch"], params["seqlen_q"], params["seqlen_k"]
    scale = 8.0 if params["case"] == "softcap" else 1.0  # scores past the cap
    q, k, v, _ = make_inputs(spec, batch, seqlen_q, seqlen_k, seed=params["seed"], scale=scale)
    tensors = case_tensors(params["case"], batch, max(seqlen_q, seqlen_k), params["seed"])
    with watching():
        out, lse = kernel.attention(q, k, v, return_lse=True, tensors=tensors or None)
    problems = compare_to_reference(spec, out, lse, q, k, v, tensors=tensors)
    assert not problems, "; ".join(problems)


def test_a_constant_derivative_lands_on_the_scores_device() -> None:
    """ALiBi as score_mod has d score_mod / d score = 1, a constant tree: the reference's
    factor must be on the scores' device (the float64 yardstick multiplies it with CUDA dS;
    on the CPU it was a CPU tensor; `meta` stands in for CUDA here)."""
    from attngen.reference.backward import _expression

    spec = expression_spec("alibi", "fp32", causal=False)
    score = torch.zeros(1, 4, 3, 5, device="meta")
    exprs = {"tensors": {"slopes": torch.ones(4, device="meta")}}
    factor = _expression(spec, "score_mod", score, exprs, derivative="score")
    assert factor.device.type == "meta" and factor.shape == score.shape


def test_a_row_that_sees_no_key_gives_zero_and_minus_inf() -> None:
    """Rows past the table (q_idx >= 20) read nothing, so every key is masked for them."""
    spec = expression_spec("out_of_range", "bf16", causal=False)
    q, k, v, _ = make_inputs(spec, 1, 24, 16, seed=0)
    tensors = case_tensors("out_of_range", 1, 24, 0)
    out, lse = load_kernel(spec, 16, 16).attention(q, k, v, return_lse=True, tensors=tensors)
    assert torch.all(out[:, :, 20:] == 0) and torch.all(lse[:, :, 20:] == float("-inf"))
    assert torch.isfinite(lse[:, :, :20]).all()


@pytest.mark.parametrize("case", ["document", "relative_bias", "prefix_lm"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_varlen_indexes_each_sequence_from_its_start(case: str, dtype: str) -> None:
    """b is the sequence, q_idx and kv_idx positions within it (not packed rows)."""
    spec = make_spec(
        name="flex",
        dtype=dtype,
        mask="causal",
        causal_align="bottom_right",
        kernels=["varlen"],
        **CASES[case],
    )
    kernel = load_kernel(spec, 16, 16, kind="varlen")
    lengths_q, lengths_k = [5, 0, 33, 17], [9, 4, 33, 40]
    q, k, v, _ = packed_inputs(spec, lengths_q, lengths_k, seed=4)
    tensors = case_tensors(case, len(lengths_q), max(lengths_k), seed=4)
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    with watching():
        out, lse = kernel.attention_varlen(
            q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), return_lse=True, tensors=tensors
        )
    for b, (nq, nk) in enumerate(zip(lengths_q, lengths_k, strict=True)):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        problems = compare_to_reference(
            spec,
            out[rows].transpose(0, 1)[None],
            lse[:, rows][None],
            *(t[s].transpose(0, 1)[None] for t, s in ((q, rows), (k, keys), (v, keys))),
            tensors=tensors,
            first_b=b,
        )
        assert not problems, (b, nq, nk, problems)


def test_flash_layout_entries_take_tensors() -> None:
    spec = expression_spec("document", "fp16", causal=True)
    kernel = load_kernel(spec, 16, 16)
    q, k, v, _ = make_inputs(spec, 2, 20, 20, seed=5)
    tensors = case_tensors("document", 2, 20, 5)
    expected = kernel.attention(q, k, v, tensors=tensors)
    flash = kernel.attention_flash(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), tensors=tensors
    )
    assert torch.equal(flash.transpose(1, 2), expected)
    assert torch.equal(
        kernel.attention_flash_out(q, k, v, tensors=tensors).transpose(1, 2), expected
    )


def _bad_calls():
    doc = torch.zeros(2, 20, dtype=torch.int32)
    return [
        (None, "tensors: got NoneType; allowed: a mapping of exactly ['doc', 'pos']"),
        ({"doc": doc}, "tensors: got the names ['doc']; allowed: a mapping of exactly"),
        ({"doc": doc, "pos": doc, "x": doc}, "tensors: got the names ['doc', 'pos', 'x']"),
        (
            {"doc": doc.long(), "pos": doc},
            "tensors['doc']: dtype torch.int64; allowed: torch.int32",
        ),
        ({"doc": doc, "pos": doc[0]}, "tensors['pos']: rank 1 (shape (20,)); allowed: rank 2"),
        ({"doc": doc, "pos": doc[:, :5]}, "tensors['pos']: size 5 on axis 1; allowed: 20"),
        (
            {"doc": doc, "pos": torch.zeros(3, 20, dtype=torch.int32)},
            "tensors['pos']: dim B is 3 on axis 0; allowed: 2, its size in tensors['doc']",
        ),
        ({"doc": doc.to("meta"), "pos": doc}, "tensors['doc']: device meta; allowed: cpu"),
        ({"doc": [0, 1], "pos": doc}, "tensors['doc']: got list; allowed: a torch.Tensor"),
    ]


@pytest.mark.parametrize(("tensors", "message"), _bad_calls())
def test_tensors_are_checked_naming_the_tensor(tensors, message: str) -> None:
    spec = make_spec(
        name="flex",
        mask_mod="doc[b, q_idx] == pos[b, kv_idx]",
        tensors=[
            {"name": "doc", "dtype": "int32", "shape": ["B", "N"]},
            {"name": "pos", "dtype": "int32", "shape": ["B", 20]},
        ],
    )
    q, k, v, _ = make_inputs(spec, 2, 20, 20, seed=0)
    kernel = load_kernel(spec, 16, 16)
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        kernel.attention(q, k, v, tensors=tensors)


def test_a_module_without_declared_tensors_refuses_them() -> None:
    spec = make_spec(name="flex", mask_mod="q_idx >= kv_idx")
    q, k, v, _ = make_inputs(spec, 1, 8, 8, seed=0)
    kernel = load_kernel(spec, 16, 16)
    with pytest.raises(ValueError, match=r"allowed: None \(the spec declares no tensors\)"):
        kernel.attention(q, k, v, tensors={"doc": q})
    assert torch.equal(kernel.attention(q, k, v, tensors={}), kernel.attention(q, k, v))
    plain = load_kernel(make_spec(name="plain"), 16, 16)
    with pytest.raises(TypeError, match="tensors"):
        plain.attention(q, k, v, tensors={})


def test_expression_modules_have_the_warp_specialized_forward() -> None:
    """sm90's warp-specialized forward serves expressions (its GPU tests passed); under the
    interpreter a call takes the tile-level kernel, and forward_path says why."""
    spec = make_spec(name="flex", dtype="bf16", head_dim=128, mask_mod="q_idx >= kv_idx")
    kernel = load_kernel(spec)
    assert hasattr(kernel, "_gluon_attn_fwd_kernel")
    kernel.attention(*make_inputs(spec, 1, 8, 8, seed=0)[:3])
    assert kernel.forward_path() == "tile-level: " + kernel._INTERPRETED


def test_the_build_renders_prefill_and_varlen() -> None:
    spec = make_spec(name="flex", kernels=["prefill", "varlen"], **CASES["document"])
    paths = [a.relative_path for a in plan_build([spec])]
    assert len(paths) == 2 and all("flex" in p for p in paths)


def test_the_runtime_never_routes_a_plain_call_to_an_expression_module(tmp_path) -> None:
    """A module with score_mod / mask_mod serves only calls that ask for its expression key
    (attngen.spec.expressions.expression_key); a call without expressions takes the plain one."""
    import attngen
    from attngen.runtime.registry import load_kernels, use_registry
    from attngen.runtime.selection import Need, best_entry, mismatches
    from attngen.spec import Dtype, Mask
    from attngen.spec.expressions import expression_key
    from tests.runtime_harness import build_folder

    fields = dict(dtype="fp32", head_dim=16, num_q_heads=2, num_kv_heads=2, mask="none")
    flex = dict(name="flex", kernels=["prefill"], mask_mod="q_idx >= kv_idx", **fields)
    registry = load_kernels(build_folder(tmp_path / "flex", [flex]), replace=True)
    (entry,) = registry.entries
    key = expression_key(entry.spec)
    assert len(key) == 16 and key == expression_key(make_spec(**flex).canonical())
    need = Need(KernelKind.prefill, Dtype.fp32, 16, 16, Mask.none, None, None, 0.0, False,
                "interpreter", 8, 8, True)  # fmt: skip
    assert mismatches(entry, need) == [f"score_mod/mask_mod: needs none, module has {key}"]
    assert best_entry(registry, need) is None
    assert best_entry(registry, need._replace(expressions=key)) is entry
    plain = dict(name="plain", kernels=["prefill"], **fields)
    saved = use_registry(load_kernels(build_folder(tmp_path / "both", [flex, plain]), replace=True))
    try:
        q = torch.randn(1, 2, 8, 16)
        attngen.scaled_dot_product_attention(q, q, q)
        assert attngen.last_dispatch().module == "sm90/plain_prefill_fp32_d16"
    finally:
        use_registry(saved)


def test_the_tiling_counts_the_pipelined_tensor_reads() -> None:
    """A read at (q_idx, kv_idx) adds a [BLOCK_M, BLOCK_N] tile per extra stage, one at kv_idx
    alone a [BLOCK_N] row, reads of neither nothing (the H200's 245760 B for the relative
    bias at 128 x 128 x 3 stages, where the model without them said 115712)."""
    from attngen.arch import ARCHS
    from attngen.tiling.prefill import ExpressionReads, derive_tiles, expression_reads

    reads = {c: expression_reads(make_spec(name="t", **CASES[c])) for c in CASES}
    assert reads["relative_bias"] == ExpressionReads(tile=4)
    assert reads["document"] == ExpressionReads(kv_row=4, q_row=4)
    assert reads["softcap"] == reads["alibi"] == ExpressionReads()
    bias = derive_tiles(
        make_spec(name="t", dtype="bf16", head_dim=64, **CASES["relative_bias"]), "sm90"
    )
    plain = derive_tiles(make_spec(name="t", dtype="bf16", head_dim=64), "sm90")
    with_reads, without = ({c.config: c.smem_bytes for c in d.candidates} for d in (bias, plain))
    for config, size in with_reads.items():
        extra = (config.num_stages - 1) * config.block_m * config.block_n * 4
        assert size == without[config] + extra
    assert bias.chosen is not None and with_reads[bias.chosen] <= ARCHS["sm90"].smem_budget


def test_the_tiling_of_tensor_reads_against_the_compiler() -> None:
    """The forward's term is exact and the gradient kernels' a bound, checked against Triton's
    sm90 cross-compile (spawned workers: no interpreter there): the relative-bias table (a
    trainable tile read) at the derived configs and at the 3-stage forward the H200 refused,
    a document mask's rows in the backward."""
    from attngen.tiling.backward import derive_backward_tiles
    from attngen.tiling.prefill import TileConfig, derive_tiles
    from attngen.verify.compiler import compile_many
    from tests.test_expression_backward import expression_backward_spec

    spec = expression_spec("relative_bias", "bf16", False)
    derivation = derive_tiles(spec, "sm90")
    modelled = {c.config: c.smem_bytes for c in derivation.candidates}
    assert derivation.chosen is not None
    configs = (derivation.chosen, TileConfig(128, 128, 8, 3))
    records = compile_many([(spec, "sm90", config) for config in configs])
    assert [r["shared"] for r in records] == [modelled[c] for c in configs], records
    jobs, bounds = [], []
    for case in ("relative_bias", "document"):
        spec = expression_backward_spec(case, "bf16", False)
        backward = derive_backward_tiles(spec, "sm90")
        for kernel in ("dq", "dkdv"):
            chosen = getattr(backward, kernel).chosen_candidate
            assert chosen is not None
            jobs.append((spec, "sm90", chosen.config, kernel))
            bounds.append(chosen.smem_bytes)
    for bound, record in zip(bounds, compile_many(jobs), strict=True):
        # the bound's excess: the trainable tile's scratch is sm80's size (see
        # attngen.tiling.backward.expression_smem), rows carry ROW_SLACK
        assert record["shared"] is not None and bound - 12288 <= record["shared"] <= bound, record
