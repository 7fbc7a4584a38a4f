"""The Gluon forward's autotune (attngen/tuning/autotune_gluon.py) and its tuning field, on the
CPU: the Gluon kernel does not run under Triton's interpreter, so the loop is driven with its
measurement stubbed (the stub checks the module it was handed was rendered with the
candidate), and the real measurement is checked to refuse a call that ran the tile-level
kernel. tests/test_tuning_gluon_gpu.py runs the real thing on the H200."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from attngen.build import plan_build
from attngen.cli.explain import explain_lines
from attngen.reference import random_inputs, reference_attention
from attngen.spec import KernelKind
from attngen.tiling.gluon import derive_gluon_tiles
from attngen.tiling.gluon_backward import derive_gluon_backward
from attngen.tuning import autotune_gluon
from attngen.tuning.autotune import Bucket, autotune
from attngen.tuning.database import (
    TUNING_SCHEMA,
    TuningError,
    entry_key,
    gluon_knobs,
    lookup,
    read_tuning_file,
    tuned_gluon,
)
from attngen.tuning.measure import config_key
from tests.kernel_harness import make_spec

SPEC = make_spec(dtype="bf16", head_dim=64, name="gluon_tuned")
TINY = (Bucket("tiny", 1, 40), Bucket("small", 1, 64))
DERIVED = derive_gluon_tiles(SPEC, "sm90").chosen.config
# The fake GPU's fastest: a feasible candidate the derivation does not choose.
FASTEST = next(
    c.config
    for c in derive_gluon_tiles(SPEC, "sm90").candidates
    if c.feasible and c.config.block_n == 64 and c.config.consumers == 3
)


def _fake_gluon_measure(module, spec, candidate, inputs, run):
    """Stands in for the GPU: each candidate's module must carry that candidate's config."""
    rendered = module.GLUON_CONFIG
    assert {k: rendered[k] for k in gluon_knobs(candidate.config)} == gluon_knobs(candidate.config)
    assert module._GLUON_OPTIONS["maxnreg"] == candidate.config.maxnreg
    ms = 0.5 if candidate.config == FASTEST else 1.0 + candidate.config.stages / 10
    return {"median_ms": {bucket: ms for bucket in inputs}}


def _fake_tile_measure(module, spec, config, inputs, device, timer):
    return {"median_ms": {bucket: 1.0 + config.block_n / 1000 for bucket in inputs}}


def _autotune(tmp_path: Path, specs=(SPEC,), max_configs=16):
    console = Console(file=open(tmp_path / "log.txt", "w"), width=200)
    return autotune(list(specs), tmp_path, budget_s=120, max_configs=max_configs, arch="sm90",
                    console=console, device="cpu", buckets=TINY, timer=lambda fn: 1.0,
                    kernels="forward")  # fmt: skip


@pytest.fixture
def stubbed(monkeypatch):
    monkeypatch.setattr(autotune_gluon, "_measure", _fake_gluon_measure)
    monkeypatch.setattr("attngen.tuning.autotune._measure", _fake_tile_measure)


def _write_gluon(folder: Path, knobs: dict, spec=SPEC, **extra) -> None:
    record = {"config": knobs, "gpu": "NVIDIA H200", "triton": "3.6.0", "date": "2026-12-10",
              "complete": True, "median_ms": {"tiny": 0.5}}  # fmt: skip
    entry = {"spec_name": spec.name, "gluon": record, **extra}
    data = {"schema": TUNING_SCHEMA, "arch": "sm90",
            "entries": {entry_key(spec, KernelKind.prefill): entry}}  # fmt: skip
    folder.mkdir(exist_ok=True)
    (folder / "sm90.json").write_text(json.dumps(data))


def test_candidates_are_the_feasible_gluon_configs_derived_first():
    derivation = derive_gluon_tiles(SPEC, "sm90")
    cands = autotune_gluon.gluon_candidates(SPEC, "sm90", 16)
    assert cands[0] == derivation.chosen
    assert set(cands) == {c for c in derivation.candidates if c.feasible}
    assert len(cands) == 12 and any(c.config.consumers == 3 for c in cands)  # D 64: all 12
    assert autotune_gluon.gluon_candidates(SPEC, "sm90", 2) == cands[:2]
    # Modules without the Gluon forward have nothing to tune.
    for spec, arch in ((make_spec(head_dim=96), "sm90"), (SPEC, "sm80")):
        assert autotune_gluon.gluon_candidates(spec, arch, 16) == []


def test_autotune_records_the_gluon_winner_and_the_build_renders_it(tmp_path, stubbed):
    outcomes = _autotune(tmp_path)
    gluon = next(o for o in outcomes if o.kernel == "gluon")
    assert gluon.winner == FASTEST and gluon.heuristic == DERIVED and gluon.complete
    entry = read_tuning_file(tmp_path / "sm90.json")["entries"][entry_key(SPEC, KernelKind.prefill)]
    record = entry["gluon"]
    assert record["config"] == gluon_knobs(FASTEST) and record["derived"] == gluon_knobs(DERIVED)
    assert record["median_ms"] == {"tiny": 0.5, "small": 0.5}
    assert record["derived_ms"] == {"tiny": 1.3, "small": 1.3}  # 3 stages
    assert len(record["candidates"]) == 12 and record["kernel_digest"]
    assert "config" in entry  # the tile-level winner beside it
    # A second tile-level record keeps the Gluon field; the build renders the winner.
    _autotune(tmp_path)
    entry = read_tuning_file(tmp_path / "sm90.json")["entries"][entry_key(SPEC, KernelKind.prefill)]
    assert entry["gluon"]["config"] == gluon_knobs(FASTEST)
    (artifact,) = plan_build([SPEC], tmp_path)
    assert (
        f'GLUON_CONFIG = {{"NUM_CONSUMERS": 3, "BLOCK_M": 64, "BLOCK_N": 64, '
        f'"STAGES": {FASTEST.stages},' in artifact.source
    )
    assert f'"maxnreg": {FASTEST.maxnreg}}}' in artifact.source
    assert "config: tuned on cpu (interpreter)" in artifact.source
    text = "\n".join(explain_lines([SPEC], ["sm90"], tmp_path))
    assert "config: tuned on cpu (interpreter)" in text and "config: derived" not in text


def test_gluon_progress_is_kept_per_kernel_text(tmp_path, stubbed, monkeypatch):
    _autotune(tmp_path)
    calls = []
    monkeypatch.setattr(autotune_gluon, "_measure", lambda *a: calls.append(a) or {"error": "x"})
    _autotune(tmp_path)
    assert calls == []  # every candidate found in the progress file
    monkeypatch.setattr(autotune_gluon, "kernel_digest", lambda module: "changed-kernel")
    _autotune(tmp_path)
    assert len(calls) == 12


def test_a_failing_candidate_never_wins(tmp_path, monkeypatch, stubbed):
    def failing(module, spec, candidate, inputs, run):
        if candidate.config == FASTEST:
            return {"error": "incorrect: out differs"}
        return _fake_gluon_measure(module, spec, candidate, inputs, run)

    monkeypatch.setattr(autotune_gluon, "_measure", failing)
    gluon = next(o for o in _autotune(tmp_path) if o.kernel == "gluon")
    assert config_key(gluon.winner) == "2x64x128x2"  # of the 2-stage ties, the first key
    record = read_tuning_file(tmp_path / "sm90.json")["entries"][
        entry_key(SPEC, KernelKind.prefill)
    ]["gluon"]
    assert record["candidates"][config_key(FASTEST)] == {"error": "incorrect: out differs"}


def test_under_the_interpreter_the_measurement_refuses_at_once(tmp_path):
    """Triton's interpreter runs no Gluon kernel: the real measurement says so, no time."""
    console = Console(file=open(tmp_path / "log.txt", "w"), width=200)
    outcomes = autotune([SPEC], tmp_path, budget_s=120, max_configs=1, arch="sm90",
                        console=console, device="cpu", buckets=TINY[:1],
                        timer=lambda fn: (fn(), 1.0)[1], kernels="forward")  # fmt: skip
    tile, gluon = outcomes
    assert tile.winner is not None and gluon.winner is None and gluon.tried == 1
    progress = json.loads((tmp_path / ".progress-sm90.json").read_text())["results"]
    (result,) = [r for key, r in progress.items() if "/gluon/" in key]
    assert result[config_key(DERIVED)]["error"] == (
        "RuntimeError: here the module runs \"tile-level: Triton's interpreter runs no Gluon "
        'kernel"'
    )
    entry = read_tuning_file(tmp_path / "sm90.json")["entries"][entry_key(SPEC, KernelKind.prefill)]
    assert "gluon" not in entry


