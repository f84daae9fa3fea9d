//! The completer's part of the sqlx driver: a resumable key's request recorded under
//! its lease, and the resumable keys whose holder is gone (`Store::orphans`), by the
//! PostgreSQL store's statements and reading of rows (`store/postgres/steps.rs`).

use super::{super::steps::orphan, SqlxRow, SqlxStore};
use crate::store::{Fenced, Lease, Orphan, StoreError};

impl SqlxStore {
    /// Records the request of a resumable key under `lease`, if it still holds the key:
    /// the step of place -1, named as registered.
    pub(super) async fn record_request_held(
        &self,
        lease: &Lease,
        name: &str,
        request: &bytes::Bytes,
    ) -> Result<Fenced, StoreError> {
        let rows = super::super::errors::again_if_it_lost_a_race(|| {
            self.fetch_all(
                self.query(&self.sql.steps.record)
                    .bind(lease.scope.as_str())
                    .bind(&*lease.key)
                    .bind(lease.token.get())
                    .bind(-1i32)
                    .bind(name)
                    .bind(&request[..]),
            )
        })
        .await?;
        Ok(Fenced::kept_if(rows.len() == 1))
    }

    /// The resumable keys registered as `name` whose holder is gone.
    pub(super) async fn orphans_of(
        &self,
        name: &str,
        limit: usize,
    ) -> Result<Vec<Orphan>, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = self
            .fetch_all(self.query(&self.sql.steps.orphans).bind(name).bind(limit))
            .await?;
        rows.into_iter().map(|row| orphan(&SqlxRow(row))).collect()
    }
}
