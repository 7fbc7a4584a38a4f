"""score_mod and mask_mod: the spec's expression language, parsed, type-checked and rendered.

A spec's expression is untrusted text that becomes kernel code, so it is parsed by Python's
`ast` in 'eval' mode (a well-tested tokenizer with Python's precedence, which is what a
reader of `a - b * c` expects) and then walked against a whitelist that builds attngen's own
tree (`Expr`); nothing of Python's tree survives, and every node type, name and function
outside the whitelist is refused with one line naming the field and the token. Kernel text
is rendered from the checked tree, never from the spec's text.

The language: int, float and bool values; `score` (float, score_mod only), `b`, `h`, `q_idx`,
`kv_idx` (int) and the spec's declared tensors, indexed with exactly one int per dim;
literals (ints within int32, finite floats, True/False); + - * / and unary -; `//` and `%`
by a positive int literal, with Python's (torch's) floor semantics; comparisons (a chain is
the `and` of its links); `and`, `or`, `not` on bools (both sides evaluated: guard a read
with `where`); where(c, a, b), min(a, b), max(a, b), abs, exp, log, tanh, sqrt.

Out-of-range reads: a tensor read whose index is outside the declared shape reads nothing
(the load is masked) and makes the expression's result invalid where it is used: mask_mod is
then False and score_mod -inf (the key is masked), so a bad index can never read outside the
tensor or pass silently. A read in the branch that `where` does not take does not count.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attngen.spec.errors import FieldError, field_error

if TYPE_CHECKING:
    from attngen.spec import AttnSpec

VARIABLES = ("score", "b", "h", "q_idx", "kv_idx")
FUNCTIONS = {"where": 3, "min": 2, "max": 2, "abs": 1, "exp": 1, "log": 1, "tanh": 1, "sqrt": 1}
TENSOR_DTYPES = {"int32": "int", "int64": "int", "float32": "float", "bf16": "float"}
TENSOR_DTYPES |= {"fp16": "float", "bool": "bool"}
MAX_CHARS, MAX_NODES, MAX_DEPTH = 1024, 256, 32
MAX_INT, MAX_FLOAT = 2**31 - 1, 1e30
_BINARY = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "div"}
_BINARY |= {ast.FloorDiv: "floordiv", ast.Mod: "mod"}
_COMPARE = {ast.Lt: "lt", ast.LtE: "le", ast.Gt: "gt", ast.GtE: "ge", ast.Eq: "eq", ast.NotEq: "ne"}
_REFUSED_OPS: dict[type[ast.AST], str] = {ast.Pow: "**", ast.MatMult: "@", ast.LShift: "<<"}
_REFUSED_OPS |= {ast.RShift: ">>"}
_REFUSED_OPS |= {ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^", ast.Invert: "~"}
_REFUSED_OPS |= {ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not"}
_SYMBOL = {"add": "+", "sub": "-", "mul": "*", "div": "/", "floordiv": "//", "mod": "%"}
_SYMBOL |= {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!=", "and": "and"}
_SYMBOL |= {"or": "or"}


class ExprError(FieldError):
    """An expression outside the language; the message is one line naming the field."""

    def __init__(self, message: str):
        ValueError.__init__(self, message)
        self.field, self.value, self.allowed = message.partition(":")[0], None, message


@dataclass(frozen=True)
class Tensor:
    """A declared tensor: its name, dtype (TENSOR_DTYPES), shape (dim names or ints)."""

    name: str
    dtype: str
    shape: tuple[str | int, ...]
    trainable: bool = False


@dataclass(frozen=True)
class Expr:
    """One checked node: op ('num', 'var', 'load', 'dim' or an operator or function name),
    its operands, its value (a literal, a variable, tensor or dim name) and its type."""

    op: str
    args: tuple[Expr, ...]
    value: int | float | bool | str | None
    type: str  # "int", "float" or "bool"

    def __str__(self) -> str:
        """The normalized text: fully parenthesized, one spelling per tree (digests hash it)."""
        if self.op == "num":
            return repr(self.value)
        if self.op in ("var", "dim"):
            return str(self.value)
        args = [str(a) for a in self.args]  # once each: the text is linear in the tree
        if self.op == "load":
            return f"{self.value}[{', '.join(args)}]"
        if self.op in _SYMBOL:
            return f"({args[0]} {_SYMBOL[self.op]} {args[1]})"
        return f"(-{args[0]})" if self.op == "neg" else f"{self.op}({', '.join(args)})"

    def nodes(self) -> list[Expr]:
        return [self, *(n for a in self.args for n in a.nodes())]


def _numeric(field: str, op: str, *args: Expr) -> None:
    for a in args:
        if a.type == "bool":
            raise ExprError(f"{field}: '{op}' needs numbers, got the bool {a}")


def make(field: str, op: str, args: tuple[Expr, ...], value: Any = None) -> Expr:
    """The typed node `op(args)`; an ExprError (naming `field`) where the types do not fit."""
    types = [a.type for a in args]
    if op in ("add", "sub", "mul", "min", "max", "neg", "abs"):
        _numeric(field, op, *args)
        kind = "int" if all(t == "int" for t in types) else "float"
    elif op in ("div", "exp", "log", "tanh", "sqrt"):
        _numeric(field, op, *args)
        kind = "float"
    elif op in ("floordiv", "mod"):
        divisor = args[1]
        if args[0].type != "int" or divisor.op != "num" or divisor.type != "int":
            raise ExprError(f"{field}: '{_SYMBOL[op]}' needs an int and a positive int literal")
        if not isinstance(divisor.value, int) or divisor.value <= 0:
            raise ExprError(f"{field}: '{_SYMBOL[op]} {divisor}' needs a positive divisor")
        kind = "int"
    elif op in ("lt", "le", "gt", "ge", "eq", "ne"):
        if op not in ("eq", "ne") or types != ["bool", "bool"]:
            _numeric(field, op, *args)
        kind = "bool"
    elif op in ("and", "or", "not"):
        if any(t != "bool" for t in types):
            raise ExprError(f"{field}: '{op}' needs bools, got {', '.join(map(str, args))}")
        kind = "bool"
    elif op == "where":
        kind = _unify(field, args)
    else:
        raise ExprError(f"{field}: '{op}' is not allowed")
    return _fold(field, Expr(op, args, value, kind))


def _unify(field: str, args: tuple[Expr, ...]) -> str:
    cond, a, b = args
    if cond.type != "bool":
        raise ExprError(f"{field}: where's condition must be a bool, got {cond}")
    if a.type == b.type:
        return a.type
    if "bool" in (a.type, b.type):
        raise ExprError(f"{field}: where's branches {a} and {b} must both be bools or numbers")
    return "float"


def _fold(field: str, node: Expr) -> Expr:
    """A node whose operands are all literals becomes its value (`exp(2.0)`, `-1`)."""
    if not node.args or any(a.op != "num" for a in node.args):
        return node
    try:
        value = evaluate(node, {})
    except (ValueError, ZeroDivisionError, OverflowError):
        value = math.nan
    if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= MAX_FLOAT):
        raise ExprError(
            f"{field}: {node} is a constant without a finite value (within +-{MAX_FLOAT:g})"
        )
    return Expr("num", (), float(value) if node.type == "float" else value, node.type)


def parse(field: str, text: str, tensors: tuple[Tensor, ...] = ()) -> Expr:
    """`text` as a checked tree; mask_mod must be a bool and score_mod a float (an int is
    widened: `score_mod: "q_idx - kv_idx"` is a float score)."""
    if not isinstance(text, str) or not text.strip():
        raise ExprError(f"{field}: got {text!r}; allowed: a non-empty expression string")
    if len(text) > MAX_CHARS:
        raise ExprError(f"{field}: {len(text)} characters; allowed: at most {MAX_CHARS}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ExprError(f"{field}: not an expression ({getattr(exc, 'msg', exc)})") from None
    names = [v for v in VARIABLES if field == "score_mod" or v != "score"]
    walker = _Walker(field, {t.name: t for t in tensors}, names)
    node = walker.walk(tree.body, 0)
    want = "bool" if field == "mask_mod" else "float"
    if node.type != want and not (want == "float" and node.type == "int"):
        raise ExprError(f"{field}: {node} is a {node.type}; {field} must be a {want}")
    return node


class _Walker:
    def __init__(self, field: str, tensors: dict[str, Tensor], names: list[str]):
        self.field, self.tensors, self.names, self.count = field, tensors, names, 0

    def refuse(self, token: str) -> ExprError:
        declared = ", ".join(self.tensors) or "none"
        return ExprError(
            f"{self.field}: {token!r} is not allowed (names: {', '.join(self.names)}, and the "
            f"declared tensors: {declared}; functions: {', '.join(FUNCTIONS)})"
        )

    def walk(self, node: ast.AST, depth: int) -> Expr:
        self.count += 1
        if depth > MAX_DEPTH or self.count > MAX_NODES:
            raise ExprError(
                f"{self.field}: nested deeper than {MAX_DEPTH} or over {MAX_NODES} nodes"
            )
        f, d = self.field, depth + 1
        if isinstance(node, ast.Constant):
            return self.constant(node.value)
        if isinstance(node, ast.Name):
            if node.id not in self.names:
                raise self.refuse(node.id)
            return Expr("var", (), node.id, "float" if node.id == "score" else "int")
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            args = (self.walk(node.left, d), self.walk(node.right, d))
            return make(f, _BINARY[type(node.op)], args)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd | ast.Not):
            arg = self.walk(node.operand, d)
            if isinstance(node.op, ast.UAdd):
                return make(f, "add", (Expr("num", (), 0, "int"), arg))
            return make(f, "not" if isinstance(node.op, ast.Not) else "neg", (arg,))
        if isinstance(node, ast.BoolOp):
            op = "and" if isinstance(node.op, ast.And) else "or"
            values = [self.walk(v, d) for v in node.values]
            out = values[0]
            for value in values[1:]:
                out = make(f, op, (out, value))
            return out
        if isinstance(node, ast.Compare):
            return self.compare(node, d)
        if isinstance(node, ast.Call):
            return self.call(node, d)
        if isinstance(node, ast.Subscript):
            return self.load(node, d)
        if isinstance(node, ast.Attribute):
            raise self.refuse("." + node.attr)
        if isinstance(node, ast.BinOp | ast.UnaryOp):
            raise self.refuse(_REFUSED_OPS.get(type(node.op), type(node.op).__name__))
        raise self.refuse(
            ast.unparse(node)[:40] if hasattr(node, "lineno") else type(node).__name__
        )

    def constant(self, value: object) -> Expr:
        if isinstance(value, bool):
            return Expr("num", (), value, "bool")
        if isinstance(value, int) and abs(value) <= MAX_INT:
            return Expr("num", (), value, "int")
        if isinstance(value, float) and math.isfinite(value) and abs(value) <= MAX_FLOAT:
            return Expr("num", (), value, "float")
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise ExprError(
            f"{self.field}: {shown} is not allowed (literals: ints within +-{MAX_INT}, finite "
            f"floats within +-{MAX_FLOAT:g}, True, False)"
        )

    def compare(self, node: ast.Compare, d: int) -> Expr:
        left, out = self.walk(node.left, d), None
        for op, right_node in zip(node.ops, node.comparators, strict=True):
            if type(op) not in _COMPARE:
                raise self.refuse(_REFUSED_OPS.get(type(op), type(op).__name__))
            right = self.walk(right_node, d)
            link = make(self.field, _COMPARE[type(op)], (left, right))
            out = link if out is None else make(self.field, "and", (out, link))
            left = right
        assert out is not None
        return out

    def call(self, node: ast.Call, d: int) -> Expr:
        if not isinstance(node.func, ast.Name):
            self.walk(node.func, d)  # refuses `.attr`, `lambda ...`; else the callee's text
            raise self.refuse(ast.unparse(node.func)[:40])
        name = node.func.id
        if name not in FUNCTIONS:
            raise self.refuse(name[:40])
        if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            raise ExprError(f"{self.field}: {name} takes positional arguments only")
        if len(node.args) != FUNCTIONS[name]:
            raise ExprError(
                f"{self.field}: {name} takes {FUNCTIONS[name]} arguments, got {len(node.args)}"
            )
        return make(self.field, name, tuple(self.walk(a, d) for a in node.args))

    def load(self, node: ast.Subscript, d: int) -> Expr:
        name = node.value.id if isinstance(node.value, ast.Name) else ast.unparse(node.value)
        if name not in self.tensors:
            raise self.refuse(name[:40])
        tensor = self.tensors[name]
        items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if any(isinstance(i, ast.Slice | ast.Starred) for i in items):
            raise ExprError(f"{self.field}: {name}[...] takes one int per dim, not slices")
        if len(items) != len(tensor.shape):
            raise ExprError(
                f"{self.field}: {name} has rank {len(tensor.shape)}, indexed with {len(items)}"
            )
        index = tuple(self.walk(i, d) for i in items)
        for i in index:
            if i.type != "int":
                raise ExprError(f"{self.field}: {name}'s index {i} is a {i.type}; must be an int")
        return Expr("load", index, name, TENSOR_DTYPES[tensor.dtype])


def validity(node: Expr, tensors: dict[str, Tensor]) -> Expr | None:
    """The bool tree that is True where every read `node` uses is inside its tensor's shape
    (None: always valid). A read in where's untaken branch does not count."""
    inner = [validity(a, tensors) for a in node.args]
    if node.op == "where":
        cond, a, b = inner
        pick = None
        if a is not None or b is not None:
            true = Expr("num", (), True, "bool")
            pick = make("", "where", (node.args[0], a or true, b or true))
        return _all([cond, pick])
    if node.op != "load":
        return _all(inner)
    bounds: list[Expr | None] = list(inner)
    for index, size in zip(node.args, tensors[str(node.value)].shape, strict=True):
        dim = (
            Expr("num", (), size, "int") if isinstance(size, int) else Expr("dim", (), size, "int")
        )
        bounds.append(make("", "ge", (index, Expr("num", (), 0, "int"))))
        bounds.append(make("", "lt", (index, dim)))
    return _all(bounds)


