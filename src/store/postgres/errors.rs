//! What a database error means: classified by SQLSTATE (never by message), shown with
//! the database's own words and, where the SQLSTATE makes the cause likely, what to do
//! about it; and the questions the store asks of one (a lost connection, a lost race, a
//! lock waited for), with the retry of a statement that lost a race under repeatable
//! read or serializable.

use std::{borrow::Cow, fmt, time::Duration};

use deadpool_postgres::PoolError;
use tokio_postgres::error::SqlState;

use super::claim::CLAIM_ATTEMPTS;
use crate::store::{StoreError, StoreErrorKind};

/// The bound on the first wait after a serialization failure; it doubles with each
/// further loss, up to `RACE_BACKOFF_CAP`. Sixteen attempts wait 0.35 s at most in all,
/// well within a store timeout.
pub(super) const RACE_BACKOFF_FIRST: Duration = Duration::from_millis(1);
pub(super) const RACE_BACKOFF_CAP: Duration = Duration::from_millis(32);

/// The hint of an error a transaction pooler causes in a store not built for one: a
/// statement prepared on one server session and executed on another, where it is
/// missing (`26000`) or another client's of the same name (`42P05`).
const BEHIND_A_POOLER: &str = "behind a transaction-pooling proxy (PgBouncer's pool_mode = transaction)? use with_transaction_pooling(true) (docs/postgres.md, \"Behind PgBouncer\")";

/// The hint of a table, column, function or schema missing while serving.
const NOT_MIGRATED: &str = "the store's table or one of its functions is missing or out of date: run migrate(), or apply migration_sql() with your migration tool; verify() names what differs";

/// The hint of a right missing while serving.
const APP_RIGHTS: &str = "the app's role needs CONNECT on the database, USAGE on the table's schema, SELECT, INSERT, UPDATE and DELETE on the table and on its _holders and _steps tables, and EXECUTE on its functions (docs/postgres.md, \"Privileges\")";

/// A database error as the store shows it: the database's message, its SQLSTATE, and
/// its detail and hint where it gave them; or, for an error that did not come from the
/// database (a connection refused, a TLS handshake), the driver's error and its causes.
/// Its `source` is the driver's error.
#[derive(Debug)]
pub(super) struct DatabaseError(pub(super) tokio_postgres::Error);

impl fmt::Display for DatabaseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        Shown(&self.0).fmt(f)
    }
}

/// A driver's error shown as [`DatabaseError`] shows it, for a log line.
pub(super) struct Shown<'a>(pub(super) &'a tokio_postgres::Error);

impl fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(db) = self.0.as_db_error() {
            write!(f, "{} (SQLSTATE {})", db.message(), db.code().code())?;
            // Sentences of their own, their full stop left out where the next part
            // follows.
            if let Some(detail) = db.detail() {
                write!(f, "; detail: {}", detail.trim_end_matches('.'))?;
            }
            if let Some(hint) = db.hint() {
                write!(f, "; hint: {}", hint.trim_end_matches('.'))?;
            }
            return Ok(());
        }
        // The driver's `Display` names the kind of failure only ("error connecting to
        // server"): its causes say which.
        write!(f, "{}", self.0)?;
        let mut cause = std::error::Error::source(self.0);
        while let Some(e) = cause {
            write!(f, ": {e}")?;
            cause = e.source();
        }
        Ok(())
    }
}

impl std::error::Error for DatabaseError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

/// `e` as the store shows it (see [`DatabaseError`]).
pub(crate) fn describe(e: &tokio_postgres::Error) -> String {
    Shown(e).to_string()
}

/// Classifies a database error by its SQLSTATE, never by its message, for the
/// statements that serve requests: a missing table or function is likely a store not
/// migrated, a missing right a role not granted it, a missing prepared statement a
/// transaction pooler, and the error says so.
pub(super) fn classify(e: tokio_postgres::Error) -> StoreError {
    classify_with(e, serving_hint)
}

/// The hint of an error of a statement that serves requests, by its SQLSTATE.
pub(crate) fn serving_hint(code: &SqlState) -> Option<Cow<'static, str>> {
    match *code {
        SqlState::UNDEFINED_TABLE
        | SqlState::UNDEFINED_COLUMN
        | SqlState::UNDEFINED_FUNCTION
        | SqlState::INVALID_SCHEMA_NAME => Some(NOT_MIGRATED.into()),
        SqlState::INSUFFICIENT_PRIVILEGE => Some(APP_RIGHTS.into()),
        _ => None,
    }
}

