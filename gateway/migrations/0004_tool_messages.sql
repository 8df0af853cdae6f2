-- Tool loops: an assistant message may call tools (tool_calls: a JSON array of
-- {"id", "name", "arguments"}), and a tool message answers one call
-- (tool_call_id). Both are stored in order with the turn's other messages, so
-- a session's history replays exactly.
ALTER TABLE agw_messages ADD COLUMN tool_calls jsonb;
ALTER TABLE agw_messages ADD COLUMN tool_call_id text NOT NULL DEFAULT '';

-- agw_store_turn with any number of messages (tool results, the user's
-- message, the answer with its calls), as a JSON array of {"role", "content",
-- "token_count"[, "tool_calls"][, "tool_call_id"]}: one statement, one
-- transaction, consecutive ordinals. Outcomes as agw_store_turn's.
CREATE FUNCTION agw_store_turn_messages(
    p_session uuid, p_tenant text, p_key text, p_result jsonb, p_messages jsonb, p_trace_id text,
    p_holder uuid, p_fingerprint text
) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    last_ordinal integer;
BEGIN
    -- Lock the session row: concurrent turns of one session get consecutive ordinals.
    PERFORM 1 FROM agw_sessions WHERE id = p_session AND tenant = p_tenant FOR UPDATE;
    IF NOT FOUND THEN
        RETURN 'not_found';
    END IF;
    IF p_key <> '' THEN
        DELETE FROM agw_turn_claims WHERE session_id = p_session AND idempotency_key = p_key AND holder = p_holder;
        IF NOT FOUND THEN
            RETURN 'claim_lost';
        END IF;
        INSERT INTO agw_turns (session_id, idempotency_key, result, fingerprint)
            VALUES (p_session, p_key, p_result, p_fingerprint)
            ON CONFLICT DO NOTHING;
        IF NOT FOUND THEN
            RETURN 'already_stored';
        END IF;
    END IF;
    SELECT coalesce(max(ordinal), -1) INTO last_ordinal FROM agw_messages WHERE session_id = p_session;
    INSERT INTO agw_messages (session_id, ordinal, role, content, token_count, trace_id, tool_calls, tool_call_id)
        SELECT p_session, last_ordinal + m.position::integer, m.value->>'role', m.value->>'content',
               (m.value->>'token_count')::integer, p_trace_id, m.value->'tool_calls',
               coalesce(m.value->>'tool_call_id', '')
        FROM jsonb_array_elements(p_messages) WITH ORDINALITY AS m(value, position);
    RETURN 'stored';
END;
$$;
