//! The statements the store sends ([`Sql`], one set per table), each with its text and
//! the types of its parameters ([`Statement`]), so that it can be sent prepared (once per connection, `prepare_cached`) or unnamed (parsed with
//! each execution, in the same message as it: behind a transaction-pooling PgBouncer,
//! where a statement prepared in one transaction is gone in the next).

use std::ops::Deref;

use tokio_postgres::types::{ToSql, Type};

/// A statement's text and its parameters' types.
#[derive(Clone)]
pub(super) struct Statement {
    text: String,
    types: &'static [Type],
}

impl Statement {
    pub(super) fn new(text: String, types: &'static [Type]) -> Self {
        Self { text, types }
    }
}

/// `params` with `sql`'s types, for an unnamed statement.
pub(super) fn typed<'a>(
    sql: &Statement,
    params: &[&'a (dyn ToSql + Sync)],
) -> Vec<(&'a (dyn ToSql + Sync), Type)> {
    debug_assert_eq!(params.len(), sql.types.len(), "{}", sql.text);
    params
        .iter()
        .zip(sql.types)
        .map(|(param, ty)| (*param, ty.clone()))
        .collect()
}

impl Deref for Statement {
    type Target = str;

    fn deref(&self) -> &str {
        &self.text
    }
}

/// The parameters of each statement, by position.
pub(super) mod params {
    use tokio_postgres::types::Type;

    /// scope, key, fingerprint, lease ms, ttl ms, token, holder (or NULL).
    pub(in super::super) const CLAIM: &[Type] = &[
        Type::TEXT,
        Type::TEXT,
        Type::BYTEA,
        Type::INT8,
        Type::INT8,
        Type::INT8,
        Type::INT8,
    ];
    /// A batch of claims, one array element per claim: scopes, keys, fingerprints,
    /// lease ms, ttl ms, tokens; and their holder.
    pub(in super::super) const CLAIM_BATCH: &[Type] = &[
        Type::TEXT_ARRAY,
        Type::TEXT_ARRAY,
        Type::BYTEA_ARRAY,
        Type::INT8_ARRAY,
        Type::INT8_ARRAY,
        Type::INT8_ARRAY,
        Type::INT8,
    ];
    /// scope, key, token seen, fingerprint, lease ms, ttl ms, holder (or NULL).
    pub(in super::super) const TAKEOVER: &[Type] = &[
        Type::TEXT,
        Type::TEXT,
        Type::INT8,
        Type::BYTEA,
        Type::INT8,
        Type::INT8,
        Type::INT8,
    ];
    /// scope, key, token, status, headers, body, ttl ms, channel, key id.
    pub(in super::super) const COMPLETE: &[Type] = &[
        Type::TEXT,
        Type::TEXT,
        Type::INT8,
        Type::INT2,
        Type::BYTEA,
        Type::BYTEA,
        Type::INT8,
        Type::TEXT,
        Type::TEXT,
    ];
    /// A batch of completions, one array element per completion: scopes, keys, tokens,
    /// statuses, headers, bodies, ttl ms, key ids; and the channel.
    pub(in super::super) const COMPLETE_BATCH: &[Type] = &[
        Type::TEXT_ARRAY,
        Type::TEXT_ARRAY,
        Type::INT8_ARRAY,
        Type::INT2_ARRAY,
        Type::BYTEA_ARRAY,
        Type::BYTEA_ARRAY,
        Type::INT8_ARRAY,
        Type::TEXT_ARRAY,
        Type::TEXT,
    ];
    /// scope, key, token, channel, key id.
    pub(in super::super) const RELEASE: &[Type] =
        &[Type::TEXT, Type::TEXT, Type::INT8, Type::TEXT, Type::TEXT];
    /// scope, key, token, lease ms.
    pub(in super::super) const RENEW: &[Type] = &[Type::TEXT, Type::TEXT, Type::INT8, Type::INT8];
    /// scope, key.
    pub(in super::super) const KEY: &[Type] = &[Type::TEXT, Type::TEXT];
    /// scope, key, the holder's token or NULL, channel, key id.
    pub(in super::super) const RELEASE_RUNNING: &[Type] =
        &[Type::TEXT, Type::TEXT, Type::INT8, Type::TEXT, Type::TEXT];
    /// older than ms, limit.
    pub(in super::super) const RUNNING_KEYS: &[Type] = &[Type::INT8, Type::INT8];
    /// scope, key, fingerprint.
    pub(in super::super) const KEY_AND_FINGERPRINT: &[Type] =
        &[Type::TEXT, Type::TEXT, Type::BYTEA];
    /// scope, key, token.
    pub(in super::super) const KEY_AND_TOKEN: &[Type] = &[Type::TEXT, Type::TEXT, Type::INT8];
    /// scope, key, token, status, headers, body.
    pub(in super::super) const COMPLETED_BY: &[Type] = &[
        Type::TEXT,
        Type::TEXT,
        Type::INT8,
        Type::INT2,
        Type::BYTEA,
        Type::BYTEA,
    ];
    /// scope, key, token, the claim's transaction start.
    pub(in super::super) const CLAIM_SIGNATURE: &[Type] =
        &[Type::TEXT, Type::TEXT, Type::INT8, Type::TIMESTAMPTZ];
    /// scope, key, token, the claim's transaction start, lease ms.
    pub(in super::super) const RENEW_ALONE: &[Type] = &[
        Type::TEXT,
        Type::TEXT,
        Type::INT8,
        Type::TIMESTAMPTZ,
        Type::INT8,
    ];
    /// scope, key, token, fingerprint, status, headers, body, ttl ms, the claim's
    /// transaction start, channel, key id.
    pub(in super::super) const FINISH_ENDED: &[Type] = &[
        Type::TEXT,
        Type::TEXT,
        Type::INT8,
        Type::BYTEA,
        Type::INT2,
        Type::BYTEA,
        Type::BYTEA,
        Type::INT8,
        Type::TIMESTAMPTZ,
        Type::TEXT,
        Type::TEXT,
    ];
    /// backend pid, its transaction's start.
    pub(in super::super) const END: &[Type] = &[Type::INT4, Type::TIMESTAMPTZ];
    /// batch.
    pub(in super::super) const PURGE: &[Type] = &[Type::INT8];
    /// batch, lock id.
    pub(in super::super) const PURGE_IN_TURN: &[Type] = &[Type::INT8, Type::INT8];
    /// A holder's id.
    pub(in super::super) const HOLDER: &[Type] = &[Type::INT8];
}

