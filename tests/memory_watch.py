"""Test-only: under Triton's interpreter, refuse every load and store outside the tensors a
kernel was launched with.

A kernel may touch only the memory of its tensor arguments, as the caller passed them: a view
into a larger buffer covers the span of its own elements, not the buffer. Triton's interpreter
(triton/runtime/interpreter.py) checks no bounds; inside `watching()` each launch records the
byte spans of its tensor arguments (GridExecutor.__call__) and every masked load and store
(InterpreterBuilder.create_masked_load/store) and atomic (create_atomic_rmw: the atomic-dQ
backward's adds) checks its live addresses first. A stray one
raises OutOfBounds before the memory is touched, so a wild index fails the test instead of
crashing the process. GPU runs cannot do this; there the guard regions (tests/safety_harness.py)
and compute-sanitizer stand in.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from triton.runtime import interpreter
from triton.runtime.interpreter import GridExecutor, InterpreterBuilder
from triton.tools.tensor_descriptor import TensorDescriptor


class OutOfBounds(AssertionError):
    """A kernel touched memory outside its tensor arguments."""


_spans: list[tuple[int, int]] = []  # byte ranges [start, end) of the running launch's tensors


def tensor_span(t: torch.Tensor) -> tuple[int, int] | None:
    """[first byte, one past the last byte) of t's elements; None when it has none."""
    if t.numel() == 0:
        return None
    low = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if s < 0)
    high = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if s > 0)
    size = t.element_size()
    return t.data_ptr() + low * size, t.data_ptr() + (high + 1) * size


def _check(ptrs, mask, what: str) -> None:
    addresses = np.asarray(ptrs.data).astype(np.uint64)
    if mask is not None:
        addresses = addresses[np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)]
    if addresses.size == 0:
        return
    width = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
    inside = np.zeros(addresses.shape, dtype=bool)
    for start, end in _spans:
        inside |= (addresses >= start) & (addresses + width <= end)
    if not inside.all():
        stray = int(addresses[~inside][0])
        raise OutOfBounds(
            f"{what} of {int((~inside).sum())} element(s) outside every tensor "
            f"argument, first at {stray:#x} (program "
            f"{interpreter.interpreter_builder.grid_idx})"
        )


@contextlib.contextmanager
def watching():
    """Every kernel launched inside touches only its tensor arguments, or OutOfBounds."""
    launch, load = GridExecutor.__call__, InterpreterBuilder.create_masked_load
    store = InterpreterBuilder.create_masked_store
    atomic = InterpreterBuilder.create_atomic_rmw

    def watched_launch(self, *args, **kwargs):
        saved = list(_spans)
        given = [
            a.base if isinstance(a, TensorDescriptor) else a for a in (*args, *kwargs.values())
        ]
        tensors = [a for a in given if isinstance(a, torch.Tensor)]
        _spans[:] = [span for t in tensors if (span := tensor_span(t)) is not None]
        try:
            return launch(self, *args, **kwargs)
        finally:
            _spans[:] = saved

    def watched_load(self, ptrs, mask, *args, **kwargs):
        _check(ptrs, mask, "load")
        return load(self, ptrs, mask, *args, **kwargs)

    def watched_store(self, ptrs, value, mask, *args, **kwargs):
        _check(ptrs, mask, "store")
        return store(self, ptrs, value, mask, *args, **kwargs)

    def watched_atomic(self, rmw_op, ptr, val, mask, *args, **kwargs):
        _check(ptr, mask, "atomic")
        return atomic(self, rmw_op, ptr, val, mask, *args, **kwargs)

    GridExecutor.__call__ = watched_launch
    InterpreterBuilder.create_masked_load = watched_load
    InterpreterBuilder.create_masked_store = watched_store
    InterpreterBuilder.create_atomic_rmw = watched_atomic
    try:
        yield
    finally:
        GridExecutor.__call__ = launch
        InterpreterBuilder.create_masked_load = load
        InterpreterBuilder.create_masked_store = store
        InterpreterBuilder.create_atomic_rmw = atomic
