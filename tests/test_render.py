"""Rendering: golden files, the StrictUndefined context, the ast gate, determinism, headers.

The golden tests render the prefill template from hand-written flat contexts (the keys of
`build_context`, fixed values), so they change only when the templates change. After an
intended template change, regenerate them and review the diff:

    ATTNGEN_UPDATE_GOLDEN=1 python -m pytest tests/test_render.py -k golden
"""

from __future__ import annotations

import ast
import difflib
import json
import os
import re
from pathlib import Path

import jinja2
import pytest

from attngen import __version__, host, render
from attngen.arch import ARCHS
from attngen.host import template_hash
from attngen.render import (
    _GLUON_INTS,
    ENTRY_POINTS,
    RenderError,
    build_context,
    check_module_source,
    expression_context,
    host_code,
    render_module,
    render_template,
)
from attngen.spec import AttnSpec, KernelKind, load_spec_file, module_name, specs_from_data
from attngen.tiling.prefill import derive_tiles

ROOT = Path(__file__).resolve().parent.parent
GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
UPDATE = os.environ.get("ATTNGEN_UPDATE_GOLDEN") == "1"
PREFILL = KernelKind.prefill
TEMPLATE = "prefill.py.jinja"

_SMEM_PRE_HOPPER = (
    "shared memory = BLOCK_M*BLOCK_N*E + BLOCK_M*D*E + BLOCK_N*E*(D + DV)*Max(1, S - 1)"
)
_REGS = "registers/thread ~ 40 + (BLOCK_M*BLOCK_N + BLOCK_M*D*E/4 + BLOCK_M*DV)/(32*W)"


def _spec_from_lines(lines: list[str]) -> dict:
    from attngen.spec import parse_yaml

    data = parse_yaml("\n".join(lines))
    return {k: v for k, v in data.items() if v is not None}


# A spec without score_mod / mask_mod (render.expression_context's keys).
NO_EXPRESSIONS = {
    "score_mod": "",
    "mask_mod": "",
    "gluon_score_mod": "",
    "gluon_mask_mod": "",
    "expr_pointers": [],
    "expr_ints": [],
    "expr_strides": [],
    "expr_declared": "()",
    "expr_tanh": False,
}

# Causal, bottom-right aligned, bf16, D = DV = 128, on sm90.
CAUSAL_BR_BF16_D128 = {
    "attngen_version": "0.1.0",
    "template_name": "prefill.py.jinja",
    "template_hash": "0123456789abcdef",
    "module_name": "golden_causal_prefill_bf16_d128_causal_br",
    "spec_hash": "fedcba9876543210",
    "spec_lines": [
        "name: golden_causal",
        "archs: [sm90]",
        "dtype: bf16",
        "head_dim: 128",
        "head_dim_v: 128",
        "num_q_heads: 32",
        "num_kv_heads: 8",
        "mask: causal",
        "causal_align: bottom_right",
        "window_left: null",
        "window_right: null",
        "softcap: 0.0",
        "alibi: false",
        "kernels: [prefill]",
    ],
    "arch": "sm90",
    "block_m": 128,
    "block_n": 128,
    "num_warps": 8,
    "num_stages": 3,
    "shorter_configs": [],
    "config_source": "heuristic",
    "derivation_lines": [
        "shared memory = BLOCK_M*D*E + BLOCK_N*E*(D + DV)*Max(1, S - 1)",
        "  = 163840 B of 232448 B per block",
        _REGS,
        "  = 200 of 255",
        "programs/SM 1, score 1.000, 60 of 72 candidates feasible",
        "binding: none (the largest tile in the grid fits)",
    ],
    "dtype": "bf16",
    "dtype_name": "bfloat16",
    "head_dim": 128,
    "head_dim_v": 128,
    "block_d": 128,
    "block_dv": 128,
    "mask": "causal",
    "causal_align": "bottom_right",
    "bottom_right": True,
    "window_left": 0,
    "window_right": 0,
    "softcap": 0.0,
    "alibi": False,
    "sinks": False,
    "chunk_size": 0,
    "sink_tokens": 0,
    "varlen": False,
    "host_code": host_code(PREFILL, tma=True, gluon=True, call_plans=True),
    "backward": False,
    "dropout": False,
    "tma": True,
    "tma_masked_blocks": True,
    "lpt_group_heads": 0,
    "pointer_loads_up_to": 512,
    "call_plans": True,
    **NO_EXPRESSIONS,
    # The warp-specialized forward (attngen/tiling/gluon.py's choice for D 128).
    "gluon": True,
    "gluon_gap": "",
    "gluon_consumers": 2,
    "gluon_block_m": 64,
    "gluon_block_n": 128,
    "gluon_stages": 2,
    "gluon_consumer_regs": 240,
    "gluon_producer_regs": 24,
    "gluon_maxnreg": 168,
    "gluon_bwd": False,  # the Gluon dK/dV backward: a backward spec built with the switch
}

