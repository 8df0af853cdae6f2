"""Conversion between ``agent.inference.v1`` messages and the inference service's domain types.

The one place in the service that knows both. The chat roles' names here are
the chat templates' (``system``, ``user``, ...): the inference service owns
templates; other services use the contract's enum values only.
"""

from __future__ import annotations

import dataclasses
import json

from agent.inference.v1 import inference_pb2 as pb

from inference.requests import (
    Constraint,
    Delta,
    FinishReason,
    Load,
    Message,
    ModelInfo,
    PromptInput,
    Result,
    SamplingInput,
    Tool,
    ToolCall,
    ToolChoice,
    ToolMode,
    check_prompt_input,
)

_ROLE_NAMES = {
    pb.ROLE_SYSTEM: "system",
    pb.ROLE_USER: "user",
    pb.ROLE_ASSISTANT: "assistant",
    pb.ROLE_TOOL: "tool",
}
_FINISH_REASONS = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
    FinishReason.TOOL_CALLS: pb.FINISH_REASON_TOOL_CALLS,
}
_TOOL_MODES = {
    pb.TOOL_CHOICE_MODE_UNSPECIFIED: ToolMode.AUTO,
    pb.TOOL_CHOICE_MODE_AUTO: ToolMode.AUTO,
    pb.TOOL_CHOICE_MODE_NONE: ToolMode.NONE,
    pb.TOOL_CHOICE_MODE_REQUIRED: ToolMode.REQUIRED,
}


def _optional(message, name: str):
    return getattr(message, name) if message.HasField(name) else None


def messages_from_proto(chat: pb.ChatMessages) -> tuple[Message, ...]:
    # An unknown or unset role becomes "" and is rejected by check_prompt_input.
    return tuple(Message(_ROLE_NAMES.get(m.role, ""), m.content, tool_calls_from_proto(m.tool_calls), m.tool_call_id)
                 for m in chat.messages)


def tools_from_proto(chat: pb.ChatMessages) -> tuple[Tool, ...]:
    return tuple(Tool(t.name, t.description, t.parameters) for t in chat.tools)


def tool_calls_from_proto(calls) -> tuple[ToolCall, ...]:
    return tuple(ToolCall(c.id, c.name, c.arguments) for c in calls)


def tool_calls_to_proto(calls: tuple[ToolCall, ...]) -> list[pb.ToolCall]:
    return [pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls]


def tool_choice_from_proto(choice: pb.ToolChoice) -> ToolChoice:
    if choice.WhichOneof("choice") == "tool_name":
        return ToolChoice(ToolMode.NAMED, choice.tool_name)
    return ToolChoice(_TOOL_MODES.get(choice.mode, ToolMode.AUTO))


def constraint_from_proto(structured: pb.StructuredOutput) -> Constraint | None:
    kind = structured.WhichOneof("constraint")
    field = f"sampling.structured_output.{kind}"
    if kind == "json_schema":
        return Constraint("json", structured.json_schema, field)
    if kind == "regex":
        return Constraint("regex", structured.regex, field)
    if kind == "choice":
        return Constraint("choice", json.dumps(list(structured.choice.values)), field)
    if kind == "grammar":
        return Constraint("grammar", structured.grammar, field)
    return None


def prompt_from_generate(request: pb.GenerateRequest) -> PromptInput:
    kind = request.WhichOneof("input")
    if kind == "prompt":
        prompt = PromptInput(text=request.prompt)
    elif kind == "chat":
        prompt = PromptInput(
            messages=messages_from_proto(request.chat),
            add_generation_prompt=request.chat.add_generation_prompt if request.chat.HasField("add_generation_prompt") else True,
            tools=tools_from_proto(request.chat),
            tool_choice=tool_choice_from_proto(request.tool_choice),
        )
    elif kind == "token_ids":
        prompt = PromptInput(token_ids=tuple(request.token_ids.ids))
    else:
        prompt = PromptInput()
    if request.cache_salt:
        prompt = dataclasses.replace(prompt, cache_salt=request.cache_salt)
    check_prompt_input(prompt)
    return prompt


def prompt_from_tokenize(request: pb.TokenizeRequest) -> PromptInput:
    kind = request.WhichOneof("input")
    if kind == "text":
        prompt = PromptInput(
            text=request.text,
            add_special_tokens=request.add_special_tokens if request.HasField("add_special_tokens") else True,
        )
    elif kind == "chat":
        prompt = PromptInput(messages=messages_from_proto(request.chat), tools=tools_from_proto(request.chat))
    else:
        prompt = PromptInput()
    check_prompt_input(prompt)
    return prompt


def sampling_from_proto(sampling: pb.SamplingParams) -> SamplingInput:
    return SamplingInput(
        max_tokens=_optional(sampling, "max_tokens"),
        temperature=_optional(sampling, "temperature"),
        top_p=_optional(sampling, "top_p"),
        top_k=_optional(sampling, "top_k"),
        stop=tuple(sampling.stop),
        seed=_optional(sampling, "seed"),
        ignore_eos=sampling.ignore_eos,
        constraint=constraint_from_proto(sampling.structured_output),
    )


def delta_to_proto(delta: Delta) -> pb.GenerateResponse:
    return pb.GenerateResponse(text=delta.text, token_ids=delta.token_ids)


def result_to_proto(result: Result) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        result=pb.GenerationResult(
            finish_reason=_FINISH_REASONS[result.finish_reason],
            usage=pb.Usage(
                prompt_tokens=result.usage.prompt_tokens,
                completion_tokens=result.usage.completion_tokens,
                cached_prompt_tokens=result.usage.cached_prompt_tokens,
            ),
            timings=pb.GenerationTimings(
                queue_ms=result.timings.queue_ms,
                first_token_ms=result.timings.first_token_ms,
                decode_ms=result.timings.decode_ms,
                total_ms=result.timings.total_ms,
            ),
            request_id=result.request_id,
            tool_calls=tool_calls_to_proto(result.tool_calls),
            structured_output_backend=result.structured_output_backend,
            constraint_cache_hit=result.constraint_cache_hit,
        )
    )


def model_info_to_proto(info: ModelInfo) -> pb.GetModelInfoResponse:
    return pb.GetModelInfoResponse(
        model=info.model,
        max_context_tokens=info.max_context_tokens,
        dtype=info.dtype,
        block_size=info.block_size,
        prefix_caching=info.prefix_caching,
        chunked_prefill=info.chunked_prefill,
        max_num_seqs=info.max_num_seqs,
        max_num_batched_tokens=info.max_num_batched_tokens,
        quantization=info.quantization,
        device=info.device,
        vocab_size=info.vocab_size,
        kv_cache_tokens=info.kv_cache_tokens,
    )


def load_to_proto(load: Load) -> pb.GetLoadResponse:
    return pb.GetLoadResponse(
        running_requests=load.running,
        waiting_requests=load.waiting,
        kv_cache_usage=load.kv_cache_usage,
        generated_tokens_total=load.generated_tokens_total,
    )
