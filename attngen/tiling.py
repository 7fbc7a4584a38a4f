"""Tile sizes, derived: a sympy model of what a prefill config costs, and the choice it implies.

The model is a handful of symbolic expressions in the tile parameters (BLOCK_M, BLOCK_N,
padded head dims D and DV, element bytes E, num_stages S, num_warps W):

- shared memory per program, per target family (Triton pipelines and lays out operands
  differently on Hopper, where wgmma takes the P operand from registers);
- fp32 registers per thread for the accumulator, the score tile and the resident Q tile;
- a predicted efficiency: K/V reuse of the tile, occupancy, and pipelining depth.

Every candidate of a fixed grid is evaluated against labelled constraints; a rejected one
carries the reasons, a feasible one its score. The chosen config is the feasible one with the
best score (ties: less shared memory). `Derivation` keeps all of it as data, so `attngen
explain` and the module header print the same numbers.
"""

from __future__ import annotations

import itertools
import textwrap
from dataclasses import dataclass, field
from functools import cache

import sympy

from attngen.arch import ARCHS, GpuArch
from attngen.spec import AttnSpec

BM, BN, D, DV, E, S, W = sympy.symbols("BLOCK_M BLOCK_N D DV E S W", positive=True, integer=True)

BLOCK_M_CHOICES = (32, 64, 128)
BLOCK_N_CHOICES = (32, 64, 128)
NUM_WARPS_CHOICES = (4, 8)
NUM_STAGES_CHOICES = (1, 2, 3, 4)

# Registers the compiler needs beyond the tiles (addresses, loop state, masks), per thread.
REGISTER_OVERHEAD = 40


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

    @property
    def feasible(self) -> bool:
        return not self.rejected


@dataclass(frozen=True)
class Derivation:
    arch: str
    source: str  # "heuristic" now; "tuning" once a tuning database supplies the config
    expressions: dict[str, str]
    constraints: tuple[str, ...]
    candidates: tuple[Candidate, ...]
    chosen: TileConfig | None
    binding: str = ""
    worked: dict[str, str] = field(default_factory=dict)  # chosen config's formulas and values

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
            f"  = {best.smem_bytes} B of {arch.smem_per_block} B per block",
            f"registers/thread ~ {self.worked['regs']} = {best.regs_per_thread} "
            f"of {arch.max_regs_per_thread}",
            f"programs/SM {best.programs_per_sm}, score {best.score:.3f}, "
            f"{feasible} of {len(self.candidates)} candidates feasible",
            f"binding: {self.binding}",
        ]
        wrapped: list[str] = []
        for line in lines:
            wrapped += textwrap.wrap(line, width, subsequent_indent="    ")
        return tuple(wrapped)


def active_branch(expr: sympy.Expr, values: dict[sympy.Symbol, int]) -> sympy.Expr:
    """The formula in force at `values`: every Piecewise replaced by its arm whose condition
    holds there (the header shows this, not the whole case analysis)."""

    def pick(piecewise: sympy.Piecewise) -> sympy.Expr:
        return next(arm for arm, cond in piecewise.args if bool(cond.subs(values)))

    return expr.replace(lambda e: isinstance(e, sympy.Piecewise), pick)


def smem_expression(arch: GpuArch) -> sympy.Expr:
    """Shared memory of one program in bytes, as Triton 3.6 allocates it for this template.

    Fitted to the compiler (`compiled.metadata.shared`, launch-time specialization: unit head-dim
    strides, 16-divisible pointers and strides) on sm80/86/89/90; docs/tiling.md has the data.
    - Hopper with wgmma (16-bit inputs, BLOCK_M >= 64: a warpgroup needs 64 rows): K and V are
      buffered S times (TMA-style multi-buffering), Q once; P stays in registers.
    - mma.sync (before Hopper, BLOCK_M < 64, or fp32 on the FMA path): K and V buffered
      max(S - 1, 1) times, Q once, and P staged through shared memory to become P @ V's A
      operand, except for 16-bit inputs with BLOCK_M = 128 and D <= 128, where the compiler
      converts it in registers; fp32 adds a row-reduction scratch of 4 * BLOCK_M bytes.
    On the 68 fitted configs the model is exact for 56 and over by at most one P tile (or the
    scratch) for the rest; it is never under, so a config it calls feasible fits.
    """
    in_registers = sympy.And(BM >= 128, D <= 128, sympy.Eq(E, 2))
    staged_p = sympy.Piecewise((0, in_registers), (BM * BN * E, True))
    scratch = sympy.Piecewise((4 * BM, sympy.Eq(E, 4)), (0, True))
    mma_sync = BM * D * E + sympy.Max(S - 1, 1) * BN * (D + DV) * E + staged_p + scratch
    if not arch.has_wgmma:
        return mma_sync
    wgmma = S * BN * (D + DV) * E + BM * D * E
    return sympy.Piecewise((wgmma, sympy.And(BM >= 64, sympy.Eq(E, 2))), (mma_sync, True))


