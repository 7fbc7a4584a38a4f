"""The trace cache: a repeated call with the same score_mod and mask_mod does not trace again.

A trace (trace.py) is a function of the code it runs and of what that code reads besides its
arguments: closure cells, the globals it names, default arguments, a partial's arguments, and
the functions those hold (and_masks' tuple). The cache key is a snapshot of all of that
(`_guard`), taken on every call:
- code objects, and Python numbers, strings, None, dtypes and devices by value (they become
  constants in the tree: a changed window or chunk size traces again);
- captured tensors by kind: dtype, ndim, requires_grad (with grad mode), layout, and which
  earlier one is the same tensor; not by identity nor value: the module reads them at run
  time, so a new tensor of the same kind (a model's new padding mask each forward) takes the
  cached tree, bound to the call's tensor by its place in the snapshot;
- functions by their code, recursively; tuples and lists item by item; the modules torch,
  math, operator and numpy by name.
Anything else (an object whose attributes the code reads, a dict, a bound method, a callable
object) may change unseen, so such a function is traced on every call. So is a trace that
ran a torch function on a real tensor outside the language (`.item()`, `int(t)`, `t.shape`, a
tensor made inside the function: `_Watch`), whose tree may hold a value read at trace time.
"""

from __future__ import annotations

import functools
import types
from collections import OrderedDict
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from attngen.expressions import Expr
from attngen.runtime.flex.trace import Capture, _Sym, trace

SIZE = 256  # entries kept, least recently used dropped first
_traces: OrderedDict[tuple, tuple] = OrderedDict()
_VALUES = (type(None), bool, int, float, str, bytes, torch.dtype, torch.device)
_MODULES = ("torch", "math", "operator", "numpy")
_METADATA = {"dim", "dtype", "device", "ndim", "layout", "requires_grad", "is_sparse", "is_nested"}


class _Unguarded(Exception):
    """The functions read something the snapshot cannot compare: trace every call."""


def traced(score_mod: Any, mask_mod: Any) -> tuple[Expr | None, Expr | None, Expr | None, Capture]:
    """(score, keep, mask, capture) of a call's score_mod and mask_mod (trace.trace's trees;
    None for an absent function), from the cache when the snapshot matches."""
    slots: list[torch.Tensor] = []
    try:  # left to right: the slots' order is the functions'
        key: tuple | None = (
            torch.is_grad_enabled(),
            _guard(score_mod, slots, 0),
            _guard(mask_mod, slots, 0),
        )
    except _Unguarded:
        key = None
    hit = None if key is None else _traces.get(key)
    if hit is not None and key is not None:
        _traces.move_to_end(key)
        capture = Capture()
        for decl, slot in hit[3]:
            capture.found[id(slots[slot])] = (decl, slots[slot])
        return hit[0], hit[1], hit[2], capture
    capture, watch = Capture(), _Watch()
    with watch:
        score, keep = (None, None) if score_mod is None else trace(score_mod, "score_mod", capture)
        mask = None if mask_mod is None else trace(mask_mod, "mask_mod", capture)[0]
    places = {id(t): i for i, t in reversed(list(enumerate(slots)))}  # each tensor's first
    bound = [(decl, places.get(id(t))) for decl, t in capture.found.values()]
    if key is not None and watch.pure and all(slot is not None for _, slot in bound):
        _traces[key] = (score, keep, mask, bound)
        if len(_traces) > SIZE:
            _traces.popitem(last=False)
    return score, keep, mask, capture


def _guard(value: Any, slots: list[torch.Tensor], depth: int) -> tuple:
    """The snapshot of one value (the module docstring); captured tensors appended to slots."""
    if depth > 8:
        raise _Unguarded
    kind = type(value)
    if kind in _VALUES:
        return (kind, repr(value) if kind is float else value)  # repr: -0.0 is not 0.0
    if isinstance(value, torch.Tensor):
        place = next((i for i, t in enumerate(slots) if t is value), len(slots))
        if place == len(slots):
            slots.append(value)
        meta = (value.dtype, value.dim(), value.requires_grad, value.layout, value.is_nested)
        return ("tensor", place, kind, *meta)
    if kind is tuple or kind is list:
        return (kind, *(_guard(item, slots, depth + 1) for item in value))
    if kind is types.FunctionType:
        cells = []
        for cell in value.__closure__ or ():
            try:
                cells.append(_guard(cell.cell_contents, slots, depth + 1))
            except ValueError:  # an empty cell (a name bound later)
                cells.append(("empty",))
        names = [n for n in _global_names(value.__code__) if n in value.__globals__]
        named = [(n, _guard(value.__globals__[n], slots, depth + 1)) for n in names]
        defaults = (value.__defaults__, sorted((value.__kwdefaults__ or {}).items()))
        if defaults != (None, []):
            named.append(("", _guard(defaults, slots, depth + 1)))
        return ("fn", value.__code__, *cells, *named)
    if kind is functools.partial:
        arguments = (value.func, value.args, sorted(value.keywords.items()))
        return ("partial", _guard(arguments, slots, depth + 1))
    if kind is types.ModuleType and value.__name__.partition(".")[0] in _MODULES:
        return ("module", value.__name__)
    if kind is types.BuiltinFunctionType or (kind is type and value.__module__ == "builtins"):
        return ("builtin", value)
    raise _Unguarded


@functools.lru_cache(maxsize=1024)
def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """The names a code object (and the functions defined in it) may read as globals."""
    nested = [_global_names(c) for c in code.co_consts if isinstance(c, types.CodeType)]
    return tuple(dict.fromkeys([*code.co_names, *(n for names in nested for n in names)]))


class _Watch(TorchFunctionMode):
    """Whether a trace stayed in the language: no torch function ran on real tensors alone
    (other than the metadata the tracer itself reads, `_METADATA`)."""

    pure = True

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        flat = [*args, *(a for x in args if isinstance(x, tuple | list) for a in x)]
        if not any(isinstance(a, _Sym) for a in flat):
            name = getattr(func, "__name__", "")
            if name == "__get__":
                name = getattr(getattr(func, "__self__", None), "__name__", "")
            self.pure = self.pure and name in _METADATA
        return func(*args, **(kwargs or {}))
