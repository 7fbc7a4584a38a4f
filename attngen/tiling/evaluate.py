"""Evaluating the tiling model quickly: its sympy expressions compiled ahead, read many times.

The model (prefill_model.py, backward_model.py, gluon_model.py) is a few symbolic
expressions. Building them and compiling them with sympy costs a process 120-300 ms (sympy's
import 180 ms of it), too slow for a kernel built on demand at a model's first call. So each
expression is named by the call that builds it (`Model`) and what a derivation needs of it
comes from the store, model_store.json: the expression compiled into a plain Python function
of the symbols (`compiled`), the formula in force at a config (`active_formula`) and its
text (`formula_text`), written from sympy by tools/model_store.py and held to sympy's values
and texts by tests/test_model_store.py. A model the store lacks is built with sympy
(symbolic.py) once per process, with the same results; `attngen explain`'s substituted
expressions (`substituted`) always are.
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, cast

STORE = Path(__file__).with_name("model_store.json")
misses: set[str] = set()  # what a derivation asked the store for and did not find (tests read it)


@dataclass(frozen=True)
class Model:
    """A model expression: `builder` (module.function under attngen.tiling) called with `args`."""

    builder: str
    args: tuple[Any, ...] = ()

    @property
    def key(self) -> str:
        # Archs by name: the store is JSON, and an arch's name is its identity in ARCHS.
        return f"{self.builder}({', '.join(getattr(a, 'name', repr(a)) for a in self.args)})"

    def expr(self) -> Any:
        """The sympy expression (imports sympy and the model's module)."""
        module, function = self.builder.rsplit(".", 1)
        return getattr(importlib.import_module(f"attngen.tiling.{module}"), function)(*self.args)


@cache
def _store() -> dict[str, Any]:
    return cast(dict[str, Any], json.loads(STORE.read_text())["models"] if STORE.exists() else {})


def _stored(model: Model, part: str, name: str | None, build: Callable[[Any, Any], Any]) -> Any:
    """The store's `part` of `model` (its `name` entry), else build(symbolic, the expression):
    the same result from sympy, the miss recorded."""
    found = _store().get(model.key, {}).get(part)
    found = found.get(name) if name is not None and found is not None else found
    if found is None:
        from attngen.tiling import symbolic

        misses.add(f"{model.key} {part} {name or ''}".strip())
        found = build(symbolic, model.expr())
    return found


def function_from(source: str) -> Callable[..., Any]:
    """The function a lambdified source defines (the store's functions and conditions)."""
    namespace: dict[str, Any] = dict(vars(math))  # lambdify's "math" module: ceil, floor, ...
    exec(source, namespace)  # noqa: S102 - the store's text, written by tools/model_store.py
    return cast(Callable[..., Any], namespace["_lambdifygenerated"])


@cache
def compiled(model: Model, symbols: tuple[str, ...]) -> Callable[..., Any]:
    """`model` as a Python function of the symbols named `symbols`, in floats (math module)."""
    build = lambda symbolic, expr: symbolic.function_source(expr, symbols)  # noqa: E731
    return function_from(_stored(model, "functions", ",".join(symbols), build))


@cache
def formula_text(model: Model) -> str:
    """str() of the expression."""
    return str(_stored(model, "text", None, lambda symbolic, expr: str(expr)))


@cache
def _conditions(model: Model, symbols: tuple[str, ...]) -> tuple[Any, ...]:
    """Per Piecewise node of `model`, its arms' conditions as functions of `symbols`."""
    build = lambda symbolic, expr: symbolic.condition_sources(expr, symbols)  # noqa: E731
    sources = _stored(model, "conditions", ",".join(symbols), build)
    return tuple(tuple(function_from(source) for source in node) for node in sources)


def arm_choice(conditions: Any, arguments: tuple[int, ...]) -> str:
    """The store's key of a worked formula: per Piecewise node, its first arm that holds."""
    return ",".join(str(next(i for i, c in enumerate(n) if c(*arguments))) for n in conditions)


def active_formula(model: Model, values: dict[str, int]) -> str:
    """The formula in force at `values` (symbol name -> integer), every Piecewise replaced by
    its first arm whose condition holds: what the module header shows. The text depends only
    on which arm each Piecewise takes, so the store keeps one text per such choice."""
    choice = arm_choice(_conditions(model, tuple(values)), tuple(values.values()))
    build = lambda symbolic, expr: symbolic.active_text(expr, values)  # noqa: E731
    return str(_stored(model, "formulas", choice, build))


def substituted(model: Model, values: Mapping[str, int]) -> str:
    """The expression with some symbols replaced by integers, simplified (sympy; explain)."""
    from attngen.tiling import symbolic

    return symbolic.substituted_text(model.expr(), values)


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
