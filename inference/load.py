"""The engine's load as vLLM's scheduler reports it.

vLLM calls :meth:`LoadTracker.record` from its output handler (on our event
loop) after every engine step. The scheduler's stats say how requests split
between running and waiting and how full the KV cache is; the iteration stats
count generated tokens, which is how a test proves that a cancelled request
computes nothing more.
"""

from __future__ import annotations

from vllm.v1.metrics.loggers import StatLoggerBase


class LoadTracker(StatLoggerBase):
    """Keeps the latest scheduler snapshot and a running count of generated tokens."""

    def __init__(self, vllm_config=None, engine_index: int = 0) -> None:  # noqa: D107 - vLLM's signature
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage = 0.0
        self.generated_tokens_total = 0

    def factory(self, vllm_config, engine_index: int = 0) -> LoadTracker:
        """vLLM builds stat loggers from factories; hand it this instance."""
        return self

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        if scheduler_stats is not None:
            self.running = scheduler_stats.num_running_reqs
            self.waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
            self.kv_cache_usage = scheduler_stats.kv_cache_usage
        if iteration_stats is not None:
            self.generated_tokens_total += iteration_stats.num_generation_tokens

    def log_engine_initialized(self) -> None:
        pass
