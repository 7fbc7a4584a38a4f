"""The cached launcher every generated module launches its kernels through, the checks of a
caller's `out=`, and launches kept with their arguments (_Step).

Copied verbatim into every generated module (attngen/host/__init__.py says how).
"""

import contextlib
import os

import torch
import triton

# -- host code: attngen/host/launch.py, copied verbatim ----------------------------------------
# The entry points take `out=` (the runtime reads this); the rest is the modules' own.
ACCEPTS_OUT = True
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# ATTNGEN_CHECKS is read at every call: os.environ.get encodes the name and the value (about
# a microsecond), so on POSIX the launchers read the bytes mapping that os.environ keeps and
# updates at every assignment and deletion.
_ENVIRON = os.environ._data if os.name == "posix" else None  # type: ignore[attr-defined]
_TENSOR = torch.Tensor


def _checked() -> bool:
    """Whether ATTNGEN_CHECKS=1 is set now (the host validation of the index tensors)."""
    if _ENVIRON is None:
        return os.environ.get("ATTNGEN_CHECKS") == "1"
    return _ENVIRON.get(b"ATTNGEN_CHECKS") == b"1"


# -- launches -------------------------------------------------------------------------------
# `kernel[grid](...)` binds every argument, derives what Triton specializes on and formats a
# cache key on each call: tens of microseconds of host time, more than a small launch's GPU
# time. `_launch` derives the same specialization from the arguments' groups (cheaper: the
# groups are known here), and after the first call for a specialization calls the compiled
# kernel's own launcher, as Triton's JITFunction.run does once it has the kernel.
_FAST_LAUNCH = not _INTERPRET  # the interpreter runs `kernel[grid]` (it has no launcher)
_LAUNCH_CACHE: dict[tuple, tuple] = {}  # _specialization(...) -> the compiled kernel's _runner
_EXACT_LAUNCHES: dict[tuple, tuple] = {}  # (_launch_classes(...), the ints themselves) -> the same
_LAUNCH_CACHE_SIZE = 1024  # a full cache starts over (a miss only costs a `kernel[grid]` call)
_DRIVER: list = []  # [get_current_device, get_current_stream], set at the first launch on a GPU
_HOOKS = triton.knobs.HookChain  # launch hooks: None or an empty chain means no hook
_KNOBS = triton.knobs
# A compiled kernel's launcher (CudaLauncher.__call__) builds its scratch closures at each
# call, and its C launcher calls each tensor's data_ptr() and cuPointerGetAttribute on it:
# 1-6 us of a launch on the H200 host (tools/profile_launch_host.py). A direct launch passes
# the tensors' addresses as ints (the C launcher takes an int as the address itself; the
# caller has checked that the tensors are on the device) and, where that C launcher's
# arguments are Triton 3.6's and the kernel needs no scratch memory, calls it without the
# Python frame.
_C_LAUNCHER = triton.__version__.split(".")[:2] == ["3", "6"]


def _int_classes(ints: tuple[int, ...]) -> tuple[int, ...]:
    """Each int's class: (n >> 31) * 4 for its range (Triton's i32 is n >> 31 in {-1, 0};
    every other value is its own class, at least as fine as i64/u64), plus 0 when
    n % 16 == 0, 2 when n == 1 (a constant to Triton), else 1."""
    return tuple([(n >> 31) * 4 + (n & 15 and (n == 1) + 1) for n in ints])


def _launch_classes(kernel, device, tensors, addresses, tail, constexprs, options):
    """Everything the compiled kernel depends on besides the ints and the argument values:
    the kernel, the device, each tensor's dtype and 16-byte alignment (of its address), the
    tail's classes (a float scalar is never specialized, None is a constant, a TMA descriptor
    is its dtype, block shape and padding), the constexprs and the compile options (with
    Triton's debug and instrumentation knobs)."""
    aligned = tuple([(t.dtype, a & 15 == 0) for t, a in zip(tensors, addresses, strict=True)])
    tail_classes = tuple([type(x) if x is None or type(x) is float
                          else (x.base.dtype, tuple(x.block_shape), x.padding)
                          for x in tail])  # fmt: skip
    return (kernel, device, aligned, tail_classes, tuple(constexprs.items()),
            tuple(options.items()), _KNOBS.runtime.debug,
            _KNOBS.compilation.instrumentation_mode)  # fmt: skip


