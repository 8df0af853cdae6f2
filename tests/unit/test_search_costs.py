"""The decaying maximum that decides which Qdrant Edge searches run on the event loop."""

from __future__ import annotations

import pytest

from retrieval.stores.search_costs import DECAY, MAX_SHAPES, SearchCosts


def test_a_shape_never_measured_is_not_under_any_budget():
    assert not SearchCosts().under(("f", 64), budget_s=10.0)


def test_the_maximum_holds_at_once_and_decays_by_a_factor_a_search():
    costs = SearchCosts()
    costs.record("s", 0.00003)
    assert costs.under("s", 0.0001)
    costs.record("s", 0.001)  # one slow search: over the budget at once
    assert not costs.under("s", 0.0001)
    searches = 0
    while not costs.under("s", 0.0001):
        costs.record("s", 0.00003)
        searches += 1
    assert searches == 22  # 1 ms x 0.9^22 = 0.098 ms
    assert 0.001 * DECAY ** 22 < 0.0001 <= 0.001 * DECAY ** 21


def test_shapes_are_kept_apart():
    costs = SearchCosts()
    costs.record(("plain", 64), 0.00002)
    costs.record(("filtered", 64), 0.004)
    assert costs.under(("plain", 64), 0.0001)
    assert not costs.under(("filtered", 64), 0.0001)


def test_the_shapes_kept_are_bounded():
    costs = SearchCosts()
    for ef in range(MAX_SHAPES):
        costs.record(ef, 0.00001)
    assert costs.under(MAX_SHAPES - 1, 0.0001)
    costs.record("one more", 0.00001)  # the table starts again rather than grow
    assert costs.under("one more", 0.0001)
    assert not costs.under(0, 0.0001)
    assert len(costs._costs) == 1


@pytest.mark.parametrize("budget", [0.0, -1.0])
def test_no_cost_is_under_a_zero_budget(budget):
    costs = SearchCosts()
    costs.record("s", 0.0)
    assert not costs.under("s", budget)
