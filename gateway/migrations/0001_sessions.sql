-- Sessions, their messages, and one idempotency record per stored turn.
CREATE TABLE agw_sessions (
    id          uuid        PRIMARY KEY,
    tenant      text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    metadata    jsonb       NOT NULL DEFAULT '{}'::jsonb
);
CREATE INDEX agw_sessions_by_tenant ON agw_sessions (tenant, created_at);

CREATE TABLE agw_messages (
    session_id   uuid        NOT NULL REFERENCES agw_sessions (id) ON DELETE CASCADE,
    ordinal      integer     NOT NULL,
    role         text        NOT NULL,
    content      text        NOT NULL,
    token_count  integer     NOT NULL DEFAULT 0,
    trace_id     text        NOT NULL DEFAULT '',
    created_at   timestamptz NOT NULL DEFAULT now(),
    -- The primary key is also the index the history query walks backwards.
    PRIMARY KEY (session_id, ordinal)
);

CREATE TABLE agw_turns (
    session_id       uuid        NOT NULL REFERENCES agw_sessions (id) ON DELETE CASCADE,
    idempotency_key  text        NOT NULL,
    result           jsonb       NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (session_id, idempotency_key)
);
