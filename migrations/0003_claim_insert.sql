-- The insert half of the claim, called by the claim statement only when the key has no
-- row: an existing key (a replay, a 409, a 422) is then a plain primary-key read, with
-- no data-modifying part for PostgreSQL to set up. Returns the new row's token, or NULL
-- when a concurrent request inserted the key first (the claim then reads it again).
-- {{table}}, {{claim_function}}: the validated, quoted identifiers configured on the PostgresStore.
CREATE OR REPLACE FUNCTION {{claim_function}}(
    p_scope text, p_key text, p_fingerprint bytea,
    p_lease_ms bigint, p_ttl_ms bigint, p_token bigint
) RETURNS bigint
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    inserted bigint;
BEGIN
    INSERT INTO {{table}} AS t (scope, key, fingerprint, state, token, locked_until, expires_at)
    VALUES (p_scope, p_key, p_fingerprint, 'running', p_token,
            now() + p_lease_ms * interval '1 millisecond',
            now() + p_ttl_ms * interval '1 millisecond')
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING t.token INTO inserted;
    RETURN inserted;
END
$$;
