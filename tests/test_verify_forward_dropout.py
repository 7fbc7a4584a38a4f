"""Dropout in the forward kernel against Triton's compiler (`dropout: true`).

The keep mask's layout conversions take shared memory (tiling/dropout.py keep_mask_scratch);
a forward model without that term put bf16 D128 GQA's 128x128, 8-warp, 3-stage config at
230400 B on sm90, and Triton needs 246784 B, more than the H200 allows. Every candidate of
that spec on sm90 is in the compiler data (tools/verify_specs/forward_dropout.yaml), a seeded
share of seven shapes on sm80 and sm90 in an allocator sweep
(tools/verify_specs/forward_dropout_shapes.yaml, tools/backward_smem_sweep.py --forward).
"""

from __future__ import annotations

import json
from pathlib import Path

from attngen.arch import ARCHS
from attngen.build import load_specs
from attngen.spec import KernelKind
from attngen.tiling.evaluate import compiled
from attngen.tiling.prefill import MODEL_NAMES, TileConfig, derive_tiles, smem_model
from attngen.verify.check import judge, plan_rows, summarize
from attngen.verify.measurements import (
    MeasurementKey,
    data_path,
    load_measurements,
    measurement_key,
    triton_version,
)

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "tools/verify_specs/forward_dropout.yaml"
DATA = data_path(triton_version())
SWEEP = DATA.with_name(f"forward_dropout_smem_triton-{triton_version()}.json")
# The config the model without the keep mask chose on sm90, and what Triton needs for it.
OLD_CHOICE = TileConfig(128, 128, 8, 3)
OLD_CHOICE_SHARED = 246784


def test_every_sm90_candidate_matches_the_compiler_data_exactly():
    """Shared memory exact on all 128 candidates (the model's dropout keys, not the plain
    spec's), every feasible one fits and spills as the policy allows (the keep mask's
    registers counted), and the chosen config fits what the compiler needs, unspilled."""
    (spec,) = load_specs([SPEC])
    data = load_measurements(DATA)
    plan = plan_rows([spec], ["sm90"])
    assert all(key.dropout for key in plan.rows)
    assert not [key.label() for key in plan.rows if data.get(key) is None]
    judge(plan, data, {})
    assert not {row.key.label(): row.problems for row in plan.rows.values() if row.problems}
    summary = summarize(plan.rows.values())
    assert summary.exact == summary.compiled == len(plan.rows) == 128
    budget = ARCHS["sm90"].smem_budget
    chosen = derive_tiles(spec, "sm90").chosen_candidate
    assert chosen is not None
    record = data.get(measurement_key(spec, "sm90", chosen.config))
    assert record is not None and record["error"] is None
    assert record["shared"] == chosen.smem_bytes <= budget
    assert not record["spill_stores"] and not chosen.may_spill(ARCHS["sm90"])
    old = data.get(measurement_key(spec, "sm90", OLD_CHOICE))
    assert old is not None and old["shared"] == OLD_CHOICE_SHARED > budget
    assert chosen.config != OLD_CHOICE


def test_dropout_records_are_their_own_keys():
    """The plain spec's records (no keep mask) are not read for a dropout spec."""
    (spec,) = load_specs([SPEC])
    data = load_measurements(DATA)
    plain = spec.model_copy(update={"dropout": False})
    with_mask = data.get(measurement_key(spec, "sm90", OLD_CHOICE))
    without = data.get(measurement_key(plain, "sm90", OLD_CHOICE))
    assert with_mask is not None and without is not None
    assert with_mask["shared"] - without["shared"] == 128 * 128  # keep_mask_scratch there


def test_forward_dropout_equals_the_allocator_sweep():
    """Seven shapes (D 16 to 256, bf16, fp16, fp32, unaligned rows), sm80 and sm90: never
    under; 16-bit exact at head dims >= 59; fp32 over by at most its row-reduction scratch,
    as without dropout. Head dims 16 and 32 (which the model was never fitted to) may be over:
    the model without dropout is over by as much on those configs (512-2048 B, compiled
    without dropout on sm80 and sm90), the keep mask's term is what the compiler adds."""
    records = json.loads(SWEEP.read_text())["records"]
    assert len(records) >= 150 and all(r["dropout"] for r in records)
    wrong, exact_wide = [], 0
    for r in records:
        key = MeasurementKey(**{f: r[f] for f in MeasurementKey._fields})
        model = compiled(
            smem_model(ARCHS[key.arch], key.tma, key.aligned or key.tma, True), MODEL_NAMES
        )
        e = 4 if key.dtype == "fp32" else 2
        predicted = int(
            model(key.BLOCK_M, key.BLOCK_N, key.num_stages, key.num_warps, key.D, key.DV, e)
        )
        assert isinstance(r["shared"], int), (key.label(), r["shared"])
        over = predicted - r["shared"]
        if e == 4:
            ok = 0 <= over <= 4 * max(key.BLOCK_M, 32)
        elif key.D <= 32:
            ok = 0 <= over <= 4096
        else:
            ok = over == 0
            exact_wide += ok
        if not ok:
            wrong.append((key.label(), predicted, r["shared"]))
    assert not wrong, wrong[:5]
    assert exact_wide >= 90  # D 59, 64, 128 and 256 in 16-bit, both archs


def test_dropout_kernels_compile_with_the_launch_signature():
    """Live: the forward kernel of a dropout spec, prefill and varlen, compiles on sm80 (its
    seed, threshold and keep scale are arguments) and needs what the model says."""
    from attngen.verify.compiler import compile_many

    (spec,) = load_specs([SPEC])
    config = TileConfig(128, 32, 8, 2)  # BLOCK_M >= DV: P in registers, the scratch beside it
    model = {c.config: c.smem_bytes for c in derive_tiles(spec, "sm80").candidates}[config]
    for kind in (KernelKind.prefill, KernelKind.varlen):
        (record,) = compile_many([(spec, "sm80", config)], 1, kind)
        assert record["error"] is None, (kind, record["error"])
        assert record["shared"] == model, kind
