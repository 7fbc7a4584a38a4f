"""Decode tiles and the split-KV rule: what a decode program holds, and how many programs run.

The decode kernel (decode.py.jinja) is the prefill kernel's key loop with a packed query tile:
one program takes all query heads of one KV head and all query tokens of the step (q_per_kv *
Nq rows, padded to a power of two >= 16), so every K/V byte crosses HBM once, and streams a
range of the keys in BLOCK_N tiles. Its loop stages prefill's buffers, so attngen.tiling.prefill's
expressions apply with BLOCK_M = the row tile (tests/test_decode_tiling.py holds them).

What differs is the goal. Decode does almost no arithmetic per byte, so a config is worth
what it keeps in flight: by Little's law an SM needs about 72 KiB of outstanding loads to draw
its share of HBM bandwidth (an H200's 4.8 TB/s x ~2 us loaded latency / 132 SMs). Measured on
the H200 (exp_decode.py@163a2b7), 64 KiB is enough: two stages read B=64 x 4096 keys at 0.99
of the copy rate, where three stages (fewer programs per SM) fell to 0.87. A pipelined
program (S >= 2) has S - 1 K/V tile pairs in flight; without pipelining (S = 1) loads and math
alternate, counted as a quarter of a tile pair (one stage read a paged cache at 0.54 of the
copy rate). Score = min(1, in-flight bytes / 64 KiB) with at most SPLIT_WAVES programs counted
per SM (the split rule below aims at about that many); ties go to fewer stages.

The split rule (flash-decoding) runs on the host at every call, from shapes only (no device
read, so a CUDA graph can capture the launch); the generated module carries the same rule with
these constants (tests check both agree):

    programs without splitting: B * HKV (* row blocks when the query tile exceeds BLOCK_M)
    at most  = clamp(blocks // MIN_BLOCKS_PER_SPLIT, 1, MAX_SPLITS)   blocks = ceil(span / BLOCK_N)
    wanted   = min(ceil(SPLIT_WAVES * SMs / programs), at most)     about two programs per SM
    splits   = the count in wanted..min(2 * wanted, at most) whose programs fill their last
               wave of SMs best (programs x splits / (SMs x waves), the first best), then
               evened out so that no split is empty: per split = ceil(blocks / splits) blocks,
               splits = ceil(blocks / per split)

span is the cache capacity (Lmax, or max_pages * page_size) or, with a window (chunks), at
most window_left (chunk_size) + query tokens + BLOCK_N keys; sink tokens add their blocks.

A call's num_splits = s >= 1 (flash_attn_with_kvcache's hint) replaces the rule's count: the
span's blocks in min(s, MAX_SPLITS) splits (the combine kernel's bound), evened out as above.
"""

from __future__ import annotations

import itertools
import math

from attngen.arch import ARCHS, GpuArch
from attngen.spec import AttnSpec
from attngen.tiling.decode_latent import derive_latent_tiles
from attngen.tiling.decode_rows import IN_FLIGHT_TARGET as IN_FLIGHT_TARGET
from attngen.tiling.decode_rows import MAX_ROW_TILE as MAX_ROW_TILE
from attngen.tiling.decode_rows import SPLIT_WAVES as SPLIT_WAVES
from attngen.tiling.decode_rows import UNPIPELINED_SHARE as UNPIPELINED_SHARE
from attngen.tiling.decode_rows import decode_score as decode_score
from attngen.tiling.decode_rows import row_tile as row_tile
from attngen.tiling.evaluate import LazyText, substituted
from attngen.tiling.prefill import (
    Candidate,
    Derivation,
    TileConfig,
    choose,
    constraint_labels,
    expression_reads,
    key_loop_read_smem,
    numeric_model,
    padded_head_dim,
    regs_model,
    resource_limits,
    smem_model,
)

DECODE_BLOCK_N_CHOICES = (32, 64, 128)
DECODE_WARPS_CHOICES = (4, 8)
DECODE_STAGES_CHOICES = (1, 2, 3, 4)
# Narrow tiles, tried only when no candidate of the row tile fits (wide heads: multi-head
# latent attention's absorbed decode, D 576 -> 1024 padded, DV 512): fewer query rows per
# program (more row blocks, each reading the keys again, mostly from L2) and 16-key tiles.
NARROW_ROW_TILES = (32, 16)
NARROW_BLOCK_N_CHOICES = (16, 32, 64)
# The split rule's constants (rendered into the generated module).
MIN_BLOCKS_PER_SPLIT = 4
MAX_SPLITS = 64
INTERPRETER_SM_COUNT = 132  # what the generated module assumes without a GPU (an H100/H200)

# Reference problems `attngen explain` works the split rule out for (batch, cache length).
REFERENCE_PROBLEMS = ((1, 4096), (8, 32768), (64, 4096))
SCORE_TEXT = (
    f"min(1, min(programs/SM, {SPLIT_WAVES}) * BLOCK_N*(D + DV)*E * (S - 1, or "
    f"{UNPIPELINED_SHARE} for S = 1) / {IN_FLIGHT_TARGET}) (bytes in flight per SM)"
)


