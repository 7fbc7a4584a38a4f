"""Tile sizes, derived: a sympy model of what a prefill config costs, and the choice it implies.

The model (prefill_model.py) is a handful of symbolic expressions in the tile parameters
(BLOCK_M, BLOCK_N, padded head dims D and DV, element bytes E, num_stages S, num_warps W):

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
from fractions import Fraction
from functools import cache
from typing import Any

from attngen.arch import ARCHS, GpuArch
from attngen.spec import AttnSpec
from attngen.spec.expressions import parsed
from attngen.tiling.evaluate import (
    LazyText,
    Model,
    active_formula,
    compiled,
    formula_text,
    substituted,
)
from attngen.tiling.rows import rows_aligned, tma_strides_aligned

# The register model's rms error against ptxas is about 30: a config predicted within this
# margin above the limit may not spill, so it stays feasible, behind the safe ones.
REGISTER_MARGIN = 24

BLOCK_M_CHOICES = (16, 32, 64, 128)
BLOCK_N_CHOICES = (16, 32, 64, 128)
NUM_WARPS_CHOICES = (4, 8)
NUM_STAGES_CHOICES = (1, 2, 3, 4)
# The compiled model's arguments (prefill_model.MODEL_SYMBOLS' names), in this order.
MODEL_NAMES = ("BLOCK_M", "BLOCK_N", "S", "W", "D", "DV", "E")
REFERENCE_TOKENS = 4096  # the wave model's reference problem: H heads x this many rows
# Prefill modules on Hopper read the masked (diagonal, window edge, tail) K/V blocks through
# TMA as well when both head dims are at most this and the tile is on the wgmma path: 2-17%
# faster with the tiles it makes best; at D = 256 the extra branch spills (68 B at 128x64 with
# 8 warps) and cost 2-3% (exp_prefill.py@163a2b7, docs/performance.md).
TMA_MASKED_MAX_HEAD_DIM = 128


def smem_model(arch: GpuArch, tma: bool, pipelined: bool = True, dropout: bool = False) -> Model:
    return Model("prefill_model.smem_expression", (arch, tma, pipelined, dropout))


def regs_model(arch: GpuArch, pipelined: bool = True, dropout: bool = False) -> Model:
    return Model("prefill_model.regs_expression", (arch, pipelined, dropout))


def numeric_model(
    arch: GpuArch, tma: bool, pipelined: bool = True, dropout: bool = False
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(shared memory, registers per thread) as Python functions of MODEL_NAMES' values
    (evaluate.py); the same numbers as substituting into the sympy expressions."""
    return (
        compiled(smem_model(arch, tma, pipelined, dropout), MODEL_NAMES),
        compiled(regs_model(arch, pipelined, dropout), MODEL_NAMES),
    )


