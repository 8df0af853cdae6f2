"""bench/gateway_overhead.py's rounds: every path in every round, their order rotating, each round's p50 kept.

The bench itself runs by hand against the real stack; here its scheduler runs
fake calls, so which path ran when can be checked exactly. The pairing of the
rounds' p50s is checked in tests/unit/test_load_goals.py (``added_p50``).
"""

from __future__ import annotations

import asyncio

from tests.support.bench import import_bench

MARK = "|"


def test_each_round_runs_every_path_in_a_rotated_order_and_keeps_its_p50():
    overhead = import_bench("gateway_overhead")
    log: list[str] = []

    class Meter:
        """Sampled before and after each path's block of calls: marks the blocks in the log."""

        samples = 0

        def sample(self) -> dict[str, float]:
            log.append(MARK)
            self.samples += 1
            return {"proxy": float(self.samples)}  # one second "spent" from each sample to the next

    def call_of(path: str):
        async def call() -> int:
            log.append(path)
            await asyncio.sleep(0)
            return 1
        return call

    paths = {path: [call_of(path), call_of(path)] for path in ("a", "b", "c")}
    rows = asyncio.run(overhead.run_levels(paths, "unary", total=30, meter=Meter(), connections=2, rounds=3))

    blocks = [part for part in "".join(log).split(MARK) if part]
    warm_up, levels = blocks[:1], blocks[1:]
    assert warm_up == ["a" * 40 + "b" * 40 + "c" * 40]  # before the first sample: every path warmed
    assert len(levels) == 3 * 3 * len(overhead.CONCURRENCY)  # a block per path, round and level
    c1 = [block[0] for block in levels[:9]]
    assert c1 == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]  # the order rotates from round to round
    assert all(len(block) == 10 for block in levels[:9])  # c=1: the 30 calls split into 3 rounds of 10
    # c=64: a round keeps all 64 workers busy for 8 calls each (one each measured a burst's drain, not a rate)
    assert all(len(block) == 64 * 8 for block in levels[-9:])

    for row in rows:
        per_round = max(row["concurrency"] * 8, 10)
        assert row["rounds"] == 3 and len(row["round_p50"]) == 3
        assert row["calls"] == row["messages"] == 3 * per_round
        assert row["cpu_s"]["proxy"] == 3.0  # summed over the path's three blocks


def test_a_unary_round_gives_every_worker_eight_calls_and_a_stream_round_one():
    """One unary call per worker (64 at c=64) timed a burst's drain, its slowest call, not a rate."""
    overhead = import_bench("gateway_overhead")

    class Meter:
        def sample(self) -> dict[str, float]:
            return {}

    async def call() -> int:
        await asyncio.sleep(0)
        return 1

    for kind, floor in (("unary", 8), ("stream", 1)):
        rows = asyncio.run(overhead.run_levels({"a": [call]}, kind, total=6, meter=Meter(), connections=1, rounds=3))
        assert [row["calls"] for row in rows] == [3 * max(c * floor, 2) for c in overhead.CONCURRENCY], kind
