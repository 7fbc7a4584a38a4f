"""The gradient of a score_mod, derived with sympy from its checked tree (attngen.spec.expressions).

Each maximal subtree that depends neither on `score` nor on a trainable tensor's read (index
arithmetic, a mask-like condition, a frozen table's read) becomes one opaque sympy symbol, so
sympy sees only what it differentiates; `where`, `min`, `max` and `abs` become Piecewise.
The derivative is simplified (sympy.simplify, for derivatives of at most MAX_SIMPLIFY_OPS
operations; kept where it has fewer operations and uses only the language's functions) and
converted back into the same tree type, which the kernels' renderer and the float64 evaluator
read like any spec expression. sympy is imported on use.
"""

from __future__ import annotations

import operator
from typing import Any

from attngen.spec.expressions import Expr, ExprError, Tensor, make

_FIELD = "score_mod gradient"
MAX_SIMPLIFY_OPS = 64


def gradients(node: Expr, tensors: tuple[Tensor, ...]) -> dict[str, Expr]:
    """d(node)/d(score) under "score", and for each read of a trainable tensor the expression
    that multiplies dS at that read, under its normalized text (`bias[h, (q_idx - kv_idx)]`)."""
    import sympy

    trainable = {t.name for t in tensors if t.trainable}
    converter = _ToSympy(trainable)
    expr = converter.convert(node)
    wanted = {"score": converter.score, **converter.reads}
    out = {}
    for name, symbol in wanted.items():
        derivative = sympy.diff(expr, symbol)
        out[name] = _back(derivative, converter, sympy)
    return out


def _depends(node: Expr, trainable: set[str]) -> bool:
    if node.op == "var" and node.value == "score":
        return True
    if node.op == "load" and node.value in trainable:
        return True
    return any(_depends(a, trainable) for a in node.args)


class _ToSympy:
    def __init__(self, trainable: set[str]):
        import sympy

        self.sympy, self.trainable = sympy, trainable
        self.score = sympy.Symbol("score", real=True)
        self.reads: dict[str, Any] = {}  # a trainable read's text -> its symbol
        self.opaque: dict[Any, Expr] = {self.score: Expr("var", (), "score", "float")}

    def symbol(self, node: Expr) -> Any:
        for symbol, known in self.opaque.items():
            if known == node:
                return symbol
        name = f"c{len(self.opaque) - 1}"
        kind = {"bool": {}, "int": {"integer": True}, "float": {"real": True}}[node.type]
        symbol = self.sympy.Symbol(name, **kind)
        self.opaque[symbol] = node
        return symbol

    def convert(self, node: Expr) -> Any:
        sp = self.sympy
        if node.op == "load" and node.value in self.trainable:
            key = str(node)
            if key not in self.reads:
                self.reads[key] = sp.Symbol(f"r{len(self.reads)}", real=True)
                self.opaque[self.reads[key]] = node
            return self.reads[key]
        if not _depends(node, self.trainable):
            if node.op == "num" and node.type != "bool":
                return (sp.Integer if node.type == "int" else sp.Float)(node.value)
            return self.symbol(node)
        if node.op == "var":
            return self.score
        a = [self.convert(x) for x in node.args]
        return self.combine(node.op, a)

    def combine(self, op: str, a: list[Any]) -> Any:
        sp = self.sympy
        if op in ("add", "sub", "mul", "neg"):
            return getattr(operator, op)(*a)
        if op == "div":
            return a[0] / a[1]
        if op in ("exp", "log", "tanh", "sqrt"):
            return getattr(sp, op)(*a)
        if op in ("lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not"):
            return getattr(sp, op.capitalize())(*a)  # sp.Lt, ..., sp.And, sp.Not
        if op == "where":
            return sp.Piecewise((a[1], a[0]), (a[2], True))
        if op == "abs":
            return sp.Piecewise((a[0], a[0] >= 0), (-a[0], True))
        keep_first = {"min": lambda: a[0] <= a[1], "max": lambda: a[0] >= a[1]}[op]()
        return sp.Piecewise((a[0], keep_first), (a[1], True))


