"""The spec: example files load, names and hashes are stable, and every mistake is one line.

A bad spec must fail with a `SpecError` whose message is a single line naming the file, the
field, the value given and what is allowed; the table `BAD_SPECS` lists the mistakes.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from attngen.spec import (
    DECODE_FIELDS,
    EXPRESSION_FIELDS,
    MAX_SPEC_BYTES,
    MODEL_FIELDS,
    TRAINING_FIELDS,
    AttnSpec,
    KernelKind,
    SpecError,
    load_spec_file,
    module_name,
    specs_from_data,
)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
PREFILL = KernelKind.prefill
DECODE = KernelKind.decode

# A valid spec; `_with` replaces (or appends, or with None drops) one top-level line of it.
BASE = """\
name: t
archs: [sm80]
dtype: bf16
head_dim: 128
num_q_heads: 8
num_kv_heads: 8
mask: causal
causal_align: bottom_right
kernels: [prefill]
"""
SLIDING = BASE.replace("mask: causal", "mask: sliding_window") + "window_left: 16\n"
ALLOWED_HEAD_DIM = "an int in 1..256"
ALLOWED_SOFTCAP = "a number in 0..10000"
ALLOWED_NAME = "a lower-case identifier [a-z][a-z0-9_]*, at most 48 characters"
ALL_ARCHS = "sm80, sm86, sm89, sm90"


def _with(key: str, raw: str | None, text: str = BASE) -> str:
    lines, found = [], False
    for line in text.splitlines():
        if line.startswith(f"{key}:"):
            found = True
            if raw is not None:
                lines.append(f"{key}: {raw}")
        else:
            lines.append(line)
    if not found and raw is not None:
        lines.append(f"{key}: {raw}")
    return "\n".join(lines) + "\n"


def _variants(body: str) -> str:
    return BASE + "variants:\n" + body


# (id, yaml text, substrings the one-line message must contain besides the file name)
BAD_SPECS = [
    ("unknown-key", BASE + "heads: 8\n", ["heads: unknown key", "allowed keys: name, archs"]),
    ("duplicate-key", BASE + "dtype: fp16\n", ["line 10", "duplicate key 'dtype'"]),
    # YAML 1.1 surprises stay strings, and strings are refused where numbers or bools belong
    ("yaml11-no", _with("alibi", "no"), ["alibi: got 'no' (str)", "allowed: true or false"]),
    ("yaml11-yes", _with("alibi", "yes"), ["alibi: got 'yes' (str)", "true or false"]),
    ("yaml11-on", _with("alibi", "on"), ["alibi: got 'on' (str)", "true or false"]),
    ("yaml11-octal", _with("head_dim", "010"), ["head_dim: got '010' (str)", ALLOWED_HEAD_DIM]),
    ("yaml11-exponent", _with("softcap", "1e3"), ["softcap: got '1e3' (str)", ALLOWED_SOFTCAP]),
    ("yaml11-sexagesimal", _with("head_dim", "12:30"), ["head_dim: got '12:30'", ALLOWED_HEAD_DIM]),
    ("yaml11-hex", _with("head_dim", "0x80"), ["head_dim: got '0x80' (str)", ALLOWED_HEAD_DIM]),
    ("yaml11-date", _with("head_dim", "2024-01-01"), ["head_dim: got '2024-01-01' (str)"]),
    ("yaml11-underscore", _with("head_dim", "1_28"), ["head_dim: got '1_28' (str)"]),
    # wrong types
    ("quoted-int", _with("head_dim", '"128"'), ["head_dim: got '128' (str)", ALLOWED_HEAD_DIM]),
    ("str-tag", _with("head_dim", "!!str 128"), ["head_dim: got '128' (str)"]),
    ("float-int", _with("head_dim", "128.0"), ["head_dim: got 128.0 (float)", ALLOWED_HEAD_DIM]),
    ("bool-float", _with("softcap", "true"), ["softcap: got True (bool)", ALLOWED_SOFTCAP]),
    ("bool-int", _with("num_q_heads", "true"), ["num_q_heads: got True (bool)", "1..1024"]),
    ("null-int", _with("head_dim", "null"), ["head_dim: got None", ALLOWED_HEAD_DIM]),
    ("archs-scalar", _with("archs", "sm90"), ["archs: got 'sm90' (str)", f"among {ALL_ARCHS}"]),
    ("window-float", _with("window_left", "1.5", SLIDING), ["window_left: got 1.5 (float)"]),
    # out of range
    ("head-dim-0", _with("head_dim", "0"), ["head_dim: got 0 (int)", ALLOWED_HEAD_DIM]),
    ("head-dim-264", _with("head_dim", "264"), ["head_dim: got 264 (int)", ALLOWED_HEAD_DIM]),
    (
        "head-dim-257",
        _with("head_dim", "257"),
        ["head_dim: got 257 (int)", ALLOWED_HEAD_DIM, "up to 576 with kernels: [decode] only"],
    ),
    ("head-dim-577", _with("head_dim", "577"), ["head_dim: got 577 (int)", ALLOWED_HEAD_DIM]),
    (
        "chunked-no-size",
        _with("mask", "chunked"),
        ["chunk_size: got None", "required with mask chunked"],
    ),
    (
        "chunk-size-causal",
        BASE + "chunk_size: 8\n",
        ["chunk_size: got 8", "absent unless mask is chunked"],
    ),
    (
        "chunk-size-0",
        _with("mask", "chunked") + "chunk_size: 0\n",
        ["chunk_size: got 0", "1..2147483647"],
    ),
    (
        "sink-tokens-causal",
        BASE + "sink_tokens: 4\n",
        ["sink_tokens: got 4", "absent unless mask is sliding_window"],
    ),
    ("sink-tokens-0", SLIDING + "sink_tokens: 0\n", ["sink_tokens: got 0", "1..2147483647"]),
    ("sinks-str", BASE + "sinks: yes\n", ["sinks: got 'yes' (str)", "true or false"]),
    ("head-dim-neg", _with("head_dim", "-128"), ["head_dim: got -128 (int)"]),
    ("head-dim-v-0", BASE + "head_dim_v: 0\n", ["head_dim_v: got 0 (int)", ALLOWED_HEAD_DIM]),
    ("q-heads-0", _with("num_q_heads", "0"), ["num_q_heads: got 0 (int)", "an int in 1..1024"]),
    ("q-heads-big", _with("num_q_heads", "2048"), ["num_q_heads: got 2048", "1..1024"]),
    ("window-neg", _with("window_left", "-1", SLIDING), ["window_left: got -1", "0..2147483647"]),
    ("window-right-neg", SLIDING + "window_right: -3\n", ["window_right: got -3", "0..2147483647"]),
    ("softcap-neg", _with("softcap", "-1"), ["softcap: got -1", ALLOWED_SOFTCAP]),
    ("softcap-huge", _with("softcap", "20000"), ["softcap: got 20000", ALLOWED_SOFTCAP]),
    ("softcap-nan", _with("softcap", ".nan"), ["softcap: got '.nan'", ALLOWED_SOFTCAP]),
    ("softcap-inf", _with("softcap", ".inf"), ["softcap: got '.inf'", ALLOWED_SOFTCAP]),
    ("softcap-neg-inf", _with("softcap", "-.inf"), ["softcap: got '-.inf'", ALLOWED_SOFTCAP]),
    # fields that contradict each other
    (
        "kv-not-divisor",
        _with("num_kv_heads", "3"),
        ["num_kv_heads: got 3", "a divisor of num_q_heads=8"],
    ),
    (
        "causal-no-align",
        _with("causal_align", None),
        ["causal_align: got None", "top_left or bottom_right", "mask causal"],
    ),
    (
        "window-no-align",
        _with("causal_align", None, SLIDING),
        ["causal_align: got None", "mask sliding_window"],
    ),
    (
        "none-with-align",
        _with("mask", "none"),
        ["causal_align: got 'bottom_right'", "absent with mask none"],
    ),
    (
        "causal-with-window",
        BASE + "window_left: 5\n",
        ["window_left: got 5", "absent unless sliding_window"],
    ),
    (
        "causal-with-window-right",
        BASE + "window_right: 0\n",
        ["window_right: got 0", "absent unless sliding_window"],
    ),
    (
        "window-no-left",
        _with("mask", "sliding_window"),
        ["window_left: got None", "required with sliding_window"],
    ),
    # archs, kernels, enums
    ("arch-unknown", _with("archs", "[sm75]"), ["archs: got 'sm75'", f"one of {ALL_ARCHS}"]),
    ("arch-case", _with("archs", "[SM80]"), ["archs.0: got 'SM80'", f"among {ALL_ARCHS}"]),
    (
        "arch-duplicate",
        _with("archs", "[sm80, sm90, sm80]"),
        ["archs: got 'sm80'", "each entry at most once"],
    ),
    ("arch-empty", _with("archs", "[]"), ["archs: got []", f"among {ALL_ARCHS}"]),
    (
        "kernel-unknown",
        _with("kernels", "[backward]"),
        ["kernels.0: got 'backward'", "'prefill', 'varlen' or 'decode'"],
    ),
    (
        "kernel-duplicate",
        _with("kernels", "[prefill, prefill]"),
        ["kernels: got 'prefill'", "at most once"],
    ),
    (
        "kernels-empty",
        _with("kernels", "[]"),
        ["kernels: got []", "a list among prefill, varlen, decode"],
    ),
    # decode fields
    (
        "decode-no-layout",
        _with("kernels", "[prefill, decode]"),
        ["kv_layout: got None", "contiguous or paged (required with decode)"],
    ),
    (
        "layout-without-decode",
        BASE + "kv_layout: paged\n",
        ["kv_layout: got 'paged'", "absent unless kernels includes decode"],
    ),
    (
        "tokens-without-decode",
        BASE + "max_query_tokens: 2\n",
        ["max_query_tokens: got 2", "absent unless kernels includes decode"],
    ),
    (
        "layout-unknown",
        _with("kernels", "[decode]") + "kv_layout: ragged\n",
        ["kv_layout: got 'ragged'", "'contiguous' or 'paged'"],
    ),
    (
        "paged-no-page-size",
        _with("kernels", "[decode]") + "kv_layout: paged\n",
        ["page_size: got None", "a power of two in 1..1024 (required with kv_layout paged)"],
    ),
    (
        "page-size-not-pow2",
        _with("kernels", "[decode]") + "kv_layout: paged\npage_size: 48\n",
        ["page_size: got 48", "a power of two in 1..1024"],
    ),
    (
        "page-size-big",
        _with("kernels", "[decode]") + "kv_layout: paged\npage_size: 2048\n",
        ["page_size: got 2048 (int)", "a power of two in 1..1024"],
    ),
    (
        "page-size-contiguous",
        _with("kernels", "[decode]") + "kv_layout: contiguous\npage_size: 16\n",
        ["page_size: got 16", "absent unless kv_layout is paged"],
    ),
    (
        "tokens-zero",
        _with("kernels", "[decode]") + "kv_layout: contiguous\nmax_query_tokens: 0\n",
        ["max_query_tokens: got 0 (int)", "an int in 1..16"],
    ),
    (
        "tokens-17",
        _with("kernels", "[decode]") + "kv_layout: contiguous\nmax_query_tokens: 17\n",
        ["max_query_tokens: got 17 (int)", "an int in 1..16"],
    ),
    (
        "decode-top-left",
        _with("causal_align", "top_left", _with("kernels", "[decode]")) + "kv_layout: contiguous\n",
        ["causal_align: got 'top_left'", "bottom_right with decode"],
    ),
    ("dtype-unknown", _with("dtype", "fp8"), ["dtype: got 'fp8'", "'fp16', 'bf16' or 'fp32'"]),
    ("mask-unknown", _with("mask", "diagonal"), ["mask: got 'diagonal'", "'sliding_window'"]),
    ("missing-field", _with("head_dim", None), ["head_dim: missing; required"]),
    # names
    ("name-upper", _with("name", "Llama"), ["name: got 'Llama' (str)", ALLOWED_NAME]),
    ("name-digit", _with("name", "3llama"), ["name: got '3llama'", ALLOWED_NAME]),
    ("name-dash", _with("name", "llama-3"), ["name: got 'llama-3'", ALLOWED_NAME]),
    ("name-slash", _with("name", "a/b"), ["name: got 'a/b'", ALLOWED_NAME]),
    ("name-dotdot", _with("name", '".."'), ["name: got '..'", ALLOWED_NAME]),
    ("name-traversal", _with("name", "../x"), ["name: got '../x'", ALLOWED_NAME]),
    ("name-too-long", _with("name", "a" * 49), ["name: got 'aaaa", ALLOWED_NAME]),
    ("name-unicode", _with("name", "llamá"), ["name: got 'llamá'", ALLOWED_NAME]),
    ("name-newline", _with("name", '"abc\\n"'), ["name: got 'abc\\n'", ALLOWED_NAME]),
    ("name-int", _with("name", "5"), ["name: got 5 (int)", ALLOWED_NAME]),
    # YAML structure
    ("anchor", _with("archs", "&targets [sm80]"), ["line 2", "YAML anchors are not allowed"]),
    (
        "anchor-and-alias",
        _with("archs", "&t [sm80]") + "other: *t\n",
        ["YAML anchors are not allowed"],
    ),
    ("alias", _with("archs", "*t"), ["line 2", "YAML aliases are not allowed"]),
    ("merge-key", BASE + "<<: {alibi: true}\n", ["<<"]),
    (
        "python-tag",
        _with("head_dim", "!!python/object/apply:os.system [echo]"),
        ["line 4", "not valid YAML", "could not determine a constructor"],
    ),
    ("non-str-key", BASE + "1: 2\n", ["line 10", "key 1 is not a name"]),
    ("tab-indent", BASE + "\tfoo: 1\n", ["line 10", "not valid YAML"]),
    ("two-documents", BASE + "---\nname: u\n", ["not valid YAML", "single document"]),
    ("list-document", "- name: t\n- name: u\n", ["must be a mapping of spec fields, got list"]),
    ("scalar-document", "just some text\n", ["must be a mapping of spec fields, got str"]),
    ("empty-document", "", ["must be a mapping of spec fields, got NoneType"]),
    ("nested-deeply", "a: " + "[" * 3000 + "]" * 3000 + "\n", ["nested too deeply"]),
    # variants
    (
        "variant-name-key",
        _variants("  local:\n    name: other\n"),
        ["variants.local.name: not allowed", "the variant's key names it"],
    ),
    (
        "variant-bad-name",
        _variants("  Local-1:\n    alibi: true\n"),
        ["variants: got name 'Local-1'", "[a-z][a-z0-9_]*, at most 24 characters"],
    ),
    (
        "variant-long-name",
        _variants(f"  {'v' * 25}:\n    alibi: true\n"),
        ["variants: got name 'vvvv", "at most 24 characters"],
    ),
    (
        "variants-list",
        BASE + "variants: [local, global]\n",
        ["variants: got ['local', 'global']", "a non-empty mapping name -> fields"],
    ),
    ("variants-empty", BASE + "variants: {}\n", ["variants: got {}", "a non-empty mapping"]),
    ("variant-scalar", _variants("  local: 3\n"), ["variants.local: got 3", "a mapping of fields"]),
    (
        "variant-bad-field",
        _variants("  local:\n    head_dim: 300\n"),
        ["variants.local.head_dim: got 300 (int)", ALLOWED_HEAD_DIM],
    ),
    (
        "variant-unknown-key",
        _variants("  local:\n    heads: 8\n"),
        ["variants.local.heads: unknown key"],
    ),
    (
        "variant-inconsistent",
        _variants("  local:\n    mask: sliding_window\n"),
        ["variants.local.window_left: got None", "required with sliding_window"],
    ),
    (
        "variant-no-model-name",
        _with("name", None, _variants("  local:\n    alibi: true\n")),
        ["variants.local.name: missing; required"],
    ),
    (
        "variant-name-too-long",
        _with("name", "m" * 45, _variants("  local:\n    alibi: true\n")),
        ["variants.local.name: got 'mmmm", ALLOWED_NAME],
    ),
]


def _load_error(path: Path) -> str:
    with pytest.raises(SpecError) as info:
        load_spec_file(path)
    message = str(info.value)
    assert "\n" not in message and "\r" not in message, f"not one line: {message!r}"
    assert message.startswith(f"{path}: "), f"does not name the file first: {message!r}"
    return message


def _one_line(tmp_path: Path, text: str | bytes, name: str = "bad_spec.yaml") -> str:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return _load_error(path)


# ------------------------------------------------------------------------------- examples


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_loads(path: Path) -> None:
    specs = load_spec_file(path)
    assert specs and all(isinstance(s, AttnSpec) for s in specs)
    for spec in specs:
        assert spec.name.startswith(path.stem)
        # every example has prefill (but MLA's absorbed form, a decode-only shape); the models
        # a runtime serves batched have varlen too
        first = DECODE if spec.name == "deepseek_v3_absorbed" else PREFILL
        assert spec.kernels[0] is first and set(spec.kernels) <= set(KernelKind)
        assert (DECODE in spec.kernels) == (spec.kv_layout is not None)


def test_at_least_three_examples_have_decode() -> None:
    specs = [spec for path in EXAMPLES for spec in load_spec_file(path)]
    layouts = {spec.kv_layout.value for spec in specs if DECODE in spec.kernels}
    assert sum(DECODE in spec.kernels for spec in specs) >= 3
    assert layouts == {"contiguous", "paged"}


def test_examples_are_all_found() -> None:
    assert len(EXAMPLES) >= 8
    assert {"llama3_8b", "gemma2_9b", "mistral_7b"} <= {p.stem for p in EXAMPLES}


def test_gemma2_gives_local_and_global() -> None:
    local, global_ = load_spec_file(ROOT / "examples" / "gemma2_9b.yaml")
    assert (local.name, global_.name) == ("gemma2_9b_local", "gemma2_9b_global")
    for spec in (local, global_):  # the common fields reach both variants
        assert (spec.dtype.value, spec.head_dim, spec.num_q_heads, spec.num_kv_heads) == (
            "bf16",
            256,
            16,
            8,
        )
        assert spec.softcap == 50.0 and spec.archs == ("sm80", "sm90")
        assert spec.causal_align.value == "bottom_right"
    assert local.mask.value == "sliding_window"
    assert (local.window_left, local.window_right, local.window) == (4095, 0, (4095, 0))
    assert global_.mask.value == "causal"
    assert (global_.window_left, global_.window_right, global_.window) == (None, None, None)


EXPECTED_MODULES = {
    "bert_base": "bert_base_prefill_fp16_d64",
    "deepseek_v3_mla": "deepseek_v3_mla_prefill_bf16_d192_dv128_causal_br",
    "deepseek_v3_absorbed": "deepseek_v3_absorbed_prefill_bf16_d576_dv512_causal_br",
    "gpt_oss_20b_local": "gpt_oss_20b_local_prefill_bf16_d64_win127x0_br_sinks_bwd",
    "gpt_oss_20b_global": "gpt_oss_20b_global_prefill_bf16_d64_causal_br_sinks_bwd",
    "llama4_scout_chunked": "llama4_scout_chunked_prefill_bf16_d128_chunk8192_br_bwd",
    "llama4_scout_global": "llama4_scout_global_prefill_bf16_d128_causal_br_bwd",
    "gemma2_9b_local": "gemma2_9b_local_prefill_bf16_d256_win4095x0_br_cap50",
    "gemma2_9b_global": "gemma2_9b_global_prefill_bf16_d256_causal_br_cap50",
    "gpt2": "gpt2_prefill_fp16_d64_causal_br",
    "llama3_8b": "llama3_8b_prefill_bf16_d128_causal_br_bwd",
    "mistral_7b": "mistral_7b_prefill_bf16_d128_win4095x0_br",
    "mpt_7b": "mpt_7b_prefill_bf16_d128_causal_br_alibi",
    "phi3_mini": "phi3_mini_prefill_bf16_d96_causal_br",
    "qwen2_5_7b": "qwen2_5_7b_prefill_bf16_d128_causal_br",
}


EXPECTED_DECODE_MODULES = {
    "deepseek_v3_absorbed": "deepseek_v3_absorbed_decode_bf16_d576_dv512_causal_br_paged64",
    "gpt_oss_20b_local": "gpt_oss_20b_local_decode_bf16_d64_win127x0_br_sinks_paged16",
    "gpt_oss_20b_global": "gpt_oss_20b_global_decode_bf16_d64_causal_br_sinks_paged16",
    "llama4_scout_chunked": "llama4_scout_chunked_decode_bf16_d128_chunk8192_br_paged16",
    "llama4_scout_global": "llama4_scout_global_decode_bf16_d128_causal_br_paged16",
    "gemma2_9b_local": "gemma2_9b_local_decode_bf16_d256_win4095x0_br_cap50_contig",
    "gemma2_9b_global": "gemma2_9b_global_decode_bf16_d256_causal_br_cap50_contig",
    "llama3_8b": "llama3_8b_decode_bf16_d128_causal_br_paged16",
    "mistral_7b": "mistral_7b_decode_bf16_d128_win4095x0_br_paged64",
    "qwen2_5_7b": "qwen2_5_7b_decode_bf16_d128_causal_br_contig_q4",
}


def test_example_decode_module_names() -> None:
    specs = [spec for path in EXAMPLES for spec in load_spec_file(path)]
    names = {spec.name: module_name(spec, DECODE) for spec in specs if DECODE in spec.kernels}
    assert names == EXPECTED_DECODE_MODULES


def test_decode_fields_and_hashes() -> None:
    decode = _spec(kernels=["prefill", "decode"], kv_layout="paged", page_size=16)
    prefill_only = _spec()
    assert decode.canonical()["kv_layout"] == "paged" and decode.query_tokens == 1
    assert decode.canonical()["max_query_tokens"] == 1  # the default, resolved
    assert "kv_layout" not in prefill_only.canonical()  # prefill-only hashes are unchanged
    assert (
        decode.kernel_hash(PREFILL) == prefill_only.spec_hash() == prefill_only.kernel_hash(PREFILL)
    )
    assert decode.kernel_hash(DECODE) != decode.spec_hash() != prefill_only.spec_hash()
    others = [
        _spec(kernels=["prefill", "decode"], kv_layout="paged", page_size=32),
        _spec(kernels=["prefill", "decode"], kv_layout="contiguous"),
        _spec(kernels=["prefill", "decode"], kv_layout="contiguous", max_query_tokens=4),
        _spec(kernels=["decode"], kv_layout="paged", page_size=16),
    ]
    hashes = {spec.kernel_hash(DECODE) for spec in [decode, *others]}
    assert len(hashes) == 4  # kernels [decode] alone has the decode kernel's hash
    assert module_name(others[2], DECODE) == "t_decode_bf16_d128_causal_br_contig_q4"
    assert _spec(
        kernels=["decode"], kv_layout="contiguous", mask="none", causal_align=None
    ).kernels == (DECODE,)


def test_example_module_names() -> None:
    specs = [spec for path in EXAMPLES for spec in load_spec_file(path)]
    names = {spec.name: module_name(spec, PREFILL) for spec in specs}
    assert names == EXPECTED_MODULES


@pytest.mark.parametrize("name", sorted(EXPECTED_MODULES.values()))
def test_module_names_hold_no_tile_sizes(name: str) -> None:
    assert re.fullmatch(r"[a-z][a-z0-9_]*", name) and name.isidentifier()
    parts = name.split("_")
    assert not any(re.fullmatch(r"(bm|bn|m|n|w|s|block|warps|stages)\d+", p) for p in parts)
    assert not re.search(r"\d+x\d+_\d+x\d+|block|warp|stage", name)


def _spec(**fields) -> AttnSpec:
    base = dict(
        name="t",
        archs=["sm80"],
        dtype="bf16",
        head_dim=128,
        num_q_heads=8,
        num_kv_heads=8,
        mask="causal",
        causal_align="bottom_right",
        kernels=["prefill"],
    )
    base.update(fields)
    base = {k: v for k, v in base.items() if v is not None}
    return specs_from_data(base)[0]


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, "t_prefill_bf16_d128_causal_br"),
        ({"causal_align": "top_left"}, "t_prefill_bf16_d128_causal_tl"),
        ({"mask": "none", "causal_align": None, "dtype": "fp32"}, "t_prefill_fp32_d128"),
        ({"head_dim": 96, "head_dim_v": 64}, "t_prefill_bf16_d96_dv64_causal_br"),
        ({"head_dim_v": 128}, "t_prefill_bf16_d128_causal_br"),  # equal to head_dim: not named
        ({"mask": "sliding_window", "window_left": 255}, "t_prefill_bf16_d128_win255x0_br"),
        (
            {
                "mask": "sliding_window",
                "window_left": 8,
                "window_right": 4,
                "causal_align": "top_left",
            },
            "t_prefill_bf16_d128_win8x4_tl",
        ),
        ({"softcap": 30.0}, "t_prefill_bf16_d128_causal_br_cap30"),
        ({"softcap": 30.5}, "t_prefill_bf16_d128_causal_br_cap30p5"),
        ({"softcap": 10000}, "t_prefill_bf16_d128_causal_br_cap10000"),
        ({"softcap": 1e-05}, "t_prefill_bf16_d128_causal_br_cap1em05"),
        ({"alibi": True, "softcap": 0.5}, "t_prefill_bf16_d128_causal_br_cap0p5_alibi"),
        ({"sinks": True}, "t_prefill_bf16_d128_causal_br_sinks"),
        ({"mask": "chunked", "chunk_size": 8192}, "t_prefill_bf16_d128_chunk8192_br"),
        (
            {"mask": "sliding_window", "window_left": 127, "sink_tokens": 4},
            "t_prefill_bf16_d128_win127x0_st4_br",
        ),
    ],
)
def test_module_name_fields(fields: dict, expected: str) -> None:
    name = module_name(_spec(**fields), PREFILL)
    assert name == expected
    assert name.isidentifier() and name.isascii()


def test_module_name_ignores_head_counts_and_archs() -> None:
    base = module_name(_spec(), PREFILL)
    assert (
        module_name(_spec(num_q_heads=32, num_kv_heads=4, archs=["sm90", "sm86"]), PREFILL) == base
    )


def test_distinct_softcaps_get_distinct_module_names() -> None:
    caps = [50.0, 50.0000001, 49.99999999, 0.0001, 0.00011, 1e-05, 1.5e-05]
    names = {module_name(_spec(softcap=cap), PREFILL) for cap in caps}
    assert len(names) == len(caps)
    assert all(n.isidentifier() for n in names)


# ---------------------------------------------------------------------------- hash, canonical


def test_spec_hash_is_stable() -> None:
    spec = load_spec_file(ROOT / "examples" / "llama3_8b.yaml")[0]
    # The value recorded in generated/; a change here means every module's header changes.
    assert spec.spec_hash() == "fb090f33213dd5bd"
    assert spec.kernel_hash(PREFILL) == "89cba968244899d4"
    # Without backward: the training fields are left out of canonical() while false, so an
    # inference spec keeps its hashes; its prefill kernel's hash leaves the decode fields out
    # (adding decode to a spec keeps its prefill kernels' tuning entries).
    inference = spec.model_copy(update={"backward": False})
    assert inference.spec_hash() == "d4c0289571265e2a"
    assert inference.kernel_hash(PREFILL) == "0b49639ae754cf1a"
    again = load_spec_file(ROOT / "examples" / "llama3_8b.yaml")[0]
    assert again.spec_hash() == spec.spec_hash() and again == spec
    reordered = dict(reversed(list(spec.model_dump(mode="json").items())))
    assert specs_from_data(reordered)[0].spec_hash() == spec.spec_hash()
    assert re.fullmatch(r"[0-9a-f]{16}", spec.spec_hash())


SLIDING_FIELDS = dict(
    name="t",
    archs=["sm80", "sm90"],
    dtype="bf16",
    head_dim=128,
    head_dim_v=128,
    num_q_heads=8,
    num_kv_heads=8,
    mask="sliding_window",
    causal_align="bottom_right",
    window_left=16,
    window_right=0,
    softcap=0.0,
    alibi=False,
    kernels=["prefill"],
)
# One change per field; the decode fields change on a decode base (DECODE_CHANGES).
FIELD_CHANGES = {
    "name": {"name": "u"},
    "archs": {"archs": ["sm80"]},
    "archs order": {"archs": ["sm90", "sm80"]},
    "dtype": {"dtype": "fp16"},
    "head_dim": {"head_dim": 64},
    "head_dim_v": {"head_dim_v": 64},
    "num_q_heads": {"num_q_heads": 16},
    "num_kv_heads": {"num_kv_heads": 2},
    "mask": {"mask": "causal", "window_left": None, "window_right": None},
    "causal_align": {"causal_align": "top_left"},
    "window_left": {"window_left": 17},
    "window_right": {"window_right": 1},
    "softcap": {"softcap": 30.0},
    "alibi": {"alibi": True},
    "backward": {"backward": True},
    "dropout": {"backward": True, "dropout": True},
    "sinks": {"sinks": True},
    "sink_tokens": {"sink_tokens": 4},
    "chunk_size": {"mask": "chunked", "chunk_size": 64, "window_left": None, "window_right": None},
    "score_mod": {"score_mod": "score * 2"},
    "mask_mod": {"mask_mod": "q_idx >= kv_idx"},
    "tensors": {
        "mask_mod": "doc[b, q_idx] == doc[b, kv_idx]",
        "tensors": [{"name": "doc", "dtype": "int32", "shape": ["B", "N"]}],
    },
}


DECODE_BASE = dict(
    kernels=["prefill", "decode"], kv_layout="paged", page_size=16, max_query_tokens=1
)
DECODE_CHANGES = {
    "kernels": {"kernels": ["decode"]},
    "kv_layout": {"kv_layout": "contiguous", "page_size": None},
    "page_size": {"page_size": 32},
    "max_query_tokens": {"max_query_tokens": 2},
    # (fp8 needs sm89+; kv_dtype alone changing the hash: tests/test_decode_fp8.py)
    "kv_dtype": {"kv_dtype": "fp8_e4m3", "archs": ["sm90"]},
}


def test_spec_hash_changes_with_every_field() -> None:
    def make(changes: dict) -> AttnSpec:
        fields = {**SLIDING_FIELDS, **changes}
        return specs_from_data({k: v for k, v in fields.items() if v is not None})[0]

    changed = {field for change in FIELD_CHANGES.values() for field in change}
    decode_fields = {field for change in DECODE_CHANGES.values() for field in change}
    assert changed | decode_fields >= set(AttnSpec.model_fields)
    hashes = {"base": make({}).spec_hash()}
    for label, change in FIELD_CHANGES.items():
        hashes[label] = make(change).spec_hash()
    assert len(set(hashes.values())) == len(hashes), hashes
    decode_base = {**SLIDING_FIELDS, **DECODE_BASE}
    decode_hashes = {"base": specs_from_data(decode_base)[0].spec_hash()}
    for label, change in DECODE_CHANGES.items():
        fields = {**decode_base, **change}
        spec = specs_from_data({k: v for k, v in fields.items() if v is not None})[0]
        decode_hashes[label] = spec.spec_hash()
    assert len(set(decode_hashes.values())) == len(decode_hashes), decode_hashes
    assert not set(decode_hashes.values()) & set(hashes.values())


def test_canonical_resolves_defaults() -> None:
    spec = _spec(mask="sliding_window", window_left=64)
    assert (spec.head_dim_v, spec.window_right) == (None, None)
    canonical = spec.canonical()
    # Decode's fields appear only in specs with decode (prefill-only hashes stay as they were).
    # So do the training fields while false, and the newer models' fields while unset.
    assert list(canonical) == [
        f
        for f in AttnSpec.model_fields
        if f not in DECODE_FIELDS + TRAINING_FIELDS + MODEL_FIELDS + EXPRESSION_FIELDS
    ]
    assert canonical["head_dim_v"] == 128 and canonical["window_right"] == 0
    assert canonical["window_left"] == 64 and canonical["softcap"] == 0.0
    assert canonical["archs"] == ["sm80"] and canonical["mask"] == "sliding_window"
    explicit = _spec(mask="sliding_window", window_left=64, head_dim_v=128, window_right=0)
    assert explicit.canonical() == canonical and explicit.spec_hash() == spec.spec_hash()
    assert _spec(head_dim=64).canonical()["head_dim_v"] == 64
    causal = _spec().canonical()
    assert (causal["window_left"], causal["window_right"]) == (None, None)


def test_spec_is_frozen() -> None:
    spec = _spec()
    with pytest.raises(Exception, match="frozen"):
        spec.head_dim = 64  # type: ignore[misc]


# ----------------------------------------------------------------------------- softcap ints


def test_softcap_int_is_accepted_as_float(tmp_path: Path) -> None:
    path = tmp_path / "capped.yaml"
    path.write_text(_with("softcap", "50"), encoding="utf-8")
    (spec,) = load_spec_file(path)
    assert spec.softcap == 50.0 and type(spec.softcap) is float
    assert spec.canonical()["softcap"] == 50.0
    as_float = tmp_path / "capped_float.yaml"
    as_float.write_text(_with("softcap", "50.0"), encoding="utf-8")
    assert load_spec_file(as_float)[0].spec_hash() == spec.spec_hash()
    assert type(_spec(softcap=0).softcap) is float
    variant = _variants("  capped:\n    softcap: 30\n")
    assert type(specs_from_data(_parse(variant))[0].softcap) is float


def _parse(text: str):
    from attngen.spec import parse_yaml

    return parse_yaml(text)


def test_yaml12_scalars_are_read() -> None:
    data = _parse("a: true\nb: false\nc: 0\nd: -12\ne: 1.5\nf: null\ng: ~\nh: yes\ni: 0o7\n")
    assert data == {
        "a": True,
        "b": False,
        "c": 0,
        "d": -12,
        "e": 1.5,
        "f": None,
        "g": None,
        "h": "yes",
        "i": "0o7",
    }


# ------------------------------------------------------------------------------ bad specs


@pytest.mark.parametrize(
    ("text", "expected"), [case[1:] for case in BAD_SPECS], ids=[case[0] for case in BAD_SPECS]
)
def test_bad_spec_is_one_line(tmp_path: Path, text: str, expected: list[str]) -> None:
    message = _one_line(tmp_path, text)
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


def test_bad_spec_ids_are_unique() -> None:
    ids = [case[0] for case in BAD_SPECS]
    assert len(ids) == len(set(ids))


def test_binary_garbage(tmp_path: Path) -> None:
    assert "not UTF-8 text" in _one_line(tmp_path, bytes(range(256)) * 4)
    # UTF-8 but with control characters: PyYAML's own message spans lines; ours must not
    message = _one_line(tmp_path, b"\x00\x01name: t\n", name="nul.yaml")
    assert "not valid YAML" in message and "special characters" in message


def test_file_too_large(tmp_path: Path) -> None:
    text = BASE + "# padding\n" * (MAX_SPEC_BYTES // 10 + 1)
    assert len(text.encode()) > MAX_SPEC_BYTES
    message = _one_line(tmp_path, text)
    assert f"at most {MAX_SPEC_BYTES} bytes" in message
    at_limit = tmp_path / "at_limit.yaml"
    at_limit.write_text(BASE + "#" * (MAX_SPEC_BYTES - len(BASE) - 1) + "\n", encoding="utf-8")
    assert at_limit.stat().st_size == MAX_SPEC_BYTES
    assert load_spec_file(at_limit)[0].name == "t"


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero")
def test_endless_file_is_refused_without_reading_it() -> None:
    # In a child with a 1 GiB address-space limit: reading /dev/zero to the end would take
    # every byte of memory the machine has before the size check.
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
        "from attngen.spec import SpecError, load_spec_file\n"
        "try:\n"
        "    load_spec_file('/dev/zero')\n"
        "except SpecError as exc:\n"
        "    print(exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("/dev/zero: ")
    assert f"at most {MAX_SPEC_BYTES} bytes" in result.stdout


def test_missing_file_and_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    assert "cannot read (No such file or directory)" in _load_error(missing)
    assert "cannot read" in _load_error(tmp_path)


def test_spec_error_is_a_value_error() -> None:
    assert issubclass(SpecError, ValueError)


def test_dtype_spellings_are_torch_and_triton_ones() -> None:
    """Dtype's properties are the build path's and the runtime's only dtype vocabulary: each
    must be what torch and Triton call that dtype."""
    import torch
    import triton.language as tl

    from attngen.spec import Dtype

    for dtype in Dtype:
        as_torch = getattr(torch, dtype.torch_name)
        assert as_torch.itemsize == dtype.itemsize
        assert torch.finfo(as_torch).eps == dtype.eps == 2.0**-dtype.mantissa_bits
        as_triton = getattr(tl, dtype.torch_name)
        assert str(as_triton) == dtype.value  # Triton's short name is the YAML name
        assert tl.str_to_ty(dtype.triton_pointer, None) == tl.pointer_type(as_triton)
        assert Dtype.from_torch_name(str(as_torch)) is dtype  # "torch.bfloat16"
        assert Dtype.from_torch_name(dtype.torch_name) is dtype
    assert Dtype.from_torch_name("float64") is None
