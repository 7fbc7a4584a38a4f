"""tools/ab_alt's candidate patches still apply to the package's templates, and the patched
templates render a D 64 and a D 128 causal sm90 module with the Gluon forward and backward
(a patch that no longer applies or renders would fail its GPU call instead)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import jinja2
import pytest

import attngen.render.template_env as template_env
from attngen.build import derive_tiles
from attngen.render import render_module
from attngen.spec import KernelKind
from tests.kernel_harness import make_spec

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "attngen" / "templates"
PATCHES = sorted((ROOT / "tools" / "ab_alt").glob("*.patch"))


def test_there_are_candidates():
    assert PATCHES, "tools/ab_alt holds no patch"


@pytest.mark.parametrize("patch", PATCHES, ids=[p.stem for p in PATCHES])
def test_each_patch_applies_and_renders(patch, tmp_path, monkeypatch):
    alt = tmp_path / "alt"
    shutil.copytree(TEMPLATES, alt, ignore=shutil.ignore_patterns("__pycache__"))
    applied = subprocess.run(["git", "apply", "-p1", str(patch)], cwd=alt, capture_output=True,
                             text=True)  # fmt: skip
    assert applied.returncode == 0, applied.stderr
    loader = jinja2.FileSystemLoader(str(alt))
    environment = jinja2.Environment(loader=loader, undefined=jinja2.StrictUndefined,
                                     **template_env.OPTIONS)  # fmt: skip
    monkeypatch.setattr(template_env, "_environment", lambda: environment)
    for head_dim in (64, 128):
        spec = make_spec(dtype="bf16", head_dim=head_dim, mask="causal", backward=True)
        source = render_module(spec, KernelKind.prefill, derive_tiles(spec, "sm90"))
        assert "def _gluon_attn_fwd_kernel(" in source
        assert "def _gluon_attn_bwd_kernel(" in source
        compile(source, "alt", "exec")
