"""servicekit.procfs: the run-queue wait counter, CPU by thread, and the CPU scheduling group (and the doctor's
check of it)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from agentgw.connection import Connection
from agentgw.doctor import Doctor, Status
from servicekit.procfs import (
    autogroups_enabled,
    cpu_scheduling_group,
    runqueue_wait_s,
    thread_cpu_s,
    thread_runqueue_wait_s,
)

_HOG = "import os, time\nos.sched_setaffinity(0, {{{cpu}}})\nend = time.time() + {seconds}\nwhile time.time() < end: pass\n"


def test_runqueue_wait_grows_while_others_hold_our_cpu():
    allowed = os.sched_getaffinity(0)
    cpu = min(allowed)
    hogs = [subprocess.Popen([sys.executable, "-c", _HOG.format(cpu=cpu, seconds=3)]) for _ in range(2)]
    os.sched_setaffinity(0, {cpu})  # this (main) thread now shares one CPU with two spinning processes
    try:
        time.sleep(0.3)  # let the hogs start spinning
        before = runqueue_wait_s()
        ends = time.monotonic() + 1.0
        while time.monotonic() < ends:
            pass  # spin too: three runnable threads on one CPU, so each waits about 2/3 of the time
        waited = runqueue_wait_s() - before
    finally:
        os.sched_setaffinity(0, allowed)
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert waited > 0.2, f"waited only {waited * 1000:.1f} ms for the CPU in 1 s shared three ways"

_BUSY_THREAD = """
import threading, time
def spin(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
spun, stop = threading.Event(), threading.Event()
def work():
    spin(0.6)
    spun.set()
    stop.wait()  # alive, so counted
threading.Thread(target=work, daemon=True).start()
spin(0.2)  # the main thread
spun.wait()
print("done", flush=True)
time.sleep(30)
"""


def _read_once_done(script: str, read):
    """``read(pid)`` of a new interpreter running ``script``, once it prints "done"; the process is killed after."""
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "done"
        return read(process.pid)
    finally:
        process.kill()
        process.wait()


def test_thread_cpu_names_the_main_thread_and_counts_each_thread_apart():
    threads = _read_once_done(_BUSY_THREAD, thread_cpu_s)
    # To the nanosecond, where /proc/<pid>/stat counts 10 ms ticks of the whole process: the main thread's
    # spin (and start-up's imports), and the worker's apart, under its name (a Python thread keeps the
    # process's command name).
    main = threads.pop("main")
    [(_name, worker)] = threads.items()
    assert 0.2 <= main < 0.6
    assert 0.6 <= worker < 0.9
    assert thread_cpu_s(999999999) == {}


_SHARING_ONE_CPU = """
import os, subprocess, sys, threading, time
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one CPU, which the child below inherits
rivals = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]  # on that CPU too
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()  # a thread that only sleeps
time.sleep(0.3)  # the rivals are running
end = time.thread_time() + 0.4
while time.thread_time() < end:
    pass
for rival in rivals:
    rival.kill()
print("done", flush=True)
time.sleep(30)
"""


def test_a_thread_sharing_its_cpu_counts_its_wait_and_a_sleeping_one_none():
    waits = _read_once_done(_SHARING_ONE_CPU, thread_runqueue_wait_s)
    # 0.4 s of CPU on a CPU shared with two spinning processes: the scheduler gave each about a third, so the
    # main thread waited about twice as long as it ran (more than all its CPU, imports included). The sleeping
    # thread was never runnable.
    main = waits.pop("main")
    [(_name, sleeper)] = waits.items()
    assert main >= 0.6, main
    assert sleeper < 0.05, sleeper
    assert thread_runqueue_wait_s(999999999) == {}


def test_an_unknown_thread_reads_as_none():
    assert runqueue_wait_s("999999999") is None
    assert runqueue_wait_s() >= 0


def _sleeper(**popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], **popen)


def _doctor(pids: dict[str, int]) -> Doctor:
    return Doctor(Connection(gateway="127.0.0.1:1", tls_dir="unused", pids=pids), collections=[])


def test_a_child_in_our_session_shares_our_group_and_passes_the_doctor():
    child = _sleeper(process_group=0)  # as ServiceProcess starts services
    try:
        assert cpu_scheduling_group(child.pid) == cpu_scheduling_group()
        check = _doctor({"gateway": os.getpid(), "inference": child.pid}).scheduling_check()
    finally:
        child.kill()
        child.wait()
    assert check.status is Status.PASS, check.line()


def test_a_child_in_its_own_session_is_named_by_the_doctor_where_sessions_are_groups():
    ours = cpu_scheduling_group()
    child = _sleeper(start_new_session=True)  # as ServiceProcess used to
    try:
        theirs = cpu_scheduling_group(child.pid)
        check = _doctor({"gateway": os.getpid(), "inference": child.pid}).scheduling_check()
    finally:
        child.kill()
        child.wait()
    # In the root cgroup with autogroups on, a new session is a new group:
    # whether we are in an autogroup of our own or still in init's (CI
    # runners and containers often are, and then read as "cgroup /").
    in_root_cgroup = ours == "cgroup /" or ours.startswith("autogroup")
    if autogroups_enabled() and in_root_cgroup:
        assert theirs != ours and theirs.startswith("autogroup")
        assert check.status is Status.WARN
        assert f"gateway: {ours}" in check.measured and f"inference: {theirs}" in check.measured
        assert "one session" in check.fix
    else:  # by cgroup: a new session stays in its parent's cgroup
        assert theirs == ours and check.status is Status.PASS


def _proc_tree(root, cgroup: str, autogroup: str | None, enabled: str = "1"):
    (root / "sys/kernel").mkdir(parents=True)
    (root / "sys/kernel/sched_autogroup_enabled").write_text(enabled + "\n")
    (root / "42").mkdir()
    (root / "42/cgroup").write_text(cgroup)
    if autogroup is not None:
        (root / "42/autogroup").write_text(autogroup)
    return root


_V1 = "9:name=systemd:/\n4:memory:/jobs/7\n2:cpuacct:/\n1:cpu:{cpu}\n0::/\n"


def test_the_group_is_the_cpu_cgroup_or_the_sessions_autogroup(tmp_path):
    cases = [  # (cgroup file, autogroup file, autogroups on, expected)
        (_V1.format(cpu="/"), "/autogroup-85 nice 0\n", "1", "autogroup-85"),
        (_V1.format(cpu="/"), "", "1", "cgroup /"),  # init's session: the root autogroup prints nothing
        (_V1.format(cpu="/"), "/autogroup-85 nice 0\n", "0", "cgroup /"),
        (_V1.format(cpu="/batch"), "/autogroup-85 nice 0\n", "1", "cgroup /batch"),  # autogroups act in the root only
        ("0::/system.slice/agw.service\n", "/autogroup-3 nice 0\n", "1", "cgroup /system.slice/agw.service"),
        ("0::/\n", None, "1", "cgroup /"),
    ]
    for number, (cgroup, autogroup, enabled, expected) in enumerate(cases):
        proc = _proc_tree(tmp_path / str(number), cgroup, autogroup, enabled)
        assert cpu_scheduling_group(42, proc) == expected, (cgroup, autogroup, enabled)
    assert cpu_scheduling_group(43, tmp_path / "0") is None  # no such process


def test_the_doctor_warns_when_it_cannot_see_the_processes():
    assert _doctor({}).scheduling_check().status is Status.WARN
    check = _doctor({"gateway": 999999999}).scheduling_check()
    assert check.status is Status.WARN and "gateway" in check.measured
