"""The ``agent.inference.v1.Inference`` servicer and the app the bootstrap runs.

The servicer only converts and delegates: validation lives in ``requests.py``,
conversion in ``convert.py``, the engine in ``engine.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import aclosing, asynccontextmanager

import grpc
from opentelemetry import trace

from agent.inference.v1 import inference_pb2, inference_pb2_grpc
from servicekit.errors import InvalidArgument, Unavailable
from servicekit.metrics import counter, gauge, meter
from servicekit.server import Health
from servicekit.tasks import cancel_and_wait

from inference.convert import (
    delta_to_proto,
    load_to_proto,
    messages_from_proto,
    model_info_to_proto,
    prompt_from_generate,
    prompt_from_tokenize,
    result_to_proto,
    sampling_from_proto,
    tools_from_proto,
)
from inference.engine import Engine, open_engine
from inference.prefix_prefill import OUTCOMES, PrefixPrefills
from inference.prompt_encoding import EncodedPrefix
from inference.requests import Delta, PromptInput, Result, Sampling, resolve_sampling
from inference.settings import MAX_LOAD_WATCH_INTERVAL_MS, InferenceSettings
from inference.public_generate import PublicGenerate

log = logging.getLogger(__name__)
tracer = trace.get_tracer("agent-gateway.inference")

INFERENCE_SERVICE = inference_pb2.DESCRIPTOR.services_by_name["Inference"]


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """Serves one engine; the app attaches it once warm."""

    def __init__(self, trace_content: bool = False, *, replica_name: str = "", load_watch_interval_ms: int = 100,
                 prefill_prefixes: bool = True) -> None:
        self.engine: Engine | None = None
        self.trace_content = trace_content
        self.prefills = PrefixPrefills(prefill_prefixes)
        self.replica_name = replica_name
        self.load_watch_interval_ms = load_watch_interval_ms
        # Abort tasks started from done-callbacks, kept so they are not
        # garbage-collected mid-flight.
        self._aborts: set[asyncio.Task] = set()

    def _engine(self) -> Engine:
        if self.engine is None:
            raise Unavailable("inference engine is not running")
        return self.engine

    def _abort_when_cancelled(self, context, engine: Engine, request_id: str) -> None:
        """Abort the engine request the moment the RPC is cancelled or times out.

        Closing the stream also aborts it, but only when the handler next
        runs; this callback does not wait for that.
        """

        def on_done(ctx) -> None:
            if ctx.cancelled():
                task = asyncio.get_running_loop().create_task(engine.abort(request_id))
                self._aborts.add(task)
                task.add_done_callback(self._aborts.discard)

        context.add_done_callback(on_done)

    async def Generate(self, request, context, prefix: EncodedPrefix | None = None):
        engine = self._engine()
        prompt = prompt_from_generate(request)
        sampling = resolve_sampling(sampling_from_proto(request.sampling), engine.limits)
        request_id = request.request_id or engine.new_request_id()
        self._abort_when_cancelled(context, engine, request_id)
        with self._generation_span(engine, prompt, sampling, request_id) as span:
            started = time.perf_counter()
            first_token = True
            output: list[str] = []
            async with aclosing(engine.generate(prompt, sampling, request_id, prefix)) as events:
                async for event in events:
                    if isinstance(event, Delta):
                        if first_token:
                            first_token = False
                            span.add_event("gen_ai.first_token", {
                                "agw.time_to_first_token_ms": round((time.perf_counter() - started) * 1000, 3),
                            })
                        if self.trace_content:
                            output.append(event.text)
                        yield delta_to_proto(event)
                    else:
                        _record_result(span, event, output if self.trace_content else None)
                        yield result_to_proto(event)

    async def OpenGenerate(self, request_iterator, context):
        """Generate, on a call opened before its prompt was ready: maybe a prefix, then the request."""
        engine = self._engine()
        prefix: asyncio.Task | None = None
        prefill: asyncio.Task | None = None
        try:
            while True:
                message = await context.read()  # the server reads up to the request, no more
                if message is grpc.aio.EOF:
                    raise InvalidArgument("request", "the request stream ended before its GenerateRequest; "
                                          "send exactly one")
                part = message.WhichOneof("part")
                if part == "request":
                    break
                if part != "prefix":
                    raise InvalidArgument("part", "is empty; send the prefix or the request")
                if prefix is not None:
                    raise InvalidArgument("prefix", "was sent twice; send at most one, before the request")
                trace.get_current_span().add_event("agw.prefix_received")
                # Tokenized while the caller builds the rest of its prompt.
                prefix = asyncio.ensure_future(engine.encode_prefix(messages_from_proto(message.prefix),
                                                                    tools_from_proto(message.prefix)))
                if message.HasField("prefill_cache_salt"):  # and prefilled, when the engine has room
                    prefill = self.prefills.start(engine, prefix, message.prefill_cache_salt)
            trace.get_current_span().add_event("agw.request_received")
            if prefill is not None:
                outcome = await self.prefills.finish(prefill)
                trace.get_current_span().add_event("agw.prefix_prefill", {"agw.prefix_prefill.outcome": outcome})
            encoded = None
            if prefix is not None:
                try:
                    encoded = await prefix
                except Exception:  # noqa: BLE001 - an optimisation: a bad prefix fails nothing, the request is checked
                    log.debug("prefix not reused", exc_info=True)
            async with aclosing(self.Generate(message.request, context, prefix=encoded)) as messages:
                async for response in messages:
                    yield response
        finally:
            if prefill is not None and not prefill.done():
                await cancel_and_wait(prefill)
            if prefix is not None and not prefix.done():
                prefix.cancel()

    def _generation_span(self, engine: Engine, prompt: PromptInput, sampling: Sampling, request_id: str):
        """A span with the GenAI semantic-convention request attributes."""
        operation = "chat" if prompt.messages is not None else "text_completion"
        attributes = {
            "gen_ai.operation.name": operation,
            "gen_ai.system": "vllm",
            "gen_ai.request.model": engine.info.model,
            "gen_ai.request.max_tokens": sampling.max_tokens,
            "gen_ai.request.temperature": sampling.temperature,
            "gen_ai.request.top_p": sampling.top_p,
            "gen_ai.response.id": request_id,
        }
        if sampling.seed is not None:
            attributes["gen_ai.request.seed"] = sampling.seed
        if self.trace_content:
            attributes["gen_ai.input.messages"] = _prompt_text(prompt)
        return tracer.start_as_current_span(f"{operation} {engine.info.model}", attributes=attributes)

    async def Tokenize(self, request, context):
        token_ids = await self._engine().tokenize(prompt_from_tokenize(request))
        return inference_pb2.TokenizeResponse(token_ids=token_ids)

    async def GetModelInfo(self, request, context):
        return model_info_to_proto(self._engine().info)

    async def GetLoad(self, request, context):
        return load_to_proto(self._engine().load())

    async def WatchLoad(self, request, context):
        """The load at once, then on each change, at most one message per interval.

        The engine's load is in memory here (its in-flight requests and the
        scheduler's last snapshot), so reading it each interval costs nothing
        that a change notification would save, and keeps the engine's request
        path free of watcher bookkeeping.
        """
        interval_s = watch_interval_s(request.interval_ms, self.load_watch_interval_ms)
        last = None
        while True:
            load = self._engine().load()
            current = (load.running, load.waiting, round(load.kv_cache_usage, 2))
            if current != last:
                await context.write(inference_pb2.WatchLoadResponse(
                    running_requests=load.running, waiting_requests=load.waiting,
                    kv_cache_usage=load.kv_cache_usage, replica=self.replica_name,
                    max_running_requests=self._engine().info.max_num_seqs))
                last = current
            await asyncio.sleep(interval_s)


def watch_interval_s(requested_ms: int, least_ms: int) -> float:
    """A WatchLoad stream's interval: what the caller asked for (0: the least), within [least, 60 s]."""
    return min(max(requested_ms, least_ms), MAX_LOAD_WATCH_INTERVAL_MS) / 1000


