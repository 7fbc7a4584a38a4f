"""The compiled tiling model (attngen/tiling/evaluate.py) gives the sympy model's exact numbers.

derive_tiles and derive_decode_tiles evaluate shared memory and registers through functions
lambdified ahead (evaluate.py's store), in floats; the registers are rounded up, so a float a
hair above an exact integer would cost a register and could flip a feasibility verdict. These
tests compare the compiled functions with the exact rational value of the expressions on every
padded head dim pair, both element sizes, every arch and both load paths, for every prefill
tile and the decode row tiles; and the worked formulas (one per Piecewise choice) with sympy's.
"""

from __future__ import annotations

import itertools
import math

import pytest
import sympy

from attngen.arch import ARCHS
from attngen.tiling.evaluate import LazyText, active_formula
from attngen.tiling.prefill import (
    BLOCK_M_CHOICES,
    BLOCK_N_CHOICES,
    MODEL_NAMES,
    NUM_STAGES_CHOICES,
    NUM_WARPS_CHOICES,
    exact_score,
    exact_waves,
    numeric_model,
    regs_model,
    smem_model,
)
from attngen.tiling.prefill_model import (
    BM,
    BN,
    MODEL_SYMBOLS,
    SMS,
    H,
    R,
    S,
    regs_expression,
    score_expression,
    smem_expression,
    wave_expression,
)
from attngen.tiling.symbolic import active_branch, exact_value

PADDED_DIMS = (16, 32, 64, 128, 256)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize(
    "tma, pipelined, dropout",
    [
        (True, True, False),
        (False, True, False),
        (False, False, False),
        (True, True, True),
        (False, False, True),
    ],
)
def test_compiled_model_equals_the_exact_expressions(
    arch: str, tma: bool, pipelined: bool, dropout: bool
) -> None:
    gpu = ARCHS[arch]
    smem_f, regs_f = numeric_model(gpu, tma, pipelined, dropout)
    smem_expr = smem_expression(gpu, tma, pipelined, dropout)
    regs_expr = regs_expression(gpu, pipelined, dropout)
    tiles = list(
        itertools.product(BLOCK_M_CHOICES, BLOCK_N_CHOICES, NUM_STAGES_CHOICES, NUM_WARPS_CHOICES)
    )
    checked = 0
    for d, e in itertools.product(PADDED_DIMS, (2, 4)):
        for dv in (d, 16, 256):  # equal dims, and the extremes of a differing value dim
            for bm, bn, s, w in tiles[::7]:  # a seventh of the grid; 7 is coprime to every axis
                values = dict(zip(MODEL_SYMBOLS, (bm, bn, s, w, d, dv, e), strict=True))
                at = tuple(values.values())
                assert int(smem_f(*at)) == int(exact_value(smem_expr, values)), (values, tma)
                exact_regs = exact_value(regs_expr, values)
                assert math.ceil(regs_f(*at)) == int(sympy.ceiling(exact_regs)), values
                checked += 1
    assert checked == 5 * 2 * 3 * len(tiles[::7])


def test_fraction_scores_and_waves_equal_the_sympy_expressions() -> None:
    """exact_score and exact_waves (Fractions) against score_expression and wave_expression
    substituted: the same numbers, the same floats and the same text (the header's waves)."""
    for bm, bn, s in itertools.product(BLOCK_M_CHOICES, BLOCK_N_CHOICES, (1, 2, 3, 4, 5)):
        want = exact_value(score_expression(), {BM: bm, BN: bn, S: s})
        got = exact_score(bm, bn, s)
        assert (got, float(got), str(got)) == (want, float(want), str(want)), (bm, bn, s)
    for heads, sms, bm, per_sm in itertools.product(
        (1, 7, 32, 64), (58, 132), (16, 64, 128), (1, 3)
    ):
        want = exact_value(wave_expression(), {H: heads, SMS: sms, BM: bm, R: per_sm})
        got = exact_waves(heads, sms, bm, per_sm)
        assert (got, float(got), str(got)) == (want, float(want), str(want)), (heads, bm)


def test_worked_formula_is_the_active_branch() -> None:
    gpu = ARCHS["sm90"]
    for tma, bm, bn, s, d in itertools.product(
        (True, False), (16, 64, 128), (32, 128), (1, 3), (64, 256)
    ):
        at = (bm, bn, s, 4, d, d, 2)
        values = dict(zip(MODEL_SYMBOLS, at, strict=True))
        named = dict(zip(MODEL_NAMES, at, strict=True))
        for model in (smem_model(gpu, tma), regs_model(gpu)):
            want = str(active_branch(model.expr(), values))
            assert active_formula(model, named) == want, (model.key, named)


def test_lazy_text_builds_once_when_read() -> None:
    calls = []

    def build() -> dict[str, str]:
        calls.append(1)
        return {"smem": "x"}

    text = LazyText(build)
    assert calls == []
    assert text["smem"] == "x" and dict(text) == {"smem": "x"} and len(text) == 1
    assert calls == [1]