def latent_rope_split(spec: AttnSpec) -> tuple[int, int] | None:
    """(latent, rope) dims of an absorbed multi-head latent attention decode, else None.

    A qk head dim that is not a power of two but is the value head dim (a power of two, the
    latent) plus a power of two >= 16 (the rope part), as DeepSeek-V3's 576 = 512 + 64: the
    decode kernel computes q.k as two dots over one key tile (no padding to 1024), and when
    the call's v_cache is k_cache[..., :DV] (the values are the latent keys) it uses the
    loaded latent tile as V instead of reading V again (decode.py.jinja)."""
    d, dv = spec.head_dim, spec.value_head_dim
    rope = d - dv

    def power_of_two(n: int) -> bool:
        return n >= 16 and n & (n - 1) == 0

    if d & (d - 1) == 0 or not (power_of_two(dv) and power_of_two(rope) and rope < dv):
        return None
    return dv, rope


def derive_decode_tiles(spec: AttnSpec, arch_name: str) -> Derivation:
    """Every decode candidate on `arch_name`, judged like prefill's, scored by bytes in flight.

    The row tile is fixed by the spec (its head ratio and max_query_tokens): it is what a
    program holds in the worst case the spec allows, so feasibility is judged there. When no
    candidate of it fits, narrower row tiles (NARROW_ROW_TILES: the query group in several
    row blocks) and 16-key tiles are judged instead. An absorbed MLA decode (latent_rope_split)
    has its own kernel loop and model: attngen/tiling/decode_latent.py."""
    if latent_rope_split(spec):
        return derive_latent_tiles(spec, arch_name)
    arch = ARCHS[arch_name]
    rows = row_tile(spec.num_q_heads, spec.num_kv_heads, spec.query_tokens)
    d, dv = padded_head_dim(spec.head_dim), padded_head_dim(spec.value_head_dim)
    candidates = _candidates(spec, arch, (rows,), DECODE_BLOCK_N_CHOICES)
    if not any(c.feasible for c in candidates):
        narrow = tuple(r for r in NARROW_ROW_TILES if r < rows)
        if narrow:
            candidates += _candidates(spec, arch, narrow, NARROW_BLOCK_N_CHOICES)
    feasible = [c for c in candidates if c.feasible]
    best = max(feasible, key=lambda c: _preference(c, arch)) if feasible else None
    shown = best.config.block_m if best else rows
    values = {"D": d, "DV": dv, "E": spec.dtype.itemsize, "BLOCK_M": shown}
    derivation = Derivation(
        arch=arch_name,
        source="heuristic",
        expressions=LazyText(
            lambda: {
                "smem": substituted(smem_model(arch, tma=False), values),
                "regs": substituted(regs_model(arch), values),
                "score": SCORE_TEXT,
            }
        ),
        constraints=constraint_labels(arch)[:3],
        candidates=tuple(candidates),
        chosen=None,
        binding="nothing fits",
        dims={"D": d, "DV": dv, "E": spec.dtype.itemsize},
        tma=False,
    )
    if best is None:
        return derivation
    return choose(derivation, best.config, "heuristic")


def fp8_cache_smem(arch: GpuArch, config: TileConfig, d: int, dv: int, e: int) -> int:
    """Shared memory of a decode program over fp8 caches (`kv_dtype`), where the 16-bit model
    counts every K and V element at E bytes. Cross-compiled for sm90 (D 64/128/256, BLOCK_N
    16-128, 1-4 stages): the fp8 tiles are buffered at a byte an element as the 16-bit ones
    are, Q and a staged P at E; wgmma (BLOCK_M >= 64) also holds one [BLOCK_N, max(D, DV)]
    tile converted to E bytes (its B operand). Exact on contiguous caches; paged ones at 3
    stages buffer one fp8 stage (the block table's gather is not pipelined), so it bounds
    them there."""
    bm, bn, s = config.block_m, config.block_n, config.num_stages
    stage = bn * (d + dv)  # one stage of fp8 K and V
    if arch.has_wgmma and bm >= 64:
        return e * (bm * d + bn * max(d, dv)) + s * stage
    if s == 1:
        return e * bm * d + max(bn * d, e * bm * bn)
    return e * (bm * d + (bm * bn if bm < dv else 0)) + (s - 1) * stage


