"""The sympy half of evaluate.py: what the store holds, worked out from an expression.

tools/model_store.py writes the store with these functions; evaluate.py calls them for a
model the store lacks; tests/test_model_store.py compares the two.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import sympy


def _symbols(expr: sympy.Expr, names: tuple[str, ...] | Mapping[str, int]) -> list[sympy.Symbol]:
    """The symbols named `names`: the expression's own, or (absent from it) a fresh one."""
    own = {s.name: s for s in expr.free_symbols}
    return [own.get(name, sympy.Symbol(name, positive=True, integer=True)) for name in names]


def function_source(expr: sympy.Expr, names: tuple[str, ...]) -> str:
    """The source of `expr` lambdified (math module) as a function of the symbols `names`."""
    return inspect.getsource(sympy.lambdify(_symbols(expr, names), expr, modules="math"))


def piecewise_nodes(expr: sympy.Expr) -> tuple[sympy.Piecewise, ...]:
    return tuple(
        node
        for node in sympy.preorder_traversal(expr, keys=True)
        if isinstance(node, sympy.Piecewise)
    )


def condition_sources(expr: sympy.Expr, names: tuple[str, ...]) -> list[list[str]]:
    """Per Piecewise node of `expr` (preorder), its arms' conditions' function sources."""
    return [
        [function_source(cond, names) for _, cond in node.args] for node in piecewise_nodes(expr)
    ]


def exact_value(expr: sympy.Expr, values: Mapping[sympy.Symbol, int]) -> Any:
    """`expr` with every symbol replaced by an integer: an exact sympy number (xreplace skips
    the pattern matching of subs, so this takes a fraction of a millisecond)."""
    return expr.xreplace({s: sympy.Integer(v) for s, v in values.items()})


def active_branch(expr: sympy.Expr, values: Mapping[sympy.Symbol, int]) -> sympy.Expr:
    """The formula in force at `values`: every Piecewise replaced by its arm whose condition
    holds there (the header shows this, not the whole case analysis)."""

    def pick(piecewise: sympy.Piecewise) -> sympy.Expr:
        return next(arm for arm, cond in piecewise.args if bool(exact_value(cond, values)))

    return expr.replace(lambda e: isinstance(e, sympy.Piecewise), pick)


def by_symbol(expr: sympy.Expr, values: Mapping[str, int]) -> dict[sympy.Symbol, int]:
    return dict(zip(_symbols(expr, values), values.values(), strict=True))


def active_text(expr: sympy.Expr, values: Mapping[str, int]) -> str:
    return str(active_branch(expr, by_symbol(expr, values)))


def substituted_text(expr: sympy.Expr, values: Mapping[str, int]) -> str:
    return str(expr.subs(by_symbol(expr, values)))
