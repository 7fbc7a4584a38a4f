"""The kernels of the generated modules: their share of the lines, and whether their source
changed against a git revision.

    python tools/kernel_lines.py                 # kernel-line fraction of every module
    python tools/kernel_lines.py --against REF   # and whether each @triton.jit / @gluon.jit
                                                 # function's source equals REF's

The shared host code at a module's end (attngen/host, copied verbatim from its first
`# -- host code:` line on) is counted apart: "own" is the fraction of the rest.

A kernel is a top-level function decorated with `triton.jit` or `gluon.jit` (called or not);
its lines run from its first decorator to its last line. The check compares each module's
kernels, by name and in order, with the same module's at REF (`git show REF:path`); a module
REF lacks is reported as new. Exit status 1 when a kernel differs.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JIT_DECORATORS = ("triton.jit", "gluon.jit")


def _is_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return ast.unparse(target) in JIT_DECORATORS


def kernels(source: str) -> dict[str, str]:
    """name -> source text (decorators included) of each top-level JIT function, in order."""
    lines = source.splitlines(keepends=True)
    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and any(map(_is_jit, node.decorator_list)):
            first = min(d.lineno for d in node.decorator_list)
            found[node.name] = "".join(lines[first - 1 : node.end_lineno])
    return found


def kernel_fraction(source: str) -> tuple[int, int]:
    """(lines inside JIT functions, all lines) of a module."""
    inside = sum(text.count("\n") for text in kernels(source).values())
    return inside, source.count("\n")


def own_lines(source: str) -> int:
    """The lines before the shared host code (attngen/host's parts) at the module's end."""
    at = source.find("\n# -- host code:")
    return source.count("\n") if at < 0 else source[: at + 1].count("\n")


def modules(root: Path = ROOT) -> list[Path]:
    return sorted((root / "generated").glob("*/*.py"))


def _at(ref: str, path: Path) -> str | None:
    relative = path.relative_to(ROOT).as_posix()
    done = subprocess.run(
        ["git", "show", f"{ref}:{relative}"], cwd=ROOT, capture_output=True, text=True
    )
    return done.stdout if done.returncode == 0 else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", help="a git revision whose kernels must be equal")
    args = parser.parse_args(argv)
    total_in = total = total_own = 0
    differing = []
    for path in modules():
        source = path.read_text()
        inside, lines = kernel_fraction(source)
        own = own_lines(source)
        total_in, total, total_own = total_in + inside, total + lines, total_own + own
        print(
            f"{inside / lines:6.1%} {inside:5d}/{lines:5d} (own {inside / own:6.1%} of {own:5d})"
            f"  {path.relative_to(ROOT)}"
        )
        if args.against:
            before = _at(args.against, path)
            if before is None:
                print(f"        new at {args.against}: no kernels to compare")
            elif list(kernels(before).items()) != list(kernels(source).items()):
                differing.append(path.relative_to(ROOT))
    print(
        f"all modules: {total_in / total:.1%} of {total} lines are kernels; "
        f"{total_in / total_own:.1%} of the {total_own} lines before the shared host code"
    )
    if args.against:
        for path in differing:
            print(f"kernels differ from {args.against}: {path}")
        print(f"kernels byte-identical to {args.against}: {not differing}")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
