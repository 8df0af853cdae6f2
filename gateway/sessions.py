"""Sessions and their messages in Postgres, always scoped to a tenant.

Every query names the tenant, so another tenant's session is indistinguishable
from one that does not exist: both are NOT_FOUND. Queries are parameterised;
content is stored and returned exactly as sent.
"""

from __future__ import annotations

import base64
import json
import uuid
from dataclasses import dataclass
from datetime import datetime

from servicekit.errors import InvalidArgument, NotFound, ResourceExhausted

from gateway.database import Database

MAX_PAGE_SIZE = 1000
DEFAULT_PAGE_SIZE = 50


@dataclass(frozen=True)
class SessionRecord:
    id: str
    created_at: datetime
    metadata: dict[str, str]
    message_count: int


@dataclass(frozen=True)
class MessageRecord:
    ordinal: int
    role: str
    content: str
    token_count: int
    trace_id: str
    created_at: datetime
    tool_calls: list[dict] | None = None
    """An assistant message's calls: {"id", "name", "arguments"} objects."""
    tool_call_id: str = ""


def parse_session_id(value: str, field: str = "session_id") -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except (ValueError, AttributeError, TypeError):
        raise InvalidArgument(field, f"{value!r} is not a session id (a UUID as CreateSession returns it)") from None


def _encode_token(ordinal: int) -> str:
    return base64.urlsafe_b64encode(f"o:{ordinal}".encode()).decode()


def _decode_token(token: str) -> int:
    try:
        kind, _, value = base64.urlsafe_b64decode(token.encode()).decode().partition(":")
        if kind == "o" and value.isdigit():
            return int(value)
    except (ValueError, UnicodeDecodeError):
        pass
    raise InvalidArgument("page_token", "is not a token this service issued; pass next_page_token unchanged")


class Sessions:
    """The session store."""

    def __init__(self, database: Database, *, max_per_tenant: int = 100_000) -> None:
        self.database = database
        self.max_per_tenant = max_per_tenant

    async def create(self, tenant: str, metadata: dict[str, str], session_id: str | None = None) -> SessionRecord:
        """A new session of ``tenant``'s, with ``session_id`` (a UUID; the inference replicas' placement chooses
        it) or a random id."""
        session_id = uuid.UUID(session_id) if session_id is not None else uuid.uuid4()
        # One statement: insert unless the tenant already holds its limit (counted through the
        # (tenant, created_at) index, at most max_per_tenant rows). Concurrent creates at the
        # limit may overshoot it by their number: the limit bounds growth, it is no quota ledger.
        row = await self.database.run(lambda c: c.fetchrow(
            "INSERT INTO agw_sessions (id, tenant, metadata) SELECT $1, $2, $3::jsonb"
            " WHERE (SELECT count(*) FROM (SELECT 1 FROM agw_sessions WHERE tenant = $2 LIMIT $4) held) < $4"
            " RETURNING created_at",
            session_id, tenant, json.dumps(metadata), self.max_per_tenant,
        ))
        if row is None:
            raise ResourceExhausted(
                f"tenant {tenant} holds {self.max_per_tenant} sessions, its limit "
                "(AGW_GATEWAY_MAX_SESSIONS_PER_TENANT); delete sessions it no longer needs", retry_after_s=None)
        return SessionRecord(str(session_id), row["created_at"], dict(metadata), 0)

    async def get(self, tenant: str, session_id: str) -> SessionRecord:
        sid = parse_session_id(session_id)
        row = await self.database.run(lambda c: c.fetchrow(
            "SELECT s.created_at, s.metadata, (SELECT count(*) FROM agw_messages m WHERE m.session_id = s.id) AS n"
            " FROM agw_sessions s WHERE s.id = $1 AND s.tenant = $2",
            sid, tenant,
        ))
        if row is None:
            raise NotFound(f"session {session_id} does not exist")
        return SessionRecord(str(sid), row["created_at"], json.loads(row["metadata"]), row["n"])

    async def delete(self, tenant: str, session_id: str) -> None:
        sid = parse_session_id(session_id)
        deleted = await self.database.run(lambda c: c.fetchval(
            "DELETE FROM agw_sessions WHERE id = $1 AND tenant = $2 RETURNING id", sid, tenant
        ))
        if deleted is None:
            raise NotFound(f"session {session_id} does not exist")

    async def list_messages(self, tenant: str, session_id: str, page_size: int, page_token: str
                            ) -> tuple[list[MessageRecord], str]:
        sid = parse_session_id(session_id)
        if page_size > MAX_PAGE_SIZE:
            raise InvalidArgument("page_size", f"at most {MAX_PAGE_SIZE} (got {page_size})")
        size = page_size or DEFAULT_PAGE_SIZE
        start = _decode_token(page_token) if page_token else 0
        async def page(connection):
            owned = await connection.fetchval("SELECT 1 FROM agw_sessions WHERE id = $1 AND tenant = $2", sid, tenant)
            if owned is None:
                return None
            return await connection.fetch(
                "SELECT ordinal, role, content, token_count, trace_id, created_at, tool_calls, tool_call_id"
                " FROM agw_messages"
                " WHERE session_id = $1 AND ordinal >= $2 ORDER BY ordinal LIMIT $3",
                sid, start, size + 1,
            )

        rows = await self.database.run(page)
        if rows is None:
            raise NotFound(f"session {session_id} does not exist")
        messages = [MessageRecord(**{**dict(row), "tool_calls": json.loads(row["tool_calls"] or "null")})
                    for row in rows[:size]]
        next_token = _encode_token(rows[size]["ordinal"]) if len(rows) > size else ""
        return messages, next_token
