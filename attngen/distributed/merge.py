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


def merge_partial(
    acc: torch.Tensor, acc_lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor
) -> None:
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
    contribution = torch.where(
        (w_part == 0)[..., None], 0.0, part.float() * (w_part * inv)[..., None]
    )
    acc.mul_((w_acc * inv)[..., None]).add_(contribution)
    acc_lse.copy_(top + torch.log(total))


def merge_triton(acc, acc_lse, part, part_lse, *, block_m: int = 64) -> None:
    batch, heads, rows, dim_v = acc.shape
    if acc_lse.numel() == 0:
        return
    block_d = max(16, 1 << (dim_v - 1).bit_length())
    grid = (-(-rows // block_m), batch * heads)
    tensors = (acc, acc_lse, part, part_lse)
    strides = (*acc.stride(), *acc_lse.stride(), *part.stride(), *part_lse.stride())
    _merge_kernel()[grid](
        *tensors, heads, rows, dim_v, *strides, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=4
    )


@functools.cache
def _merge_kernel():
    """The Triton kernel (merge_kernel.py), imported on first use: importing this module needs
    no triton, and TRITON_INTERPRET is read when the kernel is defined."""
    from attngen.distributed.merge_kernel import merge_kernel

    return merge_kernel
