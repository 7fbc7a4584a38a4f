"""The backward tiling model against Triton's compiler (`attngen verify-tiling --backward`).

Every candidate of both gradient kernels of the examples with `backward: true` is compared with
the committed compiles (attngen/verify/data/backward_compile_triton-<version>.json): shared
memory exact, feasible configs that fit, safe configs that do not spill, the mma path the
model's branch assumes. A live sample recompiles records to prove the data current, and a
few specs that share a key are compiled to show the key holds what shared memory depends on.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from attngen.arch import ARCHS
from attngen.build import load_specs
from attngen.cli import app
from attngen.tiling.backward import KERNELS, derive_backward_tiles, regs_model, smem_model
from attngen.tiling.evaluate import compiled
from attngen.tiling.prefill import MODEL_NAMES
from attngen.tuning.database import tuned_backward_tiles
from attngen.verify.backward import plan_backward_rows
from attngen.verify.check import summarize, verify_tiling
from attngen.verify.measurements import (
    BackwardKey,
    backward_key,
    data_path,
    load_measurements,
    triton_version,
)
from attngen.verify.policy import SAFE_SPILL_BYTES, judge
from tests.kernel_harness import make_spec

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
SHAPES = ROOT / "tools/verify_specs/backward_shapes.yaml"
DATA = data_path(triton_version(), backward=True)
# Archs whose every candidate is in the data (mma.sync and wgmma, the model's two families):
# all five since the sm86 / sm89 / sm120 sweep (`attngen verify-tiling --backward --save-data
# --jobs N`). OTHER_ARCHS stays for archs added later, held to whatever records exist.
COMPLETE_ARCHS = ("sm80", "sm86", "sm89", "sm90", "sm120")
OTHER_ARCHS: tuple[str, ...] = ()


def needs_data(test):
    """The pinned Triton's backward measurements must be committed: a missing file is a
    failure to regenerate it, not a reason to skip the comparison."""

    def checked(*args, **kwargs):
        assert DATA.is_file(), f"no backward compiler measurements at {DATA}"
        return test(*args, **kwargs)

    return functools.wraps(test)(checked)


@pytest.fixture(scope="module")
def specs():
    return load_specs(EXAMPLES)


@pytest.fixture(scope="module")
def data():
    return load_measurements(DATA, BackwardKey)


def _judged(plan, data):
    judge(plan, data, {})
    failures = {row.key.label(): row.problems for row in plan.rows.values() if row.problems}
    return failures, summarize(row for row in plan.rows.values() if row.measured)


@needs_data
@pytest.mark.parametrize("arch", COMPLETE_ARCHS)
def test_every_backward_candidate_of_the_examples_matches_the_compiler_data(specs, data, arch):
    plan = plan_backward_rows(specs, [arch])
    missing = [key.label() for key in plan.rows if data.get(key) is None]
    assert not missing, f"regenerate (verify-tiling --backward --save-data): {missing[:5]}"
    failures, summary = _judged(plan, data)
    assert not failures
    assert summary.compiled == summary.rows == len(plan.rows)
    assert summary.exact == summary.compiled  # shared memory exact on every candidate
    assert summary.mma_agree == summary.compiled  # the model's branch is the compiler's path
    # every launch's whole grid (dQ, dK/dV, and its dV and dK launches) for each distinct
    # (dtype, D, DV, dropout) of the examples
    trained = [s for s in specs if s.backward]
    shapes = {
        backward_key(s, arch, "dq", derive_backward_tiles(s, arch).dq.chosen)[2:6] for s in trained
    }
    grid = len(derive_backward_tiles(trained[0], arch).dq.candidates)
    assert len(plan.rows) == len(KERNELS) * grid * len(shapes)


@needs_data
def test_recorded_configs_of_other_archs_and_shapes_match(specs, data):
    """Whatever the data has beyond the complete archs (other archs of the examples, the
    branch-covering shapes of tools/verify_specs/backward_shapes.yaml) holds too."""
    plans = [plan_backward_rows(specs, OTHER_ARCHS), plan_backward_rows(load_specs([SHAPES]), None)]
    checked = 0
    for plan in plans:
        plan.rows = {key: row for key, row in plan.rows.items() if data.get(key) is not None}
        failures, summary = _judged(plan, data)
        assert not failures
        assert summary.exact == summary.compiled and summary.under == 0
        checked += summary.compiled
    assert checked >= 100  # the shapes' sample at least


@needs_data
def test_live_sample_equals_the_data(specs, data):
    """Two 16-bit records recompiled now (one the model rejects): the same shared memory,
    registers and spills, so the data is what this Triton and these templates produce."""
    report = verify_tiling(
        specs, COMPLETE_ARCHS, data, sample=2, seed=sum(map(ord, "bwd")), planner=plan_backward_rows
    )
    assert report.live == 2
    assert not report.failed, [(r.key.label(), r.problems) for r in report.failed]


@needs_data
def test_spec_fields_outside_the_key_leave_shared_memory_alone(data):
    """A window with softcap and ALiBi (dQ), and plain MHA without a mask (dK/dV), compiled
    at a recorded wgmma config: the shared memory of llama3_8b's record (causal GQA)."""
    from attngen.verify.compiler import compile_many

    fields = dict(dtype="bf16", head_dim=128, backward=True, kernels=["prefill", "varlen"])
    heavy = make_spec(
        mask="sliding_window",
        window_left=100,
        window_right=3,
        softcap=30.0,
        alibi=True,
        num_q_heads=8,
        num_kv_heads=2,
        **fields,
    )
    plain = make_spec(mask="none", num_q_heads=4, num_kv_heads=4, **fields)
    config = derive_backward_tiles(heavy, "sm90").dq.chosen
    jobs = [(heavy, "sm90", config, "dq"), (plain, "sm90", config, "dkdv")]
    for (spec, arch, _, kernel), record in zip(jobs, compile_many(jobs), strict=True):
        recorded = data.get(backward_key(spec, arch, kernel, config))
        assert recorded is not None and record["error"] is None
        assert record["shared"] == recorded["shared"], (spec.name, kernel)


