"""The prompt's layout, for prefix-cache reuse across a session's turns.

System prompt, then the session's history window, then the retrieved context
and the user's message in the last user turn. Everything before the last turn
is identical from one turn to the next, so the engine serves it from its
prefix cache; the history window's start moves in steps (``gateway.history``)
so that this holds for long sessions too.
"""

from __future__ import annotations

from collections.abc import Sequence

from agent.inference.v1 import inference_pb2
from agent.retrieval.v1 import retrieval_pb2

from gateway.convert import role_from_name


def conversation(system_prompt: str, past: Sequence[tuple[str, str]]) -> list[inference_pb2.ChatMessage]:
    """The prompt's stable part: the system prompt, then the history window as (role, content) pairs."""
    return [inference_pb2.ChatMessage(role=inference_pb2.ROLE_SYSTEM, content=system_prompt),
            *(inference_pb2.ChatMessage(role=role_from_name(role) or inference_pb2.ROLE_USER, content=content)
              for role, content in past)]


def user_turn(message: str, documents: Sequence[retrieval_pb2.ScoredDocument]) -> str:
    """The last user turn: the retrieved passages, numbered, then the question; or the message alone."""
    context_block = "\n".join(f"[{i + 1}] {d.payload['text']}" for i, d in enumerate(documents)
                              if "text" in d.payload)
    return f"Context:\n{context_block}\n\nQuestion: {message}" if context_block else message


def generate_request(system_prompt: str, past: Sequence[tuple[str, str]], user: str,
                     sampling: inference_pb2.SamplingParams, cache_salt: str) -> inference_pb2.GenerateRequest:
    """The whole prompt as the inference service takes it."""
    messages = [*conversation(system_prompt, past), inference_pb2.ChatMessage(role=inference_pb2.ROLE_USER, content=user)]
    return inference_pb2.GenerateRequest(chat=inference_pb2.ChatMessages(messages=messages), sampling=sampling,
                                         cache_salt=cache_salt)
