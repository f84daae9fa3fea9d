//! A key's record read without changing it (`Store::look_up`): one primary-key read,
//! decoded as the claim's row is, with its times.

use std::time::{Duration, SystemTime};

use deadpool_postgres::ClientWrapper;
use tokio_postgres::types::ToSql;

use super::{
    PostgresStore,
    claim::{
        lease_left, reduced, remembered_until, stored_response,
        stored_status as stored_response_status,
    },
    errors::corrupt,
    row::{Columns, need},
    sql::col,
};
use crate::{
    Fingerprint, Scope,
    store::{FencingToken, KeyRecord, StoreError},
};

impl PostgresStore {
    /// The record of `key` in `scope`, read on a pooled connection.
    pub(super) async fn look_up_pooled(
        &self,
        scope: &Scope,
        key: &str,
    ) -> Result<Option<KeyRecord>, StoreError> {
        let params: [&(dyn ToSql + Sync); 2] = [&scope.as_str(), &key];
        let rows = self.query_pooled(&self.sql.look_up, &params).await?;
        rows.first()
            .map(|row| record(row, self.sql.remember))
            .transpose()
    }

    /// The record of `key` in `scope`, read on `client`, which may be inside a
    /// transaction (transactional mode looks a key up in the one that holds its claim).
    pub(crate) async fn look_up_on(
        &self,
        client: &ClientWrapper,
        scope: &Scope,
        key: &str,
    ) -> Result<Option<KeyRecord>, StoreError> {
        let params: [&(dyn ToSql + Sync); 2] = [&scope.as_str(), &key];
        let rows = self.query_on(client, &self.sql.look_up, &params).await?;
        rows.first()
            .map(|row| record(row, self.sql.remember))
            .transpose()
    }
}

/// A look-up's row (the claim's columns, up to `now`, then the record's times), as a
/// record; a completed key remembered for `remember` once its response expired.
pub(crate) fn record(row: &impl Columns, remember: Duration) -> Result<KeyRecord, StoreError> {
    let token = FencingToken::new(need(row.int8(col::TOKEN), col::TOKEN)?);
    let fingerprint = Fingerprint::from_slice(need(row.bytes(col::FINGERPRINT), col::FINGERPRINT)?)
        .ok_or_else(|| corrupt("fingerprint is not 32 bytes, nor 33 with a known scheme"))?;
    let now: SystemTime = need(row.time(col::NOW), col::NOW)?;
    let expires_at: SystemTime = need(row.time(col::EXPIRES_AT), col::EXPIRES_AT)?;
    let expires_in = expires_at.duration_since(now).unwrap_or(Duration::ZERO);
    let record = match need(row.text(col::STATE), col::STATE)? {
        "running" => KeyRecord::running(
            token,
            fingerprint,
            lease_left(row.time(col::LOCKED_UNTIL), now),
            expires_in,
        ),
        "completed" => match remembered_until(row, "completed", expires_at, remember) {
            Some(until) if expires_at <= now || reduced(row) => KeyRecord::remembered(
                token,
                fingerprint,
                stored_response_status(row)?,
                until.duration_since(now).unwrap_or(Duration::ZERO),
            ),
            _ => KeyRecord::completed(token, fingerprint, stored_response(row)?, expires_in),
        },
        other => return Err(corrupt(&format!("unknown state {other:?}"))),
    };
    let record = record.with_claimed_at(need(row.time(col::CREATED_AT), col::CREATED_AT)?);
    Ok(match row.time(col::COMPLETED_AT) {
        Some(at) => record.with_completed_at(at),
        None => record,
    })
}
