"""One agent turn, read top to bottom in :meth:`ChatTurns.run`: admission is done; then
the stages (history and retrieval at once, while the inference call opens), the
generation (a prefix-stable prompt, ``gateway.prompt``, streamed), and the finish
(the turn stored, then a final event that says where the time went). SQL lives in
``gateway.turn_store``, metrics in ``gateway.turn_metrics``.

Nothing lost: the turn's messages (tool results, the user's message, the
answer with its tool calls) are written in one transaction before the final
event; a failed write is an error, not a final event. A cancelled turn stores
nothing (neither the user's message nor a partial answer): a retry starts
clean. Tool results must answer the calls of the session's last assistant
message (FAILED_PRECONDITION otherwise), checked on the history read. An idempotency key is claimed before the turn
generates (``gateway.turn_store``), so concurrent retries get one answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import grpc
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from agent.inference.v1 import inference_pb2
from agent.retrieval.v1 import retrieval_pb2
from servicekit.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServiceError,
    Unavailable,
)
from servicekit.tasks import cancel_and_wait
from servicekit.telemetry import trace_id_hex
from servicekit.tenancy import cache_salt_for, physical_collection

from gateway.backends import Backends
from gateway.database import Database
from gateway.generation_call import GenerationCall
from gateway.history import history_window, unprefilled_tokens
from gateway.convert import tool_calls_to_json
from gateway.routing import prefix_key, session_key
from gateway.prompt import conversation, generate_request, history_messages, turn_messages, user_turn
from gateway.settings import GatewaySettings
from gateway.turn_metrics import DegradedCause, record_turn
from gateway.turn_store import Claim, StoredTurn, TurnStore
from gateway.turn_types import ContextReady, Delta, Finished, Outcome, StageTimes, ToolCalled, ToolResult, TurnRequest

log = logging.getLogger(__name__)
_TRACER = trace.get_tracer("agent-gateway.chat")
#: How much longer an idempotency claim's lease runs than the turn may (a store still in flight).
CLAIM_LEASE_MARGIN_S = 2.0
#: How long before the caller's deadline a turn waiting on another's claim gives up with ABORTED: its last look
#: at Postgres and the status must reach the caller first. 0.25 s was once too little on a loaded 2-core CI host
#: (the caller saw DEADLINE_EXCEEDED, which says nothing about the key); giving up 0.25 s sooner costs a waiter
#: nothing it could have used.
CLAIM_WAIT_RESERVE_S = 0.5


def _over_context(error: ServiceError) -> bool:
    """The inference service's "prompt does not fit the context" refusal."""
    return error.code == grpc.StatusCode.INVALID_ARGUMENT and any(
        violation.field == "input"
        for detail in error.details if hasattr(detail, "field_violations")
        for violation in detail.field_violations
    )


def _storable(text: str) -> str:
    """The model's text as Postgres can store it: its text and jsonb types cannot hold U+0000, which a model
    may emit; it is stored as U+FFFD (a client's own text with NUL is refused at the edge, servicekit.bounds)."""
    return text.replace("\x00", "\ufffd")


def _searches(request: TurnRequest) -> bool:
    """Whether the turn has a retrieval stage: asked for, and a message to search with (a turn of tool results
    alone has none)."""
    return request.retrieval is not None and bool(request.message)


