"""Tiles of the absorbed multi-head latent attention decode (decode.py.jinja with rope_dim).

DeepSeek-V3 decodes in the absorbed form: MQA over a latent cache of D = 576 dims (512 latent +
64 rope) whose first DV = 512 dims are the values. Its kernel differs from the other decode
kernels' loop in what a program stages, so it has a model of its own:
- q.k is two dots, q_lat [rows, DV] . k_lat^T and q_rope [rows, R] . k_rope (R = D - DV), over
  one key tile of D dims: nothing is padded to the next power of two (1024);
- with v_cache = k_cache[..., :DV] (V_FROM_K) the latent tile [BLOCK_N, DV] is also V, so a key
  tile is D * E bytes, not (D + DV) * E; a v_cache of its own adds its DV * E per key, and is
  served by a config of its own (the module's SEPARATE_V_CONFIG);
- a program holds up to 64 query-head rows (FlashMLA's 64), so 128 heads read each latent byte
  twice (the second read mostly from L2), and its [rows, DV] fp32 accumulator needs 8 warps.

Shared memory, as Triton 3.6 allocates it for the paged latent cache
(attngen/verify/data/decode_compile_triton-3.6.0.json; tools/decode_compile_check.py):
- wgmma (sm90, rows >= 64): the Q tile, and two key-tile buffers at num_stages 2 (the next
  tile's copy in flight while the current one is multiplied); at least the epilogue's
  [rows, DV] fp32 layout change:  max(rows*DV*4, E*(rows*D + 2*BLOCK_N*KV))
- mma.sync: the Q tile, one key-tile buffer (block-table addressed loads are not multi-
  buffered) and P [rows, BLOCK_N]:  E*(rows*D + BLOCK_N*KV + rows*BLOCK_N)
with KV = D (V_FROM_K) or D + DV. Only num_stages 2 is a candidate: with 1, loads and math
alternate (and Triton stages the tile through extra layouts), with 3 nothing more is buffered.

Registers per thread ~ rows*(DV + BLOCK_N)/(32*W) (the accumulator and the score tile spread
over the warps) + REGISTER_BASE (Q fragments, addresses, the softmax state), and mma.sync holds
the key tile's B fragments as well (+ BLOCK_N). It bounds rather than predicts (the compiler's
spills move by tens of bytes between neighbours), so the chosen configs are compiled and their
spills recorded (tests/test_decode_tiling.py holds them to at most 64 bytes).
"""

from __future__ import annotations

import itertools
import math
from functools import cache

from attngen.arch import ARCHS, GpuArch
from attngen.spec import AttnSpec
from attngen.tiling.decode_rows import decode_score, row_tile
from attngen.tiling.prefill import (
    Candidate,
    Derivation,
    TileConfig,
    binding_constraint,
    resource_limits,
)

LATENT_ROW_TILES = (64, 32, 16)
LATENT_BLOCK_N_CHOICES = (16, 32, 64)
LATENT_WARPS_CHOICES = (4, 8, 16)
LATENT_STAGES = 2
REGISTER_BASE = 96
SMEM_TEXT = {
    True: "max(rows*DV*4, E*(rows*D + 2*BLOCK_N*KV))  (wgmma: rows >= 64)",
    False: "E*(rows*D + BLOCK_N*KV + rows*BLOCK_N)  (mma.sync)",
}


def uses_wgmma(arch: GpuArch, rows: int) -> bool:
    """Triton's dots go through Hopper's warpgroup MMA for 16-bit tiles of >= 64 rows."""
    return arch.has_wgmma and rows >= 64


def latent_smem(
    arch: GpuArch, rows: int, block_n: int, d: int, dv: int, e: int, v_from_k: bool
) -> int:
    kv = d if v_from_k else d + dv  # dims a key tile holds per key
    if uses_wgmma(arch, rows):
        return max(rows * dv * 4, e * (rows * d + 2 * block_n * kv))
    return e * (rows * d + block_n * kv + rows * block_n)


def latent_regs(arch: GpuArch, rows: int, block_n: int, warps: int, dv: int) -> int:
    spread = math.ceil(rows * (dv + block_n) / (32 * warps))
    return spread + REGISTER_BASE + (0 if uses_wgmma(arch, rows) else block_n)


