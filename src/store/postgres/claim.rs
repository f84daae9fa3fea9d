//! The claim and the completion: one statement reads the key and, finding no row,
//! inserts it; a lapsed lease is taken over with the next token; a completion stores
//! the response only under the token that holds the key.

use std::{
    sync::{Arc, atomic::Ordering},
    time::{Duration, SystemTime},
};

use bytes::Bytes;
use deadpool_postgres::ClientWrapper;
use http::StatusCode;
use tokio_postgres::types::ToSql;

use super::{
    Checkout, PostgresStore,
    errors::{again_if_it_lost_a_race, corrupt, lost_its_connection, waited_for_a_lock},
    in_doubt::InDoubt,
    row::{Columns, need},
    shared,
    sql::{Statement, col},
};
use crate::{
    Fingerprint, StoredResponse,
    store::{Claim, ClaimRequest, Fenced, FencingToken, Lease, StoreError, StoreErrorKind},
};

/// Where a claim runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Within {
    /// Its own statement, committed as it ends (lease mode).
    Alone,
    /// The transaction that the `BEGIN` sent with it opened (transactional mode): it
    /// claims nothing, and returns no row, if that transaction did not begin (see
    /// `tx::Statements::claim`).
    ItsTransaction,
}

/// How many times a claim is re-read when the row changes under it.
pub(super) const CLAIM_ATTEMPTS: usize = 16;

/// What is left of a lease at the database's `now`, rounded up to the millisecond.
pub(super) fn lease_left(locked_until: Option<SystemTime>, now: SystemTime) -> Duration {
    let left = locked_until
        .and_then(|until| until.duration_since(now).ok())
        .unwrap_or_default();
    Duration::from_millis(u64::try_from(left.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX))
}

/// Milliseconds for SQL, at most ten years (as the layer's settings): PostgreSQL's
/// timestamps end in 294276 AD, and `now()` plus more fails the statement.
pub(super) fn ms(d: Duration) -> i64 {
    i64::try_from(d.min(crate::settings::TEN_YEARS).as_millis()).unwrap_or(i64::MAX)
}

impl PostgresStore {
    /// Claims on a shared connection if there is one with room, else on a pooled one.
    /// A claim whose connection is lost once its statement was sent is released in doubt.
    pub(super) async fn claim_with(
        &self,
        request: &ClaimRequest<'_>,
        token: FencingToken,
    ) -> Result<Claim, StoreError> {
        if let Some(shared) = &self.shared
            && let Some(claimed) = self.claim_shared(shared, request, token).await?
        {
            return Ok(claimed);
        }
        if let Some(batcher) = &self.batcher {
            return self.claim_batched(batcher, request, token).await;
        }
        self.claim_pooled(request, token).await
    }

    /// Claims on a shared connection if there is one with room; `None` when there is
    /// none, or the claim waited there on another's lock, and goes elsewhere. A future
    /// of its own, so that its pinned claim does not take room in every claim's.
    async fn claim_shared(
        &self,
        shared: &shared::Shared,
        request: &ClaimRequest<'_>,
        token: FencingToken,
    ) -> Result<Option<Claim>, StoreError> {
        let Some(mut client) = shared.get(&self.pool).await? else {
            return Ok(None);
        };
        let claimed = {
            let mut claiming = std::pin::pin!(again_if_it_lost_a_race(|| {
                self.claim_on(&client, request, token)
            }));
            match tokio::time::timeout(shared::STALLED, claiming.as_mut()).await {
                Ok(claimed) => claimed,
                Err(_) => {
                    // The next claims go to another connection; this one waits on
                    // (its caller's own bound answers its client).
                    shared.evict(&client);
                    claiming.await
                }
            }
        };
        client.answered();
        match claimed {
            Err(e) if waited_for_a_lock(&e) => {
                shared.moved_off();
                Ok(None)
            }
            Err(e) => {
                if lost_its_connection(&e) {
                    shared.evict(&client);
                    self.release_in_doubt(request, token);
                }
                Err(e)
            }
            Ok(claimed) => Ok(Some(claimed)),
        }
    }

    /// Claims on a pooled connection of its own; a claim whose connection is lost once
    /// its statement was sent is released in doubt.
    pub(super) async fn claim_pooled(
        &self,
        request: &ClaimRequest<'_>,
        token: FencingToken,
    ) -> Result<Claim, StoreError> {
        self.claim_checked_out(request, token, self.client().await?)
            .await
    }

