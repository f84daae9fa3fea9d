-- The functions of a table in generations (see create.sql), applied after the
-- numbered migrations.
-- {{…}}: the validated, quoted identifiers configured on the PostgresStore ({{schema_literal}}, {{table_literal}}: the bare names, as SQL strings).

-- Running rows, so that a generation's check for a live lease does not read its
-- whole partition.
CREATE INDEX IF NOT EXISTS {{running_index}} ON {{table}} (locked_until) WHERE state = 'running';

-- Serialises the writers that may insert a key: takes a transaction-scoped advisory
-- lock of the schema-qualified table's, the scope's and the key's (tables of other
-- schemas never wait on each other), held until the transaction ends, then
-- looks for the key in every generation; true when it has no row. The look is a
-- statement of its own, with a snapshot taken after the lock: under read committed it
-- sees every row committed by the transaction that held the lock before. Under
-- repeatable read or serializable it would not (its snapshot is the transaction's,
-- taken before the lock), and a key inserted into one generation by a transaction that
-- committed after it could be inserted into the next one again: refused.
CREATE OR REPLACE FUNCTION {{lock_key_function}}(p_scope text, p_key text)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'a table in generations is claimed under read committed only, not %',
                        current_setting('transaction_isolation')
            USING ERRCODE = 'feature_not_supported',
                  HINT = 'set default_transaction_isolation to read committed for the claims';
    END IF;
    PERFORM pg_advisory_xact_lock(hashtextextended(
        {{schema_literal}} || '.' || {{table_literal}} || ' ' || length(p_scope) || ' ' || p_scope || p_key, 0));
    RETURN NOT EXISTS (SELECT 1 FROM {{table}} WHERE scope = p_scope AND key = p_key);
END
$$;

-- The insert half of the claim (0003), for a table in generations: the key is
-- inserted into the newest generation, only if no generation has it.
CREATE OR REPLACE FUNCTION {{claim_function}}(
    p_scope text, p_key text, p_fingerprint bytea,
    p_lease_ms bigint, p_ttl_ms bigint, p_token bigint
) RETURNS bigint
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    inserted bigint;
BEGIN
    IF NOT {{lock_key_function}}(p_scope, p_key) THEN
        RETURN NULL;
    END IF;
    INSERT INTO {{table}} AS t (scope, key, fingerprint, state, token, locked_until, expires_at, generation)
    VALUES (p_scope, p_key, p_fingerprint, 'running', p_token,
            now() + p_lease_ms * interval '1 millisecond',
            now() + p_ttl_ms * interval '1 millisecond',
            (SELECT max(generation) FROM {{generations}}))
    ON CONFLICT (scope, key, generation) DO NOTHING
    RETURNING t.token INTO inserted;
    RETURN inserted;
END
$$;

-- A completed record for a key that has no row (transactional mode, after the
-- handler's own ROLLBACK removed the claim): true if inserted.
CREATE OR REPLACE FUNCTION {{insert_completed_function}}(
    p_scope text, p_key text, p_fingerprint bytea, p_token bigint, p_ttl_ms bigint,
    p_status smallint, p_headers bytea, p_body bytea
) RETURNS boolean
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    inserted boolean;
BEGIN
    IF NOT {{lock_key_function}}(p_scope, p_key) THEN
        RETURN false;
    END IF;
    INSERT INTO {{table}} (scope, key, fingerprint, state, token, expires_at,
                           completed_at, status, headers, body, generation)
    VALUES (p_scope, p_key, p_fingerprint, 'completed', p_token,
            statement_timestamp() + p_ttl_ms * interval '1 millisecond',
            statement_timestamp(), p_status, p_headers, p_body,
            (SELECT max(generation) FROM {{generations}}))
    ON CONFLICT (scope, key, generation) DO NOTHING
    RETURNING true INTO inserted;
    RETURN coalesce(inserted, false);
END
$$;

-- One step of the rotation, in this replica's turn only (the advisory lock `p_lock`,
-- tried once, held until the statement commits): starts a new generation when the
-- newest is `p_period_ms` old (NULL: never), then empties the oldest generation (never the newest)
-- that holds no live row: none unexpired, none running under a live lease. The check
-- is made again under an ACCESS EXCLUSIVE lock of its partition, waited for at most
-- `p_lock_timeout_ms` (claims queue behind that wait), so that no statement can
-- revive a row between the check and the TRUNCATE. Returns the generation started
-- (or NULL) and the one emptied (or NULL); an emptied generation is then detached
-- and dropped by the store, outside any transaction.
CREATE OR REPLACE FUNCTION {{rotate_function}}(p_period_ms bigint, p_lock bigint, p_lock_timeout_ms bigint)
RETURNS TABLE (started bigint, emptied bigint)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    newest bigint;
    newest_at timestamptz;
    g bigint;
    part text;
    live boolean;
BEGIN
    started := NULL;
    emptied := NULL;
    IF NOT pg_try_advisory_xact_lock(p_lock) THEN
        RETURN NEXT;
        RETURN;
    END IF;
    SELECT generation, started_at INTO newest, newest_at
    FROM {{generations}} ORDER BY generation DESC LIMIT 1;
    IF newest_at <= now() - p_period_ms * interval '1 millisecond' THEN
        newest := newest + 1;
        part := {{table_literal}} || '_g' || newest;
        -- Made apart and attached, which locks the parent in SHARE UPDATE EXCLUSIVE
        -- mode: claims go on (a CREATE TABLE … PARTITION OF would lock them out).
        EXECUTE format('CREATE TABLE %I.%I (LIKE {{table}} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)',
                       {{schema_literal}}, part);
        EXECUTE format('ALTER TABLE {{table}} ATTACH PARTITION %I.%I FOR VALUES IN (%s)',
                       {{schema_literal}}, part, newest);
        INSERT INTO {{generations}} (generation) VALUES (newest);
        started := newest;
    END IF;
    FOR g IN SELECT generation FROM {{generations}}
             WHERE generation < newest AND emptied_at IS NULL ORDER BY generation
    LOOP
        part := format('%I.%I', {{schema_literal}}, {{table_literal}} || '_g' || g);
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s WHERE expires_at > now())
                            OR EXISTS (SELECT 1 FROM %s WHERE state = ''running'' AND locked_until > now())',
                       part, part) INTO live;
        CONTINUE WHEN live;
        BEGIN
            PERFORM set_config('lock_timeout', p_lock_timeout_ms || 'ms', true);
            EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE', part);
        EXCEPTION WHEN lock_not_available THEN
            -- Busy: the next round tries again.
            RETURN NEXT;
            RETURN;
        END;
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s WHERE expires_at > now())
                            OR EXISTS (SELECT 1 FROM %s WHERE state = ''running'' AND locked_until > now())',
                       part, part) INTO live;
        IF NOT live THEN
            EXECUTE format('TRUNCATE %s', part);
            UPDATE {{generations}} SET emptied_at = now() WHERE generation = g;
            emptied := g;
        END IF;
        -- One lock per statement: it is held until the statement commits.
        EXIT;
    END LOOP;
    RETURN NEXT;
END
$$;
