"""Evaluating the tiling model quickly: its sympy expressions compiled once, read many times.

The model (prefill_model.py) is a few symbolic expressions. Substituting a spec's dims into them and
letting sympy simplify the result takes 50-200 ms per spec, too slow for a kernel built on
demand at a model's first call. Here each expression is compiled once per process into a
plain Python function of every symbol (`compiled`), so a derivation evaluates its candidates
in about a millisecond; what needs sympy's text (the formula in force for the chosen config,
the substituted expressions `attngen explain` prints) is worked out once per distinct case
(`active_formula`) or only when read (`LazyText`). tests/test_tiling_fast.py holds the
compiled functions to the exact sympy values on every padded head dim, dtype and arch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from functools import cache
from typing import Any

import sympy


@cache
def compiled(expr: sympy.Expr, symbols: tuple[sympy.Symbol, ...]) -> Callable[..., Any]:
    """`expr` as a Python function of `symbols`, in floats (the math module)."""
    function: Callable[..., Any] = sympy.lambdify(symbols, expr, modules="math")
    return function


def exact_value(expr: sympy.Expr, values: dict[sympy.Symbol, int]) -> sympy.Expr:
    """`expr` with every symbol replaced by an integer: an exact sympy number (xreplace skips
    the pattern matching of subs, so this takes a fraction of a millisecond)."""
    value: sympy.Expr = expr.xreplace({s: sympy.Integer(v) for s, v in values.items()})
    return value


def _piecewise_nodes(expr: sympy.Expr) -> tuple[sympy.Piecewise, ...]:
    return tuple(
        node for node in sympy.preorder_traversal(expr) if isinstance(node, sympy.Piecewise)
    )


@cache
def _conditions(
    expr: sympy.Expr, symbols: tuple[sympy.Symbol, ...]
) -> tuple[tuple[Callable[..., Any], ...], ...]:
    """Per Piecewise node of `expr`, its arms' conditions as functions of `symbols`."""
    return tuple(
        tuple(sympy.lambdify(symbols, cond, modules="math") for _, cond in node.args)
        for node in _piecewise_nodes(expr)
    )


_formulas: dict[tuple[sympy.Expr, tuple[int, ...]], str] = {}


def active_formula(expr: sympy.Expr, values: dict[sympy.Symbol, int]) -> str:
    """str(active_branch(expr, values)): the formula in force at `values`, every Piecewise
    replaced by its first arm whose condition holds. The text depends only on which arm each
    Piecewise takes, so it is built once per such choice and then looked up."""
    symbols = tuple(values)
    arguments = tuple(values.values())
    choice = tuple(
        next(i for i, cond in enumerate(node) if bool(cond(*arguments)))
        for node in _conditions(expr, symbols)
    )
    key = (expr, choice)
    text = _formulas.get(key)
    if text is None:
        text = _formulas[key] = str(active_branch(expr, values))
    return text


def active_branch(expr: sympy.Expr, values: dict[sympy.Symbol, int]) -> sympy.Expr:
    """The formula in force at `values`: every Piecewise replaced by its arm whose condition
    holds there (the header shows this, not the whole case analysis)."""

    def pick(piecewise: sympy.Piecewise) -> sympy.Expr:
        return next(arm for arm, cond in piecewise.args if bool(exact_value(cond, values)))

    return expr.replace(lambda e: isinstance(e, sympy.Piecewise), pick)


class LazyText(Mapping[str, str]):
    """A mapping of texts made by `build` when first read (then kept)."""

    def __init__(self, build: Callable[[], dict[str, str]]):
        self._build: Callable[[], dict[str, str]] | None = build
        self._texts: dict[str, str] = {}

    def _loaded(self) -> dict[str, str]:
        if self._build is not None:
            self._texts, self._build = self._build(), None
        return self._texts

    def __getitem__(self, key: str) -> str:
        return self._loaded()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaded())

    def __len__(self) -> int:
        return len(self._loaded())
