"""The ``agent.inference.v1.Inference`` servicer and the app the bootstrap runs.

The servicer only converts and delegates: validation lives in ``requests.py``,
conversion in ``convert.py``, the engine in ``engine.py``.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing, asynccontextmanager

from agent.inference.v1 import inference_pb2, inference_pb2_grpc
from servicekit.errors import Unavailable
from servicekit.server import Health

from inference.convert import (
    delta_to_proto,
    load_to_proto,
    model_info_to_proto,
    prompt_from_generate,
    prompt_from_tokenize,
    result_to_proto,
    sampling_from_proto,
)
from inference.engine import Engine, open_engine
from inference.requests import Delta, resolve_sampling
from inference.settings import InferenceSettings

log = logging.getLogger(__name__)

INFERENCE_SERVICE = inference_pb2.DESCRIPTOR.services_by_name["Inference"]


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """Serves one engine; the app attaches it once warm."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
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

    async def Generate(self, request, context):
        engine = self._engine()
        prompt = prompt_from_generate(request)
        sampling = resolve_sampling(sampling_from_proto(request.sampling), engine.limits)
        request_id = request.request_id or engine.new_request_id()
        self._abort_when_cancelled(context, engine, request_id)
        async with aclosing(engine.generate(prompt, sampling, request_id)) as events:
            async for event in events:
                yield delta_to_proto(event) if isinstance(event, Delta) else result_to_proto(event)

    async def Tokenize(self, request, context):
        token_ids = await self._engine().tokenize(prompt_from_tokenize(request))
        return inference_pb2.TokenizeResponse(token_ids=token_ids)

    async def GetModelInfo(self, request, context):
        return model_info_to_proto(self._engine().info)

    async def GetLoad(self, request, context):
        return load_to_proto(self._engine().load())


class InferenceApp:
    """The inference service, as the servicekit bootstrap runs it."""

    name = "inference"
    services = (INFERENCE_SERVICE,)

    def __init__(self, settings: InferenceSettings) -> None:
        self.settings = settings
        self.servicer = InferenceServicer()

    def register(self, server) -> None:
        inference_pb2_grpc.add_InferenceServicer_to_server(self.servicer, server)

    @asynccontextmanager
    async def lifespan(self, health: Health):
        async def on_death() -> None:
            await health.set_serving(False)

        async with open_engine(self.settings, on_death=on_death) as engine:
            self.servicer.engine = engine
            try:
                yield
            finally:
                self.servicer.engine = None
