"""The committed stubs are exactly what scripts/gen_protos.py makes from protos/."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("gen_protos", REPO / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_protos"] = module
    spec.loader.exec_module(module)
    return module


def _committed_stub_files() -> set[Path]:
    return {
        p.relative_to(REPO) for p in (REPO / "agent").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_committed_stubs_match_protos(gen, tmp_path):
    gen.generate(tmp_path)
    problems = gen.drift(tmp_path, REPO)
    assert problems == [], "stubs drifted from protos/; run: python scripts/gen_protos.py\n" + "\n".join(problems)
    generated = {p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    stale = _committed_stub_files() - generated
    assert not stale, f"committed stubs with no .proto behind them: {sorted(map(str, stale))}"


def test_drift_is_detected_after_a_proto_change(gen, tmp_path):
    protos = tmp_path / "protos"
    shutil.copytree(REPO / "protos", protos)
    proto = protos / "agent" / "inference" / "v1" / "inference.proto"
    proto.write_text(proto.read_text().replace(
        "message GetLoadRequest {}", "message GetLoadRequest {\n  // Added without regenerating.\n  bool verbose = 1;\n}"
    ))
    out = tmp_path / "out"
    gen.generate(out, protos)
    problems = gen.drift(out, REPO)
    assert any("agent/inference/v1/inference_pb2.py" in p for p in problems), problems
    # Regenerating the committed tree from the changed contracts clears the drift.
    regenerated = tmp_path / "repo"
    gen.generate(regenerated, protos)
    assert gen.drift(out, regenerated) == []
