"""Which stored messages a turn's prompt carries: a window whose start moves in steps.

The engine reuses a cached prefix only while a prompt matches the previous one
token for token from its first token. A window of "the newest messages that
fit" starts one turn later on every turn once a session has outgrown it, so
from then on every prompt misses the cache right after the system prompt, and
the whole history is prefilled again (measured: 847 uncached prompt tokens a
turn instead of 294, +9 ms to the first token on the smoke model).

Here the window starts on an ordinal that is a multiple of ``step`` and stays
there while the messages since it fit both limits (count and tokens). When they
no longer do, the start jumps to the next multiple that fits. So a session past
its limits misses the cache once every ``step / 2`` turns instead of on every
turn, at the price of carrying up to ``step - 1`` fewer messages than would fit.

Chat templates expect the conversation after the system prompt to open with
the user, and a tool result without the call it answers confuses them. Plain
turns store a user then an assistant message, so an even step starts on a
user message; tool loops store more per turn, so the window then skips ahead
to its first user message. That depends on the start alone, so it stays put
while the start does and the prefix still holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class HistoryWindow:
    """The messages a prompt carries, oldest first, and whether the token budget left some out."""

    start: int
    """The first ordinal carried (a multiple of the step)."""
    messages: list
    """The rows carried, oldest first."""
    trimmed: bool
    """True when the token budget, not just the message count, moved the start."""


def _align_up(ordinal: int, step: int) -> int:
    return -(-max(ordinal, 0) // step) * step


def history_window(newest_first: Sequence, *, max_messages: int, token_budget: int, step: int) -> HistoryWindow:
    """Choose the window from a session's newest messages.

    Args:
        newest_first: the session's last ``max_messages`` messages, newest first,
            each with ``ordinal`` and ``token_count`` (by key or attribute).
        max_messages: most messages a prompt carries.
        token_budget: most history tokens a prompt carries.
        step: the window's start is a multiple of this many ordinals.
    """
    if not newest_first:
        return HistoryWindow(start=0, messages=[], trimmed=False)
    field = _reader(newest_first[0])
    by_count = _align_up(field(newest_first[0], "ordinal") + 1 - max_messages, step)
    fits_from, used = field(newest_first[0], "ordinal") + 1, 0
    for message in newest_first:
        used += field(message, "token_count")
        if used > token_budget:
            break
        fits_from = field(message, "ordinal")
    by_tokens = _align_up(fits_from, step)
    start = max(by_count, by_tokens)
    kept = [m for m in reversed(newest_first) if field(m, "ordinal") >= start]
    first_user = next((i for i, m in enumerate(kept) if field(m, "role") == "user"), 0)
    kept = kept[first_user:]
    start = field(kept[0], "ordinal") if kept else start
    return HistoryWindow(start=start, messages=kept, trimmed=by_tokens > by_count)


def _reader(sample):
    """Rows are read by key, protos by attribute."""
    if hasattr(sample, "keys"):
        return lambda message, name: message[name]
    return getattr


def unprefilled_tokens(newest_first: Sequence) -> int:
    """About how many tokens at the end of a session's history the engine's prefix cache lacks.

    The previous turn's prompt carried everything before its user message as
    it is now, so the engine has it cached; its user message went out with the
    retrieved passages around it, and its answer was generated, not
    prefilled. So: the newest assistant messages and the user message before
    them (stored token estimates). A turn of tool results alone stops at the
    tools, which its prompt carried as they are.
    """
    if not newest_first:
        return 0
    field, total = _reader(newest_first[0]), 0
    for message in newest_first:
        role = field(message, "role")
        if role not in ("assistant", "user"):
            break
        total += field(message, "token_count")
        if role == "user":
            break
    return total
