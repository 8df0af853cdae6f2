"""Host hazards that show only under load, for ``agentgw doctor``.

- cgroup v2 ``memory.high``: past it the kernel throttles and reclaims the
  group's memory, slowing every thread in it long before the OOM killer acts.
  ``memory.events`` counts each time (``high N``); a count that grows while the
  doctor exercises the stack means the services run throttled.
- CPU frequency scaling: the ``powersave`` governor, or cores clocked well
  under their maximum while busy, slow the gateway's and the engine's threads
  alike.

Each reader returns None where the host does not expose what it reads (cgroup
v1, a VM without cpufreq), and the checks say so plainly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agentgw.checks import Check, Status

#: A busy core clocked under this share of its maximum is throttled.
MIN_BUSY_FREQUENCY_SHARE = 0.70


def memory_high_events(pid: int, proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The ``high`` count of process ``pid``'s cgroup v2 ``memory.events``; None if not exposed."""
    try:
        lines = (proc / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return None
    unified = [line.split(":", 2)[2] for line in lines if line.startswith("0::")]
    if not unified:
        return None  # cgroup v1 only: no memory.high
    try:
        events = (cgroup_root / unified[0].lstrip("/") / "memory.events").read_text()
    except OSError:
        return None
    for line in events.splitlines():
        key, _, value = line.partition(" ")
        if key == "high":
            return int(value)
    return None


def memory_pressure_check(before: dict[str, int | None], after: dict[str, int | None]) -> Check:
    """WARN when a service's ``memory.high`` count grew while the doctor ran its checks."""
    name = "memory.high not throttling"
    readable = {service: (before[service], after.get(service)) for service in before
                if before[service] is not None and after.get(service) is not None}
    if not readable:
        return Check(name, Status.PASS, "not exposed by this host (no cgroup v2 memory.events for the services); "
                     "nothing to check")
    grown = {service: b - a for service, (a, b) in readable.items() if b > a}
    if not grown:
        return Check(name, Status.PASS, "high count unchanged during the checks: "
                     + ", ".join(f"{service} {a}" for service, (a, _) in readable.items()))
    return Check(name, Status.WARN, "memory.high reached during the checks: "
                 + ", ".join(f"{service} +{count}" for service, count in grown.items()),
                 "the services' cgroup is throttled for memory before any OOM: raise memory.high (a pod's memory "
                 "limit) or lower AGW_INFERENCE_KV_CACHE_GIB / the pools")


@dataclass(frozen=True)
class CpuFrequency:
    cpu: str
    governor: str
    current_khz: int
    max_khz: int


def cpu_frequencies(cpus: Path = Path("/sys/devices/system/cpu")) -> list[CpuFrequency] | None:
    """Each core's governor and current and maximum frequency; None if the host exposes no cpufreq."""
    found = []
    for freq in sorted(cpus.glob("cpu[0-9]*/cpufreq")):
        try:
            found.append(CpuFrequency(
                freq.parent.name, (freq / "scaling_governor").read_text().strip(),
                int((freq / "scaling_cur_freq").read_text()), int((freq / "cpuinfo_max_freq").read_text())))
        except (OSError, ValueError):
            continue
    return found or None


def cpu_frequency_check(frequencies: list[CpuFrequency] | None) -> Check:
    """WARN on the powersave governor, or on busy cores under 70% of their maximum frequency."""
    name = "CPU frequency while busy"
    if frequencies is None:
        return Check(name, Status.PASS, "not exposed by this host (no cpufreq in /sys; a VM usually); nothing to check")
    powersave = [f.cpu for f in frequencies if f.governor == "powersave"]
    slow = [f for f in frequencies if f.max_khz and f.current_khz < MIN_BUSY_FREQUENCY_SHARE * f.max_khz]
    summary = ", ".join(f"{f.cpu} {f.governor} {f.current_khz / 1e6:.2f}/{f.max_khz / 1e6:.2f} GHz" for f in frequencies)
    if not powersave and not slow:
        return Check(name, Status.PASS, summary)
    return Check(name, Status.WARN, summary,
                 "set the performance governor (cpupower frequency-set -g performance): the services' latency-bound "
                 f"threads run slower on {'powersave' if powersave else 'cores under 70% of their maximum'}")