class _FakeModule:
    """A module whose forward ran the tile-level kernel on `tile_level_from` calls on: the
    gate's (call 0) or a bucket's; its outputs are the float64 golden's, so the gate passes."""

    GLUON_PATH, POINTER_LOADS_UP_TO = "gluon warp-specialized", 512

    def __init__(self, tile_level_from: int):
        self.calls, self.tile_level_from, self.path = 0, tile_level_from, ""

    def expected_forward_path(self):
        return self.GLUON_PATH

    def forward_path(self):
        return self.path

    def attention(self, q, k, v, alibi_slopes=None, return_lse=False):
        tile = self.calls >= self.tile_level_from
        self.path = "tile-level: a base address is not 16-byte aligned" if tile else self.GLUON_PATH
        self.calls += 1
        out, lse = reference_attention(SPEC, q, k, v, alibi_slopes=alibi_slopes)
        return (out.to(q.dtype), lse.float()) if return_lse else out.to(q.dtype)


@pytest.mark.parametrize("tile_level_from, where", [(0, "the gate"), (1, "tiny")])
def test_a_call_that_ran_the_tile_level_kernel_is_an_error_not_a_time(tile_level_from, where):
    module = _FakeModule(tile_level_from)
    run = SimpleNamespace(device="cpu", timer=lambda fn: (fn(), 1.0)[1])
    candidate = derive_gluon_tiles(SPEC, "sm90").chosen
    inputs = {"tiny": random_inputs(SPEC, 1, 40, 40, seed=1)}
    result = autotune_gluon._measure(module, SPEC, candidate, inputs, run)
    assert result == {
        "error": f"RuntimeError: {where}: the call ran 'tile-level: a base address is not "
        "16-byte aligned', not the Gluon kernel"
    }
    # The gate's batch takes the launch past POINTER_LOADS_UP_TO: 8 row blocks x 4 heads x
    # 11 key blocks = 352 a sequence, so 2 sequences.
    assert autotune_gluon._gate_batch(module, SPEC, candidate) == 2
    fine = _FakeModule(99)
    assert autotune_gluon._measure(fine, SPEC, candidate, inputs, run) == {
        "median_ms": {"tiny": 1.0}
    }


