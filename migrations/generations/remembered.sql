-- Remembered keys (`PostgresStore::remember_keys_for`) over a table in generations,
-- applied after the numbered migrations: a generation is emptied only once its rows
-- are all forgotten. A completed row whose response expired is remembered until its
-- expiry plus `p_remember_ms`: the purge reduces it (headers and body dropped,
-- `expires_at` moved to when it is forgotten), after which the check of generations.sql
-- (`expires_at > now()`) keeps its generation; one not reduced yet is looked for
-- here, by its expiry within the window and its headers still there. The form of
-- three arguments stays, for the stores of an older version during a rolling upgrade:
-- it remembers nothing, as they did.
-- {{…}}: the validated, quoted identifiers configured on the PostgresStore ({{schema_literal}}, {{table_literal}}: the bare names, as SQL strings).

-- One step of the rotation (generations.sql's, remembering keys), in this replica's turn only (the advisory lock `p_lock`,
-- tried once, held until the statement commits): starts a new generation when the
-- newest is `p_period_ms` old (NULL: never), then empties the oldest generation (never the newest)
-- that holds no live row: none unexpired, none running under a live lease. The check
-- is made again under an ACCESS EXCLUSIVE lock of its partition, waited for at most
-- `p_lock_timeout_ms` (claims queue behind that wait), so that no statement can
-- revive a row between the check and the TRUNCATE. Returns the generation started
-- (or NULL) and the one emptied (or NULL); an emptied generation is then detached
-- and dropped by the store, outside any transaction.
CREATE OR REPLACE FUNCTION {{rotate_function}}(
    p_period_ms bigint, p_lock bigint, p_lock_timeout_ms bigint, p_remember_ms bigint
)
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
                            OR EXISTS (SELECT 1 FROM %s WHERE expires_at > now() - %s * interval ''1 millisecond''
                                                          AND state = ''completed'' AND headers IS NOT NULL)
                            OR EXISTS (SELECT 1 FROM %s WHERE state = ''running'' AND locked_until > now())',
                       part, part, p_remember_ms, part) INTO live;
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
                            OR EXISTS (SELECT 1 FROM %s WHERE expires_at > now() - %s * interval ''1 millisecond''
                                                          AND state = ''completed'' AND headers IS NOT NULL)
                            OR EXISTS (SELECT 1 FROM %s WHERE state = ''running'' AND locked_until > now())',
                       part, part, p_remember_ms, part) INTO live;
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