def _back(derivative: Any, converter: _ToSympy, sp: Any) -> Expr:
    """The simplest of the derivative and its simplification that converts back."""
    candidates = [derivative]
    if sp.count_ops(derivative) <= MAX_SIMPLIFY_OPS:  # simplify's time grows fast with size
        try:
            candidates.insert(0, sp.simplify(derivative))
        except (TypeError, ValueError, NotImplementedError):
            pass
    candidates.sort(key=sp.count_ops)
    for candidate in candidates:
        try:
            node = _from_sympy(candidate, converter.opaque, sp)
        except ExprError:
            continue
        if node.type == "int":
            node = make(_FIELD, "mul", (Expr("num", (), 1.0, "float"), node))
        return node
    raise ExprError(f"{_FIELD}: sympy's {derivative} has no form in the expression language")


def _num(value: float) -> Expr:
    return Expr("num", (), float(value), "float")


def _from_sympy(e: Any, opaque: dict[Any, Expr], sp: Any) -> Expr:
    back = lambda x: _from_sympy(x, opaque, sp)  # noqa: E731
    if e in opaque:
        return opaque[e]
    if e is sp.true or e is sp.false:
        return Expr("num", (), bool(e), "bool")
    if e.is_Number:
        return _num(float(e))
    if isinstance(e, sp.Mul) and e.args[0] == -1:
        return make(_FIELD, "neg", (back(sp.Mul(*e.args[1:])),))
    if isinstance(e, sp.Add | sp.Mul):
        op = "add" if isinstance(e, sp.Add) else "mul"
        out = back(e.args[0])
        for arg in e.args[1:]:
            negative = op == "add" and arg.could_extract_minus_sign()
            term = back(-arg if negative else arg)
            out = make(_FIELD, "sub" if negative else op, (out, term))
        return out
    if isinstance(e, sp.Pow):
        return _power(back(e.base), e.exp, back)
    functions = {sp.exp: "exp", sp.log: "log", sp.tanh: "tanh", sp.Abs: "abs"}
    if e.func in functions:
        return make(_FIELD, functions[e.func], (back(e.args[0]),))
    if isinstance(e, sp.Piecewise):
        (value, cond), rest = e.args[0], e.args[1:]
        if cond is sp.true or not rest:
            return back(value)
        return make(_FIELD, "where", (back(cond), back(value), back(sp.Piecewise(*rest))))
    relations = {sp.StrictLessThan: "lt", sp.LessThan: "le", sp.StrictGreaterThan: "gt"}
    relations |= {sp.GreaterThan: "ge", sp.Equality: "eq", sp.Unequality: "ne"}
    relations |= {sp.And: "and", sp.Or: "or"}
    if e.func in relations:
        out = back(e.args[0])
        for arg in e.args[1:]:
            out = make(_FIELD, relations[e.func], (out, back(arg)))
        return out
    if isinstance(e, sp.Not):
        return make(_FIELD, "not", (back(e.args[0]),))
    raise ExprError(f"{_FIELD}: {e.func.__name__} is not in the expression language")


def _power(base: Expr, exponent: Any, back: Any) -> Expr:
    if exponent.is_Integer and 0 < abs(int(exponent)) <= 8:
        out = base
        for _ in range(abs(int(exponent)) - 1):
            out = make(_FIELD, "mul", (out, base))
        return out if exponent > 0 else make(_FIELD, "div", (_num(1.0), out))
    if exponent.is_Rational and abs(exponent.q) == 2 and abs(exponent.p) == 1:
        root = make(_FIELD, "sqrt", (base,))
        return root if exponent > 0 else make(_FIELD, "div", (_num(1.0), root))
    log = make(_FIELD, "log", (base,))
    return make(_FIELD, "exp", (make(_FIELD, "mul", (back(exponent), log)),))
