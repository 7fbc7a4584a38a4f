"""The tiling models compiled ahead (attngen/tiling/model_store.json, evaluate.py) are sympy's.

The store is written by tools/model_store.py; a derivation reads it instead of building the
expressions with sympy (whose import alone costs a process 180 ms). These tests hold the store
to sympy's texts, functions and conditions for every model the tool enumerates, its worked
formulas on a sample of models, and check that a process deriving every example spec on every
arch finds everything in the store and never imports sympy.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sympy

from attngen.tiling.evaluate import STORE

ROOT = Path(__file__).resolve().parents[1]
STALE = "the store is stale: run `python tools/model_store.py` (and commit model_store.json)"


def _tool():
    spec = importlib.util.spec_from_file_location("model_store", ROOT / "tools/model_store.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def stored() -> dict:
    data = json.loads(STORE.read_text())
    assert data["sympy"] == sympy.__version__, f"written with sympy {data['sympy']}; {STALE}"
    return dict(data["models"])


def test_every_model_is_stored_as_sympy_makes_it(stored: dict) -> None:
    tool = _tool()
    expected = {model.key: (model, names) for model, names, _ in tool.models()}
    assert sorted(expected) == sorted(stored), STALE
    for key, (model, names) in expected.items():
        fresh = tool.entry(model, names, worked=False)
        for part in ("text", "functions", "conditions"):
            assert stored[key][part] == fresh[part], f"{key} {part}: {STALE}"


@pytest.mark.parametrize(
    "key",
    [
        "prefill_model.smem_expression(sm90, True, True, False)",
        "prefill_model.regs_expression(sm80, True, False)",
        "backward_model.dkdv_smem_expression(sm90, True, 3)",
    ],
)
def test_worked_formulas_are_sympy_active_branches(stored: dict, key: str) -> None:
    tool = _tool()
    model, names, worked = next(m for m in tool.models() if m[0].key == key)
    assert worked
    conditions = stored[key]["conditions"][",".join(names)]
    assert stored[key]["formulas"] == tool.formulas(model.expr(), names, conditions), STALE


DERIVE_EVERY_EXAMPLE = """
import glob, sys
from attngen.arch import ARCHS
from attngen.build import load_specs
from attngen.spec import KernelKind
from attngen.tiling import evaluate
from attngen.tiling.backward import derive_backward_tiles
from attngen.tiling.decode import derive_decode_tiles
from attngen.tiling.gluon import derive_gluon_tiles
from attngen.tiling.gluon_backward import derive_gluon_backward
from attngen.tiling.prefill import derive_tiles

count = 0
for spec in load_specs(sorted(glob.glob("examples/*.yaml"))):
    for arch in ARCHS:
        derive_tiles(spec, arch).summary_lines()
        derive_decode_tiles(spec, arch).summary_lines()
        if spec.backward:
            derive_backward_tiles(spec, arch)
        count += 1
    for kind in (KernelKind.prefill, KernelKind.varlen):
        if (gluon := derive_gluon_tiles(spec, "sm90", kind)) is not None:
            gluon.summary_lines()
    if (backward := derive_gluon_backward(spec, "sm90")) is not None:
        backward.summary_lines()
print(count, "sympy" in sys.modules, sorted(evaluate.misses))
"""


def test_a_process_derives_every_example_from_the_store_without_sympy() -> None:
    """A fresh process (nothing cached) derives every example spec on every arch, prefill,
    decode, backward and the Gluon kernels, with their header lines: nothing is missing from
    the store, and sympy is never imported."""
    done = subprocess.run(
        [sys.executable, "-c", DERIVE_EVERY_EXAMPLE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    count, imported, misses = done.stdout.strip().split(" ", 2)
    assert int(count) >= 50
    assert (imported, misses) == ("False", "[]"), done.stdout


FLEX_MASK_CALL = """
import os, sys, tempfile
os.environ["ATTNGEN_CACHE"] = tempfile.mkdtemp()
import torch
import attngen

doc = torch.repeat_interleave(torch.arange(2), 32)[None]


def document(b, h, q_idx, kv_idx):
    return doc[b, q_idx] == doc[b, kv_idx]


q, k, v = (torch.randn(1, 2, 64, 64, requires_grad=True) for _ in range(3))
block_mask = attngen.create_block_mask(document, 1, 1, 64, 64, device="cpu")
attngen.flex_attention(q, k, v, block_mask=block_mask).sum().backward()
print(q.grad.abs().sum().item() > 0, "sympy" in sys.modules)
"""


def test_a_new_flex_mask_module_and_its_backward_import_no_sympy() -> None:
    """A process's first flex_attention call with a new mask_mod, in an empty cache, derives,
    renders, writes and runs its module, and its backward, without sympy (a score_mod's
    gradient is sympy's: only such calls import it)."""
    done = subprocess.run(
        [sys.executable, "-c", FLEX_MASK_CALL],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "TRITON_INTERPRET": "1", "ATTNGEN_ON_DEMAND": "1"},
    )
    assert done.stdout.split() == ["True", "False"], done.stderr[-2000:]


def test_a_model_the_store_lacks_is_built_with_sympy() -> None:
    """Capture words past the tool's range: the function and text come from sympy, the same
    as the stored models', and the miss is recorded."""
    from attngen.tiling import evaluate, gluon
    from attngen.tiling.symbolic import by_symbol, exact_value

    words = _tool().MAX_CAPTURE_WORDS + 5
    model = gluon.smem_model(words, False)
    at = dict(zip(gluon.SYMBOL_NAMES, (2, 64, 128, 128, 128, 2, 2), strict=True))
    function = evaluate.compiled(model, gluon.SYMBOL_NAMES)
    exact = exact_value(model.expr(), by_symbol(model.expr(), at))
    assert int(function(*at.values())) == int(exact)
    assert evaluate.formula_text(model) == str(model.expr())
    assert f"{model.key} functions {','.join(gluon.SYMBOL_NAMES)}" in evaluate.misses
