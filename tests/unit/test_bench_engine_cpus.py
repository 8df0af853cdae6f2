"""bench/harness.py's engine isolation: the CPUs vLLM's worker bound, and the other processes moved off them.

Real processes and threads: a child that binds one of its threads to one
CPU, as vLLM's CPU worker binds its OpenMP threads, under a parent that
stands for the inference service; and another process that stands for the
rest of the stack.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from servicekit.procfs import descendants
from tests.support.bench import import_bench

ALLOWED = os.sched_getaffinity(0)
pytestmark = pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two CPUs to move threads between")

#: A parent (the inference service) whose child (the engine worker) binds its second thread to the CPU given
#: (or to none: "none").
_SERVICE = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", '''
import os, sys, threading, time
def bound():
    if sys.argv[1] != "none":
        os.sched_setaffinity(0, {int(sys.argv[1])})
    time.sleep(60)
threading.Thread(target=bound, daemon=True).start()
time.sleep(60)
''', sys.argv[1]])
time.sleep(60)
"""

#: A process with two threads of its own, neither bound.
_OTHER = "import threading, time; threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); time.sleep(60)"


@pytest.fixture
def processes():
    started = []

    def start(*args: str) -> subprocess.Popen:
        started.append(subprocess.Popen([sys.executable, "-c", *args]))
        return started[-1]

    yield start
    for process in started:
        for pid in descendants(process.pid):  # the service's worker, which its parent's kill would orphan
            os.kill(pid, signal.SIGKILL)
        process.kill()
        process.wait()


def _threads(pid: int) -> list[int]:
    return [int(task.name) for task in os.scandir(f"/proc/{pid}/task")]


def _wait_for(condition, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not (found := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return found


def test_the_engine_workers_bound_cpus_are_found_and_everything_else_leaves_them(processes):
    harness = import_bench("harness")
    engine_cpu = max(ALLOWED)
    service = processes(_SERVICE, str(engine_cpu))
    other = processes(_OTHER)
    assert _wait_for(lambda: harness.engine_worker_cpus(service.pid)) == {engine_cpu}
    _wait_for(lambda: len(_threads(other.pid)) == 2)

    kept, moved = harness.move_off_cpus([service.pid, other.pid], {engine_cpu})

    rest = ALLOWED - {engine_cpu}
    [worker] = descendants(service.pid)
    masks = {tid: os.sched_getaffinity(tid) for pid in (service.pid, worker, other.pid) for tid in _threads(pid)}
    # The worker's bound thread keeps its CPU; every other thread (the service's, the worker's main thread,
    # the other process's two) is off it.
    assert list(masks.values()).count({engine_cpu}) == 1 and kept == 1
    assert all(mask == rest for mask in masks.values() if mask != {engine_cpu})
    assert moved == len(masks) - 1


def test_nothing_bound_is_found_and_moving_off_nothing_is_refused(processes):
    harness = import_bench("harness")
    service = processes(_SERVICE, "none")
    other = processes(_OTHER)
    _wait_for(lambda: [len(_threads(pid)) for pid in descendants(service.pid)] == [2])
    _wait_for(lambda: len(_threads(other.pid)) == 2)
    assert harness.engine_worker_cpus(service.pid) == set()
    with pytest.raises(ValueError, match="nothing to move off"):
        harness.move_off_cpus([other.pid], set())
    with pytest.raises(ValueError, match="nothing to move off"):
        harness.move_off_cpus([other.pid], set(ALLOWED))