# Sliding window (top-left), softcap 30, ALiBi, fp32, D = DV = 80 padded to 128, on sm80.
WINDOW_SOFTCAP_ALIBI_FP32_D80 = {
    "attngen_version": "0.1.0",
    "template_name": "prefill.py.jinja",
    "template_hash": "0123456789abcdef",
    "module_name": "golden_window_prefill_fp32_d80_win255x16_tl_cap30_alibi",
    "spec_hash": "0a1b2c3d4e5f6071",
    "spec_lines": [
        "name: golden_window",
        "archs: [sm80]",
        "dtype: fp32",
        "head_dim: 80",
        "head_dim_v: 80",
        "num_q_heads: 8",
        "num_kv_heads: 2",
        "mask: sliding_window",
        "causal_align: top_left",
        "window_left: 255",
        "window_right: 16",
        "softcap: 30.0",
        "alibi: true",
        "kernels: [prefill]",
    ],
    "arch": "sm80",
    "block_m": 128,
    "block_n": 64,
    "num_warps": 8,
    "num_stages": 2,
    "shorter_configs": [],
    "config_source": "heuristic",
    "derivation_lines": [
        _SMEM_PRE_HOPPER,
        "  = 163840 B of 166912 B per block",
        _REGS,
        "  = 200 of 255",
        "programs/SM 1, score 0.600, 35 of 72 candidates feasible",
        "binding: regs, smem (larger tiles rejected)",
    ],
    "dtype": "fp32",
    "dtype_name": "float32",
    "head_dim": 80,
    "head_dim_v": 80,
    "block_d": 128,
    "block_dv": 128,
    "mask": "sliding_window",
    "causal_align": "top_left",
    "bottom_right": False,
    "window_left": 255,
    "window_right": 16,
    "softcap": 30.0,
    "alibi": True,
    "sinks": False,
    "chunk_size": 0,
    "sink_tokens": 0,
    "varlen": False,
    "host_code": host_code(PREFILL, call_plans=True),
    "backward": False,
    "dropout": False,
    "tma": False,
    "tma_masked_blocks": False,
    "lpt_group_heads": 0,
    "pointer_loads_up_to": 512,
    "call_plans": True,
    **NO_EXPRESSIONS,
    "gluon": False,
    "gluon_gap": "sm80 has no warp-specialized kernel (wgmma, TMA and setmaxnreg are sm90's)",
    "gluon_consumers": 0,
    "gluon_block_m": 0,
    "gluon_block_n": 0,
    "gluon_stages": 0,
    "gluon_consumer_regs": 0,
    "gluon_producer_regs": 0,
    "gluon_maxnreg": 0,
    "gluon_bwd": False,
}

# The same causal bf16 kernel as varlen: packed sequences, cu_seqlens, LSE [HQ, total_q].
CAUSAL_BR_BF16_D128_VARLEN = {
    **CAUSAL_BR_BF16_D128,
    "module_name": "golden_causal_varlen_bf16_d128_causal_br",
    "spec_lines": [*CAUSAL_BR_BF16_D128["spec_lines"][:-1], "kernels: [varlen]"],
    "varlen": True,
    "host_code": host_code(KernelKind.varlen, call_plans=True),
    "tma": False,
    "tma_masked_blocks": False,
    "lpt_group_heads": 0,
    "pointer_loads_up_to": 512,
    "call_plans": True,
    "gluon": False,
    "gluon_gap": "varlen: packed sequences need per-sequence descriptors (not written yet)",
}

