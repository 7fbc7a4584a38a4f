"""The tiling model against Triton's compiler (attngen.verify.check, `attngen verify-tiling`).

The full comparison reads the committed compiler measurements (no compile, seconds); a small live
sample recompiles configs of that data to prove it is current for the installed Triton, and
a few configs the model rejects are compiled to show they really do not fit.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from attngen.arch import ARCHS
from attngen.build import load_specs
from attngen.cli import app
from attngen.spec import KernelKind
from attngen.tiling.prefill import derive_tiles
from attngen.verify.check import plan_rows, summarize, verify_tiling
from attngen.verify.measurements import (
    current_template_hash,
    data_path,
    load_measurements,
    measurement_key,
    save_measurements,
    triton_version,
)
from attngen.verify.policy import OTHER_SPEC_SPILL_BYTES, judge

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
# The live compiles run on these; sm120 (sm86's budgets) is held to the committed data only.
LIVE_ARCHS = ("sm80", "sm86", "sm89", "sm90")
DATA = data_path(triton_version())


def needs_data(test):
    """The measurements of the pinned Triton (the test extra pins 3.6.0) must be committed: a
    missing file is a failure to regenerate it (`attngen verify-tiling --save-data`), not a
    reason to skip the comparison."""

    def checked(*args, **kwargs):
        assert DATA.is_file(), f"no compiler measurements for triton {triton_version()} at {DATA}"
        return test(*args, **kwargs)

    return functools.wraps(test)(checked)


@pytest.fixture(scope="module")
def specs():
    return load_specs(EXAMPLES)


@needs_data
@pytest.mark.parametrize("arch", [*LIVE_ARCHS, "sm120"])
def test_every_candidate_of_every_example_matches_the_compiler_data(specs, arch):
    data = load_measurements(DATA)
    plan = plan_rows(specs, [arch])
    missing = [key.label() for key in plan.rows if data.get(key) is None]
    assert not missing, f"regenerate the data (attngen verify-tiling --save-data): {missing[:5]}"
    judge(plan, data, {})
    failures = {row.key.label(): row.problems for row in plan.rows.values() if row.problems}
    assert not failures
    summary = summarize(plan.rows.values())
    assert summary.compiled == summary.rows == len(plan.rows)
    assert summary.under == 0  # never below the compiler
    assert summary.exact / summary.compiled >= 0.95
    assert summary.mma_agree == summary.compiled  # the model's branch is the compiler's path
    # every candidate of every spec is there: the whole grid per distinct (dtype, D, DV)
    # (of the specs with a prefill kind: a decode-only spec is decode_compile_check's)
    prefill = [s for s in specs if {KernelKind.prefill, KernelKind.varlen} & set(s.kernels)]
    shapes = {measurement_key(s, arch, derive_tiles(s, arch).chosen)[1:4] for s in prefill}
    assert len(plan.rows) == len(shapes) * len(derive_tiles(specs[0], arch).candidates)


@needs_data
def test_live_sample_equals_the_data(specs):
    """Ten random 16-bit configs of the data, recompiled now: same shared memory, registers
    and spills, so the committed data is what this Triton and these templates produce."""
    data = load_measurements(DATA)
    report = verify_tiling(specs, LIVE_ARCHS, data, sample=10, seed=triton_seed(), processes=2)
    assert report.live == 10
    assert not report.failed, [(r.key.label(), r.problems) for r in report.failed]


def triton_seed() -> int:
    return sum(map(ord, triton_version()))  # fixed per Triton version, different across them


@needs_data
def test_rejected_configs_really_exceed_the_budget(specs):
    """Configs rejected for shared memory, compiled now: the compiler needs more than the
    arch allows, on each arch of LIVE_ARCHS."""
    from attngen.verify.compiler import compile_many

    data = load_measurements(DATA)
    llama = [s for s in specs if s.name == "llama3_8b"]
    picks = []
    for arch in LIVE_ARCHS:
        plan = plan_rows(llama, [arch])
        rejected = sorted(
            (
                r
                for r in plan.rows.values()
                if any(x.startswith("smem") for x in r.candidate.rejected)
                and data.get(r.key)["compile_s"] < 2
            ),
            key=lambda r: r.candidate.smem_bytes,
        )
        picks.append(rejected[0])  # the closest to the budget: the sharpest test
    records = compile_many([(data.spec_of(r.key), r.key.arch, r.key.config) for r in picks])
    for row, record in zip(picks, records, strict=True):
        assert record["error"] is None
        assert record["shared"] > ARCHS[row.key.arch].smem_budget, row.key.label()


@needs_data
def test_cli_reads_the_data_and_writes_json(tmp_path):
    out = tmp_path / "report.json"
    result = CliRunner().invoke(
        app,
        ["verify-tiling", str(ROOT / "examples/gpt2.yaml"), "--arch", "sm86", "--json", str(out)],
    )
    assert result.exit_code == 0, result.output
    assert "result: PASS" in result.output and "0 compiled live" in result.output
    report = json.loads(out.read_text())
    assert report["passed"] and len(report["rows"]) == 128


@needs_data
def test_cli_fails_on_a_feasible_config_the_compiler_cannot_fit(tmp_path, specs):
    data = load_measurements(DATA)
    gpt2 = next(s for s in specs if s.name == "gpt2")
    plan = plan_rows([gpt2], ["sm86"])
    feasible = next(r for r in plan.rows.values() if r.candidate.feasible)
    data.records[feasible.key]["shared"] = ARCHS["sm86"].smem_budget + 16  # doctored
    doctored = tmp_path / "measurements.json"
    doctored.write_text(data.dumps())
    result = CliRunner().invoke(
        app,
        [
            "verify-tiling",
            str(ROOT / "examples/gpt2.yaml"),
            "--arch",
            "sm86",
            "--data",
            str(doctored),
        ],
    )
    assert result.exit_code == 1
    assert "FAILED: 1 config(s)" in result.output and feasible.key.label() in result.output


@needs_data
def test_other_specs_of_a_key_are_held_to_their_spill_bound(specs):
    """--every-spec: a safe config compiled for another spec of its key may spill up to
    OTHER_SPEC_SPILL_BYTES (ptxas's per-spec register variance), not more."""
    data = load_measurements(DATA)
    plan = plan_rows(specs, ["sm86"])
    row = next(r for r in plan.rows.values() if r.candidate.feasible and not r.may_spill)
    record = dict(data.get(row.key))
    within = {**record, "spill_stores": OTHER_SPEC_SPILL_BYTES}
    beyond = {**record, "spill_stores": OTHER_SPEC_SPILL_BYTES + 8}
    judge(plan, data, {}, others={row.key: [("phi3-within", within)]})
    assert not row.problems and any("phi3-within" in n for n in row.notes)
    row.notes.clear()
    judge(plan, data, {}, others={row.key: [("phi3-beyond", beyond)]})
    assert any("phi3-beyond" in p for p in row.problems)


@needs_data
def test_a_missing_record_is_compiled_and_saved_with_the_template_hash(tmp_path, specs):
    """verify_tiling(save_to=...) (`--save-data`): what it compiles live is written to the file
    (atomically, stamped with the current templates' hash); the records it had stay."""
    data = load_measurements(DATA)
    gpt2 = next(s for s in specs if s.name == "gpt2")
    key = measurement_key(gpt2, "sm86", derive_tiles(gpt2, "sm86").chosen)
    recorded = data.records.pop(key)
    kept = len(data.records)
    path = tmp_path / "measurements.json"
    report = verify_tiling([gpt2], ["sm86"], data, save_to=path)
    assert report.live == 1 and not report.failed
    saved = load_measurements(path)
    assert saved.template_hash == current_template_hash() == report.template_hash
    assert len(saved.records) == kept + 1
    # the record may come from another spec of the key: only shared memory and the code path
    # are the same for every spec
    fields = ("shared", "mma", "error")
    assert {f: saved.get(key)[f] for f in fields} == {f: recorded[f] for f in fields}
    assert saved.get(key)["spec"].startswith("gpt2-")
    assert not save_measurements(saved, path)  # the same bytes: nothing written


ODD_DIMS = ROOT / "tools/verify_specs/odd_head_dims.yaml"


@needs_data
def test_odd_head_dims_match_the_compiler_data_on_hopper():
    """Head dims 59 and 111 in fp16 (rows of 118 and 222 bytes): pointer loads without TMA and
    without pipelining; every candidate on sm90 against the committed compiles. Shared memory
    must be exact (a stage more buffers nothing) and the unaligned register model keep the
    spill policy."""
    data = load_measurements(DATA)
    plan = plan_rows(load_specs([ODD_DIMS]), ["sm90"])
    assert all(not key.tma and not key.aligned for key in plan.rows)
    assert not [key.label() for key in plan.rows if data.get(key) is None]
    judge(plan, data, {})
    assert not {row.key.label(): row.problems for row in plan.rows.values() if row.problems}
    summary = summarize(plan.rows.values())
    assert summary.exact == summary.compiled == 256


def test_odd_head_dims_compile_as_modelled_on_ampere():
    """Live: two sm80 configs of head dim 59 (the chosen one and a 3-stage one) need the
    shared memory the unaligned model says, and the chosen one does not spill."""
    from attngen.verify.compiler import compile_many

    spec = next(s for s in load_specs([ODD_DIMS]) if s.head_dim == 59)
    derivation = derive_tiles(spec, "sm80")
    chosen = derivation.chosen
    staged = next(
        c
        for c in derivation.candidates
        if c.config.num_stages == 3
        and c.config.block_m == 64
        and c.config.block_n == 64
        and c.feasible
    )
    records = compile_many([(spec, "sm80", chosen), (spec, "sm80", staged.config)])
    model = {c.config: c.smem_bytes for c in derivation.candidates}
    assert [r["shared"] for r in records] == [model[chosen], model[staged.config]]
    assert records[0]["error"] is None and (records[0]["spill_stores"] or 0) <= 64
