"""The sympy model of what a prefill tile config costs (prefill.py evaluates it on every
candidate through evaluate.py's store and chooses): shared memory per program, registers per
thread, a predicted efficiency and the wave quantization on a reference problem, in the tile
parameters BLOCK_M, BLOCK_N, the padded head dims D and DV, element bytes E, num_stages S and
num_warps W. The decode and backward models (decode.py, backward_model.py) reuse its symbols
and parts."""

from __future__ import annotations

from functools import cache, partial

import sympy

from attngen.arch import GpuArch
from attngen.tiling import dropout as drop
from attngen.tiling.prefill import REFERENCE_TOKENS, TMA_MASKED_MAX_HEAD_DIM

BM, BN, D, DV, E, S, W = sympy.symbols("BLOCK_M BLOCK_N D DV E S W", positive=True, integer=True)
# Wave quantization: H query heads x REFERENCE_TOKENS rows in BLOCK_M tiles, R programs
# resident per SM, SMS streaming multiprocessors.
H, R, SMS = sympy.symbols("H R SMS", positive=True, integer=True)


@cache  # sympy builds it slowly; one per arch serves every derivation
def smem_expression(
    arch: GpuArch, tma: bool = True, pipelined: bool = True, dropout: bool = False
) -> sympy.Expr:
    """Dynamic shared memory per program in bytes, as Triton 3.6 allocates it for this template.

    Fitted to the compiler on 584 configs (docs/results/tiling_fit_set_584.json) and checked
    by `attngen verify-tiling` (attngen/verify/compiler.py, docs/tiling.md): exact on all 1920
    16-bit candidate configs of the example specs on sm80/86/89/90/120, never under; fp32 is
    over by at most its row-reduction scratch (counted always). Q is staged once; the key loops and
    the epilogue's BLOCK_M x DV layout conversion reuse the same bytes.
    - wgmma (Hopper, 16-bit, BLOCK_M >= 64): S buffers each of K and V; P stays in registers.
    - mma.sync (16-bit otherwise): max(S - 1, 1) buffers; P goes through shared memory only
      when the compiler splits warps along N, i.e. BLOCK_M < DV.
    - fp32 (IEEE dot -> FMA, every arch): like mma.sync with P always staged, plus up to
      4 * max(BLOCK_M, 32) bytes of row-reduction scratch (counted always: an upper bound;
      16-row tiles with 8 warps take 128 B).
    - S == 1: no multi-buffering; P reuses K's bytes.
    - pipelined=False (pointer loads of rows that are not 16-element aligned): as S == 1.
    - dropout: the keep mask's scratch where no staged P holds it (tiling/dropout.py).
    """
    q, k, v = BM * D, BN * D, BN * DV
    epilogue = BM * DV
    # Unevaluated (its comparisons cost 30 ms of a first derivation); substituting evaluates.
    Max = partial(sympy.Max, evaluate=False)  # noqa: N806 - sympy's name

    def loop(p: sympy.Expr, buffers: sympy.Expr) -> sympy.Expr:
        if dropout:
            return drop.forward_loop(q, k, v, p, buffers)
        return sympy.Piecewise(
            (q + v + Max(k, p), sympy.Eq(S, 1)), (q + buffers * (k + v) + p, True)
        )

    staged_p = sympy.Piecewise((0, BM >= DV), (BM * BN, True))
    sixteen_bit = E * Max(loop(staged_p, Max(S - 1, 1)), epilogue)
    barrier = tma_barrier_expression() if arch.has_tma and tma else 0  # decode's tma=False
    if arch.has_wgmma:
        wgmma = drop.forward_wgmma(barrier) if dropout else E * Max(q + S * (k + v), epilogue)
        sixteen_bit = sympy.Piecewise((wgmma, BM >= 64), (sixteen_bit, True))
    sixteen_bit = sixteen_bit + barrier
    fp32 = E * Max(loop(BM * BN, Max(S - 1, 1)), epilogue) + 4 * Max(BM, 32)
    expr = sympy.Piecewise((fp32, sympy.Eq(E, 4)), (sixteen_bit, True))
    # Rows the compiler cannot prove 16-element aligned (rows_aligned) are loaded element by
    # element: nothing is copied asynchronously, so no stage is buffered and the program
    # needs what one stage does at any num_stages (all 256 such sm90 configs measured).
    return expr if pipelined else expr.subs(S, 1)