# The causal bf16 kernel with a document mask and a relative bias table as expressions
# (their kernel text from render.expression_context; tile-level forward, no call plans).
EXPRESSION_FIELDS = [
    "mask_mod: (doc[b, q_idx] == doc[b, kv_idx])",
    "score_mod: (score + bias[h, ((q_idx - kv_idx) + 8)])",
    "tensors: [{name: doc, dtype: int32, shape: [B, N]},"
    " {name: bias, dtype: bf16, shape: [H, 17]}]",
]
CAUSAL_BR_BF16_D128_EXPRESSIONS = {
    **CAUSAL_BR_BF16_D128,
    "module_name": "golden_causal_prefill_bf16_d128_causal_br_sm6fdba56b_mm6d5921dd",
    "spec_lines": [*CAUSAL_BR_BF16_D128["spec_lines"], *EXPRESSION_FIELDS],
    "host_code": host_code(PREFILL, expressions=True, tma=True),
    "call_plans": False,
    "gluon": False,
    "gluon_gap": "score_mod/mask_mod: not in the warp-specialized kernel yet",  # a fixed gap
    **dict.fromkeys(_GLUON_INTS, 0),
    **expression_context(
        specs_from_data(_spec_from_lines(CAUSAL_BR_BF16_D128["spec_lines"] + EXPRESSION_FIELDS))[0]
    ),
}

GOLDEN = {
    "prefill_causal_br_bf16_d128_expressions": CAUSAL_BR_BF16_D128_EXPRESSIONS,
    "varlen_causal_br_bf16_d128": CAUSAL_BR_BF16_D128_VARLEN,
    "prefill_causal_br_bf16_d128": CAUSAL_BR_BF16_D128,
    "prefill_window_softcap_alibi_fp32_d80": WINDOW_SOFTCAP_ALIBI_FP32_D80,
}


def _spec(**fields) -> AttnSpec:
    base = dict(
        name="t",
        archs=["sm80", "sm90"],
        dtype="bf16",
        head_dim=128,
        num_q_heads=8,
        num_kv_heads=8,
        mask="causal",
        causal_align="bottom_right",
        kernels=["prefill"],
    )
    base.update(fields)
    return specs_from_data({k: v for k, v in base.items() if v is not None})[0]


# Specs that together reach every branch of the template.
VARIETY = {
    "causal_br": _spec(),
    "causal_tl_fp16_d64": _spec(causal_align="top_left", dtype="fp16", head_dim=64),
    "none_fp32_dv": _spec(mask="none", causal_align=None, dtype="fp32", head_dim=80, head_dim_v=48),
    "window_cap_alibi": _spec(
        mask="sliding_window",
        window_left=100,
        window_right=3,
        softcap=12.5,
        alibi=True,
        head_dim=96,
    ),
}


def _render(spec: AttnSpec, arch: str = "sm80") -> str:
    return render_module(spec, PREFILL, derive_tiles(spec, arch))


def _header(source: str) -> str:
    return source.split('"""', 1)[0]


# --------------------------------------------------------------------------------- golden


def test_golden_contexts_mirror_build_context() -> None:
    spec = VARIETY["window_cap_alibi"]
    real = build_context(spec, PREFILL, derive_tiles(spec, "sm80"))
    for name, context in GOLDEN.items():
        assert set(context) == set(real), f"{name}: update the hand-written context"
        for key, value in real.items():
            assert type(context[key]) is type(value), f"{name}.{key}"
        if not UPDATE:
            kind = KernelKind.varlen if context["varlen"] else PREFILL
            assert context["module_name"] == module_name(
                specs_from_data(_spec_from_lines(context["spec_lines"]))[0], kind
            )


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_render(name: str) -> None:
    source = render_template(TEMPLATE, GOLDEN[name])
    path = GOLDEN_DIR / f"{name}.py"
    if UPDATE:
        GOLDEN_DIR.mkdir(exist_ok=True)
        path.write_bytes(source.encode("utf-8"))
    assert path.is_file(), f"{path} missing; run with ATTNGEN_UPDATE_GOLDEN=1 to create it"
    expected = path.read_bytes()
    if source.encode("utf-8") != expected:
        diff = "".join(
            difflib.unified_diff(
                expected.decode("utf-8").splitlines(keepends=True),
                source.splitlines(keepends=True),
                str(path),
                "rendered",
                n=1,
            )
        )
        pytest.fail(
            f"render differs from {path} (if intended, regenerate with "
            f"ATTNGEN_UPDATE_GOLDEN=1):\n{diff[:4000]}"
        )


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_files_pass_the_gate(name: str) -> None:
    source = (GOLDEN_DIR / f"{name}.py").read_text(encoding="utf-8")
    entry = "attention_varlen" if GOLDEN[name]["varlen"] else "attention"
    check_module_source(source, GOLDEN[name]["module_name"], entry)
    assert source.endswith("\n") and not source.endswith("\n\n")
    header = _header(source)
    context = GOLDEN[name]
    for key in ("spec_hash", "template_hash", "arch"):
        assert context[key] in header
    assert f"BLOCK_M={context['block_m']}, BLOCK_N={context['block_n']}" in header


