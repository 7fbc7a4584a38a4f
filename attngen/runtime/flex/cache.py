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

Before the snapshot, a repeated pair of functions is checked against its last snapshot by
identity (`_same`: each function's code and defaults, each cell's and global's object, the
captured tensors' kind, grad mode): what the snapshot holds by value is immutable, so equal
objects give an equal snapshot, whose key then serves without being taken again.
"""

from __future__ import annotations

import dis
import functools
import types
import weakref
from collections import OrderedDict
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from attngen.runtime.flex.trace import Capture, _Sym, trace
from attngen.spec.expressions import Expr

SIZE = 256  # entries kept, least recently used dropped first
_traces: OrderedDict[tuple, tuple] = OrderedDict()
_seen: dict[tuple[int, int], tuple] = {}  # (id(score_mod), id(mask_mod)) -> the last reads
_EMPTY = object()  # an empty cell, an absent global
_FUNCTION = "function"  # a function's code, defaults and keyword defaults (_same)
_GLOBAL_LOADS = {"LOAD_GLOBAL", "LOAD_NAME", "LOAD_FROM_DICT_OR_GLOBALS"}
_VALUES = (type(None), bool, int, float, str, bytes, torch.dtype, torch.device)
_MODULES = ("torch", "math", "operator", "numpy")
_METADATA = {"dim", "dtype", "device", "ndim", "layout", "requires_grad", "is_sparse", "is_nested"}


class _Unguarded(Exception):
    """The functions read something the snapshot cannot compare: trace every call."""


def traced(score_mod: Any, mask_mod: Any) -> tuple[Expr | None, Expr | None, Expr | None, Capture]:
    """(score, keep, mask, capture) of a call's score_mod and mask_mod (trace.trace's trees;
    None for an absent function), from the cache when the snapshot matches."""
    grad, pair = torch.is_grad_enabled(), (id(score_mod), id(mask_mod))
    seen = _seen.get(pair)
    if seen is not None and seen[0] is grad and _same(seen[3], score_mod, mask_mod):
        slots, reads, key = seen[2:]  # nothing it read changed: the last snapshot
    else:
        slots, reads, seen = [], ([], []), None
        try:  # left to right: the slots' order is the functions'
            key = (
                grad,
                _guard(score_mod, slots, 0, reads[0]),
                _guard(mask_mod, slots, 0, reads[1]),
            )
        except _Unguarded:
            key = None
    hit = None if key is None else _traces.get(key)
    if hit is not None and key is not None:
        _traces.move_to_end(key)
        if seen is None:
            _remember(pair, score_mod, mask_mod, (grad, slots, reads, key))
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


def _same(reads: tuple[list, list], score_mod: Any, mask_mod: Any) -> bool:
    """Whether everything the last snapshot of these functions read is as it was: the same
    objects (functions' code and defaults, cells, globals) and captured tensors of the same
    kind. Then the snapshot would be the same: what it holds by value is immutable."""
    now: Any
    for root, held in zip((score_mod, mask_mod), reads, strict=True):
        for holder, name, was in held:
            holder = root if holder is None else holder
            if name is _FUNCTION:
                now = holder.__code__, holder.__defaults__, holder.__kwdefaults__
                if now[0] is not was[0] or now[1] is not was[1] or now[2] is not was[2]:
                    return False
                continue
            if name is None:  # a tensor: its kind
                now = (holder.dtype, holder.dim(), holder.requires_grad, holder.layout)
                if now != was or holder.is_nested:
                    return False
                continue
            if name == "":  # a list or a partial's keywords, changed in place unseen
                return False
            try:
                now = holder.get(name, _EMPTY) if type(holder) is dict else getattr(holder, name)
            except ValueError:  # an empty cell
                now = _EMPTY
            if now is not was:
                return False
    return True


def _remember(pair: tuple[int, int], score_mod: Any, mask_mod: Any, seen: tuple) -> None:
    """Keep a snapshot's reads for _same while both functions live (weak references to them;
    the reads hold what they read, not the functions, and go with them), SIZE at most."""
    try:
        drop = functools.partial(_seen.pop, pair)  # drop(ref): _seen.pop(pair, ref)
        refs = tuple(weakref.ref(fn, drop) for fn in (score_mod, mask_mod) if fn is not None)
    except TypeError:  # a callable without weak references: a snapshot every call
        return
    if len(_seen) >= SIZE:  # a full table starts over (no iteration: other threads write)
        _seen.clear()
    _seen[pair] = (seen[0], refs, *seen[1:])


def _guard(value: Any, slots: list[torch.Tensor], depth: int, reads: list) -> tuple:
    """The snapshot of one value (the module docstring); captured tensors appended to slots,
    and what it read to reads, as (holder, name, what it held), the holder None for the
    function at depth 0 (_same)."""
    if depth > 8:
        raise _Unguarded
    kind = type(value)
    if kind in _VALUES:
        return (kind, repr(value)) if kind is float else (kind, value)  # repr: -0.0 is not 0.0
    if kind is types.FunctionType:
        code, defaults, keywords = value.__code__, value.__defaults__, value.__kwdefaults__
        reads.append((value if depth else None, _FUNCTION, (code, defaults, keywords)))
        parts: list[Any] = ["fn", code]
        for cell in value.__closure__ or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell (a name bound later)
                reads.append((cell, "cell_contents", _EMPTY))
                parts.append(("empty",))
                continue
            reads.append((cell, "cell_contents", contents))
            parts.append(_guard(contents, slots, depth + 1, reads))
        names = value.__globals__
        for name in _global_names(code):
            reads.append((names, name, names.get(name, _EMPTY)))
            if name in names:
                parts.append((name, _guard(names[name], slots, depth + 1, reads)))
        if defaults is not None or keywords:
            defaults = (defaults, tuple(sorted((keywords or {}).items())))
            parts.append(("", _guard(defaults, slots, depth + 1, reads)))
        return tuple(parts)
    if isinstance(value, torch.Tensor):
        for place, held in enumerate(slots):  # noqa: B007 - the place of an earlier one
            if held is value:
                break
        else:
            place = len(slots)
            slots.append(value)
        meta = (value.dtype, value.dim(), value.requires_grad, value.layout)
        reads.append((value, None, meta))
        return ("tensor", place, kind, *meta, value.is_nested)
    if kind is tuple or kind is list:
        if kind is list:
            reads.append((value, "", None))
        return (kind, *[_guard(item, slots, depth + 1, reads) for item in value])
    if kind is functools.partial:
        if value.keywords:
            reads.append((value, "", None))
        arguments = (value.func, value.args, tuple(sorted(value.keywords.items())))
        return ("partial", _guard(arguments, slots, depth + 1, reads))
    if kind is types.ModuleType and value.__name__.partition(".")[0] in _MODULES:
        return ("module", value.__name__)
    if kind is types.BuiltinFunctionType or (kind is type and value.__module__ == "builtins"):
        return ("builtin", value)
    raise _Unguarded


@functools.lru_cache(maxsize=1024)
def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """The names a code object (and the functions defined in it) reads as globals."""
    nested = [_global_names(c) for c in code.co_consts if isinstance(c, types.CodeType)]
    loads = [i.argval for i in dis.get_instructions(code) if i.opname in _GLOBAL_LOADS]
    return tuple(dict.fromkeys([*loads, *(n for names in nested for n in names)]))


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