/// A fencing token is a `bigint` parameter.
impl ToSql for crate::store::FencingToken {
    fn to_sql(
        &self,
        ty: &Type,
        out: &mut bytes::BytesMut,
    ) -> Result<tokio_postgres::types::IsNull, Box<dyn std::error::Error + Sync + Send>> {
        self.get().to_sql(ty, out)
    }

    fn accepts(ty: &Type) -> bool {
        <i64 as ToSql>::accepts(ty)
    }

    tokio_postgres::types::to_sql_checked!();
}

/// The claim statement's columns, by position (`Sql::new` lists them in this order):
/// read by index, a replay does not search the columns by name ten times over.
pub(super) mod col {
    pub(in crate::store::postgres) const TOKEN: usize = 0;
    pub(in crate::store::postgres) const FINGERPRINT: usize = 1;
    pub(in crate::store::postgres) const STATE: usize = 2;
    pub(in crate::store::postgres) const LOCKED_UNTIL: usize = 3;
    pub(in crate::store::postgres) const EXPIRES_AT: usize = 4;
    pub(in crate::store::postgres) const STATUS: usize = 5;
    pub(in crate::store::postgres) const HEADERS: usize = 6;
    pub(in crate::store::postgres) const BODY: usize = 7;
    pub(in crate::store::postgres) const NOW: usize = 8;
    pub(in crate::store::postgres) const CLAIMED: usize = 9;
    /// Whether the holder of a running claim is gone (`liveness`): NULL when the row
    /// is not judged so (no holder, a lapsed lease, another fingerprint, no row).
    pub(in crate::store::postgres) const GONE: usize = 10;
    /// When the row was completed: what a remembered key's refusal says.
    pub(in crate::store::postgres) const CLAIM_COMPLETED_AT: usize = 11;
    /// Transactional mode's claim's own: the pid of the backend running its
    /// transaction (`tx::Statements::claim`).
    pub(in crate::store::postgres) const TX_PID: usize = 12;
    /// The batched claim's own: the claim's position in its batch, from 1.
    pub(in crate::store::postgres) const N: usize = 12;
    /// A look-up's own (and the list of running keys'), in place of `CLAIMED` and `N`.
    pub(in crate::store::postgres) const CREATED_AT: usize = 9;
    pub(in crate::store::postgres) const COMPLETED_AT: usize = 10;
    /// The list of running keys' own.
    pub(in crate::store::postgres) const SCOPE: usize = 11;
    pub(in crate::store::postgres) const KEY: usize = 12;
}

