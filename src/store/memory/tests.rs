//! The memory store's own tests: its bound, its bytes, its sweeps.

use super::{
    records::{RECORD_BYTES, SCOPE_BYTES},
    *,
};
use crate::store::StoreErrorKind;

fn request<'a>(scope: &'a Scope, key: &'a str, lease: Duration, ttl: Duration) -> ClaimRequest<'a> {
    ClaimRequest {
        scope,
        key,
        fingerprint: Fingerprint::new([0; 32]),
        lease,
        ttl,
    }
}

fn acquire(store: &MemoryStore, req: &ClaimRequest<'_>) -> Lease {
    match store.claim_now(req) {
        Ok(Claim::Acquired(lease)) => lease,
        _ => panic!("not acquired"),
    }
}

/// Counts the times it is woken.
#[derive(Default)]
struct Woken(std::sync::atomic::AtomicUsize);

impl std::task::Wake for Woken {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

fn created(body: &str) -> StoredResponse {
    let mut headers = http::HeaderMap::new();
    headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    StoredResponse {
        status: http::StatusCode::CREATED,
        headers,
        body: bytes::Bytes::from(body.to_owned()),
    }
}

fn holds(store: &MemoryStore, scope: &Scope, key: &str) -> bool {
    store
        .lock()
        .records
        .contains_key(&(scope.clone(), Arc::from(key)))
}

fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
}

#[test]
fn at_its_bound_the_store_evicts_the_completed_records_soonest_to_expire() {
    let rt = current_thread();
    let store = MemoryStore::new().with_max_entries(4);
    let scope = Scope::anonymous();
    let (lease, hour) = (Duration::from_secs(60), Duration::from_secs(3600));
    // Completed in another order than they expire: k1 first, then k3, k2, k0.
    for (key, hours) in [("k0", 4), ("k1", 1), ("k2", 3), ("k3", 2)] {
        let held = acquire(&store, &request(&scope, key, lease, hour * hours));
        let stored = rt.block_on(store.complete(&held, &created(key), hour * hours));
        assert!(stored.unwrap().is_kept());
    }
    assert_eq!((store.len(), store.evicted()), (4, 0));
    let full_bytes = store.bytes();

    // Running claims of new keys push the completed records out, one each.
    let mut running = Vec::new();
    for (i, gone) in ["k1", "k3", "k2", "k0"].into_iter().enumerate() {
        running.push(acquire(
            &store,
            &request(&scope, &format!("r{i}"), lease, hour),
        ));
        assert!(!holds(&store, &scope, gone), "{gone} is still held");
        assert_eq!(store.len(), 4);
        assert_eq!(store.evicted(), i as u64 + 1);
        assert!(store.bytes() <= full_bytes);
    }

    // Only running claims are left: a new key is refused, and nothing is evicted.
    let refused = store.claim_now(&request(&scope, "r4", lease, hour));
    let error = refused.expect_err("a claim past the bound of running claims");
    assert_eq!(error.kind(), StoreErrorKind::Unavailable, "{error}");
    assert_eq!((store.len(), store.evicted()), (4, 4));
    for held in &running {
        assert!(
            rt.block_on(store.renew(held, lease)).unwrap().is_kept(),
            "a claim was lost"
        );
    }
    // Keys the store holds still answer as they did.
    assert!(matches!(
        store.claim_now(&request(&scope, "r0", lease, hour)),
        Ok(Claim::Running { .. })
    ));

    // An evicted key is a new key: claimed afresh, once there is room.
    assert!(rt.block_on(store.release(&running[0])).unwrap().is_kept());
    let again = acquire(&store, &request(&scope, "k1", lease, hour));
    assert_ne!(
        again.token,
        FencingToken::new(1),
        "a fresh claim's token is random"
    );
    assert_eq!(store.len(), 4);
}

#[test]
fn the_bytes_held_stay_within_the_bound_and_are_all_given_back() {
    let rt = current_thread();
    let body = "x".repeat(1000);
    let one = RECORD_BYTES + 2 + STORED_BYTES + 40 + body.len();
    let short = Duration::from_millis(300);
    let store = MemoryStore::new()
        .with_max_bytes(3 * one + one / 2)
        .remember_keys_for(short);
    let scope = Scope::anonymous();
    for i in 0..10 {
        let key = format!("k{i}");
        let held = acquire(&store, &request(&scope, &key, short, short));
        assert!(store.bytes() <= store.max_bytes());
        assert!(
            rt.block_on(store.complete(&held, &created(&body), short))
                .unwrap()
                .is_kept()
        );
        assert!(store.bytes() <= store.max_bytes(), "{i}: {store:?}");
    }
    assert_eq!(store.len(), 3, "{store:?}");
    assert_eq!(store.evicted(), 7);
    assert_eq!(store.bytes(), 3 * one + SCOPE_BYTES);
    // Their responses expired: what they held goes, and the keys are remembered.
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(rt.block_on(store.purge(100)).unwrap(), 3);
    assert_eq!(
        (store.len(), store.bytes()),
        (3, 3 * (RECORD_BYTES + 2) + SCOPE_BYTES)
    );
    // Forgotten in turn: nothing is left counted.
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(rt.block_on(store.purge(100)).unwrap(), 3);
    assert_eq!((store.len(), store.bytes()), (0, 0));
}

