-- The table in generations (`PostgresStore::with_generations`), created instead of the
-- plain one of 0001 when it does not exist yet: partitioned by `generation`, one
-- partition per generation, so that a generation whose rows have all expired is
-- emptied with a TRUNCATE rather than deleted row by row. Its columns are those of
-- 0001 and 0002, plus `generation`. The primary key of a partitioned table must
-- include the partition key, so it keeps `(scope, key)` unique per generation only:
-- the functions of `generations.sql` keep it unique across them.
-- {{table}}, {{generations}}, {{first_partition}}: the validated, quoted identifiers configured on the PostgresStore.
CREATE TABLE {{table}} (
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
    waiters      boolean     NOT NULL DEFAULT false,
    generation   bigint      NOT NULL,
    PRIMARY KEY (scope, key, generation)
) PARTITION BY LIST (generation);

-- One row per generation: the newest takes the new keys.
CREATE TABLE {{generations}} (
    generation bigint      PRIMARY KEY,
    started_at timestamptz NOT NULL DEFAULT now(),
    -- When its partition was emptied; it is then detached and dropped.
    emptied_at timestamptz
);

CREATE TABLE {{first_partition}} PARTITION OF {{table}} FOR VALUES IN (1);
INSERT INTO {{generations}} (generation) VALUES (1);
