"""Every bench script still starts: a rename in one bench (or in what it imports) must not leave another broken.

The benches run by hand, and on a device machine when one is lent, never in
CI; so nothing else would notice. ``bench/idle_gap.py`` imported a name that
``bench/chat_turn.py`` had renamed, and stayed broken for days.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if '__name__ == "__main__"' in p.read_text())
MODULES = sorted(p for p in BENCH.glob("*.py") if p not in SCRIPTS)


def test_there_are_benches_to_check():
    assert len(SCRIPTS) >= 10 and {p.name for p in MODULES} >= {"harness.py"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_each_bench_script_imports_and_shows_its_usage(script: Path):
    done = subprocess.run([sys.executable, script.name, "--help"], cwd=BENCH, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, f"python bench/{script.name} --help failed:\n{done.stderr[-2000:]}"
    assert done.stdout.startswith("usage:"), done.stdout[:500]


@pytest.mark.parametrize("module", MODULES, ids=lambda p: p.name)
def test_each_bench_helper_module_imports(module: Path):
    done = subprocess.run([sys.executable, "-c", f"import {module.stem}"], cwd=BENCH, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, f"import {module.stem} (from bench/) failed:\n{done.stderr[-2000:]}"