#[test]
fn a_completed_key_is_remembered_without_its_response_then_forgotten() {
    let rt = current_thread();
    let (ttl, window) = (Duration::from_millis(200), Duration::from_millis(600));
    let store = MemoryStore::new().remember_keys_for(window);
    let scope = Scope::anonymous();
    let req = request(&scope, "k", Duration::from_secs(60), ttl);
    let held = acquire(&store, &req);
    let kept = rt.block_on(store.complete(&held, &created(&"x".repeat(500)), ttl));
    assert!(kept.unwrap().is_kept());
    let full = store.bytes();
    std::thread::sleep(Duration::from_millis(300));
    // Before a sweep (a look-up sweeps nothing) and after it (a claim sweeps first)
    // alike: remembered, with its status; a claim is refused, never run again.
    let record = store.look_up_now(&scope, "k").unwrap().expect("a record");
    assert!(matches!(record.state, crate::store::KeyState::Remembered { status } if status == 201));
    assert!(!record.is_free());
    match store.claim_now(&req) {
        Ok(Claim::Remembered {
            status,
            completed_at,
            remembered_until,
            ..
        }) => {
            assert_eq!(status, http::StatusCode::CREATED);
            assert!(completed_at < remembered_until);
        }
        other => panic!("{other:?}"),
    }
    // Swept by the claim: its response's bytes are gone.
    assert!(store.bytes() < full - 500, "{store:?}");
    assert_eq!(store.len(), 1);
    assert!(matches!(
        store.claim_now(&req),
        Ok(Claim::Remembered { .. })
    ));
    // Past the window: forgotten, and a claim takes the key as new.
    std::thread::sleep(Duration::from_millis(600));
    acquire(&store, &req);
}

#[test]
fn at_its_bound_the_store_evicts_remembered_records_before_completed_ones() {
    let rt = current_thread();
    let store = MemoryStore::new().with_max_entries(3);
    let scope = Scope::anonymous();
    let (lease, short, long) = (
        Duration::from_secs(60),
        Duration::from_millis(100),
        Duration::from_secs(3600),
    );
    // "old" completes first and expires first; "kept" expires in an hour.
    for (key, ttl) in [("old", short), ("kept", long)] {
        let held = acquire(&store, &request(&scope, key, lease, ttl));
        assert!(
            rt.block_on(store.complete(&held, &created(key), ttl))
                .unwrap()
                .is_kept()
        );
    }
    std::thread::sleep(Duration::from_millis(150));
    assert_eq!(store.purge_expired(), 1);
    // Remembered for 7 days, "old" is forgotten before "kept", which expires far sooner.
    acquire(&store, &request(&scope, "new1", lease, long));
    acquire(&store, &request(&scope, "new2", lease, long));
    assert!(!holds(&store, &scope, "old"));
    assert!(holds(&store, &scope, "kept"));
    assert_eq!((store.evicted_remembered(), store.evicted()), (1, 0));
}

#[test]
fn a_response_is_stored_even_when_only_running_claims_are_left_to_evict() {
    let rt = current_thread();
    // Room for two running claims of one-letter keys, and no more.
    let store = MemoryStore::new().with_max_bytes(2 * (RECORD_BYTES + 1) + SCOPE_BYTES);
    let scope = Scope::anonymous();
    let long = Duration::from_secs(60);
    let a = acquire(&store, &request(&scope, "a", long, long));
    let b = acquire(&store, &request(&scope, "b", long, long));
    let refused = store.claim_now(&request(&scope, "c", long, long));
    assert_eq!(refused.unwrap_err().kind(), StoreErrorKind::Unavailable);
    // Over the bound once stored: the handler has run, and a retry must not run it
    // again.
    let big = "x".repeat(1000);
    assert!(
        rt.block_on(store.complete(&a, &created(&big), long))
            .unwrap()
            .is_kept()
    );
    assert!(store.bytes() > store.max_bytes());
    assert!(matches!(
        store.claim_now(&request(&scope, "a", long, long)),
        Ok(Claim::Completed { response, .. }) if response == created(&big)
    ));
    // A completion makes room by evicting others, never itself.
    assert!(
        rt.block_on(store.complete(&b, &created(&big), long))
            .unwrap()
            .is_kept()
    );
    assert!(holds(&store, &scope, "b"));
    assert!(!holds(&store, &scope, "a"));
    assert_eq!(store.evicted(), 1);
    // The next new key evicts it in turn.
    acquire(&store, &request(&scope, "c", long, long));
    assert!(!holds(&store, &scope, "b"));
    assert!(store.bytes() <= store.max_bytes());
}