def estimate_tokens(text: str) -> int:
    """About four characters a token: for the history budget, not for billing."""
    return max(1, len(text) // 4)


@dataclass
class Clock:
    started: float

    def ms(self, since: float | None = None) -> float:
        return (time.perf_counter() - (since if since is not None else self.started)) * 1000


@dataclass
class _Turn:
    """What one turn gathers as it runs."""

    request: TurnRequest
    tenant: str
    timings: StageTimes
    system_prompt: str
    history: list[inference_pb2.ChatMessage] = field(default_factory=list)
    documents: list[retrieval_pb2.ScoredDocument] = field(default_factory=list)
    degraded: list[DegradedCause] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    result: inference_pb2.GenerationResult | None = None

    def messages_to_store(self) -> list[dict]:
        """The turn's messages as migrations/0004 stores them: tool results, the user's message, the answer."""
        request = self.request
        messages = [{"role": "tool", "content": r.content, "token_count": estimate_tokens(r.content),
                     "tool_call_id": r.tool_call_id} for r in request.tool_results]
        if request.message:
            messages.append({"role": "user", "content": request.message,
                             "token_count": estimate_tokens(request.message)})
        answer = {"role": "assistant", "content": _storable("".join(self.pieces)),
                  "token_count": self.result.usage.completion_tokens if self.result else 0}
        if self.tool_calls:
            answer["tool_calls"] = [{key: _storable(value) for key, value in call.items()}
                                    for call in tool_calls_to_json(self.tool_calls)]
        return [*messages, answer]

    @property
    def tool_calls(self) -> list[inference_pb2.ToolCall]:
        return list(self.result.tool_calls) if self.result else []


class ChatTurns:
    """Runs Chat turns against the backends and the session store."""

    def __init__(self, settings: GatewaySettings, backends: Backends, database: Database) -> None:
        self.settings = settings
        self.backends = backends
        self.database = database
        self.store = TurnStore(database)
        self._releases: set[asyncio.Task] = set()

    async def _history(self, tenant: str, session_id: uuid.UUID | None,
                       tool_results: tuple[ToolResult, ...]) -> tuple[list[inference_pb2.ChatMessage], bool, int]:
        """The history window's messages, whether the token budget trimmed it, and :func:`unprefilled_tokens`."""
        if session_id is None:
            return [], False, 0
        rows = await self.store.recent_messages(tenant, session_id, self.settings.history_messages)
        _check_tool_results(rows[0] if rows else None, tool_results)
        window = history_window(rows, max_messages=self.settings.history_messages,
                                token_budget=self.settings.history_token_budget,
                                step=self.settings.history_window_step)
        return history_messages(window.messages), window.trimmed, unprefilled_tokens(rows)

    async def _retrieve(self, tenant: str, request: TurnRequest, context) -> list[retrieval_pb2.ScoredDocument]:
        if not _searches(request):
            return []
        ask = request.retrieval
        search = retrieval_pb2.SearchRequest(
            collection=physical_collection(tenant, ask.collection, "retrieval.collection"),
            text=request.message, top_k=ask.top_k or self.settings.retrieval_top_k,
            filter=ask.filter, payload_fields=list(ask.payload_fields) or ["text"],
        )
        return list((await self.backends.search(search, context)).results)

    def _claim_times(self, context) -> tuple[float, float]:
        """(lease, wait) for an idempotency claim: as long as this turn may run, and as long as its caller waits."""
        remaining = context.time_remaining() if context is not None else None
        budget = self.settings.default_deadline_s if remaining is None else remaining
        # The lease outlives the turn by a little (a store in flight), so a live holder is never taken over.
        # The wait ends early enough for ABORTED (and its last look at Postgres) to beat the caller's deadline.
        return budget + CLAIM_LEASE_MARGIN_S, max(0.0, budget - max(self.settings.deadline_margin_ms / 1000,
                                                                   CLAIM_WAIT_RESERVE_S))

    def _release_later(self, claim: Claim) -> None:
        """Give up a claim even while this turn is being cancelled (the release must not be cancelled with it)."""
        task = asyncio.ensure_future(self.store.release(claim))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def run(self, tenant: str, request: TurnRequest, context, admitted_at: float, clock: Clock):
        session_id = request.session_id
        trace_id = trace_id_hex()  # the call's server span, opened by the edge's wrapper
        timings = StageTimes(admission_ms=(admitted_at - clock.started) * 1000)

        claim = None
        if session_id is not None and request.idempotency_key:
            lease_s, wait_s = self._claim_times(context)
            owned = await self.store.claim(tenant, session_id, request, lease_s=lease_s, wait_s=wait_s)
            if isinstance(owned, StoredTurn):  # answered before, or by a concurrent turn we waited for
                if owned.text or not owned.tool_calls:
                    yield Delta(owned.text)
                for call in owned.tool_calls:
                    yield ToolCalled(call)
                yield Finished(owned.outcome)
                return
            claim = owned

        turn = _Turn(request, tenant, timings, request.system_prompt or self.settings.default_system_prompt)
        call = GenerationCall(self.backends, context, self._route_key(turn))
        stored = False
        try:
            try:
                await self._stages(turn, session_id, call, context)
                async for event in self._generate(turn, call, context, clock):
                    yield event
            finally:
                call.close()
            final = await self._finish(turn, session_id, trace_id, clock, claim)
            stored = True
        finally:
            if claim is not None and not stored:
                self._release_later(claim)
        yield Finished(final)

    def _route_key(self, turn: _Turn) -> bytes:
        """Which replica the turn's call goes to: known at once, so the call can open before the history loads."""
        if turn.request.session_id is not None:
            return self.session_route_key(turn.tenant)(str(turn.request.session_id))
        salt = cache_salt_for(self.settings.prefix_cache, turn.tenant)
        return prefix_key(salt, [turn.system_prompt, turn.request.message], self.settings.routing_prefix_chars)

    def session_route_key(self, tenant: str) -> Callable[[str], bytes]:
        """The routing key of ``tenant``'s session turns, by session id (CreateSession places new ids with it)."""
        salt = cache_salt_for(self.settings.prefix_cache, tenant)
        return lambda session_id: session_key(salt, session_id)

    async def _send_prefix(self, turn: _Turn, call: GenerationCall, past: list[inference_pb2.ChatMessage],
                           _trimmed: bool, unprefilled: int) -> None:
        """The prompt's session part on the early call, for the inference service to tokenize while retrieval
        still runs, and to prefill (inference/prefix_prefill.py) when enough of it is new to the engine's cache:
        under the turn's cache salt, as the request will be."""
        prefill = self.settings.prefill_prefix and unprefilled >= self.settings.prefill_min_tokens
        salt = cache_salt_for(self.settings.prefix_cache, turn.tenant) if prefill else None
        await call.send_prefix(conversation(turn.system_prompt, past), turn.request.tools, salt)

    async def _stages(self, turn: _Turn, session_id: uuid.UUID | None, call: GenerationCall, context) -> None:
        """History and retrieval at once, each within its budget, while the inference call opens."""

        async def history_then_prefix():
            outcome = loaded, _error, _ms = await _timed(
                "history", self._history(turn.tenant, session_id, turn.request.tool_results),
                self.settings.history_budget_s)
            if loaded and loaded[0] and call.opened_early:  # a plain Generate carries the whole prompt at once
                await self._send_prefix(turn, call, *loaded)
            return outcome

        stages = asyncio.gather(
            history_then_prefix(),
            _timed("retrieval", self._retrieve(turn.tenant, turn.request, context), self.settings.retrieval_budget_s),
        )
        try:
            # Only a search is long enough to hide the early call. Without one the
            # stages are the history read (1-2 ms), and the call's extra messages
            # (the prefix sent apart, the prompt tokenized in two parts) and its
            # opening, which delays that read, cost more than they save: 1 ms
            # at c=1 p50, and 1.7 ms of the share's mean at c=8 (docs/benchmarks.md).
            if self.settings.open_generate_early and self.backends.inference_opens_early and _searches(turn.request):
                await asyncio.sleep(0)  # the stages' own calls go out first
                call.open_early()
            (history, history_error, turn.timings.history_ms), (documents, retrieval_error, turn.timings.retrieval_ms) = \
                await stages
        finally:
            if not stages.done():  # opening failed, or the turn was cancelled meanwhile
                await cancel_and_wait(stages)
        if history_error is not None:
            if isinstance(history_error, (NotFound, InvalidArgument, FailedPrecondition)):
                raise history_error
            # A TimeoutError's text is empty: say which budget ran out, for the operator reading the log.
            cause = getattr(history_error, "internal", "") or str(history_error) or \
                f"no answer from Postgres within AGW_GATEWAY_HISTORY_BUDGET_S={self.settings.history_budget_s:g}"
            raise Unavailable("session history unavailable; the turn was not run, retry shortly",
                              internal=f"history: {cause}")
        turn.history, trimmed, _ = history
        if retrieval_error is not None:
            timed_out = isinstance(retrieval_error, TimeoutError)
            code = getattr(retrieval_error, "code", None)
            # The caller's own mistake fails the turn, before any token: degrading
            # would hide it. A collection the tenant does not have is NOT_FOUND; a
            # bad name here, or a top_k past the cap or a bad filter at the
            # retrieval service, INVALID_ARGUMENT (a backend's arrives as a
            # ServiceError with that code).
            if code == grpc.StatusCode.NOT_FOUND:
                raise NotFound(f"retrieval.collection: the tenant has no collection "
                               f"{turn.request.retrieval.collection!r}; ingest into it first") from None
            if code == grpc.StatusCode.INVALID_ARGUMENT or self.settings.fail_on_retrieval_error:
                raise Unavailable("retrieval timed out") if timed_out else retrieval_error
            # Only an outage or a timeout degrades the turn. The client learns what was missing,
            # not why inside (that is in the log and on the retrieval span).
            cause = DegradedCause.RETRIEVAL_TIMED_OUT if timed_out else DegradedCause.RETRIEVAL_UNAVAILABLE
            log.warning("turn degraded, %s (%s)", cause.reason, str(retrieval_error) or "budget spent")
            turn.degraded.append(cause)
        else:
            turn.documents = documents
        if trimmed:
            turn.degraded.append(DegradedCause.HISTORY_OVER_BUDGET)

    async def _generate(self, turn: _Turn, call: GenerationCall, context, clock: Clock):
        """The context event (once the request is out, so its write overlaps the prefill), then token deltas."""
        request = turn.request
        context_event = ContextReady(turn.documents) if turn.documents else None
        this_turn = turn_messages(request.tool_results, user_turn(request.message, turn.documents) if request.message else "")
        cache_salt = cache_salt_for(self.settings.prefix_cache, turn.tenant)

        def prompt(past: list[inference_pb2.ChatMessage]) -> inference_pb2.GenerateRequest:
            return generate_request(turn.system_prompt, past, this_turn, request.sampling, cache_salt,
                                    request.tools, request.tool_choice)

        generation_started = time.perf_counter()
        # Not "current" across the yields below: a context attached in an
        # async generator must not leak to the code between its messages.
        span = call.prompt_ready()
        if self.settings.trace_content:  # AGW_TRACE_CONTENT=1 only: prompts can hold personal data
            span.set_attribute("agw.chat.user_message", request.message)
        span.set_attributes({"agw.chat.tools": len(request.tools), "agw.chat.tool_results": len(request.tool_results)})
        history = turn.history
        try:
            while True:
                early, received = call.opened_early, False
                try:
                    # Leaving the block (done, failed, or the turn closed mid-stream) cancels the call now.
                    async with await call.start(prompt(history)) as stream:
                        if context_event is not None:
                            await asyncio.sleep(0)  # a new call's request goes out first
                            yield context_event
                            context_event = None
                        async for message in stream:
                            received = True
                            if message.text:
                                if not turn.pieces:
                                    turn.timings.first_token_ms = clock.ms()
                                    span.add_event("first_token")
                                turn.pieces.append(message.text)
                                yield Delta(message.text)
                            if message.HasField("result"):
                                turn.result = message.result
                    break
                except ServiceError as exc:
                    if early and not turn.pieces and call.refused(exc):
                        continue  # an inference service older than OpenGenerate: Generate
                    if not received and await call.retry(exc, early):
                        continue  # the replica failed before the first token: once more, on the next
                    history = _shorter_history(turn, history, exc)
        except BaseException as exc:  # cancelled, failed: the span says so, and always ends
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            if self.settings.trace_content:
                span.set_attribute("agw.chat.answer", "".join(turn.pieces))
            _record_result(span, turn.result)
            if call.route is not None and turn.result is not None:
                call.route.replica.note_usage(turn.result.usage)
            span.end()
        turn.timings.generation_ms = clock.ms(generation_started)
        for tool_call in turn.tool_calls:
            yield ToolCalled(tool_call)

    async def _finish(self, turn: _Turn, session_id: uuid.UUID | None, trace_id: str, clock: Clock,
                      claim: Claim | None) -> Outcome:
        """The turn's outcome, once the turn is stored (a failed write raises: no final event)."""
        result, timings = turn.result, turn.timings
        outcome = Outcome(
            finish_reason=result.finish_reason if result else 0, usage=result.usage if result else None,
            timings=timings, degraded=tuple(turn.degraded), trace_id=trace_id,
            session_id=str(session_id) if session_id is not None else "",
            engine_timings=result.timings if result else None)
        if session_id is not None:
            persist_started = time.perf_counter()
            with _TRACER.start_as_current_span("persist"):
                # One round trip: the messages, the key's result and the end of its claim, in one transaction.
                # What a replay returns carries the timings up to here (persist and total not yet known).
                await self.store.store(turn.tenant, session_id, turn.request, claim,
                                       messages=turn.messages_to_store(),
                                       outcome=replace(outcome, timings=replace(timings)), trace_id=trace_id)
            timings.persist_ms = clock.ms(persist_started)
        timings.total_ms = clock.ms()
        record_turn(timings, turn.degraded, result)
        return outcome


def _check_tool_results(newest, tool_results: tuple[ToolResult, ...]) -> None:
    """Each result must answer a call of the session's last message, an assistant's that called tools."""
    if not tool_results:
        return
    calls = {c["id"] for c in json.loads(newest["tool_calls"] or "[]")} if newest is not None else set()
    for index, result in enumerate(tool_results):
        if result.tool_call_id not in calls:
            raise FailedPrecondition(
                f"tool_results[{index}].tool_call_id: {result.tool_call_id[:80]!r} is not a tool call of the "
                "session's last assistant message" + ("" if calls else " (it called no tools)")
                + "; send results only for the calls of the turn before")


def _record_result(span, result: inference_pb2.GenerationResult | None) -> None:
    """The generation span learns the tool calls and the structured-output backend (and whether cached)."""
    if result is None:
        return
    span.set_attributes({"agw.chat.tool_calls": len(result.tool_calls)})
    if result.structured_output_backend:
        span.set_attributes({"agw.structured_output.backend": result.structured_output_backend,
                             "agw.structured_output.cache_hit": result.constraint_cache_hit})


def _shorter_history(turn: _Turn, history: list[inference_pb2.ChatMessage],
                     error: ServiceError) -> list[inference_pb2.ChatMessage]:
    """The rule for a prompt over the model's context, before any token: drop the oldest half of the
    history and try again; with no history left, the message alone does not fit (RESOURCE_EXHAUSTED)."""
    if turn.pieces or not _over_context(error):
        raise error
    if not history:
        raise ResourceExhausted(
            f"the message does not fit the model's context even without history ({error.message}); "
            "shorten it or lower max_tokens", retry_after_s=None) from None
    if DegradedCause.HISTORY_OVER_CONTEXT not in turn.degraded:
        turn.degraded.append(DegradedCause.HISTORY_OVER_CONTEXT)
    return history[len(history) // 2 + len(history) % 2:]


async def _timed(name: str, coro, budget_s: float):
    """``(result, None, ms)`` or ``(None, error, ms)``: a stage within its budget, in its own span."""
    started = time.perf_counter()
    with _TRACER.start_as_current_span(name) as span:
        try:
            async with asyncio.timeout(budget_s):  # in this task: no extra task per stage, as wait_for makes
                result = await coro
            return result, None, (time.perf_counter() - started) * 1000
        except (TimeoutError, ServiceError) as exc:
            span.set_status(Status(StatusCode.ERROR, str(exc) or "timed out"))
            return None, exc, (time.perf_counter() - started) * 1000
