"""Proves tests/interpreter_bf16.py makes bf16 kernels correct under TRITON_INTERPRET=1.

Every bf16 case is first run WITHOUT the shim in a fresh subprocess (install() patches the
interpreter globally, so the pristine behaviour can only be observed in another process) and
must come out wrong there; then it runs here with the shim and must match torch.
"""

import os

import pytest
import torch

if torch.cuda.is_available():  # these tests are about the CPU interpreter; a GPU run has none
    pytest.skip("interpreter-only tests: CUDA is available", allow_module_level=True)
# must precede `import triton`: @triton.jit picks the interpreter at decoration
os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402
import pathlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import interpreter_bf16  # noqa: E402

TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# ----------------------------------------------------------------------------- kernels
@triton.jit
def dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    rm, rk, rn = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])  # bf16 [M, K]
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])  # bf16 [K, N]
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], tl.dot(a, b))  # fp32 accumulate


@triton.jit
def elementwise_kernel(x_ptr, y_ptr, z_ptr, n: tl.constexpr, DT: tl.constexpr):
    offs = tl.arange(0, n)
    x = tl.load(x_ptr + offs)
    y = (x * 1.5 + x).to(DT)  # bf16 mul/add, each rounded to bf16
    z = tl.exp2(y.to(tl.float32))  # fp32 math on a bf16 value
    tl.store(y_ptr + offs, y)
    tl.store(z_ptr + offs, z.to(DT))  # fp32 -> bf16 RTNE


