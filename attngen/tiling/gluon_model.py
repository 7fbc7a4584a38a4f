"""The Gluon kernels' sympy models (gluon.py and gluon_backward.py evaluate them through
evaluate.py's store): one CTA's shared memory, exact against the compiler, and a consumer
thread's registers, in the tiles' symbols: NC consumers, BLOCK_M, BLOCK_N, head dims D and DV,
element bytes E, S stages and (backward) the C dQ columns a consumer computes."""

from __future__ import annotations

from functools import cache

import sympy

from attngen.tiling.gluon import CONSUMER_OVERHEAD, WARPGROUP, WS_FIXED_BYTES
from attngen.tiling.gluon_backward import OVERHEAD, WS_CAPTURE_BYTES

NC, BM, BN, D, DV, E, S, C = sympy.symbols(
    "NC BLOCK_M BLOCK_N D DV E S C", positive=True, integer=True
)


def barriers(n: sympy.Expr) -> sympy.Expr:  # an [n, 1] int64 array, padded to 16 B
    return 16 * sympy.ceiling(n / sympy.Integer(2))


@cache
def smem_expression(words: int = 0, o_tile: bool = False) -> sympy.Expr:
    """Dynamic shared memory of one CTA in bytes (exact against the compiler), for a kernel
    whose partitions take `words` more 32-bit scalars than the plain one (capture_words); with
    o_tile (DV != D) each Q slot holds max(D, DV) columns, O's tile a view of it."""

    slot = sympy.Max(D, DV) if o_tile else D
    tiles = E * (NC * BM * slot + S * BN * (D + DV))
    smallest = sympy.Min(NC, S)  # the last array placed: its padding is not allocated
    arrays = 2 * barriers(NC) + 4 * barriers(S) - (barriers(smallest) - 8 * smallest)
    captures = 16 * sympy.ceiling(sympy.Rational(words - 1, 4))
    partitions = 4 * (NC - 2)  # a third consumer partition: 4 B more of warp_specialize's
    return tiles + arrays + WS_FIXED_BYTES + partitions + captures


@cache
def consumer_regs_expression(tiles: int = 0) -> sympy.Expr:
    """Registers per consumer thread: O (fp32), S (fp32) and P (two 16-bit values a register)
    of one warpgroup's tiles, `tiles` more [BM, BN] 32-bit tiles, plus CONSUMER_OVERHEAD."""
    return (BM * DV + (1 + tiles) * BM * BN + BM * BN / 2) / WARPGROUP + CONSUMER_OVERHEAD


@cache
def backward_smem_expression() -> sympy.Expr:
    """Dynamic shared memory of one CTA in bytes (exact against the compiler)."""
    tiles = E * (2 * BN * D + S * 2 * BM * D + 2 * BM * BN) + S * 2 * BM * 4
    staging = NC * BM * C * 4 + WS_CAPTURE_BYTES
    return tiles + staging + 3 * barriers(S) + 2 * barriers(sympy.Integer(2))


@cache
def backward_regs_expression(d256: bool = False) -> sympy.Expr:
    """Registers per consumer thread (module docstring); D 256's form keeps one [BN, D]
    accumulator a warpgroup, its scores [BN, BM] and its half of dQ [BM, D / 2]."""
    if d256:
        return (BN * D + sympy.Max(BN * BM + BM * WARPGROUP / 4, BM * D / 2)) / WARPGROUP + OVERHEAD
    scores = 2 * BM * BN / NC + BM * WARPGROUP / 4  # S^T, dP^T fp32; delta by column
    return (2 * BN / NC * D + sympy.Max(scores, BM * C)) / WARPGROUP + OVERHEAD
