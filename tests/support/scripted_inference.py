"""A scripted Inference service for testing the server bootstrap itself.

It runs on the real bootstrap (mTLS, health, drain) but its handlers follow a
script instead of running a model, so tests can hold a stream open for a known
time or raise a chosen error on demand. The real inference service is tested
against vLLM elsewhere; this exists only to inject timings and faults.

Script, through the request:
- Generate: ``prompt`` = "tokens=N delay=S" streams N messages S seconds apart;
  "pad=B" adds B bytes to each message's text (to fill flow-control windows);
  "first=S" waits S seconds before the first message (a backend silent that long);
  "call=NAME" ends with a call of tool NAME (finish reason TOOL_CALLS);
  "drop=N" ends the stream UNAVAILABLE after N messages (a replica lost mid-stream).
  With ``fail_generate`` every generation is refused UNAVAILABLE before its first
  message (a replica that went away between routing and the call).
  Every stream's prompt is appended to ``ScriptedInference.closed`` when its
  handler's cleanup has run, however the call ended.
- Tokenize: ``text`` = "invalid" | "busy" | "crash" raises that failure;
  anything else returns one id per character.

Run as a process: ``python -m tests.support.scripted_inference`` with
``AGW_SCRIPTED_PORT_FILE``, ``AGW_TLS_DIR`` and optionally
``AGW_SCRIPTED_WARMUP_S`` and ``AGW_SCRIPTED_CLOSED_FILE``.
"""

from __future__ import annotations

import asyncio
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import grpc

from agent.inference.v1 import inference_pb2, inference_pb2_grpc
from servicekit import InvalidArgument, ResourceExhausted, ServiceSettings, main_for, prefixed_config
from inference.public_generate import PublicGenerate
from servicekit.errors import Unavailable
from servicekit.public_api import PublicApiSettings

INFERENCE_SERVICE = inference_pb2.DESCRIPTOR.services_by_name["Inference"]


class ScriptedSettings(ServiceSettings, PublicApiSettings):
    model_config = prefixed_config("scripted")

    identity: str = "inference"  # it stands in for the inference service, with its certificate
    warmup_s: float = 0.0
    open_generate: bool = True  # false: answer OpenGenerate UNIMPLEMENTED, as a service older than it
    closed_file: Path | None = None
    fail_generate: bool = False  # true: every Generate and OpenGenerate ends UNAVAILABLE before a message
    replica_name: str = ""  # set: answer WatchLoad (idle, with this name), as an inference service does


def parse_script(prompt: str) -> tuple[int, float, int]:
    fields = _fields(prompt)
    return int(fields.get("tokens", 3)), float(fields.get("delay", 0)), int(fields.get("pad", 0))


def _fields(prompt: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in prompt.split() if "=" in part)


def _result(script: str, generation: int) -> inference_pb2.GenerationResult:
    tool = _fields(script).get("call")
    if tool is None:
        return inference_pb2.GenerationResult(finish_reason=inference_pb2.FINISH_REASON_LENGTH)
    call = inference_pb2.ToolCall(id=f"call_{generation}", name=tool, arguments=f'{{"step":{generation}}}')
    return inference_pb2.GenerationResult(finish_reason=inference_pb2.FINISH_REASON_TOOL_CALLS, tool_calls=[call])


