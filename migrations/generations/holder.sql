-- The claim's insert naming its holder (0004), for a table in generations, applied
-- after the numbered migrations (which add the `holder` column to the parent table,
-- and so to every partition): the key is inserted into the newest generation, only
-- if no generation has it, as in generations.sql.
-- {{…}}: the validated, quoted identifiers configured on the PostgresStore.
CREATE OR REPLACE FUNCTION {{claim_function}}(
    p_scope text, p_key text, p_fingerprint bytea,
    p_lease_ms bigint, p_ttl_ms bigint, p_token bigint, p_holder bigint
) RETURNS bigint
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    inserted bigint;
BEGIN
    IF NOT {{lock_key_function}}(p_scope, p_key) THEN
        RETURN NULL;
    END IF;
    INSERT INTO {{table}} AS t (scope, key, fingerprint, state, token, locked_until, expires_at, holder, generation)
    VALUES (p_scope, p_key, p_fingerprint, 'running', p_token,
            now() + p_lease_ms * interval '1 millisecond',
            now() + p_ttl_ms * interval '1 millisecond', p_holder,
            (SELECT max(generation) FROM {{generations}}))
    ON CONFLICT (scope, key, generation) DO NOTHING
    RETURNING t.token INTO inserted;
    RETURN inserted;
END
$$;