    /// [`claim_pooled`](Self::claim_pooled) on `client`, checked out of the pool for it.
    pub(super) async fn claim_checked_out(
        &self,
        request: &ClaimRequest<'_>,
        token: FencingToken,
        client: Checkout,
    ) -> Result<Claim, StoreError> {
        let claiming = InDoubt::new(self, request, token, client);
        let claimed =
            again_if_it_lost_a_race(|| self.claim_on(claiming.client(), request, token)).await;
        claiming.settle(&claimed);
        claimed
    }

    /// Claims on `client` in lease mode, the claim naming this store as its holder if
    /// it has liveness (`with_liveness`). A fresh row gets `token`; the caller keeps it
    /// to release a claim in doubt.
    pub(crate) async fn claim_on(
        &self,
        client: &ClientWrapper,
        req: &ClaimRequest<'_>,
        token: FencingToken,
    ) -> Result<Claim, StoreError> {
        self.claim_within(Within::Alone, client, req, token, self.holder())
            .await
            .map(|(claim, ..)| claim)
    }

    /// Claims on `client`, `within` its own statement or the transaction a `BEGIN` sent
    /// with it opened (see [`Within`]; a conflicting row that another transaction has
    /// not committed yet is then waited for), for `holder` (`None`: judged by its lease
    /// alone, as transactional mode's claims are). Returns the database's `now()` as
    /// the claim read it: inside a transaction, the time it started, which a claim row
    /// inserted or taken over in it carries as `created_at`; and, within its
    /// transaction, the pid of the backend that runs it.
    pub(super) async fn claim_within(
        &self,
        within: Within,
        client: &ClientWrapper,
        req: &ClaimRequest<'_>,
        token: FencingToken,
        holder: Option<i64>,
    ) -> Result<(Claim, SystemTime, Option<i32>), StoreError> {
        // A store in use purges what it expires (`with_background_purge`).
        self.purge.start();
        for _ in 0..CLAIM_ATTEMPTS {
            if let (Some(claim), now, pid) =
                self.claim_once(within, client, req, token, holder).await?
            {
                return Ok((claim, now, pid));
            }
        }
        Err(StoreError::new(
            StoreErrorKind::Timeout,
            "the key kept changing while it was being claimed",
        ))
    }

