-- One round trip per stored turn, instead of five (begin, lock, max, insert,
-- commit): lock the session, claim the idempotency key, append both messages
-- with the turn's trace id. The function runs as one statement, so it is one
-- transaction; each statement inside takes a fresh snapshot, so the
-- max(ordinal) read after the lock sees every turn committed before it.
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