def regs_expression() -> sympy.Expr:
    """fp32 registers per thread: the accumulator, the score tile and the Q tile, spread over
    32 * W threads, plus a fixed overhead."""
    return (BM * DV + BM * BN + BM * D * E / 4) / (32 * W) + REGISTER_OVERHEAD


def score_expression() -> sympy.Expr:
    """Predicted efficiency in (0, 1]: tile reuse (larger tiles read K/V fewer times and feed
    the tensor cores longer) times a pipelining factor; occupancy is applied numerically."""
    reuse = (BM * BN / (BM + BN)) / sympy.Integer(64)  # 1 for a 128 x 128 tile
    pipelining = sympy.Piecewise((sympy.Rational(6, 10), sympy.Eq(S, 1)),
                                 (sympy.Rational(9, 10), sympy.Eq(S, 2)), (1, True))
    return sympy.Min(reuse, 1) * pipelining


def constraint_labels(arch: GpuArch) -> tuple[str, ...]:
    return (
        f"smem: shared memory <= {arch.smem_per_block} B (opt-in limit per block on {arch.name})",
        f"regs: registers/thread <= {arch.max_regs_per_thread} (more would spill)",
        f"occupancy: at least one program per SM ({arch.max_threads_per_sm} threads/SM)",
        "tile: BLOCK_M <= 32 * num_warps (at most one query row per thread)",
    )


def padded_head_dim(head_dim: int) -> int:
    """tl.dot and tl.arange need power-of-two extents of at least 16."""
    return max(16, 1 << (head_dim - 1).bit_length())


@cache
def derive_tiles(spec: AttnSpec, arch_name: str) -> Derivation:
    arch = ARCHS[arch_name]
    values = {D: padded_head_dim(spec.head_dim), DV: padded_head_dim(spec.value_head_dim),
              E: spec.dtype.itemsize}
    smem_f = sympy.lambdify((BM, BN, S), smem_expression(arch).subs(values))
    regs_f = sympy.lambdify((BM, BN, W), regs_expression().subs(values))
    score_f = sympy.lambdify((BM, BN, S), score_expression().subs(values), modules="sympy")
    candidates = []
    for bm, bn, w, s in itertools.product(BLOCK_M_CHOICES, BLOCK_N_CHOICES, NUM_WARPS_CHOICES,
                                          NUM_STAGES_CHOICES):
        config = TileConfig(bm, bn, w, s)
        smem, regs = int(smem_f(bm, bn, s)), int(sympy.ceiling(regs_f(bm, bn, w)))
        reasons = []
        if smem > arch.smem_per_block:
            reasons.append(f"smem {smem} B > {arch.smem_per_block} B")
        if regs > arch.max_regs_per_thread:
            reasons.append(f"regs {regs} > {arch.max_regs_per_thread}")
        by_smem = arch.smem_per_sm // max(smem, 1)
        by_regs = arch.regs_per_sm // (max(regs, 1) * 32 * w)
        by_threads = arch.max_threads_per_sm // (32 * w)
        per_sm = min(by_smem, by_regs, by_threads)
        if not reasons and per_sm < 1:
            reasons.append("occupancy 0 programs/SM")
        if bm > 32 * w:
            reasons.append(f"tile: BLOCK_M {bm} > 32 * num_warps (a row per thread at most)")
        occupancy = min(1.0, per_sm * w / 8)  # 8 resident warps hide most latency
        score = float(score_f(bm, bn, s)) * occupancy if not reasons else 0.0
        candidates.append(Candidate(config, smem, regs, per_sm, round(score, 6), tuple(reasons)))
    feasible = [c for c in candidates if c.feasible]
    chosen = None
    binding = "nothing fits"
    worked: dict[str, str] = {}
    if feasible:
        best = max(feasible, key=lambda c: (c.score, -c.smem_bytes, c.config))
        chosen = best.config
        binding = _binding_constraint(best, candidates)
        at = {**values, BM: chosen.block_m, BN: chosen.block_n, S: chosen.num_stages,
              W: chosen.num_warps}
        worked = {
            "smem": str(active_branch(smem_expression(arch), at)),
            "regs": str(regs_expression()),
            "values": ", ".join(f"{symbol}={at[symbol]}" for symbol in (BM, BN, D, DV, E, S, W)),
        }
    return Derivation(
        arch=arch_name,
        source="heuristic",
        expressions={"smem": str(smem_expression(arch)), "regs": str(regs_expression()),
                     "score": str(score_expression())},
        constraints=constraint_labels(arch),
        candidates=tuple(candidates),
        chosen=chosen,
        binding=binding,
        worked=worked,
    )


def _binding_constraint(best: Candidate, candidates: list[Candidate]) -> str:
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
            parts.append(f"{label} {value}->{grown}: fits, lower score {neighbour.score:.3f}")
    return "; ".join(parts)
