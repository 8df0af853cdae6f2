"""Where Chat turns are read and stored, and how an idempotency key gets exactly one answer.

A turn with an idempotency key claims the key in Postgres before it generates
(``agw_claim_turn``, migrations/0003_turn_claims.sql), with a lease as long as
the turn may run. So every worker and pod agrees on who answers:

- the first turn claims the key, generates, and stores its messages and result
  in the same transaction that ends the claim (``agw_store_turn``);
- a concurrent turn with the key and the same request waits for that answer
  and replays it, or gets ``ABORTED`` when its deadline comes first;
- the same key with a different request (another fingerprint) gets
  ``FAILED_PRECONDITION``, as payment APIs answer;
- a holder that is cancelled releases its claim at once; one that dies leaves
  it to expire with its lease, after which a retry generates afresh.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, replace

from agent.gateway.v1 import gateway_pb2 as pb
from servicekit.errors import Aborted, FailedPrecondition, NotFound

from gateway.convert import outcome_from_proto, outcome_to_proto, tool_calls_from_json
from gateway.database import Database
from gateway.turn_types import Outcome, TurnRequest

log = logging.getLogger(__name__)

#: How often a turn waiting on another's claim asks again, at most and at first.
POLL_MAX_S = 0.25
POLL_FIRST_S = 0.02


@dataclass(frozen=True)
class Claim:
    """This turn holds ``key`` in ``session_id`` until it stores or releases it."""

    session_id: uuid.UUID
    key: str
    fingerprint: str
    holder: uuid.UUID


@dataclass(frozen=True)
class StoredTurn:
    """A turn already answered under the key: its text, its tool calls and outcome, marked replayed."""

    text: str
    outcome: Outcome
    tool_calls: tuple = ()

    @classmethod
    def from_json(cls, value: str | dict) -> StoredTurn:
        # Stored as the TurnSummary the client got, so a replay answers with the same message.
        data = json.loads(value) if isinstance(value, str) else value
        outcome = outcome_from_proto(pb.TurnSummary.FromString(bytes.fromhex(data["final"])))
        return cls(data["text"], replace(outcome, replayed=True), tuple(tool_calls_from_json(data.get("tool_calls"))))


class TurnStore:
    """Claims, replays and stores turns; every query is scoped to the tenant."""

    def __init__(self, database: Database) -> None:
        self.database = database

    async def recent_messages(self, tenant: str, session_id: uuid.UUID, limit: int) -> list:
        """The session's last ``limit`` messages, newest first (ordinal, role, content, token_count, tool_calls
        as JSON text, tool_call_id).

        One round trip: the session's ownership and its messages, through the
        primary key index. No row: not this tenant's session (or none), NOT_FOUND;
        one row of NULLs: no messages yet.
        """
        rows = await self.database.run(lambda c: c.fetch(
            "SELECT m.ordinal, m.role, m.content, m.token_count, m.tool_calls, m.tool_call_id"
            " FROM agw_sessions s LEFT JOIN LATERAL ("
            "  SELECT ordinal, role, content, token_count, tool_calls, tool_call_id FROM agw_messages"
            "  WHERE session_id = s.id"
            "  ORDER BY ordinal DESC LIMIT $3) m ON true"
            " WHERE s.id = $1 AND s.tenant = $2 ORDER BY m.ordinal DESC", session_id, tenant, limit))
        if not rows:
            raise NotFound(f"session {session_id} does not exist")
        return [row for row in rows if row["ordinal"] is not None]

    async def claim(self, tenant: str, session_id: uuid.UUID, request: TurnRequest, *, lease_s: float,
                    wait_s: float) -> Claim | StoredTurn:
        """Claim the request's key, or wait up to ``wait_s`` for the turn that holds it and return its answer.

        Raises:
            NotFound: no such session of the tenant.
            FailedPrecondition: the key was used for a different request.
            Aborted: another turn still holds the key after ``wait_s``.
        """
        key, print_ = request.idempotency_key, request.fingerprint
        holder = uuid.uuid4()
        deadline = time.monotonic() + wait_s
        pause = POLL_FIRST_S
        while True:
            row = await self.database.run(lambda c: c.fetchrow(
                "SELECT outcome, result FROM agw_claim_turn($1, $2, $3, $4, $5, $6)",
                session_id, tenant, key, print_, holder, max(1, int(lease_s * 1000))))
            outcome = row["outcome"]
            if outcome == "claimed":
                return Claim(session_id, key, print_, holder)
            if outcome == "stored":
                return StoredTurn.from_json(row["result"])
            if outcome == "not_found":
                raise NotFound(f"session {session_id} does not exist")
            if outcome == "mismatch":
                raise FailedPrecondition(
                    f"idempotency_key {key!r} was used for a different request in this session (another message, "
                    "system prompt, retrieval or generation options); use a new key for a new turn")
            left = deadline - time.monotonic()  # "held": another turn is answering under this key
            if left <= 0:
                raise Aborted(f"a turn with idempotency_key {key!r} is in progress; retry to get its answer once "
                              "it is stored")
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 2, POLL_MAX_S)

    async def release(self, claim: Claim) -> None:
        """Give the key up without storing (the turn failed or was cancelled): a retry may generate afresh."""
        await self.database.run(lambda c: c.execute(
            "DELETE FROM agw_turn_claims WHERE session_id = $1 AND idempotency_key = $2 AND holder = $3",
            claim.session_id, claim.key, claim.holder))

    async def store(self, tenant: str, session_id: uuid.UUID, request: TurnRequest, claim: Claim | None, *,
                    messages: list[dict], outcome: Outcome, trace_id: str) -> None:
        """Append the turn's messages (tool results, the user's, then the answer with its calls, last; as
        migrations/0004 takes them) and the key's result (the answer, for replays), in one transaction."""
        answer = messages[-1]
        result = json.dumps({"text": answer["content"], "tool_calls": answer.get("tool_calls", []),
                             "final": outcome_to_proto(outcome).SerializeToString().hex()})
        outcome = await self.database.run(lambda connection: connection.fetchval(
            "SELECT agw_store_turn_messages($1, $2, $3, $4::jsonb, $5::jsonb, $6, $7, $8)",
            session_id, tenant, request.idempotency_key, result, json.dumps(messages), trace_id,
            claim.holder if claim else None, claim.fingerprint if claim else ""))
        if outcome == "not_found":
            raise NotFound(f"session {session_id} does not exist")
        if outcome in ("claim_lost", "already_stored"):
            # Our lease ran out mid-turn and another attempt took the key: its answer is the stored one.
            raise Aborted(f"this turn outlived its claim on idempotency_key {request.idempotency_key!r} and another "
                          "attempt answered it; retry with the same key to get the stored answer")
