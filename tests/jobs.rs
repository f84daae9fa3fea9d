//! Idempotent work without HTTP: a queue consumer deduplicating deliveries.
#![allow(clippy::unwrap_used)] // unwrap in test helpers: a failure is the test failing

mod common;

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use common::{
    TestSchema,
    completions::{AlteredCompletions, Completion},
};
use tower_idempotency::{
    Scope,
    job::{JobError, JobOutcome, JobRunner},
    store::{MemoryStore, Store},
};

/// Delivers `key` again while another run holds it (at most ~10 s, a bounded wait),
/// with a fresh `work` each time; the first outcome that is not `Running`.
async fn redeliver_past_running<W, Fut, E>(
    runner: &JobRunner,
    scope: &Scope,
    key: &str,
    input: &[u8],
    work: impl Fn() -> W,
) -> Option<JobOutcome>
where
    W: FnOnce(tower_idempotency::job::JobContext) -> Fut,
    Fut: std::future::Future<Output = Result<Bytes, E>> + Send + 'static,
    E: Send + 'static + std::fmt::Debug,
{
    for _ in 0..500 {
        let outcome = runner
            .run(scope, key, input, work())
            .await
            .expect("a redelivery");
        if !matches!(outcome, JobOutcome::Running { .. }) {
            return Some(outcome);
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    None
}

async fn deliveries_run_once(runner: JobRunner) {
    let scope = Scope::new("consumer");
    let runs = Arc::new(AtomicUsize::new(0));
    let work = |runs: Arc<AtomicUsize>| {
        move |_| async move {
            let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            Ok::<_, std::io::Error>(Bytes::from(format!("run {n}")))
        }
    };
    // All fifty deliveries released at once, to race for the key.
    let start = Arc::new(tokio::sync::Barrier::new(50));
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let (runner, scope, runs) = (runner.clone(), scope.clone(), runs.clone());
            let start = start.clone();
            tokio::spawn(async move {
                start.wait().await;
                runner
                    .run(&scope, "msg-1", b"payload", work(runs))
                    .await
                    .unwrap()
            })
        })
        .collect();
    let mut ran = 0;
    for t in tasks {
        match t.await.unwrap() {
            JobOutcome::Ran(r) => {
                ran += 1;
                assert_eq!(r, "run 1");
            }
            JobOutcome::AlreadyDone(r) => assert_eq!(r, "run 1"),
            JobOutcome::Running { .. } => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(ran, 1);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // A redelivery later gets the stored result.
    let again = runner
        .run(&scope, "msg-1", b"payload", work(runs.clone()))
        .await
        .unwrap();
    assert_eq!(again, JobOutcome::AlreadyDone(Bytes::from("run 1")));
    // The same id with another payload is a producer bug.
    let other = runner
        .run(&scope, "msg-1", b"other", work(runs.clone()))
        .await;
    assert!(matches!(other, Err(JobError::Mismatch)));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

async fn failures_release_the_key(runner: JobRunner) {
    let scope = Scope::new("consumer");
    let failed = runner
        .run(&scope, "msg-2", b"p", |_| async {
            Err::<Bytes, _>("downstream refused")
        })
        .await;
    assert!(matches!(
        failed,
        Err(JobError::Failed("downstream refused"))
    ));
    let panicked = runner
        .run(&scope, "msg-2", b"p", |_| async {
            if true {
                panic!("the job panicked on purpose");
            }
            Ok::<_, std::io::Error>(Bytes::new())
        })
        .await;
    assert!(matches!(panicked, Err(JobError::Panicked)));
    // The function itself panics, before its work's future exists.
    let panicked = runner
        .run(
            &scope,
            "msg-2",
            b"p",
            |_| -> std::future::Ready<Result<Bytes, std::io::Error>> {
                panic!("the job's function panicked on purpose")
            },
        )
        .await;
    assert!(matches!(panicked, Err(JobError::Panicked)));
    let ran = runner
        .run(&scope, "msg-2", b"p", |ctx| async move {
            Ok::<_, std::io::Error>(Bytes::from(ctx.key.derive("downstream")))
        })
        .await
        .unwrap();
    assert!(matches!(ran, JobOutcome::Ran(ref k) if k.len() == 64));
}

/// A store that panics while it stores a result fails the run as `Panicked`, and the key
/// is released, as the run's error says (and as the layer does): a redelivery runs.
#[tokio::test]
async fn a_store_that_panics_on_completion_releases_the_key() {
    let memory = Arc::new(MemoryStore::new());
    let store = AlteredCompletions::around(memory.clone(), Completion::CompletionsPanic);
    let runner = JobRunner::new(store);
    let scope = Scope::new("consumer");
    let ran = runner
        .run(&scope, "msg", b"p", |_| async {
            Ok::<_, std::io::Error>(Bytes::from_static(b"done"))
        })
        .await;
    assert!(matches!(ran, Err(JobError::Panicked)), "{ran:?}");
    assert!(memory.is_empty(), "the key was left claimed");
    assert_eq!(runner.shutdown_handle().in_flight(), 0);
}

/// The same when the caller has dropped the run before the store panics: the key is
/// released all the same, and a drain waits for it.
#[tokio::test]
async fn a_store_that_panics_on_completion_of_a_dropped_run_releases_the_key() {
    let memory = Arc::new(MemoryStore::new());
    let store = AlteredCompletions::around(memory.clone(), Completion::CompletionsPanic);
    let runner = JobRunner::new(store);
    let scope = Scope::new("consumer");
    let (started, gate) = (
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(tokio::sync::Notify::new()),
    );
    let work = {
        let (started, gate) = (started.clone(), gate.clone());
        move |_| async move {
            started.notify_one();
            gate.notified().await;
            Ok::<_, std::io::Error>(Bytes::from_static(b"done"))
        }
    };
    tokio::select! {
        ended = runner.run(&scope, "msg", b"p", work) => panic!("the run ended: {ended:?}"),
        () = started.notified() => {}
    }
    // The run is dropped; its work goes on, ends, and its result meets the panic.
    gate.notify_one();
    runner.shutdown_handle().drain().await;
    assert!(memory.is_empty(), "the key was left claimed");
}

/// A store that panics while it renews the lease of a running work stops that work (as
/// the layer drops its handler) and releases the key once the work has ended, never
/// while it still runs: a redelivery cannot run beside it.
#[tokio::test]
async fn a_store_that_panics_on_renewal_stops_the_work_before_it_releases_the_key() {
    /// Counts the work's end, however it ends.
    struct Ended(Arc<AtomicUsize>);
    impl Drop for Ended {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let memory = Arc::new(MemoryStore::new());
    let store = AlteredCompletions::around(memory.clone(), Completion::RenewalsPanic);
    // Renewed every 100 ms: the first renewal panics while the work waits.
    let runner = JobRunner::new(store).lease_duration(Duration::from_millis(300));
    let scope = Scope::new("consumer");
    let ended = Arc::new(AtomicUsize::new(0));
    let work = {
        let ended = ended.clone();
        move |_| async move {
            let _ended = Ended(ended);
            std::future::pending::<()>().await;
            Ok::<_, std::io::Error>(Bytes::new())
        }
    };
    let ran = runner.run(&scope, "msg", b"p", work).await;
    assert!(matches!(ran, Err(JobError::Panicked)), "{ran:?}");
    assert_eq!(ended.load(Ordering::SeqCst), 1, "the work still runs");
    assert!(memory.is_empty(), "the key was left claimed");
    assert_eq!(runner.shutdown_handle().in_flight(), 0);
}

/// A caller that gives up on a run once its work has started (its own timeout, a
/// `select!`) leaves nothing claimed: the work finishes, its result is stored, and a
/// redelivery gets it, rather than finding the key running until its lease lapses.
async fn a_run_dropped_by_its_caller_still_stores_its_result(runner: JobRunner) {
    let scope = Scope::new("consumer");
    let runs = Arc::new(AtomicUsize::new(0));
    let gate = Arc::new(tokio::sync::Notify::new());
    let work = {
        let (runs, gate) = (runs.clone(), gate.clone());
        move |_| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            gate.notified().await;
            Ok::<_, std::io::Error>(Bytes::from("done"))
        }
    };
    tokio::select! {
        _ = runner.run(&scope, "msg-3", b"p", work) => panic!("the work finished before its gate opened"),
        () = common::eventually(|| runs.load(Ordering::SeqCst) == 1) => {}
    }
    // The run is dropped; its work goes on and finishes.
    gate.notify_one();
    let redelivered = redeliver_past_running(&runner, &scope, "msg-3", b"p", || {
        |_| async { Ok::<_, std::io::Error>(Bytes::from("a second run")) }
    })
    .await;
    assert_eq!(
        redelivered,
        Some(JobOutcome::AlreadyDone(Bytes::from("done"))),
        "the redeliveries found the key running, or ran the work again"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A store that fails a run's first completions (a connection reset, a failover) still
/// gets its result: the runner renews the lease and tries again, so a redelivery finds
/// the result, never a lapsed key to run again.
async fn a_result_whose_first_completions_fail_is_still_stored(store: Arc<dyn Store>) {
    let store = AlteredCompletions::around(store, Completion::FailingFirst(2));
    let runner = JobRunner::new(store).lease_duration(Duration::from_secs(1));
    let scope = Scope::new("consumer");
    let runs = Arc::new(AtomicUsize::new(0));
    let work = |runs: Arc<AtomicUsize>| {
        move |_| async move {
            let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
            Ok::<_, std::io::Error>(Bytes::from(format!("run {n}")))
        }
    };
    let first = runner
        .run(&scope, "msg-4", b"p", work(runs.clone()))
        .await
        .unwrap();
    assert_eq!(first, JobOutcome::Ran(Bytes::from("run 1")));
    // Redeliveries, for five leases: running while the result is on its way, then done.
    let mut seen = Vec::new();
    for _ in 0..100 {
        let outcome = runner
            .run(&scope, "msg-4", b"p", work(runs.clone()))
            .await
            .unwrap();
        seen.push(outcome);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let ran = seen
        .iter()
        .filter(|o| matches!(o, JobOutcome::Ran(_)))
        .count();
    assert_eq!(ran, 0, "redeliveries ran the work again");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(
        seen.last(),
        Some(&JobOutcome::AlreadyDone(Bytes::from("run 1")))
    );
}

#[tokio::test]
async fn memory_a_result_whose_first_completions_fail_is_still_stored() {
    a_result_whose_first_completions_fail_is_still_stored(Arc::new(MemoryStore::new())).await;
}

#[tokio::test]
async fn postgres_a_result_whose_first_completions_fail_is_still_stored() {
    let schema = TestSchema::new();
    a_result_whose_first_completions_fail_is_still_stored(Arc::new(schema.store().await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_deliveries_run_once() {
    deliveries_run_once(JobRunner::new(MemoryStore::new())).await;
}

#[tokio::test]
async fn memory_failures_release_the_key() {
    failures_release_the_key(JobRunner::new(MemoryStore::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_deliveries_run_once() {
    let schema = TestSchema::new();
    deliveries_run_once(JobRunner::new(schema.store().await)).await;
}

#[tokio::test]
async fn postgres_failures_release_the_key() {
    let schema = TestSchema::new();
    failures_release_the_key(JobRunner::new(schema.store().await)).await;
}

#[tokio::test]
async fn memory_a_run_dropped_by_its_caller_still_stores_its_result() {
    a_run_dropped_by_its_caller_still_stores_its_result(JobRunner::new(MemoryStore::new())).await;
}

#[tokio::test]
async fn postgres_a_run_dropped_by_its_caller_still_stores_its_result() {
    let schema = TestSchema::new();
    a_run_dropped_by_its_caller_still_stores_its_result(JobRunner::new(schema.store().await)).await;
}

/// "Forever" is a setting some consumers reach for: the longest leases, TTLs and
/// timeouts are taken as the longest the store can hold, not as an error on every run.
async fn the_longest_settings_still_run(runner: JobRunner) {
    let max = std::time::Duration::MAX;
    let runner = runner.lease_duration(max).ttl(max).store_timeout(max);
    let scope = Scope::new("consumer");
    for expected in [
        JobOutcome::Ran(Bytes::from("once")),
        JobOutcome::AlreadyDone(Bytes::from("once")),
    ] {
        let outcome = runner
            .run(&scope, "msg-4", b"p", |_| async {
                Ok::<_, std::io::Error>(Bytes::from("once"))
            })
            .await
            .unwrap();
        assert_eq!(outcome, expected);
    }
}

#[tokio::test]
async fn memory_the_longest_settings_still_run() {
    the_longest_settings_still_run(JobRunner::new(MemoryStore::new())).await;
}

#[tokio::test]
async fn postgres_the_longest_settings_still_run() {
    let schema = TestSchema::new();
    the_longest_settings_still_run(JobRunner::new(schema.store().await)).await;
}

#[tokio::test]
async fn transactional_the_longest_settings_still_run() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    let runner = JobRunner::transactional(store.clone()).lock_timeout(std::time::Duration::MAX);
    the_longest_settings_still_run(runner).await;
    common::idle(&store).await;
}

#[tokio::test]
async fn transactional_failures_release_the_key() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    failures_release_the_key(JobRunner::transactional(store.clone())).await;
    common::idle(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transactional_deliveries_run_once() {
    let schema = TestSchema::new();
    deliveries_run_once(JobRunner::transactional(schema.store().await)).await;
}

/// A transactional runner in `schema`, and a `balances` table there for its work.
async fn with_balances(schema: &TestSchema) -> (JobRunner, String) {
    let store = schema.store().await;
    let table = format!("\"{}\".balances", schema.name);
    store
        .pool()
        .get()
        .await
        .expect("a connection")
        .batch_execute(&format!("CREATE TABLE {table} (account text, delta int)"))
        .await
        .expect("the balances table");
    (JobRunner::transactional(store), table)
}

#[tokio::test]
async fn transactional_work_commits_its_writes_with_the_result_or_not_at_all() {
    let schema = TestSchema::new();
    let (runner, table) = with_balances(&schema).await;
    let scope = Scope::new("consumer");
    let credit = |fail: bool| {
        let table = table.clone();
        move |ctx: tower_idempotency::job::JobContext| async move {
            let tx = ctx.transaction.expect("transactional mode");
            let client = tx.client().await.map_err(|e| e.to_string())?;
            client
                .execute(&format!("INSERT INTO {table} VALUES ('acct-1', 100)"), &[])
                .await
                .map_err(|e| e.to_string())?;
            if fail {
                return Err("the ledger refused".to_owned());
            }
            Ok(Bytes::from_static(b"credited"))
        }
    };
    let count_sql = format!("SELECT count(*) FROM {table}");
    let failed = runner.run(&scope, "msg-3", b"+100", credit(true)).await;
    assert!(matches!(failed, Err(JobError::Failed(_))));
    assert_eq!(
        schema.query(&count_sql).await[0].get::<_, i64>(0),
        0,
        "a failed job's writes roll back"
    );
    let ran = runner
        .run(&scope, "msg-3", b"+100", credit(false))
        .await
        .unwrap();
    assert_eq!(ran, JobOutcome::Ran(Bytes::from_static(b"credited")));
    let again = runner
        .run(&scope, "msg-3", b"+100", credit(false))
        .await
        .unwrap();
    assert_eq!(
        again,
        JobOutcome::AlreadyDone(Bytes::from_static(b"credited"))
    );
    assert_eq!(
        schema.query(&count_sql).await[0].get::<_, i64>(0),
        1,
        "credited once"
    );
}

/// A run whose lease could not be renewed (the store out of reach) and was taken over
/// by a redelivery meanwhile says so when its work ends: the work may have run twice,
/// and the key holds the other run's result.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_run_whose_lease_was_taken_over_says_so() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let failing = AlteredCompletions::around(store.clone(), Completion::RenewalsFail);
    let lease = std::time::Duration::from_millis(100);
    let first_runner = JobRunner::new(failing).lease_duration(lease);
    let second_runner = JobRunner::new(store).lease_duration(lease);
    let scope = Scope::new("consumer");
    let gate = Arc::new(tokio::sync::Notify::new());
    let started = Arc::new(AtomicUsize::new(0));
    let first = tokio::spawn({
        let (scope, gate, started) = (scope.clone(), gate.clone(), started.clone());
        async move {
            first_runner
                .run(&scope, "msg-10", b"p", |_| async move {
                    started.fetch_add(1, Ordering::SeqCst);
                    gate.notified().await;
                    Ok::<_, String>(Bytes::from("first"))
                })
                .await
        }
    });
    common::eventually(|| started.load(Ordering::SeqCst) == 1).await;
    // Redelivered once the first run's lease has lapsed, unrenewed.
    let second = redeliver_past_running(&second_runner, &scope, "msg-10", b"p", || {
        |_| async { Ok::<_, String>(Bytes::from("second")) }
    })
    .await;
    assert_eq!(second, Some(JobOutcome::Ran(Bytes::from("second"))));
    gate.notify_one();
    let first = first.await.unwrap();
    assert!(
        matches!(&first, Err(JobError::TakenOver(r)) if r == "first"),
        "{first:?}"
    );
    let again = second_runner
        .run(&scope, "msg-10", b"p", |_| async {
            Ok::<_, String>(Bytes::from("third"))
        })
        .await
        .unwrap();
    assert_eq!(again, JobOutcome::AlreadyDone(Bytes::from("second")));
}

/// A transactional run dropped by its caller rolls its work back when the work ends,
/// writes included, and a redelivery runs it anew.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transactional_a_run_dropped_by_its_caller_rolls_back_and_runs_again() {
    let schema = TestSchema::new();
    let (runner, table) = with_balances(&schema).await;
    let scope = Scope::new("consumer");
    let runs = Arc::new(AtomicUsize::new(0));
    let gate = Arc::new(tokio::sync::Notify::new());
    let credit = |delta: i32, gate: Option<Arc<tokio::sync::Notify>>| {
        let (table, runs) = (table.clone(), runs.clone());
        move |ctx: tower_idempotency::job::JobContext| async move {
            let tx = ctx.transaction.expect("transactional mode");
            let client = tx.client().await.map_err(|e| e.to_string())?;
            client
                .execute(
                    &format!("INSERT INTO {table} VALUES ('acct-1', {delta})"),
                    &[],
                )
                .await
                .map_err(|e| e.to_string())?;
            drop(client);
            runs.fetch_add(1, Ordering::SeqCst);
            if let Some(gate) = gate {
                gate.notified().await;
            }
            Ok::<_, String>(Bytes::from(format!("credited {delta}")))
        }
    };
    tokio::select! {
        _ = runner.run(&scope, "msg-7", b"+1", credit(1, Some(gate.clone()))) => {
            panic!("the work finished before its gate opened")
        }
        () = common::eventually(|| runs.load(Ordering::SeqCst) == 1) => {}
    }
    // The run is dropped; its work ends, and its transaction rolls back.
    gate.notify_one();
    let redelivered =
        redeliver_past_running(&runner, &scope, "msg-7", b"+1", || credit(2, None)).await;
    assert_eq!(
        redelivered,
        Some(JobOutcome::Ran(Bytes::from("credited 2")))
    );
    let rows = format!("SELECT string_agg(delta::text, ',') FROM {table}");
    assert_eq!(
        schema.query(&rows).await[0]
            .get::<_, Option<String>>(0)
            .as_deref(),
        Some("2"),
        "only the redelivery's write"
    );
}

/// A transactional run dropped by its caller, whose work left a copy of its
/// transaction handle in a task that lives on: the transaction still rolls back when the
/// work ends, and a redelivery runs, instead of finding the key held for as long as the
/// copy lives.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transactional_a_dropped_run_whose_work_kept_its_handle_still_rolls_back() {
    a_dropped_run_whose_work_kept_its_handle(false).await;
}

/// The same, with a work that panics once its run was dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transactional_a_dropped_run_whose_work_kept_its_handle_and_panicked_rolls_back() {
    a_dropped_run_whose_work_kept_its_handle(true).await;
}

async fn a_dropped_run_whose_work_kept_its_handle(panics: bool) {
    let schema = TestSchema::new();
    let runner = JobRunner::transactional(schema.store().await)
        .lock_timeout(std::time::Duration::from_millis(200));
    let scope = Scope::new("consumer");
    let started = Arc::new(AtomicUsize::new(0));
    let gate = Arc::new(tokio::sync::Notify::new());
    let work = {
        let (started, gate) = (started.clone(), gate.clone());
        move |ctx: tower_idempotency::job::JobContext| async move {
            let kept = ctx.transaction.clone();
            tokio::spawn(async move {
                tokio::time::sleep(std::time::Duration::from_secs(3600)).await;
                drop(kept);
            });
            started.fetch_add(1, Ordering::SeqCst);
            gate.notified().await;
            if panics {
                panic!("the work panicked on purpose");
            }
            Ok::<_, String>(Bytes::from("first"))
        }
    };
    tokio::select! {
        _ = runner.run(&scope, "msg-8", b"p", work) => panic!("the work finished before its gate opened"),
        () = common::eventually(|| started.load(Ordering::SeqCst) == 1) => {}
    }
    gate.notify_one();
    let redelivered = redeliver_past_running(&runner, &scope, "msg-8", b"p", || {
        |_| async { Ok::<_, String>(Bytes::from("second")) }
    })
    .await;
    assert_eq!(redelivered, Some(JobOutcome::Ran(Bytes::from("second"))));
}

/// A work that fails while something it spawned still holds the transaction's client is
/// reported as failed, not as "not committed".
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transactional_a_failed_work_that_kept_its_client_is_reported_failed() {
    let schema = TestSchema::new();
    let runner = JobRunner::transactional(schema.store().await)
        .store_timeout(std::time::Duration::from_millis(300));
    let scope = Scope::new("consumer");
    let outcome = runner
        .run(&scope, "msg-9", b"p", |ctx| async move {
            let tx = ctx.transaction.expect("transactional mode");
            let client = tx.client().await.map_err(|e| e.to_string())?;
            tokio::spawn(async move {
                tokio::time::sleep(std::time::Duration::from_secs(2)).await;
                drop(client);
            });
            Err::<Bytes, _>("the ledger refused".to_owned())
        })
        .await;
    assert!(
        matches!(&outcome, Err(JobError::Failed(e)) if e == "the ledger refused"),
        "{outcome:?}"
    );
}

/// A work whose `COMMIT` lost its answer with its connection committed all the same: the
/// runner checks, and reports it ran, so the consumer acknowledges the message instead
/// of running it again under another key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_a_commit_whose_answer_was_lost_is_reported_as_ran() {
    let schema = TestSchema::new();
    let proxy = Arc::new(common::proxy::PgProxy::start().await);
    let store = schema.store_at(&proxy.url(), 2).await;
    let table = format!("\"{}\".balances", schema.name);
    schema
        .query(&format!("CREATE TABLE {table} (account text, delta int)"))
        .await;
    let runner = JobRunner::transactional(store);
    let scope = Scope::new("consumer");
    let runs = Arc::new(AtomicUsize::new(0));
    let credit = || {
        let (table, proxy, runs) = (table.clone(), proxy.clone(), runs.clone());
        move |ctx: tower_idempotency::job::JobContext| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            let tx = ctx.transaction.expect("transactional mode");
            let client = tx.client().await.map_err(|e| e.to_string())?;
            client
                .execute(&format!("INSERT INTO {table} VALUES ('acct-1', 100)"), &[])
                .await
                .map_err(|e| e.to_string())?;
            proxy.lose_next_commit_reply();
            Ok::<_, String>(Bytes::from_static(b"credited"))
        }
    };
    let ran = runner
        .run(&scope, "msg-4", b"+100", credit())
        .await
        .unwrap();
    assert_eq!(ran, JobOutcome::Ran(Bytes::from_static(b"credited")));
    let count_sql = format!("SELECT count(*) FROM {table}");
    assert_eq!(schema.query(&count_sql).await[0].get::<_, i64>(0), 1);
    let again = runner
        .run(&scope, "msg-4", b"+100", credit())
        .await
        .unwrap();
    assert_eq!(
        again,
        JobOutcome::AlreadyDone(Bytes::from_static(b"credited"))
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A work function that panics releases its key, even when the caller drops the run
/// (its own timeout, a `select!`) while the release is on its way.
async fn a_panicking_run_dropped_by_its_caller_still_releases(store: Arc<dyn Store>) {
    let (store, releases) = AlteredCompletions::counting_releases(
        store,
        Completion::SlowRelease(Duration::from_millis(500)),
    );
    let runner = JobRunner::new(store);
    let scope = Scope::new("consumer");
    let panicked = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = panicked.clone();
    let run = runner.run(
        &scope,
        "msg-5",
        b"p",
        move |_| -> std::future::Ready<Result<Bytes, String>> {
            flag.store(true, Ordering::SeqCst);
            panic!("the work function panicked on purpose")
        },
    );
    // Dropped once its work function has panicked: its release is then on its way.
    let dropped = tokio::select! {
        ended = run => Some(ended),
        () = common::eventually(|| panicked.load(Ordering::SeqCst)) => None,
    };
    assert!(
        dropped.is_none(),
        "the run ended before its caller dropped it"
    );
    // The release reaches the store although its run was dropped.
    common::eventually(|| releases.load(Ordering::SeqCst) == 1).await;
    // The default lease is 30 s: a key left claimed would answer Running here.
    let again = runner
        .run(&scope, "msg-5", b"p", |_| async {
            Ok::<_, String>(Bytes::from_static(b"ran"))
        })
        .await
        .unwrap();
    assert_eq!(again, JobOutcome::Ran(Bytes::from_static(b"ran")));
}

#[tokio::test]
async fn memory_a_panicking_run_dropped_by_its_caller_still_releases() {
    a_panicking_run_dropped_by_its_caller_still_releases(Arc::new(MemoryStore::new())).await;
}

#[tokio::test]
async fn postgres_a_panicking_run_dropped_by_its_caller_still_releases() {
    let schema = TestSchema::new();
    a_panicking_run_dropped_by_its_caller_still_releases(Arc::new(schema.store().await)).await;
}

/// A runner drained before its process exits waits for the results it is still storing
/// in the background, so none is lost to leave its key claimed until the lease lapses;
/// once closed, it starts nothing.
async fn a_drain_waits_for_results_still_being_stored(inner: Arc<dyn Store>) {
    let store = AlteredCompletions::around(inner.clone(), Completion::FailingFirst(3));
    let runner = JobRunner::new(store).lease_duration(Duration::from_secs(5));
    let shutdown = runner.shutdown_handle();
    let scope = Scope::new("consumer");
    let done = |body: &'static str| {
        move |_| async move { Ok::<_, String>(Bytes::from_static(body.as_bytes())) }
    };
    let ran = runner
        .run(&scope, "msg-6", b"p", done("done"))
        .await
        .unwrap();
    assert_eq!(ran, JobOutcome::Ran(Bytes::from_static(b"done")));
    shutdown.drain().await;
    let refused = runner.run(&scope, "msg-7", b"p", done("late")).await;
    assert!(
        matches!(refused, Err(JobError::ShuttingDown)),
        "{refused:?}"
    );
    // Another process, after this one exited: the result is there.
    let next = JobRunner::new(inner);
    let again = next
        .run(&scope, "msg-6", b"p", done("again"))
        .await
        .unwrap();
    assert_eq!(again, JobOutcome::AlreadyDone(Bytes::from_static(b"done")));
    let unclaimed = next.run(&scope, "msg-7", b"p", done("now")).await.unwrap();
    assert_eq!(unclaimed, JobOutcome::Ran(Bytes::from_static(b"now")));
}

#[tokio::test]
async fn memory_a_drain_waits_for_results_still_being_stored() {
    a_drain_waits_for_results_still_being_stored(Arc::new(MemoryStore::new())).await;
}

#[tokio::test]
async fn postgres_a_drain_waits_for_results_still_being_stored() {
    let schema = TestSchema::new();
    a_drain_waits_for_results_still_being_stored(Arc::new(schema.store().await)).await;
}

/// A claim given up on at the store timeout may still land; it is then released. A
/// drain waits for that release, so that a consumer that exits at once does not leave
/// the key claimed for a lease.
#[tokio::test]
async fn a_drain_waits_for_a_late_claim_to_be_released() {
    let (store, releases) = AlteredCompletions::counting_releases(
        Arc::new(MemoryStore::new()),
        Completion::SlowClaim(Duration::from_millis(300)),
    );
    let runner = JobRunner::new(store).store_timeout(Duration::from_millis(50));
    let scope = Scope::new("consumer");
    let given_up = runner
        .run(&scope, "msg-8", b"p", |_| async {
            Ok::<_, String>(Bytes::from_static(b"never"))
        })
        .await;
    assert!(matches!(given_up, Err(JobError::Store(_))), "{given_up:?}");
    runner.shutdown_handle().drain().await;
    assert_eq!(releases.load(Ordering::SeqCst), 1);
}

/// A transactional run that waited on another worker's row and gets it after `close()`
/// claims nothing and runs nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transactional_a_run_that_gets_the_row_after_close_runs_nothing() {
    let schema = TestSchema::new();
    let runner = JobRunner::transactional(schema.store().await);
    let scope = Scope::new("consumer");
    let (started, first_started) = tokio::sync::oneshot::channel();
    let (finish, may_finish) = tokio::sync::oneshot::channel::<()>();
    let first = tokio::spawn({
        let (runner, scope) = (runner.clone(), scope.clone());
        async move {
            runner
                .run(&scope, "msg-9", b"p", move |_| async move {
                    let _ = started.send(());
                    let _ = may_finish.await;
                    Err::<Bytes, _>("the first worker failed".to_owned())
                })
                .await
        }
    });
    first_started.await.unwrap();
    let ran_second = Arc::new(AtomicUsize::new(0));
    let second = tokio::spawn({
        let (runner, scope, ran) = (runner.clone(), scope.clone(), ran_second.clone());
        async move {
            runner
                .run(&scope, "msg-9", b"p", move |_| async move {
                    ran.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, String>(Bytes::from_static(b"second"))
                })
                .await
        }
    });
    // The close comes once the second run waits on the first one's row.
    schema.wait_for_lock_waiters(1).await;
    runner.shutdown_handle().close();
    finish.send(()).unwrap();
    assert!(matches!(first.await.unwrap(), Err(JobError::Failed(_))));
    let second = second.await.unwrap();
    assert!(matches!(second, Err(JobError::ShuttingDown)), "{second:?}");
    assert_eq!(ran_second.load(Ordering::SeqCst), 0);
}

/// A transactional work whose spawned task keeps its client for good: the runner gives
/// up on it after `store_timeout` and ends its transaction on the server, so nothing
/// of it commits and a redelivery runs at once, rather than meeting `Running` for as
/// long as the task lives.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transactional_a_client_kept_for_good_by_the_work_does_not_hold_the_key() {
    let schema = TestSchema::new();
    let (runner, table) = with_balances(&schema).await;
    let runner = runner
        .store_timeout(Duration::from_millis(500))
        .lock_timeout(Duration::from_secs(5));
    let scope = Scope::new("consumer");
    let first = runner
        .run(&scope, "msg-10", b"+100", {
            let table = table.clone();
            move |ctx| async move {
                let tx = ctx.transaction.expect("transactional mode");
                let (written, wrote) = tokio::sync::oneshot::channel();
                tokio::spawn(async move {
                    let client = tx.client().await.expect("transaction");
                    let insert = format!("INSERT INTO {table} VALUES ('kept', 100)");
                    client.execute(&insert, &[]).await.unwrap();
                    let _ = written.send(());
                    std::future::pending::<()>().await;
                    drop(client);
                });
                wrote.await.unwrap();
                Ok::<_, String>(Bytes::from_static(b"first"))
            }
        })
        .await;
    assert!(matches!(first, Err(JobError::NotCommitted)), "{first:?}");
    let second = runner
        .run(&scope, "msg-10", b"+100", {
            let table = table.clone();
            move |ctx| async move {
                let tx = ctx.transaction.expect("transactional mode");
                let client = tx.client().await.map_err(|e| e.to_string())?;
                let insert = format!("INSERT INTO {table} VALUES ('second', 100)");
                client
                    .execute(&insert, &[])
                    .await
                    .map_err(|e| e.to_string())?;
                Ok::<_, String>(Bytes::from_static(b"second"))
            }
        })
        .await;
    assert_eq!(
        second.unwrap(),
        JobOutcome::Ran(Bytes::from_static(b"second"))
    );
    let accounts = format!("SELECT string_agg(account, ',') FROM {table}");
    let kept: String = schema.query(&accounts).await[0].get(0);
    assert_eq!(kept, "second", "the kept work's write never commits");
}
/// A transactional work whose spawned task commits the runner's transaction and then
/// keeps its client for good: when the runner gives up on it, the transaction had
/// ended with the claim committed. The run says so, and the key is completed with that
/// outcome, so a redelivery neither meets `Running` until the lease lapses nor runs
/// the work again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transactional_a_client_kept_after_the_work_s_commit_is_not_run_again() {
    let schema = TestSchema::new();
    let (runner, table) = with_balances(&schema).await;
    let runner = runner
        .store_timeout(Duration::from_millis(500))
        .lock_timeout(Duration::from_secs(5));
    let scope = Scope::new("consumer");
    let runs = Arc::new(AtomicUsize::new(0));
    let credit = || {
        let (table, runs) = (table.clone(), runs.clone());
        move |ctx: tower_idempotency::job::JobContext| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            let tx = ctx.transaction.expect("transactional mode");
            let (written, wrote) = tokio::sync::oneshot::channel();
            tokio::spawn(async move {
                let client = tx.client().await.expect("transaction");
                let insert = format!("INSERT INTO {table} VALUES ('kept', 100)");
                client.execute(&insert, &[]).await.unwrap();
                client.batch_execute("COMMIT").await.unwrap();
                let _ = written.send(());
                std::future::pending::<()>().await;
                drop(client);
            });
            wrote.await.unwrap();
            Ok::<_, String>(Bytes::from_static(b"credited"))
        }
    };
    let first = runner.run(&scope, "msg-13", b"+100", credit()).await;
    assert!(
        matches!(first, Err(JobError::TransactionEnded)),
        "{first:?}"
    );
    let again = runner.run(&scope, "msg-13", b"+100", credit()).await;
    assert!(
        matches!(again, Err(JobError::TransactionEnded)),
        "{again:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let count_sql = format!("SELECT count(*) FROM {table}");
    assert_eq!(schema.query(&count_sql).await[0].get::<_, i64>(0), 1);
}

/// A transactional work that commits the runner's transaction and runs on for several
/// leases: its claim, committed `running`, is kept from lapsing until the runner
/// finishes the key, so redeliveries meanwhile get `Running`, never a second run.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transactional_a_work_that_commits_and_runs_on_past_its_lease_is_not_taken_over() {
    let schema = TestSchema::new();
    let (runner, table) = with_balances(&schema).await;
    let lease = Duration::from_millis(1500);
    let runner = runner.lease_duration(lease);
    let scope = Scope::new("consumer");
    let runs = Arc::new(AtomicUsize::new(0));
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let (committed, has_committed) = tokio::sync::oneshot::channel();
    let first = tokio::spawn({
        let (runner, scope, table, runs, gate) = (
            runner.clone(),
            scope.clone(),
            table.clone(),
            runs.clone(),
            gate.clone(),
        );
        async move {
            let work = move |ctx: tower_idempotency::job::JobContext| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let tx = ctx.transaction.expect("transactional mode");
                let client = tx.client().await.map_err(|e| e.to_string())?;
                let insert = format!("INSERT INTO {table} VALUES ('acct-1', 100)");
                client
                    .execute(&insert, &[])
                    .await
                    .map_err(|e| e.to_string())?;
                client
                    .batch_execute("COMMIT")
                    .await
                    .map_err(|e| e.to_string())?;
                let _ = committed.send(());
                gate.acquire().await.expect("the gate").forget();
                Ok::<_, String>(Bytes::from_static(b"credited"))
            };
            runner.run(&scope, "msg-14", b"+100", work).await
        }
    });
    has_committed.await.unwrap();
    let again = || {
        let runs = runs.clone();
        move |_: tower_idempotency::job::JobContext| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, String>(Bytes::from_static(b"again"))
        }
    };
    let until = tokio::time::Instant::now() + 3 * lease;
    while tokio::time::Instant::now() < until {
        let redelivered = runner.run(&scope, "msg-14", b"+100", again()).await;
        assert!(
            matches!(redelivered, Ok(JobOutcome::Running { .. })),
            "{redelivered:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    gate.add_permits(1);
    let first = first.await.unwrap();
    assert!(
        matches!(first, Err(JobError::TransactionEnded)),
        "{first:?}"
    );
    let after = runner.run(&scope, "msg-14", b"+100", again()).await;
    assert!(
        matches!(after, Err(JobError::TransactionEnded)),
        "{after:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A transactional work that commits the runner's transaction, begins another, and has
/// a statement fail in it (two helpers written for a plain connection): the aborted
/// transaction is the work's own, not the runner's, whose claim the work's `COMMIT`
/// committed. The run says the transaction ended, and a redelivery does not run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transactional_a_work_that_commits_begins_and_fails_a_statement_is_not_run_again() {
    let schema = TestSchema::new();
    let (runner, table) = with_balances(&schema).await;
    let scope = Scope::new("consumer");
    let runs = Arc::new(AtomicUsize::new(0));
    let credit = || {
        let (table, runs) = (table.clone(), runs.clone());
        move |ctx: tower_idempotency::job::JobContext| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            let tx = ctx.transaction.expect("transactional mode");
            let client = tx.client().await.map_err(|e| e.to_string())?;
            let insert = format!("INSERT INTO {table} VALUES ('acct-1', 100)");
            client
                .execute(&insert, &[])
                .await
                .map_err(|e| e.to_string())?;
            client
                .batch_execute("COMMIT; BEGIN")
                .await
                .map_err(|e| e.to_string())?;
            // A failure the work shrugs off (an audit row it tolerates losing, say).
            let failed = client.batch_execute("SELECT 1 / 0").await;
            assert!(failed.is_err());
            Ok::<_, String>(Bytes::from_static(b"credited"))
        }
    };
    let first = runner.run(&scope, "msg-12", b"+100", credit()).await;
    assert!(
        matches!(first, Err(JobError::TransactionEnded)),
        "{first:?}"
    );
    let again = runner.run(&scope, "msg-12", b"+100", credit()).await;
    assert!(
        matches!(again, Err(JobError::TransactionEnded)),
        "{again:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let count_sql = format!("SELECT count(*) FROM {table}");
    assert_eq!(schema.query(&count_sql).await[0].get::<_, i64>(0), 1);
}

/// A transactional work that commits the runner's transaction itself (a helper written
/// for a plain connection): the run says so, and the key is completed with that
/// outcome, so a redelivery does not run the work again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transactional_a_work_that_commits_its_transaction_itself_is_not_run_again() {
    let schema = TestSchema::new();
    let (runner, table) = with_balances(&schema).await;
    let scope = Scope::new("consumer");
    let runs = Arc::new(AtomicUsize::new(0));
    let credit = || {
        let (table, runs) = (table.clone(), runs.clone());
        move |ctx: tower_idempotency::job::JobContext| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            let tx = ctx.transaction.expect("transactional mode");
            let client = tx.client().await.map_err(|e| e.to_string())?;
            let insert = format!("INSERT INTO {table} VALUES ('acct-1', 100)");
            client
                .execute(&insert, &[])
                .await
                .map_err(|e| e.to_string())?;
            client
                .batch_execute("COMMIT")
                .await
                .map_err(|e| e.to_string())?;
            Ok::<_, String>(Bytes::from_static(b"credited"))
        }
    };
    let first = runner.run(&scope, "msg-11", b"+100", credit()).await;
    assert!(
        matches!(first, Err(JobError::TransactionEnded)),
        "{first:?}"
    );
    let again = runner.run(&scope, "msg-11", b"+100", credit()).await;
    assert!(
        matches!(again, Err(JobError::TransactionEnded)),
        "{again:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let count_sql = format!("SELECT count(*) FROM {table}");
    assert_eq!(schema.query(&count_sql).await[0].get::<_, i64>(0), 1);
}
