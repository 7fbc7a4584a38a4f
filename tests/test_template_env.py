"""The renders' Jinja environment (attngen/render/template_env.py): Jinja's bytecode cache under the
cache root, filled by a first process and used by the next, rendering the sources' bytes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

from attngen.build import plan_build
from attngen.render import TEMPLATE_FOR_KIND, build_context, template_env
from attngen.spec import KernelKind, load_spec_file
from attngen.spec.files import user_cache_dir
from attngen.tiling.decode import derive_decode_tiles
from attngen.tiling.prefill import derive_tiles
from attngen.tuning.database import DEFAULT_TUNING_DIR

ROOT = Path(__file__).resolve().parent.parent
# (example, kind): every template's branches that the examples reach between them: a causal
# GQA prefill with backward, sliding window with softcap, a varlen, sinks and a paged decode.
RENDERED = [
    ("llama3_8b", KernelKind.prefill),
    ("gemma2_9b", KernelKind.prefill),
    ("mistral_7b", KernelKind.varlen),
    ("gpt_oss_20b", KernelKind.decode),
    ("deepseek_v3", KernelKind.decode),
]


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache root for this test ($ATTNGEN_CACHE, which the runtime's settings read
    too while configure() has not set a cache_dir)."""
    monkeypatch.setenv("ATTNGEN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_bytecode_folder_is_under_the_cache_root(cache_root: Path) -> None:
    assert template_env.cache_root() == cache_root
    assert template_env.bytecode_folder() == cache_root / (f"templates_jinja2-{jinja2.__version__}")


def test_the_cache_root_without_settings_is_the_users(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ATTNGEN_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere/cache")
    assert template_env.cache_root() == user_cache_dir()
    if sys.platform == "linux":
        assert user_cache_dir() == Path("/somewhere/cache/attngen")


def test_the_runtimes_cache_dir_decides_when_it_is_loaded(cache_root: Path, tmp_path: Path) -> None:
    from attngen.runtime import registry

    registry.set_overrides(None, tmp_path / "configured")
    try:
        assert template_env.cache_root() == tmp_path / "configured"
    finally:
        registry.reset_overrides()
    assert template_env.cache_root() == cache_root


def test_a_filled_cache_renders_the_same_bytes_without_compiling(
    cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first environment compiles each template and writes its bytecode; a second one
    (a later process) loads it, compiles nothing, and renders what the sources render."""
    contexts = [(_context(example, kind), TEMPLATE_FOR_KIND[kind]) for example, kind in RENDERED]
    plain = template_env.source_environment()
    expected = [plain.get_template(name).render(**context) for context, name in contexts]

    first = template_env.TemplateBytecodeCache()
    cold = template_env.source_environment(first)
    assert [cold.get_template(n).render(**c) for c, n in contexts] == expected
    assert first.error is None
    written = sorted(template_env.bytecode_folder().glob("*.cache"))
    # Each top-level template and the partials it includes: one file each.
    assert len(written) >= len({name for _, name in contexts}) + 1, written

    def no_compile(*args: object, **kwargs: object) -> None:
        raise AssertionError("a template was compiled from its source")

    monkeypatch.setattr(jinja2.Environment, "compile", no_compile)
    warm = template_env.source_environment(template_env.TemplateBytecodeCache())
    assert [warm.get_template(n).render(**c) for c, n in contexts] == expected


def test_an_edited_template_is_compiled_again(cache_root: Path) -> None:
    """An entry is used only for the source it was compiled from (Jinja's sha1 check)."""
    loader = jinja2.DictLoader({"t.py.jinja": "x = {{ value }}\n"})
    env = jinja2.Environment(loader=loader, bytecode_cache=template_env.TemplateBytecodeCache())
    assert env.get_template("t.py.jinja").render(value=1) == "x = 1"
    loader.mapping["t.py.jinja"] = "y = {{ value }}\n"
    env = jinja2.Environment(loader=loader, bytecode_cache=template_env.TemplateBytecodeCache())
    assert env.get_template("t.py.jinja").render(value=1) == "y = 1"


def test_an_unwritable_cache_renders_and_says_why(tmp_path: Path, cache_root: Path) -> None:
    cache_root.parent.mkdir(parents=True, exist_ok=True)
    cache_root.write_text("a file where the folder would be\n", encoding="utf-8")
    bytecode = template_env.TemplateBytecodeCache()
    env = template_env.source_environment(bytecode)
    context = _context("llama3_8b", KernelKind.prefill)
    name = TEMPLATE_FOR_KIND[KernelKind.prefill]
    expected = template_env.source_environment().get_template(name).render(**context)
    assert env.get_template(name).render(**context) == expected
    assert bytecode.error is not None and "Error" in bytecode.error


def test_template_loading_names_the_folder() -> None:
    loading = template_env.template_loading()
    assert loading.startswith(f"sources, Jinja2 {jinja2.__version__}, bytecode cache ")
    assert "templates_jinja2-" in loading


def test_a_second_process_loads_the_bytecode(tmp_path: Path) -> None:
    """Two processes on one cache root: the first writes the bytecode, the second compiles no
    template (its Environment.compile is never called)."""
    script = (
        "import jinja2, sys\n"
        "from attngen import render\nfrom attngen.render import template_env\n"
        "calls = []\n"
        "original = jinja2.Environment.compile\n"
        "jinja2.Environment.compile = lambda *a, **k: calls.append(1) or original(*a, **k)\n"
        "template_env.environment().get_template('decode.py.jinja')\n"
        "print(len(calls))\n"
    )
    env = {**os.environ, "ATTNGEN_CACHE": str(tmp_path), "PYTHONPATH": str(ROOT)}
    counts = [
        subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    ]
    assert int(counts[0]) > 0 and counts[1] == "0", counts


def test_the_built_module_is_the_committed_one() -> None:
    """plan_build through the environment (the bytecode cache as this process found it) gives
    generated/'s bytes."""
    for artifact in plan_build(
        load_spec_file(ROOT / "examples" / "mistral_7b.yaml"), DEFAULT_TUNING_DIR
    ):
        assert (ROOT / "generated" / artifact.relative_path).read_text(
            encoding="utf-8"
        ) == artifact.source, artifact.relative_path


def _context(example: str, kind: KernelKind) -> dict:
    """The render context of the example's first spec with `kind`, on sm90 (whose code paths
    include the TMA loads)."""
    spec = next(
        s for s in load_spec_file(ROOT / "examples" / f"{example}.yaml") if kind in s.kernels
    )
    derive = derive_decode_tiles if kind is KernelKind.decode else derive_tiles
    return build_context(spec, kind, derive(spec, "sm90"))
