"""The doctor's host hazards, read from /proc and /sys trees laid out as Linux lays them out.

This machine exposes neither (cgroup v1 memory, no cpufreq in its VM), so
each check is also run against the real host, where it must say so.
"""

from __future__ import annotations

import os

import pytest

from agentgw.checks import Status
from agentgw.host_hazards import (
    CpuFrequency,
    cpu_frequencies,
    cpu_frequency_check,
    memory_high_events,
    memory_pressure_check,
)

pytestmark = pytest.mark.unit


def _cgroup_v2(tmp_path, pid: int, high: int):
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "cgroup").write_text("0::/system.slice/agw.service\n")
    group = root / "system.slice" / "agw.service"
    group.mkdir(parents=True, exist_ok=True)
    (group / "memory.events").write_text(f"low 0\nhigh {high}\nmax 0\noom 0\noom_kill 0\n")
    return proc, root


def test_memory_high_events_read_from_the_process_cgroup(tmp_path):
    proc, root = _cgroup_v2(tmp_path, 42, 7)
    assert memory_high_events(42, proc, root) == 7


def test_cgroup_v1_only_is_not_exposed(tmp_path):
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "cgroup").write_text("4:memory:/user.slice\n1:cpu,cpuacct:/user.slice\n")
    assert memory_high_events(42, tmp_path, tmp_path) is None


def test_a_growing_high_count_warns_naming_the_service():
    check = memory_pressure_check({"gateway": 3, "inference": 10}, {"gateway": 3, "inference": 14})
    assert check.status == Status.WARN and "inference +4" in check.measured and "gateway" not in check.measured
    assert memory_pressure_check({"gateway": 3}, {"gateway": 3}).status == Status.PASS
    unexposed = memory_pressure_check({"gateway": None}, {"gateway": None})
    assert unexposed.status == Status.PASS and "not exposed" in unexposed.measured


def _cpufreq(root, cpu: str, governor: str, current: int, maximum: int) -> None:
    freq = root / cpu / "cpufreq"
    freq.mkdir(parents=True)
    (freq / "scaling_governor").write_text(governor + "\n")
    (freq / "scaling_cur_freq").write_text(f"{current}\n")
    (freq / "cpuinfo_max_freq").write_text(f"{maximum}\n")


def test_powersave_or_a_slow_busy_core_warns(tmp_path):
    _cpufreq(tmp_path, "cpu0", "performance", 3_000_000, 3_200_000)
    _cpufreq(tmp_path, "cpu1", "schedutil", 1_500_000, 3_200_000)
    check = cpu_frequency_check(cpu_frequencies(tmp_path))
    assert check.status == Status.WARN and "cpu1 schedutil 1.50/3.20 GHz" in check.measured
    assert "70%" in check.fix
    governor = cpu_frequency_check([CpuFrequency("cpu0", "powersave", 3_000_000, 3_000_000)])
    assert governor.status == Status.WARN and "powersave" in governor.fix
    fast = cpu_frequency_check([CpuFrequency("cpu0", "performance", 3_100_000, 3_200_000)])
    assert fast.status == Status.PASS


def test_this_host_says_plainly_what_it_does_not_expose():
    frequencies = cpu_frequencies()
    check = cpu_frequency_check(frequencies)
    assert check.status in (Status.PASS, Status.WARN)
    if frequencies is None:
        assert "not exposed" in check.measured
    events = memory_high_events(os.getpid())
    assert events is None or events >= 0
