"""Tile sizes, derived: a sympy model of what a prefill config costs, and the choice it implies.

The model is a handful of symbolic expressions in the tile parameters (BLOCK_M, BLOCK_N,
padded head dims D and DV, element bytes E, num_stages S, num_warps W):

- shared memory per program, per target family (Triton pipelines and lays out operands
  differently on Hopper, where wgmma takes the P operand from registers);
- fp32 registers per thread for the accumulator, the score tile and the resident Q tile;
- a predicted efficiency: K/V reuse of the tile, occupancy, pipelining depth, and wave
  quantization over the SM count on a reference problem (the spec's query heads, batch 1,
  REFERENCE_TOKENS queries: a long prompt).

Every candidate of a fixed grid is evaluated against labelled constraints; a rejected one
carries the reasons, a feasible one its score. The chosen config is the feasible one with the
best score (ties: less shared memory). `Derivation` keeps all of it as data, so `attngen
explain` and the module header print the same numbers.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import sympy

from attngen.arch import ARCHS, GpuArch
from attngen.spec import AttnSpec
from attngen.tiling import dropout as drop
from attngen.tiling.evaluate import LazyText, active_formula, compiled, exact_value
from attngen.tiling.evaluate import active_branch as active_branch
from attngen.tiling.rows import rows_aligned, tma_strides_aligned

BM, BN, D, DV, E, S, W = sympy.symbols("BLOCK_M BLOCK_N D DV E S W", positive=True, integer=True)
# Wave quantization: H query heads x REFERENCE_TOKENS rows in BLOCK_M tiles, R programs
# resident per SM, SMS streaming multiprocessors.
H, R, SMS = sympy.symbols("H R SMS", positive=True, integer=True)
REFERENCE_TOKENS = 4096

# The register model's rms error against ptxas is about 30: a config predicted within this
# margin above the limit may not spill, so it stays feasible, behind the safe ones.
REGISTER_MARGIN = 24

BLOCK_M_CHOICES = (16, 32, 64, 128)
BLOCK_N_CHOICES = (16, 32, 64, 128)
NUM_WARPS_CHOICES = (4, 8)
NUM_STAGES_CHOICES = (1, 2, 3, 4)

@dataclass(frozen=True, order=True)
class TileConfig:
    """One launch config of the prefill kernel.

    block_m, block_n: powers of two >= 16 (tl.dot's minimum); num_warps: 4 or 8;
    num_stages: software-pipelining depth of the K/V loop, >= 1.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    @classmethod
    def from_dict(cls, data: dict[str, int]) -> TileConfig:
        """The inverse of as_dict (the launcher's CONFIG keys)."""
        return cls(int(data["BLOCK_M"]), int(data["BLOCK_N"]), int(data["num_warps"]),
                   int(data["num_stages"]))

    def as_dict(self) -> dict[str, int]:
        return {
            "BLOCK_M": self.block_m,
            "BLOCK_N": self.block_n,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
        }


@dataclass(frozen=True)
class Candidate:
    config: TileConfig
    smem_bytes: int
    regs_per_thread: int
    programs_per_sm: int
    score: float
    rejected: tuple[str, ...]  # empty when feasible
    # False where the register count only bounds (fp32: FMA dots, see regs_expression): such a
    # config is never promised not to spill.
    regs_predictive: bool = True
    wave_efficiency: float = 0.0  # wave_expression on the reference problem (0 if rejected)

    @property
    def feasible(self) -> bool:
        return not self.rejected

    def may_spill(self, arch: GpuArch) -> bool:
        """Within the register model's error margin above the limit, or fp32: it may or may not
        spill. Such configs are feasible (autotuning may try them) but the heuristic prefers
        others."""
        return self.regs_per_thread > arch.max_regs_per_thread or not self.regs_predictive


@dataclass(frozen=True)
class Derivation:
    arch: str
    source: str  # "heuristic" now; "tuning" once a tuning database supplies the config
    expressions: Mapping[str, str]
    constraints: tuple[str, ...]
    candidates: tuple[Candidate, ...]
    chosen: TileConfig | None
    binding: str = ""
    worked: dict[str, str] = field(default_factory=dict)  # chosen config's formulas and values
    # D, DV (padded), E of the spec; H (its query heads) and SMS (the arch's) for the waves
    dims: dict[str, int] = field(default_factory=dict)
    tma: bool = True  # the kernel's loads may use TMA (prefill); decode's never do
    pipelined: bool = True  # K/V copies are asynchronous (rows_aligned or TMA)
    # Measured faster than `chosen` on shorter sequences (autotune's per-length winners):
    # (longest sequence served, config), ascending; `chosen` serves everything longer.
    shorter: tuple[tuple[int, TileConfig], ...] = ()
    dropout: bool = False  # the kernel draws the dropout keep mask (smem_expression's term)

    @property
    def chosen_candidate(self) -> Candidate | None:
        return next((c for c in self.candidates if c.config == self.chosen), None)

    def summary_lines(self, width: int = 92) -> tuple[str, ...]:
        """What the module header records: the formulas in force for the chosen config, worked
        out, wrapped to `width` columns."""
        best = self.chosen_candidate
        if best is None:
            return ("no feasible config",)
        arch = ARCHS[self.arch]
        feasible = sum(c.feasible for c in self.candidates)
        lines = [
            f"shared memory = {self.worked['smem']}",
            f"  with {self.worked['values']}",
            f"  = {best.smem_bytes} B of {arch.smem_budget} B available per block",
            f"registers/thread ~ {self.worked['regs']} = {best.regs_per_thread} "
            f"of {arch.max_regs_per_thread}",
            f"programs/SM {best.programs_per_sm}"
            + (f", waves {self.worked['waves']}" if "waves" in self.worked else ""),
            f"score {best.score:.3f}, "
            f"{feasible} of {len(self.candidates)} candidates feasible",
            f"binding: {self.binding}",
        ]
        lines += [f"sequences up to {up_to}: {c.block_m}x{c.block_n}, {c.num_warps} warps, "
                  f"{c.num_stages} stages (measured faster there)" for up_to, c in self.shorter]
        wrapped: list[str] = []
        for line in lines:
            wrapped += textwrap.wrap(line, width, subsequent_indent="    ")
        return tuple(wrapped)


@cache  # sympy builds it slowly; one per arch serves every derivation
def smem_expression(arch: GpuArch, tma: bool = True, pipelined: bool = True,
                    dropout: bool = False) -> sympy.Expr:
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

    def loop(p: sympy.Expr, buffers: sympy.Expr) -> sympy.Expr:
        if dropout:
            return drop.forward_loop(q, k, v, p, buffers)
        return sympy.Piecewise((q + v + sympy.Max(k, p), sympy.Eq(S, 1)),
                               (q + buffers * (k + v) + p, True))

    staged_p = sympy.Piecewise((0, BM >= DV), (BM * BN, True))
    sixteen_bit = E * sympy.Max(loop(staged_p, sympy.Max(S - 1, 1)), epilogue)
    barrier = tma_barrier_expression() if arch.has_tma and tma else 0  # decode's tma=False
    if arch.has_wgmma:
        wgmma = drop.forward_wgmma(barrier) if dropout else E * sympy.Max(q + S * (k + v), epilogue)
        sixteen_bit = sympy.Piecewise((wgmma, BM >= 64), (sixteen_bit, True))
    sixteen_bit = sixteen_bit + barrier
    fp32 = E * sympy.Max(loop(BM * BN, sympy.Max(S - 1, 1)), epilogue) + 4 * sympy.Max(BM, 32)
    expr = sympy.Piecewise((fp32, sympy.Eq(E, 4)), (sixteen_bit, True))
    # Rows the compiler cannot prove 16-element aligned (rows_aligned) are loaded element by
    # element: nothing is copied asynchronously, so no stage is buffered and the program
    # needs what one stage does at any num_stages (all 256 such sm90 configs measured).
    return expr if pipelined else expr.subs(S, 1)


# Prefill modules on Hopper read the masked (diagonal, window edge, tail) K/V blocks through
# TMA as well when both head dims are at most this and the tile is on the wgmma path: 2-17%
# faster with the tiles it makes best; at D = 256 the extra branch spills (68 B at 128x64 with
# 8 warps) and cost 2-3% (tools/exp_prefill.py, docs/performance.md).
TMA_MASKED_MAX_HEAD_DIM = 128


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
    after_aligned = sympy.Piecewise((0, sympy.Eq(S, 1)),
                                    (0, sympy.Max(D, DV) <= TMA_MASKED_MAX_HEAD_DIM),
                                    (8 * S, True))
    wgmma = sympy.Piecewise((1024 + after_aligned, S * BN > BM),
                            (8, sympy.Eq(S, 1)), (arrays(S), True))
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
    if pipelined:
        sixteen_bit = (69 + sympy.Rational(4, 3) * acc + sympy.Rational(4, 3) * scores
                       + sympy.Rational(2, 3) * kv)
        wgmma = 66 + acc + sympy.Rational(3, 4) * scores + sympy.Rational(5, 6) * kv
    else:
        sixteen_bit = 116 + sympy.Rational(8, 5) * acc + sympy.Rational(11, 5) * kv
        wgmma = (136 + sympy.Rational(4, 3) * acc + sympy.Rational(1, 4) * scores
                 + sympy.Rational(4, 3) * kv)
    if arch.has_wgmma:
        sixteen_bit = sympy.Piecewise((wgmma, BM >= 64), (sixteen_bit, True))
    sixteen_bit = sixteen_bit + (drop.forward_registers() if dropout else 0)
    return sympy.Piecewise((40 + 8 * (acc + scores), sympy.Eq(E, 4)), (sixteen_bit, True))


@cache
def score_expression() -> sympy.Expr:
    """Predicted efficiency in (0, 1]: tile reuse (larger tiles read K/V fewer times and feed
    the tensor cores longer) times a pipelining factor; occupancy and waves multiply it."""
    reuse = (BM * BN / (BM + BN)) / sympy.Integer(64)  # 1 for a 128 x 128 tile
    pipelining = sympy.Piecewise((sympy.Rational(6, 10), sympy.Eq(S, 1)),
                                 (sympy.Rational(9, 10), sympy.Eq(S, 2)), (1, True))
    return sympy.Min(reuse, 1) * pipelining


@cache
def wave_expression() -> sympy.Expr:
    """Wave efficiency in (0, 1] on the reference problem: the programs fill
    ceiling(waves) rounds of SMS x R slots, of which the last is partly idle. A tile that
    leaves 1.1 waves runs at 1.1 / 2 of the SMs' capacity; 7.9 waves at 7.9 / 8."""
    waves = H * sympy.ceiling(sympy.Integer(REFERENCE_TOKENS) / BM) / (SMS * R)
    return waves / sympy.ceiling(waves)


# The symbols the compiled model takes, in this order.
MODEL_SYMBOLS = (BM, BN, S, W, D, DV, E)


def numeric_model(arch: GpuArch, tma: bool, pipelined: bool = True, dropout: bool = False
                  ) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(shared memory, registers per thread) as Python functions of MODEL_SYMBOLS' values,
    compiled once per arch (evaluate.py); the same numbers as substituting into the sympy
    expressions."""
    return (compiled(smem_expression(arch, tma, pipelined, dropout), MODEL_SYMBOLS),
            compiled(regs_expression(arch, pipelined, dropout), MODEL_SYMBOLS))


@cache
def exact_waves(heads: int, sm_count: int, block_m: int, per_sm: int) -> sympy.Expr:
    """wave_expression at these values, exactly."""
    return exact_value(wave_expression(), {H: heads, SMS: sm_count, BM: block_m, R: per_sm})


@cache
def exact_score(block_m: int, block_n: int, stages: int) -> sympy.Expr:
    """score_expression at these values, exactly."""
    return exact_value(score_expression(), {BM: block_m, BN: block_n, S: stages})


def constraint_labels(arch: GpuArch) -> tuple[str, ...]:
    return (
        f"smem: shared memory <= {arch.smem_budget} B (the opt-in limit per block on "
        f"{arch.name}, {arch.smem_per_block} B, less {arch.smem_reserved} B ptxas reserves)",
        f"regs: registers/thread <= {arch.max_regs_per_thread} + {REGISTER_MARGIN} (the "
        "model's error margin; above the limit a config may spill, so the heuristic prefers "
        "one below it)",
        f"occupancy: at least one program per SM ({arch.max_threads_per_sm} threads/SM; "
        f"each resident program also takes {arch.smem_block_cost} B, the driver's reserve)",
        "tile: BLOCK_M <= 32 * num_warps (at most one query row per thread)",
    )


def padded_head_dim(head_dim: int) -> int:
    """tl.dot and tl.arange need power-of-two extents of at least 16."""
    return max(16, 1 << (head_dim - 1).bit_length())


@cache
def derive_tiles(spec: AttnSpec, arch_name: str) -> Derivation:
    arch = ARCHS[arch_name]
    tma = arch.has_tma and tma_strides_aligned(spec)
    pipelined = (tma and spec.dtype.itemsize == 2) or rows_aligned(spec)
    d, dv, e = padded_head_dim(spec.head_dim), padded_head_dim(spec.value_head_dim), (
        spec.dtype.itemsize)
    values = {D: d, DV: dv, E: e}
    smem_f, regs_f = numeric_model(arch, tma, pipelined, spec.dropout)
    waves_at = {H: spec.num_q_heads, SMS: arch.sm_count}
    candidates = []
    for bm, bn, w, s in itertools.product(BLOCK_M_CHOICES, BLOCK_N_CHOICES, NUM_WARPS_CHOICES,
                                          NUM_STAGES_CHOICES):
        config = TileConfig(bm, bn, w, s)
        smem = int(smem_f(bm, bn, s, w, d, dv, e))
        regs = int(math.ceil(regs_f(bm, bn, s, w, d, dv, e)))
        reasons = []
        if smem > arch.smem_budget:
            reasons.append(f"smem {smem} B > {arch.smem_budget} B")
        if regs > arch.max_regs_per_thread + REGISTER_MARGIN:
            reasons.append(f"regs {regs} > {arch.max_regs_per_thread} + {REGISTER_MARGIN}")
        by_smem = arch.smem_per_sm // (smem + arch.smem_block_cost)
        # ptxas caps registers at the limit (spilling the rest), so occupancy uses the cap.
        by_regs = arch.regs_per_sm // (min(regs, arch.max_regs_per_thread) * 32 * w)
        by_threads = arch.max_threads_per_sm // (32 * w)
        per_sm = min(by_smem, by_regs, by_threads)
        if not reasons and per_sm < 1:
            reasons.append("occupancy 0 programs/SM")
        if bm > 32 * w:
            reasons.append(f"tile: BLOCK_M {bm} > 32 * num_warps (a row per thread at most)")
        occupancy = min(1.0, per_sm * w / 8)  # 8 resident warps hide most latency
        score = waves = 0.0
        if not reasons:
            waves = float(exact_waves(spec.num_q_heads, arch.sm_count, bm, per_sm))
            score = float(exact_score(bm, bn, s)) * occupancy * waves
        candidates.append(Candidate(config, smem, regs, per_sm, round(score, 6), tuple(reasons),
                                    regs_predictive=spec.dtype.itemsize != 4,
                                    wave_efficiency=round(waves, 4)))
    derivation = Derivation(
        arch=arch_name,
        source="heuristic",
        # The formulas with this spec's dtype and head dims substituted: what explain prints
        # (sympy takes a while to simplify them, so only when read).
        expressions=LazyText(lambda: {
            "smem": str(smem_expression(arch, tma, pipelined, spec.dropout).subs(values)),
            "regs": str(regs_expression(arch, pipelined, spec.dropout).subs(values)),
            "score": str(score_expression()),
            "waves": str(wave_expression().subs(waves_at))}),
        constraints=constraint_labels(arch),
        candidates=tuple(candidates),
        chosen=None,
        binding="nothing fits",
        dims={str(symbol): value for symbol, value in {**values, **waves_at}.items()},
        tma=tma,
        pipelined=pipelined, dropout=spec.dropout,
    )
    feasible = [c for c in candidates if c.feasible]
    if not feasible:
        return derivation
    best = max(feasible, key=lambda c: (not c.may_spill(arch), c.score, -c.smem_bytes, c.config))
    return choose(derivation, best.config, "heuristic")


def choose(derivation: Derivation, config: TileConfig, source: str) -> Derivation:
    """The derivation with `config` chosen (it must be a feasible candidate): the binding
    constraint and the worked formulas are those of that config."""
    arch = ARCHS[derivation.arch]
    by_config = {c.config: c for c in derivation.candidates}
    candidate = by_config.get(config)
    if candidate is None or not candidate.feasible:
        raise ValueError(f"{config} is not a feasible candidate on {arch.name}")
    at = {D: derivation.dims["D"], DV: derivation.dims["DV"], E: derivation.dims["E"],
          BM: config.block_m, BN: config.block_n, S: config.num_stages, W: config.num_warps}
    worked = {}
    if "H" in derivation.dims:  # prefill's reference problem (decode has its own split rule)
        waves = exact_waves(derivation.dims["H"], derivation.dims["SMS"], config.block_m,
                            candidate.programs_per_sm)
        worked["waves"] = (f"{waves} = {float(waves):.3f} ({derivation.dims['H']} heads x "
                           f"{REFERENCE_TOKENS} tokens / {config.block_m} rows per program "
                           f"over {derivation.dims['SMS']} SMs x {candidate.programs_per_sm} "
                           "per SM)")
    paths = (derivation.pipelined, derivation.dropout)
    worked |= {
        "smem": active_formula(smem_expression(arch, derivation.tma, *paths), at),
        "regs": active_formula(regs_expression(arch, *paths), at),
        "values": ", ".join(f"{symbol}={at[symbol]}" for symbol in (BM, BN, D, DV, E, S, W)),
    }
    return dataclasses.replace(derivation, chosen=config, source=source,
                               binding=binding_constraint(candidate, list(derivation.candidates)),
                               worked=worked)


def binding_constraint(best: Candidate, candidates: list[Candidate]) -> str:
    """What stops the chosen config from growing: each one-step larger neighbour and why not.

    A neighbour doubles BLOCK_M or BLOCK_N or adds a stage, at the same warps. One that is
    feasible but was not chosen lost on score; one outside the grid is said to be.
    """
    by_config = {c.config: c for c in candidates}
    cfg = best.config
    steps = (
        ("BLOCK_M", cfg.block_m, TileConfig(cfg.block_m * 2, cfg.block_n, cfg.num_warps,
                                            cfg.num_stages)),
        ("BLOCK_N", cfg.block_n, TileConfig(cfg.block_m, cfg.block_n * 2, cfg.num_warps,
                                            cfg.num_stages)),
        ("num_stages", cfg.num_stages, TileConfig(cfg.block_m, cfg.block_n, cfg.num_warps,
                                                  cfg.num_stages + 1)),
    )
    parts = []
    for label, value, bigger in steps:
        grown = getattr(bigger, label.lower())
        neighbour = by_config.get(bigger)
        if neighbour is None:
            parts.append(f"{label} {value}->{grown}: outside the candidate grid")
        elif neighbour.rejected:
            parts.append(f"{label} {value}->{grown}: {neighbour.rejected[0]}")
        else:
            parts.append(f"{label} {value}->{grown}: fits, not chosen "
                         f"(score {neighbour.score:.3f})")
    return "; ".join(parts)