/// Classifies a database error by its SQLSTATE, with the hint `hint` gives for its
/// SQLSTATE where the caller knows the likely cause (errors without one, that did not
/// come from the database, get none). The errors of a transaction pooler get theirs
/// whatever the caller.
pub(super) fn classify_with(
    e: tokio_postgres::Error,
    hint: impl FnOnce(&SqlState) -> Option<Cow<'static, str>>,
) -> StoreError {
    let code = e.code().cloned();
    classified(code.as_ref(), hint, DatabaseError(e))
}

/// An error of either driver as the store reports it: its kind by its SQLSTATE (`None`:
/// it did not come from the database, which could not be reached), with the hint of a
/// transaction pooler's errors, or the one `hint` gives for its SQLSTATE.
pub(crate) fn classified(
    code: Option<&SqlState>,
    hint: impl FnOnce(&SqlState) -> Option<Cow<'static, str>>,
    error: impl std::error::Error + Send + Sync + 'static,
) -> StoreError {
    let kind = match code {
        None => StoreErrorKind::Unavailable,
        Some(code) if code.code().starts_with("08") => StoreErrorKind::Unavailable,
        Some(code) => match *code {
            SqlState::ADMIN_SHUTDOWN
            | SqlState::CRASH_SHUTDOWN
            | SqlState::CANNOT_CONNECT_NOW
            | SqlState::TOO_MANY_CONNECTIONS
            | SqlState::T_R_SERIALIZATION_FAILURE
            | SqlState::T_R_DEADLOCK_DETECTED
            | SqlState::READ_ONLY_SQL_TRANSACTION => StoreErrorKind::Unavailable,
            SqlState::QUERY_CANCELED | SqlState::LOCK_NOT_AVAILABLE => StoreErrorKind::Timeout,
            SqlState::UNDEFINED_TABLE
            | SqlState::UNDEFINED_COLUMN
            | SqlState::UNDEFINED_FUNCTION
            | SqlState::INVALID_SCHEMA_NAME
            | SqlState::INSUFFICIENT_PRIVILEGE
            | SqlState::INVALID_SQL_STATEMENT_NAME
            | SqlState::DUPLICATE_PSTATEMENT
            // A table in generations claimed under repeatable read or serializable.
            | SqlState::FEATURE_NOT_SUPPORTED => StoreErrorKind::Misconfigured,
            _ => StoreErrorKind::Other,
        },
    };
    let hint = match code {
        // The store never prepares a statement with SQL (`PREPARE`): a prepared
        // statement missing, or already there, is the driver's, prepared on one server
        // session and executed on another.
        Some(&SqlState::INVALID_SQL_STATEMENT_NAME | &SqlState::DUPLICATE_PSTATEMENT) => {
            Some(BEHIND_A_POOLER.into())
        }
        Some(code) => hint(code),
        None => None,
    };
    let error = StoreError::new(kind, error);
    match hint {
        Some(hint) => error.with_hint(hint),
        None => error,
    }
}

/// A database error of a statement whose failure means the database could not be
/// reached (a `BEGIN`, a `ROLLBACK`), whatever its SQLSTATE.
pub(super) fn unavailable(e: tokio_postgres::Error) -> StoreError {
    StoreError::new(StoreErrorKind::Unavailable, DatabaseError(e))
}

pub(super) fn classify_pool(e: PoolError) -> StoreError {
    match e {
        PoolError::Backend(e) => classify(e),
        PoolError::Timeout(_) => StoreError::new(StoreErrorKind::Timeout, e),
        PoolError::NoRuntimeSpecified => StoreError::new(StoreErrorKind::Misconfigured, e),
        _ => StoreError::new(StoreErrorKind::Unavailable, e),
    }
}

/// The SQLSTATE of the database error behind `e`, if there is one, whichever driver
/// sent its statement.
pub(super) fn sqlstate(e: &StoreError) -> Option<SqlState> {
    if let Some(e) = e.source.downcast_ref::<DatabaseError>() {
        return e.0.code().cloned();
    }
    #[cfg(feature = "sqlx")]
    if let Some(e) = e.source.downcast_ref::<::sqlx::Error>() {
        return super::sqlx_store::sqlstate(e);
    }
    None
}

/// Whether `e` is a statement refused because an earlier one failed in its transaction
/// (which PostgreSQL has then aborted: its `COMMIT` rolls back).
pub(crate) fn in_an_aborted_transaction(e: &StoreError) -> bool {
    sqlstate(e) == Some(SqlState::IN_FAILED_SQL_TRANSACTION)
}

/// Whether `e` is PostgreSQL cancelling the statement (`statement_timeout`, or a
/// cancel request): a slow database, not a row held by another request.
pub(crate) fn statement_cancelled(e: &StoreError) -> bool {
    sqlstate(e) == Some(SqlState::QUERY_CANCELED)
}