def tma_barrier_expression() -> sympy.Expr:
    """What TMA loads (16-bit, Hopper: templates' `tma` flag) add to shared memory: two arrays
    (K, V) of n 8-byte mbarriers, the first padded to 16 B, with n = S on the wgmma path and
    S - 1 on mma.sync (its pipeline is one stage shorter); a single barrier (wgmma) or none
    (mma.sync) at S = 1. On the wgmma path, when the stages of K and V outgrow Q
    (S * BLOCK_N > BLOCK_M) the barriers land after the 1024-byte aligned swizzled buffers
    instead: 1024 B of alignment plus one array, or none when the masked blocks are TMA
    loads too. Fitted to all 256 16-bit sm90 configs of the examples (D = DV = 64, 128, 256)
    and checked by verify-tiling."""

    def arrays(n: sympy.Expr) -> sympy.Expr:
        return 16 * sympy.ceiling(8 * n / sympy.Integer(16)) + 8 * n

    # The masked blocks' loads through TMA too (D, DV <= TMA_MASKED_MAX_HEAD_DIM) leave one
    # pipeline for both key loops: the array after the aligned buffers goes (the compiler's
    # count on all 66 such sm90 configs: 8 x S bytes fewer).
    after_aligned = sympy.Piecewise(
        (0, sympy.Eq(S, 1)), (0, sympy.Max(D, DV) <= TMA_MASKED_MAX_HEAD_DIM), (8 * S, True)
    )
    wgmma = sympy.Piecewise(
        (1024 + after_aligned, S * BN > BM), (8, sympy.Eq(S, 1)), (arrays(S), True)
    )
    mma = sympy.Piecewise((0, sympy.Eq(S, 1)), (arrays(S - 1), True))
    return sympy.Piecewise((wgmma, BM >= 64), (mma, True))


@cache
def regs_expression(arch: GpuArch, pipelined: bool = True, dropout: bool = False) -> sympy.Expr:
    """Registers per thread: the fp32 accumulator, the score tile and the K/V tiles, over
    32 * W threads. A bound more than an estimate (rms error 31 on configs that do not spill):
    the 16-bit coefficients come from a linear program over the 16-bit configs in
    attngen/verify/data and the original 584-config fit set, constrained so that every config
    that spills more than 64 B is predicted at 260 or more (never "safe") and the tuned
    winners in tuning/ stay feasible. ptxas varies by up to +-75 registers between specs that
    share a config (mask, softcap, ALiBi, a padded head dim), which no tile formula sees;
    docs/tiling.md has the numbers.

    fp32 (IEEE dots lower to FMA loops): ptxas's register use is not a function of the tile
    (on sm90, 32x32 tiles with 8 warps spill 500 B where 32x64 spill none), so the formula is
    only a rejection bound (above 279 the configs spill) and every fp32 config is in the
    may-spill class (Candidate.regs_predictive).

    pipelined=False (rows that are not 16-element aligned, loaded element by element, each
    with its own address): the same linear program over the 64 distinct such configs measured
    on sm90 (D = 64 and 128; num_stages changes nothing there), coefficients rounded up.
    dropout (16-bit): plus the keep mask's registers (tiling/dropout.py forward_registers)."""
    threads = 32 * W
    acc, scores = BM * DV / threads, BM * BN / threads
    kv = BN * (D + DV) * E / (4 * threads)

    def fitted(one: int, *coefficients: str) -> sympy.Expr:  # one + a acc + b scores + c kv
        a, b, c = map(sympy.Rational, coefficients)
        return one + a * acc + b * scores + c * kv

    if pipelined:
        sixteen_bit, wgmma = fitted(69, "4/3", "4/3", "2/3"), fitted(66, "1", "3/4", "5/6")
    else:
        sixteen_bit, wgmma = fitted(116, "8/5", "0", "11/5"), fitted(136, "4/3", "1/4", "4/3")
    if arch.has_wgmma:
        sixteen_bit = sympy.Piecewise((wgmma, BM >= 64), (sixteen_bit, True))
    sixteen_bit = sixteen_bit + (drop.forward_registers() if dropout else 0)
    return sympy.Piecewise((40 + 8 * (acc + scores), sympy.Eq(E, 4)), (sixteen_bit, True))


@cache
def score_expression() -> sympy.Expr:
    """Predicted efficiency in (0, 1]: tile reuse (larger tiles read K/V fewer times and feed
    the tensor cores longer) times a pipelining factor; occupancy and waves multiply it."""
    reuse = (BM * BN / (BM + BN)) / sympy.Integer(64)  # 1 for a 128 x 128 tile
    pipelining = sympy.Piecewise(
        (sympy.Rational(6, 10), sympy.Eq(S, 1)), (sympy.Rational(9, 10), sympy.Eq(S, 2)), (1, True)
    )
    return sympy.Min(reuse, 1) * pipelining


@cache
def wave_expression() -> sympy.Expr:
    """Wave efficiency in (0, 1] on the reference problem: the programs fill
    ceiling(waves) rounds of SMS x R slots, of which the last is partly idle. A tile that
    leaves 1.1 waves runs at 1.1 / 2 of the SMs' capacity; 7.9 waves at 7.9 / 8."""
    waves = H * sympy.ceiling(sympy.Integer(REFERENCE_TOKENS) / BM) / (SMS * R)
    return waves / sympy.ceiling(waves)


# The symbols the compiled model takes, in this order (prefill.py MODEL_NAMES names them).
MODEL_SYMBOLS = (BM, BN, S, W, D, DV, E)