def register_cap(arch: GpuArch, warps: int) -> int:
    """Registers a thread may hold: the ISA's limit, or the SM's file over the block's threads."""
    return min(arch.max_regs_per_thread, arch.regs_per_sm // (32 * warps))


def latent_candidate(
    spec: AttnSpec, arch: GpuArch, config: TileConfig, v_from_k: bool
) -> Candidate:
    rows, bn, w = config.block_m, config.block_n, config.num_warps
    d, dv, e = spec.head_dim, spec.value_head_dim, spec.dtype.itemsize
    smem_b = latent_smem(arch, rows, bn, d, dv, e, v_from_k)
    regs_t = latent_regs(arch, rows, bn, w, dv)
    cap = register_cap(arch, w)
    reasons, per_sm = resource_limits(arch, smem_b, regs_t, w, cap)
    score = 0.0
    if not reasons:  # one key tile in flight per program (num_stages 2)
        score = decode_score(per_sm, bn, d, 0 if v_from_k else dv, e, LATENT_STAGES)
    return Candidate(
        config, smem_b, regs_t, per_sm, round(score, 6), tuple(reasons), spec.dtype.itemsize != 4
    )


def _preference(cand: Candidate, arch: GpuArch) -> tuple[bool, int, float, int, int]:
    """Predicted not to spill first (against the warps' register cap), then the wider row
    tile, the score, fewer warps and less shared memory."""
    c = cand.config
    return (
        cand.regs_per_thread <= register_cap(arch, c.num_warps),
        c.block_m,
        cand.score,
        -c.num_warps,
        -cand.smem_bytes,
    )


@cache
def derive_latent_tiles(spec: AttnSpec, arch_name: str, v_from_k: bool = True) -> Derivation:
    """The latent decode's candidates on `arch_name` for V_FROM_K (the served path) or a
    v_cache of its own, and the preferred one; row tiles up to the spec's query group."""
    arch = ARCHS[arch_name]
    group = row_tile(spec.num_q_heads, spec.num_kv_heads, spec.query_tokens)
    grid = itertools.product(
        [r for r in LATENT_ROW_TILES if r <= group], LATENT_BLOCK_N_CHOICES, LATENT_WARPS_CHOICES
    )
    candidates = tuple(
        latent_candidate(spec, arch, TileConfig(r, n, w, LATENT_STAGES), v_from_k)
        for r, n, w in grid
    )
    feasible = [c for c in candidates if c.feasible]
    d, dv, e = spec.head_dim, spec.value_head_dim, spec.dtype.itemsize
    kv = "D" if v_from_k else "D + DV"
    derivation = Derivation(
        arch=arch_name,
        source="heuristic",
        expressions={
            "smem": f"{SMEM_TEXT[True]}; {SMEM_TEXT[False]}; KV = {kv}",
            "regs": f"rows*(DV + BLOCK_N)/(32*W) + {REGISTER_BASE} (+ BLOCK_N on mma.sync)",
            "score": f"min(1, min(programs/SM, 2) * BLOCK_N*KV*E / 65536), KV = {kv}",
        },
        constraints=("smem", "regs", "occupancy"),
        candidates=candidates,
        chosen=None,
        binding="nothing fits",
        dims={"D": d, "DV": dv, "E": e},
        tma=False,
    )
    if not feasible:
        return derivation
    best = max(feasible, key=lambda c: _preference(c, arch))
    c = best.config
    wgmma = uses_wgmma(arch, c.block_m)
    values = f"rows={c.block_m}, BLOCK_N={c.block_n}, W={c.num_warps}, D={d}, DV={dv}, E={e}"
    worked = {
        "smem": SMEM_TEXT[wgmma] + f", KV = {kv}",
        "regs": f"rows*(DV + BLOCK_N)/(32*W) + {REGISTER_BASE}" + ("" if wgmma else " + BLOCK_N"),
        "values": values,
    }
    return Derivation(
        arch=arch_name,
        source="heuristic",
        expressions=derivation.expressions,
        constraints=derivation.constraints,
        candidates=candidates,
        chosen=c,
        binding=binding_constraint(best, list(candidates)),
        worked=worked,
        dims=derivation.dims,
        tma=False,
    )
