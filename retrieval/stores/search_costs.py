"""Which searches run on the event loop: those that cost less than handing them to a thread.

A Qdrant Edge call handed to the store's thread and back wakes that thread and
then the event loop. On the 2-core development hosts that hand-off cost 80-100
µs of the service's CPU and of latency per search at one call at a time
(``bench/search_hops.py``), more than a search of a small collection takes
(25-45 µs for 200 points; docs/benchmarks.md, "A search without thread hops").
So a search whose recent cost is under a budget (``AGW_RETRIEVAL_INLINE_SEARCH_US``)
runs on the loop, and any other on the thread, as every Edge call did before.

The cost is kept per collection and per query shape (filtered or not, and the
``hnsw_ef``: both change what a search reads) as a decaying maximum of the
measured times. One slow search (a collection that grew, a filter that falls
back to a scan) sends the next ones of its shape to the thread at once; they
come back only when the maximum has decayed under the budget, about 22
searches after one ten times over it. A shape never measured runs on the
thread first. Times measured on the thread include its waits for the GIL:
under load they read high, which errs towards the thread, where under load
the hand-offs are amortised anyway (at c=64 the budget moved nothing beyond
the bench's noise).
"""

from __future__ import annotations

from collections.abc import Hashable

#: Each new measurement counts whole; an old maximum loses this factor per search.
DECAY = 0.9
#: Shapes kept per collection: a client that varies hnsw_ef per call cannot grow this without bound.
MAX_SHAPES = 64


class SearchCosts:
    """One collection's recent search times, per query shape, in seconds."""

    def __init__(self) -> None:
        self._costs: dict[Hashable, float] = {}

    def under(self, shape: Hashable, budget_s: float) -> bool:
        """Whether searches of ``shape`` have lately cost less than ``budget_s`` (False if never measured)."""
        cost = self._costs.get(shape)
        return cost is not None and cost < budget_s

    def record(self, shape: Hashable, seconds: float) -> None:
        """One search of ``shape`` took ``seconds``."""
        cost = self._costs.get(shape)
        if cost is None and len(self._costs) >= MAX_SHAPES:
            self._costs.clear()
        self._costs[shape] = seconds if cost is None else max(seconds, cost * DECAY)
