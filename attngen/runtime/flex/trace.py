"""Python score_mod and mask_mod functions traced into attngen's expression tree.

The tracer calls the function once on symbolic values (`_Sym`) for score, b, h, q_idx and
kv_idx; every operation on them builds a node with `expressions.make` (the constructor the
spec parser uses, with its type checks), so the result is the same `Expr` a spec's text
parses to: one rendering, digest and derived gradient. Symbolic values rather than torch.fx:
a Python operator or a torch function meets the tracer itself (dunder methods and
`__torch_function__`), so each one is typed and checked where it happens and refused with the
function's name and the operation's (data-dependent `if`, `and`/`or`, int() of a traced value,
a torch function outside the language); fx would give a graph of arbitrary torch calls to
translate afterwards, and its own errors for control flow.

Captured tensors (read by indexing with traced indices, `doc[b, q_idx]`, or 0-d tensors used
as numbers) become declared tensors: named after the closure, global or default-argument
variable that holds them where that is a valid name, else t0, t1, ...; dtype from the tensor;
every dim named (DOC_0, DOC_1: one kernel serves every size); trainable when the tensor
requires grad. A read outside the tensor masks the key (the language's rule, also for the
negative indices torch would wrap).

score_mod may return -inf through torch.where (`torch.where(c, score, -float("inf"))`, as
Flex users mask in a score_mod): that branch is taken out as a mask (`keep`), which the caller
ANDs into mask_mod; -inf anywhere else is refused.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

import torch

from attngen.spec import expressions
from attngen.spec.expressions import TENSOR_DTYPES, Expr, ExprError, Tensor, make

_DTYPES = {torch.int32: "int32", torch.int64: "int64", torch.float32: "float32"}
_DTYPES |= {torch.bfloat16: "bf16", torch.float16: "fp16", torch.bool: "bool"}
_RESERVED = {"score", "b", "h", "q_idx", "kv_idx", "where", "min", "max", "abs", "exp", "log"}
_RESERVED |= {"tanh", "sqrt", "and", "or", "not", "if", "else", "in", "is", "lambda"}
_TRUE = Expr("num", (), True, "bool")
LN2 = math.log(2.0)


class TraceError(ValueError):
    """A score_mod or mask_mod the tracer cannot express; names the function and operation."""


class Capture:
    """The tensors the traced functions of one call read, declared once each."""

    def __init__(self) -> None:
        self.found: dict[int, tuple[Tensor, torch.Tensor]] = {}

    def declare(self, tensor: torch.Tensor, fn: Any, where: str) -> Tensor:
        if id(tensor) in self.found:
            return self.found[id(tensor)][0]
        if tensor.dtype not in _DTYPES:
            allowed = ", ".join(map(str, _DTYPES))
            raise TraceError(
                f"{where}: a captured tensor of dtype {tensor.dtype}; allowed: {allowed}"
            )
        if tensor.dim() > 4 or tensor.is_sparse or tensor.is_nested:
            raise TraceError(
                f"{where}: a captured tensor of shape {tuple(tensor.shape)}; "
                "allowed: dense tensors of at most 4 dims"
            )
        taken = {decl.name for decl, _ in self.found.values()}
        name = _variable_names(fn).get(id(tensor))
        if name is None or name in taken or name in _RESERVED:
            name = next(f"t{i}" for i in range(len(taken) + 1) if f"t{i}" not in taken)
        prefix = name.upper()[:13]  # dim names: [A-Z][A-Z0-9_]{0,15}, unique to the tensor
        if any(str(d.shape[0]).startswith(prefix + "_") for d, _ in self.found.values()):
            prefix = f"T{len(taken)}"
        shape = tuple(f"{prefix}_{k}" for k in range(max(tensor.dim(), 1)))
        trainable = tensor.requires_grad and torch.is_grad_enabled()
        decl = Tensor(name, _DTYPES[tensor.dtype], shape, trainable)
        self.found[id(tensor)] = (decl, tensor)
        return decl

    def declarations(self) -> tuple[Tensor, ...]:
        return tuple([decl for decl, _ in self.found.values()])

    def values(self) -> dict[str, torch.Tensor]:
        """name -> the tensor the module reads (a 0-d tensor as one element)."""
        return {d.name: t.reshape(1) if t.dim() == 0 else t for d, t in self.found.values()}


def _variable_names(fn: Any, depth: int = 0) -> dict[int, str]:
    """id(tensor) -> the name of a closure cell, global, default or partial keyword argument
    holding it (also in the functions those hold, as and_masks' closures do)."""
    fn = getattr(fn, "fn", fn)  # torch's _MaskModWrapper
    pairs: list[tuple[str, Any]] = []
    code = getattr(fn, "__code__", None)
    if isinstance(fn, functools.partial):
        pairs = [*fn.keywords.items(), ("", fn.args), ("", fn.func)]
    elif code is not None:
        cells = [getattr(c, "cell_contents", None) for c in fn.__closure__ or ()]  # None: empty
        pairs = list(zip(code.co_freevars, cells, strict=True))
        pairs += [(n, fn.__globals__[n]) for n in code.co_names if n in fn.__globals__]
        defaults, params = fn.__defaults__ or (), code.co_varnames[: code.co_argcount]
        pairs += list(zip(params[len(params) - len(defaults) :], defaults, strict=True))
    found: dict[int, str] = {}
    for name, value in pairs:
        if isinstance(value, torch.Tensor):
            clean = re.sub(r"[^a-z0-9_]", "_", name.lower()).lstrip("_0123456789")[:32]
            if clean:
                found.setdefault(id(value), clean)
        elif depth < 3:  # a function it calls (and_masks keeps a tuple of them)
            for inner in value if isinstance(value, tuple | list) else (value,):
                if callable(inner) and not isinstance(inner, type):
                    found = _variable_names(inner, depth + 1) | found
    return found


class _Context:
    """One function's trace: its field, its name (for errors), the call's Capture."""

    def __init__(self, field: str, fn: Any, capture: Capture):
        self.field, self.fn, self.capture = field, fn, capture
        self.label = f"{field} {getattr(fn, '__qualname__', None) or type(fn).__name__}"

    def error(self, what: str) -> TraceError:
        return TraceError(f"{self.label}: {what}")

    def node(self, value: Any, op: str) -> tuple[Expr, Expr | None]:
        """(tree, keep) of an operand: a traced value, a Python number, a captured 0-d tensor."""
        if isinstance(value, _Sym) and not isinstance(value, _Partial):
            return value.expr, value.keep
        if isinstance(value, bool):
            return Expr("num", (), value, "bool"), None
        if isinstance(value, int | float) and not isinstance(value, bool):
            try:  # the parser's own literal rules (ranges, finiteness)
                return expressions._Walker(self.field, {}, []).constant(value), None
            except ExprError as exc:
                raise self.error(f"'{op}' of {exc}".replace(f"{self.field}: ", "")) from None
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            return self.load(value, ()).expr, None
        if isinstance(value, _Partial):
            raise self.error(
                f"'{op}' of {value}, which indexes {len(value.index)} of its "
                f"tensor's {value.tensor.dim()} dims"
            )
        shown = repr(value)[:40]
        if isinstance(value, torch.Tensor):
            shown = f"a captured tensor of shape {tuple(value.shape)} (not indexed)"
        raise self.error(
            f"'{op}' of {shown}; allowed: traced values, numbers, bools, captured tensors "
            "indexed by traced ints"
        )

    def apply(self, op: str, *operands: Any) -> _Sym:
        nodes = [self.node(x, op) for x in operands]
        keeps = [keep for _, keep in nodes]
        if any(keeps) and not (op == "add" or (op == "sub" and keeps[1] is None)):
            raise self.error(
                f"'{op}' of a score that is -inf where torch.where masked it; "
                "allowed there: adding to it, subtracting from it, returning it"
            )
        if op in ("and", "or", "not") and any(n.type != "bool" for n, _ in nodes):
            symbol = {"and": "&", "or": "|", "not": "~"}[op]
            shown = ", ".join(str(n) for n, _ in nodes)
            raise self.error(f"'{symbol}' of {shown}; allowed: bools (comparisons, masks)")
        if op in ("and", "or"):  # a literal side (and_masks starts from True) folds away
            (a, _), (b, _) = nodes
            for x, y in ((a, b), (b, a)):
                if x.op == "num" and x.type == y.type == "bool":
                    return _Sym(y if x.value == (op == "and") else x, self)
        try:
            tree = make(self.field, op, tuple(n for n, _ in nodes))
        except ExprError as exc:
            raise self.error(str(exc).partition(": ")[2] or str(exc)) from None
        return _Sym(tree, self, _all(keeps))

    def where(self, cond: Any, a: Any, b: Any) -> _Sym:
        """torch.where; a score_mod's -inf branch becomes `keep` (the module docstring)."""
        masked = [isinstance(x, float) and x == -math.inf for x in (a, b)]
        if any(masked) and (self.field != "score_mod" or all(masked)):
            raise self.error(
                "-inf in torch.where; allowed: one branch of a score_mod's where "
                "(it masks the key); a mask_mod returns False instead"
            )
        test = self.node(cond, "where")[0]
        if test.type != "bool":
            raise self.error(f"torch.where's condition {test} is a {test.type}; must be a bool")
        if any(masked):
            kept, keep = self.node(b if masked[0] else a, "where")
            test = make(self.field, "not", (test,)) if masked[0] else test
            return _Sym(kept, self, _all([test, keep]))
        (ta, ka), (tb, kb) = self.node(a, "where"), self.node(b, "where")
        out = self.apply("where", _Sym(test, self), _Sym(ta, self), _Sym(tb, self))
        if ka is None and kb is None:
            return out
        return _Sym(out.expr, self, make(self.field, "where", (test, ka or _TRUE, kb or _TRUE)))

    def load(self, base: Any, index: Any) -> _Sym | _Partial:
        tensor, done = (base.tensor, base.index) if isinstance(base, _Partial) else (base, ())
        items = index if isinstance(index, tuple) else (index,)
        shown = f"a captured tensor of shape {tuple(tensor.shape)}"
        nodes = []
        for item in items:
            if isinstance(item, int) and not isinstance(item, bool) and item < 0:
                raise self.error(
                    f"{shown} indexed with {item}; allowed: indices >= 0 "
                    "(a negative one is not wrapped: the read would mask the key)"
                )
            if not isinstance(item, _Sym | int | torch.Tensor) or isinstance(item, bool):
                raise self.error(
                    f"{shown} indexed with {item!r}; allowed: one traced int or "
                    "int per dim (no slices, None, ..., floats or bools)"
                )
            node = self.node(item, "index")[0]
            if node.type != "int":
                raise self.error(f"{shown} indexed with {node}, a {node.type}; allowed: ints")
            nodes.append(node)
        full = (*done, *nodes)
        if len(full) > max(tensor.dim(), 1) or (tensor.dim() == 0 and full):
            raise self.error(f"{shown} indexed with {len(full)} indices")
        if len(full) < tensor.dim():
            return _Partial(tensor, full, self)
        decl = self.capture.declare(tensor, self.fn, self.label)
        full = full or (Expr("num", (), 0, "int"),)
        return _Sym(Expr("load", full, decl.name, TENSOR_DTYPES[decl.dtype]), self)


def _all(parts: list[Expr | None]) -> Expr | None:
    out = None
    for part in parts:
        if part is not None:
            out = part if out is None else make("mask_mod", "and", (out, part))
    return out


def _refuse(what: str):
    def method(self: _Sym, *args: Any, **kwargs: Any) -> Any:
        raise self.ctx.error(what)

    return method


def _binary(op: str, swap: bool = False):
    def method(self: _Sym, other: Any) -> _Sym:
        return self.ctx.apply(op, other, self) if swap else self.ctx.apply(op, self, other)

    return method


class _Sym:
    """A traced value: its tree, and where a score_mod masked it with -inf, `keep`."""

    __hash__ = None  # type: ignore[assignment]

    def __init__(self, expr: Expr, ctx: _Context, keep: Expr | None = None):
        self.expr, self.ctx, self.keep = expr, ctx, keep

    def __repr__(self) -> str:
        return f"traced({self.expr})"

    __add__, __radd__ = _binary("add"), _binary("add", True)
    __sub__, __rsub__ = _binary("sub"), _binary("sub", True)
    __mul__, __rmul__ = _binary("mul"), _binary("mul", True)
    __truediv__, __rtruediv__ = _binary("div"), _binary("div", True)
    __floordiv__, __rfloordiv__ = _binary("floordiv"), _binary("floordiv", True)
    __mod__, __rmod__ = _binary("mod"), _binary("mod", True)
    __and__, __rand__ = _binary("and"), _binary("and", True)
    __or__, __ror__ = _binary("or"), _binary("or", True)
    __lt__, __le__, __gt__ = _binary("lt"), _binary("le"), _binary("gt")
    __ge__, __eq__, __ne__ = _binary("ge"), _binary("eq"), _binary("ne")
    __bool__ = _refuse(
        "a traced value used as a Python bool (if, and, or, not, min, max, "
        "assert: data-dependent control flow); use &, |, ~, torch.where, "
        "torch.minimum, torch.maximum"
    )
    __int__ = __float__ = __index__ = _refuse(
        "int() or float() of a traced value, or a traced value as a Python index"
    )
    __pow__ = __rpow__ = _refuse("'**' (not in the language: write x * x)")
    __xor__ = __rxor__ = _refuse("'^' (not in the language)")
    __lshift__ = __rshift__ = _refuse("'<<' or '>>' (not in the language)")
    __iter__ = __len__ = _refuse("iterating a traced value")
    __getitem__ = _refuse("indexing a traced value (only captured tensors are indexed)")

    def __neg__(self) -> _Sym:
        return self.ctx.apply("neg", self)

    def __abs__(self) -> _Sym:
        return self.ctx.apply("abs", self)

    def __invert__(self) -> _Sym:
        return self.ctx.apply("not", self)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "device":  # for .to(x.device): devices are the call's
            return None
        method = _TORCH.get(name)
        if method is None:
            raise self.ctx.error(f"the method .{name}() is not in the language; {_ALLOWED}")
        return functools.partial(method, self.ctx, self)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        flat = [*args, *(a for x in args if isinstance(x, tuple) for a in x)]
        ctx = next(a.ctx for a in flat if isinstance(a, _Sym | _Partial))
        name = getattr(func, "__name__", repr(func))
        if name == "__getitem__":
            return ctx.load(args[0], args[1])
        method = _TORCH.get(name)
        if method is None or (kwargs and name not in ("new_ones", "new_zeros", "to")):
            raise ctx.error(f"torch.{name} is not in the language (or not so); {_ALLOWED}")
        return method(ctx, *args, **(kwargs or {}))


class _Partial(_Sym):
    """A captured tensor indexed in fewer dims than it has (`doc[b]` of `doc[b][q_idx]`):
    indexing it again is all it allows (an operator on it is refused by _Context.node)."""

    def __init__(self, tensor: torch.Tensor, index: tuple[Expr, ...], ctx: _Context):
        super().__init__(Expr("num", (), 0, "int"), ctx)
        self.tensor, self.index = tensor, index

    def __getitem__(self, index: Any) -> _Sym | _Partial:
        return self.ctx.load(self, index)

    def __repr__(self) -> str:
        return f"tensor[{', '.join(map(str, self.index))}]"


def _op(op: str, swap: bool = False):
    return lambda ctx, *args: ctx.apply(op, *(reversed(args) if swap else args))


def _constant(value: float):
    def method(ctx: _Context, x: Any, size: Any = (), dtype: Any = None, **_: Any) -> Any:
        if tuple(size) != ():
            raise ctx.error(f"new_ones/new_zeros of size {size}; allowed: () (a scalar)")
        node = ctx.node(x, "constant")[0]
        kind = "bool" if dtype is torch.bool else node.type if dtype is None else "float"
        number = {"bool": bool(value), "int": int(value)}.get(kind, float(value))
        return _Sym(ctx.node(number, "constant")[0], ctx)  # traced: .to() and .device work

    return method


def _to(ctx: _Context, x: Any, *args: Any, **kwargs: Any) -> Any:
    """Tensor.to: a device (and_masks' `.to(result.device)`) or the value's own type changes
    nothing; a floating dtype makes it a float; anything else is refused."""
    node = ctx.node(x, "to")[0]
    for arg in (*args, *kwargs.values()):
        same = {torch.bool: "bool", torch.int32: "int", torch.int64: "int"}.get(arg) == node.type
        if arg is None or same or isinstance(arg, str | torch.device | bool):
            continue
        if isinstance(arg, torch.dtype) and arg.is_floating_point:
            x = ctx.apply("mul", x, 1.0) if node.type != "float" else x
            continue
        raise ctx.error(f".to({arg!r}) of {node}, a {node.type}; allowed: a device, a float dtype")
    return x


_TORCH: dict[str, Any] = {name: _op(name) for name in ("abs", "exp", "log", "sqrt", "tanh")}
_TORCH |= {"add": _op("add"), "sub": _op("sub"), "subtract": _op("sub"), "rsub": _op("sub", True)}
_TORCH |= {"mul": _op("mul"), "multiply": _op("mul"), "div": _op("div"), "true_divide": _op("div")}
_TORCH |= {"floor_divide": _op("floordiv"), "remainder": _op("mod"), "neg": _op("neg")}
_TORCH |= {"negative": _op("neg"), "minimum": _op("min"), "maximum": _op("max")}
_TORCH |= {name: _op(name) for name in ("lt", "le", "gt", "ge", "eq", "ne")}
_TORCH |= {"less": _op("lt"), "greater": _op("gt"), "less_equal": _op("le")}
_TORCH |= {"greater_equal": _op("ge"), "not_equal": _op("ne")}
_TORCH |= {f"{p}_{o}": _op(o) for p in ("logical", "bitwise") for o in ("and", "or", "not")}
_TORCH |= {f"__{o}__": _op(o) for o in ("and", "or")}
_TORCH |= {f"__r{o}__": _op(o, True) for o in ("add", "sub", "mul", "and", "or")}
_TORCH |= {"__rtruediv__": _op("div", True), "__rdiv__": _op("div", True)}
_TORCH |= {"__floordiv__": _op("floordiv"), "__rfloordiv__": _op("floordiv", True)}
_TORCH |= {"__mod__": _op("mod"), "__rmod__": _op("mod", True), "__invert__": _op("not")}
_TORCH |= {"where": lambda ctx, c, a, b: ctx.where(c, a, b)}
_TORCH |= {"exp2": lambda ctx, x: ctx.apply("exp", ctx.apply("mul", x, LN2))}
_TORCH |= {"float": lambda ctx, x: ctx.apply("mul", x, 1.0)}
_TORCH |= {"new_ones": _constant(1), "new_zeros": _constant(0)}
_TORCH |= {"ones_like": _constant(1), "zeros_like": _constant(0), "to": _to}
_ALLOWED = f"allowed: {', '.join(sorted(name for name in _TORCH if name[0] != '_'))}"


def trace(fn: Any, field: str, capture: Capture) -> tuple[Expr | None, Expr | None]:
    """(tree, keep) of score_mod or mask_mod `fn`: `keep` is where a score_mod is not -inf
    (None: everywhere); (None, None) for a mask_mod that keeps every key (torch's noop_mask).
    The tree is printed and parsed again (the spec's checks, once more)."""
    from torch.nn.attention.flex_attention import noop_mask

    if getattr(fn, "fn", fn) is noop_mask:
        return None, None
    if not callable(fn):
        raise TraceError(f"{field}: got {fn!r}; allowed: a Python function or None")
    ctx = _Context(field, fn, capture)
    names = ("score", "b", "h", "q_idx", "kv_idx")[field == "mask_mod" :]
    args = [_Sym(Expr("var", (), n, "float" if n == "score" else "int"), ctx) for n in names]
    try:
        result = fn(*args)
    except (TraceError, ExprError):
        raise
    except Exception as exc:  # noqa: BLE001 - any failure inside the user's function
        raise ctx.error(f"tracing raised {type(exc).__name__}: {exc}") from exc
    tree, keep = ctx.node(result, "return")
    want = "bool" if field == "mask_mod" else "float"
    if tree.type != want and not (want == "float" and tree.type == "int"):
        raise ctx.error(f"returns {tree}, a {tree.type}; {field} must return a {want}")
    try:
        tree = expressions.parse(field, str(tree), capture.declarations())
    except ExprError as exc:
        raise ctx.error(str(exc)) from None
    return tree, keep