@needs_data
def test_cli_checks_the_backward_kernels(tmp_path):
    out = tmp_path / "report.json"
    result = CliRunner().invoke(
        app,
        [
            "verify-tiling",
            "--backward",
            str(ROOT / "examples/llama3_8b.yaml"),
            "--arch",
            "sm80",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "result: PASS" in result.output and "0 compiled live" in result.output
    assert "llama3_8b dkdv" in result.output  # the chosen config of each kernel
    report = json.loads(out.read_text())
    assert report["passed"] and len(report["rows"]) == 64 * len(KERNELS)  # one arch, one shape
    assert {row["kernel"] for row in report["rows"]} == set(KERNELS)
    refused = CliRunner().invoke(
        app, ["verify-tiling", "--backward", str(ROOT / "examples/gpt2.yaml")]
    )
    assert refused.exit_code == 1 and "none of the specs has backward: true" in refused.output


def test_a_forward_data_file_is_not_read_as_backward_records():
    with pytest.raises(ValueError, match="records keyed by"):
        load_measurements(data_path(triton_version()), BackwardKey)


SWEEP = DATA.with_name(f"backward_dropout_smem_triton-{triton_version()}.json")


def test_dropout_shared_memory_equals_every_allocator_record():
    """The keep mask's conversion scratch (keep_mask_scratch, and where a staged buffer holds
    it) against whole grids swept through Triton's allocator: every record exact."""
    records = json.loads(SWEEP.read_text())["records"]
    assert len(records) >= 700 and all(r["dropout"] for r in records)
    wrong = []
    for r in records:
        model = compiled(smem_model(ARCHS[r["arch"]], r["kernel"], True), MODEL_NAMES)
        predicted = int(
            model(
                r["BLOCK_M"],
                r["BLOCK_N"],
                r["num_stages"],
                r["num_warps"],
                r["D"],
                r["DV"],
                4 if r["dtype"] == "fp32" else 2,
            )
        )
        if predicted != r["shared"]:
            key = BackwardKey(**{f: r[f] for f in BackwardKey._fields})
            wrong.append((key.label(), predicted, r["shared"]))
    assert not wrong, wrong[:5]


def _predicted_regs(record: dict) -> int:
    model = compiled(regs_model(ARCHS[record["arch"]], record["kernel"]), MODEL_NAMES)
    e = 4 if record["dtype"] == "fp32" else 2
    dims = (record["BLOCK_M"], record["BLOCK_N"], record["num_stages"], record["num_warps"])
    return math.ceil(model(*dims, record["D"], record["DV"], e))


@needs_data
def test_no_config_the_register_model_calls_safe_spills_in_the_data():
    """Every 16-bit record of every arch (not only the examples' candidates: the whole D 64 and
    D 128 grids, the branch-covering shapes): a config predicted at or below the register
    limit spills at most the allowance. fp32 is never called safe (FMA dots)."""
    records = json.loads(DATA.read_text())["records"]
    checked, unsafe = 0, []
    for r in records:
        if r["error"] or r["dtype"] == "fp32":
            continue
        predicted = _predicted_regs(r)
        if predicted <= ARCHS[r["arch"]].max_regs_per_thread:
            checked += 1
            if (r["spill_stores"] or 0) > SAFE_SPILL_BYTES:
                key = BackwardKey(**{f: r[f] for f in BackwardKey._fields})
                unsafe.append((key.label(), predicted, r["spill_stores"]))
    assert {r["arch"] for r in records} >= set(COMPLETE_ARCHS)
    assert checked >= 900
    assert not unsafe, unsafe


@needs_data
def test_tuned_backward_configs_stay_accepted():
    """Every backward entry of tuning/ (llama3_8b and tools/bench_specs/backward_grid.yaml)
    is a feasible candidate of the current model (the build refuses it otherwise), and those
    the data holds without a spill are called safe."""
    paths = sorted((ROOT / "examples").glob("*.yaml")) + [
        ROOT / "tools/bench_specs/backward_grid.yaml"
    ]
    data = load_measurements(DATA, BackwardKey)
    tuned = 0
    for spec in (s for s in load_specs(paths) if s.backward):
        for arch in spec.archs:
            derivation = tuned_backward_tiles(ROOT / "tuning", spec, arch)
            for kernel in ("dq", "dkdv"):
                kernel_derivation = getattr(derivation, kernel)
                if kernel_derivation.source == "heuristic":
                    continue
                tuned += 1
                config = kernel_derivation.chosen
                candidate = next(c for c in kernel_derivation.candidates if c.config == config)
                record = data.get(backward_key(spec, arch, kernel, config))
                if record is not None and not record["spill_stores"]:
                    assert not candidate.may_spill(ARCHS[arch]), (spec.name, kernel, config)
    assert tuned >= 11  # every backward entry of tuning/sm90.json
