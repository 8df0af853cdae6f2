"""What `agentgw load` sends: a schedule of turns, synthetic and agent-shaped, or replayed from a trace.

A turn is described by its shape only (sizes, retrieval on or off, tokens to
generate), never by content: spans do not keep contents by default, and load
needs none. Text of the recorded size is made up at send time.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

#: The Chat server span's name, as the gateway's edge names it.
CHAT_SPAN = "agent.gateway.v1.AgentGateway/Chat"
_WORDS = ("agent", "gateway", "token", "cache", "prefix", "stream", "latency", "session", "tool", "vector",
          "search", "engine", "history", "turn", "budget", "replica")


@dataclass(frozen=True)
class TurnSpec:
    """One turn to send, ``at_s`` seconds after the run starts (open loop; closed loop ignores it)."""

    at_s: float
    tenant: str
    session: int | None  # the tenant's n-th session; None: a stateless turn
    message_chars: int
    retrieval: bool
    max_tokens: int

    def to_json(self) -> dict:
        return asdict(self)


def message_text(chars: int, seed: int) -> str:
    """Made-up words, exactly ``chars`` characters long (at least one)."""
    rng = random.Random(seed)
    text = ""
    while len(text) < max(1, chars):
        text += rng.choice(_WORDS) + " "
    return text[:max(1, chars)]


def synthetic(*, rate: float, duration_s: float, tenants: list[str], sessions_per_tenant: int,
              retrieval_share: float, max_tokens: int, message_chars: int = 120, seed: int = 0) -> list[TurnSpec]:
    """Poisson arrivals at ``rate`` per second: multi-turn sessions across tenants, a share with retrieval.

    Each arrival continues one of its tenant's sessions, so sessions grow a
    history as agents' do, and every tenant keeps one stable system prompt.
    """
    rng = random.Random(seed)
    turns: list[TurnSpec] = []
    at = rng.expovariate(rate)
    while at < duration_s:
        tenant = tenants[len(turns) % len(tenants)]
        turns.append(TurnSpec(
            at_s=at, tenant=tenant, session=rng.randrange(sessions_per_tenant) if sessions_per_tenant else None,
            message_chars=max(8, int(rng.gauss(message_chars, message_chars / 4))),
            retrieval=rng.random() < retrieval_share, max_tokens=max_tokens))
        at += rng.expovariate(rate)
    return turns


def replay(path: Path, *, time_scale: float = 1.0, tenant: str = "dev") -> list[TurnSpec]:
    """The Chat turns recorded in a trace: the gateway's span file (``AGW_TRACE_FILE``) or an OTLP JSON export.

    Arrival times keep their gaps (times ``time_scale``); shapes come from the
    ``agw.turn.*`` attributes the gateway records on each Chat span.
    """
    spans = sorted(_chat_spans(path), key=lambda span: span[0])
    if not spans:
        raise ValueError(f"{path}: no {CHAT_SPAN} spans to replay (was AGW_TRACE_FILE set on the gateway?)")
    first = spans[0][0]
    sessions: dict[str, int] = {}
    turns = []
    for start_ns, attributes in spans:
        key = attributes.get("agw.turn.session_key")
        session = sessions.setdefault(key, len(sessions)) if key else None
        turns.append(TurnSpec(
            at_s=(start_ns - first) / 1e9 * time_scale, tenant=tenant, session=session,
            message_chars=int(attributes.get("agw.turn.message_chars", 64)),
            retrieval=bool(attributes.get("agw.turn.retrieval", False)),
            max_tokens=int(attributes.get("agw.turn.max_tokens", 0) or 64)))
    return turns


def _chat_spans(path: Path):
    """(start_ns, attributes) of each Chat server span in either format."""
    text = Path(path).read_text()
    stripped = text.lstrip()
    if stripped.startswith("{") and '"resourceSpans"' in stripped[:2000]:
        for batch in _otlp_batches(text):
            for resource in batch.get("resourceSpans", []):
                for scope in resource.get("scopeSpans", []):
                    for span in scope.get("spans", []):
                        if span.get("name") == CHAT_SPAN:
                            yield int(span["startTimeUnixNano"]), {a["key"]: _otlp_value(a["value"])
                                                                   for a in span.get("attributes", [])}
        return
    for line in text.splitlines():
        if line.strip():
            record = json.loads(line)
            if record.get("name") == CHAT_SPAN:
                yield int(record["start_ns"]), record.get("attributes", {})


def _otlp_batches(text: str):
    """One OTLP JSON document, or one per line (the Collector's file exporter)."""
    try:
        yield json.loads(text)
    except json.JSONDecodeError:
        for line in text.splitlines():
            if line.strip():
                yield json.loads(line)


def _otlp_value(value: dict):
    for kind in ("stringValue", "boolValue", "doubleValue"):
        if kind in value:
            return value[kind]
    if "intValue" in value:
        return int(value["intValue"])
    return None
