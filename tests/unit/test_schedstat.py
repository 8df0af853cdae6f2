"""The run-queue wait counter reads what the kernel measured."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from servicekit.schedstat import runqueue_wait_s

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

def test_an_unknown_thread_reads_as_none():
    assert runqueue_wait_s("999999999") is None
    assert runqueue_wait_s() >= 0
