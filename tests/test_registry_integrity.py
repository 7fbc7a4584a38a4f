"""The registry runs only the module its index entry describes: sha256 of the bytes recorded at
build time, verified before import; its header's attngen and template hash compared with the
running ones; the module's own constants compared with the entry; and `attngen check` names
modules in the folder that no given spec produces."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import attngen
from attngen.build import INDEX_NAME, plan_build, read_index, write_build
from attngen.cli import app
from attngen.runtime import registry
from attngen.runtime.registry import RegistryError, current_registry, load_kernels, use_registry
from attngen.spec import specs_from_data
from attngen.spec.names import __version__
from tests.ondemand_harness import on_demand  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
TOY = dict(
    name="toy",
    archs=["sm90"],
    dtype="fp32",
    head_dim=16,
    num_q_heads=4,
    num_kv_heads=2,
    mask="causal",
    causal_align="bottom_right",
    kernels=["prefill"],
)
MODULE = "sm90/toy_prefill_fp32_d16_causal_br.py"


def _build(folder: Path, *specs: dict) -> Path:
    write_build(plan_build([s for data in specs for s in specs_from_data(data)]), folder)
    return folder


def _module_of(folder: Path):
    registry = load_kernels(folder, replace=True)
    return registry.module(str((folder / MODULE).resolve()))


@pytest.fixture()
def restore_registry():
    saved = current_registry()
    yield
    use_registry(saved)


def test_every_generated_module_has_its_sha256_in_the_index():
    for entry in read_index(ROOT / "generated"):
        data = (ROOT / "generated" / entry["path"]).read_bytes()
        assert entry["sha256"] == hashlib.sha256(data).hexdigest(), entry["path"]


def test_an_edited_module_is_refused_by_name(tmp_path, restore_registry):
    folder = _build(tmp_path / "k", TOY)
    assert _module_of(folder).MASK == "causal"
    path = folder / MODULE
    path.write_text(path.read_text().replace('MASK = "causal"', 'MASK = "none"'))
    with pytest.raises(RegistryError, match=rf"{MODULE}: its bytes do not match the sha256"):
        _module_of(folder)


def test_a_module_whose_constants_disagree_with_its_entry_is_refused(tmp_path, restore_registry):
    """A module renamed over another (or an index entry edited) passes the hash only if the
    index was rewritten too: then its constants still give it away."""
    folder = _build(
        tmp_path / "k", TOY, {**TOY, "name": "other", "mask": "none", "causal_align": None}
    )
    index = json.loads((folder / INDEX_NAME).read_text())
    entry = next(e for e in index["modules"] if e["path"] == MODULE)
    other = folder / "sm90/other_prefill_fp32_d16.py"
    (folder / MODULE).write_bytes(other.read_bytes())  # the mask-none module under this name
    entry["sha256"] = hashlib.sha256(other.read_bytes()).hexdigest()
    (folder / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(RegistryError, match=r"MASK: module has 'none', index says 'causal'"):
        _module_of(folder)


def test_an_index_without_hashes_is_refused_at_load(tmp_path, restore_registry):
    folder = _build(tmp_path / "k", TOY)
    index = json.loads((folder / INDEX_NAME).read_text())
    del index["modules"][0]["sha256"]
    (folder / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(RegistryError, match=r"has no sha256 .* rebuild the folder"):
        load_kernels(folder, replace=True)


def _rewrite(folder: Path, path: Path, header: str) -> bytes:
    """The module at `path` with its first line replaced, and its index entry's sha256 with it
    (as a build by that attngen would have written both)."""
    data = (header + "\n" + path.read_text().split("\n", 1)[1]).encode()
    path.write_bytes(data)
    index = json.loads((folder / INDEX_NAME).read_text())
    for entry in index["modules"]:
        if folder / entry["path"] == path:
            entry["sha256"] = hashlib.sha256(data).hexdigest()
    (folder / INDEX_NAME).write_text(json.dumps(index))
    return data


def test_a_module_another_attngen_built_is_refused_by_name(tmp_path, restore_registry):
    """A folder module whose header records another attngen version or template hash (or no
    header at all) is refused before it runs, in one line naming the file and both builds."""
    folder = _build(tmp_path / "k", TOY)
    first = (folder / MODULE).read_text().split("\n", 1)[0]
    digest = first.rsplit("(", 1)[1][:-2]
    cases = [
        (first.replace(__version__, "0.0.0-old"), "built by attngen 0.0.0-old (prefill.py.jinja "),
        (first.replace(digest, "0123456789abcdef"), "(prefill.py.jinja 0123456789abcdef), not "),
        ("# written by hand", "has no attngen header"),
    ]
    for header, expected in cases:
        _rewrite(folder, folder / MODULE, header)
        with pytest.raises(RegistryError) as refused:
            _module_of(folder)
        message = str(refused.value)
        assert "\n" not in message and MODULE in message and expected in message, message
        assert "rebuild the folder with `attngen build`" in message
    _rewrite(folder, folder / MODULE, first)
    assert _module_of(folder).MASK == "causal"  # the header it was built with: served


def test_a_cached_module_with_a_stale_header_is_rebuilt(on_demand):  # noqa: F811
    """A module of the on-demand cache that another attngen built is rendered again by this
    one and the rebuilt module serves the call."""
    q, k, v = torch.randn(3, 1, 5, 2, 59, generator=torch.Generator().manual_seed(0))
    out = attngen.flash_attn_func(q, k, v, causal=True)
    path = Path(attngen.last_dispatch().key)
    original = path.read_bytes()
    first = original.decode().split("\n", 1)[0]
    _rewrite(path.parent.parent, path, first.replace(__version__, "0.0.0-old"))
    load_kernels()  # a new registry (as a new process would have) reads the cache's index
    renders = registry.render_count()
    again = attngen.flash_attn_func(q, k, v, causal=True)
    assert path.read_bytes() == original and torch.equal(again, out)
    assert attngen.last_dispatch().key == str(path) and registry.render_count() == renders + 1


def test_check_reports_modules_no_given_spec_produces(tmp_path):
    spec_a, spec_b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    spec_a.write_text(
        "name: toy\narchs: [sm90]\ndtype: fp32\nhead_dim: 16\nnum_q_heads: 4\n"
        "num_kv_heads: 2\nmask: causal\ncausal_align: bottom_right\n"
        "kernels: [prefill]\n"
    )
    spec_b.write_text(spec_a.read_text().replace("toy", "other"))
    out = tmp_path / "out"
    runner = CliRunner()
    assert runner.invoke(app, ["build", str(spec_a), str(spec_b), "--out", str(out)]).exit_code == 0
    assert runner.invoke(app, ["check", str(spec_a), str(spec_b), "--out", str(out)]).exit_code == 0
    result = runner.invoke(app, ["check", str(spec_a), "--out", str(out)])
    assert result.exit_code == 1
    assert "none of the given specs produces" in result.stderr
    assert "sm90/other_prefill_fp32_d16_causal_br.py" in result.stderr
    assert "toy_prefill" not in result.stderr and result.stderr.count("\n") == 1
    stray = out / "sm90" / "hand_written.py"  # a file the index does not list either
    stray.write_text("x = 1\n")
    result = runner.invoke(app, ["check", str(spec_a), str(spec_b), "--out", str(out)])
    assert result.exit_code == 1 and "sm90/hand_written.py" in result.stderr
