"""The backward kernels' sympy models (backward.py evaluates them through evaluate.py's
store): shared memory and registers per kernel, in prefill_model.py's symbols (BLOCK_M query
rows, BLOCK_N key rows, padded head dims D and DV, element bytes E, num_stages S, num_warps
W). backward.py's docstring says how they were fitted and checked."""

from __future__ import annotations

from functools import cache

import sympy

from attngen.arch import GpuArch
from attngen.tiling.dropout import keep_mask_scratch
from attngen.tiling.prefill_model import BM, BN, DV, D, E, S, W


@cache
def dq_smem_expression(arch: GpuArch, dropout: bool = False) -> sympy.Expr:
    """dQ kernel. Resident Q and dO are staged once; K and V stream through shared memory.

    - mma.sync (16-bit): max(S - 1, 1) buffers of K and V. dS (the A operand of dS @ K) goes
      through shared memory when the compiler splits warps along D, i.e. BLOCK_M < D (the dot
      chain's output [BM, D] is wider than tall); at S = 1 it reuses K's bytes.
    - wgmma (Hopper, 16-bit, BLOCK_M >= 64): S buffers of K and V; dS stays in registers.
    - fp32 (IEEE dots lower to FMA on every arch): the mma.sync layout with dS always staged.
    - dropout: the keep mask's conversion scratch (keep_mask_scratch) is live before dS is
      formed, so a staged dS buffer (at least as large) holds it; without one it is added.
    """
    resident = BM * D + BM * DV
    mask = keep_mask_scratch() if dropout else sympy.Integer(0)

    def loop(staged_ds: sympy.Expr) -> sympy.Expr:
        return sympy.Piecewise(
            (resident + BN * DV + sympy.Max(BN * D, staged_ds), sympy.Eq(S, 1)),
            (resident + (S - 1) * (BN * D + BN * DV) + staged_ds, True),
        )

    staged = sympy.Piecewise((BM * BN, BM < D), (0, True))
    sixteen_bit = E * loop(staged)
    if dropout:  # where dS is not staged (staged's condition, not staged itself: no simplify)
        sixteen_bit += sympy.Piecewise((mask, BM >= D), (0, True))
    if arch.has_wgmma:
        wgmma = E * (resident + S * (BN * D + BN * DV)) + mask
        sixteen_bit = sympy.Piecewise((wgmma, BM >= 64), (sixteen_bit, True))
    fp32 = E * loop(BM * BN)
    return sympy.Piecewise((fp32, sympy.Eq(E, 4)), (sixteen_bit, True))


@cache
def dkdv_smem_expression(arch: GpuArch, dropout: bool = False, grads: int = 3) -> sympy.Expr:
    """dK/dV kernel. Resident K and V; Q and dO stream, and with S >= 2 the LSE and delta rows
    too (S - 1 fp32 buffers of BLOCK_M each: 8 * BLOCK_M bytes a stage for both).

    `grads` 3 is the fused launch; 2 (dK alone) needs every buffer of it (dP^T reads V and
    delta); 1 (dV alone) holds no V tile and streams no delta: K resident, 4 * BLOCK_M bytes
    of LSE rows a stage, and on wgmma the 1 KiB gap follows K alone.

    - mma.sync (16-bit): max(S - 1, 1) buffers of Q and dO; P^T and dS^T (left operands of the
      dots into dV and dK) share one buffer when warps split along D (BLOCK_N < D).
    - wgmma (Hopper, 16-bit, BLOCK_N >= 64): S buffers of Q and dO. The allocator takes
      buffers by size (ties: the resident K, V first); once a streamed buffer precedes a
      resident one, the small LSE/delta rows follow it and the resident tile's swizzled layout
      starts at the next 1024 B boundary: the gap is counted.
    - fp32 (FMA): the mma.sync layout with P^T/dS^T always staged.
    - S = 1 (not a candidate): conversion scratch counted as its bound, a [BM, max(D, DV)]
      tile (and on wgmma the rows' bytes rounded up to 1 KiB).
    - dropout: the keep mask's conversion scratch (keep_mask_scratch). A staged P^T/dS^T
      buffer holds it, except on the smallest 16-bit tiles (at most two score elements a
      thread, BM * BN <= 64 W), where the allocator places it beside that buffer (fp32's
      staged buffer, twice the size, holds it there too).
    """
    resident = BN * D + BN * DV if grads & 2 else BN * D
    smallest_resident = BN * sympy.Min(D, DV) if grads & 2 else BN * D
    rows = (8 if grads & 2 else 4) * BM * (S - 1)
    staged = sympy.Piecewise((BM * BN, sympy.Or(BN < D, sympy.Eq(E, 4))), (0, True))
    scratch = sympy.Piecewise((E * BM * sympy.Max(D, DV), sympy.Eq(S, 1)), (0, True))
    mma = E * (resident + sympy.Max(S - 1, 1) * (BM * D + BM * DV) + staged) + rows + scratch
    mask_scratch = keep_mask_scratch() if dropout else sympy.Integer(0)
    if dropout:  # not staged: staged's condition (a Piecewise in one costs sympy a simplify)
        beside = sympy.Or(sympy.Not(sympy.Or(BN < D, sympy.Eq(E, 4))),
                          sympy.And(BM * BN <= 64 * W, sympy.Ne(E, 4)))  # fmt: skip
        mma = mma + sympy.Piecewise((mask_scratch, beside), (0, True))
    if not arch.has_wgmma:
        return mma
    streamed_first = smallest_resident < S * BM * sympy.Max(D, DV)
    gap = sympy.Piecewise((1024 * sympy.ceiling(rows / 1024) - rows, streamed_first), (0, True))
    row_scratch = sympy.Piecewise((1024 * sympy.ceiling(8 * BM / 1024), sympy.Eq(S, 1)), (0, True))
    wgmma = E * (resident + S * (BM * D + BM * DV)) + rows + gap + row_scratch + mask_scratch
    return sympy.Piecewise((wgmma, sympy.And(BN >= 64, sympy.Ne(E, 4))), (mma, True))