def _prompt_text(prompt: PromptInput) -> str:
    if prompt.messages is not None:
        return json.dumps([{"role": m.role, "content": m.content} for m in prompt.messages])
    if prompt.text is not None:
        return json.dumps([{"role": "user", "content": prompt.text}])
    return json.dumps({"token_ids": list(prompt.token_ids or ())})


def _record_result(span, result: Result, output: list[str] | None) -> None:
    span.set_attributes({
        "gen_ai.response.finish_reasons": [result.finish_reason.value],
        "gen_ai.usage.input_tokens": result.usage.prompt_tokens,
        "gen_ai.usage.output_tokens": result.usage.completion_tokens,
        "gen_ai.usage.cache_read.input_tokens": result.usage.cached_prompt_tokens,
        "agw.timings.queue_ms": result.timings.queue_ms,
        "agw.timings.first_token_ms": result.timings.first_token_ms,
        "agw.timings.decode_ms": result.timings.decode_ms,
        "agw.tool_calls": len(result.tool_calls),
        "agw.structured_output.backend": result.structured_output_backend,
        "agw.structured_output.cache_hit": result.constraint_cache_hit,
    })
    if output is not None:
        span.set_attribute("gen_ai.output.messages", json.dumps([{"role": "assistant", "content": "".join(output)}]))


