"""The prompt's layout, for prefix-cache reuse across a session's turns.

System prompt, then the tools (the chat template renders them next to the
system prompt), then the session's history window, then this turn's tool
results and the user's message with the retrieved context. Everything before
this turn's messages is identical from one turn to the next (the tools too,
when a tool loop sends the same ones), so the engine serves it from its prefix
cache; the history window's start moves in steps (``gateway.history``) so
that this holds for long sessions too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from agent.inference.v1 import inference_pb2
from agent.retrieval.v1 import retrieval_pb2

from gateway.convert import role_from_name, tool_calls_from_json
from gateway.turn_types import ToolResult


def history_messages(rows: Sequence) -> list[inference_pb2.ChatMessage]:
    """Stored messages (role, content, tool_calls as JSON text, tool_call_id) as the prompt carries them."""
    return [inference_pb2.ChatMessage(
        role=role_from_name(row["role"]) or inference_pb2.ROLE_USER, content=row["content"],
        tool_calls=tool_calls_from_json(json.loads(row["tool_calls"]) if row["tool_calls"] else None),
        tool_call_id=row["tool_call_id"]) for row in rows]


def conversation(system_prompt: str, past: Sequence[inference_pb2.ChatMessage]) -> list[inference_pb2.ChatMessage]:
    """The prompt's stable part: the system prompt, then the history window."""
    return [inference_pb2.ChatMessage(role=inference_pb2.ROLE_SYSTEM, content=system_prompt), *past]


def user_turn(message: str, documents: Sequence[retrieval_pb2.ScoredDocument]) -> str:
    """The last user turn: the retrieved passages, numbered, then the question; or the message alone."""
    context_block = "\n".join(f"[{i + 1}] {d.payload['text']}" for i, d in enumerate(documents)
                              if "text" in d.payload)
    return f"Context:\n{context_block}\n\nQuestion: {message}" if context_block else message


def turn_messages(tool_results: Sequence[ToolResult], user: str) -> list[inference_pb2.ChatMessage]:
    """This turn's messages: the tool results, in the order sent, then the user's message (if any)."""
    messages = [inference_pb2.ChatMessage(role=inference_pb2.ROLE_TOOL, content=r.content, tool_call_id=r.tool_call_id)
                for r in tool_results]
    if user:
        messages.append(inference_pb2.ChatMessage(role=inference_pb2.ROLE_USER, content=user))
    return messages


def generate_request(system_prompt: str, past: Sequence[inference_pb2.ChatMessage],
                     turn: Sequence[inference_pb2.ChatMessage], sampling: inference_pb2.SamplingParams,
                     cache_salt: str, tools: Sequence[inference_pb2.Tool] = (),
                     tool_choice: inference_pb2.ToolChoice | None = None) -> inference_pb2.GenerateRequest:
    """The whole prompt as the inference service takes it."""
    chat = inference_pb2.ChatMessages(messages=[*conversation(system_prompt, past), *turn], tools=tools)
    return inference_pb2.GenerateRequest(chat=chat, sampling=sampling, cache_salt=cache_salt, tool_choice=tool_choice)
