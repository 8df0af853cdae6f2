"""Generate streams of one seeded request, taken on different paths (direct, the gateway, the edge), compared."""

from __future__ import annotations

from agent.inference.v1 import inference_pb2


def text_and_tokens(messages: list[bytes]) -> tuple[str, list[int]]:
    """A Generate stream's deltas (all but its final message), joined: what coalescing must keep whole."""
    deltas = [inference_pb2.GenerateResponse.FromString(message) for message in messages[:-1]]
    return "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids]


def assert_same_deltas(first: list[bytes], *others: list[bytes]) -> None:
    """Every stream's deltas carry the same text and token ids, and, where each has as many messages, the same
    bytes. The inference service merges the deltas of a reader that falls behind (its coalescing under
    back-pressure): one CI run on a loaded machine had 24 messages on the direct call, 25 through the gateway."""
    assert len(first) > 2
    for other in others:
        assert text_and_tokens(other) == text_and_tokens(first)
    if all(len(other) == len(first) for other in others):
        for other in others:
            assert other[:-1] == first[:-1]  # every delta, byte for byte
