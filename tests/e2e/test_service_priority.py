"""AGW_<SERVICE>_NICE: a service lowers its own priority at start, every thread of it, before serving."""

from __future__ import annotations

import os

import pytest

from agentgw.supervisor import ServiceProcess

pytestmark = pytest.mark.e2e


def _thread_niceness(pid: int) -> dict[int, int]:
    """Each live thread's niceness (Linux keeps one per thread, and getpriority reads it by thread id)."""
    nices = {}
    for tid in map(int, os.listdir(f"/proc/{pid}/task")):
        try:
            nices[tid] = os.getpriority(os.PRIO_PROCESS, tid)
        except OSError:  # the thread ended meanwhile
            continue
    return nices


def test_a_service_started_with_a_niceness_serves_with_every_thread_at_it(tmp_path, pki):
    retrieval = ServiceProcess("retrieval.main", tmp_path / "retrieval", pki.root, "AGW_RETRIEVAL_",
                               env={"AGW_HOME": str(tmp_path / "home"), "AGW_RETRIEVAL_NICE": "4"})
    try:
        retrieval.wait_serving(120)
        nices = _thread_niceness(retrieval.pid)
        # The event loop, the embedder's and the store's pools, gRPC's own threads: started before the setting
        # was read (imports) or after, all at 4.
        assert len(nices) > 3 and set(nices.values()) == {4}, nices
    finally:
        retrieval.stop(5)