def _specialization(kernel, device, tensors, ints, tail, constexprs, options):
    """_launch_classes and the ints' classes: equal keys give equal specializations; the
    converse may not hold (no harm: one more entry)."""
    addresses = [t.data_ptr() for t in tensors]
    return (
        _launch_classes(kernel, device, tensors, addresses, tail, constexprs, options),
        _int_classes(ints),
    )


def _runs_directly(kernel: triton.JITFunction) -> bool:
    """Whether a launch may call a compiled kernel's launcher: the cached launcher on (not the
    interpreter), no pre-run hook and no launch hook (a profiler: it receives the launch's
    metadata, which only `kernel[grid]` builds). Resolves _DRIVER on the first call."""
    runtime = _KNOBS.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    if (
        not _FAST_LAUNCH
        or kernel.pre_run_hooks
        or (enter is not None and not (type(enter) is _HOOKS and not enter.calls))
        or (leave is not None and not (type(leave) is _HOOKS and not leave.calls))
    ):
        return False
    if not _DRIVER:
        active = triton.runtime.driver.active
        _DRIVER[:] = [active.get_current_device, active.get_current_stream]
    return True


def _direct_on(device: int, kernels: tuple[triton.JITFunction, ...]) -> bool:
    """Whether launches of these kernels may call their compiled launchers now: each
    _runs_directly, and `device` the current device (the compiled kernels' handles are
    loaded for it)."""
    for kernel in kernels:
        if not _runs_directly(kernel):
            return False
    return _DRIVER[0]() == device


def _runner(compiled):
    """(launch, prefix): launch(grid, 1, 1, stream, *prefix, *addresses, *ints, *tail,
    *constexprs) runs the compiled kernel: its C launcher with the fixed arguments Triton
    3.6's takes after the stream (_C_LAUNCHER, no scratch memory), else its launcher."""
    launcher = compiled.run
    if (
        _C_LAUNCHER
        and type(launcher).__name__ == "CudaLauncher"
        and not getattr(launcher, "global_scratch_size", 1)
        and not getattr(launcher, "profile_scratch_size", 1)
    ):
        return _encoded_launch(launcher.launch), (
            compiled.function,
            launcher.launch_cooperative_grid,
            launcher.launch_pdl,
            None,
            None,
            compiled.packed_metadata,
            None,
            None,
            None,
        )
    return launcher, (compiled.function, compiled.packed_metadata, None, None, None)


_ENCODINGS: dict = {}  # (a descriptor's metadata, address, shape, strides, padding) -> arguments


def _encoded_launch(launch):
    """launch, or where it is Triton 3.6's wrapper that encodes every TMA descriptor argument
    at every launch (cuTensorMapEncodeTiled and Python around it, microseconds each) the same
    launch, each encoding made once per metadata, address, shape, strides and padding (all it
    depends on)."""
    names = getattr(getattr(launch, "__code__", None), "co_freevars", ())  # the C launcher: ()
    cells = dict(zip(names, [c.cell_contents for c in launch.__closure__], strict=True)
                 ) if names else {}  # fmt: skip
    metas, indices = cells.get("tensordesc_meta"), cells.get("tensordesc_indices")
    if not metas or not indices or None in metas:
        return launch
    raw, encode = cells["launcher"], launch.__globals__["make_tensordesc_arg"]
    base = launch.__globals__["_BASE_ARGS_FORMAT_LEN"]
    spots = [(base + i, m, repr(sorted(m.items())))
             for i, m in zip(sorted(indices), metas, strict=True)][::-1]  # fmt: skip

    def encoded(*args):
        values = list(args)
        for at, meta, meta_key in spots:  # the last first: each becomes several arguments
            desc = values[at]
            key = (meta_key, desc.base.data_ptr(), *desc.shape, *desc.strides, desc.padding)
            made = _ENCODINGS.get(key)
            if made is None:
                if len(_ENCODINGS) >= _LAUNCH_CACHE_SIZE:
                    _ENCODINGS.clear()
                made = _ENCODINGS[key] = encode(desc, meta)
            values[at : at + 1] = made
        return raw(*values)

    return encoded


