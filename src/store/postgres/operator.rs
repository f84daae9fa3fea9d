//! An operator's actions (`Store::running_keys`, `release_running`, `delete_completed`):
//! the running keys listed, a running key released whatever its lease, a completed one
//! deleted. Each one statement; a removal that removes nothing reads the key again to
//! say why.

use std::time::Duration;

use tokio_postgres::types::ToSql;

use super::{
    PostgresStore,
    claim::ms,
    look_up::record,
    row::{Columns, need},
    sql::col,
};
use crate::{
    Scope,
    store::{FencingToken, KeyRecord, Removal, RunningKey, StoreError},
};

impl PostgresStore {
    /// The running keys claimed at least `older_than` ago, oldest first, at most
    /// `limit`.
    pub(super) async fn running_keys_pooled(
        &self,
        older_than: Duration,
        limit: usize,
    ) -> Result<Vec<RunningKey>, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let params: [&(dyn ToSql + Sync); 2] = [&ms(older_than), &limit];
        let rows = self.query_pooled(&self.sql.running_keys, &params).await?;
        rows.iter()
            .map(|row| running_key(row, self.sql.remember))
            .collect()
    }

    /// Deletes the running claim of `key` (held by `holder`, if given), waking those
    /// who wait for it.
    pub(super) async fn release_running_pooled(
        &self,
        scope: &Scope,
        key: &str,
        holder: Option<FencingToken>,
    ) -> Result<Removal, StoreError> {
        let id = self.key_id(scope, key);
        let channel = self.listener.channel();
        let params: [&(dyn ToSql + Sync); 5] = [&scope.as_str(), &key, &holder, &channel, &id];
        let rows = self
            .query_pooled(&self.sql.release_running, &params)
            .await?;
        self.removed(rows.first().map(|row| row.get(0)), scope, key)
            .await
    }

    /// Deletes the record of `key` if it is not running.
    pub(super) async fn delete_completed_pooled(
        &self,
        scope: &Scope,
        key: &str,
    ) -> Result<Removal, StoreError> {
        let params: [&(dyn ToSql + Sync); 2] = [&scope.as_str(), &key];
        let rows = self.query_pooled(&self.sql.delete_done, &params).await?;
        self.removed(rows.first().map(|row| row.get(0)), scope, key)
            .await
    }

    /// What a removal did: the token of the row it deleted, or else why it deleted
    /// none, as the key reads now.
    async fn removed(
        &self,
        token: Option<i64>,
        scope: &Scope,
        key: &str,
    ) -> Result<Removal, StoreError> {
        if let Some(token) = token {
            return Ok(removed(token));
        }
        Ok(refused(self.look_up_pooled(scope, key).await?))
    }
}

/// A row of the list of running keys (`col`), as a running key.
pub(super) fn running_key(
    row: &impl Columns,
    remember: Duration,
) -> Result<RunningKey, StoreError> {
    let scope = Scope::new(need(row.text(col::SCOPE), col::SCOPE)?);
    let key = need(row.text(col::KEY), col::KEY)?;
    Ok(RunningKey::new(
        scope,
        key.to_owned(),
        record(row, remember)?,
    ))
}

/// The removal of the row whose token a removing statement returned.
pub(super) fn removed(token: i64) -> Removal {
    Removal::Removed {
        token: FencingToken::new(token),
    }
}

/// Why a removing statement removed nothing, from the key's record read after it.
pub(super) fn refused(record: Option<KeyRecord>) -> Removal {
    match record {
        Some(record) => Removal::Refused(Box::new(record)),
        None => Removal::Absent,
    }
}
