"""A scripted Inference service for testing the server bootstrap itself.

It runs on the real bootstrap (mTLS, health, drain) but its handlers follow a
script instead of running a model, so tests can hold a stream open for a known
time or raise a chosen error on demand. The real inference service is tested
against vLLM elsewhere; this exists only to inject timings and faults.

Script, through the request:
- Generate: ``prompt`` = "tokens=N delay=S" streams N messages S seconds apart;
  "pad=B" adds B bytes to each message's text (to fill flow-control windows).
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

from agent.inference.v1 import inference_pb2, inference_pb2_grpc
from servicekit import InvalidArgument, ResourceExhausted, ServiceSettings, main_for, prefixed_config

INFERENCE_SERVICE = inference_pb2.DESCRIPTOR.services_by_name["Inference"]


class ScriptedSettings(ServiceSettings):
    model_config = prefixed_config("scripted")

    identity: str = "inference"  # it stands in for the inference service, with its certificate
    warmup_s: float = 0.0
    closed_file: Path | None = None


def parse_script(prompt: str) -> tuple[int, float, int]:
    fields = dict(part.split("=", 1) for part in prompt.split() if "=" in part)
    return int(fields.get("tokens", 3)), float(fields.get("delay", 0)), int(fields.get("pad", 0))


class ScriptedInference(inference_pb2_grpc.InferenceServicer):
    def __init__(self) -> None:
        self.closed: list[str] = []
        #: Generate calls started (Chat turns that reached the engine).
        self.generations = 0
        #: Each Generate call's request metadata (what the gateway propagates).
        self.metadata: list[dict] = []

    async def Generate(self, request, context):
        # A plain prompt is the script; a chat's script is its last message (the user's, through Chat).
        script = request.chat.messages[-1].content if request.HasField("chat") else request.prompt
        tokens, delay, pad = parse_script(script.rsplit("Question: ", 1)[-1])
        self.generations += 1
        self.metadata.append(dict(context.invocation_metadata()))
        if "crash" in script.split():
            raise RuntimeError("scripted crash inside the inference service")
        try:
            for index in range(tokens):
                if index:
                    await asyncio.sleep(delay)
                yield inference_pb2.GenerateResponse(text=f"t{index} " + "x" * pad, token_ids=[index])
            yield inference_pb2.GenerateResponse(
                result=inference_pb2.GenerationResult(finish_reason=inference_pb2.FINISH_REASON_LENGTH)
            )
        finally:
            self.closed.append(request.prompt)

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
        self.servicer = ScriptedInference()

    def register(self, server) -> None:
        inference_pb2_grpc.add_InferenceServicer_to_server(self.servicer, server)

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