#[test]
fn a_scope_s_name_is_held_once_for_all_of_its_records() {
    let store = MemoryStore::new();
    let long = Duration::from_secs(60);
    let name = "auth:".to_owned() + &"0123456789abcdef".repeat(4);
    for i in 0..100 {
        // A scope of its own per request, as the default scope function makes.
        let scope = Scope::new(name.clone());
        acquire(&store, &request(&scope, &format!("k{i:02}"), long, long));
    }
    assert_eq!(
        store.bytes(),
        100 * (RECORD_BYTES + 3) + SCOPE_BYTES + name.len()
    );
    let inner = store.lock();
    let mut scopes = inner.records.keys().map(|(scope, _)| scope);
    let first = scopes.next().unwrap();
    assert!(scopes.all(|scope| std::ptr::eq(scope.as_str(), first.as_str())));
}

#[test]
fn a_replay_is_the_stored_response_byte_for_byte() {
    let rt = current_thread();
    let store = MemoryStore::new();
    let scope = Scope::anonymous();
    let long = Duration::from_secs(60);
    let mut response = created("{\"id\":1}");
    response
        .headers
        .append("x-a", http::HeaderValue::from_static("1"));
    response
        .headers
        .append("x-a", http::HeaderValue::from_static("2"));
    let held = acquire(&store, &request(&scope, "k", long, long));
    assert!(
        rt.block_on(store.complete(&held, &response, long))
            .unwrap()
            .is_kept()
    );
    for _ in 0..2 {
        match store.claim_now(&request(&scope, "k", long, long)) {
            Ok(Claim::Completed {
                response: replay, ..
            }) => assert_eq!(replay, response),
            _ => panic!("not replayed"),
        }
    }
    let held = acquire(&store, &request(&scope, "empty", long, long));
    let empty = StoredResponse {
        status: http::StatusCode::NO_CONTENT,
        headers: http::HeaderMap::new(),
        body: bytes::Bytes::new(),
    };
    assert!(
        rt.block_on(store.complete(&held, &empty, long))
            .unwrap()
            .is_kept()
    );
    assert!(matches!(
        store.claim_now(&request(&scope, "empty", long, long)),
        Ok(Claim::Completed { response, .. }) if response == empty
    ));
}

#[test]
fn a_completion_wakes_the_requests_waiting_on_its_key_alone() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let store = MemoryStore::new();
    let scope = Scope::anonymous();
    let long = Duration::from_secs(60);
    let leases: Vec<_> = (0..100)
        .map(|i| acquire(&store, &request(&scope, &format!("k{i}"), long, long)))
        .collect();
    // A request waiting on each key, as `wait_for_running` does, first polled
    // while the key runs.
    let mut waits: Vec<_> = (0..100)
        .map(|i| {
            let mut wait = store.changed(&scope, &format!("k{i}"));
            let woken = Arc::new(Woken::default());
            let waker = std::task::Waker::from(woken.clone());
            let mut cx = std::task::Context::from_waker(&waker);
            assert!(wait.as_mut().poll(&mut cx).is_pending());
            (wait, woken, waker)
        })
        .collect();
    let response = StoredResponse {
        status: http::StatusCode::CREATED,
        headers: http::HeaderMap::new(),
        body: bytes::Bytes::new(),
    };
    assert!(
        rt.block_on(store.complete(&leases[7], &response, long))
            .unwrap()
            .is_kept()
    );
    let woken = |waits: &[(_, Arc<Woken>, _)]| -> Vec<usize> {
        waits
            .iter()
            .enumerate()
            .filter(|(_, (_, w, _))| w.0.load(std::sync::atomic::Ordering::SeqCst) > 0)
            .map(|(i, _)| i)
            .collect()
    };
    assert_eq!(woken(&waits), [7]);
    let (wait, _, waker) = &mut waits[7];
    let mut cx = std::task::Context::from_waker(waker);
    assert!(wait.as_mut().poll(&mut cx).is_ready());
    // A release wakes its key's waiters alone too.
    assert!(rt.block_on(store.release(&leases[3])).unwrap().is_kept());
    assert_eq!(woken(&waits), [3, 7]);
}