# Coefficients (intercept, acc, tile, stream, repeat) of regs_expression per (kernel, code
# path): the linear program of tools/fit_backward_registers.py on the 16-bit compiles, rounded
# up (the intercept to 0.5, the rest to 0.01; the rounded model keeps both of the fit's rules).
REGS_FIT = {
    ("dq", "mma.sync"): ("74", "1.24", "2.37", "0.13", "0"),
    ("dq", "wgmma"): ("69", "0.8", "1.81", "0.25", "0.27"),
    ("dkdv", "mma.sync"): ("105.5", "0.9", "2.04", "0.51", "0"),
    ("dkdv", "wgmma"): ("169", "0.39", "2.09", "0", "0"),
    ("dv", "mma.sync"): ("68.5", "1.8", "1.8", "0.6", "0"),
    ("dv", "wgmma"): ("80", "1.04", "1.39", "0.4", "0"),
    ("dk", "mma.sync"): ("96.5", "0.85", "4.1", "0.35", "0"),
    ("dk", "wgmma"): ("114", "0.99", "1.7", "0.21", "0"),
}


@cache
def regs_expression(arch: GpuArch, kernel: str) -> sympy.Expr:
    """Registers per thread. The owned side (dQ: BLOCK_M queries; dK/dV: BLOCK_N keys) is split
    over the warps, `rows` a warp; with width = dQ's D or dK/dV's D + DV and `streamed` the
    other side: acc = rows * width / 32 fp32 accumulator elements a thread holds, tile =
    rows * streamed / 32 (one score tile), stream = the streamed dot operands in 32-bit
    registers (dQ: K and V; dK/dV: Q and dO), streamed * (D + DV) * E / 4 over 32 W threads,
    and repeat = acc once more where a warp holds more than 16 rows (on wgmma a warpgroup then
    covers more than one M slice of 64: dQ with 4 warps on 128 queries, which spills at
    D 64 from BLOCK_N 64 while 8 warps on 128 queries and 128 keys at D 128, the same acc
    and tile a thread, compile to 232 registers; the tuned llama3_8b dQ config).

    rows is owned / W, except where the score tile stays in registers as the left operand of
    the next dot (dS @ K; P^T @ dO and dS^T @ Q): a warp then holds whole rows of it, at least
    an MMA instruction's M of 16 (a warpgroup's 64 on wgmma), so `rows` is max(16, owned / W).
    That is always so on wgmma, and on mma.sync when the tile is not staged through shared
    memory (owned >= D: see the smem models). 8 warps on 64 owned rows cost what 4 do; the
    nominal owned / W had called sm80 dK/dV 128x64 with 8 warps at D 64 (spilling 1 KiB) and
    sm90 dQ 128x64 with 4 warps at D 64 safe.

    The coefficients (REGS_FIT) solve the forward's linear program on the 16-bit compiles in
    verify/data: least absolute error, every config that spills more than 64 B predicted at
    260 or more (never safe), every tuned winner at 275 or less (feasible) and at 251 or less
    (safe) when it compiles without spilling. fp32 (FMA dots,
    its tile always staged) uses the mma.sync formula and is never promised not to spill."""
    owned, streamed = (BM, BN) if kernel == "dq" else (BN, BM)
    width = {"dq": D, "dkdv": D + DV, "dv": DV, "dk": D}[kernel]
    stream = streamed * (D + DV) * E / (4 * 32 * W)

    def fitted(path: str, rows: sympy.Expr) -> sympy.Expr:
        one, acc, tile, streamed_coef, repeat = (sympy.Rational(c) for c in REGS_FIT[kernel, path])
        held = rows * width / 32
        return (
            one
            + (acc + repeat * sympy.Piecewise((1, rows > 16), (0, True))) * held
            + tile * rows * streamed / 32
            + streamed_coef * stream
        )

    whole_rows = sympy.Max(16, owned / W)
    mma = sympy.Piecewise(
        (fitted("mma.sync", whole_rows), sympy.And(owned >= D, sympy.Ne(E, 4))),
        (fitted("mma.sync", owned / W), True),
    )
    if arch.has_wgmma:
        on_wgmma = sympy.And(owned >= 64, sympy.Ne(E, 4))
        return sympy.Piecewise((fitted("wgmma", whole_rows), on_wgmma), (mma, True))
    return mma
