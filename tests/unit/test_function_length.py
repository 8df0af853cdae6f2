"""No function over 60 lines in gateway/, servicekit/ or agentgw/: a function that long does several jobs.

Exceptions are listed here with the reason; the list is empty, and should stay so.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway", "servicekit", "agentgw")
MAX_LINES = 60
#: "path:function" -> why it may be longer. Empty.
EXCEPTIONS: dict[str, str] = {}


def _long_functions(root: Path = ROOT) -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    where = f"{path.relative_to(root)}:{node.name}"
                    if lines > MAX_LINES and where not in EXCEPTIONS:
                        found.append(f"{where} has {lines} lines")
    return found


def test_no_function_is_over_sixty_lines():
    assert _long_functions() == []


def test_the_check_counts_a_long_function(tmp_path):
    (tmp_path / "gateway").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    (tmp_path / "gateway" / "long.py").write_text(f"def long():\n{body}\n")
    assert _long_functions(tmp_path) == ["gateway/long.py:long has 62 lines"]
