"""The Gluon forward's autotune on the H200: `pytest -m gpu tests/test_tuning_gluon_gpu.py`
(`bash tools/gpu_session.sh $OUT autotune_gluon:270 autotune_gluon_test:300`: the CLI,
then this).

One example spec (Qwen2.5-7B: bf16, D 128, causal, GQA 7:1), a small budget, the forward
kernels only: the tuning file gains the prefill entry's "gluon" field (the winner timed on
every bucket, the derived config among the measured), and the module the build renders from
it carries the winner's GLUON_CONFIG, runs the Gluon kernel (forward_path()) and matches the
float64 reference.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from attngen.build import load_specs, plan_build
from attngen.reference import compare_to_reference, random_inputs
from attngen.spec import KernelKind
from attngen.tuning.autotune import BUCKETS, autotune
from attngen.tuning.database import entry_key, gluon_knobs, read_tuning_file
from attngen.tuning.measure import config_key

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the H200"),
]
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "qwen2_5_7b.yaml"


def _import(path: Path, source: str):
    path.write_text(source)
    loader = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(loader)
    sys.modules[path.stem] = module
    loader.loader.exec_module(module)
    return module


def test_autotune_records_the_gluon_forward_and_the_build_renders_it(tmp_path):
    (spec,) = load_specs([EXAMPLE])
    console = Console(file=open(tmp_path / "log.txt", "w"), width=200)
    outcomes = autotune([spec], tmp_path, budget_s=150, max_configs=2, arch="sm90",
                        console=console, kernels="forward")  # fmt: skip
    gluon = next(o for o in outcomes if o.kernel == "gluon")
    assert gluon.winner is not None, (tmp_path / "log.txt").read_text()
    entry = read_tuning_file(tmp_path / "sm90.json")["entries"][entry_key(spec, KernelKind.prefill)]
    record = entry["gluon"]
    assert record["config"] == gluon_knobs(gluon.winner)
    assert record["gpu"] == torch.cuda.get_device_name()  # the GPU it ran on, H100 or H200
    assert set(record["median_ms"]) == {b.name for b in BUCKETS}
    assert all(t > 0 for t in record["median_ms"].values())
    assert "median_ms" in record["candidates"][config_key(gluon.heuristic)], record
    # The build renders the winner; the module runs it and is right.
    (artifact,) = [a for a in plan_build([spec], tmp_path) if a.relative_path.startswith("sm90/")
                   and a.entry["kind"] == "prefill"]  # fmt: skip
    assert f"config: tuned on {torch.cuda.get_device_name()}" in artifact.source
    module = _import(tmp_path / "tuned_gluon_prefill.py", artifact.source)
    assert {k: module.GLUON_CONFIG[k] for k in record["config"]} == record["config"]
    q, k, v, _ = random_inputs(spec, 2, 1500, 1700, seed=3, device="cuda")
    out, lse = module.attention(q, k, v, return_lse=True)
    assert module.forward_path() == module.GLUON_PATH
    assert compare_to_reference(spec, out, lse, q, k, v) == []
