"""How long a process's event-loop thread waited for a CPU, from Linux schedstat.

A latency-bound service can be starved without being busy: runnable, but not
scheduled. On a host shared with vLLM's spinning CPU workers we measured
seconds of such waits when the two were in different scheduler groups (see
docs/architecture.md, "CPU scheduling"). The kernel counts that time per
thread; exported as a counter it shows up on a dashboard before it shows up
as a mystery in a trace.
"""

from __future__ import annotations

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
