"""Test-only shim: make bfloat16 compute correctly under Triton 3.6's interpreter.

Triton's interpreter (triton/runtime/interpreter.py, TRITON_INTERPRET=1) stores bf16
tensors as raw uint16 bit patterns (`_get_np_dtype`), which is right for memory traffic
(loads/stores/splat/select/bitcast only move bits) but wrong for anything that does math:
  * `create_dot` calls np.matmul on the uint16 bits (triton issue 11584),
  * `binary_op`/`unary_op`/fma/clamp/erf/rsqrt do integer math on the bits,
  * `cast_impl` (fp32<->bf16 via create_fp_trunc/create_fp_ext) truncates instead of
    rounding to nearest even, and `_convert_float`'s "RTNE" is round-half-up,
  * tl.sum's fast path (ReduceOps.sum) np.sum()s the bits,
  * `get_bf16` is missing, so `tl.full(shape, 1.5, tl.bfloat16)` raises.
We keep the bit representation (so loads/stores stay untouched and bit-exact) and
decode bf16 -> fp32 at each compute seam, rounding results back to bf16 with the same
round-to-nearest-even bit trick torch uses. fp8 e4m3 casts go through torch (_e4m3_cast).
Call `install()` before launching kernels.
"""

import functools

import numpy as np
import triton.language as tl
from triton._C.libtriton import ir as _ir
from triton.runtime.interpreter import InterpreterBuilder, ReduceOps, TensorHandle

_BF16 = tl.bfloat16


def bf16_to_f32(bits):
    """bf16 bit pattern (uint16) -> float32; exact (bf16 is the top half of fp32)."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x, rtz=False):
    """float32 -> bf16 bits, round-to-nearest-even (torch / cvt.rn.bf16.f32) or toward zero."""
    x = np.asarray(x).astype(np.float32)  # ints / fp16 / fp64 sources go through fp32 first
    u = x.view(np.uint32)
    if (
        not rtz
    ):  # add 0x7FFF plus the lsb of the kept half: ties go to even; carries bump the exponent
        u = u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))
    bits = (u >> 16).astype(np.uint16)
    # canonical quiet NaN; rounding could otherwise carry a NaN into inf or flip its sign
    return np.where(np.isnan(x), np.uint16(0x7FC0), bits)


def _is_bf16(h):
    return isinstance(h, TensorHandle) and h.dtype == _BF16


def _upcast(fn, round_back=True):
    """Run a builder op on fp32-decoded bf16 operands; float results are rounded back to bf16
    (fp32 has >2*8+2 mantissa bits, so fp32-then-round equals a native bf16 +,-,*,/,sqrt)."""

    @functools.wraps(fn)
    def wrapped(self, *args, **kwargs):
        if not any(_is_bf16(a) for a in args):
            return fn(self, *args, **kwargs)
        args = [TensorHandle(bf16_to_f32(a.data), tl.float32) if _is_bf16(a) else a for a in args]
        out = fn(self, *args, **kwargs)
        if round_back and out.data.dtype == np.float32:  # comparisons return bool masks: keep as-is
            return TensorHandle(f32_to_bf16(out.data), _BF16)
        return out

    return wrapped


def _make_cast_impl(orig):
    # fp32/fp64/int -> bf16 (create_fp_trunc, create_si/ui_to_fp) and bf16 -> fp32 (create_fp_ext).
    # Triton's default for `.to(tl.bfloat16)` is RTNE, but the interpreter truncated here.
    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == _BF16:
            src = TensorHandle(bf16_to_f32(src.data), tl.float32)
        if dst_type.scalar == _BF16:
            return TensorHandle(f32_to_bf16(src.data), _BF16)
        return orig(self, src, dst_type)

    return cast_impl


def _make_fp_to_fp(orig):
    # Reached for `.to(tl.bfloat16, fp_downcast_rounding="rtz"/"rtne")` and fp8 e4m3 casts;
    # other fp8 types stay on the original path.
    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        s, d = src.dtype.scalar, dst_type.scalar
        if _E4M3 in (s, d):
            return _e4m3_cast(src, dst_type)
        if s.is_fp8() or d.is_fp8() or _BF16 not in (s, d):
            return orig(self, src, dst_type, rounding_mode)
        if d == _BF16:
            return TensorHandle(
                f32_to_bf16(src.data, rtz=rounding_mode == _ir.ROUNDING_MODE.RTZ), _BF16
            )
        return orig(self, TensorHandle(bf16_to_f32(src.data), tl.float32), dst_type, rounding_mode)

    return create_fp_to_fp


_E4M3 = tl.float8e4nv


def _e4m3_cast(src, dst_type):
    """fp8 e4m3 (torch.float8_e4m3fn) <-> fp32/fp16/bf16 through torch's conversions: the
    interpreter's bit arithmetic (_convert_float) rounds half up without carrying into the
    exponent, flushes subnormals and reads NaN (0x7f) as 480. Downcasts round to nearest even
    and saturate to +-448 (torch on CPU and sm89+'s cvt.rn.satfinite agree); the kernels clamp
    first anyway."""
    import torch

    s, d = src.dtype.scalar, dst_type.scalar
    data = np.asarray(src.data)
    if s == _E4M3:
        values = torch.from_numpy(data.astype(np.uint8)).view(torch.float8_e4m3fn).float().numpy()
    else:
        values = bf16_to_f32(data) if s == _BF16 else data.astype(np.float32)
    if d == _E4M3:
        bits = torch.from_numpy(np.ascontiguousarray(values, np.float32)).to(torch.float8_e4m3fn)
        return TensorHandle(bits.view(torch.uint8).numpy(), _E4M3)
    if d == _BF16:
        return TensorHandle(f32_to_bf16(values), _BF16)
    return TensorHandle(values.astype(np.float16 if d == tl.float16 else np.float32), d)


def _retype(ty, elt):
    return ty.with_element_ty(elt) if ty.is_block() else elt


def _sum_upcast(fn):
    """tl.sum's fast path np.sum()s handle.data directly (tl.max/min/cumsum already promote
    bf16 to fp32 in triton.language.standard). Decode, accumulate in fp32, round once."""

    @functools.wraps(fn)
    def wrapped(self, input):
        if input.dtype != _BF16:
            return fn(self, input)
        out = fn(
            self,
            tl.core.tensor(
                TensorHandle(bf16_to_f32(input.handle.data), tl.float32),
                _retype(input.type, tl.float32),
            ),
        )
        return tl.core.tensor(
            TensorHandle(f32_to_bf16(out.handle.data), _BF16), _retype(out.type, _BF16)
        )

    return wrapped


def install():
    """Monkeypatch the interpreter builder (class-level, so the module-global
    `interpreter_builder` instance sees it). Idempotent, also across module reloads."""
    B = InterpreterBuilder
    if getattr(B, "_bf16_shim_installed", False):
        return
    for name in (
        "binary_op",
        "unary_op",
        "create_fma",
        "create_clampf",
        "create_erf",
        "create_rsqrt",
    ):
        setattr(B, name, _upcast(getattr(B, name)))
    B.create_dot = _upcast(B.create_dot, round_back=False)  # bf16 x bf16 -> fp32 accumulator
    B.cast_impl = _make_cast_impl(
        B.cast_impl
    )  # create_fp_trunc/ext etc. are lambdas calling self.cast_impl
    B.create_fp_to_fp = _make_fp_to_fp(B.create_fp_to_fp)
    B.get_bf16 = lambda self, v: TensorHandle(f32_to_bf16(np.array([v], np.float32)), _BF16)
    ReduceOps.sum = _sum_upcast(ReduceOps.sum)
    B._bf16_shim_installed = True