def test_golden_branches_differ() -> None:
    causal = (GOLDEN_DIR / "prefill_causal_br_bf16_d128.py").read_text(encoding="utf-8")
    window = (GOLDEN_DIR / "prefill_window_softcap_alibi_fp32_d80.py").read_text(encoding="utf-8")
    assert "def _tanh(x):" in window and "_tanh" not in causal
    assert "_WINDOW_LEFT = tl.constexpr(255)" in window and "_WINDOW_LEFT" not in causal
    assert 'input_precision="ieee"' in window and "input_precision" not in causal
    assert "(offs_d < _HEAD_DIM)" in window and "(offs_d < _HEAD_DIM)" not in causal
    assert (
        "slope_log2 = tl.load(Slopes + off_b.to(tl.int64) * stride_slopes_b + off_h)" in window
        and "tl.load(Slopes" not in causal
    )
    assert "diagonal = seqlen_k - seqlen_q" in causal and "diagonal = 0" in window


@pytest.mark.parametrize("key", sorted(WINDOW_SOFTCAP_ALIBI_FP32_D80))
def test_missing_context_key_is_an_error(key: str) -> None:
    failures = 0
    for context in GOLDEN.values():
        partial = {k: v for k, v in context.items() if k != key}
        try:
            render_template(TEMPLATE, partial)
        except jinja2.UndefinedError as exc:
            assert key in str(exc)
            failures += 1
    assert failures >= 1, f"no golden context needs {key!r}: is it still used?"


def test_strict_undefined_in_loops_and_attributes() -> None:
    context = dict(CAUSAL_BR_BF16_D128)
    del context["block_m"]
    with pytest.raises(jinja2.UndefinedError, match="block_m"):
        render_template(TEMPLATE, context)
    context = dict(CAUSAL_BR_BF16_D128)
    del context["derivation_lines"]  # only iterated over
    with pytest.raises(jinja2.UndefinedError, match="derivation_lines"):
        render_template(TEMPLATE, context)


# ------------------------------------------------------------------------------- ast gate


def _golden_source() -> tuple[str, str]:
    context = CAUSAL_BR_BF16_D128
    return render_template(TEMPLATE, context), context["module_name"]


def _after_imports(source: str, line: str) -> str:
    assert "\nimport os\n" in source
    return source.replace("\nimport os\n", f"\nimport os\n{line}\n", 1)


@pytest.mark.parametrize(
    ("mutation", "match"),
    [
        (lambda s: _after_imports(s, "import os.path"), "imports 'os.path'"),
        (lambda s: _after_imports(s, "import subprocess"), "imports 'subprocess'"),
        (lambda s: _after_imports(s, "from subprocess import run"), "imports 'subprocess'"),
        (lambda s: _after_imports(s, "import sys, json"), "imports 'sys'"),
        (lambda s: _after_imports(s, "import attngen"), "imports 'attngen'"),
        (
            lambda s: _after_imports(s, "from attngen.spec import AttnSpec"),
            "imports 'attngen.spec'",
        ),
        (lambda s: _after_imports(s, "from attngen import render"), "imports 'attngen'"),
        (lambda s: _after_imports(s, "from . import sibling"), "imports ''"),
        (lambda s: _after_imports(s, "import importlib"), "imports 'importlib'"),
        (lambda s: _after_imports(s, "from os import path"), "imports 'os'"),
        (
            lambda s: s + "\n\ndef _helper():\n    import subprocess\n    return subprocess\n",
            "imports 'subprocess'",
        ),
        # the gate walks statements only: every kind of nested body is one
        (lambda s: s + "\n\nclass _C:\n    def m(self):\n        import socket\n", "'socket'"),
        (lambda s: s + "\n\ntry:\n    pass\nexcept Exception:\n    import shutil\n", "'shutil'"),
        (
            lambda s: (
                s + "\n\nwhile False:\n    pass\nelse:\n    with open(0):\n        import ctypes\n"
            ),
            "'ctypes'",
        ),
        (lambda s: s + "\n\nmatch 0:\n    case 1:\n        from os import system\n", "'os'"),
        (
            lambda s: (
                s
                + "\n\nasync def _f():\n    try:\n        pass\n    finally:\n        import bz2\n"
            ),
            "'bz2'",
        ),
        (lambda s: s.replace("def attention(", "def attend("), "defines no attention"),
        (lambda s: s.replace("def attention(", "def _attention("), "defines no attention"),
        (lambda s: s + "\ndef (:\n", "does not parse"),
    ],
)
def test_gate_rejects(mutation, match: str) -> None:
    source, name = _golden_source()
    check_module_source(source, name)  # the unmodified module passes
    bad = mutation(source)
    assert bad != source
    with pytest.raises(RenderError, match=match) as info:
        check_module_source(bad, name)
    assert name in str(info.value)


