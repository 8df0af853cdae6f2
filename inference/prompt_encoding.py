"""Prompts to token ids, with a conversation's first messages tokenized ahead when the caller sends them early.

A caller that knows a conversation's first messages before the rest (the
gateway, once a session's history is loaded while retrieval still runs)
sends them first on an ``OpenGenerate`` call; they are rendered and tokenized
then, and when the request arrives only what follows them is encoded. The
result must be the very token ids a whole encode gives, or the prefix cache
and the model would see another prompt. It is, when the rendered prompt
starts with the rendered prefix and the rest starts with an added token
(such as ``<|user|>``): the tokenizer splits text on added tokens before
anything else, so no token can span that boundary. Both are checked on every
request, and the tokenizer and its chat template are checked once, on a
sample conversation, when the encoder is built.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from inference.requests import Message, PromptInput, Tool

#: Checked when the encoder is built: reused tokens must equal a whole encode.
_SAMPLE = (Message("system", "Answer briefly."), Message("user", "What is a tuple?"),
           Message("assistant", "An immutable sequence.\n"))
_SAMPLE_NEXT = (Message("user", "  And a list?\n"),)


@dataclass(frozen=True)
class EncodedPrefix:
    """A conversation's first messages, rendered (without a generation prompt) and tokenized."""

    messages: tuple[Message, ...]
    text: str
    token_ids: tuple[int, ...]
    tools: tuple[Tool, ...] = ()


class PromptEncoder:
    """Renders chat prompts through the model's template and tokenizes them; stateless once built."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        # Added tokens that keep the whitespace before them: text is split on
        # these first, so a boundary just before one is a boundary for BPE too.
        self._boundaries = tuple({token.content for token in tokenizer.added_tokens_decoder.values() if not token.lstrip})
        self.reuses_prefixes = self._reuse_holds_on_a_sample()

    def render(self, messages: tuple[Message, ...], add_generation_prompt: bool, tools: tuple[Tool, ...] = ()) -> str:
        """The chat template's text; tools go through its own ``tools`` argument, in Hugging Face's shape."""
        return self._tokenizer.apply_chat_template(
            [_message_dict(m) for m in messages], tools=[_tool_dict(t) for t in tools] or None,
            add_generation_prompt=add_generation_prompt, tokenize=False,
        )

    def encode_prefix(self, messages: tuple[Message, ...], tools: tuple[Tool, ...] = ()) -> EncodedPrefix:
        # Rendered as a whole conversation would start: the template already
        # holds the special tokens it wants (such as BOS).
        text = self.render(messages, add_generation_prompt=False, tools=tools)
        return EncodedPrefix(messages, text, tuple(self._tokenizer.encode(text, add_special_tokens=False)), tools)

    def encode(self, prompt: PromptInput, prefix: EncodedPrefix | None = None) -> tuple[list[int], int]:
        """The prompt's token ids, and how many of them came from ``prefix`` (0 when it did not apply)."""
        if prompt.token_ids is not None:
            return list(prompt.token_ids), 0
        if prompt.messages is None:
            return self._tokenizer.encode(prompt.text, add_special_tokens=prompt.add_special_tokens), 0
        text = self.render(prompt.messages, prompt.add_generation_prompt, prompt.tools)
        if prefix is not None and self.reuses_prefixes:
            reused = self._after_prefix(prompt.messages, text, prefix, prompt.tools)
            if reused is not None:
                return reused, len(prefix.token_ids)
        return self._tokenizer.encode(text, add_special_tokens=False), 0

    def _after_prefix(self, messages: tuple[Message, ...], text: str, prefix: EncodedPrefix,
                      tools: tuple[Tool, ...] = ()) -> list[int] | None:
        rest = text[len(prefix.text):]
        if (messages[:len(prefix.messages)] != prefix.messages or tools != prefix.tools
                or not text.startswith(prefix.text) or not rest.startswith(self._boundaries)):
            return None
        return [*prefix.token_ids, *self._tokenizer.encode(rest, add_special_tokens=False)]

    def _reuse_holds_on_a_sample(self) -> bool:
        if not self._boundaries or getattr(self._tokenizer, "chat_template", None) is None:
            return False
        whole = _SAMPLE + _SAMPLE_NEXT
        text = self.render(whole, add_generation_prompt=True)
        reused = self._after_prefix(whole, text, self.encode_prefix(_SAMPLE))
        return reused is not None and reused == self._tokenizer.encode(text, add_special_tokens=False)


def _message_dict(message: Message) -> dict:
    """A message as chat templates take it: tool calls with their arguments as an object (templates apply
    ``tojson``), a tool result with the id of its call."""
    entry: dict = {"role": message.role, "content": message.content}
    if message.tool_calls:
        entry["tool_calls"] = [{"id": call.id, "type": "function",
                                "function": {"name": call.name, "arguments": _json_or_text(call.arguments)}}
                               for call in message.tool_calls]
    if message.tool_call_id:
        entry["tool_call_id"] = message.tool_call_id
    return entry


def _tool_dict(tool: Tool) -> dict:
    parameters = _json_or_text(tool.parameters) if tool.parameters else {"type": "object"}
    return {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                             "parameters": parameters}}


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