def _launch(kernel, grid, device, tensors, ints, tail, constexprs, options):
    """kernel[(grid,)](*tensors, *ints, *tail, **constexprs, **options): the kernel's
    parameters are tensors (pointers), Python ints (a tuple), the tail (floats, TMA
    descriptors or None) and its constexprs, in that order; device is the tensors' CUDA
    device index. Returns the compiled kernel's _runner when it ran directly, else None.

    The first call of a specialization goes through `kernel[grid]` (which compiles or finds the
    kernel, checks Triton's globals, and launches); later ones call its launcher directly with
    the tensors' addresses, found first under the call's ints as they are (a repeated shape:
    no int classes to derive), else under their classes, on `device` made current if it is
    not. Where _runs_directly says no, every launch takes `kernel[grid]`."""
    if not _runs_directly(kernel):
        with torch.cuda.device(device) if device >= 0 else contextlib.nullcontext():
            kernel[(grid,)](*tensors, *ints, *tail, **constexprs, **options)
        return None
    if _DRIVER[0]() != device:
        with torch.cuda.device(device):
            return _launch(kernel, grid, device, tensors, ints, tail, constexprs, options)
    addresses = [t.data_ptr() for t in tensors]
    classes = _launch_classes(kernel, device, tensors, addresses, tail, constexprs, options)
    exact = (classes, ints)
    runner = _EXACT_LAUNCHES.get(exact)
    if runner is None:
        key = (classes, _int_classes(ints))
        runner = _LAUNCH_CACHE.get(key)
        if runner is None:
            return _first_launch(kernel, grid, key, tensors, ints, tail, constexprs, options)
        if len(_EXACT_LAUNCHES) >= _LAUNCH_CACHE_SIZE:
            _EXACT_LAUNCHES.clear()
        _EXACT_LAUNCHES[exact] = runner
    launch, prefix = runner
    launch(grid, 1, 1, _DRIVER[1](device), *prefix, *addresses, *ints, *tail, *constexprs.values())
    return runner


def _first_launch(kernel, grid, key, tensors, ints, tail, constexprs, options):
    """`kernel[grid]`, and its compiled kernel's _runner remembered under `key` once the
    kernel's parameters are known to be the groups in order with the constexprs last (the
    launcher takes them by position)."""
    compiled = kernel[(grid,)](*tensors, *ints, *tail, **constexprs, **options)
    if hasattr(compiled, "result"):  # Triton's asynchronous compile mode
        compiled = compiled.result()
    positional = len(tensors) + len(ints) + len(tail)
    params = kernel.params
    if (
        len(params) != positional + len(constexprs)
        or any(p.is_constexpr for p in params[:positional])
        or [p.name for p in params[positional:]] != list(constexprs)
    ):
        raise RuntimeError(
            f"{kernel.fn.__name__}: its parameters are not the launch's groups "
            "in order, constexprs last; rebuild the module"
        )
    runner = _runner(compiled)  # (compiled.run loads the kernel's handles on this device)
    if len(_LAUNCH_CACHE) >= _LAUNCH_CACHE_SIZE:
        _LAUNCH_CACHE.clear()
    _LAUNCH_CACHE[key] = runner
    return runner


# -- out= -----------------------------------------------------------------------------------
_DENSE_LAYOUTS: dict[tuple, bool] = {}  # (shape, strides) -> whether no two elements share memory


