"""The record of dispatches, per thread: which module served each call, and why.

`last_dispatch()` is this thread's latest Dispatch, and `with dispatch_log() as log:` collects
this thread's dispatches inside the block (logs nest). Recording is one attribute store per
call (a repeated call records the Dispatch object cached for it), so it is always on. Under
torch.compile, selection runs while tracing, so it is recorded once per trace; the kernel runs
themselves are counted by attngen.runtime.ops.run_counts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

from attngen.runtime.selection import Dispatch


class _ThreadRecords(threading.local):
    """Per thread: the latest Dispatch and the open dispatch_log() lists, innermost last."""

    def __init__(self) -> None:
        self.last: Dispatch | None = None
        self.logs: list[list[Dispatch]] = []


_records = _ThreadRecords()


def record(dispatch: Dispatch) -> Dispatch:
    records = _records
    records.last = dispatch
    if records.logs:
        for log in records.logs:
            log.append(dispatch)
    return dispatch


def last_dispatch() -> Dispatch | None:
    """This thread's most recent Dispatch: which module served its last call and why (or the
    fallback). Per thread, so a server's other threads never show up here. Its `forward` is
    the forward kernel the module ran for that call ("gluon warp-specialized", or
    "tile-level: <why>"), as the module's forward_path() reports it."""
    last = _records.last
    if last is None or last.forward is None or last.key is None:
        return last
    return _with_forward(last)


_FORWARD_VARIANTS: dict[tuple[Dispatch, str], Dispatch] = {}


def _with_forward(dispatch: Dispatch) -> Dispatch:
    """`dispatch` itself when its module's last forward on this thread is the one the
    Dispatch expects, else (remembered) a copy whose `forward` is the one that ran."""
    from attngen.runtime.registry import current_registry

    try:
        module = current_registry().module(dispatch.key)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - a replaced registry: the record as it was made
        return dispatch
    taken = getattr(module, "forward_path", None)
    path = None if taken is None else str(taken())
    if path is None or path == dispatch.forward or path.endswith("no call yet"):
        return dispatch
    variant = _FORWARD_VARIANTS.get((dispatch, path))
    if variant is None:
        if len(_FORWARD_VARIANTS) >= 1024:
            _FORWARD_VARIANTS.clear()
        variant = dataclasses.replace(dispatch, forward=path)
        _FORWARD_VARIANTS[(dispatch, path)] = variant
    return variant


@contextlib.contextmanager
def dispatch_log() -> Iterator[list[Dispatch]]:
    """Collect every Dispatch this thread makes inside the block, in order. Logs nest: an
    outer log also gets what an inner one collects."""
    log: list[Dispatch] = []
    logs = _records.logs
    logs.append(log)
    try:
        yield log
    finally:
        # By identity: two logs with equal contents (both empty, say) are different logs.
        del logs[next(i for i, open_log in enumerate(logs) if open_log is log)]