pub(super) struct Sql {
    pub(super) claim: Statement,
    /// Claims in a batch (`batch`).
    pub(super) claim_batch: Statement,
    pub(super) takeover: Statement,
    pub(super) complete: Statement,
    /// Completions in a batch (`batch_complete`).
    pub(super) complete_batch: Statement,
    /// Whether a lease's own token completed its row with a given response: a
    /// completion sent again after its answer was lost.
    pub(super) completed_by: Statement,
    pub(super) release: Statement,
    /// A key's record, read and nothing else (`Store::look_up`).
    pub(super) look_up: Statement,
    /// An operator's (`operator`): the running keys claimed before a time, oldest
    /// first; a running key deleted whatever its lease, by its token if given; a key
    /// that is not running deleted.
    pub(super) running_keys: Statement,
    pub(super) release_running: Statement,
    pub(super) delete_done: Statement,
    pub(super) renew: Statement,
    pub(super) wait: Statement,
    pub(super) in_doubt_wait: Statement,
    pub(super) in_doubt_read: Statement,
    pub(super) purge: Statement,
    pub(super) purge_in_turn: Statement,
    /// A table in generations': completed rows whose response expired reduced to
    /// remembered ones, in this replica's turn.
    pub(super) reduce_in_turn: Statement,
    /// How long a completed key is remembered once its response expired
    /// (`remember_keys_for`).
    pub(super) remember: std::time::Duration,
    /// Liveness's own (`liveness`): the registration of a holder that holds its lock,
    /// and the removal of holders long gone, on its liveness connection.
    pub(super) register_holder: Statement,
    pub(super) forget_holders: Statement,
    /// Transactional mode's own.
    pub(super) tx: super::tx::Statements,
    /// The role of a reserve connection, and whether it may do to the table what the
    /// statements of running claims do (`reserve::Setup::open`). Sent unnamed, once
    /// per connection opened.
    pub(super) reserve_check: String,
    pub(super) qualified: String,
    pub(super) expires_index: String,
    pub(super) migrations_table: String,
    pub(super) claim_function: String,
    /// `<table>_holders` and `<table>_holder_gone` (migration 0004).
    pub(super) holders: String,
    pub(super) holder_gone_function: String,
    /// The names of a table in generations, if it is one (`with_generations`).
    pub(super) generations: Option<super::generations::Names>,
    /// Recorded steps' own (migration 0005, `steps`).
    pub(super) steps: super::steps::Statements,
}