def _all(parts: list[Expr | None]) -> Expr | None:
    out = None
    for part in parts:
        if part is not None and not (part.op == "num" and part.value is True):
            out = part if out is None else make("", "and", (out, part))
    return out


_MATH: dict[str, Any] = {"exp": math.exp, "log": math.log, "tanh": math.tanh, "abs": abs}
_MATH |= {"sqrt": math.sqrt}
_MATH |= {"min": min, "max": max, "neg": lambda a: -a, "not": lambda a: not a}
_PY = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv}
_PY |= {"floordiv": operator.floordiv, "mod": operator.mod, "lt": operator.lt, "le": operator.le}
_PY |= {"gt": operator.gt, "ge": operator.ge, "eq": operator.eq, "ne": operator.ne}


def evaluate(node: Expr, env: dict[str, Any]) -> Any:
    """`node`'s value in float64 Python (the reference's meaning): `env` maps the variables,
    dim names and tensor names (numpy arrays) to values; a read out of range gives 0."""
    if node.op == "num":
        return node.value
    if node.op in ("var", "dim"):
        return env[str(node.value)]
    if node.op == "where":
        return evaluate(node.args[1] if evaluate(node.args[0], env) else node.args[2], env)
    args = [evaluate(a, env) for a in node.args]
    if node.op == "load":
        array = env[str(node.value)]
        if not all(0 <= i < n for i, n in zip(args, array.shape, strict=True)):
            return 0
        return array[tuple(args)].item()
    if node.op in ("and", "or"):
        return (args[0] and args[1]) if node.op == "and" else (args[0] or args[1])
    if node.op in _MATH:
        return _MATH[node.op](*args)
    return _PY[node.op](args[0], args[1])


