"""Exact merge of partial attention results through their log-sum-exp.

Attention over keys K1 + K2 from the results over K1 and K2 alone (out_i, lse_i):

    lse = log(exp(lse_1) + exp(lse_2)),   out = exp(lse_1 - lse) out_1 + exp(lse_2 - lse) out_2

computed as m = max(lse_1, lse_2), w_i = exp(lse_i - m), lse = m + log(w_1 + w_2),
out = (w_1 out_1 + w_2 out_2) / (w_1 + w_2). A partial that saw no key (lse -inf, output 0)
gets weight 0 (its stored output is never multiplied, so no 0 x NaN); when both did, m is
taken as 0 so that no -inf - -inf = NaN appears, and the row stays output 0, LSE -inf. The
accumulator is fp32 and updated in place; partials may be in any float dtype and any strides
(views of a larger output).

Two implementations of the same arithmetic: `merge_torch` (any device; five elementwise
passes) and `merge_triton` (CUDA, or CPU under TRITON_INTERPRET=1; one pass that reads the
accumulator and the partial once and writes the accumulator once). `merge_partial` runs the
Triton one on CUDA and the torch one on the CPU (the interpreter is slower than torch there).
"""

from __future__ import annotations

import functools

import torch


def merge_partial(acc: torch.Tensor, acc_lse: torch.Tensor, part: torch.Tensor,
                  part_lse: torch.Tensor) -> None:
    """acc [B, H, M, Dv] fp32 and acc_lse [B, H, M] fp32 absorb part and part_lse, in place."""
    if acc.is_cuda:
        merge_triton(acc, acc_lse, part, part_lse)
    else:
        merge_torch(acc, acc_lse, part, part_lse)


def merge_torch(acc, acc_lse, part, part_lse) -> None:
    top = torch.maximum(acc_lse, part_lse)
    top = torch.where(top == float("-inf"), 0.0, top)
    w_acc, w_part = torch.exp(acc_lse - top), torch.exp(part_lse - top)
    total = w_acc + w_part
    inv = torch.where(total == 0, 0.0, 1.0 / total)
    contribution = torch.where((w_part == 0)[..., None], 0.0,
                               part.float() * (w_part * inv)[..., None])
    acc.mul_((w_acc * inv)[..., None]).add_(contribution)
    acc_lse.copy_(top + torch.log(total))


def merge_triton(acc, acc_lse, part, part_lse, *, block_m: int = 64) -> None:
    batch, heads, rows, dim_v = acc.shape
    if acc_lse.numel() == 0:
        return
    block_d = max(16, 1 << (dim_v - 1).bit_length())
    grid = (-(-rows // block_m), batch * heads)
    _merge_kernel()[grid](
        acc, acc_lse, part, part_lse, heads, rows, dim_v,
        *acc.stride(), *acc_lse.stride(), *part.stride(), *part_lse.stride(),
        BLOCK_M=block_m, BLOCK_D=block_d, num_warps=4)


@functools.cache
def _merge_kernel():
    """The Triton kernel, defined on first use: importing this module needs no triton, and
    TRITON_INTERPRET is read when the kernel is defined."""
    import triton
    import triton.language as tl

    @triton.jit
    def merge_kernel(Acc, AccLse, Part, PartLse, heads, rows, dim_v,
                     s_ab, s_ah, s_am, s_ad, s_lab, s_lah, s_lam,
                     s_pb, s_ph, s_pm, s_pd, s_lpb, s_lph, s_lpm,
                     BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
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
        lse_p = tl.load(PartLse + off_b * s_lpb + off_h * s_lph + offs_m * s_lpm, mask=row_ok,
                        other=float("-inf"))
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
        acc_ptrs = (Acc + off_b * s_ab + off_h * s_ah + offs_m[:, None] * s_am
                    + offs_d[None, :] * s_ad)
        part_ptrs = (Part + off_b * s_pb + off_h * s_ph + offs_m[:, None] * s_pm
                     + offs_d[None, :] * s_pd)
        acc = tl.load(acc_ptrs, mask=tile_ok, other=0.0)
        part = tl.load(part_ptrs, mask=tile_ok, other=0.0).to(tl.float32)
        contribution = tl.where((w_p == 0)[:, None], 0.0, part * (w_p * inv)[:, None])
        tl.store(acc_ptrs, acc * (w_a * inv)[:, None] + contribution, mask=tile_ok)
        tl.store(lse_a_ptrs, tl.where(empty, float("-inf"), top + tl.log(safe_total)),
                 mask=row_ok)

    return merge_kernel