def _observe(engine: Engine, prefills: PrefixPrefills) -> None:
    """Gauges read at each scrape: the engine's queue and KV cache; and the prefix prefills' outcomes."""
    inference_meter = meter("inference")
    counter(inference_meter, "agw.inference.prefix_prefills",
            lambda: [(prefills.outcomes[outcome], {"outcome": outcome}) for outcome in OUTCOMES],
            description="OpenGenerate prefixes prefilled before their request arrived, or why not (stopped: the "
                        "request came first; busy: a request waited in the engine).")

    def requests():
        load = engine.load()
        return [(load.running, {"state": "running"}), (load.waiting, {"state": "waiting"})]

    gauge(inference_meter, "agw.engine.requests", requests, description="Engine requests running and waiting.")
    gauge(inference_meter, "agw.engine.kv_cache.usage", lambda: [(engine.load().kv_cache_usage, {})],
          description="Fraction of the KV cache in use (0-1).")
    if engine.constraints is not None:
        cache = engine.constraints
        counter(inference_meter, "agw.inference.constraint_cache",
                lambda: [(cache.hits, {"outcome": "hit"}), (cache.misses, {"outcome": "miss"})],
                description="Structured-output constraints found compiled (hit) or compiled (miss).")


class InferenceApp:
    """The inference service, as the servicekit bootstrap runs it."""

    name = "inference"
    services = (INFERENCE_SERVICE,)

    def __init__(self, settings: InferenceSettings) -> None:
        self.settings = settings
        self.servicer = InferenceServicer(trace_content=settings.trace_content, replica_name=settings.replica_name,
                                           load_watch_interval_ms=settings.load_watch_interval_ms,
                                           prefill_prefixes=settings.prefill_prefixes)
        # With an edge (AGW_INFERENCE_EDGE_CLIENTS), the public Generate too: for tenants, through the edge only.
        self.public = PublicGenerate(settings, self.servicer) if settings.edge_client_patterns else None
        if self.public is not None:
            self.public.declare_on(self)

    def register(self, server) -> None:
        inference_pb2_grpc.add_InferenceServicer_to_server(self.servicer, server)
        if self.public is not None:
            self.public.register(server)

    @asynccontextmanager
    async def lifespan(self, health: Health):
        async def on_death() -> None:
            await health.set_serving(False)

        async with open_engine(self.settings, on_death=on_death) as engine:
            _observe(engine, self.servicer.prefills)
            self.servicer.engine = engine
            try:
                yield
            finally:
                self.servicer.engine = None