@pytest.mark.parametrize(
    "d, knobs, why",
    [
        (
            128,
            {"NUM_CONSUMERS": 3, "BLOCK_M": 64, "BLOCK_N": 128, "STAGES": 2},
            "consumer regs ~192",
        ),
        (64, {"NUM_CONSUMERS": 2, "BLOCK_M": 64, "BLOCK_N": 256, "STAGES": 2}, "not a candidate"),
    ],
)
def test_an_infeasible_tuned_gluon_config_is_ignored_and_explained(tmp_path, d, knobs, why):
    spec = make_spec(dtype="bf16", head_dim=d, name="gluon_tuned")
    _write_gluon(tmp_path, knobs, spec)
    derivation = tuned_gluon(tmp_path, spec, "sm90")
    derived = derive_gluon_tiles(spec, "sm90").chosen.config
    assert derivation.chosen.config == derived
    assert derivation.source.startswith(f"derived; the tuned {knobs} (NVIDIA H200, 2026-12-10)")
    assert why in derivation.source
    (artifact,) = plan_build([spec], tmp_path)
    (plain,) = plan_build([spec])
    assert f'"BLOCK_N": 128, "STAGES": {derived.stages},' in artifact.source  # the derived one
    assert artifact.source.replace(f"#     config: {derivation.source}\n", "") == plain.source
    text = "\n".join(explain_lines([spec], ["sm90"], tmp_path))
    assert f"config: {derivation.source}" in text