def evaluate_mod(field: str, node: Expr, env: dict[str, Any], tensors: tuple[Tensor, ...]) -> Any:
    """What the kernel computes: `node`'s value, or False (mask_mod) / -inf (score_mod) where
    a read it uses is out of range."""
    valid = validity(node, {t.name: t for t in tensors})
    if valid is not None and not evaluate(valid, env):
        return False if field == "mask_mod" else -math.inf
    return evaluate(node, env)


def digest(node: Expr, tensors: tuple[Tensor, ...]) -> str:
    """8 hex digits of the normalized tree and the declarations of the tensors it reads."""
    read = sorted({str(n.value) for n in node.nodes() if n.op == "load"})
    used = [t for t in tensors if t.name in read]
    return hashlib.sha256(f"{node}|{used}".encode()).hexdigest()[:8]


def expression_key(spec: Mapping[str, Any]) -> str:
    """What an expression module serves and a call asks for (the runtime's Need.expressions):
    "" for a canonical spec (AttnSpec.canonical(), a registry entry's) without score_mod and
    mask_mod, else 16 hex digits of their normalized texts and the tensor declarations."""
    parts = [spec.get("score_mod"), spec.get("mask_mod"), list(spec.get("tensors") or [])]
    if parts[0] is None and parts[1] is None:
        return ""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


