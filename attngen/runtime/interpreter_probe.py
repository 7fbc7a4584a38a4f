"""A probe of bf16 math under Triton's interpreter (imported only when the interpreter is on).

One 16 x 16 tile exercises what attention kernels do with bf16: a dot with an fp32
accumulator, elementwise bf16 arithmetic, a row sum, and the fp32 -> bf16 cast (round to
nearest even). The results must equal torch's bit for bit; Triton 3.6's interpreter fails
all four (triton-lang/triton#11584), a correct one (or the tests' shim) passes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _bf16_probe_kernel(A, B, Dot, Prod, RowSum, Cast, N: tl.constexpr):
    rows = tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :]
    a = tl.load(A + rows)
    b = tl.load(B + rows)
    tl.store(Dot + rows, tl.dot(a, b, input_precision="ieee"))
    tl.store(Prod + rows, a * b)
    tl.store(RowSum + tl.arange(0, N), tl.sum(a.to(tl.float32), 1))
    tl.store(Cast + rows, (a.to(tl.float32) / 3.0).to(tl.bfloat16))


def bf16_math_is_correct() -> bool:
    n = 16
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, n, generator=gen).to(torch.bfloat16)
    dot = torch.empty(n, n)
    prod = torch.empty(n, n, dtype=torch.bfloat16)
    row_sum = torch.empty(n)
    cast = torch.empty(n, n, dtype=torch.bfloat16)
    _bf16_probe_kernel[(1,)](a, b, dot, prod, row_sum, cast, N=n)
    # The dot's summation order may differ from torch's: a relative 1e-5 separates that from
    # bit-pattern garbage (wrong by orders of magnitude). The rest is exact in any order.
    expected_dot = a.float() @ b.float()
    return bool(
        torch.allclose(dot, expected_dot, rtol=1e-5, atol=1e-5)
        and torch.equal(prod, a * b)
        and torch.allclose(row_sum, a.float().sum(1), rtol=1e-6, atol=1e-6)
        and torch.equal(cast, (a.float() / 3.0).to(torch.bfloat16))
    )
