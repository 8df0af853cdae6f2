"""What a Chat turn takes and produces, as typed values: the servicer converts at its edge.

The turn (``gateway.chat``) takes a :class:`TurnRequest` and yields
:class:`ContextReady`, then :class:`Delta` after :class:`Delta`, then any
:class:`ToolCalled`, then one :class:`Finished`; ``gateway.convert`` is the one place that knows the
``agent.gateway.v1`` messages they come from and become. Backend contract
values (a search filter, sampling parameters, retrieved documents, the
engine's usage and timings) travel as the backends take and send them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, fields

from agent.inference.v1 import inference_pb2
from agent.retrieval.v1 import retrieval_pb2

from gateway.turn_metrics import DegradedCause


@dataclass(frozen=True)
class RetrievalAsk:
    """What the turn retrieves: the tenant's collection, how many passages, a filter and the fields."""

    collection: str
    top_k: int = 0  # 0: the gateway's default
    filter: retrieval_pb2.Filter | None = None
    payload_fields: tuple[str, ...] = ()


@dataclass(frozen=True)
class ToolResult:
    """The output of one tool call of the session's last assistant message."""

    tool_call_id: str
    content: str


@dataclass(frozen=True)
class TurnRequest:
    """One turn, checked: the message (or tool results), the session it continues, its options, its
    tools and its idempotency key."""

    message: str
    session_id: uuid.UUID | None = None
    system_prompt: str = ""  # empty: the gateway's default
    retrieval: RetrievalAsk | None = None  # None: no retrieval
    sampling: inference_pb2.SamplingParams = field(default_factory=inference_pb2.SamplingParams)
    idempotency_key: str = ""
    #: What makes two requests "the same turn" for the key (gateway.convert.turn_fingerprint).
    fingerprint: str = ""
    tools: tuple[inference_pb2.Tool, ...] = ()
    tool_choice: inference_pb2.ToolChoice | None = None
    tool_results: tuple[ToolResult, ...] = ()


@dataclass
class StageTimes:
    """Where a turn's time went, in milliseconds, as the gateway measured it."""

    admission_ms: float = 0.0
    history_ms: float = 0.0
    retrieval_ms: float = 0.0
    first_token_ms: float = 0.0
    generation_ms: float = 0.0
    persist_ms: float = 0.0
    total_ms: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class ContextReady:
    """The passages retrieved for the turn, best first."""

    documents: list[retrieval_pb2.ScoredDocument]


@dataclass(frozen=True)
class Delta:
    """Text generated since the previous delta."""

    text: str


@dataclass(frozen=True)
class ToolCalled:
    """A tool call the model made (the turn then ends with finish reason TOOL_CALLS)."""

    call: inference_pb2.ToolCall


@dataclass(frozen=True)
class Outcome:
    """How a turn ended: always its last event."""

    finish_reason: int = 0
    usage: inference_pb2.Usage | None = None
    timings: StageTimes = field(default_factory=StageTimes)
    degraded: tuple[DegradedCause, ...] = ()
    trace_id: str = ""
    session_id: str = ""
    replayed: bool = False
    engine_timings: inference_pb2.GenerationTimings | None = None
    #: A replayed turn's reasons, as they were stored (its causes are not kept, only what the client was told).
    stored_reason: str = ""

    @property
    def degraded_reason(self) -> str:
        return self.stored_reason or "; ".join(cause.reason for cause in self.degraded)


@dataclass(frozen=True)
class Finished:
    """The turn's summary, once it is stored."""

    outcome: Outcome


TurnEvent = ContextReady | Delta | ToolCalled | Finished
