"""How many CPUs the gateway's worker rule counts: affinity, capped by a cgroup quota."""

from __future__ import annotations

import os

import pytest

from servicekit.procfs import available_cpus, cpu_seconds, rss_bytes

pytestmark = pytest.mark.unit

AFFINITY = len(os.sched_getaffinity(0))


def test_no_cgroup_files_means_the_affinity_mask(tmp_path):
    assert available_cpus(tmp_path) == AFFINITY


def test_cgroup_v2_unlimited_and_limited(tmp_path):
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert available_cpus(tmp_path) == AFFINITY
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a CPU still gets a worker
    assert available_cpus(tmp_path) == 1
    (tmp_path / "cpu.max").write_text(f"{(AFFINITY + 8) * 100000} 100000\n")  # a quota above the mask: the mask
    assert available_cpus(tmp_path) == AFFINITY


def test_cgroup_v1_quota(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert available_cpus(tmp_path) == AFFINITY
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    assert available_cpus(tmp_path) == 1


def test_cpu_and_memory_of_this_process():
    assert cpu_seconds() > 0 and rss_bytes() > 10 * 2**20
    assert cpu_seconds(2**22 + 12345) is None  # no such process


def test_the_worker_rule_leaves_each_worker_its_poller_thread():
    from gateway.settings import default_workers

    assert [default_workers(c) for c in (1, 2, 3, 4, 8, 16)] == [1, 1, 2, 3, 6, 12]


def test_the_doctor_warns_past_the_rule():
    from agentgw.doctor import Status, workers_check

    assert workers_check(1, 2).status == Status.PASS
    over = workers_check(2, 2)
    assert over.status == Status.WARN and "the rule gives 1" in over.measured and "AGW_GATEWAY_WORKERS" in over.fix
