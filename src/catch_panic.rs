//! [`catch_panic`]: a handler's panic as a value, so the task that runs the handler can
//! release its key instead of dying with it.

use std::{any::Any, future::Future, panic::AssertUnwindSafe};

use futures_util::future::{CatchUnwind, FutureExt};

/// The payload of a caught panic.
pub(crate) type Panicked = Box<dyn Any + Send>;

/// Polls `future`, turning a panic during a poll into `Err`.
///
/// A guarded request runs inside the layer's own future, not in a task of its own;
/// this is what lets the layer still release the key or roll back after a panic
/// (the handler's, the storage policy's, a store's), whether or not its client is
/// still there to be answered.
pub(crate) fn catch_panic<F: Future>(future: F) -> CatchUnwind<AssertUnwindSafe<F>> {
    // Unwind safety: after a panic the future is never polled again (its owner only
    // releases the key and answers 500), so no broken invariant is observed.
    AssertUnwindSafe(future).catch_unwind()
}

/// The panic's message, when it has one, for the log.
pub(crate) fn message(panic: &Panicked) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panic_becomes_an_error_and_a_value_passes_through() {
        let ok = catch_panic(async { 7 }).await;
        assert_eq!(ok.ok(), Some(7));

        let caught = catch_panic(async {
            tokio::task::yield_now().await;
            panic!("the handler broke");
        })
        .await;
        let panic = caught.expect_err("the panic is caught");
        assert_eq!(message(&panic), "the handler broke");

        let formatted = catch_panic(async {
            let n = 3;
            panic!("broke at step {n}");
        })
        .await;
        assert_eq!(message(&formatted.expect_err("caught")), "broke at step 3");
    }
}
