"""vLLM's AsyncLLM behind a small domain API: tokenize, generate, load, info.

Tokenizing and chat templating run on our own thread pool, never on the event
loop, and the engine receives token ids, so a prompt is tokenized exactly once
and its length is checked before it reaches the scheduler. The engine's
constructor blocks for tens of seconds (it starts the engine-core process), so
it runs in a thread too: health checks keep answering NOT_SERVING meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack, aclosing, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from opentelemetry import trace

from servicekit.errors import InvalidArgument, ResourceExhausted, Unavailable
from servicekit.json_schema import SchemaVerdicts, check_schema

from inference.constraints import MAX_SCHEMA_DEPTH, CompiledConstraint, ConstraintCache
from inference.engine_plan import EnginePlan, ModelShape, Platform, plan_engine
from inference.load import LoadTracker
from inference.prompt_encoding import EncodedPrefix, PromptEncoder
from inference.requests import (
    Delta,
    FinishReason,
    Limits,
    Load,
    Message,
    ModelInfo,
    PromptInput,
    Constraint,
    Result,
    Sampling,
    Timings,
    Usage,
    Tool,
    check_fits_context,
    check_token_ids,
)
from inference.settings import InferenceSettings
from inference.smoke_model import build_smoke_model
from inference.tools import (
    ToolOutput,
    ToolParsing,
    check_constraint_exclusive,
    choose_parser_name,
    tool_call_constraint,
)

log = logging.getLogger(__name__)
_TRACER = trace.get_tracer("agent-gateway.inference")

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}
WARMUP_TEXT = "Warm-up: the tokenizer and the engine see one request before real traffic does."
#: The first constrained request starts the engine's structured-output backend (its tokenizer tables):
#: warm-up sends one, so no caller pays for it.
WARMUP_SCHEMA = '{"type":"object","properties":{"ok":{"type":"boolean"}},"required":["ok"]}'


@dataclass(frozen=True)
class StructuredOutputs:
    """What shapes a generation's output: a vLLM constraint (compiled, cached or not) and the tool calls'
    parsing."""

    compiled: CompiledConstraint | None
    cache_hit: bool
    tool_output: ToolOutput


def detect_platform() -> Platform:
    """CPU or CUDA, and the memory that sizing works from."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        return Platform(device="cpu", total_memory_gib=total)
    import torch

    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    return Platform(device="cuda", total_memory_gib=total)


def resolve_model(settings: InferenceSettings) -> str:
    """The model to load: AGW_MODEL, or the smoke model (built on first use)."""
    if settings.model:
        return settings.model
    return str(build_smoke_model(settings.smoke_model_dir))


@dataclass
class StartupStep:
    name: str
    ms: float