def test_gate_accepts_every_rendered_module() -> None:
    for spec in VARIETY.values():
        for arch in spec.archs:
            check_module_source(_render(spec, arch), module_name(spec, PREFILL))
    generated = json.loads((ROOT / "generated" / "index.json").read_text())["modules"]
    assert {entry["kind"] for entry in generated} == {"prefill", "varlen", "decode"}
    for entry in generated:
        source = (ROOT / "generated" / entry["path"]).read_text(encoding="utf-8")
        check_module_source(source, entry["module"], ENTRY_POINTS[KernelKind(entry["kind"])])
    first = (ROOT / "generated" / generated[0]["path"]).read_text(encoding="utf-8")
    with pytest.raises(RenderError, match="defines no decode"):
        check_module_source(
            first.replace("def decode(", "def other(").replace("def attention(", "def other("),
            "m",
            "decode",
        )


def test_render_module_runs_the_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    monkeypatch.setattr(
        render, "check_module_source", lambda source, name, entry: seen.append((name, entry))
    )
    spec = VARIETY["causal_br"]
    _render(spec)
    assert seen == [(module_name(spec, PREFILL), "attention")]


# ------------------------------------------------------------------- determinism, headers


@pytest.mark.parametrize("label", sorted(VARIETY))
def test_render_is_deterministic(label: str) -> None:
    spec = VARIETY[label]
    first = _render(spec, "sm80")
    clear = getattr(derive_tiles, "cache_clear", None)
    if clear is not None:
        clear()
    assert _render(spec, "sm80") == first
    assert build_context(spec, PREFILL, derive_tiles(spec, "sm80")) == build_context(
        spec, PREFILL, derive_tiles(spec, "sm80")
    )


@pytest.mark.parametrize("arch", ["sm80", "sm86", "sm90"])
def test_header_records_provenance(arch: str) -> None:
    spec = load_spec_file(ROOT / "examples" / "llama3_8b.yaml")[0]
    derivation = derive_tiles(spec, arch)
    config, chosen = derivation.chosen, derivation.chosen_candidate
    source = _render(spec, arch)
    header = _header(source)
    assert header.startswith(
        f"# Generated by attngen {__version__} from template {TEMPLATE} "
        f"({template_hash(TEMPLATE)})."
    )
    assert f"# Spec (hash {spec.spec_hash()}):" in header
    for line in build_context(spec, PREFILL, derivation)["spec_lines"]:
        assert f"\n#   {line}\n" in header, line
    assert len(build_context(spec, PREFILL, derivation)["spec_lines"]) == len(spec.canonical())
    assert "#   head_dim_v: 128" in header and "#   archs: [sm80, sm86, sm89, sm90]" in header
    assert (
        f"# Target {arch}: BLOCK_M={config.block_m}, BLOCK_N={config.block_n}, "
        f"num_warps={config.num_warps}, num_stages={config.num_stages}.\n"
        f"# Config source: {derivation.source}."
    ) in header
    # The derivation lines wrap at 92 columns; compare them unwrapped.
    unwrapped = re.sub(r"\n#\s+", " ", header)
    assert f" shared memory = {derivation.worked['smem']} with " in unwrapped
    assert (
        f"#     = {chosen.smem_bytes} B of {ARCHS[arch].smem_budget} B available per block\n"
        in header
    )
    assert f"#   binding: {derivation.binding[:40]}" in header
    # The CONFIG the launcher uses is the one the header states.
    tree = ast.parse(source)
    configs = [
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(getattr(t, "id", None) == "CONFIG" for t in node.targets)
    ]
    assert len(configs) == 1 and ast.literal_eval(configs[0]) == config.as_dict()