@triton.jit
def pv_kernel(
    p_ptr,
    v_ptr,
    o_ptr,
    pq_ptr,
    M: tl.constexpr,
    N: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DT: tl.constexpr,
):
    # attention's P@V: fp32 probabilities cast to bf16 in-kernel, dotted with a bf16 V tile
    rm, rn, rd = tl.arange(0, M), tl.arange(0, BLOCK_N), tl.arange(0, D)
    acc = tl.zeros([M, D], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        p = tl.load(p_ptr + rm[:, None] * N + (start + rn)[None, :])  # fp32
        pq = p.to(DT)
        tl.store(pq_ptr + rm[:, None] * N + (start + rn)[None, :], pq)
        v = tl.load(v_ptr + (start + rn)[:, None] * D + rd[None, :])
        acc = tl.dot(pq, v, acc)
    tl.store(o_ptr + rm[:, None] * D + rd[None, :], acc)


@triton.jit
def cast_kernel(x_ptr, rne_ptr, rtz_ptr, n: tl.constexpr):
    offs = tl.arange(0, n)
    x = tl.load(x_ptr + offs)
    tl.store(rne_ptr + offs, x.to(tl.bfloat16))
    tl.store(rtz_ptr + offs, x.to(tl.bfloat16, fp_downcast_rounding="rtz"))


@triton.jit
def misc_kernel(x_ptr, y_ptr, max_ptr, fma_ptr, gt_ptr, sum_ptr, n: tl.constexpr):
    offs = tl.arange(0, n)
    x = tl.load(x_ptr + offs)
    y = tl.load(y_ptr + offs)
    tl.store(max_ptr + offs, tl.maximum(x, y) * 0.5)  # (tl.maximum promotes bf16 to fp32 itself)
    tl.store(fma_ptr + offs, x * y + x)  # pure bf16 arithmetic, no scalar constants involved
    tl.store(gt_ptr + offs, (x > y).to(tl.int8))  # comparison on negative bf16 values
    tl.store(sum_ptr, tl.sum(x, axis=0))  # bf16 sum (accumulated in fp32, rounded once)


@triton.jit
def full_kernel(o_ptr, n: tl.constexpr):
    # bf16 constant: semantic.scalar_constant calls builder.get_bf16, absent from the interpreter
    tl.store(
        o_ptr + tl.arange(0, n),
        tl.full([n], 1.00390625, tl.bfloat16) + tl.full([n], -3.0, tl.bfloat16),
    )


# ----------------------------------------------------------------------------- cases
def _bits(t):
    return t.view(torch.int16)


def _bitwise(out, ref):
    nan = torch.isnan(ref.float())
    return bool(
        torch.equal(torch.isnan(out.float()), nan)
        and torch.equal(_bits(out)[~nan], _bits(ref)[~nan])
    )


def _close(out, ref, rtol=1e-5):
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    return err < rtol, f"max_err/max|ref|={err:.3g}"


def case_dot(dt):
    torch.manual_seed(0)
    a, b = torch.randn(32, 64).to(dt), torch.randn(64, 32).to(dt)
    c = torch.empty(32, 32)
    dot_kernel[(1,)](a, b, c, 32, 64, 32)
    return _close(c, a.float() @ b.float())


def case_elementwise(dt):
    torch.manual_seed(1)
    x = (torch.randn(256) * 4).to(dt)
    y, z = torch.empty_like(x), torch.empty_like(x)
    elementwise_kernel[(1,)](x, y, z, 256, TL[dt])
    y_ref = x * 1.5 + x  # torch rounds each bf16 op to bf16
    z_ref = torch.exp2(y_ref.float()).to(dt)
    return _bitwise(y, y_ref) and _bitwise(z, z_ref), f"y_mismatch={(y != y_ref).sum().item()}"


def case_pv(dt):
    torch.manual_seed(2)
    s = torch.randn(32, 128)
    p = torch.exp2(s - s.max(dim=1, keepdim=True).values)  # softmax numerators in (0, 1]
    v = torch.randn(128, 32).to(dt)
    o, pq = torch.empty(32, 32), torch.empty(32, 128, dtype=dt)
    pv_kernel[(1,)](p, v, o, pq, 32, 128, 32, 64, TL[dt])
    pq_ref = p.to(dt)
    ok, msg = _close(o, pq_ref.float() @ v.float())
    return ok and _bitwise(pq, pq_ref), f"{msg} pq_bitwise={_bitwise(pq, pq_ref)}"


def _cast_inputs():
    special = np.array(
        [
            0x3F808000,  # 1 + 2^-8: exact tie -> even (down to 0x3F80)
            0x3F818000,  # tie with odd kept lsb -> up to 0x3F82
            0x3F808001,
            0xBF808000,
            0xBF818000,
            0x7F7FFFFF,  # just above tie, negative ties, rounds to inf
            0x7F800000,
            0xFF800000,
            0x80000000,
            0x00000001,
            0x00018000,
            0x807FFFFF,  # inf, -0, subnormals
            0x7FC00000,
            0x7F800001,
            0xFFFFFFFF,  # NaNs (incl. one whose payload is only in the low half)
        ],
        dtype=np.uint32,
    )
    rand = (
        np.random.default_rng(3)
        .integers(0, 2**32, size=1024 - special.size, dtype=np.uint64)
        .astype(np.uint32)
    )
    return torch.from_numpy(np.concatenate([special, rand]).view(np.float32).copy())


def case_cast(dt=torch.bfloat16):
    x = _cast_inputs()
    rne, rtz = torch.empty(x.numel(), dtype=dt), torch.empty(x.numel(), dtype=dt)
    cast_kernel[(1,)](x, rne, rtz, x.numel())
    u = x.view(torch.int32)
    rtz_ref = (u >> 16).to(torch.int16).view(torch.bfloat16)  # truncation == round toward zero ...
    rtz_ref[torch.isnan(x)] = float(
        "nan"
    )  # ... except a NaN must stay NaN (0x7F800001 would truncate to inf)
    return _bitwise(rne, x.to(dt)) and _bitwise(
        rtz, rtz_ref
    ), f"rne_ok={_bitwise(rne, x.to(dt))} rtz_ok={_bitwise(rtz, rtz_ref)}"


def case_misc(dt=torch.bfloat16):
    torch.manual_seed(4)
    x, y = torch.randn(128).to(dt), torch.randn(128).to(dt)
    mx, xyx, gt = torch.empty_like(x), torch.empty_like(x), torch.empty(128, dtype=torch.int8)
    sm = torch.empty(1, dtype=dt)
    misc_kernel[(1,)](x, y, mx, xyx, gt, sm, 128)
    checks = {
        "maximum*0.5": _bitwise(mx, torch.maximum(x, y) * 0.5),
        "x*y+x": _bitwise(xyx, x * y + x),
        "x>y": torch.equal(gt, (x > y).to(torch.int8)),
        "sum": _bitwise(sm, x.float().sum().to(dt).reshape(1)),
    }
    return all(checks.values()), str(checks)


def case_full(dt=torch.bfloat16):
    o = torch.empty(16, dtype=dt)
    full_kernel[(1,)](o, 16)
    ref = torch.full((16,), 1.00390625, dtype=dt) + torch.full(
        (16,), -3.0, dtype=dt
    )  # 1.0039 rounds to 1.0
    return _bitwise(o, ref), f"got {o[0].item()} want {ref[0].item()}"


BF16_CASES = {
    "dot": case_dot,
    "elementwise": case_elementwise,
    "pv": case_pv,
    "cast": case_cast,
    "misc": case_misc,
    "full": case_full,
}


def _report_without_shim():
    """Subprocess entry point: run every bf16 case on the pristine interpreter."""
    assert not getattr(triton.runtime.interpreter.InterpreterBuilder, "_bf16_shim_installed", False)
    res = {}
    for name, fn in BF16_CASES.items():
        try:
            ok, msg = fn(torch.bfloat16)
            res[name] = {"ok": bool(ok), "msg": msg}
        except Exception as e:  # crashing is also "not correct"
            res[name] = {"ok": False, "msg": f"{type(e).__name__}: {e}"[:200]}
    print("RESULT " + json.dumps(res))


# ----------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def without_shim():
    code = (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); "
        "import test_interpreter_bf16 as t; t._report_without_shim()"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return json.loads(line[-1][len("RESULT ") :])


@pytest.fixture(scope="module")
def shim():
    interpreter_bf16.install()
    interpreter_bf16.install()  # idempotent: second call must not double-wrap
    return interpreter_bf16


@pytest.mark.parametrize("name", list(BF16_CASES))
def test_bf16_wrong_without_shim_right_with_it(name, without_shim, shim):
    assert not without_shim[name]["ok"], (
        f"{name} was already correct without the shim: {without_shim[name]}"
    )
    ok, msg = BF16_CASES[name](torch.bfloat16)
    assert ok, f"{name} with shim: {msg} (without shim: {without_shim[name]['msg']})"


@pytest.mark.filterwarnings(
    "ignore:overflow encountered in cast:RuntimeWarning"
)  # exp2(y) overflows fp16 to inf, as in torch
@pytest.mark.parametrize("name", ["dot", "elementwise", "pv"])
def test_fp16_still_exact_with_shim(name, shim):
    ok, msg = BF16_CASES[name](torch.float16)
    assert ok, msg


def test_install_is_idempotent(shim):
    B = triton.runtime.interpreter.InterpreterBuilder
    shim.install()
    # exactly one layer of wrapping around the original binary_op
    assert B.binary_op.__wrapped__.__qualname__ == "InterpreterBuilder.binary_op"


def test_rne_helper_matches_torch_on_all_bf16_neighbourhoods(shim):
    # every bf16 value, plus exact ties and off-by-one-ulp neighbours in fp32
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    u = np.concatenate([hi, hi | 0x8000, hi | 0x7FFF, hi | 0x8001, hi | 0xFFFF])
    x = u.view(np.float32)
    ours = shim.f32_to_bf16(x).view(np.int16)
    ref = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy()
    nan = np.isnan(x)
    assert (
        np.array_equal(ours[~nan], ref[~nan])
        and np.isnan(shim.bf16_to_f32(ours.view(np.uint16))[nan]).all()
    )
