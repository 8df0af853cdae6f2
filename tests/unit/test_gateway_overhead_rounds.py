"""bench/gateway_overhead.py's rounds: every path in every round, in balanced orders, each round's p50 kept.

The bench itself runs by hand against the real stack; here its scheduler runs
fake calls, so which path ran when can be checked exactly. The pairing of the
rounds' p50s is checked in tests/unit/test_load_goals.py (``added_p50``).
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from tests.support.bench import import_bench

MARK = "|"


def test_each_round_runs_every_path_in_a_balanced_order_and_keeps_its_p50():
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
    assert c1 == ["a", "b", "c", "c", "b", "a", "b", "c", "a"]  # harness.round_order's first three rounds
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


@pytest.mark.parametrize("count", range(1, 8))
def test_round_order_puts_every_path_after_every_other_and_in_every_place_alike(count):
    """Over 2n rounds of n paths: each ordered pair of neighbours twice, each path in each place twice."""
    round_order = import_bench("harness").round_order
    names = [f"path{i}" for i in range(count)]
    rows = [round_order(names, round_) for round_ in range(2 * count)]
    assert all(sorted(row) == names for row in rows)
    neighbours = Counter(pair for row in rows for pair in zip(row, row[1:]))
    assert len(neighbours) == count * (count - 1) and set(neighbours.values()) <= {2}
    assert set(Counter(place for row in rows for place in enumerate(row)).values()) == {2}


def test_round_order_runs_a_round_and_the_next_in_opposite_orders():
    """Two rounds from an even one: every neighbouring pair in both orders, so neither always goes first."""
    round_order = import_bench("harness").round_order
    names = ["direct", "gateway", "envoy", "edge", "envoy-twin"]
    for round_ in range(0, 10, 2):
        assert round_order(names, round_ + 1) == round_order(names, round_)[::-1]
    # The old rotation put the twin after the edge in 4 rounds of 5; here it follows each path twice in 10.
    before_twin = Counter(row[row.index("envoy-twin") - 1] for row in (round_order(names, r) for r in range(10))
                          if row[0] != "envoy-twin")
    assert before_twin == {"direct": 2, "gateway": 2, "envoy": 2, "edge": 2}
