"""Tile sizes of the backward kernels (spec `backward: true`), derived like the forward's.

Two kernels, each with its own sympy model (symbols as in prefill_model.py: BLOCK_M query rows,
BLOCK_N key rows, padded head dims D and DV, element bytes E, num_stages S, num_warps W):

- dQ kernel, a program per BLOCK_M query rows: Q [BM, D] and dO [BM, DV] resident, K and V
  streamed (the forward's shape, with dO added);
- dK/dV kernel, a program per BLOCK_N keys: K [BN, D] and V [BN, DV] resident, Q, dO and the
  fp32 LSE/delta rows streamed, the group's query heads in one flat loop.

The accumulators (dQ; dK and dV) are registers, never shared memory. The shared-memory model
was read off Triton 3.6's allocator and is checked by `attngen verify-tiling --backward`
against compiles of the rendered kernels (attngen/verify/data/backward_compile_triton-3.6.0.json:
every candidate of the examples on sm80 and sm90, samples of head dims 64 and 256, D != DV,
fp32 and dropout) and, with dropout, against allocator sweeps of whole grids
(backward_dropout_smem_triton-3.6.0.json, tools/backward_smem_sweep.py). It is exact on every
recorded candidate (num_stages 2 and 3), with and without dropout. num_stages = 1 (not a
candidate: it pipelines nothing and was never the fast config) is a bound: its unpipelined Q
and dO go through a transposition scratch that follows the layout's repetitions.

Registers: the forward's linear program (tools/fit_backward_registers.py) on the 16-bit
compiles (every kernel's whole bf16 D 64 and D 128 grids on all five archs, D 256 on sm90):
least absolute error (rms 23 to 28 on configs that do not spill, 34-46 on wgmma's dK/dV, dV
and dK), with every config that spills more than 64 B predicted above the limit, so no config
the model calls safe spills more than verify-tiling allows, and every tuned winner feasible.

The dK/dV kernel also runs as two launches, dV alone and dK alone (`split_dkdv`: D 256 on
sm90), each with its own candidates, models ("dv", "dk") and choice.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import sympy

from attngen.arch import ARCHS, GpuArch
from attngen.spec import AttnSpec
from attngen.tiling.dropout import keep_mask_scratch
from attngen.tiling.evaluate import LazyText, active_formula, compiled
from attngen.tiling.prefill import (
    REGISTER_MARGIN,
    Candidate,
    Derivation,
    ExpressionReads,
    TileConfig,
    binding_constraint,
    expression_reads,
    padded_head_dim,
    resource_limits,
)
from attngen.tiling.prefill_model import BM, BN, DV, D, E, S, W

KERNELS = ("dq", "dkdv", "dv", "dk")  # dv, dk: the dK/dV kernel's one-gradient launches
GRADS_OF = {"dkdv": 3, "dv": 1, "dk": 2}  # the dK/dV kernel's GRADS constexpr per launch
BLOCK_CHOICES = (16, 32, 64, 128)
NUM_WARPS_CHOICES = (4, 8)
NUM_STAGES_CHOICES = (2, 3)
MODEL_SYMBOLS = (BM, BN, S, W, D, DV, E)


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


def _choice(
    candidates: list[Candidate], arch: GpuArch, tuned: TileConfig | None, kernel: str
) -> TileConfig | None:
    """`tuned` (which must be feasible), else the heuristic's: the best score among configs
    the register model does not call may-spill (then the smallest shared memory). The
    one-gradient launches exist to reach wgmma (split_dkdv), so on wgmma their heuristic
    picks among 64-key tiles only, may-spill or not: at D 256 the model puts every one of
    them a little above the register limit (dK 32x128, 8 warps: 274 predicted, 252-255
    compiled with 0-32 B of spill), and the H200 measured 32x128, 8 warps, 3 stages the
    fastest for both launches (docs/performance.md, "D 256 as two dK/dV launches")."""
    feasible = [c for c in candidates if c.feasible]
    if tuned is not None:
        if tuned not in [c.config for c in feasible]:
            raise ValueError(f"{tuned} is not a feasible {kernel} candidate on {arch.name}")
        return tuned
    if kernel in ("dv", "dk") and arch.has_wgmma:
        wide = [c for c in feasible if c.config.block_n >= 64]
        return max(wide, key=lambda c: (c.score, -c.smem_bytes, c.config)).config if wide else None
    if not feasible:
        return None
    return max(
        feasible, key=lambda c: (not c.may_spill(arch), c.score, -c.smem_bytes, c.config)
    ).config


def smem_expression(arch: GpuArch, kernel: str, dropout: bool) -> sympy.Expr:
    if kernel == "dq":
        return dq_smem_expression(arch, dropout)
    return dkdv_smem_expression(arch, dropout, GRADS_OF[kernel])


def split_dkdv(arch: GpuArch, e: int, dkdv: Derivation, dv: Derivation, dk: Derivation) -> bool:
    """Whether dK and dV run as two launches, one accumulator each: on wgmma (16-bit), when
    no feasible fused config reaches wgmma's 64 key rows (both fp32 accumulators leave no
    registers for them: D 256) and both one-gradient launches' choices do. Their extra
    product (dV recomputes P, dK recomputes P and dP: five products for four) is the price;
    on the H200 (exp_backward_split_dkdv.py@8a07bfd, B 4, H 8, N 4096, D 256, bf16) the fused
    32x32 launch on mma.sync took 5.03 / 2.62 ms (full / causal) and the split at 32x128,
    8 warps, 3 stages for both launches 3.07 / 1.84 ms. At D 128, where the fused kernel
    runs on wgmma (64x128), the best split took 1.3-1.5x the fused time. A property of the
    candidates, not of the choice: a tuned small fused tile does not split the kernel."""
    if not arch.has_wgmma or e == 4 or dv.chosen is None or dk.chosen is None:
        return False
    fused_reaches = any(c.feasible and c.config.block_n >= 64 for c in dkdv.candidates)
    return not fused_reaches and min(dv.chosen.block_n, dk.chosen.block_n) >= 64


def atomic_extra_smem(arch: GpuArch, config: TileConfig, d: int, e: int) -> int:
    """Shared memory the ATOMIC_DQ variant of a dK/dV launch (deterministic=False) adds to
    its launch's. wgmma (16-bit, BLOCK_N >= 64 on Hopper): dQ's share dS @ K takes dS (a
    [BM, BN] tile) and K ([BN, D]) as operands in shared memory; exact where measured (Triton
    3.6, sm90, bf16 32x128, 8 warps, 3 stages: D 64 57856 -> 82432 B, D 128 115200 -> 156160 B;
    D 256's dK launch 229888 -> 311808 B, 8 KiB more than this term). mma.sync (16-bit): a
    staged dS of max(BM, 32) rows, exact from 32 rows, a bound below (sm80 fp16 D 64/128, 16-64
    x 128, 2-3 stages). fp32 (FMA): a staged dS where BLOCK_N < D, else none (sm80 and sm90,
    D 64/128: 0 or BM x BN x 4 B measured)."""
    bm, bn = config.block_m, config.block_n
    if e == 4:
        return 4 * bm * bn if bn < d else 0
    if arch.has_wgmma and bn >= 64:
        return e * (bm * bn + bn * d)
    return e * max(bm, 32) * bn


def atomic_dkdv_config(
    spec: AttnSpec, arch_name: str, derivation: BackwardDerivation
) -> TileConfig | None:
    """The config of the dK/dV launch that adds dQ by atomics (the dK launch with the split),
    the deterministic path's own, or None where its shared memory with the atomic term would
    not fit (D 256 on sm90: 303616 B of 232448): the module then runs deterministic=False on
    the deterministic kernels (BWD_DKDV_ATOMIC_CONFIG None)."""
    launch = derivation.dk if derivation.split else derivation.dkdv
    config = launch.chosen
    if config is None:
        return None
    arch = ARCHS[arch_name]
    smem = next(c.smem_bytes for c in launch.candidates if c.config == config)
    d, e = padded_head_dim(spec.head_dim), spec.dtype.itemsize
    return config if smem + atomic_extra_smem(arch, config, d, e) <= arch.smem_budget else None


@dataclass(frozen=True)
class BackwardDerivation:
    """The gradient kernels' derivations (each a prefill-style Derivation, candidates and
    all): dQ, the fused dK/dV launch, and its one-gradient launches dV and dK, which run
    instead of it where `split` (split_dkdv)."""

    dq: Derivation
    dkdv: Derivation
    dv: Derivation
    dk: Derivation
    split: bool = False

    def launches(self) -> tuple[tuple[str, Derivation], ...]:
        """(label, derivation) of the launches the module makes."""
        dkdv = (("dV launch", self.dv), ("dK launch", self.dk)) if self.split else (
            ("dK/dV kernel", self.dkdv),)  # fmt: skip
        return (("dQ kernel", self.dq), *dkdv)

    def summary_lines(self) -> tuple[str, ...]:
        lines: list[str] = []
        if self.split:
            lines.append(
                "dK/dV as two launches, dV then dK (split_dkdv): no fused config reaches 64 keys"
            )
        for label, derivation in self.launches():
            chosen = derivation.chosen
            head = (
                "no feasible config"
                if chosen is None
                else (
                    f"{chosen.block_m}x{chosen.block_n}, {chosen.num_warps} warps, "
                    f"{chosen.num_stages} stages"
                )
            )
            lines.append(f"{label}: {head}")
            if derivation.source != "heuristic":  # a heuristic choice's lines stay as they were
                lines.append(f"  (source: {derivation.source})")
            lines += [f"  {line}" for line in derivation.summary_lines()]
        return tuple(lines)


# A kernel's measured choice: (kernel, config, source), e.g. ("dkdv", config, "tuning on ...").
Tuned = tuple[tuple[str, TileConfig, str], ...]


@cache
def derive_backward_tiles(spec: AttnSpec, arch_name: str, tuned: Tuned = ()) -> BackwardDerivation:
    """The kernels' derivations; `tuned` replaces the heuristic's choice of the kernels it
    names (attngen.tuning.database checks that each is a feasible candidate first)."""
    chosen = {kernel: (config, source) for kernel, config, source in tuned}
    unknown = set(chosen) - set(KERNELS)
    if unknown:
        raise ValueError(f"tuned: unknown backward kernel(s) {sorted(unknown)}; expected {KERNELS}")
    derived = {kernel: _derive(spec, arch_name, kernel, *chosen.get(kernel, (None, "")))
               for kernel in KERNELS}  # fmt: skip
    split = split_dkdv(
        ARCHS[arch_name], spec.dtype.itemsize, derived["dkdv"], derived["dv"], derived["dk"]
    )
    return BackwardDerivation(**derived, split=split)


# The allocator's alignment of the pipelined row buffers and their layout conversions: at most
# 2176 B beyond the rows themselves in the cross-compiles of sm80 and sm90 (document masks,
# int32 rows, every feasible 4- and 8-warp config of both kernels).
ROW_SLACK = 2304


def expression_smem(reads: ExpressionReads, kernel: str, config: TileConfig) -> int:
    """A bound on the shared memory the score_mod / mask_mod tensor reads add to a gradient
    kernel. Its loop streams the other side (dQ: keys, dK/dV: queries) and the pipeliner
    buffers each read that changes per step as the forward's key loop does: num_stages - 1
    copies of a [BLOCK_M, BLOCK_N] tile per read at (q_idx, kv_idx) and of a row per read at
    the streamed index alone (exact in the compiles), rows with ROW_SLACK. A trainable tile's
    gradient, scattered by the dK/dV kernels, takes a min(BLOCK_M, 32) x BLOCK_N fp32
    conversion scratch (exact on sm80, an upper bound on sm90)."""
    bm, bn, s = config.block_m, config.block_n, config.num_stages
    row = reads.kv_row * bn if kernel == "dq" else reads.q_row * bm
    extra = (s - 1) * (bm * bn * reads.tile + row) + (ROW_SLACK if row else 0)
    if reads.trainable and kernel != "dq":
        extra += min(bm, 32) * bn * 4
    return extra


def _candidate(
    arch: GpuArch,
    kernel: str,
    config: TileConfig,
    reads: ExpressionReads,
    smem_f: Callable[..., Any],
    regs_f: Callable[..., Any],
    d: int,
    dv: int,
    e: int,
) -> Candidate:
    """One config of `kernel` measured by the model: its shared memory, registers and
    occupancy, why it is rejected (if it is), and its score."""
    bm, bn, w, s = config.block_m, config.block_n, config.num_warps, config.num_stages
    smem = int(smem_f(bm, bn, s, w, d, dv, e)) + expression_smem(reads, kernel, config)
    regs = int(math.ceil(regs_f(bm, bn, s, w, d, dv, e)))
    owned = bm if kernel == "dq" else bn
    tile = f"tile: {'BLOCK_M' if kernel == 'dq' else 'BLOCK_N'} {owned} > 32 * num_warps"
    reasons, per_sm = resource_limits(arch, smem, regs, w, tile=tile if owned > 32 * w else "")
    score = 0.0
    if not reasons:
        # A program keeps its owned tile (dQ: BLOCK_M queries, dK/dV: BLOCK_N keys) in
        # registers and streams the other operand past it, so each streamed byte serves
        # `owned` rows: the intensity grows with the owned side alone. A streamed side below
        # 64 costs only loop steps. On the H200 (llama3_8b, D 128, tuning/sm90.json) dK/dV
        # took 2.9 / 4.5 / 5.2 ms at 32x128 / 64x64 / 128x32 and dQ 1.6 / 2.9 ms at 128 /
        # 64 owned queries; a score symmetric in the two sides had ranked them the other way.
        streamed = bn if kernel == "dq" else bm
        reuse = min(owned / 128, 1.0) * (0.9 + 0.1 * min(streamed / 64, 1.0))
        score = reuse * (0.9 if s == 2 else 1.0) * min(1.0, per_sm * w / 8)
    return Candidate(config, smem, regs, per_sm, round(score, 6), tuple(reasons), e != 4)


def _derive(
    spec: AttnSpec, arch_name: str, kernel: str, tuned: TileConfig | None = None, source: str = ""
) -> Derivation:
    arch = ARCHS[arch_name]
    d, dv = padded_head_dim(spec.head_dim), padded_head_dim(spec.value_head_dim)
    e = spec.dtype.itemsize
    smem_expr = smem_expression(arch, kernel, spec.dropout)
    regs_expr = regs_expression(arch, kernel)
    smem_f, regs_f = compiled(smem_expr, MODEL_SYMBOLS), compiled(regs_expr, MODEL_SYMBOLS)
    reads = expression_reads(spec)
    candidates = [
        _candidate(arch, kernel, TileConfig(bm, bn, w, s), reads, smem_f, regs_f, d, dv, e)
        for bm, bn, w, s in itertools.product(
            BLOCK_CHOICES, BLOCK_CHOICES, NUM_WARPS_CHOICES, NUM_STAGES_CHOICES
        )
    ]
    chosen = _choice(candidates, arch, tuned, kernel)
    values = {D: d, DV: dv, E: e}
    worked: dict[str, str] = {}
    binding = "nothing fits"
    if chosen is not None:
        at = {
            **values,
            BM: chosen.block_m,
            BN: chosen.block_n,
            S: chosen.num_stages,
            W: chosen.num_warps,
        }
        worked = {
            "smem": active_formula(smem_expr, at),
            "regs": active_formula(regs_expr, at),
            "values": ", ".join(f"{sym}={at[sym]}" for sym in (BM, BN, D, DV, E, S, W)),
        }
        binding = binding_constraint(next(c for c in candidates if c.config == chosen), candidates)
    return Derivation(
        arch=arch_name,
        source=source if tuned is not None else "heuristic",
        expressions=LazyText(
            lambda: {"smem": str(smem_expr.subs(values)), "regs": str(regs_expr.subs(values))}
        ),
        constraints=(
            f"smem: shared memory <= {arch.smem_budget} B",
            f"regs: registers/thread <= {arch.max_regs_per_thread} + "
            f"{REGISTER_MARGIN} (an estimate)",
            "tile: the rows a program owns <= 32 * num_warps",
        ),
        candidates=tuple(candidates),
        chosen=chosen,
        binding=binding,
        worked=worked,
        dims={"D": d, "DV": dv, "E": e},
        tma=False,
    )
