-- One row per (scope, key).
-- {{table}} (schema-qualified), {{expires_index}}: the validated, quoted identifiers configured on the PostgresStore.
CREATE TABLE IF NOT EXISTS {{table}} (
    scope        text        NOT NULL,
    key          text        NOT NULL,
    fingerprint  bytea       NOT NULL,
    state        text        NOT NULL CHECK (state IN ('running', 'completed')),
    token        bigint      NOT NULL,
    locked_until timestamptz,
    expires_at   timestamptz NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    completed_at timestamptz,
    status       smallint,
    headers      bytea,
    body         bytea,
    PRIMARY KEY (scope, key)
);

-- The purger deletes by expiry in batches.
CREATE INDEX IF NOT EXISTS {{expires_index}} ON {{table}} (expires_at);
