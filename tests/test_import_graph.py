"""attngen's import graph has no circle and no arrow from a lower stage to a higher one.

The graph is read from the source (ast over attngen/**/*.py), with every import a module runs:
module-level imports and function-local ones alike (a function-local import that closes a
circle is the circle, postponed). Imports under `if TYPE_CHECKING:` never run and are left out.

The stages, lowest first: the spec and what it is validated against (arch: the GPU targets as
data, which the spec's `targets` check reads, so it sits beside the spec rather than above
it), tiling, render, build, runtime; then the tools over all of them (cli, explain, verify,
tuning, the package's facade). A module may import its own stage or a lower one only.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "attngen"

# The lowest stage first; a module's stage is the first prefix below that names it.
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "spec",
        (
            "attngen.arch",
            "attngen.spec",  # the spec language, its expressions, masks, names and files
            "attngen.reference",
        ),
    ),
    ("tiling", ("attngen.tiling", "attngen.tuning.database")),
    # attngen.host: the modules' shared host code, which render copies into them as text
    ("render", ("attngen.render", "attngen.host")),
    ("build", ("attngen.build",)),
    ("runtime", ("attngen.runtime", "attngen.distributed")),
    (
        "tools",
        (
            "attngen.tuning",
            "attngen.verify",
            "attngen.cli",
            "attngen.__main__",
            "attngen",
        ),
    ),
)


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if "templates_compiled" in parts:
            continue
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _type_checking_only(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        if _type_checking_only(node):
            stack.extend(node.orelse)  # type: ignore[attr-defined]
            continue
        stack.extend(ast.iter_child_nodes(node))
    return found


def import_graph() -> dict[str, set[str]]:
    """Each attngen module and the attngen modules it imports (its package's __init__ aside:
    importing attngen.x.y runs attngen/x/__init__.py, which is x's own edge, not y's)."""
    modules = _modules()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str | None] = set()
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets |= {owner(a.name) for a in node.names if a.name.startswith("attngen")}
                continue
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            if base == "attngen" or base.startswith("attngen."):
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in modules else owner(base))
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def stage_of(module: str) -> int:
    for rank, (_, prefixes) in enumerate(STAGES):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    raise AssertionError(f"{module}: in no stage of STAGES; add it to the stage it belongs to")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), or a self-loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_attngen_imports_have_no_circle() -> None:
    graph = import_graph()
    assert "attngen.runtime.registry" in graph and "attngen.spec" in graph
    found = cycles(graph)
    assert found == [], "import circles (each a set of modules that reach one another):\n" + (
        "\n".join(" <-> ".join(c) for c in found)
    )


def test_no_module_imports_a_higher_stage() -> None:
    graph = import_graph()
    upward = [
        f"{a} ({STAGES[stage_of(a)][0]}) imports {b} ({STAGES[stage_of(b)][0]})"
        for a, targets in sorted(graph.items())
        for b in sorted(targets)
        if stage_of(b) > stage_of(a)
    ]
    assert upward == [], "\n".join(upward)


def test_the_registry_imports_none_of_the_modules_that_use_it() -> None:
    used_by = {"selection", "dispatch", "plans", "launch"}
    imported = import_graph()["attngen.runtime.registry"]
    assert not {f"attngen.runtime.{m}" for m in used_by} & imported, imported


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import attngen.spec\n", {"attngen.spec"}),
        ("def f():\n    from attngen.runtime import registry\n", {"attngen.runtime.registry"}),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import attngen.spec\n", set()),
        ("from . import masks\n", {"attngen.masks"}),
    ],
)
def test_the_graph_reads_every_import_that_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, expected: set[str]
) -> None:
    """Module-level, function-local and relative imports count; TYPE_CHECKING ones do not."""
    package = tmp_path / "attngen"
    (package / "runtime").mkdir(parents=True)
    for name in ("__init__.py", "spec.py", "masks.py", "runtime/__init__.py"):
        (package / name).write_text("", encoding="utf-8")
    (package / "runtime" / "registry.py").write_text("", encoding="utf-8")
    (package / "probe.py").write_text(source, encoding="utf-8")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    monkeypatch.setattr(f"{__name__}.PACKAGE", package)
    assert import_graph()["attngen.probe"] == expected
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_the_package_has_few_rooms() -> None:
    """attngen/ at most 15 top-level modules and packages (one per stage and its helpers),
    attngen/runtime/ at most 16 files: a newcomer finds a stage by its folder."""
    top = [p.name for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()]
    top += [p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name == "templates"]
    assert len(top) <= 15, sorted(top)
    assert len(list((PACKAGE / "runtime").glob("*.py"))) <= 16
