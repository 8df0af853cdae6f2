"""A vLLM plugin: the engine's processes stop spinning a core each while they wait for one another.

vLLM's multiprocess executor passes each step between its engine core and its
worker through shared-memory queues. A reader that finds its queue empty
spins (``sched_yield`` in a loop) for a whole second after its last message
before it sleeps on a socket until the writer's notification. While requests
run, a message comes every step, so neither process ever sleeps: on a CPU
host the engine core spins a core for as long as the worker computes the
step, and the worker spins while the core schedules the next. On this
project's 2-core machine the engine core took 77-86% of a core during
decoding, nearly all of it waiting, and the gateway, retrieval and the
clients shared what was left (docs/benchmarks.md, "The engine's processes
stop spinning").

This plugin, loaded by vLLM in each of its processes (the
``vllm.general_plugins`` entry point in pyproject.toml), changes how a
reader waits (``SpinCondition.wait``):

- it spins for ``AGW_INFERENCE_ENGINE_SPIN_MS`` after its last message
  (default 2 ms on CPU: longer than the core's scheduling between steps, so
  the worker still picks a step up at once), then sleeps on the socket;
- it never sleeps longer than :data:`IDLE_POLL_MS` at a time before looking
  at its queue again. vLLM's own sleep rechecks only every 5 s, and its
  notification can be missed (with no spin at all, decoding ran at 296
  tokens/s instead of 528, and one request stalled 60 s, waiting out lost
  wake-ups); the bound makes a missed one cost at most 10 ms.

It patches a vLLM class, so it checks the version it was written against and
does nothing on another (logging why). On a GPU host it does nothing unless
``AGW_INFERENCE_ENGINE_SPIN_MS`` is set: cores are plentiful there and a
step's wake-up latency is worth more than a core.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)

#: The vLLM release whose internals this plugin was written against and tested with.
SUPPORTED_VLLM = "0.32."
#: Longest sleep before a waiting reader looks at its queue again: what a missed notification can cost.
IDLE_POLL_MS = 10
#: The spin after a message on CPU when AGW_INFERENCE_ENGINE_SPIN_MS is unset.
CPU_SPIN_MS = 2.0


def patch_spin_condition(spin_condition, sched_yield, spin_ms: float, idle_poll_ms: int = IDLE_POLL_MS) -> None:
    """Make ``spin_condition``'s readers spin ``spin_ms`` after a message, then sleep at most ``idle_poll_ms`` at a
    time. The class keeps vLLM's fields (``last_read``, ``poller``, ``local_notify_socket``); only ``wait`` changes."""
    import zmq

    spin_s = spin_ms / 1000

    def wait(self, timeout_ms: int | None = None) -> None:
        if time.monotonic() <= self.last_read + spin_s:
            sched_yield()
            return
        bound = idle_poll_ms if timeout_ms is None else min(timeout_ms, idle_poll_ms)
        events = dict(self.poller.poll(timeout=bound))
        if self.local_notify_socket in events:
            # The socket conflates notifications: at most one is waiting.
            self.local_notify_socket.recv(flags=zmq.NOBLOCK, copy=False)

    wait.agw_spin_ms = spin_ms
    spin_condition.wait = wait


def _spin_ms() -> float | None:
    """The spin this process's engine should use, from the inference service's settings; None: leave vLLM's."""
    from inference.settings import InferenceSettings
    from servicekit import load_settings

    configured = load_settings(InferenceSettings).engine_spin_ms
    if configured is not None:
        return configured
    from vllm.platforms import current_platform

    return CPU_SPIN_MS if current_platform.is_cpu() else None


def register() -> None:
    """vLLM's plugin hook; safe to call more than once per process (vLLM may)."""
    import vllm

    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        log.warning("agent-gateway engine waits: written for vLLM %sx, found %s; not installed (the engine's "
                    "processes spin while they wait, as vLLM does)", SUPPORTED_VLLM, vllm.__version__)
        return
    from vllm.distributed.device_communicators import shm_broadcast

    if hasattr(shm_broadcast.SpinCondition.wait, "agw_spin_ms"):
        return
    try:
        spin_ms = _spin_ms()
    except Exception as exc:  # noqa: BLE001 - a plugin must not stop vLLM's process; the service validates at start
        log.warning("agent-gateway engine waits: not installed, settings unreadable here: %s", exc)
        return
    if spin_ms is None:
        return
    patch_spin_condition(shm_broadcast.SpinCondition, shm_broadcast.sched_yield, spin_ms)
    log.info("agent-gateway engine waits installed: spin %.1f ms after a message, then sleep at most %d ms at a time",
             spin_ms, IDLE_POLL_MS)
