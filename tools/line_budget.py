"""The line budget: attngen/ within its total, every function within FUNCTION_LINES.

tinygrad keeps its library under a line budget that CI checks (sz.py); attngen does the same:

- attngen/ (its modules, *.py, and templates, attngen/templates/*.jinja) at most TOTAL_LINES
  lines in all: the size it had when the total replaced per-file caps, so code that grows
  pays for itself by removing as much elsewhere. Lines are physical lines, as `wc -l` counts
  them; package data (attngen/verify/data/*.json) is not code and is not counted, and
  generated/ and tests/golden/ (the templates' output) are outside attngen/.
- a function or method, in attngen/ and tools/, at most FUNCTION_LINES lines from its `def`
  (signature included) to its last line, with no exceptions.

When code is removed for good, lower TOTAL_LINES to the new total (`--all` prints it).

    python tools/line_budget.py           # violations, the total and the largest files; exit 1
    python tools/line_budget.py --all     # every counted file
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOTAL_LINES = 26647
FUNCTION_LINES = 60
PACKAGE = "attngen"
FUNCTION_DIRS = ("attngen", "tools")
COUNTED = ("*.py", "*.jinja")


@dataclass(frozen=True)
class Measured:
    name: str  # a path, or "path::qualified.function"
    lines: int


def _functions(path: Path, relative: str) -> list[Measured]:
    found: list[Measured] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lines = (child.end_lineno or child.lineno) - child.lineno + 1
                    found.append(Measured(f"{relative}::{name}", lines))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), "")
    return found


def package_files(root: Path = ROOT) -> list[Measured]:
    """Every counted file of attngen/ with its lines."""
    paths = sorted({p for pattern in COUNTED for p in (root / PACKAGE).rglob(pattern)})
    return [
        Measured(p.relative_to(root).as_posix(), len(p.read_text(encoding="utf-8").splitlines()))
        for p in paths
    ]


def functions(root: Path = ROOT) -> list[Measured]:
    """Every function and method of attngen/ and tools/ with its lines."""
    found: list[Measured] = []
    for folder in FUNCTION_DIRS:
        for path in sorted((root / folder).rglob("*.py")):
            found += _functions(path, path.relative_to(root).as_posix())
    return found


def violations(
    files: list[Measured], measured_functions: list[Measured], total_budget: int = TOTAL_LINES
) -> list[str]:
    """Each line says what is over budget and what to do."""
    total = sum(m.lines for m in files)
    found = []
    if total > total_budget:
        found.append(
            f"{PACKAGE}/: {total} lines, budget {total_budget} ({total - total_budget} over); "
            "remove as many lines as the change adds"
        )
    found += [
        f"{m.name}: {m.lines} lines, budget {FUNCTION_LINES}; split it"
        for m in measured_functions
        if m.lines > FUNCTION_LINES
    ]
    return found


def main(argv: list[str] | None = None, root: Path = ROOT, total_budget: int = TOTAL_LINES) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="print every counted file")
    args = parser.parse_args(argv)
    files = package_files(root)
    largest = sorted(files, key=lambda m: -m.lines)
    for m in largest if args.all else largest[:8]:
        print(f"{m.lines:6d}  {m.name}")
    total = sum(m.lines for m in files)
    print(
        f"{PACKAGE}/: {total} lines in {len(files)} files, budget {total_budget} "
        f"({total_budget - total} left); functions at most {FUNCTION_LINES} lines"
    )
    problems = violations(files, functions(root), total_budget)
    for problem in problems:
        print(f"OVER BUDGET: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
