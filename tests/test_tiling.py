"""The tile derivation: feasibility, the choice, and the explanation, per arch."""

from __future__ import annotations

import math

import pytest

from attngen.arch import ARCHS
from attngen.build import BuildError, plan_build
from attngen.cli.explain import explain_one
from attngen.tiling.prefill import REFERENCE_TOKENS, TileConfig, derive_tiles
from attngen.tiling.prefill_model import BM, BN, DV, D, E, S, smem_expression
from tests.kernel_harness import make_spec

# (arch, dtype, D, BLOCK_M, BLOCK_N, stages) -> bytes Triton 3.6 reported for the compiled
# template (launch-time specialization); the model must never be below these.
COMPILED_SMEM = [
    ("sm90", 2, 128, 128, 128, 3, 229376),
    ("sm90", 2, 128, 128, 64, 2, 98304),
    ("sm90", 2, 256, 64, 128, 2, 294912),
    ("sm90", 2, 256, 64, 64, 2, 163840),
    ("sm90", 2, 128, 32, 32, 2, 26624),
    ("sm80", 2, 128, 128, 64, 3, 98304),
    ("sm80", 2, 128, 64, 128, 2, 98304),
    ("sm80", 2, 256, 128, 128, 2, 229376),
    ("sm80", 4, 64, 128, 128, 2, 164352),
    ("sm86", 2, 128, 64, 64, 3, 90112),
]


@pytest.mark.parametrize("arch, e, d, bm, bn, s, compiled", COMPILED_SMEM)
def test_smem_model_is_exact_or_above_the_compiler(arch, e, d, bm, bn, s, compiled):
    predicted = int(smem_expression(ARCHS[arch]).subs({BM: bm, BN: bn, D: d, DV: d, E: e, S: s}))
    assert compiled <= predicted <= compiled + bm * bn * e + 4 * bm


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize(
    "dtype, head_dim", [("bf16", 64), ("bf16", 128), ("fp16", 96), ("bf16", 256), ("fp32", 128)]
)
def test_chosen_config_is_feasible_and_best(arch, dtype, head_dim):
    spec = make_spec(dtype=dtype, head_dim=head_dim, archs=[arch])
    derivation = derive_tiles(spec, arch)
    chosen = derivation.chosen_candidate
    assert chosen is not None and chosen.feasible
    assert chosen.smem_bytes <= ARCHS[arch].smem_budget
    safe = [c for c in derivation.candidates if c.feasible and not c.may_spill(ARCHS[arch])]
    if safe:  # no spills first (predicted), then the best score
        assert not chosen.may_spill(ARCHS[arch])
        assert all(c.score <= chosen.score for c in safe)
    else:
        assert all(c.score <= chosen.score for c in derivation.candidates if c.feasible)
    for cand in derivation.candidates:
        assert cand.feasible == (not cand.rejected)
        if cand.smem_bytes > ARCHS[arch].smem_budget:
            assert any(r.startswith("smem") for r in cand.rejected)


def test_smaller_budget_gives_smaller_tiles():
    spec = make_spec(dtype="bf16", head_dim=256, archs=["sm86", "sm90"])
    small = derive_tiles(spec, "sm86").chosen_candidate
    large = derive_tiles(spec, "sm90").chosen_candidate
    assert small.smem_bytes <= ARCHS["sm86"].smem_budget < large.smem_bytes


def test_explain_names_choice_binding_and_headroom():
    spec = make_spec(dtype="bf16", head_dim=128, archs=["sm86"])
    text = "\n".join(explain_one(spec, derive_tiles(spec, "sm86")))
    chosen = derive_tiles(spec, "sm86").chosen
    assert f"BLOCK_M={chosen.block_m} BLOCK_N={chosen.block_n}" in text
    assert "binding constraint:" in text and "headroom:" in text and "rejected: smem" in text


def test_spec_no_arch_can_serve_is_refused_before_rendering(monkeypatch):
    import attngen.tiling.prefill as tiling

    monkeypatch.setattr(tiling, "BLOCK_M_CHOICES", (128,))
    monkeypatch.setattr(tiling, "BLOCK_N_CHOICES", (128,))
    monkeypatch.setattr(tiling, "NUM_WARPS_CHOICES", (4,))
    tiling.derive_tiles.cache_clear()
    try:
        spec = make_spec(dtype="fp32", head_dim=256, archs=["sm86"], name="huge")
        with pytest.raises(BuildError, match="no prefill tile config fits sm86"):
            plan_build([spec])
    finally:
        tiling.derive_tiles.cache_clear()


def test_wave_efficiency_counts_rounds_of_resident_programs():
    # 32 heads x 4096 tokens on sm80's 108 SMs: 128-row tiles give 1024 programs, 9.48 rounds
    # of 108 at one program per SM, so the tenth round is 48% busy; the score carries it.
    spec = make_spec(dtype="bf16", head_dim=128, num_q_heads=32, num_kv_heads=8, archs=["sm80"])
    arch = ARCHS["sm80"]
    for cand in derive_tiles(spec, "sm80").candidates:
        if not cand.feasible:
            assert cand.wave_efficiency == 0.0
            continue
        programs = 32 * math.ceil(REFERENCE_TOKENS / cand.config.block_m)
        waves = programs / (arch.sm_count * cand.programs_per_sm)
        # Candidate.wave_efficiency is stored rounded to 4 decimals (error <= 5e-5 < 1e-4).
        assert cand.wave_efficiency == pytest.approx(waves / math.ceil(waves), abs=1e-4)
        assert 0 < cand.wave_efficiency <= 1
    by_config = {c.config: c for c in derive_tiles(spec, "sm80").candidates}
    chosen_before = by_config[TileConfig(128, 64, 8, 3)]
    assert chosen_before.wave_efficiency == pytest.approx(1024 / 1080, abs=1e-4)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_occupancy_counts_the_driver_reserve_per_block(arch):
    spec = make_spec(dtype="bf16", head_dim=64, archs=[arch])
    target = ARCHS[arch]
    per_block = target.smem_block_cost  # 1 KiB: ptxas's static 1 KiB where it has one is it
    assert target.smem_block_reserve == 1024 and per_block == 1024
    cut_by_reserve = 0
    for cand in derive_tiles(spec, arch).candidates:
        if cand.programs_per_sm:
            assert cand.programs_per_sm * (cand.smem_bytes + per_block) <= target.smem_per_sm
        without = target.smem_per_sm // cand.smem_bytes
        cut_by_reserve += without > target.smem_per_sm // (cand.smem_bytes + per_block)
    assert cut_by_reserve  # some tile shapes lose a resident program to the reserve


def test_the_h200_fits_two_64x64_programs_at_d128_exactly():
    """The measured case behind `smem_block_cost`: 115712 B + 1 KiB, twice, is the SM's
    228 KiB, and that config was 1.5x faster than its variant asking 24 bytes more."""
    spec = make_spec(
        dtype="bf16", head_dim=128, archs=["sm90"], mask="causal", causal_align="bottom_right"
    )
    by_config = {c.config: c for c in derive_tiles(spec, "sm90").candidates}
    cand = by_config[TileConfig(64, 64, 4, 3)]
    assert cand.smem_bytes == 115712 and cand.programs_per_sm == 2
    assert ARCHS["sm90"].smem_per_sm // (cand.smem_bytes + 24 + 1024) == 1
