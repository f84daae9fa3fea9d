//! The guides: how the layer behaves when things break, which mode to pick, how to run
//! it on PostgreSQL, what it keeps and shows, what it logs and counts, what clients
//! should do, and how it reads against the standards. The same pages as the
//! repository's `docs/`, and their examples compiled and run as tests.

/// Lease mode and transactional mode: what each guarantees, costs and cannot do.
pub mod modes {
    #![doc = include_str!("../docs/modes.md")]
}

/// Recorded steps and resumable handlers: a handler that dies half-way is finished,
/// not redone.
pub mod steps {
    #![doc = include_str!("../docs/steps.md")]
}

/// Every fault, what the client sees, what the table holds, and the test that proves it.
///
/// [modes]: crate::guide::modes
pub mod failure_modes {
    #![doc = include_str!("../docs/failure-modes.md")]
}

/// Running the store on PostgreSQL: the table, the statements, pooling, retention.
///
/// [problems]: crate::rejection
pub mod postgres {
    #![doc = include_str!("../docs/postgres.md")]
}

/// Keys, scopes, what is stored and for how long, and what the traces show.
pub mod security {
    #![doc = include_str!("../docs/security.md")]
}

/// What the layer logs of each request, at which level and why; and its metrics.
///
/// [security]: crate::guide::security
pub mod observability {
    #![doc = include_str!("../docs/observability.md")]
}

/// For API clients: what to retry, retry settings, and what they live through.
pub mod clients {
    #![doc = include_str!("../docs/clients.md")]
}

/// The IETF Idempotency-Key draft and Stripe's behaviour, point by point.
pub mod standards {
    #![doc = include_str!("../docs/standards.md")]
}

/// From an empty app to production in one page: PostgreSQL behind PgBouncer, scope by
/// the authenticated account, the app's error type, migrations in the team's tool,
/// metrics and a graceful shutdown.
pub mod production {
    #![doc = include_str!("../docs/production.md")]
}