class ScriptedInference(inference_pb2_grpc.InferenceServicer):
    """Generate and OpenGenerate (unless ``open_generate`` is off, as an older service) with scripted output."""

    def __init__(self, open_generate: bool = True, fail_generate: bool = False, replica_name: str = "") -> None:
        self.open_generate = open_generate
        self.fail_generate = fail_generate
        self.replica_name = replica_name
        self.closed: list[str] = []
        #: Generate calls started (Chat turns that reached the engine).
        self.generations = 0
        #: Each Generate call's request metadata (what the gateway propagates).
        self.metadata: list[dict] = []
        #: Each generation's request, as received (the prompt the gateway laid out).
        self.requests: list[inference_pb2.GenerateRequest] = []
        #: The chat prefix each OpenGenerate call received ahead of its request (None: none sent).
        self.prefixes: list[inference_pb2.ChatMessages | None] = []
        #: The cache salt each of those prefixes asked to be prefilled under (None: not asked).
        self.prefill_salts: list[str | None] = []
        #: Calls by method name, counted as they arrive.
        self.calls: dict[str, int] = {}
        #: Messages each script's stream has handed to gRPC so far (how far a stream got).
        self.sent: dict[str, int] = {}

    async def OpenGenerate(self, request_iterator, context):
        if not self.open_generate:
            raise NotImplementedError  # what the generated servicer does for a method a server lacks
        self.calls["OpenGenerate"] = self.calls.get("OpenGenerate", 0) + 1
        prefix = prefill_salt = None
        while True:
            message = await context.read()
            if message is grpc.aio.EOF:
                raise InvalidArgument("request", "the call ended before its request")
            if message.HasField("prefix"):
                prefix = message.prefix
                prefill_salt = message.prefill_cache_salt if message.HasField("prefill_cache_salt") else None
                continue
            break
        self.prefixes.append(prefix)
        self.prefill_salts.append(prefill_salt)
        async for response in self.Generate(message.request, context):
            yield response

    async def Generate(self, request, context):
        # A plain prompt is the script; a chat's script is its last message (the user's, through Chat).
        script = request.chat.messages[-1].content if request.HasField("chat") else request.prompt
        tokens, delay, pad = parse_script(script.rsplit("Question: ", 1)[-1])
        self.generations += 1
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        if "crash" in script.split():
            raise RuntimeError("scripted crash inside the inference service")
        if self.fail_generate:
            raise Unavailable("scripted replica refuses every generation")
        drop = int(_fields(script).get("drop", -1))
        try:
            await asyncio.sleep(float(_fields(script).get("first", 0)))
            for index in range(tokens):
                if index == drop:
                    raise Unavailable(f"scripted replica lost after {drop} messages")
                if index:
                    await asyncio.sleep(delay)
                yield inference_pb2.GenerateResponse(text=f"t{index} " + "x" * pad, token_ids=[index])
                self.sent[script] = index + 1
            yield inference_pb2.GenerateResponse(result=_result(script, self.generations))
        finally:
            self.closed.append(request.prompt)

    async def WatchLoad(self, request, context):
        if not self.replica_name:
            raise NotImplementedError  # as a service older than WatchLoad
        await context.write(inference_pb2.WatchLoadResponse(replica=self.replica_name))
        await asyncio.Event().wait()  # idle for ever: no change to push

    async def Tokenize(self, request, context):
        if request.text == "invalid":
            raise InvalidArgument("text", "scripted invalid input")
        if request.text == "busy":
            raise ResourceExhausted("scripted overload", retry_after_s=0.25)
        if request.text == "crash":
            raise RuntimeError("scripted crash")
        return inference_pb2.TokenizeResponse(token_ids=[ord(c) for c in request.text])


class ScriptedApp:
    name = "scripted"
    services = (INFERENCE_SERVICE,)

    def __init__(self, settings: ScriptedSettings) -> None:
        self.settings = settings
        self.servicer = ScriptedInference(open_generate=settings.open_generate, fail_generate=settings.fail_generate,
                                          replica_name=settings.replica_name)
        # With edge_clients, the public Generate too, as the inference service serves it (for the edge's routing).
        self.public = PublicGenerate(settings, self.servicer) if settings.edge_client_patterns else None
        if self.public is not None:
            self.public.declare_on(self)

    def register(self, server) -> None:
        inference_pb2_grpc.add_InferenceServicer_to_server(self.servicer, server)
        if self.public is not None:
            self.public.register(server)

    @asynccontextmanager
    async def lifespan(self, health):
        await asyncio.sleep(self.settings.warmup_s)
        try:
            yield
        finally:
            if self.settings.closed_file is not None:
                self.settings.closed_file.write_text("closed\n")


def main() -> int:
    return main_for(ScriptedSettings, ScriptedApp)


if __name__ == "__main__":
    sys.exit(main())
