-- agw_store_turn() also records the turn's trace id on both messages, so a
-- stored message leads to its trace in Jaeger. Migrations are append-only:
-- this replaces the function 0002 created rather than editing 0002.
DROP FUNCTION agw_store_turn(uuid, text, text, jsonb, text, integer, text, integer);

CREATE FUNCTION agw_store_turn(
    p_session uuid, p_tenant text, p_key text, p_result jsonb,
    p_user text, p_user_tokens integer, p_answer text, p_answer_tokens integer, p_trace_id text
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
        INSERT INTO agw_turns (session_id, idempotency_key, result) VALUES (p_session, p_key, p_result)
            ON CONFLICT DO NOTHING;
        IF NOT FOUND THEN
            RETURN 'already_stored';  -- a concurrent retry stored this turn first
        END IF;
    END IF;
    SELECT coalesce(max(ordinal), -1) INTO last_ordinal FROM agw_messages WHERE session_id = p_session;
    INSERT INTO agw_messages (session_id, ordinal, role, content, token_count, trace_id) VALUES
        (p_session, last_ordinal + 1, 'user', p_user, p_user_tokens, p_trace_id),
        (p_session, last_ordinal + 2, 'assistant', p_answer, p_answer_tokens, p_trace_id);
    RETURN 'stored';
END;
$$;