class Engine:
    """One vLLM engine, its tokenizer and its load. Build it with :func:`open_engine`."""

    def __init__(self, llm, encoder: PromptEncoder, executor: ThreadPoolExecutor, settings: InferenceSettings,
                 tracker: LoadTracker, model_name: str, device: str, vocab_size: int,
                 constraints: ConstraintCache | None = None, tool_parsing: ToolParsing | None = None) -> None:
        self._llm = llm
        self._encoder = encoder
        self.constraints = constraints
        self.tool_parsing = tool_parsing
        self._schema_verdicts = SchemaVerdicts()
        self._executor = executor
        self._settings = settings
        self._tracker = tracker
        # Ids of requests admitted to the engine (load, capacity, abort) and
        # ids claimed by any call still running, admitted or not (uniqueness).
        self._in_flight: set[str] = set()
        self._claimed_ids: set[str] = set()
        #: Prefix prefills running (:meth:`prefill`): they take batch places too.
        self._prefilling = 0
        self.dead_reason: str | None = None
        config = llm.vllm_config
        self.info = ModelInfo(
            model=model_name,
            max_context_tokens=config.model_config.max_model_len,
            dtype=str(config.model_config.dtype).removeprefix("torch."),
            block_size=config.cache_config.block_size,
            prefix_caching=bool(config.cache_config.enable_prefix_caching),
            chunked_prefill=bool(config.scheduler_config.enable_chunked_prefill),
            max_num_seqs=config.scheduler_config.max_num_seqs,
            max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
            quantization=config.model_config.quantization or "",
            device=device,
            vocab_size=vocab_size,
            kv_cache_tokens=(config.cache_config.num_gpu_blocks or 0) * config.cache_config.block_size,
        )
        self.limits = Limits(
            max_context_tokens=self.info.max_context_tokens,
            vocab_size=self.info.vocab_size,
            default_max_tokens=min(settings.default_max_tokens, self.info.max_context_tokens - 1),
        )

    # -- tokenizing, off the loop ------------------------------------------------

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def tokenize(self, prompt: PromptInput) -> list[int]:
        """Token ids of ``prompt``, exactly as :meth:`generate` would see them."""
        return (await self._encode(prompt))[0]

    async def _encode(self, prompt: PromptInput, prefix: EncodedPrefix | None = None) -> tuple[list[int], int]:
        self._check_alive()
        if prompt.token_ids is not None:  # nothing to tokenize: a list copy costs less than a thread's round trip
            token_ids, reused = self._encoder.encode(prompt, prefix)
        else:
            token_ids, reused = await self._off_loop(self._encoder.encode, prompt, prefix)
        check_token_ids(token_ids, self.limits)
        return token_ids, reused

    async def encode_prefix(self, messages: tuple[Message, ...], tools: tuple[Tool, ...] = ()) -> EncodedPrefix | None:
        """A conversation's first messages, tokenized now for a request to come (None: this model cannot reuse them)."""
        if not self._encoder.reuses_prefixes:
            return None
        return await self._off_loop(self._encoder.encode_prefix, messages, tools)

    # -- structured outputs and tools ----------------------------------------------

    async def _check_tool_schemas(self, tools: tuple[Tool, ...]) -> None:
        """Every tool's parameters are a valid JSON Schema; each text is checked once (then remembered)."""
        for index, tool in enumerate(tools):
            key = SchemaVerdicts.key(tool.parameters)
            if not tool.parameters or self._schema_verdicts.seen(key):
                continue
            await self._off_loop(lambda f=f"chat.tools[{index}].parameters", t=tool.parameters:
                                 check_schema(f, t, max_depth=MAX_SCHEMA_DEPTH))
            self._schema_verdicts.remember(key)

    async def structured_outputs(self, prompt: PromptInput, sampling: Sampling) -> StructuredOutputs:
        """The constraint (a forced tool call's, or the caller's) compiled or from the cache, and the tool parsing."""
        await self._check_tool_schemas(prompt.tools)
        check_constraint_exclusive(prompt, sampling.constraint)
        constraint = tool_call_constraint(prompt) or sampling.constraint
        compiled, hit = None, False
        if constraint is not None:
            if self.constraints is None:
                raise InvalidArgument(constraint.field, "this service has no structured-output backend")
            compiled = self.constraints.lookup(constraint)
            hit = compiled is not None
            if compiled is None:
                with _TRACER.start_as_current_span("compile constraint"):
                    compiled = await self._off_loop(self.constraints.compile, constraint)
                self.constraints.remember(constraint, compiled)
        return StructuredOutputs(compiled, hit, ToolOutput(prompt, self.tool_parsing))

    # -- generating --------------------------------------------------------------

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise Unavailable(f"inference engine is dead ({self.dead_reason}); restart the inference service")

    def _check_capacity(self) -> None:
        """Refuse at once rather than queue without bound."""
        queued = max(self._tracker.waiting, len(self._in_flight) - self.info.max_num_seqs)
        if queued >= self._settings.max_waiting and len(self._in_flight) >= self.info.max_num_seqs:
            raise ResourceExhausted(
                f"inference queue is full: {queued} requests waiting beyond {self.info.max_num_seqs} running "
                f"(AGW_INFERENCE_MAX_WAITING={self._settings.max_waiting}); retry shortly",
                retry_after_s=0.5,
            )

    def new_request_id(self) -> str:
        return f"gen-{uuid.uuid4().hex}"

    async def generate(self, prompt: PromptInput, sampling: Sampling, request_id: str,
                       prefix: EncodedPrefix | None = None) -> AsyncIterator[Delta | Result]:
        """Stream deltas, then one :class:`Result`. Closing the iterator aborts the request.

        ``prefix``: the prompt's first messages, already tokenized (:meth:`encode_prefix`); used if they match.
        """
        started = time.perf_counter()
        self._check_alive()
        # Claim the id before the first await: two calls arriving together
        # with the same id must not both pass the check.
        if request_id in self._claimed_ids:
            raise InvalidArgument("request_id", f"{request_id!r} is already in flight; use a unique id")
        self._claimed_ids.add(request_id)
        try:
            # aclosing: closing this stream must close the engine request now.
            async with aclosing(self._admitted_generate(prompt, sampling, request_id, started, prefix)) as events:
                async for event in events:
                    yield event
        finally:
            self._claimed_ids.discard(request_id)

    async def _admitted_generate(self, prompt: PromptInput, sampling: Sampling, request_id: str,
                                 started: float, prefix: EncodedPrefix | None) -> AsyncIterator[Delta | Result]:
        from vllm import SamplingParams
        from vllm.renderers.inputs.preprocess import parse_model_prompt
        from vllm.sampling_params import RequestOutputKind
        from vllm.exceptions import VLLMValidationError
        from vllm.v1.engine.exceptions import EngineDeadError

        with _TRACER.start_as_current_span("tokenize") as span:
            token_ids, reused = await self._encode(prompt, prefix)
            span.set_attributes({"agw.prompt_tokens": len(token_ids), "agw.prompt_tokens_tokenized_ahead": reused})
        check_fits_context(len(token_ids), sampling, self.limits)
        self._check_capacity()
        shaped = await self.structured_outputs(prompt, sampling)
        try:
            params = SamplingParams(
                max_tokens=sampling.max_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                stop=list(sampling.stop) or None,
                seed=sampling.seed,
                ignore_eos=sampling.ignore_eos,
                output_kind=RequestOutputKind.DELTA,
                structured_outputs=shaped.compiled.structured_outputs() if shaped.compiled else None,
            )
        except VLLMValidationError as exc:  # vLLM's own ranges (temperature in [0, 2], ...): the caller's to fix
            raise InvalidArgument(f"sampling.{exc.parameter or 'params'}", str(exc)) from None
        with _TRACER.start_as_current_span("render"):
            (engine_input,) = await self._llm.renderer.render_cmpl_async(
                [parse_model_prompt(self._llm.model_config, _engine_prompt(token_ids, prompt.cache_salt))]
            )
        self._in_flight.add(request_id)
        completion_tokens = 0
        tool_output = shaped.tool_output
        try:
            async with aclosing(self._llm.generate(engine_input, params, request_id)) as outputs:
                async for output in outputs:
                    completion = output.outputs[0]
                    completion_tokens += len(completion.token_ids)
                    text = tool_output.feed(completion.text)
                    if text or completion.token_ids:
                        yield Delta(text, tuple(completion.token_ids))
                    if output.finished:
                        rest, calls = tool_output.finish()
                        if rest:  # held text that turned out not to be a call
                            yield Delta(rest, ())
                        finish = _FINISH.get(completion.finish_reason or "", FinishReason.STOP)
                        yield Result(
                            request_id=request_id,
                            finish_reason=FinishReason.TOOL_CALLS if calls else finish,
                            usage=Usage(len(token_ids), completion_tokens, output.num_cached_tokens or 0),
                            timings=engine_timings(output.metrics, started),
                            tool_calls=calls,
                            structured_output_backend=self.constraints.backend if shaped.compiled else "",
                            constraint_cache_hit=shaped.cache_hit,
                        )
        except EngineDeadError as exc:
            self.mark_dead(str(exc) or "engine core exited")
            raise Unavailable(f"inference engine died during the request; restart the service ({exc})") from exc
        except ValueError as exc:  # vLLM's own request validation
            raise InvalidArgument("request", str(exc)) from exc
        finally:
            self._in_flight.discard(request_id)

    async def prefill(self, prefix: EncodedPrefix, cache_salt: str) -> str:
        """Compute ``prefix``'s KV blocks now, under ``cache_salt``, so that a request starting with it finds them
        in the prefix cache. Returns why it ran or not: ``prefilled``; ``busy`` (a request waits, or
        ``AGW_INFERENCE_PREFILL_MAX_RUNNING`` requests run, or the batch is full: a prefill would queue or slow
        every running request's step, not use idle room); ``short`` (less than one block, or no prefix cache).

        Cancel the task running it to stop it: the engine request is aborted, and blocks already computed stay
        cached. Only whole blocks are sent: the engine caches nothing of a partial one.
        """
        from vllm import SamplingParams
        from vllm.renderers.inputs.preprocess import parse_model_prompt
        from vllm.sampling_params import RequestOutputKind

        self._check_alive()
        whole = len(prefix.token_ids) // self.info.block_size * self.info.block_size
        if not whole or not self.info.prefix_caching:
            return "short"
        room = min(self.info.max_num_seqs, self._settings.prefill_max_running)
        if self._tracker.waiting or len(self._in_flight) + self._prefilling >= room:
            return "busy"
        self._prefilling += 1  # counted from here: the checks above and this add run without an await between
        try:
            (engine_input,) = await self._llm.renderer.render_cmpl_async(
                [parse_model_prompt(self._llm.model_config, _engine_prompt(list(prefix.token_ids[:whole]), cache_salt))]
            )
            params = SamplingParams(max_tokens=1, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
            async with aclosing(self._llm.generate(engine_input, params, f"prefill-{uuid.uuid4().hex}")) as outputs:
                async for _ in outputs:
                    pass
        finally:
            self._prefilling -= 1
        return "prefilled"

    async def abort(self, request_id: str) -> None:
        """Abort a request (idempotent; unknown ids are ignored)."""
        if request_id in self._in_flight:
            await self._llm.abort(request_id)

    # -- load and health ---------------------------------------------------------

    def load(self) -> Load:
        in_flight = len(self._in_flight)
        waiting = min(in_flight, max(self._tracker.waiting, in_flight - self.info.max_num_seqs))
        return Load(
            running=in_flight - waiting,
            waiting=waiting,
            kv_cache_usage=self._tracker.kv_cache_usage if in_flight else 0.0,
            generated_tokens_total=self._tracker.generated_tokens_total,
        )

    def mark_dead(self, reason: str) -> None:
        if self.dead_reason is None:
            log.error("inference engine is dead: %s", reason)
        self.dead_reason = reason

    @property
    def errored(self) -> bool:
        return bool(self._llm.errored)

    async def warm_up(self) -> list[StartupStep]:
        """Encode a sample and run one short generation, so no real request pays for either."""
        steps = []
        started = time.perf_counter()
        await self.tokenize(PromptInput(text=WARMUP_TEXT))
        steps.append(StartupStep("warm tokenizer", (time.perf_counter() - started) * 1000))
        started = time.perf_counter()
        sampling = Sampling(max_tokens=4, temperature=0.0, ignore_eos=True)
        prompt = PromptInput(messages=(Message("system", WARMUP_TEXT), Message("user", WARMUP_TEXT)))
        async with aclosing(self.generate(prompt, sampling, "warmup")) as stream:
            async for _ in stream:
                pass
        steps.append(StartupStep("warm generation", (time.perf_counter() - started) * 1000))
        if self.constraints is not None:
            started = time.perf_counter()
            constrained = Sampling(max_tokens=8, temperature=0.0, constraint=Constraint("json", WARMUP_SCHEMA))
            async with aclosing(self.generate(prompt, constrained, "warmup-constrained")) as stream:
                async for _ in stream:
                    pass
            steps.append(StartupStep("warm structured outputs", (time.perf_counter() - started) * 1000))
        return steps

    async def warm_constraints(self, schemas: list[str]) -> None:
        """Compile ``schemas`` into the constraint cache, so their first use is a hit (the cache is keyed by
        the schema's text: a schema given as an object is keyed by its compact JSON)."""
        for index, schema in enumerate(schemas):
            schema = schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"))
            constraint = Constraint("json", schema, field=f"AGW_INFERENCE_WARM_SCHEMAS_FILE[{index}]")
            self.constraints.remember(constraint, await self._off_loop(self.constraints.compile, constraint))


def _engine_prompt(token_ids: list[int], cache_salt: str | None) -> dict:
    """vLLM's token prompt; a salt starts the request's block hashes, so only same-salt requests share blocks."""
    return {"prompt_token_ids": token_ids, **({"cache_salt": cache_salt} if cache_salt else {})}


def engine_timings(metrics, started: float) -> Timings:
    """A request's timings from vLLM's own per-request stats (``RequestStateStats``), ms.

    ``queue_ms`` is from the request's arrival at the engine to its scheduling,
    as the contract says. vLLM's own queue time starts later, when the engine
    core's scheduler takes the request in, and that misses most of the wait:
    the engine core reads new requests only between steps, so a request that
    arrives during a step waits for the step's end before any queue sees it
    (on CPU, up to a whole prefill step, tens of ms under load; the scheduler's
    own queue is then about 0). The arrival is stamped on the front end's wall
    clock and the scheduling on the engine core's monotonic one, a process on
    the same host (the engine runs in-process): the wall clock is brought to
    the monotonic one by their offset now.
    """
    total_ms = (time.perf_counter() - started) * 1000
    if metrics is None:
        return Timings(0.0, 0.0, 0.0, total_ms)
    arrived = metrics.arrival_time - (time.time() - time.monotonic())
    queue_ms = max(0.0, (metrics.scheduled_ts - arrived) * 1000) if metrics.scheduled_ts else 0.0
    decode_ms = max(0.0, (metrics.last_token_ts - metrics.first_token_ts) * 1000) if metrics.first_token_ts else 0.0
    return Timings(queue_ms, (metrics.first_token_latency or 0.0) * 1000, decode_ms, total_ms)


def _log_plan(plan: EnginePlan) -> None:
    for line in plan.describe():
        log.info("engine: %s", line)


@asynccontextmanager
async def open_engine(settings: InferenceSettings, *, on_death=None) -> AsyncIterator[Engine]:
    """Start the engine (and warm it up unless disabled); shut it down on exit.

    ``on_death`` is awaited once if the engine dies while serving.
    """
    from transformers import AutoTokenizer
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    steps: list[StartupStep] = []
    async with AsyncExitStack() as stack:
        executor = ThreadPoolExecutor(settings.tokenizer_threads, thread_name_prefix="tokenizer")
        stack.callback(executor.shutdown, wait=False, cancel_futures=True)
        loop = asyncio.get_running_loop()

        started = time.perf_counter()
        model = await loop.run_in_executor(executor, resolve_model, settings)
        steps.append(StartupStep("resolve model", (time.perf_counter() - started) * 1000))

        platform = detect_platform()
        local = Path(model)
        plan = plan_engine(settings, platform, model, ModelShape.from_folder(local, settings.dtype) if local.exists() else None)
        log.info("engine plan for %s on %s (%.0f GiB):", model, platform.device, platform.total_memory_gib)
        _log_plan(plan)
        if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            log.warning("VLLM_CPU_KVCACHE_SPACE=%s is set: vLLM lets it override the planned KV cache; unset it and "
                        "use AGW_INFERENCE_KV_CACHE_GIB", os.environ["VLLM_CPU_KVCACHE_SPACE"])

        started = time.perf_counter()
        tokenizer = await loop.run_in_executor(executor, AutoTokenizer.from_pretrained, model)
        steps.append(StartupStep("load tokenizer", (time.perf_counter() - started) * 1000))

        tracker = LoadTracker()
        started = time.perf_counter()
        from vllm.config import StructuredOutputsConfig

        engine_args = {**plan.engine_args,
                       "structured_outputs_config": StructuredOutputsConfig(**plan.engine_args["structured_outputs_config"])}
        args = AsyncEngineArgs(**engine_args, disable_log_stats=True)
        llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args, stat_loggers=[tracker.factory])
        stack.callback(llm.shutdown)
        steps.append(StartupStep("start engine", (time.perf_counter() - started) * 1000))

        encoder = await loop.run_in_executor(executor, PromptEncoder, tokenizer)
        if not encoder.reuses_prefixes:
            log.info("%s: chat prefixes sent ahead (OpenGenerate) cannot be reused with this tokenizer and template; "
                     "such requests are tokenized whole", model)
        constraints = await loop.run_in_executor(
            executor, lambda: ConstraintCache(settings.structured_output_backend, tokenizer, settings.constraint_cache_size))
        tool_parsing = ToolParsing.load(choose_parser_name(settings.tool_parser, tokenizer.chat_template), tokenizer)
        log.info("tool calls in AUTO mode: %s", f"vLLM's {tool_parsing.name} parser" if tool_parsing else
                 "not parsed (no parser for this chat template; set AGW_INFERENCE_TOOL_PARSER)")
        engine = Engine(llm, encoder, executor, settings, tracker, model, platform.device, len(tokenizer),
                        constraints, tool_parsing)
        if settings.warm_schemas_file is not None:
            await engine.warm_constraints(json.loads(settings.warm_schemas_file.read_text()))
        if settings.warmup:
            steps += await engine.warm_up()
        for step in steps:
            log.info("start-up: %s took %.0f ms", step.name, step.ms)

        watcher = asyncio.create_task(_watch_engine(engine, on_death), name="engine-watch")
        stack.callback(watcher.cancel)
        yield engine


async def _watch_engine(engine: Engine, on_death) -> None:
    """Notice an engine that died while idle, not only on the next request."""
    while not engine.errored and engine.dead_reason is None:
        await asyncio.sleep(0.5)
    engine.mark_dead(engine.dead_reason or "engine core exited")
    if on_death is not None:
        await on_death()