def test_a_malformed_gluon_field_is_refused(tmp_path):
    _write_gluon(tmp_path, {"NUM_CONSUMERS": 2, "BLOCK_N": 64})
    with pytest.raises(TuningError, match="'gluon' is malformed"):
        plan_build([SPEC], tmp_path)


def test_a_tuned_forward_and_the_gluon_backward_keep_their_own_register_splits(tmp_path):
    """A module's Gluon forward and dK/dV kernels launch with their own setmaxnreg splits, so a
    tuned forward of another consumer count leaves the backward's as derived."""
    spec = make_spec(dtype="bf16", head_dim=64, name="gluon_tuned", backward=True)
    _write_gluon(tmp_path, gluon_knobs(FASTEST), spec)
    assert tuned_gluon(tmp_path, spec, "sm90").chosen.config == FASTEST  # three consumers
    backward = derive_gluon_backward(spec, "sm90").chosen.config
    assert (FASTEST.consumer_regs, FASTEST.maxnreg) != (backward.consumer_regs, backward.maxnreg)
    (source,) = [a.source for a in plan_build([spec], tmp_path) if "sm90/" in a.relative_path
                 and "_prefill_" in a.relative_path]  # fmt: skip
    assert f'_GLUON_OPTIONS = {{"num_warps": 4, "maxnreg": {FASTEST.maxnreg}}}' in source
    assert f'"CONSUMER_REGS": {backward.consumer_regs}, "PRODUCER_REGS": 24,' in source
    assert f'"num_warps": 4, "maxnreg": {backward.maxnreg}}}' in source


def test_modules_without_the_gluon_forward_are_unaffected(tmp_path, stubbed):
    other = make_spec(dtype="fp16", head_dim=96, name="tile_only")
    outcomes = _autotune(tmp_path, specs=(other,), max_configs=2)
    assert [o.kernel for o in outcomes] == ["prefill"]
    entry = read_tuning_file(tmp_path / "sm90.json")["entries"][
        entry_key(other, KernelKind.prefill)
    ]
    assert "gluon" not in entry
    (tile_tuned,) = plan_build([other], tmp_path)
    _write_gluon(tmp_path, gluon_knobs(FASTEST), other, **entry)  # a stray field changes nothing
    assert tuned_gluon(tmp_path, other, "sm90") is None
    assert plan_build([other], tmp_path)[0].source == tile_tuned.source
    text = "\n".join(explain_lines([other], ["sm90"], tmp_path))
    assert "forward (prefill): tile-level (prefill.py.jinja) only" in text


def test_tuning_files_with_and_without_the_gluon_field_load(tmp_path):
    # The repository's file (no Gluon field): the build and explain read it as before.
    root = Path(__file__).resolve().parents[1] / "tuning"
    assert tuned_gluon(root, SPEC, "sm90").source == "derived"
    text = "\n".join(explain_lines([SPEC], ["sm90"], root))
    assert "config: derived" in text
    # An entry holding only the Gluon field: the tile-level kernel stays on its heuristic.
    _write_gluon(tmp_path, gluon_knobs(FASTEST))
    assert lookup(tmp_path, SPEC, KernelKind.prefill, "sm90") is None
    (artifact,) = plan_build([SPEC], tmp_path)
    assert artifact.entry["config_source"] == "heuristic"
