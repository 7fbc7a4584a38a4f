"""Tile sizes of the backward kernels (spec `backward: true`), derived like the forward's.

Two kernels, each with its own sympy model (backward_model.py; symbols as in prefill_model.py:
BLOCK_M query rows, BLOCK_N key rows, padded head dims D and DV, element bytes E, num_stages
S, num_warps W):

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

from attngen.arch import ARCHS, GpuArch
from attngen.spec import AttnSpec
from attngen.tiling.evaluate import LazyText, Model, active_formula, compiled, substituted
from attngen.tiling.prefill import (
    MODEL_NAMES,
    REGISTER_MARGIN,
    WORKED_ORDER,
    Candidate,
    Derivation,
    ExpressionReads,
    TileConfig,
    binding_constraint,
    expression_reads,
    padded_head_dim,
    resource_limits,
)

KERNELS = ("dq", "dkdv", "dv", "dk")  # dv, dk: the dK/dV kernel's one-gradient launches
GRADS_OF = {"dkdv": 3, "dv": 1, "dk": 2}  # the dK/dV kernel's GRADS constexpr per launch
BLOCK_CHOICES = (16, 32, 64, 128)
NUM_WARPS_CHOICES = (4, 8)
NUM_STAGES_CHOICES = (2, 3)


def smem_model(arch: GpuArch, kernel: str, dropout: bool) -> Model:
    if kernel == "dq":
        return Model("backward_model.dq_smem_expression", (arch, dropout))
    return Model("backward_model.dkdv_smem_expression", (arch, dropout, GRADS_OF[kernel]))


def regs_model(arch: GpuArch, kernel: str) -> Model:
    return Model("backward_model.regs_expression", (arch, kernel))


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
    smem_m, regs_m = smem_model(arch, kernel, spec.dropout), regs_model(arch, kernel)
    smem_f, regs_f = compiled(smem_m, MODEL_NAMES), compiled(regs_m, MODEL_NAMES)
    reads = expression_reads(spec)
    candidates = [
        _candidate(arch, kernel, TileConfig(bm, bn, w, s), reads, smem_f, regs_f, d, dv, e)
        for bm, bn, w, s in itertools.product(
            BLOCK_CHOICES, BLOCK_CHOICES, NUM_WARPS_CHOICES, NUM_STAGES_CHOICES
        )
    ]
    chosen = _choice(candidates, arch, tuned, kernel)
    values = {"D": d, "DV": dv, "E": e}
    worked: dict[str, str] = {}
    binding = "nothing fits"
    if chosen is not None:
        at = {
            "BLOCK_M": chosen.block_m,
            "BLOCK_N": chosen.block_n,
            "S": chosen.num_stages,
            "W": chosen.num_warps,
            **values,
        }
        worked = {
            "smem": active_formula(smem_m, at),
            "regs": active_formula(regs_m, at),
            "values": ", ".join(f"{name}={at[name]}" for name in WORKED_ORDER),
        }
        binding = binding_constraint(next(c for c in candidates if c.config == chosen), candidates)
    return Derivation(
        arch=arch_name,
        source=source if tuned is not None else "heuristic",
        expressions=LazyText(
            lambda: {"smem": substituted(smem_m, values), "regs": substituted(regs_m, values)}
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
