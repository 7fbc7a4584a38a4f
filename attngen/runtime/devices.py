"""Which device a call's tensors are on, and whether generated kernels can run there.

CUDA tensors run on the module built for the device's arch (sm<major><minor>). CPU tensors run
under Triton's interpreter, which triton enables when it is imported with TRITON_INTERPRET=1
(its own @triton.jit helpers are made interpreted or compiled at that moment, so setting the
variable later leaves a half-interpreted triton that fails inside the first kernel).

bf16 under the interpreter: Triton 3.6's interpreter computes bf16 dots and arithmetic on the
raw uint16 bit patterns (triton-lang/triton#11584), so every kernel returns garbage for bf16. The
runtime does not patch triton (a library must not change how other people's kernels run);
it refuses bf16 on the interpreter with an error saying why, unless bf16 math has been made
correct there: a tiny probe kernel (below) is run once and must give torch's
bits. The test suite's shim (tests/interpreter_bf16.py) passes the probe, and so will a Triton
release that fixes the issue.

The probe: one 16 x 16 tile exercises what attention kernels do with bf16: a dot with an fp32
accumulator, elementwise bf16 arithmetic, a row sum, and the fp32 -> bf16 cast (round to
nearest even). The results must equal torch's bit for bit; Triton 3.6's interpreter fails
all four, a correct one (or the tests' shim) passes.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from attngen.runtime.selection import INTERPRETER
from attngen.spec import Dtype

_bf16_ok = False  # only a passed probe is remembered: a shim may be installed later


def interpreter_wanted() -> bool:
    """TRITON_INTERPRET=1, as the generated modules read it."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_interprets() -> bool:
    """Whether the imported triton runs kernels in its interpreter (importing it if needed:
    then the variable's value now decides)."""
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.cdiv, InterpretedFunction)


def device_arch(device) -> str:
    """sm<major><minor> of a CUDA device; INTERPRETER for CPU tensors when Triton's interpreter
    is on; otherwise the device type (device_problem says why nothing runs there)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"sm{major}{minor}"
    if device.type == "cpu" and interpreter_wanted() and triton_interprets():
        return INTERPRETER
    return device.type


def device_problem(api: str, arch: str, dtype: Dtype | None) -> str | None:
    """Why no generated kernel can run a call on this device (arch from device_arch), or
    None."""
    if arch == "cpu":
        if not interpreter_wanted():
            return (
                "q is a CPU tensor: generated kernels run on CUDA tensors, or on CPU "
                "tensors under Triton's interpreter: set TRITON_INTERPRET=1 in the "
                "environment before triton is imported (before importing attngen, torch "
                "libraries that import triton, or the generated modules)"
            )
        return (
            "q is a CPU tensor and TRITON_INTERPRET=1 is set, but triton was imported "
            "before it was set, so triton is not in interpreter mode (it decides at "
            "import) and its kernels would fail; set TRITON_INTERPRET=1 before anything "
            "imports triton (in the shell, or first thing in the script)"
        )
    if arch != INTERPRETER and not arch.startswith("sm"):
        return f"q is on device type {arch!r}: generated kernels run on CUDA tensors"
    if arch == INTERPRETER and dtype is Dtype.bf16 and not bf16_interpreter_ok():
        return (
            "dtype bf16 on CPU tensors: Triton's interpreter computes bfloat16 dots and "
            "arithmetic on the raw bit patterns (triton-lang/triton#11584) and returns garbage; "
            "use fp16 or fp32 on the CPU, or CUDA for bf16"
        )
    return None


def problem_may_change(arch: str, dtype: Dtype | None) -> bool:
    """Whether device_problem's answer for (arch, dtype) may change in this process: bf16
    under the interpreter, which a shim (or a probe that passes later) makes correct, and a
    test may make incorrect again. Every other answer is fixed by the arch and the dtype."""
    return arch == INTERPRETER and dtype is Dtype.bf16


def bf16_interpreter_ok() -> bool:
    """Whether the interpreter computes bf16 correctly now (a probe kernel, cached once it
    passes)."""
    global _bf16_ok
    if not _bf16_ok:
        _bf16_ok = bf16_math_is_correct()
    return _bf16_ok


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
