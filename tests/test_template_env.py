"""The templates' compiled form (attngen/template_env.py): shipped current, used, equal to the
sources' renders, and set aside (the sources compiled instead) when it is not theirs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jinja2
import pytest

from attngen import template_env
from attngen.build import plan_build
from attngen.render import TEMPLATE_FOR_KIND, build_context
from attngen.spec import KernelKind, load_spec_file
from attngen.tiling.decode import derive_decode_tiles
from attngen.tiling.prefill import derive_tiles
from attngen.tuning.database import DEFAULT_TUNING_DIR

ROOT = Path(__file__).resolve().parent.parent
REGENERATE = "python -m attngen.template_env"
# (example, kind): every template's branches that the examples reach between them: a causal
# GQA prefill with backward, sliding window with softcap, a varlen, sinks and a paged decode.
RENDERED = [
    ("llama3_8b", KernelKind.prefill),
    ("gemma2_9b", KernelKind.prefill),
    ("mistral_7b", KernelKind.varlen),
    ("gpt_oss_20b", KernelKind.decode),
    ("deepseek_v3", KernelKind.decode),
]


def test_the_shipped_compiled_templates_are_current() -> None:
    assert template_env.stale_files() == [], f"run `{REGENERATE}`"
    assert template_env.main(["--check"]) == 0


def test_renders_use_the_compiled_templates(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh environment renders every kind without compiling a template (what a process's
    first render paid: lexing, parsing and code generation of every template it includes)."""
    assert template_env.template_loading().startswith("compiled"), template_env.template_loading()

    def no_compile(*args: object, **kwargs: object) -> None:
        raise AssertionError("a template was compiled from its source")

    monkeypatch.setattr(jinja2.Environment, "compile", no_compile)
    env, loading = template_env._environment_and_loading.__wrapped__()
    assert loading.startswith("compiled")
    for example, kind in RENDERED:
        context = _context(example, kind)
        assert env.get_template(TEMPLATE_FOR_KIND[kind]).render(**context)


@pytest.mark.parametrize(("example", "kind"), RENDERED, ids=lambda x: getattr(x, "value", x))
def test_compiled_and_source_templates_render_the_same_bytes(
    example: str, kind: KernelKind
) -> None:
    context = _context(example, kind)
    compiled = template_env.environment().get_template(TEMPLATE_FOR_KIND[kind])
    sources = template_env._source_environment().get_template(TEMPLATE_FOR_KIND[kind])
    assert compiled.render(**context) == sources.render(**context)


def test_the_built_module_is_the_committed_one() -> None:
    """plan_build through the compiled templates gives generated/'s bytes (which the sources
    rendered when they were built)."""
    for artifact in plan_build(
        load_spec_file(ROOT / "examples" / "mistral_7b.yaml"), DEFAULT_TUNING_DIR
    ):
        assert (ROOT / "generated" / artifact.relative_path).read_text(
            encoding="utf-8"
        ) == artifact.source, artifact.relative_path


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda m: m.update(jinja2="3.0.0"), "the installed Jinja2 3.1.6 is not 3.0.0"),
        (lambda m: m.update(sources_sha256="0" * 64), "their sources_sha256 differ"),
        (lambda m: m["options"].update(trim_blocks=False), "their options differ"),
        (lambda m: m["modules"].pop("prefill.py.jinja"), "their modules differ"),
    ],
)
def test_compiled_templates_that_are_not_the_sources_are_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change, reason: str
) -> None:
    monkeypatch.setattr(jinja2, "__version__", "3.1.6")
    folder = _copy(tmp_path)
    assert template_env._why_not_compiled(folder) is None
    manifest = json.loads((folder / template_env.MANIFEST).read_text(encoding="utf-8"))
    change(manifest)
    (folder / template_env.MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")
    assert reason in template_env._why_not_compiled(folder)
    monkeypatch.setattr(template_env, "COMPILED_DIR", folder)
    env, loading = template_env._environment_and_loading.__wrapped__()
    assert loading.startswith("sources (the compiled templates are not used: ")
    assert isinstance(env.loader, jinja2.PackageLoader)


def test_a_missing_module_or_manifest_is_named(tmp_path: Path) -> None:
    folder = _copy(tmp_path)
    module = template_env.manifest()["modules"]["decode.py.jinja"]
    (folder / module).unlink()
    assert template_env._why_not_compiled(folder) == f"{module} is missing"
    (folder / template_env.MANIFEST).unlink()
    assert "no readable manifest.json" in template_env._why_not_compiled(folder)


def test_write_compiled_writes_what_changed_and_removes_stale_modules(tmp_path: Path) -> None:
    folder = tmp_path / "compiled"
    written = template_env.write_compiled(folder)
    assert sorted(written) == sorted(template_env.compiled_files())
    assert template_env.write_compiled(folder) == []  # idempotent
    (folder / "tmpl_0000.py").write_text("x = 1\n", encoding="utf-8")
    assert template_env.write_compiled(folder) == ["tmpl_0000.py"]
    assert not (folder / "tmpl_0000.py").exists()
    assert template_env._why_not_compiled(folder) is None
    assert template_env.stale_files(folder) == []
    (folder / "tmpl_0000.py").write_text("x = 1\n", encoding="utf-8")
    module = template_env.manifest()["modules"]["prefill.py.jinja"]
    (folder / module).write_text("# edited\n", encoding="utf-8")
    assert template_env.stale_files(folder) == [module, "tmpl_0000.py"]


def _copy(tmp_path: Path) -> Path:
    folder = tmp_path / "compiled"
    shutil.copytree(template_env.COMPILED_DIR, folder, ignore=shutil.ignore_patterns("__pycache__"))
    return folder


def _context(example: str, kind: KernelKind) -> dict:
    """The render context of the example's first spec with `kind`, on sm90 (whose code paths
    include the TMA loads)."""
    spec = next(
        s for s in load_spec_file(ROOT / "examples" / f"{example}.yaml") if kind in s.kernels
    )
    derive = derive_decode_tiles if kind is KernelKind.decode else derive_tiles
    return build_context(spec, kind, derive(spec, "sm90"))