# prefill_model's wave_expression and score_expression at integer values, exactly, in
# Fractions: the same numbers as substituting into them (tests/test_tiling_fast.py).
@cache
def exact_waves(heads: int, sm_count: int, block_m: int, per_sm: int) -> Fraction:
    waves = Fraction(heads * -(-REFERENCE_TOKENS // block_m), sm_count * per_sm)
    return waves / math.ceil(waves)


@cache
def exact_score(block_m: int, block_n: int, stages: int) -> Fraction:
    reuse = min(Fraction(block_m * block_n, (block_m + block_n) * 64), Fraction(1))
    return reuse * {1: Fraction(6, 10), 2: Fraction(9, 10)}.get(stages, Fraction(1))


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
        return cls(
            int(data["BLOCK_M"]),
            int(data["BLOCK_N"]),
            int(data["num_warps"]),
            int(data["num_stages"]),
        )

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
            f"score {best.score:.3f}, {feasible} of {len(self.candidates)} candidates feasible",
            f"binding: {self.binding}",
        ]
        lines += [
            f"sequences up to {up_to}: {c.block_m}x{c.block_n}, {c.num_warps} warps, "
            f"{c.num_stages} stages (measured faster there)"
            for up_to, c in self.shorter
        ]
        wrapped: list[str] = []
        for line in lines:
            wrapped += textwrap.wrap(line, width, subsequent_indent="    ")
        return tuple(wrapped)


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
    d, dv, e = (
        padded_head_dim(spec.head_dim),
        padded_head_dim(spec.value_head_dim),
        (spec.dtype.itemsize),
    )
    values = {"D": d, "DV": dv, "E": e}
    smem_f, regs_f = numeric_model(arch, tma, pipelined, spec.dropout)
    waves_at = {"H": spec.num_q_heads, "SMS": arch.sm_count}
    candidates = [
        _candidate(spec, arch, TileConfig(bm, bn, w, s), smem_f, regs_f, d, dv, e)
        for bm, bn, w, s in itertools.product(
            BLOCK_M_CHOICES, BLOCK_N_CHOICES, NUM_WARPS_CHOICES, NUM_STAGES_CHOICES
        )
    ]
    derivation = Derivation(
        arch=arch_name,
        source="heuristic",
        # The formulas with this spec's dtype and head dims substituted: what explain prints
        # (sympy takes a while to simplify them, so only when read).
        expressions=LazyText(
            lambda: {
                "smem": substituted(smem_model(arch, tma, pipelined, spec.dropout), values),
                "regs": substituted(regs_model(arch, pipelined, spec.dropout), values),
                "score": formula_text(Model("prefill_model.score_expression")),
                "waves": substituted(Model("prefill_model.wave_expression"), waves_at),
            }
        ),
        constraints=constraint_labels(arch),
        candidates=tuple(candidates),
        chosen=None,
        binding="nothing fits",
        dims={**values, **waves_at},
        tma=tma,
        pipelined=pipelined,
        dropout=spec.dropout,
    )
    feasible = [c for c in candidates if c.feasible]
    if not feasible:
        return derivation
    best = max(feasible, key=lambda c: (not c.may_spill(arch), c.score, -c.smem_bytes, c.config))
    return choose(derivation, best.config, "heuristic")


_READ_BYTES = {"int32": 4, "int64": 8, "float32": 4, "bf16": 2, "fp16": 2, "bool": 1}


@dataclass(frozen=True)
class ExpressionReads:
    """Bytes per element of the score_mod / mask_mod tensor reads, by what indexes them: a
    read at (q_idx, kv_idx) is a [BLOCK_M, BLOCK_N] tile, one at kv_idx alone a [BLOCK_N] row,
    one at q_idx alone a [BLOCK_M] row (reads of neither are scalars). `trainable`: a tensor
    read at a tile gets a gradient (the dK/dV kernel scatters a [BLOCK_M, BLOCK_N] tile)."""

    tile: int = 0
    kv_row: int = 0
    q_row: int = 0
    trainable: bool = False


def expression_reads(spec: AttnSpec) -> ExpressionReads:
    """The score_mod / mask_mod tensor reads of `spec`. Triton's software pipeliner buffers
    such a load in the key loop as it does K and V, num_stages - 1 copies in shared memory:
    on the H200 a relative-bias table's read took a 128 x 128 x 3-stage bf16 D 64 forward to
    245760 B where the model without it said 115712."""
    tile = kv_row = q_row = 0
    trainable = False
    for field_name in ("score_mod", "mask_mod"):
        tree = parsed(spec, field_name)
        for node in tree.nodes() if tree is not None else ():
            if node.op != "load":
                continue
            names = {n.value for a in node.args for n in a.nodes() if n.op == "var"}
            declared = next(t for t in spec.tensors if t.name == node.value)
            size = _READ_BYTES[declared.dtype]
            if {"q_idx", "kv_idx"} <= names:
                tile += size
                trainable |= declared.trainable
            elif "kv_idx" in names:
                kv_row += size
            elif "q_idx" in names:
                q_row += size
    return ExpressionReads(tile, kv_row, q_row, trainable)


def key_loop_read_smem(reads: ExpressionReads, config: TileConfig) -> int:
    """The shared memory a key loop's pipelined tensor reads take (forward and decode, whose
    row tile is BLOCK_M): num_stages - 1 copies of a tile per read at (q_idx, kv_idx) and of a
    [BLOCK_N] row per read at kv_idx alone; exact in the sm90 cross-compiles."""
    bm, bn, s = config.block_m, config.block_n, config.num_stages
    return (s - 1) * bn * (bm * reads.tile + reads.kv_row)


def _candidate(
    spec: AttnSpec,
    arch: GpuArch,
    config: TileConfig,
    smem_f: Callable[..., Any],
    regs_f: Callable[..., Any],
    d: int,
    dv: int,
    e: int,
) -> Candidate:
    """One config measured by the model: its shared memory, registers and occupancy, why it
    is rejected (if it is), and its score on the reference problem."""
    bm, bn, w, s = config.block_m, config.block_n, config.num_warps, config.num_stages
    smem = int(smem_f(bm, bn, s, w, d, dv, e)) + key_loop_read_smem(expression_reads(spec), config)
    regs = int(math.ceil(regs_f(bm, bn, s, w, d, dv, e)))
    reasons, per_sm = resource_limits(arch, smem, regs, w)
    if bm > 32 * w:
        reasons.append(f"tile: BLOCK_M {bm} > 32 * num_warps (a row per thread at most)")
    occupancy = min(1.0, per_sm * w / 8)  # 8 resident warps hide most latency
    score = waves = 0.0
    if not reasons:
        waves = float(exact_waves(spec.num_q_heads, arch.sm_count, bm, per_sm))
        score = float(exact_score(bm, bn, s)) * occupancy * waves
    scored = (per_sm, round(score, 6), tuple(reasons), spec.dtype.itemsize != 4)
    return Candidate(config, smem, regs, *scored, wave_efficiency=round(waves, 4))


def resource_limits(
    arch: GpuArch, smem: int, regs: int, warps: int, cap: int | None = None, tile: str = ""
) -> tuple[list[str], int]:
    """(why a program of `smem` bytes, `regs` registers a thread and `warps` warps is
    rejected: shared memory, registers over `cap` (the arch's limit unless given) + the
    margin, `tile` when given, else occupancy 0; its programs per SM). ptxas caps registers
    at the limit (spilling the rest), so occupancy counts the cap."""
    cap = arch.max_regs_per_thread if cap is None else cap
    reasons = []
    if smem > arch.smem_budget:
        reasons.append(f"smem {smem} B > {arch.smem_budget} B")
    if regs > cap + REGISTER_MARGIN:
        reasons.append(f"regs {regs} > {cap} + {REGISTER_MARGIN}")
    reasons += [tile] if tile else []
    by_smem = arch.smem_per_sm // (smem + arch.smem_block_cost)
    by_regs = arch.regs_per_sm // (min(regs, cap) * 32 * warps)
    per_sm = min(by_smem, by_regs, arch.max_threads_per_sm // (32 * warps))
    if not reasons and per_sm < 1:
        reasons.append("occupancy 0 programs/SM")
    return reasons, per_sm


WORKED_ORDER = ("BLOCK_M", "BLOCK_N", "D", "DV", "E", "S", "W")  # the header's "with ..."


def choose(derivation: Derivation, config: TileConfig, source: str) -> Derivation:
    """The derivation with `config` chosen (it must be a feasible candidate): the binding
    constraint and the worked formulas are those of that config."""
    arch = ARCHS[derivation.arch]
    by_config = {c.config: c for c in derivation.candidates}
    candidate = by_config.get(config)
    if candidate is None or not candidate.feasible:
        raise ValueError(f"{config} is not a feasible candidate on {arch.name}")
    at = {
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "S": config.num_stages,
        "W": config.num_warps,
        **{name: derivation.dims[name] for name in ("D", "DV", "E")},
    }
    worked = {}
    if "H" in derivation.dims:  # prefill's reference problem (decode has its own split rule)
        waves = exact_waves(
            derivation.dims["H"], derivation.dims["SMS"], config.block_m, candidate.programs_per_sm
        )
        worked["waves"] = (
            f"{waves} = {float(waves):.3f} ({derivation.dims['H']} heads x "
            f"{REFERENCE_TOKENS} tokens / {config.block_m} rows per program "
            f"over {derivation.dims['SMS']} SMs x {candidate.programs_per_sm} "
            "per SM)"
        )
    paths = (derivation.pipelined, derivation.dropout)
    worked |= {
        "smem": active_formula(smem_model(arch, derivation.tma, *paths), at),
        "regs": active_formula(regs_model(arch, *paths), at),
        "values": ", ".join(f"{name}={at[name]}" for name in WORKED_ORDER),
    }
    return dataclasses.replace(
        derivation,
        chosen=config,
        source=source,
        binding=binding_constraint(candidate, list(derivation.candidates)),
        worked=worked,
    )


def binding_constraint(best: Candidate, candidates: list[Candidate]) -> str:
    """What stops the chosen config from growing: each one-step larger neighbour and why not.

    A neighbour doubles BLOCK_M or BLOCK_N or adds a stage, at the same warps. One that is
    feasible but was not chosen lost on score; one outside the grid is said to be.
    """
    by_config = {c.config: c for c in candidates}
    cfg = best.config
    steps = (
        ("BLOCK_M", dataclasses.replace(cfg, block_m=cfg.block_m * 2)),
        ("BLOCK_N", dataclasses.replace(cfg, block_n=cfg.block_n * 2)),
        ("num_stages", dataclasses.replace(cfg, num_stages=cfg.num_stages + 1)),
    )
    parts = []
    for label, bigger in steps:
        value, grown = getattr(cfg, label.lower()), getattr(bigger, label.lower())
        neighbour = by_config.get(bigger)
        if neighbour is None:
            parts.append(f"{label} {value}->{grown}: outside the candidate grid")
        elif neighbour.rejected:
            parts.append(f"{label} {value}->{grown}: {neighbour.rejected[0]}")
        else:
            score = f"score {neighbour.score:.3f}"
            parts.append(f"{label} {value}->{grown}: fits, not chosen ({score})")
    return "; ".join(parts)
