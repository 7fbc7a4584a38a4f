"""The line budget (tools/line_budget.py) holds, and it catches what it is meant to catch."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location("line_budget", ROOT / "tools" / "line_budget.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_the_repository_is_within_its_line_budget(capsys: pytest.CaptureFixture[str]) -> None:
    assert _tool().main([]) == 0, capsys.readouterr().out


def test_the_total_counts_modules_and_templates_only(tmp_path: Path) -> None:
    tool = _tool()
    tool.OVER_FUNCTION_LINES = {}  # the temporary tree has none of the listed functions
    (tmp_path / "attngen" / "templates").mkdir(parents=True)
    (tmp_path / "attngen" / "verify" / "data").mkdir(parents=True)
    (tmp_path / "tools").mkdir()
    (tmp_path / "attngen" / "a.py").write_text("x = 1\n" * 7, encoding="utf-8")
    (tmp_path / "attngen" / "templates" / "t.py.jinja").write_text("{# t #}\n" * 5, "utf-8")
    (tmp_path / "attngen" / "verify" / "data" / "d.json").write_text("{}\n" * 100, "utf-8")
    (tmp_path / "tools" / "big.py").write_text("y = 2\n" * 1000, encoding="utf-8")
    files = tool.package_files(tmp_path)
    assert {m.name: m.lines for m in files} == {
        "attngen/a.py": 7,
        "attngen/templates/t.py.jinja": 5,
    }
    assert tool.violations(files, [], total_budget=12) == []
    over = tool.violations(files, [], total_budget=11)
    assert over == [
        "attngen/: 12 lines, budget 11 (1 over); remove as many lines as the change adds"
    ]
    assert tool.main([], root=tmp_path, total_budget=12) == 0
    assert tool.main([], root=tmp_path, total_budget=11) == 1


def test_long_functions_fail_in_the_package_and_in_tools(tmp_path: Path) -> None:
    tool = _tool()
    tool.OVER_FUNCTION_LINES = {}  # the temporary tree has none of the listed functions
    (tmp_path / "attngen").mkdir()
    (tmp_path / "tools").mkdir()
    body = "\n".join(f"        x{i} = {i}" for i in range(tool.FUNCTION_LINES))
    (tmp_path / "attngen" / "long.py").write_text(
        "class Holder:\n    def method(self):\n" + body + "\n", encoding="utf-8"
    )
    fits = "\n".join(f"    x{i} = {i}" for i in range(tool.FUNCTION_LINES - 1))
    (tmp_path / "tools" / "t.py").write_text(
        "def fits():\n" + fits + "\n\n\ndef over():\n" + fits + "\n    y = 1\n", encoding="utf-8"
    )
    problems = tool.violations([], tool.functions(tmp_path), total_budget=0)
    assert problems == [
        f"attngen/long.py::Holder.method: {tool.FUNCTION_LINES + 1} lines, budget "
        f"{tool.FUNCTION_LINES}; split it",
        f"tools/t.py::over: {tool.FUNCTION_LINES + 1} lines, budget {tool.FUNCTION_LINES}; "
        "split it",
    ]
    assert tool.main([], root=tmp_path, total_budget=10_000) == 1
