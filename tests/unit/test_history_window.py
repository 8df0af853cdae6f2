"""The history window: what a prompt carries, and a start that moves in steps."""

from __future__ import annotations

import pytest

from agent.gateway.v1 import gateway_pb2 as pb
from gateway.history import history_window, unprefilled_tokens

pytestmark = pytest.mark.unit


def session(turns: int, tokens: int = 10) -> list[dict]:
    """A session's stored messages, newest first, as the history query returns them."""
    rows = [{"ordinal": i, "role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}", "token_count": tokens}
            for i in range(2 * turns)]
    return rows[::-1]


def window(rows, max_messages=50, token_budget=10_000, step=16):
    # The query hands over the newest max_messages rows only.
    return history_window(rows[:max_messages], max_messages=max_messages, token_budget=token_budget, step=step)


def test_a_short_session_is_carried_whole():
    carried = window(session(3))
    assert [m["ordinal"] for m in carried.messages] == list(range(6))
    assert carried.start == 0 and not carried.trimmed
    assert window([]).messages == []


def test_past_the_limit_the_start_moves_in_steps_and_prefixes_stay_stable():
    max_messages, step = 20, 8
    windows = [window(session(turns), max_messages=max_messages, step=step) for turns in range(1, 40)]
    starts = [w.start for w in windows]
    assert all(start % step == 0 for start in starts)
    assert all(max_messages - step < len(w.messages) <= max_messages
               for turns, w in enumerate(windows, 1) if 2 * turns > max_messages)
    assert all(w.messages[0]["role"] == "user" for w in windows)
    # The start moves once every step/2 turns, not every turn: between moves,
    # each window extends the one before it, so the prompt's prefix is cached.
    moves = sum(a != b for a, b in zip(starts, starts[1:]))
    assert moves == starts[-1] // step
    for before, after in zip(windows, windows[1:]):
        if before.start == after.start:
            assert after.messages[:len(before.messages)] == before.messages
    assert not any(w.trimmed for w in windows)  # the count limit is not a trim


def test_the_token_budget_trims_to_an_aligned_start_and_says_so():
    carried = window(session(10, tokens=10), token_budget=95, step=4)
    # 9 messages fit (90 tokens): ordinals 11..19; aligned up to 12.
    assert carried.start == 12 and carried.trimmed
    assert [m["ordinal"] for m in carried.messages] == list(range(12, 20))
    assert sum(m["token_count"] for m in carried.messages) <= 95


def test_a_newest_message_over_the_budget_leaves_the_window_empty():
    rows = session(2)
    rows[0] = {**rows[0], "token_count": 500}
    carried = window(rows, token_budget=100, step=2)
    assert carried.messages == [] and carried.trimmed


def test_listed_messages_give_the_same_window_as_rows():
    rows = session(30, tokens=7)
    listed = [pb.Message(ordinal=r["ordinal"], content=r["content"], token_count=r["token_count"]) for r in rows]
    from_rows, from_listed = window(rows, token_budget=200), window(listed, token_budget=200)
    assert from_rows.start == from_listed.start and from_rows.trimmed == from_listed.trimmed
    assert [m.ordinal for m in from_listed.messages] == [m["ordinal"] for m in from_rows.messages]


def _row(role: str, tokens: int) -> dict:
    return {"role": role, "token_count": tokens}


@pytest.mark.parametrize("newest_first, expected", [
    ([], 0),
    # The previous turn's answer and its question: what its prompt did not carry as they are now.
    ([_row("assistant", 128), _row("user", 20), _row("assistant", 50), _row("user", 9)], 148),
    # A turn of tool results alone: its prompt carried the results; only the answer is new.
    ([_row("assistant", 40), _row("tool", 300), _row("assistant", 12), _row("user", 9)], 40),
    ([_row("user", 7)], 7),
], ids=["empty", "question-and-answer", "tool-results", "unanswered"])
def test_unprefilled_tokens_are_the_previous_turns_answer_and_question(newest_first, expected):
    assert unprefilled_tokens(newest_first) == expected
