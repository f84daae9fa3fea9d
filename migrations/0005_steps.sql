-- Recorded steps: what a running key's handler did on the way (a charge, say), so that
-- a later run of the key (a retry after a crash, a takeover) gets each step's result
-- instead of doing it again. Kept while the key runs: its completion, its release and
-- its deletion (the purge, an operator) forget them.
-- {{table}}, {{steps}}, {{steps_forget_function}}, {{steps_forget_on_update}}, {{steps_forget_on_delete}}: the validated, quoted identifiers configured on the PostgresStore.

-- Set by the first step a running claim records: the triggers below fire for such rows
-- only, so that a key without steps (almost every key) pays nothing for them.
ALTER TABLE {{table}} ADD COLUMN IF NOT EXISTS steps boolean NOT NULL DEFAULT false;

-- One row per step: its place in the handler's order (`n`, from 0), its name, the token
-- of the holder that recorded it, and its result as the app serialised it. In
-- transactional mode, whose claim row is not committed while the handler runs, the
-- request's fingerprint too: a claim rolled back leaves its steps for a retry of the
-- same request, and another request under the key does not see them.
CREATE TABLE IF NOT EXISTS {{steps}} (
    scope       text        NOT NULL,
    key         text        NOT NULL,
    n           integer     NOT NULL,
    name        text        NOT NULL,
    token       bigint      NOT NULL,
    result      bytea       NOT NULL,
    fingerprint bytea,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (scope, key, n)
);

-- Forgets the steps of a key: when its row is deleted, completed, or taken by another
-- request (another fingerprint, once the key expired).
CREATE OR REPLACE FUNCTION {{steps_forget_function}}() RETURNS trigger
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    DELETE FROM {{steps}} WHERE scope = OLD.scope AND key = OLD.key;
    IF TG_OP = 'UPDATE' THEN
        NEW.steps := false;
        RETURN NEW;
    END IF;
    RETURN OLD;
END
$$;

DROP TRIGGER IF EXISTS {{steps_forget_on_update}} ON {{table}};
CREATE TRIGGER {{steps_forget_on_update}}
    BEFORE UPDATE ON {{table}} FOR EACH ROW
    WHEN (OLD.steps AND (NEW.state <> 'running' OR NEW.fingerprint <> OLD.fingerprint))
    EXECUTE FUNCTION {{steps_forget_function}}();

DROP TRIGGER IF EXISTS {{steps_forget_on_delete}} ON {{table}};
CREATE TRIGGER {{steps_forget_on_delete}}
    AFTER DELETE ON {{table}} FOR EACH ROW
    WHEN (OLD.steps)
    EXECUTE FUNCTION {{steps_forget_function}}();