# The kernel's names (the prefill key loop's, _key_loop.py.jinja): the scaled score tile, the
# program's batch and query head, the rows' and keys' positions in their sequence (broadcast to
# the [BLOCK_M, BLOCK_N] tile); a tensor T is read through T_ptr with strides T_stride0.., and
# a named dim D is the kernel argument dim_D; "tl" and "tanh" name the language module and the
# tanh helper (GLUON_NAMES: the warp-specialized forward's, gl and _gluon_tanh).
KERNEL_NAMES = {"score": "qk", "b": "off_b", "h": "off_h", "tl": "tl", "tanh": "_tanh"}
KERNEL_NAMES |= {"q_idx": "offs_m[:, None]", "kv_idx": "key_pos[None, :]"}
GLUON_NAMES = KERNEL_NAMES | {"score": "s", "tl": "gl", "tanh": "_gluon_tanh"}
GLUON_NAMES |= {"q_idx": "rows[:, None]", "kv_idx": "cols[None, :]"}
_TRITON = {"min": "minimum", "max": "maximum", "abs": "abs", "exp": "exp", "log": "log"}
_TRITON |= {"sqrt": "sqrt", "where": "where"}
_INFIX = {**_SYMBOL, "and": "&", "or": "|"}
_FLOAT_OPS = ("div", "exp", "log", "tanh", "sqrt")
_OTHER = {"int": "0", "float": "0.0", "bool": "False"}


