//! A statement the store sends: its text, and the types of its parameters, so that it
//! can be sent prepared (once per connection, `prepare_cached`) or unnamed (parsed with
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

    /// scope, key, fingerprint, lease ms, ttl ms, token.
    pub(in super::super) const CLAIM: &[Type] = &[
        Type::TEXT,
        Type::TEXT,
        Type::BYTEA,
        Type::INT8,
        Type::INT8,
        Type::INT8,
    ];
    /// scope, key, token seen, fingerprint, lease ms, ttl ms.
    pub(in super::super) const TAKEOVER: &[Type] = &[
        Type::TEXT,
        Type::TEXT,
        Type::INT8,
        Type::BYTEA,
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
    /// scope, key, token, channel, key id.
    pub(in super::super) const RELEASE: &[Type] =
        &[Type::TEXT, Type::TEXT, Type::INT8, Type::TEXT, Type::TEXT];
    /// scope, key, token, lease ms.
    pub(in super::super) const RENEW: &[Type] = &[Type::TEXT, Type::TEXT, Type::INT8, Type::INT8];
    /// scope, key.
    pub(in super::super) const KEY: &[Type] = &[Type::TEXT, Type::TEXT];
    /// scope, key, fingerprint.
    pub(in super::super) const KEY_AND_FINGERPRINT: &[Type] =
        &[Type::TEXT, Type::TEXT, Type::BYTEA];
    /// scope, key, token.
    pub(in super::super) const KEY_AND_TOKEN: &[Type] = &[Type::TEXT, Type::TEXT, Type::INT8];
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