def _candidates(
    spec: AttnSpec, arch: GpuArch, row_tiles: tuple[int, ...], block_ns: tuple[int, ...]
) -> list[Candidate]:
    d, dv = padded_head_dim(spec.head_dim), padded_head_dim(spec.value_head_dim)
    smem_f, regs_f = numeric_model(arch, tma=False)  # decode loads through pointers
    reads, e, paged = expression_reads(spec), spec.dtype.itemsize, spec.kv_layout == "paged"
    candidates = []
    for rows, bn, w, s in itertools.product(
        row_tiles, block_ns, DECODE_WARPS_CHOICES, DECODE_STAGES_CHOICES
    ):
        at = (rows, bn, s, w, d, dv, e)  # MODEL_NAMES' order
        config = TileConfig(rows, bn, w, s)
        smem_b = fp8_cache_smem(arch, config, d, dv, e) if spec.kv_dtype else int(smem_f(*at))
        smem_b, regs_t = smem_b + key_loop_read_smem(reads, config), int(math.ceil(regs_f(*at)))
        reasons, per_sm = resource_limits(arch, smem_b, regs_t, w)
        # fp8: a byte an element in flight, and paged fp8 tiles buffered once (fp8_cache_smem)
        kv_bytes, buffered = (1, min(s, 2) if paged else s) if spec.kv_dtype else (e, s)
        score = 0.0 if reasons else decode_score(per_sm, bn, d, dv, kv_bytes, buffered)
        scored = (per_sm, round(score, 6), tuple(reasons), e != 4)
        candidates.append(Candidate(config, smem_b, regs_t, *scored))
    return candidates


def _preference(cand: Candidate, arch: GpuArch) -> tuple[bool, int, float, float, int, int, int]:
    """Safe before may-spill, then the wider row tile (fewer re-reads of the keys), then the
    score; among equals BLOCK_N 64 (a K tile of 64 rows already makes full 128-byte
    transactions, and finer tiles let splits be finer), then fewer warps (more programs per
    SM), fewer stages and less shared memory."""
    c = cand.config
    return (
        not cand.may_spill(arch),
        c.block_m,
        cand.score,
        -abs(math.log2(c.block_n / 64)),
        -c.num_warps,
        -c.num_stages,
        -cand.smem_bytes,
    )


def split_span(spec: AttnSpec, capacity: int, block_n: int, query_tokens: int) -> int:
    """Keys a step can reach: the capacity, or with a window (a chunk) the window (the
    chunk) and the step; sink tokens add their blocks."""
    reach = spec.chunk_size if spec.chunk_size else (spec.window[0] if spec.window else None)
    span = capacity if reach is None else min(capacity, reach + query_tokens + block_n)
    if spec.sink_tokens:
        span += -(-min(spec.sink_tokens, capacity) // block_n) * block_n
    return span


def num_splits(programs: int, span: int, block_n: int, sm_count: int) -> tuple[int, int]:
    """(splits, keys per split) for `programs` (batch x KV heads x row blocks) over `span` keys;
    the rule of the module docstring, mirrored by the generated module's `_num_splits`.
    Integer arithmetic only, so both give the same answer."""
    blocks = max(1, -(-span // block_n))
    most = max(1, min(blocks // MIN_BLOCKS_PER_SPLIT, MAX_SPLITS))
    wanted = min(-(-SPLIT_WAVES * sm_count // max(programs, 1)), most)
    best, best_total, best_waves = wanted, 0, 1
    for splits in range(wanted, min(2 * wanted, most) + 1):
        total = programs * splits
        waves = -(-total // sm_count)
        if total * best_waves > best_total * waves:  # a fuller last wave
            best, best_total, best_waves = splits, total, waves
    per_split = -(-blocks // best)
    return -(-blocks // per_split), per_split * block_n


def split_lines(spec: AttnSpec, config: TileConfig, sm_count: int) -> list[str]:
    """The split rule worked out for REFERENCE_PROBLEMS with the spec's heads."""
    ratio = spec.num_q_heads // spec.num_kv_heads
    row_blocks = -(-ratio // config.block_m)  # one query token
    lines = [
        f"num_splits rule ({sm_count} SMs, BLOCK_N={config.block_n}): programs = B x "
        f"HKV{' x row blocks' if row_blocks > 1 else ''}; at most clamp(blocks // "
        f"{MIN_BLOCKS_PER_SPLIT}, 1, {MAX_SPLITS}); wanted = ceil({SPLIT_WAVES} x SMs / "
        "programs); the count in wanted..2 x wanted that fills its last wave best"
    ]
    for batch, length in REFERENCE_PROBLEMS:
        capacity = length
        if spec.page_size is not None:  # a paged cache: whole pages
            capacity = -(-length // spec.page_size) * spec.page_size
        span = split_span(spec, capacity, config.block_n, 1)
        programs = batch * spec.num_kv_heads * row_blocks
        splits, keys = num_splits(programs, span, config.block_n, sm_count)
        blocks = -(-span // config.block_n)
        wanted = -(-SPLIT_WAVES * sm_count // programs)
        total = programs * splits
        most = max(1, min(blocks // MIN_BLOCKS_PER_SPLIT, MAX_SPLITS))
        lines.append(
            f"  B={batch} L={length}: {programs} programs, span {span} keys = {blocks} blocks, "
            f"wanted {min(wanted, most)}, at most {most} -> {splits} "
            f"split(s) of {keys} keys: {total} programs = {total / sm_count:.2f} per SM"
            + ("" if splits > 1 else " (no combine: written directly)")
        )
    return lines
