"""Imports flow one way: generated stubs <- servicekit (the runtime) <- the services <- agentgw (the operator's tools).

Every import in every module is read, those inside functions too: a lazy
import that runs upward is still an upward arrow.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
#: Each package's layer; a module may import its own package or lower layers, never a peer's.
LAYERS = {"agent": 0, "servicekit": 1, "gateway": 2, "retrieval": 2, "inference": 2, "agentgw": 3}


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def _arrows(root: Path = ROOT) -> list[str]:
    wrong = []
    for package, layer in LAYERS.items():
        for path in sorted((root / package).rglob("*.py")):
            for line, imported in _imports(path):
                if imported not in LAYERS or imported == package:
                    continue
                if LAYERS[imported] >= layer:
                    wrong.append(f"{path.relative_to(root)}:{line} imports {imported} "
                                 f"(layer {LAYERS[imported]}, not below {package}'s {layer})")
    return wrong


def test_imports_flow_one_way():
    assert _arrows() == []


def test_the_check_sees_an_upward_or_sideways_arrow(tmp_path):
    for package, source in (("servicekit", "def later():\n    from gateway.settings import GatewaySettings\n"),
                            ("gateway", "import inference.convert\n")):
        (tmp_path / package).mkdir()
        (tmp_path / package / "oops.py").write_text(source)
    assert _arrows(tmp_path) == ["servicekit/oops.py:2 imports gateway (layer 2, not below servicekit's 1)",
                                 "gateway/oops.py:1 imports inference (layer 2, not below gateway's 2)"]
