"""bench/chat_turn.py's forms of the gateway's share of the first token, on turns whose answer is known, and
its sessions' questions.

The bench itself runs by hand (`tests/unit/test_bench_scripts.py` checks that
it starts); these check the arithmetic its verdicts rest on.
"""

from __future__ import annotations

from itertools import islice

import pytest

from tests.support.bench import import_bench


@pytest.fixture(scope="module")
def chat_turn():
    return import_bench("chat_turn")


def turns(chat_turn, stages_and_direct, added_ms: float):
    """Turns of a gateway whose Chat first token is its stages, plus the direct first token, plus ``added_ms``."""
    return [chat_turn.TurnSample(worker=0, turn=n, chat=stages + direct + added_ms, stages=stages, direct=direct)
            for n, (stages, direct) in enumerate(stages_and_direct)]


# Right-skewed stages and direct first tokens: each is usually fast, and
# slow in a different turn. Medians: stages 10, direct 10; their per-turn sum's, 50.
SKEWED = [(10.0, 40.0), (40.0, 10.0), (10.0, 10.0), (10.0, 45.0), (45.0, 10.0)]


def test_a_gateway_that_adds_nothing_is_charged_the_medians_skew_by_the_p50_form_only(chat_turn):
    forms = chat_turn.share_forms(turns(chat_turn, SKEWED, added_ms=0.0))
    assert forms["sum_form"] == pytest.approx(0.0)
    assert forms["median_skew"] == pytest.approx(50.0 - 20.0)
    assert forms["p50_form"] == pytest.approx(forms["sum_form"] + forms["median_skew"])


def test_a_gateway_that_adds_three_ms_a_turn_has_a_sum_form_share_of_three(chat_turn):
    forms = chat_turn.share_forms(turns(chat_turn, SKEWED, added_ms=3.0))
    assert forms["sum_form"] == pytest.approx(3.0)
    assert forms["p50_form"] == pytest.approx(33.0)


def test_the_mean_share_is_the_mean_of_each_turns_share(chat_turn):
    samples = turns(chat_turn, SKEWED, added_ms=0.0)
    samples[0] = chat_turn.TurnSample(worker=0, turn=0, chat=samples[0].chat + 10.0, stages=10.0, direct=40.0)
    assert chat_turn.share_forms(samples)["mean"] == pytest.approx(10.0 / len(SKEWED))


def test_without_skew_the_two_forms_agree(chat_turn):
    steady = [(30.0, 40.0)] * 4 + [(31.0, 41.0)]
    forms = chat_turn.share_forms(turns(chat_turn, steady, added_ms=2.5))
    assert forms["median_skew"] == pytest.approx(0.0)
    assert forms["p50_form"] == pytest.approx(forms["sum_form"]) == pytest.approx(2.5)


def test_a_turn_sample_is_written_to_json_with_its_session_turn(chat_turn):
    sample = chat_turn.TurnSample(worker=3, turn=0, chat=91.23456, stages=40.0, direct=45.5,
                                  chat_engine=30.1234, direct_engine=33.0)
    assert sample.as_json() == {"worker": 3, "turn": 0, "chat": 91.235, "stages": 40.0, "direct": 45.5,
                                "chat_engine": 30.123, "direct_engine": 33.0}
    # Without the engine's own figures, the sample has none to write.
    assert "chat_engine" not in chat_turn.TurnSample(worker=0, turn=1, chat=1.0, stages=0.5, direct=0.4).as_json()


def test_a_turns_share_splits_into_the_engines_part_and_the_rest(chat_turn):
    # Chat: 40 ms of stages, the engine 30 ms, 21.2 ms of hops and gateway; direct: the engine 33 ms, 12.5 of hop.
    sample = chat_turn.TurnSample(worker=0, turn=2, chat=91.2, stages=40.0, direct=45.5,
                                  chat_engine=30.0, direct_engine=33.0)
    assert sample.share == pytest.approx(5.7)
    assert sample.engine_share == pytest.approx(-3.0)
    assert sample.share - sample.engine_share == pytest.approx((91.2 - 40.0 - 30.0) - (45.5 - 33.0))


def test_sessions_ask_their_questions_in_orders_of_their_own(chat_turn):
    """Sessions that ask alike hold the same history and find one another's prompts cached (until 2026-12-06
    sessions six workers apart did), which real agents' sessions do not; the orders are seeded, so every run
    asks the same."""
    def orders():
        return [tuple(islice(chat_turn.session_questions(32, worker), 8)) for worker in range(32)]

    first = orders()
    assert first == orders()
    assert len(set(first)) == 32
    assert {q for order in first for q in order} == set(chat_turn.QUESTIONS)
