"""Tool calls: the constraint that forces one, and the split of a generation's text into text and calls.

Three ways a generation meets tools:

- ``REQUIRED`` or a named tool: decoding is constrained to JSON (a named
  tool's arguments, or an array of ``{"name", "arguments"}`` objects, each
  naming a given tool with arguments that match its schema), so the calls
  always parse and validate. The whole output is the calls; none of it is
  streamed as text.
- ``AUTO``: the model chooses, and the model's tool parser (vLLM's, chosen by
  ``AGW_INFERENCE_TOOL_PARSER``) finds calls in the output. Text streams as it
  comes, except that once the text could be opening a call (the parser's start
  marker, such as ``<tool_call>``, or a prefix of it at the end) it is held
  until the generation ends and the parser has had its say. Output the parser
  cannot read is returned as text: a weak model's garbage never fails a call.
- ``NONE`` or no tools: plain text.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass

from servicekit.errors import InvalidArgument

from inference.requests import Constraint, PromptInput, Tool, ToolCall, ToolMode

log = logging.getLogger(__name__)

#: Most calls one REQUIRED generation may make (the array's maxItems).
MAX_PARALLEL_CALLS = 8
_NO_ARGUMENTS = '{"type":"object"}'


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _parameters(tool: Tool) -> dict:
    return json.loads(tool.parameters) if tool.parameters else {"type": "object"}


def tool_call_constraint(prompt: PromptInput) -> Constraint | None:
    """The constraint that makes the output a valid call (REQUIRED or NAMED), or None."""
    choice = prompt.tool_choice
    if not prompt.tools or choice.mode in (ToolMode.AUTO, ToolMode.NONE):
        return None
    if choice.mode is ToolMode.NAMED:
        index, tool = next((i, t) for i, t in enumerate(prompt.tools) if t.name == choice.name)
        return Constraint("json", tool.parameters or _NO_ARGUMENTS, field=f"chat.tools[{index}].parameters")
    one_of = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": _parameters(t)},
               "required": ["name", "arguments"], "additionalProperties": False} for t in prompt.tools]
    schema = {"type": "array", "minItems": 1, "maxItems": MAX_PARALLEL_CALLS, "items": {"anyOf": one_of}}
    return Constraint("json", json.dumps(schema, separators=(",", ":")), field="chat.tools")


def choose_parser_name(setting: str, chat_template: str | None) -> str:
    """``AGW_INFERENCE_TOOL_PARSER``: a vLLM parser name, "none", or "auto" (read from the chat template)."""
    if setting != "auto":
        return "" if setting == "none" else setting
    if chat_template and "<tool_call>" in chat_template:
        return "hermes"  # the Hermes/Qwen convention, which the smoke model's template follows too
    return ""


@dataclass
class ToolParsing:
    """A vLLM tool parser for the model, and the marker that opens a call in its output."""

    name: str
    parser: object
    marker: str | None

    @classmethod
    def load(cls, name: str, tokenizer) -> ToolParsing | None:
        if not name:
            return None
        from vllm.tool_parsers import ToolParserManager

        try:
            parser = ToolParserManager.get_tool_parser(name)(tokenizer)
        except KeyError:
            raise ValueError(f"AGW_INFERENCE_TOOL_PARSER={name!r} is not one of vLLM's tool parsers: "
                             f"{', '.join(sorted(ToolParserManager.list_registered()))}") from None
        marker = getattr(parser, "tool_call_start_token", None) or getattr(parser, "bot_token", None)
        return cls(name, parser, marker)

    def extract(self, text: str, tools: tuple[Tool, ...]) -> tuple[str, tuple[ToolCall, ...]] | None:
        """(content, calls) when ``text`` holds calls of known tools; None when it holds none it can read."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest(
            model="agw", messages=[{"role": "user", "content": ""}],
            tools=[{"type": "function", "function": {"name": t.name, "description": t.description,
                                                     "parameters": _parameters(t)}} for t in tools])
        try:
            found = self.parser.extract_tool_calls(text, request)
        except Exception:  # noqa: BLE001 - a parser's bug must not fail the generation: the text stands
            log.warning("tool parser %s failed on the output; returned as text", self.name, exc_info=True)
            return None
        known = {t.name for t in tools}
        if not found.tools_called or any(call.function.name not in known for call in found.tool_calls):
            return None
        calls = tuple(ToolCall(new_call_id(), c.function.name, c.function.arguments) for c in found.tool_calls)
        return found.content or "", calls