def render(
    node: Expr,
    tensors: tuple[Tensor, ...],
    as_float: bool = False,
    names: Mapping[str, str] = KERNEL_NAMES,
) -> str:
    """Triton source of `node` (deterministic; `tanh` is the kernels' `_tanh` helper); an int
    operand of a float operation (and the whole, with `as_float`) is cast to fp32. `names`:
    the kernel's text of each variable (KERNEL_NAMES: the forward's key loop)."""
    text = _render(node, {t.name: t for t in tensors}, names)
    return _cast(node, text, names["tl"]) if as_float else text


def _cast(node: Expr, text: str, tl: str) -> str:
    if node.type != "int":
        return text
    return repr(float(str(node.value))) if node.op == "num" else f"{text}.to({tl}.float32)"


def _render(node: Expr, tensors: dict[str, Tensor], names: Mapping[str, str]) -> str:
    r, tl = [_render(a, tensors, names) for a in node.args], names["tl"]
    if node.op != "load" and (node.type == "float" or node.op in _FLOAT_OPS):
        r = [_cast(a, text, tl) for a, text in zip(node.args, r, strict=True)]
    if node.op == "num":
        return repr(float(node.value)) if isinstance(node.value, float) else repr(node.value)
    if node.op == "var":
        return names[str(node.value)]
    if node.op == "dim":
        return f"dim_{node.value}"
    if node.op == "load":
        tensor = tensors[str(node.value)]
        offset = " + ".join(f"({i}) * {tensor.name}_stride{k}" for k, i in enumerate(r))
        bounds = validity(Expr("load", node.args, node.value, node.type), tensors)
        mask = _render(bounds, tensors, names) if bounds is not None else "None"
        load = f"{tl}.load({tensor.name}_ptr + {offset}, mask={mask}, other={_OTHER[node.type]})"
        return f"{load}.to({tl}.float32)" if node.type == "float" else load
    if node.op == "floordiv":  # floor semantics from Triton's truncating // and %
        return f"(({r[0]} - (({r[0]} % {r[1]}) + {r[1]}) % {r[1]}) // {r[1]})"
    if node.op == "mod":
        return f"((({r[0]} % {r[1]}) + {r[1]}) % {r[1]})"
    if node.op == "neg":
        return f"(-{r[0]})"
    if node.op == "not":
        return f"({r[0]} == 0)"
    if node.op in _INFIX:
        return f"({r[0]} {_INFIX[node.op]} {r[1]})"
    if node.op == "tanh":
        return f"{names['tanh']}({r[0]})"
    return f"{tl}.{_TRITON[node.op]}({', '.join(r)})"


