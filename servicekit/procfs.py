"""What Linux's /proc says about a process's scheduling: CPU waits, scheduling group, children.

A latency-bound service can be starved without being busy: runnable, but not
scheduled. On a host shared with vLLM's spinning CPU workers we measured
seconds of such waits when the two were in different scheduler groups (see
docs/architecture.md, "CPU scheduling"). The kernel counts that time per
thread (schedstat), and says which group each process is scheduled in; the
services export the first, ``agentgw doctor`` checks the second.
"""

from __future__ import annotations

import os
from pathlib import Path


def runqueue_wait_s(thread: str = "self") -> float | None:
    """Seconds the given thread (default: this process's main thread) spent
    runnable but waiting for a CPU since it started; None where the kernel
    does not report it (not Linux, or schedstats unavailable)."""
    try:
        fields = Path(f"/proc/{thread}/schedstat").read_text().split()
        return int(fields[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def cpu_scheduling_group(pid: int | str = "self", proc: Path = Path("/proc")) -> str | None:
    """The group the kernel shares CPU time by, for process ``pid``; None if unknown.

    The process's cgroup for the cpu controller, or, where that is the root
    and ``kernel.sched_autogroup_enabled`` is 1, its session's autogroup.
    Processes in different groups get CPU as groups first, then as threads.
    A process whose session never left init's (no ``setsid`` above it, as
    under a container's init or a CI runner) is in the root autogroup, which
    *is* the root cgroup: the kernel prints nothing for it, and it reads as
    ``cgroup /``. Its children that call ``setsid`` get autogroups of their own.
    ``proc`` is where procfs is mounted (a fixture tree in tests).
    """
    try:
        cgroup_lines = (proc / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return None
    path = None
    for line in cgroup_lines:
        _hierarchy, controllers, cgroup_path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            path = cgroup_path  # cgroup v1's cpu controller
            break
        if controllers == "" and path is None:
            path = cgroup_path  # cgroup v2's unified hierarchy
    if path is None:
        return None
    if path != "/" or not autogroups_enabled(proc):
        return f"cgroup {path}"
    try:
        autogroup = (proc / str(pid) / "autogroup").read_text().split()
    except OSError:
        return f"cgroup {path}"
    # "/autogroup-N nice K"; empty for the root autogroup (see above).
    return autogroup[0].lstrip("/") if autogroup else f"cgroup {path}"


def autogroups_enabled(proc: Path = Path("/proc")) -> bool:
    """Whether the kernel gives each session its own scheduling group (in the root cgroup)."""
    try:
        return (proc / "sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return False


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (children of any of its threads)."""
    found: set[int] = set()
    for path in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found.update(int(child) for child in path.read_text().split())
        except OSError:  # the thread ended meanwhile
            continue
    return sorted(found)


def descendants(pid: int) -> set[int]:
    """Every process below ``pid``, recursively."""
    found: set[int] = set()
    for child in children(pid):
        found |= {child, *descendants(child)}
    return found


def cpu_seconds(pid: int | str = "self", proc: Path = Path("/proc")) -> float | None:
    """User plus system CPU seconds process ``pid`` has used (``/proc/<pid>/stat`` utime + stime); None if gone."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # the command name, in parentheses, may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int, proc: Path = Path("/proc")) -> dict[str, float]:
    """On-CPU seconds of each live thread of process ``pid``, summed by thread name, the main thread (an
    asyncio service's event loop) as ``main`` (``/proc/<pid>/task/<tid>/schedstat``, in nanoseconds where
    ``stat`` counts clock ticks). Threads that ended are not counted; empty if the process is gone."""
    return _thread_schedstat_s(pid, 0, proc)


def thread_runqueue_wait_s(pid: int, proc: Path = Path("/proc")) -> dict[str, float]:
    """Seconds each live thread of process ``pid`` spent runnable but waiting for a CPU, summed by thread name as
    :func:`thread_cpu_s` sums them."""
    return _thread_schedstat_s(pid, 1, proc)


def _thread_schedstat_s(pid: int, field: int, proc: Path) -> dict[str, float]:
    found: dict[str, float] = {}
    for task in (proc / str(pid) / "task").glob("*"):
        try:
            name = "main" if task.name == str(pid) else (task / "comm").read_text().strip()
            nanoseconds = int((task / "schedstat").read_text().split()[field])
        except (OSError, IndexError, ValueError):  # the thread ended meanwhile
            continue
        found[name] = found.get(name, 0.0) + nanoseconds / 1e9
    return found


def rss_bytes(pid: int | str = "self", proc: Path = Path("/proc")) -> int | None:
    """Resident memory of process ``pid`` (``/proc/<pid>/statm``), in bytes; None if gone."""
    try:
        return int((proc / str(pid) / "statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return None


def available_cpus(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup CPU quota (a container's limit).

    ``os.cpu_count()`` counts the host's cores, which in a pod limited to two
    CPUs on a 64-core node would start 64 workers fighting over two.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_quota(cgroup)
    if quota is not None:
        cpus = min(cpus, max(1, int(quota + 0.999)))  # a 1.5-CPU quota still runs two threads part of the time
    return max(1, cpus)


def _cgroup_quota(cgroup: Path) -> float | None:
    """The CPU quota in CPUs, from cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``; None when unlimited."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def open_fds(pid: int | str = "self", proc: Path = Path("/proc")) -> int:
    """File descriptors process ``pid`` holds open (``/proc/<pid>/fd``); 0 if it cannot be read."""
    try:
        return len(os.listdir(proc / str(pid) / "fd"))
    except OSError:
        return 0


def thread_count(pid: int | str = "self", proc: Path = Path("/proc")) -> int:
    """Threads of process ``pid`` (``Threads:`` in ``/proc/<pid>/status``); 0 if it cannot be read."""
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0
