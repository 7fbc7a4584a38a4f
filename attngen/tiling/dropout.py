"""Dropout's terms in the tiling models (spec `dropout: true`): the keep mask's shared memory
and registers.

The forward kernel draws the keep mask (templates/_dropout.py.jinja) and both backward kernels
draw it again; its layout conversions take shared memory (keep_mask_scratch), which the
forward model (prefill.py smem_expression) and the backward's (backward.py) place per code
path. Measured on sm80 and sm90 (docs/tiling.md, verify/data).
"""

from __future__ import annotations

import sympy

# The symbols of prefill.py (sympy symbols of one name and assumptions are the same symbol).
BM, BN, D, DV, E, S, W = sympy.symbols("BLOCK_M BLOCK_N D DV E S W", positive=True, integer=True)


def keep_mask_scratch() -> sympy.Expr:
    """Bytes of shared memory the keep mask's layout conversions take (Triton 3.6). The mask
    joins eight 16-bit lanes of four Philox words in a tree of tl.join (the [BM, BN / 8, 2, 2]
    int32 level is the largest, 2 * BM * BN bytes) and the joins convert layouts through
    shared memory: the whole level when a thread holds at most four of its elements
    (BM * BN <= 256 W), else in two passes of half of it. Measured on every backward candidate
    of head dims 64 and 128, both kernels, sm80 and sm90, every sm90 forward candidate of
    bf16 D 128 and a sample of forward shapes (verify/data)."""
    return sympy.Piecewise((2 * BM * BN, BM * BN <= 256 * W), (BM * BN, True))


def forward_loop(
    q: sympy.Expr, k: sympy.Expr, v: sympy.Expr, p: sympy.Expr, buffers: sympy.Expr
) -> sympy.Expr:
    """The forward key loop's elements (prefill.py smem_expression's loop) with the scratch,
    which is live after the scores are formed: a staged P buffer (E * BM * BN bytes, at least
    as large) holds it, so it adds nothing to fp32 or to mma.sync tiles with BLOCK_M < DV;
    beside a P held in registers it is added; at S == 1 it reuses K's bytes like P does."""
    mask = keep_mask_scratch() / E
    return sympy.Piecewise(
        (q + v + sympy.Max(k, p, mask), sympy.Eq(S, 1)),
        (q + buffers * (k + v) + sympy.Max(p, mask), True),
    )


def forward_wgmma(barrier: sympy.Expr) -> sympy.Expr:
    """The forward wgmma path's bytes with the scratch, less `barrier` (the TMA bytes
    smem_expression adds after it). At S == 1 the scratch takes K's bytes and those of the
    one TMA barrier (live only while K loads) or the alignment gap beside them:
    E (Q + V) + max(E K + barrier, scratch). Exact on 5 of 6 such sm90 configs (D 16-64); the
    sixth (D 32, 64x128: the scratch as large as K) the allocator packs 512 B tighter (over,
    never under; the model without dropout is over by as much on head dims <= 32, which it
    was never fitted to). Otherwise the scratch is added beside the S stages."""
    q, k, v = BM * D, BN * D, BN * DV
    unpipelined = E * (q + v) + sympy.Max(E * k + barrier, keep_mask_scratch()) - barrier
    pipelined = E * (q + S * (k + v)) + keep_mask_scratch()
    return sympy.Piecewise(
        (sympy.Max(unpipelined, E * BM * DV), sympy.Eq(S, 1)),
        (sympy.Max(pipelined, E * BM * DV), True),
    )


def forward_registers() -> sympy.Expr:
    """Registers a thread the keep mask adds in the forward kernel (16-bit): its Philox rounds
    and joins add 0 to 126 (all 128 sm90 candidates of bf16 D 128, against the same configs
    without dropout), most on the tiles with the most score elements a thread; 5/8 per score
    element is the least that puts every one of them that spills more than 64 B at 260 or
    more, the register linear program's rule. Fitted on sm90 only."""
    return sympy.Rational(5, 8) * BM * BN / (32 * W)
