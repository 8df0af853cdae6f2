"""The bench scripts as modules, for tests of the rules they compute (the benches themselves run by hand)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def import_bench(name: str) -> ModuleType:
    """``bench/<name>.py`` imported as a module, with ``bench/`` on the path for its own imports (``harness``)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)