def _no_self_overlap(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """No two elements of a tensor of this shape and these strides share an address: sorted by
    stride, each dimension steps past everything the smaller ones span (remembered)."""
    known = _DENSE_LAYOUTS.get((shape, strides))
    if known is None:
        span, known = 1, True
        for size, stride in sorted(zip(shape, strides, strict=True), key=lambda d: d[1]):
            if size > 1:
                known = known and stride >= span
                span = stride * (size - 1) + 1
        if len(_DENSE_LAYOUTS) >= _LAUNCH_CACHE_SIZE:
            _DENSE_LAYOUTS.clear()
        _DENSE_LAYOUTS[(shape, strides)] = known
    return known


def _check_out(
    out: object,
    shape: tuple[int, ...],
    q: torch.Tensor,
    inputs: tuple[tuple[str, torch.Tensor | None], ...],
) -> None:
    """out: a tensor of `shape`, q's dtype and device, any strides whose elements do not
    overlap, sharing no storage with the inputs (the kernel reads them while it writes)."""
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"out: expected a torch.Tensor or None, got {type(out).__name__}")
    if out.shape != shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"out: expected shape {tuple(shape)} {q.dtype} on {q.device}, got "
            f"{tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if not _no_self_overlap(out.shape, out.stride()):
        raise ValueError(
            f"out: strides {out.stride()} make elements share memory (an expanded "
            "or overlapping view); pass a tensor each element of which is its own"
        )
    storage = out.untyped_storage().data_ptr()
    for name, t in inputs:
        if t is not None and t.untyped_storage().data_ptr() == storage and out.numel():
            raise ValueError(f"out: shares memory with {name}; pass a separate tensor")


def _check_grid(num_programs: int) -> None:
    if num_programs >= 2**31:
        raise ValueError(f"shape: {num_programs} programs exceed the grid's 2**31 - 1")


# -- launches kept with their arguments --------------------------------------------------------
class _Step:
    """One launch: its kernel, grid, ints, tail, constexprs and compile options, what follows
    the ints in the launcher's arguments (`after`: the tail, the constexprs' values), and the
    compiled kernels' _runner found for it, per (the tensors' 16-byte alignment, Triton's
    knobs)."""

    __slots__ = ("kernel", "grid", "ints", "tail", "constexprs", "options", "after", "compiled")

    def __init__(self, kernel, grid, ints, tail, constexprs, options):
        self.kernel, self.grid, self.ints, self.tail = kernel, grid, ints, tail
        self.constexprs, self.options, self.compiled = constexprs, options, {}
        self.after = (*tail, *constexprs.values())


def _run_step(step, device, tensors, ints=None, direct=None, stream=None):
    """_launch(step's kernel, ...) with these tensors, or, once a compiled kernel is known for
    their alignment and the launch may run directly, its launcher with their addresses and no
    key to derive. ints: the call's, in place of the step's (a decode plan's caches of another
    size); the caller keeps a step for ints of its ints' classes only (_int_classes), so that
    the compiled kernel is theirs. direct: _direct_on(device, the step's kernel), and stream:
    the device's current stream, when the caller has asked them once for all its steps (None:
    asked here)."""
    if ints is None:
        ints = step.ints
    addresses = [t.data_ptr() for t in tensors]
    slot = (
        tuple([a & 15 == 0 for a in addresses]),
        _KNOBS.runtime.debug,
        _KNOBS.compilation.instrumentation_mode,
    )
    runner = step.compiled.get(slot)
    if direct is None:
        direct = _direct_on(device, (step.kernel,))
    if runner is None or not direct:
        runner = _launch(
            step.kernel, step.grid, device, tensors, ints, step.tail, step.constexprs, step.options
        )
        if runner is not None and _DRIVER[0]() == device:
            step.compiled[slot] = runner
        return
    launch, prefix = runner
    if stream is None:
        stream = _DRIVER[1](device)
    launch(step.grid, 1, 1, stream, *prefix, *addresses, *ints, *step.after)


def _layout(t: torch.Tensor | None) -> tuple | None:
    """A tensor's layout in a plan's key: shape, strides, dtype, device; None stays None."""
    if t is None:
        return None
    if type(t) is not _TENSOR:
        raise TypeError  # not a plain tensor: the full path decides
    return t.shape, t.stride(), t.dtype, t.is_cuda, t.get_device()
