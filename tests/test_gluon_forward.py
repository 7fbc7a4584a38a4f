"""The warp-specialized (Gluon) forward on the CPU: which modules render it, its derived config
against the compiler (cross-compiled for sm90), and the routing (under the interpreter the
tile-level kernel runs, and forward_path() / last_dispatch() say why).
tests/test_gluon_gpu.py runs it on the H200."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import attngen
from attngen.arch import ARCHS
from attngen.reference import compare_to_reference
from attngen.render import render_module
from attngen.runtime.registry import cache_folder, current_registry, load_kernels, use_registry
from attngen.spec import KernelKind, load_spec_file
from attngen.spec.files import VARIANTS_ENV
from attngen.tiling.gluon import GLUON_UNVERIFIED, derive_gluon_tiles, gluon_gap
from attngen.tiling.prefill import derive_tiles
from attngen.verify.gluon import verify_gluon
from tests.decode_harness import make_decode_spec
from tests.kernel_harness import assert_matches_reference, load_kernel, make_inputs, make_spec
from tests.test_block_sparse import exact_block_mask, mask_mod_values
from tests.test_expression_kernels import CASES, case_tensors

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = [s for path in sorted(ROOT.glob("examples/*.yaml")) for s in load_spec_file(path)]
PLAIN = {"bert_base", "gpt2", "llama3_8b", "llama4_scout_global", "qwen2_5_7b"}
# windows, chunks, softcap, ALiBi and sinks (opened after tests/test_gluon_variants_gpu.py)
VARIANT_EXAMPLES = {
    "gemma2_9b_global",
    "gemma2_9b_local",
    "gpt_oss_20b_global",
    "gpt_oss_20b_local",
    "llama4_scout_chunked",
    "mistral_7b",
    "mpt_7b",
}

NOT_COVERED = {
    "dropout": dict(backward=True, dropout=True),
    "fp32": dict(dtype="fp32"),
    "d96": dict(head_dim=96, head_dim_v=96),
    "d192_dv128": dict(head_dim=192, head_dim_v=128, dtype="bf16"),
}


def _render(spec, kind=KernelKind.prefill, arch="sm90"):
    return render_module(spec, kind, derive_tiles(spec, arch))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_covered_specs_render_the_gluon_kernel(d, mask):
    spec = make_spec(dtype="bf16", head_dim=d, mask=mask)
    assert gluon_gap(spec, "sm90", KernelKind.prefill) == ""
    source = _render(spec)
    assert "def _gluon_attn_fwd_kernel(" in source and "GLUON_PATH" in source
    imports = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Import | ast.ImportFrom)]
    assert not any("attngen" in (getattr(n, "module", None) or "") for n in imports)
    assert all(not a.name.startswith("attngen") for n in imports for a in n.names)


@pytest.mark.parametrize("name", sorted(NOT_COVERED))
def test_other_specs_stay_tile_level_and_say_why(name):
    spec = make_spec(**NOT_COVERED[name])
    gap = gluon_gap(spec, "sm90", KernelKind.prefill)
    assert gap
    source = _render(spec)
    assert "_gluon_attn_fwd_kernel" not in source
    assert f'return "tile-level: {gap}"' in source


def _has_gluon(source: str) -> bool:
    """A Gluon kernel, launch or host part (the call plans' shared _run_plan names _gluon_why
    and _gluon_run only behind a plan's Gluon answer, None in a module without them)."""
    return any(s in source for s in ("@gluon.jit", "def _gluon", "attngen/host/gluon.py"))


def test_other_archs_stay_tile_level_and_varlen_holds_the_kernel():
    spec = make_spec(dtype="bf16", head_dim=128, kernels=["prefill", "varlen"], archs=["sm80"])
    assert _has_gluon(_render(spec)) and not _has_gluon(_render(spec, arch="sm80"))
    assert gluon_gap(spec, "sm80", KernelKind.prefill).startswith("sm80 has no")
    assert _has_gluon(_render(spec, KernelKind.varlen))
    assert gluon_gap(spec, "sm90", KernelKind.varlen) == ""


def test_the_derived_configs_are_the_measured_ones():
    """Causal, D 64: 64x128, 3 stages; D 128: 64x128, 2; D 256: 64x64, 2 (docs/performance.md),
    two consumers with 240 registers each and 24 for the producer, within the budget."""
    expected = {64: (128, 3), 128: (128, 2), 256: (64, 2)}
    for d, (block_n, stages) in expected.items():
        chosen = derive_gluon_tiles(make_spec(dtype="bf16", head_dim=d), "sm90").chosen
        config = chosen.config
        assert (config.consumers, config.block_m, config.block_n, config.stages) == (
            2,
            64,
            block_n,
            stages,
        )
        assert (config.consumer_regs, config.producer_regs, config.maxnreg) == (240, 24, 168)
        assert chosen.smem_bytes <= ARCHS["sm90"].smem_budget


def test_d64_without_a_mask_takes_three_consumers():
    """Measured faster there (tiling/gluon.py, preferred_consumers): three consumers x 64 rows
    at 160 registers each; a causal mask, varlen, a variant or another head dim keeps two."""

    def config(kind=KernelKind.prefill, head_dim=64, **fields):
        spec = make_spec(dtype="bf16", head_dim=head_dim, **fields)
        return derive_gluon_tiles(spec, "sm90", kind).chosen.config

    plain = config(mask="none")
    assert (plain.consumers, plain.block_m, plain.block_n, plain.stages) == (3, 64, 128, 3)
    assert (plain.consumer_regs, plain.producer_regs, plain.maxnreg) == (160, 24, 128)
    assert config(mask="causal").consumers == 2
    assert config(KernelKind.varlen, mask="none").consumers == 2
    assert config(mask="none", softcap=20.0).consumers == 2
    assert config(head_dim=128, mask="none").consumers == 2


def test_every_covered_example_compiles_for_sm90_as_the_model_predicts():
    """The sm90 Gluon kernels of every example with the plain kernel (the forward, and the dK/dV
    backward where the example trains): the shared memory the model predicts, no spills
    but the known one, the derived setmaxnreg values, wgmma (attngen verify-tiling
    --gluon). The variants' examples compile in the slow test below (7-45 s each)."""
    rows = verify_gluon([s for s in EXAMPLES if s.name in PLAIN])
    assert {row.spec for row in rows} == PLAIN
    for row in rows:
        # the dK/dV kernel's one known spill (D 128 causal, its consumer at the 240-register
        # cap, dQ a step late; tests/test_gluon_backward.py holds it at exactly this)
        known = ["spills 48 B, stack 48 B"] if " dK/dV: " in row.line() else []
        assert row.problems == known, row.line()
        assert row.record["shared"] == row.chosen.smem_bytes


def test_every_example_but_phi3_and_deepseek_has_the_gluon_forward():
    """Phi-3's D 96 and DeepSeek's 192/128 are not laid out; every other example is served."""
    covered = {s.name for s in EXAMPLES if not gluon_gap(s, "sm90", KernelKind.prefill)}
    assert covered == PLAIN | VARIANT_EXAMPLES


@pytest.mark.slow
def test_every_variant_example_compiles_for_sm90_as_the_model_predicts():
    rows = verify_gluon([s for s in EXAMPLES if s.name in VARIANT_EXAMPLES])
    assert {row.spec for row in rows} >= VARIANT_EXAMPLES
    for row in rows:
        # the one known spill: Gemma-2's D 256 window with softcap, varlen (its consumer at the
        # 240-register cap; the prefill form of the same kernel spills nothing)
        local_varlen = row.spec == "gemma2_9b_local" and row.kind is KernelKind.varlen
        assert row.problems == (["spills 40 B, stack 40 B"] if local_varlen else []), row.line()
        assert row.record["shared"] == row.chosen.smem_bytes


def test_d256_compiles_as_the_model_predicts():
    rows = verify_gluon([make_spec(dtype="fp16", head_dim=256, mask="none")])
    assert len(rows) == 1 and not rows[0].problems, rows[0].line()


def test_under_the_interpreter_the_tile_level_kernel_runs_and_says_why():
    spec = make_spec(dtype="fp16", head_dim=64, num_q_heads=4, num_kv_heads=2)
    module = load_kernel(spec)
    q, k, v, _ = make_inputs(spec, 1, 70, 70, seed=41)
    out, lse = module.attention(q, k, v, return_lse=True)
    path = "tile-level: Triton's interpreter runs no Gluon kernel"
    assert module.forward_path() == path == module.expected_forward_path()
    assert_matches_reference(spec, out, lse, q, k, v)


def test_last_dispatch_says_which_forward_ran():
    saved = current_registry()
    load_kernels()  # the default layers (the bundled generated/), whatever a test loaded before
    try:
        _check_last_dispatch_says_which_forward_ran()
    finally:
        use_registry(saved)


def _check_last_dispatch_says_which_forward_ran():
    q = torch.randn(1, 70, 4, 64, dtype=torch.float16)
    k = torch.randn(1, 70, 2, 64, dtype=torch.float16)
    attngen.flash_attn_func(q, k, k, causal=True)  # the sm90 GPT-2 module, interpreted
    chosen = attngen.last_dispatch()
    assert chosen.module == "sm90/gpt2_prefill_fp16_d64_causal_br"
    assert chosen.forward == "tile-level: Triton's interpreter runs no Gluon kernel"
    phi3 = torch.randn(1, 70, 32, 96, dtype=torch.bfloat16)
    attngen.flash_attn_func(phi3, phi3, phi3, causal=True)
    forward = attngen.last_dispatch().forward
    assert (
        forward
        == "tile-level: head dim 96: the kernel is laid out and checked for 64, 128, 256 only"
    )


# The variants the Gluon forward serves: (spec fields, a line only that variant's kernel has).
# tests/test_gluon_variants_gpu.py runs them on the GPU.
_WIN = dict(mask="sliding_window", window_left=127, window_right=0)
VARIANTS = {
    "window-sinks-d64": (
        dict(dtype="bf16", head_dim=64, sinks=True, **_WIN),
        "sink_log2 = gl.load(",
    ),
    "window-d128-top-left": (
        dict(dtype="fp16", head_dim=128, causal_align="top_left", **_WIN),
        "def _gluon_window_range(",
    ),
    "softcap-window-d256": (
        dict(dtype="bf16", head_dim=256, softcap=50.0, **_WIN),
        "gl.exp2(s * (qk_scale * -2.8853900817779268))",
    ),
    "softcap-d256": (
        dict(dtype="bf16", head_dim=256, softcap=50.0),
        "gl.exp2(s * (qk_scale * -2.8853900817779268))",
    ),
    "alibi-none-d128": (
        dict(dtype="fp16", head_dim=128, mask="none", alibi=True),
        "gl.load(Slopes +",
    ),
    "alibi-d256": (dict(dtype="bf16", head_dim=256, alibi=True), "slope_log2 * gl.abs("),
    "sink-tokens-d128": (
        dict(dtype="bf16", head_dim=128, sink_tokens=4, **_WIN),
        "def _gluon_col0(",
    ),
    "chunked-d128": (
        dict(dtype="bf16", head_dim=128, mask="chunked", chunk_size=256),
        "// _CHUNK_SIZE * _CHUNK_SIZE",
    ),
    "sinks-d128": (dict(dtype="fp16", head_dim=128, sinks=True), "m_sink = gl.maximum("),
    "dv64-d128": (
        dict(dtype="bf16", head_dim=128, head_dim_v=64),
        "q4 = q_smem.index(CID)._reinterpret(",
    ),
    "dv256-d64": (
        dict(dtype="fp16", head_dim=64, head_dim_v=256),
        "q4 = q_smem.index(CID)._reinterpret(",
    ),
    "window-alibi-d64": (
        dict(
            dtype="bf16",
            head_dim=64,
            mask="sliding_window",
            window_left=100,
            window_right=20,
            alibi=True,
        ),
        "slope_log2 * gl.abs(",
    ),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_the_variants_build_the_gluon_kernel_without_the_switch(name, monkeypatch):
    fields, marker = VARIANTS[name]
    spec = make_spec(**fields)
    monkeypatch.delenv(VARIANTS_ENV, raising=False)
    assert gluon_gap(spec, "sm90", KernelKind.prefill) == ""
    source = _render(spec)
    assert "def _gluon_attn_fwd_kernel(" in source and marker in source
    assert derive_gluon_tiles(spec, "sm90").chosen is not None


def test_every_variant_the_kernel_implements_has_passed_its_gpu_tests():
    """The last to leave the set, the expressions forward and backward, passed
    tests/test_gluon_expressions_gpu.py whole on one tree (73 of 73, an H100)."""
    assert GLUON_UNVERIFIED == frozenset()


# score_mod / mask_mod in the Gluon forward (behind the switch): (spec fields, cross-compiled
# BLOCK_N at D 64 and 128: a relative bias table's [BM, BN] reads take the narrower blocks).
EXPRESSIONS = {
    "document": (dict(CASES["document"], mask="causal", causal_align="top_left"), 128),
    "relative_bias": (dict(CASES["relative_bias"], mask="causal", causal_align="top_left"), 64),
    "softcap": (dict(CASES["softcap"], mask="none"), 128),
    "prefix_lm": (dict(CASES["prefix_lm"], mask="none"), 128),
}


@pytest.mark.parametrize("name", sorted(EXPRESSIONS))
def test_expressions_build_the_gluon_kernel_without_the_switch(name, monkeypatch):
    fields, block_n = EXPRESSIONS[name]
    spec = make_spec(dtype="bf16", head_dim=128, **fields)
    monkeypatch.delenv(VARIANTS_ENV, raising=False)
    assert gluon_gap(spec, "sm90", KernelKind.prefill) == ""
    source = _render(spec)
    assert "def _gluon_listing(" in source and "def _gluon_every_block(" in source
    assert derive_gluon_tiles(spec, "sm90").chosen.config.block_n == block_n
    for kind, more in ((KernelKind.varlen, {}), (KernelKind.prefill, _WIN)):
        other = make_spec(dtype="bf16", head_dim=128, **dict(fields, **more))
        assert gluon_gap(other, "sm90", kind).startswith("score_mod/mask_mod with varlen")


def test_an_expression_module_serves_calls_under_the_interpreter(monkeypatch):
    """A document mask with a block mask: the tile-level kernel serves it here and says why."""
    monkeypatch.delenv(VARIANTS_ENV, raising=False)
    spec = make_spec(dtype="bf16", head_dim=64, **EXPRESSIONS["document"][0])
    module = load_kernel(spec)
    assert "def _gluon_listing(" in Path(module.__file__).read_text()
    q, k, v, _ = make_inputs(spec, 1, 130, 130, seed=5)
    tensors = case_tensors("document", 1, 130, 5)
    block_mask = exact_block_mask(mask_mod_values(spec, tensors, 1, 130, 130), 128, 128)
    out, lse = module.attention(q, k, v, return_lse=True, tensors=tensors, block_mask=block_mask)
    assert module.forward_path() == "tile-level: Triton's interpreter runs no Gluon kernel"
    assert not compare_to_reference(spec, out, lse, q, k, v, tensors=tensors)
    assert module._gluon_blocks_why((None,) * 4 + (256, 128)) is None  # whole CTAs and tiles
    every = module._gluon_every_block(q, k)[0]  # a call without a block mask: every block
    assert every[0].flatten().tolist() == [1, 2] and every[1].shape == (1, 1, 2, 2)
    again = module.attention(q, k, v, return_lse=True, tensors=tensors, block_mask=every)
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)
    why = "blocks of 64 x 128, not multiples of the CTA's 128 x 128"
    assert module._gluon_blocks_why((None,) * 4 + (64, 128)) == why
    assert module.forward_path() == "tile-level: " + why


@pytest.mark.slow
def test_expressions_compile_for_sm90_as_the_model_predicts(monkeypatch):
    """Shared memory exact, no spills (one kernel serves calls with and without a block mask:
    without one, the host lists every block)."""
    monkeypatch.delenv(VARIANTS_ENV, raising=False)
    specs = [make_spec(name=f"{n}{d}", dtype="bf16", head_dim=d, **fields)
             for n, (fields, _) in EXPRESSIONS.items() for d in (64, 128)]  # fmt: skip
    rows = verify_gluon(specs, processes=1)
    assert len(rows) == len(specs)
    for row in rows:
        assert not row.problems, row.line()


@pytest.mark.parametrize(
    "fields, gap",
    [
        (dict(dropout=True, backward=True), "dropout"),
        (dict(dtype="fp32", softcap=30.0), "fp32"),
    ],
)
def test_the_switch_builds_only_what_the_kernel_implements(fields, gap, monkeypatch):
    monkeypatch.setenv(VARIANTS_ENV, "1")
    assert gluon_gap(make_spec(**fields), "sm90", KernelKind.prefill).startswith(gap + ":")


def test_window_and_alibi_take_narrower_key_blocks(monkeypatch):
    """Their extra live tiles (extra_tiles): BLOCK_N 64 at D 64 and 128, no config at D 256."""
    monkeypatch.delenv(VARIANTS_ENV, raising=False)
    fields = dict(mask="sliding_window", window_left=100, window_right=20, alibi=True)
    for d, block_n in ((64, 64), (128, 64), (256, None)):
        chosen = derive_gluon_tiles(make_spec(dtype="bf16", head_dim=d, **fields), "sm90").chosen
        assert (chosen and chosen.config.block_n) == block_n


def test_modules_built_with_the_switch_are_cached_apart(monkeypatch):
    monkeypatch.delenv(VARIANTS_ENV, raising=False)
    plain = cache_folder("sm90")
    monkeypatch.setenv(VARIANTS_ENV, "1")
    assert cache_folder("sm90") == plain.with_name(plain.name + "_gluon-unverified")


@pytest.mark.slow
def test_every_variant_compiles_for_sm90_as_the_model_predicts(monkeypatch):
    """The Gluon kernel of each variant, cross-compiled for sm90 in a spawned worker: shared
    memory equal to the model's, no spills, the derived setmaxnreg values, wgmma (attngen
    verify-tiling --gluon's judgement)."""
    monkeypatch.delenv(VARIANTS_ENV, raising=False)
    specs = [make_spec(**fields) for fields, _ in VARIANTS.values()]
    rows = verify_gluon(specs, processes=1)
    assert len(rows) == len(VARIANTS)
    for row in rows:
        assert not row.problems, row.line()
        assert row.record["shared"] == row.chosen.smem_bytes


def test_a_variant_module_serves_calls_under_the_interpreter(monkeypatch):
    """Window, ALiBi, softcap and sinks together: the module imports and its tile-level kernel
    serves the call (Gluon does not run here), as forward_path() says."""
    monkeypatch.delenv(VARIANTS_ENV, raising=False)
    spec = make_spec(dtype="bf16", head_dim=64, mask="sliding_window", window_left=20,
                     window_right=5, alibi=True, softcap=20.0, sinks=True)  # fmt: skip
    module = load_kernel.__wrapped__(spec)
    assert "def _gluon_attn_fwd_kernel(" in Path(module.__file__).read_text()
    q, k, v, slopes = make_inputs(spec, 1, 70, 90, seed=42)
    sinks = torch.linspace(-1.0, 1.0, spec.num_q_heads)
    out, lse = module.attention(q, k, v, alibi_slopes=slopes, sinks=sinks, return_lse=True)
    assert module.forward_path() == "tile-level: Triton's interpreter runs no Gluon kernel"
    assert_matches_reference(spec, out, lse, q, k, v, slopes=slopes, sinks=sinks)


def test_softcap_tanh_is_branch_free_and_exact_where_it_must_be(monkeypatch):
    """No libdevice (its tanh branches per element); 16-bit prefill modules (the Gluon forward
    inline too) take 2 / (1 + exp(-2x)) - 1, fp32 and decode modules add the polynomial."""
    monkeypatch.delenv(VARIANTS_ENV, raising=False)
    exact = "x2 < 0.36"
    source = _render(make_spec(dtype="bf16", head_dim=128, softcap=30.0))
    assert "_gluon_attn_fwd_kernel" in source and "import libdevice" not in source
    assert "\ndef _tanh(x):" in source and exact not in source
    assert exact in _render(make_spec(dtype="fp32", head_dim=64, softcap=30.0), arch="sm80")
    decode = make_decode_spec("contiguous", None, dtype="bf16", head_dim=64, softcap=30.0)
    assert exact in _render(decode, KernelKind.decode)
