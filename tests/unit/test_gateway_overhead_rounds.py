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
    rows = asyncio.run(overhead.run_levels(paths, "unary", total=6, meter=Meter(), connections=2, rounds=3))

    blocks = [part for part in "".join(log).split(MARK) if part]
    warm_up, levels = blocks[:1], blocks[1:]
    assert warm_up == ["a" * 40 + "b" * 40 + "c" * 40]  # before the first sample: every path warmed
    assert len(levels) == 3 * 3 * len(overhead.CONCURRENCY)  # a block per path, round and level
    c1 = [block[0] for block in levels[:9]]
    assert c1 == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]  # the order rotates from round to round
    assert all(len(block) == 2 for block in levels[:9])  # c=1: the 6 calls split into 3 rounds of 2
    assert all(len(block) == 64 for block in levels[-9:])  # c=64: a round keeps all 64 workers busy

    for row in rows:
        per_round = max(row["concurrency"], 2)
        assert row["rounds"] == 3 and len(row["round_p50"]) == 3
        assert row["calls"] == row["messages"] == 3 * per_round
        assert row["cpu_s"]["proxy"] == 3.0  # summed over the path's three blocks