/// Whether `e` is PostgreSQL giving up on a row lock (`lock_timeout`).
pub(super) fn waited_for_a_lock(e: &StoreError) -> bool {
    sqlstate(e) == Some(SqlState::LOCK_NOT_AVAILABLE)
}

/// Whether `e` is a serialization failure: where transactions default to repeatable read
/// or serializable, a statement that meets a row committed after its snapshot (the key
/// inserted by a concurrent claim, the row changed by a concurrent takeover) fails so
/// rather than seeing it. A statement with a snapshot of its own can look again.
pub(super) fn lost_a_race(e: &StoreError) -> bool {
    sqlstate(e) == Some(SqlState::T_R_SERIALIZATION_FAILURE)
}

/// Runs `statement` again while it loses a race under repeatable read or serializable,
/// up to `CLAIM_ATTEMPTS` times in all. Each attempt must take a snapshot of its own:
/// one autocommit statement, or a transaction begun anew.
///
/// Under serializable, the statements that lost are the ones still running when another
/// committed, and they all run again together: at once, they would meet each other again,
/// and a burst of completions could lose sixteen times in a row. So each one waits a
/// random time first, up to a bound that doubles with every loss (`race_backoff`).
pub(crate) async fn again_if_it_lost_a_race<T, Fut>(
    mut statement: impl FnMut() -> Fut,
) -> Result<T, StoreError>
where
    Fut: Future<Output = Result<T, StoreError>>,
{
    let mut attempts = 1;
    loop {
        match statement().await {
            Err(e) if lost_a_race(&e) && attempts < CLAIM_ATTEMPTS => {
                tokio::time::sleep(race_backoff(attempts, crate::random::u64())).await;
                attempts += 1;
            }
            done => return done,
        }
    }
}

/// The wait before running a statement again after its `losses`-th serialization
/// failure: `random` scaled into `0..=bound`, where the bound starts at 1 ms and
/// doubles with each loss up to `RACE_BACKOFF_CAP` ("full jitter": the statements that
/// lost together spread out instead of meeting again).
pub(super) fn race_backoff(losses: usize, random: u64) -> Duration {
    let bound = RACE_BACKOFF_FIRST
        .saturating_mul(1 << (losses - 1).min(16))
        .min(RACE_BACKOFF_CAP);
    let micros = u64::try_from(bound.as_micros()).unwrap_or(u64::MAX);
    Duration::from_micros(random % (micros + 1))
}

/// Whether `e` ended its connection ([`connection_lost`]).
pub(super) fn lost_its_connection(e: &StoreError) -> bool {
    e.source
        .downcast_ref::<DatabaseError>()
        .is_some_and(|e| connection_lost(&e.0))
}

/// Whether `e` ended the connection: an I/O error or a closed connection (no
/// SQLSTATE), a connection exception (class `08`), or the server shutting the session
/// down.
pub(crate) fn connection_lost(e: &tokio_postgres::Error) -> bool {
    match e.code() {
        None => true,
        Some(code) => {
            code.code().starts_with("08")
                || [
                    SqlState::ADMIN_SHUTDOWN,
                    SqlState::CRASH_SHUTDOWN,
                    SqlState::CANNOT_CONNECT_NOW,
                ]
                .contains(code)
        }
    }
}

pub(super) fn corrupt(what: &str) -> StoreError {
    StoreError::new(StoreErrorKind::Corrupt, what.to_owned())
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_after_a_lost_race_are_spread_and_bounded() {
        let (us, ms) = (Duration::from_micros, Duration::from_millis);
        // The bound doubles with each loss from 1 ms, up to the cap.
        assert_eq!(race_backoff(1, 1_000), ms(1));
        assert_eq!(race_backoff(1, 1_001), ms(0));
        assert_eq!(race_backoff(3, 4_000), ms(4));
        assert_eq!(race_backoff(3, 4_001), ms(0));
        assert_eq!(race_backoff(6, 32_000), ms(32));
        assert_eq!(race_backoff(15, 32_000), ms(32));
        assert_eq!(race_backoff(15, 32_001), ms(0));
        assert_eq!(race_backoff(usize::MAX, 7), us(7));
        for losses in 1..CLAIM_ATTEMPTS {
            assert!(race_backoff(losses, u64::MAX) <= RACE_BACKOFF_CAP);
        }
        // Statements that lost together draw different waits.
        let waits: std::collections::HashSet<_> = (0..32)
            .map(|_| race_backoff(6, crate::random::u64()))
            .collect();
        assert!(waits.len() > 16, "{waits:?}");
    }
}