impl Sql {
    pub(super) fn new(
        schema: &str,
        table: &str,
        in_generations: bool,
        remember: std::time::Duration,
    ) -> Self {
        let names = in_generations.then(|| super::generations::Names::new(schema, table));
        let t = format!("\"{schema}\".\"{table}\"");
        let claim_function = format!("\"{schema}\".\"{table}_claim\"");
        let holders = format!("\"{schema}\".\"{table}_holders\"");
        let holder_gone_function = format!("\"{schema}\".\"{table}_holder_gone\"");
        // Whether a running row's holder is gone (migration 0004), for a row `f` that a
        // claim with fingerprint `fp` found: asked only of a running row with a holder,
        // a live lease and the claim's fingerprint, a row the claim could take over if
        // its holder were gone; NULL for any other.
        let grace = super::claim::ms(super::liveness::GRACE);
        let gone = |f: &str, fp: &str| {
            format!(
                "CASE WHEN {f}.state = 'running' AND {f}.holder IS NOT NULL
                           AND {f}.locked_until > now() AND {f}.fingerprint = {fp}
                      THEN {holder_gone_function}({f}.holder, {f}.created_at, {grace}) END AS gone"
            )
        };
        // A key's record as `look_up` decodes it: the claim's first columns, in their
        // order (`col`), then its times.
        let record = "token, fingerprint, state, locked_until, expires_at, status, headers, body,
                      now() AS now, created_at, completed_at";
        let ms = "$ms::bigint * interval '1 millisecond'";
        let window = format!(
            "{}::bigint * interval '1 millisecond'",
            super::claim::ms(remember)
        );
        let purge = |turn: &str| {
            format!(
                "WITH due AS (
                    SELECT ctid FROM {t}
                    WHERE {turn}expires_at <= now() AND (state = 'completed' OR locked_until <= now())
                    LIMIT $1 FOR UPDATE SKIP LOCKED),
                 gone AS (
                    DELETE FROM {t} WHERE ctid = ANY(ARRAY(SELECT ctid FROM due))
                      AND expires_at <= now() AND (state = 'completed' OR locked_until <= now())
                      AND (state = 'running' OR headers IS NULL OR expires_at + {window} <= now())
                    RETURNING 1),
                 reduced AS (
                    UPDATE {t} SET headers = NULL, body = NULL, expires_at = expires_at + {window}
                    WHERE ctid = ANY(ARRAY(SELECT ctid FROM due))
                      AND expires_at <= now() AND state = 'completed' AND headers IS NOT NULL
                      AND expires_at + {window} > now()
                    RETURNING 1)
                 SELECT 1 FROM gone UNION ALL SELECT 1 FROM reduced"
            )
        };
        // The notification is delivered when, and only if, the change commits. The
        // TTL counts from this statement: in transactional mode `now()` would be the
        // transaction's start, before the handler ran.
        let complete = |only: &str| {
            format!(
                "WITH done AS (
                    UPDATE {t} SET state = 'completed', locked_until = NULL, status = $4,
                           headers = $5, body = $6, completed_at = statement_timestamp(),
                           expires_at = statement_timestamp() + {e}
                    WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'running'{only}
                    RETURNING waiters)
                 SELECT CASE WHEN waiters THEN pg_notify($8, $9) END FROM done",
                e = ms.replace("$ms", "$7"),
            )
        };
        // A primary-key read that inserts only when the key has no row: the insert is a
        // function (migration 0003) called from a branch that an existing key never
        // takes, so a replay, a 409 or a 422 costs PostgreSQL about what a plain read
        // does (0.9x its rate, docs/postgres.md). Two requests that both find nothing
        // race on the insert, and its `ON CONFLICT` settles it; the loser gets neither a
        // row nor a token and reads again (`claim_on`). Times are compared in Rust
        // against the database's `now()`, which is cheaper than numeric arithmetic in
        // SQL.
        // The columns are read by position: keep them in the order of `col`.
        // A running row whose holder may be gone (its lease still live) is asked about
        // here too (`gone`), so that a 409 stays one round trip; the takeover asks
        // again, atomically, with the row's token. The claim's holder is `$7` (NULL in
        // transactional mode, whose claims are judged by their transaction).
        let claim = format!(
            "SELECT f.token, f.fingerprint, f.state, f.locked_until, f.expires_at,
                    f.status, f.headers, f.body, now() AS now,
                    CASE WHEN f.token IS NULL THEN {claim_function}($1, $2, $3, $4, $5, $6, $7) END AS claimed,
                    {gone}, f.completed_at
             FROM (VALUES (1)) AS one LEFT JOIN {t} AS f ON f.scope = $1 AND f.key = $2",
            gone = gone("f", "$3"),
        );
        Self {
            tx: super::tx::Statements::new(
                &t,
                &claim,
                Statement::new(complete(super::tx::WRITTEN_BY_THIS_TRANSACTION), params::COMPLETE),
                names.as_ref().map(|n| n.insert_completed_function.as_str()),
            ),
            claim: Statement::new(claim, params::CLAIM),
            // The claim of many keys at once (`batch`): the same columns per key, and its
            // position in the batch. Each key is read as the claim reads it, and the
            // missing ones are inserted by the same function, one after another in the
            // order of the arrays (sorted by the sender), so that concurrent batches
            // take their keys in one order and cannot deadlock: the keys are read by a
            // lateral subquery that is not flattened (`OFFSET 0`), so that the plan is a
            // nested loop over the arrays, in their order. Two claims of one key in a
            // batch both find no row; the second's insert then meets the first's row
            // and returns NULL, and it reads again, as it would after a statement of its
            // own. The `WHERE` on `r.n` always holds: it is there for the planner,
            // which assumes `unnest` returns a hundred rows and, for a plan of its own
            // with the arrays' real lengths, would plan the statement again at every
            // execution; a range on `n` of unknown bounds is estimated at one row,
            // and the plan kept for the connection is the same nested loop.
            claim_batch: Statement::new(
                format!(
                    "SELECT f.token, f.fingerprint, f.state, f.locked_until, f.expires_at,
                            f.status, f.headers, f.body, now() AS now,
                            CASE WHEN f.token IS NULL THEN {claim_function}(
                                r.scope, r.key, r.fingerprint, r.lease_ms, r.ttl_ms, r.token, $7) END AS claimed,
                            {gone}, f.completed_at,
                            r.n
                     FROM unnest($1::text[], $2::text[], $3::bytea[], $4::bigint[], $5::bigint[], $6::bigint[])
                          WITH ORDINALITY AS r(scope, key, fingerprint, lease_ms, ttl_ms, token, n)
                     LEFT JOIN LATERAL (
                         SELECT k.token, k.fingerprint, k.state, k.locked_until, k.expires_at,
                                k.status, k.headers, k.body, k.holder, k.created_at, k.completed_at
                         FROM {t} AS k WHERE k.scope = r.scope AND k.key = r.key OFFSET 0) AS f ON true
                     WHERE r.n >= 1 AND r.n <= array_length($2::text[], 1)
                     ORDER BY r.n",
                    gone = gone("f", "r.fingerprint"),
                ),
                params::CLAIM_BATCH,
            ),
            // A record taken over after it completed starts with nobody waiting on it
            // (the old value of `state` is read): a lapsed running one keeps its waiters.
            // A running one is taken over when its lease has lapsed, or, its lease still
            // live, when its holder is gone (migration 0004: asked last, the condition
            // costliest to evaluate, and only of the row whose token the claim saw).
            // The new holder is `$7` (NULL in transactional mode).
            takeover: Statement::new(
                format!(
                    "UPDATE {t} SET token = token + 1, state = 'running', fingerprint = $4,
                            locked_until = now() + {l}, expires_at = now() + {e}, created_at = now(),
                            completed_at = NULL, status = NULL, headers = NULL, body = NULL,
                            waiters = (state = 'running' AND waiters), holder = $7
                     WHERE scope = $1 AND key = $2 AND token = $3
                       AND (state = 'completed' OR locked_until <= now()
                            OR (state = 'running' AND fingerprint = $4 AND holder IS NOT NULL
                                AND {holder_gone_function}(holder, created_at, {grace})))
                       AND (expires_at <= now() OR (state = 'running' AND fingerprint = $4))
                     RETURNING token",
                    l = ms.replace("$ms", "$5"),
                    e = ms.replace("$ms", "$6"),
                ),
                params::TAKEOVER,
            ),
            complete: Statement::new(complete(""), params::COMPLETE),
            // The completion of many keys at once (`batch_complete`): each row matched by
            // its own token, as the completion of one, and one row back per completion
            // that landed (its position in the batch), with its waiters notified. The
            // `WHERE` on `n` always holds, for the planner (see `claim_batch`).
            complete_batch: Statement::new(
                format!(
                    "WITH r AS (
                        SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::smallint[],
                                             $5::bytea[], $6::bytea[], $7::bigint[], $8::text[])
                        WITH ORDINALITY AS r(scope, key, token, status, headers, body, ttl_ms, key_id, n)
                        WHERE n >= 1 AND n <= array_length($2::text[], 1)),
                     done AS (
                        UPDATE {t} AS k SET state = 'completed', locked_until = NULL, status = r.status,
                               headers = r.headers, body = r.body, completed_at = statement_timestamp(),
                               expires_at = statement_timestamp() + r.ttl_ms * interval '1 millisecond'
                        FROM r
                        WHERE k.scope = r.scope AND k.key = r.key AND k.token = r.token AND k.state = 'running'
                        RETURNING r.n, k.waiters, r.key_id)
                     SELECT n, CASE WHEN waiters THEN pg_notify($9, key_id) END FROM done"
                ),
                params::COMPLETE_BATCH,
            ),
            completed_by: Statement::new(
                format!(
                    "SELECT 1 FROM {t} WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'completed'
                       AND status = $4 AND headers = $5 AND body = $6"
                ),
                params::COMPLETED_BY,
            ),
            release: Statement::new(
                format!(
                    "WITH done AS (
                        DELETE FROM {t} WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'running'
                        RETURNING waiters)
                     SELECT CASE WHEN waiters THEN pg_notify($4, $5) END FROM done"
                ),
                params::RELEASE,
            ),
            // One primary-key read, its columns the claim's first ones, in their order
            // (`col`), so that a row of either is decoded alike (`look_up`), then its
            // times.
            look_up: Statement::new(
                format!(
                    "SELECT {record} FROM {t} WHERE scope = $1 AND key = $2"
                ),
                params::KEY,
            ),
            // No index serves it on a plain table: a sequential scan, every row read
            // (docs/postgres.md, "A key's life on demand"). A table in generations has
            // an index of its running rows.
            running_keys: Statement::new(
                format!(
                    "SELECT {record}, scope, key FROM {t}
                     WHERE state = 'running' AND created_at <= now() - {older}
                     ORDER BY created_at LIMIT $2",
                    older = ms.replace("$ms", "$1"),
                ),
                params::RUNNING_KEYS,
            ),
            // As a release, whatever the lease: the holder's token no longer names a
            // row, so its completion, renewal and release change nothing.
            release_running: Statement::new(
                format!(
                    "WITH gone AS (
                        DELETE FROM {t} WHERE scope = $1 AND key = $2 AND state = 'running'
                                          AND ($3::bigint IS NULL OR token = $3)
                        RETURNING token, waiters)
                     SELECT token, CASE WHEN waiters THEN pg_notify($4, $5) END FROM gone"
                ),
                params::RELEASE_RUNNING,
            ),
            // Nobody waits on a key that is not running: no notification.
            delete_done: Statement::new(
                format!(
                    "DELETE FROM {t} WHERE scope = $1 AND key = $2 AND state <> 'running'
                     RETURNING token"
                ),
                params::KEY,
            ),
            renew: Statement::new(
                format!(
                    "UPDATE {t} SET locked_until = now() + {l}, expires_at = greatest(expires_at, now() + {l})
                     WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'running'",
                    l = ms.replace("$ms", "$4"),
                ),
                params::RENEW,
            ),
            // Whether the key is still running, setting its `waiters` flag only where it
            // is not set yet: a retry storm on one key re-registers on every turn, and a
            // write each time would take the row lock and make a new row version each
            // time. A flag already set is read, not written (the outer read sees the
            // row as it was before the update, which never touches such a row).
            wait: Statement::new(
                format!(
                    "WITH flagged AS (
                        UPDATE {t} SET waiters = true
                        WHERE scope = $1 AND key = $2 AND state = 'running' AND NOT waiters
                        RETURNING 1)
                     SELECT EXISTS (SELECT 1 FROM flagged)
                         OR EXISTS (SELECT 1 FROM {t}
                                    WHERE scope = $1 AND key = $2 AND state = 'running' AND waiters)"
                ),
                params::KEY,
            ),
            // For a COMMIT in doubt (`committed_on`): an insert of the key, rolled back
            // after, waits for a transaction still inserting or updating its row (the
            // unique check waits on it); the read, in a snapshot taken after, sees how
            // that transaction ended. Not `FOR SHARE`: that would wait for a duplicate
            // that took the row since, through its whole handler.
            // In generations, the insert waits only for a transaction that inserted the
            // key (it holds the key's lock); one that took an existing row over is
            // waited for by locking that row, after.
            in_doubt_wait: Statement::new(
                if in_generations {
                    format!(
                        "SELECT {claim_function}($1, $2, $3, 1, 1, 0),
                                (SELECT count(*) FROM (SELECT 1 FROM {t} WHERE scope = $1 AND key = $2
                                                       FOR NO KEY UPDATE) AS held)"
                    )
                } else {
                    format!("SELECT {claim_function}($1, $2, $3, 1, 1, 0)")
                },
                params::KEY_AND_FINGERPRINT,
            ),
            in_doubt_read: Statement::new(
                format!(
                    "SELECT token, state, fingerprint, status, headers, body, created_at FROM {t}
                     WHERE scope = $1 AND key = $2"
                ),
                params::KEY,
            ),
            // Expired rows, a batch at a time: a completed row whose response expired is
            // reduced to a remembered one (headers and body dropped, status, fingerprint
            // and completion time kept, `expires_at` moved to when it is forgotten, so
            // that it leaves the expired range of the index the purge walks); a
            // remembered row past that time, a completed one past it unreduced, and a
            // lapsed running one are deleted. One row back per row changed, so that the
            // count of the command is the batch's.
            // The outer conditions repeat the inner one: a ctid names a row only within
            // one table, so on a partitioned table it could name a live row elsewhere.
            purge: Statement::new(purge(""), params::PURGE),
            // The background purge's batch: the same, in this replica's turn only (an
            // advisory lock of the table's own, `$2`, tried once per statement and held
            // until it commits; another replica's batch holding it changes nothing).
            purge_in_turn: Statement::new(
                purge("(SELECT pg_try_advisory_xact_lock($2)) AND "),
                params::PURGE_IN_TURN,
            ),
            // Over a table in generations, whose rows go with their generation: the
            // completed rows whose response expired are reduced (never deleted), so
            // that a generation with remembered rows lives on until they are forgotten.
            reduce_in_turn: Statement::new(
                format!(
                    "UPDATE {t} SET headers = NULL, body = NULL, expires_at = expires_at + {window}
                     WHERE ctid = ANY(ARRAY(
                        SELECT ctid FROM {t}
                        WHERE (SELECT pg_try_advisory_xact_lock($2))
                          AND expires_at <= now() AND state = 'completed' AND headers IS NOT NULL
                        LIMIT $1 FOR UPDATE SKIP LOCKED))
                     AND expires_at <= now() AND state = 'completed' AND headers IS NOT NULL"
                ),
                params::PURGE_IN_TURN,
            ),
            // On the liveness connection, once it holds the holder's lock (`$1`): this
            // server's start, so that a restart is told apart.
            register_holder: Statement::new(
                format!(
                    "INSERT INTO {holders} (holder, postmaster_start, seen_at)
                     VALUES ($1, pg_postmaster_start_time(), now())
                     ON CONFLICT (holder) DO UPDATE
                     SET postmaster_start = excluded.postmaster_start, seen_at = excluded.seen_at"
                ),
                params::HOLDER,
            ),
            // Holders unseen for a day whose lock is free: processes gone (a live one
            // registers again when it next holds its lock). A few at a time, each lock
            // tried only for them, and held until the statement commits.
            forget_holders: Statement::new(
                format!(
                    "WITH old AS MATERIALIZED (
                        SELECT holder FROM {holders}
                        WHERE holder <> $1 AND seen_at < now() - interval '1 day' LIMIT 64)
                     DELETE FROM {holders} AS h USING old
                     WHERE h.holder = old.holder AND pg_try_advisory_xact_lock(h.holder)"
                ),
                params::HOLDER,
            ),
            // Names are checked identifiers (`validate_identifier`), safe inside a
            // literal; the schema's is taken as it is, the table's parsed (quoted).
            reserve_check: format!(
                "SELECT current_user::text,
                        has_schema_privilege('{schema}', 'USAGE')
                        AND has_table_privilege('{t}', 'SELECT')
                        AND has_table_privilege('{t}', 'INSERT')
                        AND has_table_privilege('{t}', 'UPDATE')
                        AND has_table_privilege('{t}', 'DELETE')"
            ),
            migrations_table: format!("\"{schema}\".\"{table}_migrations\""),
            claim_function,
            holders,
            holder_gone_function,
            generations: names,
            remember,
            steps: super::steps::Statements::new(schema, table, &t),
            expires_index: format!("\"{table}_expires_at\""),
            qualified: t,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The columns `sql` selects, by their names.
    fn selected(sql: &str) -> Vec<&str> {
        let select_list = &sql[..sql.find(" FROM ").expect("a FROM clause")];
        // Split at the commas outside parentheses (the insert's call has its own).
        let mut depth = 0;
        let names: Vec<&str> = select_list
            .trim_start_matches("SELECT")
            .split(|c: char| {
                match c {
                    '(' => depth += 1,
                    ')' => depth -= 1,
                    _ => {}
                }
                c == ',' && depth == 0
            })
            .map(|c| c.split_whitespace().last().expect("a column"))
            .map(|c| c.rsplit('.').next().unwrap_or(c))
            .collect();
        names
    }

    #[test]
    fn claim_columns_are_read_in_the_order_the_statement_lists_them() {
        let sql = Sql::new("s", "t", false, std::time::Duration::ZERO);
        let names = selected(&sql.claim);
        let expected = [
            (col::TOKEN, "token"),
            (col::FINGERPRINT, "fingerprint"),
            (col::STATE, "state"),
            (col::LOCKED_UNTIL, "locked_until"),
            (col::EXPIRES_AT, "expires_at"),
            (col::STATUS, "status"),
            (col::HEADERS, "headers"),
            (col::BODY, "body"),
            (col::NOW, "now"),
            (col::CLAIMED, "claimed"),
            (col::GONE, "gone"),
            (col::CLAIM_COMPLETED_AT, "completed_at"),
        ];
        assert_eq!(names.len(), expected.len(), "{names:?}");
        for (index, name) in expected {
            assert_eq!(names[index], name, "column {index} of {names:?}");
        }
        // A look-up's row is decoded as the claim's: the same columns, up to `now`; then
        // its times, as the list of running keys has them, then its scope and key.
        let look_up = selected(&sql.look_up);
        assert_eq!(look_up[..=col::NOW], names[..=col::NOW]);
        assert_eq!(look_up[col::CREATED_AT], "created_at");
        assert_eq!(look_up[col::COMPLETED_AT], "completed_at");
        assert_eq!(look_up.len(), col::COMPLETED_AT + 1);
        let listed = selected(&sql.running_keys);
        assert_eq!(listed[..look_up.len()], look_up[..]);
        assert_eq!(listed[col::SCOPE], "scope");
        assert_eq!(listed[col::KEY], "key");
    }
}
