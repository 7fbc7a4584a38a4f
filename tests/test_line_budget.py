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


def test_over_budget_files_functions_and_stale_exceptions_fail(tmp_path: Path) -> None:
    tool = _tool()
    (tmp_path / "attngen" / "templates").mkdir(parents=True)
    (tmp_path / "tools").mkdir()
    body = "\n".join(f"        x{i} = {i}" for i in range(tool.FUNCTION_LINES))
    (tmp_path / "attngen" / "long.py").write_text(
        "class Holder:\n    def method(self):\n" + body + "\n" + "# filler\n" * tool.MODULE_LINES,
        encoding="utf-8",
    )
    (tmp_path / "attngen" / "fine.py").write_text("def f():\n    return 1\n", encoding="utf-8")
    (tmp_path / "attngen" / "templates" / "big.py.jinja").write_text(
        "{# line #}\n" * (tool.TEMPLATE_LINES + 1), encoding="utf-8"
    )
    excepted = {"attngen/templates/big.py.jinja": "a reason", "attngen/fine.py": "no longer needed"}
    problems = tool.violations(tool.measure(tmp_path), excepted)
    assert len(problems) == 3
    assert problems[0].startswith(f"attngen/long.py: {tool.MODULE_LINES + 2 + tool.FUNCTION_LINES}")
    assert problems[1].startswith(f"attngen/long.py::Holder.method: {tool.FUNCTION_LINES + 1} ")
    assert problems[2].startswith("attngen/fine.py: listed in EXCEPTIONS (no longer needed)")
    assert tool.main([], root=tmp_path, exceptions=excepted) == 1
    within = {"attngen/templates/big.py.jinja": "a reason"}
    (tmp_path / "attngen" / "long.py").write_text("x = 1\n", encoding="utf-8")
    assert tool.violations(tool.measure(tmp_path), within) == []