#[test]
fn each_claim_sweeps_a_few_expired_records_and_purges_take_the_rest() {
    let store = MemoryStore::new();
    let scope = Scope::anonymous();
    let short = Duration::from_millis(500);
    for i in 0..1000 {
        acquire(&store, &request(&scope, &format!("k{i}"), short, short));
    }
    assert_eq!(store.len(), 1000);
    std::thread::sleep(Duration::from_millis(600));
    // One claim: its own record in, at most SWEPT_PER_CLAIM expired ones out.
    acquire(
        &store,
        &request(
            &scope,
            "new",
            Duration::from_secs(60),
            Duration::from_secs(60),
        ),
    );
    assert_eq!(store.len(), 1000 + 1 - SWEPT_PER_CLAIM);
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    assert_eq!(rt.block_on(store.purge(100)).unwrap(), 100);
    assert_eq!(store.purge_expired(), 1000 - SWEPT_PER_CLAIM - 100);
    assert_eq!(store.len(), 1, "the live claim stays");
    // The swept records gave their bytes back: the live claim's are left.
    assert_eq!(store.bytes(), RECORD_BYTES + "new".len() + SCOPE_BYTES);
    // The purged records' entries went with them: the live claim's is left.
    let inner = store.lock();
    assert_eq!((inner.running.len(), inner.expiry.len()), (1, 0));
}

#[test]
fn released_and_completed_claims_leave_no_entry_behind() {
    let rt = current_thread();
    let store = MemoryStore::new();
    let scope = Scope::anonymous();
    let long = Duration::from_secs(3600);
    for i in 0..1000 {
        let held = acquire(&store, &request(&scope, &format!("k{i}"), long, long));
        if i % 2 == 0 {
            assert!(rt.block_on(store.release(&held)).unwrap().is_kept());
        } else {
            let stored = rt.block_on(store.complete(&held, &created("{}"), long));
            assert!(stored.unwrap().is_kept());
        }
    }
    // Gone at once, not when their leases would have lapsed: the released claims
    // with nothing behind, the completed ones with their entry of expiry alone.
    let inner = store.lock();
    assert_eq!(inner.records.len(), 500);
    assert_eq!((inner.running.len(), inner.expiry.len()), (0, 500));
}

#[test]
fn renewed_and_completed_records_are_not_swept_at_their_first_time() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let store = MemoryStore::new();
    let scope = Scope::anonymous();
    let short = Duration::from_millis(500);
    let renewed = acquire(&store, &request(&scope, "renewed", short, short));
    let completed = acquire(&store, &request(&scope, "completed", short, short));
    assert!(
        rt.block_on(store.renew(&renewed, Duration::from_secs(60)))
            .unwrap()
            .is_kept()
    );
    let response = StoredResponse {
        status: http::StatusCode::CREATED,
        headers: http::HeaderMap::new(),
        body: bytes::Bytes::new(),
    };
    assert!(
        rt.block_on(store.complete(&completed, &response, Duration::from_secs(60)))
            .unwrap()
            .is_kept()
    );
    std::thread::sleep(Duration::from_millis(600));
    // Their first TTL has passed: each claim sweeps, and leaves them.
    for i in 0..3 {
        acquire(&store, &request(&scope, &format!("k{i}"), short, short));
    }
    assert_eq!(rt.block_on(store.purge(100)).unwrap(), 0);
    assert!(matches!(
        store.claim_now(&request(&scope, "renewed", short, short)),
        Ok(Claim::Running { .. })
    ));
    assert!(matches!(
        store.claim_now(&request(&scope, "completed", short, short)),
        Ok(Claim::Completed { .. })
    ));
    // A released key claimed afresh is swept by its new claim's time, not the old.
    let rt_lease = acquire(&store, &request(&scope, "again", short, short));
    assert!(rt.block_on(store.release(&rt_lease)).unwrap().is_kept());
    let long = Duration::from_secs(60);
    acquire(&store, &request(&scope, "again", long, long));
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(
        rt.block_on(store.purge(100)).unwrap(),
        3,
        "the k0..k2 claims only"
    );
    assert!(matches!(
        store.claim_now(&request(&scope, "again", long, long)),
        Ok(Claim::Running { .. })
    ));
}
