"""`agentgw ingest` and `agentgw tune-ef` against a real retrieval service."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from agent.retrieval.v1 import retrieval_pb2 as pb
from tests.support.retrieval_service import retrieval_server, retrieval_stub

pytestmark = pytest.mark.integration


async def _agentgw(*args: str, tls_dir) -> tuple[int, str, str]:
    env = {**os.environ, "AGW_TLS_DIR": str(tls_dir)}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agentgw.cli", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 300)
    return process.returncode, out.decode(), err.decode()


async def test_ingest_files_then_tune(tmp_path, pki):
    notes = tmp_path / "notes"
    notes.mkdir()
    for name, topic in (("a.md", "channels"), ("b.txt", "keepalive"), ("c.md", "tenants")):
        paragraphs = [f"Paragraph {i} about {topic}: " + ("words about the gateway and its " + topic + ". ") * 12
                      for i in range(8)]
        (notes / name).write_text("\n\n".join(paragraphs))
    (notes / "ignored.bin").write_bytes(b"\x00\x01")

    async with retrieval_server(tmp_path / "home", pki.root) as (running, _):
        target = f"127.0.0.1:{running.port}"
        code, _, err = await _agentgw("ingest", str(notes), "--collection", "notes", "--target", target, tls_dir=pki.root)
        assert code == 0, err
        assert "ingesting 24 passages into 'notes'" in err and "24/24" in err
        async with retrieval_stub(running.port, pki.root) as stub:
            collection = (await stub.GetCollection(pb.GetCollectionRequest(name="notes"), timeout=5)).collection
            assert collection.point_count == 24
            hits = await stub.Search(pb.SearchRequest(collection="notes", text="keepalive", top_k=3,
                                                      payload_fields=["source"]), timeout=10)
            assert all(h.payload["source"].endswith("b.txt") for h in hits.results)

        code, out, err = await _agentgw("tune-ef", "notes", "--k", "3", "--sample-size", "10", "--target", target,
                                        tls_dir=pki.root)
        assert code == 0, err
        assert out.splitlines()[0].split() == ["ef", "recall@3", "p50", "ms", "p95", "ms"]
        assert "stored ef=16 with 'notes'" in out and "meets the target" in out


async def test_ingest_reports_an_unreachable_service(tmp_path, pki):
    code, _, err = await _agentgw("ingest", "--sample", "--target", "127.0.0.1:1", tls_dir=pki.root)
    assert code == 1
    assert "127.0.0.1:1 not ready" in err
