-- One answer per idempotency key, across every worker and pod: a turn claims
-- its key here, with a lease, before it generates; a concurrent turn with the
-- same key waits for the holder's stored answer instead of generating its own.
-- A holder that dies leaves its claim to expire (lease_until); one that is
-- cancelled releases it. The fingerprint (a hash of the message, system prompt,
-- retrieval options and generation parameters) tells a retry from a different
-- request that reuses the key.
ALTER TABLE agw_turns ADD COLUMN fingerprint text NOT NULL DEFAULT '';

CREATE TABLE agw_turn_claims (
    session_id       uuid        NOT NULL REFERENCES agw_sessions (id) ON DELETE CASCADE,
    idempotency_key  text        NOT NULL,
    fingerprint      text        NOT NULL,
    holder           uuid        NOT NULL,
    lease_until      timestamptz NOT NULL,
    PRIMARY KEY (session_id, idempotency_key)
);

-- Outcomes: 'not_found' (no such session of the tenant), 'stored' (replay
-- result), 'mismatch' (the key belongs to another request), 'claimed' (the
-- caller holds the key now), 'held' (another turn holds it; wait and ask again).
CREATE FUNCTION agw_claim_turn(
    p_session uuid, p_tenant text, p_key text, p_fingerprint text, p_holder uuid, p_lease_ms integer
) RETURNS TABLE (outcome text, result jsonb) LANGUAGE plpgsql AS $$
DECLARE
    stored_result jsonb;
    stored_fingerprint text;
    claimed_fingerprint text;
BEGIN
    PERFORM 1 FROM agw_sessions WHERE id = p_session AND tenant = p_tenant;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, NULL::jsonb;
        RETURN;
    END IF;
    SELECT t.result, t.fingerprint INTO stored_result, stored_fingerprint
        FROM agw_turns t WHERE t.session_id = p_session AND t.idempotency_key = p_key;
    IF FOUND THEN
        -- '' is a turn stored before fingerprints existed: it replays for any request.
        IF stored_fingerprint <> '' AND stored_fingerprint <> p_fingerprint THEN
            RETURN QUERY SELECT 'mismatch'::text, NULL::jsonb;
        ELSE
            RETURN QUERY SELECT 'stored'::text, stored_result;
        END IF;
        RETURN;
    END IF;
    -- A new claim, or the takeover of one whose lease ran out (its holder died
    -- or hung; nothing was stored under the key, so any request may take it).
    INSERT INTO agw_turn_claims AS c (session_id, idempotency_key, fingerprint, holder, lease_until)
        VALUES (p_session, p_key, p_fingerprint, p_holder, clock_timestamp() + p_lease_ms * interval '1 millisecond')
        ON CONFLICT (session_id, idempotency_key) DO UPDATE
            SET fingerprint = EXCLUDED.fingerprint, holder = EXCLUDED.holder, lease_until = EXCLUDED.lease_until
            WHERE c.lease_until < clock_timestamp();
    IF FOUND THEN
        -- The holder before us may have stored the turn and released its claim
        -- between our look at agw_turns and our insert: look again (a new snapshot).
        SELECT t.result INTO stored_result
            FROM agw_turns t WHERE t.session_id = p_session AND t.idempotency_key = p_key;
        IF FOUND THEN
            DELETE FROM agw_turn_claims WHERE session_id = p_session AND idempotency_key = p_key AND holder = p_holder;
            RETURN QUERY SELECT 'stored'::text, stored_result;
        ELSE
            RETURN QUERY SELECT 'claimed'::text, NULL::jsonb;
        END IF;
        RETURN;
    END IF;
    SELECT c.fingerprint INTO claimed_fingerprint
        FROM agw_turn_claims c WHERE c.session_id = p_session AND c.idempotency_key = p_key;
    IF claimed_fingerprint IS DISTINCT FROM p_fingerprint THEN
        RETURN QUERY SELECT 'mismatch'::text, NULL::jsonb;
    ELSE
        RETURN QUERY SELECT 'held'::text, NULL::jsonb;
    END IF;
END;
$$;

-- Storing a turn now also ends its claim: only the claim's holder may store
-- under the key ('claim_lost' if its lease ran out and another turn took it).
DROP FUNCTION agw_store_turn(uuid, text, text, jsonb, text, integer, text, integer, text);
CREATE FUNCTION agw_store_turn(
    p_session uuid, p_tenant text, p_key text, p_result jsonb,
    p_user text, p_user_tokens integer, p_answer text, p_answer_tokens integer, p_trace_id text,
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
    INSERT INTO agw_messages (session_id, ordinal, role, content, token_count, trace_id) VALUES
        (p_session, last_ordinal + 1, 'user', p_user, p_user_tokens, p_trace_id),
        (p_session, last_ordinal + 2, 'assistant', p_answer, p_answer_tokens, p_trace_id);
    RETURN 'stored';
END;
$$;
