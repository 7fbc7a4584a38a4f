"""The Triton kernel of merge.py's merge_triton: one pass over the accumulator and a partial
result (the module docstring of merge.py has the arithmetic). Imported on first use
(merge._merge_kernel), so that importing merge.py needs no triton."""

import triton
import triton.language as tl


@triton.jit
def merge_kernel(
    Acc,
    AccLse,
    Part,
    PartLse,
    heads,
    rows,
    dim_v,
    s_ab,
    s_ah,
    s_am,
    s_ad,
    s_lab,
    s_lah,
    s_lam,
    s_pb,
    s_ph,
    s_pm,
    s_pd,
    s_lpb,
    s_lph,
    s_lpm,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program: BLOCK_M rows of one (batch, head), all of the value head dim. Offsets
    # in int64: a [1, 32, 1M, 128] accumulator has 2**32 elements.
    off_b = (tl.program_id(1) // heads).to(tl.int64)
    off_h = (tl.program_id(1) % heads).to(tl.int64)
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < rows
    tile_ok = row_ok[:, None] & (offs_d < dim_v)[None, :]
    lse_a_ptrs = AccLse + off_b * s_lab + off_h * s_lah + offs_m * s_lam
    lse_a = tl.load(lse_a_ptrs, mask=row_ok, other=float("-inf"))
    lse_p_ptrs = PartLse + off_b * s_lpb + off_h * s_lph + offs_m * s_lpm
    lse_p = tl.load(lse_p_ptrs, mask=row_ok, other=float("-inf"))
    # Note: rows no key reached on either side keep max -inf; 0 stands in for it so that
    # both weights are exp(-inf) = 0 instead of exp(-inf - -inf) = NaN.
    top = tl.maximum(lse_a, lse_p)
    top = tl.where(top == float("-inf"), 0.0, top)
    w_a = tl.exp(lse_a - top)
    w_p = tl.exp(lse_p - top)
    total = w_a + w_p
    # Note: `== 0` tests (not `> 0`) so that a NaN weight stays NaN in the output; the
    # divisor and log argument are 1 where total is 0, so no inf is ever formed.
    empty = total == 0
    safe_total = tl.where(empty, 1.0, total)
    inv = tl.where(empty, 0.0, 1.0 / safe_total)
    acc_ptrs = Acc + off_b * s_ab + off_h * s_ah + offs_m[:, None] * s_am + offs_d[None, :] * s_ad
    part_ptrs = Part + off_b * s_pb + off_h * s_ph + offs_m[:, None] * s_pm + offs_d[None, :] * s_pd
    acc = tl.load(acc_ptrs, mask=tile_ok, other=0.0)
    part = tl.load(part_ptrs, mask=tile_ok, other=0.0).to(tl.float32)
    contribution = tl.where((w_p == 0)[:, None], 0.0, part * (w_p * inv)[:, None])
    tl.store(acc_ptrs, acc * (w_a * inv)[:, None] + contribution, mask=tile_ok)
    tl.store(lse_a_ptrs, tl.where(empty, float("-inf"), top + tl.log(safe_total)), mask=row_ok)
