"""Hostile and broken spec files, drawn by Hypothesis: every one is either a valid spec that
renders safely, or a one-line SpecError; the CLI exits 1 (never a traceback) and writes
nothing; no text of the file is ever executed or copied into a module."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from attngen.build import plan_build
from attngen.cli import app
from attngen.spec import SpecError, load_spec_file

CANARY = "attngen_canary_must_not_exist"
VALID = {
    "name": "hostile",
    "archs": ["sm90"],
    "dtype": "bf16",
    "head_dim": 128,
    "num_q_heads": 8,
    "num_kv_heads": 2,
    "mask": "causal",
    "causal_align": "bottom_right",
    "kernels": ["prefill"],
}
CODE = [
    f"__import__('pathlib').Path('{CANARY}').touch()",
    "'; import os; os.system('true') #",
    '"""\nimport os\n"""',
    "{{ 7 * 7 }}",
    "{% raw %}",
    "${HOME}",
    "\x00",
    "\u202e",
    "名前",
    "../../etc/passwd",
    "a/b",
    "..",
    "sm90\nname: x",
    "!!python/object/apply:os.system ['true']",
]
HOSTILE_VALUES = st.one_of(
    st.sampled_from(CODE),
    st.text(max_size=40),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.lists(st.sampled_from(["sm90", "sm80", "x", CODE[0]]), max_size=3),
    st.dictionaries(st.sampled_from(["a", "name"]), st.integers(), max_size=2),
)
YAML_1_1_TRAPS = [
    "no",
    "yes",
    "on",
    "off",
    "010",
    "0x80",
    "1e3",
    "12:30",
    "2024-01-01",
    "~",
    ".inf",
    ".nan",
    "0o17",
    "+1",
    "1_000",
    "0b101",
]


def _field_value_text() -> st.SearchStrategy[str]:
    """A spec text with one field replaced by a hostile value."""

    def build(field, value):
        data = dict(VALID)
        data[field] = value
        return yaml.safe_dump(data, allow_unicode=True)

    fields = st.sampled_from(
        [
            *VALID,
            "head_dim_v",
            "window_left",
            "softcap",
            "alibi",
            "variants",
            "score_mod",
            "mask_mod",
            "tensors",
            "unknown_key",
            CODE[0],
        ]
    )
    return st.builds(build, fields, HOSTILE_VALUES)


def _raw_scalar_text() -> st.SearchStrategy[str]:
    """YAML 1.1 traps written as plain scalars where a number or bool is expected."""

    def build(field, trap):
        lines = [
            f"{k}: {v if not isinstance(v, list) else '[' + ', '.join(v) + ']'}"
            for k, v in VALID.items()
            if k != field
        ]
        return "\n".join([*lines, f"{field}: {trap}"]) + "\n"

    return st.builds(
        build,
        st.sampled_from(["head_dim", "num_q_heads", "softcap", "alibi", "window_left"]),
        st.sampled_from(YAML_1_1_TRAPS),
    )


def _structural_text() -> st.SearchStrategy[str]:
    base = yaml.safe_dump(VALID)
    return st.one_of(
        st.just(base + "name: again\n"),  # duplicate key
        st.just("x: &a [1, 2]\ny: *a\n"),  # anchors and aliases
        st.just("a: &a [" + ",".join(["*a"] * 5) + "]\n"),  # alias bomb (self-reference)
        st.just(base + "---\n" + base),  # two documents
        st.just("- just\n- a list\n"),
        st.just("[" * 200 + "]" * 200),  # deep nesting
        st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
        st.just(base + "#" * 70000 + "\n"),  # larger than the 64 KiB limit
        st.just(base.replace("head_dim: 128", "head_dim: !!python/object:os.system 1")),
    )


HOSTILE_TEXTS = st.one_of(_field_value_text(), _raw_scalar_text(), _structural_text())


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    return path


@settings(max_examples=300)  # cheap: no kernel runs
@given(text=HOSTILE_TEXTS)
def test_hostile_spec_is_rejected_in_one_line_or_renders_safely(tmp_path_factory, text):
    tmp_path = tmp_path_factory.mktemp("hostile")
    path = _write(tmp_path, text)
    cwd = os.getcwd()
    os.chdir(tmp_path)  # the canary would land here
    try:
        try:
            specs = load_spec_file(path)
        except SpecError as exc:
            message = str(exc)
            assert "\n" not in message and message.startswith(str(path))
            return
        finally:
            assert not (tmp_path / CANARY).exists(), "spec text was executed"
    finally:
        os.chdir(cwd)
    # Accepted: then only validated values reach the module, whatever else the file held.
    if any(spec.score_mod is not None or spec.mask_mod is not None for spec in specs):
        with pytest.raises(SpecError, match="no kernel compiles them yet"):
            plan_build(specs)  # an expression is parsed and checked, never built (yet)
        return
    for artifact in plan_build(specs):
        assert CANARY not in artifact.source and "import os\n" in artifact.source
        assert artifact.source.isascii()


@given(text=st.one_of(_raw_scalar_text(), _structural_text(), st.sampled_from(CODE)))
def test_cli_exits_1_with_one_line_and_writes_nothing(tmp_path_factory, text):
    tmp_path = tmp_path_factory.mktemp("cli")
    path = _write(tmp_path, text)
    try:  # the strategies can draw a valid file (an explicit null for an optional field)
        load_spec_file(path)
        assume(False)
    except SpecError:
        pass
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["build", str(path), "--out", str(out)])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()
