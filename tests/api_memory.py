"""Guarded memory and process isolation for the API-level tests (tests/test_api_*.py).

Every tensor handed to a public function is a view into a larger buffer whose other elements
hold a sentinel; after the call every byte outside the caller's slots must be bitwise unchanged
(`guarded`, `unexpected_writes`). A call that may store out of bounds runs in a forked child
(`isolated`), so that a crash is one failing example rather than the end of the test run.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import traceback
from dataclasses import dataclass, field

import torch

GUARD = 24  # sentinel elements before and after every view, at least
SENTINELS = {
    torch.float32: -7777.0,
    torch.float16: -7777.0,
    torch.bfloat16: -7776.0,
    torch.float64: -7777.0,
    torch.int32: -123456789,
    torch.int64: -123456789,
}


@dataclass(frozen=True)
class Layout:
    """How a view sits in its buffer: `order` lists the dims outermost first, `step` is the
    innermost dim's stride and `gap` the sentinel elements between consecutive slices of each
    outer dim. Layout.plain(rank) is a contiguous tensor at a storage offset."""

    order: tuple[int, ...]
    gap: int = 0
    step: int = 1

    @staticmethod
    def plain(rank: int) -> Layout:
        return Layout(tuple(range(rank)))

    @property
    def contiguous(self) -> bool:
        return self.order == tuple(sorted(self.order)) and self.gap == 0 and self.step == 1

    def strides(self, shape) -> list[int]:
        strides, stride = [0] * len(shape), self.step
        for dim in reversed(self.order):
            strides[dim] = stride
            stride = stride * max(shape[dim], 1) + self.gap
        return strides


@dataclass
class Guarded:
    """A caller's tensor (`view`) inside a sentinel-filled buffer, and the buffer's bytes
    before the call."""

    buffer: torch.Tensor
    view: torch.Tensor
    before: torch.Tensor = field(repr=False)

    def view_of(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer.as_strided(self.view.shape, self.view.stride(), self.view.storage_offset())

    def positions(self) -> torch.Tensor:
        """The buffer index of every element of the view, in the view's shape."""
        index = torch.arange(self.buffer.numel(), device=self.buffer.device)
        return self.view_of(index)


def guarded(values: torch.Tensor, layout: Layout | None = None) -> Guarded:
    """`values` copied into a view of a sentinel-filled buffer. The guard on each side is at
    least one outer slice (a cache row, a page), where a store one index too far lands."""
    layout = layout or Layout.plain(values.dim())
    shape = tuple(values.shape)
    strides = layout.strides(shape)
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) if all(shape) else 0
    guard = max([GUARD, *strides])
    buffer = torch.full(
        (guard + extent + guard,), SENTINELS[values.dtype], dtype=values.dtype, device=values.device
    )
    view = buffer.as_strided(shape, strides, guard)
    view.copy_(values)
    return Guarded(buffer, view, buffer.clone())


def _bits(t: torch.Tensor) -> torch.Tensor:
    as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(as_int)


def unexpected_writes(
    name: str,
    g: Guarded,
    expected_view: torch.Tensor | None = None,
    free: torch.Tensor | None = None,
) -> list[str]:
    """What changed in g's buffer that should not have. The view must now hold
    `expected_view` (default: what it held before), except where `free` (a bool mask in the
    view's shape) is True; every element outside the view must be bitwise unchanged."""
    expected = g.before.clone()
    if expected_view is not None:
        g.view_of(expected).copy_(expected_view.to(expected.device))
    if free is not None and free.any():
        where = g.positions()[free.to(g.buffer.device)]
        expected[where] = g.buffer[where]
    differ = (_bits(expected) != _bits(g.buffer)).nonzero().flatten()
    if differ.numel() == 0:
        return []
    inside = torch.zeros_like(g.buffer, dtype=torch.bool)
    inside[g.positions().flatten()] = True
    outside = differ[~inside[differ]]
    where = (
        f"{outside.numel()} outside the tensor (first at buffer index {outside[0].item()})"
        if outside.numel()
        else "all inside the tensor"
    )
    return [f"{name}: {differ.numel()} elements changed unexpectedly, {where}"]


ISOLATED_TIMEOUT_S = 300


def isolated(fn, *args) -> None:
    """fn(*args) in a forked child process, its failure re-raised here as an AssertionError.

    An out-of-bounds store can corrupt the heap or kill the process; in a child, a crash (a
    signal) is one failing example instead of the end of the test run. CPU only: CUDA cannot
    be used across fork, so with CUDA initialised fn runs in this process. The child runs
    torch single-threaded (GNU OpenMP's pool does not survive fork)."""
    if not hasattr(os, "fork") or torch.cuda.is_initialized():
        fn(*args)
        return
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run, report, never return into pytest
        os.close(read)
        faulthandler.disable()  # a crash is reported by the parent, in one line
        signal.alarm(ISOLATED_TIMEOUT_S)
        try:
            torch.set_num_threads(1)
            fn(*args)
            report = b""
        except AssertionError as exc:
            report = f"{exc}".encode()
        except BaseException:
            report = traceback.format_exc(limit=-4).encode()
        with os.fdopen(write, "wb") as pipe:
            pipe.write(report or b"")
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        report = pipe.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        name = signal.Signals(os.WTERMSIG(status)).name
        what = "timed out" if name == "SIGALRM" else "crashed the process"
        raise AssertionError(f"the call {what} ({name})")
    if report:
        raise AssertionError(report)