def test_template_hash_covers_partials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = template_hash.__wrapped__(TEMPLATE)
    assert original == template_hash(TEMPLATE)
    sources = dict(host.template_sources())
    monkeypatch.setattr(host, "template_sources", lambda: sources)
    assert template_hash.__wrapped__(TEMPLATE) == original
    sources["_scores.py.jinja"] += b"{# changed #}\n"
    assert template_hash.__wrapped__(TEMPLATE) != original


# ---------------------------------------------------------------------------- no user text


def _printable_ascii(text: str) -> bool:
    return all(ch == "\n" or " " <= ch <= "~" for ch in text)


@pytest.mark.parametrize("label", sorted(VARIETY))
def test_module_text_is_printable_ascii(label: str) -> None:
    source = _render(VARIETY[label])
    bad = sorted({ch for ch in source if not (ch == "\n" or " " <= ch <= "~")})
    assert not bad, f"characters outside printable ASCII: {bad!r}"
    assert "\r" not in source and "\t" not in source


def test_generated_modules_are_printable_ascii() -> None:
    for path in sorted((ROOT / "generated").glob("*/*.py")):
        assert _printable_ascii(path.read_text(encoding="utf-8")), path


def _blank_line_problems(source: str) -> list[str]:
    """PEP 8's blank lines (ruff's E3 rules) in a module: two around a top-level function,
    never more than two in a row, never two in a row inside a block."""
    lines = source.splitlines()

    def blanks_before(number: int) -> int:  # 1-based line number
        count = 0
        while number - count - 2 >= 0 and not lines[number - count - 2].strip():
            count += 1
        return count

    problems = []
    for number, line in enumerate(lines, 1):
        limit = 1 if line.startswith(" ") else 2  # inside a block, or at the top level
        if line.strip() and blanks_before(number) > limit:
            problems.append(f"line {number}: {blanks_before(number)} blank lines before it")

    def first_line(node: ast.stmt) -> int:  # with its decorators and the comments above it
        number = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
        while number > 1 and lines[number - 2].startswith("#"):
            number -= 1
        return number

    body = ast.parse(source).body
    for node, following in zip(body, [*body[1:], None], strict=True):
        if isinstance(node, ast.FunctionDef):
            first = first_line(node)
            if first > 1 and blanks_before(first) != 2:
                problems.append(f"line {first}: {blanks_before(first)} blank lines before a def")
            if following is not None and blanks_before(first_line(following)) < 2:
                problems.append(f"line {first_line(following)}: < 2 blank lines after a def")
    return problems


def test_generated_modules_have_pep8_blank_lines() -> None:
    for path in sorted((ROOT / "generated").glob("*/*.py")):
        assert not _blank_line_problems(path.read_text(encoding="utf-8")), path


@pytest.mark.parametrize("label", sorted(VARIETY))
def test_rendered_modules_have_pep8_blank_lines(label: str) -> None:
    assert not _blank_line_problems(_render(VARIETY[label]))


def test_only_validated_name_and_hash_vary_with_the_name() -> None:
    """Two specs that differ only in their (validated) name differ only where it is printed."""
    a = _spec(name="first_model", mask="sliding_window", window_left=7, softcap=2.5, alibi=True)
    b = _spec(name="zz_other9", mask="sliding_window", window_left=7, softcap=2.5, alibi=True)
    lines_a, lines_b = _render(a).splitlines(), _render(b).splitlines()
    assert len(lines_a) == len(lines_b)
    differing = [(x, y) for x, y in zip(lines_a, lines_b, strict=True) if x != y]
    assert differing
    for x, y in differing:
        assert a.name in x or a.spec_hash() in x, x
        assert b.name in y or b.spec_hash() in y, y
    # the name appears only in comments and the docstring, never as code
    code_names = {node.id for node in ast.walk(ast.parse(_render(a))) if isinstance(node, ast.Name)}
    assert not any(a.name in name for name in code_names)
    literals = [
        node.value
        for node in ast.walk(ast.parse(_render(a)))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]
    assert sum(a.name in lit for lit in literals) == 1  # the module docstring
