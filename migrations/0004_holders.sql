-- Liveness: which store (process) holds a running lease-mode claim, so that a duplicate
-- can take the claim over as soon as that process is gone instead of when its lease
-- lapses.
-- {{table}}, {{holders}}, {{claim_function}}, {{holder_gone_function}}: the validated, quoted identifiers configured on the PostgresStore.

-- The holder of a running claim: the store's random id, which is also the key of the
-- session-level advisory lock its liveness connection holds. NULL: the claim is judged
-- by its lease alone (transactional mode, a store without liveness, a claim made before
-- this migration).
ALTER TABLE {{table}} ADD COLUMN IF NOT EXISTS holder bigint;

-- One row per holder, written by its liveness connection once it holds its lock.
-- UNLOGGED, so that what it says never outlives the lock table it speaks of: a crash
-- restart empties it, and a standby never has its rows (a promoted standby starts with
-- none). `postmaster_start` tells a clean restart apart (the rows then survive, the
-- locks do not). `seen_at`: the holder's last sign of life, renewed while it runs claims.
CREATE UNLOGGED TABLE IF NOT EXISTS {{holders}} (
    holder           bigint      PRIMARY KEY,
    postmaster_start timestamptz NOT NULL,
    seen_at          timestamptz NOT NULL
);

-- The insert half of the claim (0003), naming the claim's holder. The six-argument form
-- stays, for the stores of an older version during a rolling upgrade, and for the
-- check of a claim in doubt. (Over a table in generations this is replaced at once by
-- the form of generations/holder.sql, in the same transaction.)
CREATE OR REPLACE FUNCTION {{claim_function}}(
    p_scope text, p_key text, p_fingerprint bytea,
    p_lease_ms bigint, p_ttl_ms bigint, p_token bigint, p_holder bigint
) RETURNS bigint
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    inserted bigint;
BEGIN
    INSERT INTO {{table}} AS t (scope, key, fingerprint, state, token, locked_until, expires_at, holder)
    VALUES (p_scope, p_key, p_fingerprint, 'running', p_token,
            now() + p_lease_ms * interval '1 millisecond',
            now() + p_ttl_ms * interval '1 millisecond', p_holder)
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING t.token INTO inserted;
    RETURN inserted;
END
$$;

-- Whether the holder of a running claim made at `p_claimed_at` is gone: true only if
--   - the claim is older than the grace (its holder was alive when it made it);
--   - the holder registered on this very server, since it last started (its row is
--     here, so no crash, promotion or failover came since, and `postmaster_start` is
--     this server's, so no clean restart came since either): its lock was held in
--     this lock table, which is the one asked;
--   - it has shown no sign of life for the grace (a live holder that lost its lock,
--     its liveness connection cut, goes on renewing `seen_at` from its pool);
--   - and its lock is free: no session holds it. Taken, not only looked at, and held
--     until the caller's transaction ends, so that a holder re-taking its lock waits
--     for the caller's takeover to commit, and two callers cannot both see it free.
-- In this order: the lock is tried last, only for a holder that is silent.
CREATE OR REPLACE FUNCTION {{holder_gone_function}}(
    p_holder bigint, p_claimed_at timestamptz, p_grace_ms bigint
) RETURNS boolean
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    RETURN p_claimed_at < now() - p_grace_ms * interval '1 millisecond'
       AND EXISTS (SELECT 1 FROM {{holders}} AS h
                   WHERE h.holder = p_holder
                     AND h.postmaster_start = pg_postmaster_start_time()
                     AND h.seen_at < now() - p_grace_ms * interval '1 millisecond')
       AND pg_try_advisory_xact_lock(p_holder);
END
$$;