def render_mod(
    field: str, node: Expr, tensors: tuple[Tensor, ...], names: Mapping[str, str] = KERNEL_NAMES
) -> str:
    """The kernel's value of the field: False (mask_mod) or -inf (score_mod) where a read is
    out of range (module docstring), else the expression."""
    valid = validity(node, {t.name: t for t in tensors})
    text = render(node, tensors, as_float=field == "score_mod", names=names)
    if valid is None:
        return text
    guard = render(valid, tensors, names=names)
    return (
        f"({guard} & {text})"
        if field == "mask_mod"
        else f"{names['tl']}.where({guard}, {text}, float('-inf'))"
    )


_RESERVED = {*VARIABLES, *FUNCTIONS, "and", "or", "not", "if", "else", "in", "is", "lambda"}
_RESERVED |= {"lse", "delta"}  # lse_ptr, delta_ptr: the dK/dV kernel's own names


def declared(spec: AttnSpec) -> tuple[Tensor, ...]:
    return tuple(Tensor(t.name, t.dtype, t.shape, t.trainable) for t in spec.tensors)


def parsed(spec: AttnSpec, field: str) -> Expr | None:
    """The checked tree of the spec's `field` (score_mod or mask_mod), or None where unset."""
    text = getattr(spec, field)
    return None if text is None else parse(field, text, declared(spec))


def check_expressions(spec: AttnSpec) -> None:
    """The tensors' names, and score_mod and mask_mod against them (parse raises)."""
    names = [t.name for t in spec.tensors]
    for name in names:
        if name in _RESERVED or names.count(name) > 1:
            raise field_error(
                "tensors", name, "unique names other than " + ", ".join(sorted(_RESERVED))
            )
    trees = [tree for f in ("score_mod", "mask_mod") if (tree := parsed(spec, f)) is not None]
    read = [{str(n.value) for n in tree.nodes() if n.op == "load"} for tree in trees]
    for tensor in spec.tensors:
        if not any(tensor.name in names for names in read):
            raise field_error("tensors", tensor.name, "tensors that score_mod or mask_mod reads")
        scored = spec.score_mod is not None and tensor.name in read[0]
        if tensor.trainable and not (
            spec.backward and TENSOR_DTYPES[tensor.dtype] == "float" and scored
        ):
            raise field_error(
                "tensors",
                tensor.name,
                "trainable only for a float tensor that score_mod reads, with backward: true",
            )
    if spec.score_mod is not None and (spec.softcap or spec.alibi):
        raise field_error(
            "score_mod",
            spec.score_mod,
            "absent with softcap or alibi (write them in the expression: 30 * tanh(score / 30))",
        )
