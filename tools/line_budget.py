"""The line budget: modules, templates and functions that outgrow their size fail the check.

tinygrad keeps its library under a line budget that CI checks (sz.py); attngen does the same
for its own code, attngen/ and tools/ (tests are tables of cases, and generated/ and
attngen/templates_compiled/ are the templates' output, so none of them is counted):

- a module (*.py) at most MODULE_LINES lines;
- a template (attngen/templates/*.jinja) at most TEMPLATE_LINES lines;
- a function or method at most FUNCTION_LINES lines, from its `def` to its last line.

Lines are physical lines, as `wc -l` counts them. Anything over budget is a violation unless
EXCEPTIONS names it with its reason; an exception that is no longer needed (the file shrank,
or is gone) is a violation too, so the table only ever lists real exceptions.

    python tools/line_budget.py           # violations, and the largest files; exit 1 on any
    python tools/line_budget.py --all     # every counted file
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULE_LINES = 450
TEMPLATE_LINES = 300
FUNCTION_LINES = 60
CODE_DIRS = ("attngen", "tools")
TEMPLATE_DIR = "attngen/templates"
# Jinja's output for the templates (attngen/template_env.py), written by a tool like generated/.
GENERATED_DIRS = ("attngen/templates_compiled",)

# Why the functions below exceed the budget: the public drop-in functions (the signature that
# flash-attn or torch fixes, and the planned fast path of plans.py inline), and the launchers.
_FAST_PATH_INLINE = (
    "the drop-in signature (a parameter a line, formatted) and the planned fast path stay "
    "inline: a helper call would add host time to every planned call "
    "(tools/host_overhead_cpu.py); the full path's steps are helpers"
)
_OPTIONS_BY_KEYWORD = (
    "the mask options go by keyword into the Need, the fallback and the op, a line each "
    "once formatted; a helper would take the same list (an options value carried through "
    "dispatch and the fallback would shorten it)"
)
# The one place an exception is named: a path (or "path::function") relative to the repository
# root, and why it may exceed its budget for now.
EXCEPTIONS: dict[str, str] = {
    "attngen/runtime/api.py::scaled_dot_product_attention": _FAST_PATH_INLINE,
    "attngen/runtime/api.py::flash_attn_func": _FAST_PATH_INLINE,
    "attngen/runtime/api.py::flash_attn_varlen_func": _FAST_PATH_INLINE,
    "attngen/runtime/kvcache.py::flash_attn_with_kvcache": _FAST_PATH_INLINE,
    "attngen/runtime/launch.py::run_dense": _OPTIONS_BY_KEYWORD,
    "attngen/runtime/launch.py::run_varlen": _OPTIONS_BY_KEYWORD,
}


@dataclass(frozen=True)
class Measured:
    name: str  # a path, or "path::qualified.function"
    lines: int
    budget: int


def _functions(path: Path, relative: str) -> list[Measured]:
    found: list[Measured] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lines = (child.end_lineno or child.lineno) - child.lineno + 1
                    found.append(Measured(f"{relative}::{name}", lines, FUNCTION_LINES))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), "")
    return found


def measure(root: Path = ROOT) -> list[Measured]:
    """Every counted file and function with its size and budget."""
    measured: list[Measured] = []
    for folder in CODE_DIRS:
        for path in sorted((root / folder).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            if relative.startswith(tuple(f"{g}/" for g in GENERATED_DIRS)):
                continue
            lines = len(path.read_text(encoding="utf-8").splitlines())
            measured.append(Measured(relative, lines, MODULE_LINES))
            measured += _functions(path, relative)
    for path in sorted((root / TEMPLATE_DIR).glob("*.jinja")):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        measured.append(Measured(path.relative_to(root).as_posix(), lines, TEMPLATE_LINES))
    return measured


def violations(measured: list[Measured], exceptions: dict[str, str]) -> list[str]:
    """Each line says what is over budget (or which exception is stale) and what to do."""
    over = {m.name: m for m in measured if m.lines > m.budget}
    found = [
        f"{m.name}: {m.lines} lines, budget {m.budget}; split it, or name it in "
        "EXCEPTIONS with the reason"
        for name, m in over.items()
        if name not in exceptions
    ]
    found += [
        f"{name}: listed in EXCEPTIONS ({reason}) but within budget or gone; remove it "
        "from EXCEPTIONS"
        for name, reason in exceptions.items()
        if name not in over
    ]
    return found


def main(
    argv: list[str] | None = None, root: Path = ROOT, exceptions: dict[str, str] | None = None
) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="print every counted file")
    args = parser.parse_args(argv)
    allowed = EXCEPTIONS if exceptions is None else exceptions
    measured = measure(root)
    files = sorted((m for m in measured if "::" not in m.name), key=lambda m: -m.lines)
    for m in files if args.all else files[:8]:
        print(f"{m.lines:6d} / {m.budget:3d}  {m.name}")
    total = sum(m.lines for m in files if m.name.startswith("attngen/"))
    print(
        f"attngen/: {total} lines in {sum(m.name.startswith('attngen/') for m in files)} "
        f"files; budgets: module {MODULE_LINES}, template {TEMPLATE_LINES}, function "
        f"{FUNCTION_LINES}"
    )
    for name, reason in allowed.items():
        print(f"exception: {name} ({reason})")
    problems = violations(measured, allowed)
    for problem in problems:
        print(f"OVER BUDGET: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