    /// Stores `response` under `lease` on `client`; `Ok(false)` when the lease is lost.
    pub(crate) async fn complete_on(
        &self,
        client: &ClientWrapper,
        lease: &Lease,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<Fenced, StoreError> {
        self.complete_with(&self.sql.complete, client, lease, response, ttl)
            .await
    }

    /// Stores `response` under `lease` on `client` with `sql`, a completion statement.
    pub(super) async fn complete_with(
        &self,
        sql: &Statement,
        client: &ClientWrapper,
        lease: &Lease,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<Fenced, StoreError> {
        let status = response.status.as_u16() as i16;
        let headers = StoredResponse::encode_headers(&response.headers);
        let (h, b): (&[u8], &[u8]) = (&headers, &response.body);
        let id = self.key_id(&lease.scope, &lease.key);
        let rows = self
            .query_on(
                client,
                sql,
                &[
                    &lease.scope.as_str(),
                    &&*lease.key,
                    &lease.token,
                    &status,
                    &h,
                    &b,
                    &ms(ttl),
                    &self.listener.channel(),
                    &id,
                ],
            )
            .await?;
        Ok(Fenced::kept_if(rows.len() == 1))
    }

    /// A completion that matched no running row of its token (`LeaseLost`), told apart
    /// from one whose row its own token completed already with this very response: a
    /// completion sent again after its answer was lost (its connection cut once the
    /// statement had committed) stored it the first time, and is `Kept`. Any other
    /// response is never stored over a completed row, and stays `LeaseLost`.
    pub(super) async fn kept_already(
        &self,
        lease: &Lease,
        response: &StoredResponse,
        fenced: Result<Fenced, StoreError>,
    ) -> Result<Fenced, StoreError> {
        if !matches!(fenced, Ok(Fenced::LeaseLost)) {
            return fenced;
        }
        let status = response.status.as_u16() as i16;
        let headers = StoredResponse::encode_headers(&response.headers);
        let (h, b): (&[u8], &[u8]) = (&headers, &response.body);
        let client = self.running_client().await?;
        let params: [&(dyn ToSql + Sync); 6] = [
            &lease.scope.as_str(),
            &&*lease.key,
            &lease.token,
            &status,
            &h,
            &b,
        ];
        let read = client
            .answer(self.query_on(&client, &self.sql.completed_by, &params))
            .await;
        client.done(&read);
        Ok(Fenced::kept_if(!read?.is_empty()))
    }

    pub(super) async fn claim_once(
        &self,
        within: Within,
        client: &ClientWrapper,
        req: &ClaimRequest<'_>,
        token: FencingToken,
        holder: Option<i64>,
    ) -> Result<(Option<Claim>, SystemTime, Option<i32>), StoreError> {
        let lease_ms = ms(req.lease);
        let ttl_ms = ms(req.ttl);
        let fp: &[u8] = req.fingerprint.as_bytes();
        let sql = match within {
            Within::Alone => &self.sql.claim,
            Within::ItsTransaction => &self.sql.tx.claim,
        };
        let rows = self
            .query_on(
                client,
                sql,
                &[
                    &req.scope.as_str(),
                    &req.key,
                    &fp,
                    &lease_ms,
                    &ttl_ms,
                    &token,
                    &holder,
                ],
            )
            .await?;
        let row = match (rows.first(), within) {
            (Some(row), _) => row,
            (None, Within::Alone) => return Err(corrupt("the claim returned no row")),
            (None, Within::ItsTransaction) => {
                return Err(StoreError::new(
                    StoreErrorKind::Unavailable,
                    "the claim found no transaction of its own (its BEGIN failed), and claimed nothing",
                ));
            }
        };
        let pid = match within {
            Within::Alone => None,
            Within::ItsTransaction => Some(need(row.int4(col::TX_PID), col::TX_PID)?),
        };
        match found(row, req, self.sql.remember)? {
            (Found::Claim(claim), now) => Ok((claim, now, pid)),
            (Found::TakeOver(seen), now) => {
                Ok((self.take_over(client, req, seen, holder).await?, now, pid))
            }
        }
    }

    /// Takes over the lapsed lease (or the expired record, or the claim whose holder
    /// is gone) of `req`'s key, whose token the claim read, for `holder`; `None` when
    /// another request changed it first, or its holder is not gone after all.
    pub(super) async fn take_over(
        &self,
        client: &ClientWrapper,
        req: &ClaimRequest<'_>,
        seen: Seen,
        holder: Option<i64>,
    ) -> Result<Option<Claim>, StoreError> {
        let fp: &[u8] = req.fingerprint.as_bytes();
        let rows = self
            .query_on(
                client,
                &self.sql.takeover,
                &[
                    &req.scope.as_str(),
                    &req.key,
                    &seen.token,
                    &fp,
                    &ms(req.lease),
                    &ms(req.ttl),
                    &holder,
                ],
            )
            .await?;
        let Some(row) = rows.first() else {
            return Ok(None);
        };
        let token = FencingToken::new(need(row.int8(0), 0)?);
        if seen.holder_gone {
            if let Some(liveness) = &self.liveness {
                liveness.activity.takeovers.fetch_add(1, Ordering::Relaxed);
            }
            tracing::info!(
                %token,
                "took over a running key whose holder's process is gone (its lease had not lapsed)"
            );
        }
        Ok(Some(Claim::Acquired(Lease {
            scope: req.scope.clone(),
            key: Arc::from(req.key),
            token,
        })))
    }
}

/// What a takeover is asked to take over: the token the claim read, and whether it
/// found the holder gone (rather than the lease lapsed or the record expired).
#[derive(Debug, Clone, Copy)]
pub(super) struct Seen {
    pub(super) token: i64,
    pub(super) holder_gone: bool,
}

/// What a claim statement's row says of the key.
pub(super) enum Found {
    /// The claim's answer; `None`: look again (a concurrent request inserted the key
    /// after the statement's snapshot, or released it in between).
    Claim(Option<Claim>),
    /// A lapsed lease, an expired record, or a claim whose holder is gone, to take
    /// over.
    TakeOver(Seen),
}

/// Reads a claim statement's `row` (the columns of `col`) for `req`, with the
/// database's `now()` as the statement read it; a completed key is remembered for
/// `remember` once its response expired.
pub(crate) fn found(
    row: &impl Columns,
    req: &ClaimRequest<'_>,
    remember: Duration,
) -> Result<(Found, SystemTime), StoreError> {
    let lease = |token| Lease {
        scope: req.scope.clone(),
        key: Arc::from(req.key),
        token,
    };
    let now: SystemTime = need(row.time(col::NOW), col::NOW)?;
    let Some(token) = row.int8(col::TOKEN) else {
        // No row for the key. A token: ours, inserted. None: a concurrent request
        // inserted it after this statement's snapshot (or it was released in
        // between); either way, look again.
        let claimed = row.int8(col::CLAIMED);
        return Ok((
            Found::Claim(claimed.map(|token| Claim::Acquired(lease(FencingToken::new(token))))),
            now,
        ));
    };
    let fingerprint = Fingerprint::from_slice(need(row.bytes(col::FINGERPRINT), col::FINGERPRINT)?)
        .ok_or_else(|| corrupt("fingerprint is not 32 bytes, nor 33 with a known scheme"))?;
    let locked_until: Option<SystemTime> = row.time(col::LOCKED_UNTIL);
    let expires_at: SystemTime = need(row.time(col::EXPIRES_AT), col::EXPIRES_AT)?;
    let state: &str = need(row.text(col::STATE), col::STATE)?;
    // Asked of a running row with a holder, a live lease and this fingerprint only.
    let gone: Option<bool> = row.boolean(col::GONE);
    let lapsed = locked_until.is_some_and(|until| until <= now);
    let remembered_until = remembered_until(row, state, expires_at, remember);
    let expired = match remembered_until {
        Some(until) => until <= now,
        None => expires_at <= now && (state == "completed" || lapsed),
    };
    let holder_gone = gone == Some(true) && !expired;
    let take_over = expired
        || (state == "running" && (lapsed || holder_gone) && fingerprint == req.fingerprint);
    if take_over {
        let seen = Seen { token, holder_gone };
        return Ok((Found::TakeOver(seen), now));
    }
    let found = match state {
        "running" => Claim::Running {
            fingerprint,
            retry_after: lease_left(locked_until, now),
        },
        "completed" => match remembered_until {
            Some(remembered_until) if expires_at <= now || reduced(row) => Claim::Remembered {
                fingerprint,
                status: stored_status(row)?,
                completed_at: row.time(col::CLAIM_COMPLETED_AT).unwrap_or(now),
                remembered_until,
            },
            _ => Claim::Completed {
                fingerprint,
                response: stored_response(row)?,
            },
        },
        other => return Err(corrupt(&format!("unknown state {other:?}"))),
    };
    Ok((Found::Claim(Some(found)), now))
}

/// Whether a completed row was reduced to a remembered one (by the purge): its
/// headers dropped, which a stored response always has, if empty.
pub(super) fn reduced(row: &impl Columns) -> bool {
    row.bytes(col::HEADERS).is_none()
}

/// Until when a completed row's key is remembered: a reduced row's `expires_at` (the
/// purge moved it there); another's, its response's expiry plus `remember`. `None`
/// for a running row, and for a completed one when keys are not remembered.
pub(super) fn remembered_until(
    row: &impl Columns,
    state: &str,
    expires_at: SystemTime,
    remember: Duration,
) -> Option<SystemTime> {
    if state != "completed" {
        return None;
    }
    if reduced(row) {
        return Some(expires_at);
    }
    (!remember.is_zero()).then(|| expires_at + remember)
}

/// A completed row's stored status.
pub(super) fn stored_status(row: &impl Columns) -> Result<StatusCode, StoreError> {
    let status: i16 = row
        .int2(col::STATUS)
        .ok_or_else(|| corrupt("completed record without status"))?;
    u16::try_from(status)
        .ok()
        .and_then(|s| StatusCode::from_u16(s).ok())
        .ok_or_else(|| corrupt("stored status out of range"))
}

/// The stored response of a completed record, from a row with the claim's columns
/// (`col`): the claim's, or a look-up's.
pub(super) fn stored_response(row: &impl Columns) -> Result<StoredResponse, StoreError> {
    let status = stored_status(row)?;
    let headers = row
        .bytes(col::HEADERS)
        .and_then(StoredResponse::decode_headers)
        .ok_or_else(|| corrupt("stored headers undecodable"))?;
    let body: &[u8] = row
        .bytes(col::BODY)
        .ok_or_else(|| corrupt("completed record without body"))?;
    Ok(StoredResponse {
        status,
        headers,
        body: Bytes::copy_from_slice(body),
    })
}