class ToolOutput:
    """What of a generation's text streams now (:meth:`feed`) and what the end brings (:meth:`finish`)."""

    def __init__(self, prompt: PromptInput, parsing: ToolParsing | None) -> None:
        mode = prompt.tool_choice.mode if prompt.tools else ToolMode.NONE
        self._prompt = prompt
        self._mode = mode
        self._parsing = parsing if mode is ToolMode.AUTO else None
        # AUTO with no parser for this model: the text is the answer, as with NONE.
        self._holds_all = mode in (ToolMode.REQUIRED, ToolMode.NAMED) or (
            self._parsing is not None and not self._parsing.marker)
        self._text: list[str] = []
        self._sent = 0  # characters of the joined text already streamed
        self._pending = ""  # text after what was streamed, not yet known not to open a call
        self._holding = False

    @property
    def passes_through(self) -> bool:
        return not self._holds_all and self._parsing is None

    def feed(self, text: str) -> str:
        """The part of the text so far that may stream now."""
        if self.passes_through:
            return text
        self._text.append(text)
        if self._holds_all or self._holding:
            return ""
        # Only the unsent tail is searched, so a long answer costs linear time, not quadratic.
        pending, marker = self._pending + text, self._parsing.marker
        found = pending.find(marker)
        if found >= 0:
            self._holding = True
            sendable = found
        else:
            sendable = len(pending) - _partial_overlap(pending, marker)
        self._pending = pending[sendable:]
        self._sent += sendable
        return pending[:sendable]

    def finish(self) -> tuple[str, tuple[ToolCall, ...]]:
        """(text still to stream, the calls) once the generation ended."""
        if self.passes_through:
            return "", ()
        joined = "".join(self._text)
        rest = joined[self._sent:]
        if self._mode is ToolMode.NAMED:
            calls = self._named(joined)
        elif self._mode is ToolMode.REQUIRED:
            calls = self._required(joined)
        else:
            parsed = self._parsing.extract(joined, self._prompt.tools) if self._holding or self._holds_all else None
            if parsed is None:
                return rest, ()
            content, calls = parsed
            return content[self._sent:], calls
        return ("", calls) if calls else (rest, ())

    def _named(self, text: str) -> tuple[ToolCall, ...]:
        try:
            arguments = json.loads(text)
        except json.JSONDecodeError:
            return ()  # cut short (max_tokens): returned as text with finish reason LENGTH
        if not isinstance(arguments, dict):
            return ()
        return (ToolCall(new_call_id(), self._prompt.tool_choice.name, text),)

    def _required(self, text: str) -> tuple[ToolCall, ...]:
        try:
            calls = json.loads(text)
        except json.JSONDecodeError:
            return ()
        if not isinstance(calls, list):
            return ()
        return tuple(ToolCall(new_call_id(), c["name"], json.dumps(c["arguments"], separators=(",", ":"),
                                                                   ensure_ascii=False))
                     for c in calls if isinstance(c, dict) and "name" in c and "arguments" in c)


def _partial_overlap(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


def check_constraint_exclusive(prompt: PromptInput, constraint: Constraint | None) -> None:
    """A forced tool call constrains decoding itself; a second constraint cannot apply."""
    if constraint is not None and prompt.tools and prompt.tool_choice.mode in (ToolMode.REQUIRED, ToolMode.NAMED):
        raise InvalidArgument("sampling.structured_output",
                              "cannot be combined with tool_choice REQUIRED or a named tool, which constrain "
                              "the output to the tool's arguments; drop one")
