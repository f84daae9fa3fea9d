//! The layer suite: every behaviour of the layer, instantiated once per store.
//!
//! `layer_suite!(make)` expands to the tests, where `make` is an async fn returning
//! `(Arc<dyn Store>, Guard)`: the store under test and whatever keeps it alive.

#[macro_export]
macro_rules! layer_suite {
    ($make:ident) => {
        mod suite {
            use std::{sync::Arc, time::Duration};

            use axum::body::Body;
            use tower_idempotency::{
                Fingerprint, IdempotencyLayer, Outcome, Scope, StoredResponse,
                store::{Claim, ClaimRequest, Store},
            };

            use $crate::common::completions::{AlteredCompletions, Completion};
            use $crate::common::{
                app, app_behind_auth, app_with_auth_inside, eventually, in_flight, post, post_as,
                post_with_headers, req, retry_until_created, route_behind_auth, send,
            };

            async fn layer() -> (IdempotencyLayer, Arc<dyn Store>, impl Sized) {
                let (store, guard) = super::$make().await;
                (IdempotencyLayer::new(store.clone()), store, guard)
            }

            #[tokio::test]
            async fn executes_then_replays_byte_for_byte() {
                let (layer, _store, _g) = layer().await;
                let (router, counter) = app(layer);
                let first = send(&router, post("k1", "{\"amount\":1}")).await;
                assert_eq!(first.status, 201);
                assert_eq!(first.outcome, Some(Outcome::Executed));
                assert_eq!(first.header("idempotent-replayed"), None);
                assert_eq!(first.header("set-cookie"), Some("session=1"));

                let second = send(&router, post("k1", "{\"amount\":1}")).await;
                assert_eq!(counter.runs(), 1);
                assert_eq!(second.outcome, Some(Outcome::Replayed));
                assert_eq!(second.status, first.status);
                assert_eq!(second.body, first.body);
                assert_eq!(second.header("idempotent-replayed"), Some("true"));
                let mut expected = first.headers.clone();
                expected.remove("set-cookie");
                let mut replayed = second.headers.clone();
                replayed.remove("idempotent-replayed");
                assert_eq!(replayed, expected);
                assert_eq!(replayed["x-run"], "1");
            }

            #[tokio::test]
            async fn quoted_and_bare_forms_are_one_key() {
                let (layer, _store, _g) = layer().await;
                let (router, counter) = app(layer);
                assert_eq!(
                    send(&router, post("\"k\"", "{}")).await.outcome,
                    Some(Outcome::Executed)
                );
                assert_eq!(
                    send(&router, post("k", "{}")).await.outcome,
                    Some(Outcome::Replayed)
                );
                assert_eq!(counter.runs(), 1);
            }

            #[tokio::test]
            async fn a_key_reused_with_another_request_is_422() {
                let (layer, _store, _g) = layer().await;
                let (router, counter) = app(layer);
                assert_eq!(send(&router, post("k", "{\"amount\":1}")).await.status, 201);
                let other_body = send(&router, post("k", "{\"amount\":2}")).await;
                assert_eq!(other_body.status, 422);
                assert_eq!(other_body.problem(), "key-reused");
                assert_eq!(other_body.outcome, Some(Outcome::Mismatch));
                let other_query = send(
                    &router,
                    req("POST")
                        .uri("/payments?x=1")
                        .header("idempotency-key", "k")
                        .body(Body::from("{\"amount\":1}"))
                        .unwrap(),
                )
                .await;
                assert_eq!(other_query.status, 422);
                let other_method = send(
                    &router,
                    req("PATCH")
                        .header("idempotency-key", "k")
                        .body(Body::from("{\"amount\":1}"))
                        .unwrap(),
                )
                .await;
                assert_eq!(other_method.status, 422);
                let other_type = send(
                    &router,
                    req("POST")
                        .header("idempotency-key", "k")
                        .header("content-type", "text/plain")
                        .body(Body::from("{\"amount\":1}"))
                        .unwrap(),
                )
                .await;
                // Two content-type values now: still a different fingerprint.
                assert_eq!(other_type.status, 422);
                assert_eq!(counter.runs(), 1);
            }

            /// The same JSON re-spelt (whitespace, member order, escapes) and sent as
            /// `application/json; charset=UTF-8` is the same request: replayed, never a
            /// final 422; another amount is another request.
            #[tokio::test]
            async fn a_json_body_re_spelt_is_the_same_request() {
                let (layer, _store, _g) = layer().await;
                let (router, counter) = app(layer);
                let first = send(&router, post("k", r#"{"amount":1000,"currency":"EUR"}"#)).await;
                assert_eq!(first.status, 201);
                let resent = send(
                    &router,
                    post("k", r#"{ "currency" : "EUR", "amount" : 1000 }"#),
                )
                .await;
                assert_eq!(resent.outcome, Some(Outcome::Replayed));
                assert_eq!(resent.body, first.body);
                let mut utf8 = post(
                    "k",
                    "{\n  \"currency\": \"\\u0045UR\",\n  \"amount\": 1000\n}",
                );
                // `post` sends `application/json`: the one value, the client's.
                utf8.headers_mut().insert(
                    "content-type",
                    axum::http::HeaderValue::from_static("Application/JSON; charset=UTF-8"),
                );
                let utf8 = send(&router, utf8).await;
                assert_eq!(utf8.outcome, Some(Outcome::Replayed));
                assert_eq!(utf8.body, first.body);
                let other = send(&router, post("k", r#"{"currency":"EUR","amount":1001}"#)).await;
                assert_eq!(other.status, 422);
                assert_eq!(other.outcome, Some(Outcome::Mismatch));
                let long = send(&router, post("n", r#"{"amount":9007199254740993}"#)).await;
                assert_eq!(long.status, 201);
                let rounded = send(&router, post("n", r#"{"amount":9007199254740992}"#)).await;
                assert_eq!(rounded.status, 422, "a digit of a long number counts");
                assert_eq!(counter.runs(), 2);
            }

            /// `FingerprintScheme::Bytes` keeps byte-exact fingerprints.
            #[tokio::test]
            async fn the_bytes_scheme_compares_bytes() {
                let (layer, _store, _g) = layer().await;
                let (router, counter) =
                    app(layer.fingerprint_scheme(tower_idempotency::FingerprintScheme::Bytes));
                assert_eq!(
                    send(&router, post("k", r#"{"a":1,"b":2}"#)).await.status,
                    201
                );
                let same = send(&router, post("k", r#"{"a":1,"b":2}"#)).await;
                assert_eq!(same.outcome, Some(Outcome::Replayed));
                let resent = send(&router, post("k", r#"{"b":2,"a":1}"#)).await;
                assert_eq!(resent.status, 422);
                assert_eq!(counter.runs(), 1);
            }

            /// A deploy that turns the JSON scheme on lands amid a client's retries:
            /// a record stored before it (a 32-byte bytes fingerprint) is compared with
            /// its retry the bytes' way, and replayed; the new layer's records say
            /// their scheme (33 bytes).
            #[tokio::test]
            async fn a_record_made_before_the_json_scheme_is_replayed_after_it() {
                let (layer, store, _g) = layer().await;
                let body = r#"{"amount":1000,"currency":"EUR"}"#;
                let before = layer
                    .clone()
                    .fingerprint_scheme(tower_idempotency::FingerprintScheme::Bytes);
                let (old, counter) = app(before);
                let first = send(&old, post("k", body)).await;
                assert_eq!(first.status, 201);
                let record = store
                    .look_up(&Scope::anonymous(), "k")
                    .await
                    .unwrap()
                    .unwrap();
                assert_eq!(record.fingerprint.as_bytes().len(), 32);

                let (new, after) = app(layer);
                let replay = send(&new, post("k", body)).await;
                assert_eq!(replay.outcome, Some(Outcome::Replayed));
                assert_eq!(replay.body, first.body);
                // Compared the record's way: its bytes.
                let resent = send(&new, post("k", r#"{"currency":"EUR","amount":1000}"#)).await;
                assert_eq!(resent.status, 422);
                assert_eq!(counter.runs() + after.runs(), 1);

                assert_eq!(send(&new, post("fresh", body)).await.status, 201);
                let record = store
                    .look_up(&Scope::anonymous(), "fresh")
                    .await
                    .unwrap()
                    .unwrap();
                assert_eq!(record.fingerprint.as_bytes().len(), 33);
                assert_eq!(
                    record.fingerprint.scheme(),
                    tower_idempotency::FingerprintScheme::Json
                );
            }

            /// A running key claimed before the upgrade (a bytes fingerprint) whose
            /// holder is gone: its retry after the upgrade takes it over and runs it
            /// once, then is replayed, instead of a 422.
            #[tokio::test]
            async fn a_lapsed_claim_made_before_the_json_scheme_is_taken_over_after_it() {
                use axum::http::header::CONTENT_TYPE;
                let (layer, store, _g) = layer().await;
                let body = r#"{"amount":1000,"currency":"EUR"}"#;
                let (parts, _) = post("k", body).into_parts();
                let old = tower_idempotency::FingerprintScheme::Bytes.fingerprint(
                    &parts,
                    &[CONTENT_TYPE],
                    body.as_bytes(),
                );
                let scope = Scope::anonymous();
                let lease = Duration::from_secs(1);
                let request = ClaimRequest {
                    scope: &scope,
                    key: "k",
                    fingerprint: old,
                    lease,
                    ttl: Duration::from_secs(60),
                };
                let Claim::Acquired(held) = store.claim(&request).await.unwrap() else {
                    panic!("the old claim must acquire")
                };
                // Its holder never completes it; its lease lapses.
                tokio::time::sleep(lease * 2).await;

                let (router, counter) = app(layer);
                let retry = send(&router, post("k", body)).await;
                assert_eq!(retry.status, 201, "{:?}", retry.body);
                assert_eq!(retry.outcome, Some(Outcome::Executed));
                assert_eq!(counter.runs(), 1);
                let again = send(&router, post("k", body)).await;
                assert_eq!(again.outcome, Some(Outcome::Replayed));
                assert_eq!(counter.runs(), 1);
                let record = store.look_up(&scope, "k").await.unwrap().unwrap();
                assert_eq!(record.fingerprint, old);
                assert!(record.token > held.token);
            }

            #[tokio::test]
            async fn a_duplicate_in_flight_gets_409_with_retry_after() {
                let (layer, _store, _g) = layer().await;
                let layer = layer.lease_duration(Duration::from_secs(60));
                let (router, counter) = app(layer.clone());
                let held = post_with_headers("k", &[("x-held", "1")]);
                let first = in_flight(&router, held, &counter).await;
                let dup = send(&router, post("k", "{}")).await;
                assert_eq!(dup.status, 409);
                assert_eq!(dup.problem(), "in-progress");
                assert_eq!(dup.outcome, Some(Outcome::Conflict));
                let retry_after = |reply: &$crate::common::Reply| -> u64 {
                    reply
                        .header("retry-after")
                        .expect("retry-after")
                        .parse()
                        .unwrap()
                };
                // A short hint by default, not the holder's 60 s lease.
                assert_eq!(retry_after(&dup), 1);
                // A hint of the app's own, on a layer over the same store.
                let (hinted, _) = app(layer
                    .clone()
                    .in_progress_retry_after(Duration::from_secs(7)));
                assert_eq!(retry_after(&send(&hinted, post("k", "{}")).await), 7);
                // Never more than what is left of the holder's lease (renewed every 20 s).
                let (long, _) = app(layer.in_progress_retry_after(Duration::from_secs(3600)));
                let capped = retry_after(&send(&long, post("k", "{}")).await);
                assert!((40..=60).contains(&capped), "{capped}");
                // A different request under the running key is a mismatch, not a conflict.
                assert_eq!(send(&router, post("k", "{\"x\":1}")).await.status, 422);
                counter.let_go(1);
                let first = first.await.unwrap();
                assert_eq!(first.status, 201);
                let after = send(&router, post("k", "{}")).await;
                assert_eq!(after.outcome, Some(Outcome::Replayed));
                assert_eq!(after.body, first.body);
                assert_eq!(counter.runs(), 1);
            }

            #[tokio::test]
            async fn a_layer_inside_another_passes_the_guarded_request_through() {
                let (layer, store, _g) = layer().await;
                let store_of_inner = store.clone();
                // A key required on one route, under a layer for the whole router.
                let (inner, counter) = app(IdempotencyLayer::new(store).require_key(true));
                let router = inner.layer(layer);
                let first = send(&router, post("k", "{}")).await;
                assert_eq!(first.status, 201);
                assert_eq!(first.outcome, Some(Outcome::Executed));
                let again = send(&router, post("k", "{}")).await;
                assert_eq!(again.outcome, Some(Outcome::Replayed));
                assert_eq!(again.body, first.body);
                assert_eq!(counter.runs(), 1);
                // A request the outer layer let through is still the inner layer's.
                let keyless = send(&router, req("POST").body(Body::from("{}")).unwrap()).await;
                assert_eq!(keyless.status, 400);
                assert_eq!(keyless.problem(), "key-missing");
                assert_eq!(counter.runs(), 1);
                // Nor does a copy of the request between the two (a retry, a mirror)
                // meet its own claim.
                let copying = |req: axum::extract::Request| async move {
                    let (parts, body) = req.into_parts();
                    axum::extract::Request::from_parts(parts.clone(), body)
                };
                let (inner, counter) = app(IdempotencyLayer::new(store_of_inner.clone()));
                let router = inner
                    .layer(axum::middleware::map_request(copying))
                    .layer(IdempotencyLayer::new(store_of_inner.clone()));
                let first = send(&router, post("k3", "{}")).await;
                assert_eq!(first.outcome, Some(Outcome::Executed));
                let again = send(&router, post("k3", "{}")).await;
                assert_eq!(again.outcome, Some(Outcome::Replayed));
                assert_eq!(counter.runs(), 1);
                // A request that carries the guarded one's extensions under another key
                // (a call to an inner service, say) is guarded under its own.
                let rekeying = |mut req: axum::extract::Request| async move {
                    req.headers_mut().insert(
                        "idempotency-key",
                        axum::http::HeaderValue::from_static("k4-inner"),
                    );
                    req
                };
                let (inner, counter) = app(IdempotencyLayer::new(store_of_inner.clone()));
                let router = inner
                    .layer(axum::middleware::map_request(rekeying))
                    .layer(IdempotencyLayer::new(store_of_inner.clone()));
                let first = send(&router, post("k4", "{}")).await;
                assert_eq!(first.json()["key"], "k4-inner");
                assert_eq!(counter.runs(), 1);
                // A key some other middleware put in the request is no layer's claim.
                let (alone, counter) = app(IdempotencyLayer::new(store_of_inner));
                let mut planted = post("k2", "{}");
                planted
                    .extensions_mut()
                    .insert(tower_idempotency::IdempotencyKey::new(
                        Scope::anonymous(),
                        "k2",
                    ));
                let r = send(&alone, planted).await;
                assert_eq!(r.outcome, Some(Outcome::Executed));
                assert_eq!(counter.runs(), 1);
            }

            /// `POST /payments` whose response streams without end, behind `layer`.
            fn endless(layer: IdempotencyLayer) -> (axum::Router, $crate::common::Counter) {
                let counter = $crate::common::Counter::default();
                let runs = counter.clone();
                let handler = move || {
                    let runs = runs.clone();
                    async move {
                        runs.count_run();
                        axum::response::Response::new(Body::new($crate::common::Trickle {
                            left: None,
                            every: Duration::from_millis(20),
                            sleep: None,
                        }))
                    }
                };
                let router = axum::Router::new()
                    .route("/payments", axum::routing::post(handler))
                    .layer(layer);
                (router, counter)
            }

            /// A handler that answers the status in `x-status` with a body that breaks off.
            fn breaking_off(layer: IdempotencyLayer) -> (axum::Router, $crate::common::Counter) {
                let counter = $crate::common::Counter::default();
                let runs = counter.clone();
                let handler = move |headers: axum::http::HeaderMap| {
                    let runs = runs.clone();
                    async move {
                        runs.count_run();
                        let status = headers["x-status"]
                            .to_str()
                            .expect("x-status")
                            .parse()
                            .expect("a status");
                        let mut res = axum::response::Response::new(Body::new(
                            $crate::common::BreaksOff::default(),
                        ));
                        *res.status_mut() =
                            axum::http::StatusCode::from_u16(status).expect("a status");
                        res
                    }
                };
                let router = axum::Router::new()
                    .route("/payments", axum::routing::post(handler))
                    .layer(layer);
                (router, counter)
            }

            /// A handler that answered a status the policy keeps has run to its answer (a
            /// charge made): its body breaking off does not free the key for it to run
            /// again. A status the policy does not keep frees it, as before.
            #[tokio::test]
            async fn a_response_body_that_breaks_off_after_a_kept_status_never_runs_twice() {
                let (layer, _store, _g) = layer().await;
                let (router, counter) = breaking_off(layer);
                let first = send(&router, post_with_headers("k", &[("x-status", "201")])).await;
                assert_eq!(first.status, 500);
                assert_eq!(first.problem(), "response-not-stored");
                assert_eq!(first.outcome, Some(Outcome::Executed));
                let retry = send(&router, post_with_headers("k", &[("x-status", "201")])).await;
                assert_eq!(retry.status, 500);
                assert_eq!(retry.problem(), "response-not-stored");
                assert_eq!(retry.outcome, Some(Outcome::Replayed));
                assert_eq!(retry.body, first.body);
                assert_eq!(counter.runs(), 1);

                let first = send(&router, post_with_headers("k2", &[("x-status", "503")])).await;
                assert_eq!(first.status, 500);
                assert_eq!(first.problem(), "handler-failed");
                let retry = send(&router, post_with_headers("k2", &[("x-status", "503")])).await;
                assert_eq!(retry.problem(), "handler-failed");
                assert_eq!(retry.outcome, Some(Outcome::Released));
                assert_eq!(
                    counter.runs(),
                    3,
                    "the 503's key was freed, and its retry ran"
                );
            }

            #[tokio::test]
            async fn a_response_body_that_never_ends_is_sent_on_and_replayed_as_not_stored() {
                use http_body_util::BodyExt;
                use tower::ServiceExt;

                let (layer, _store, _g) = layer().await;
                let layer = layer.response_body_timeout(Duration::from_millis(300));
                let shutdown = layer.shutdown_handle();
                let (router, counter) = endless(layer);
                // The client gets the head at the bound, then the body as it streams.
                let res = tokio::time::timeout(
                    Duration::from_secs(10),
                    router.clone().oneshot(post("k", "{}")),
                )
                .await
                .expect("the head arrives")
                .unwrap();
                assert_eq!(res.status(), 200);
                assert_eq!(res.extensions().get::<Outcome>(), Some(&Outcome::Executed));
                let mut body = res.into_body();
                for _ in 0..3 {
                    let frame = body.frame().await.expect("more").unwrap();
                    assert!(frame.into_data().is_ok_and(|d| !d.is_empty()));
                }
                drop(body);
                let retry = send(&router, post("k", "{}")).await;
                assert_eq!(retry.status, 500);
                assert_eq!(retry.problem(), "response-not-stored");
                assert_eq!(retry.outcome, Some(Outcome::Replayed));
                assert_eq!(counter.runs(), 1);

                // A client gone before the head: the request still ends, and its key
                // is completed rather than held and renewed without end.
                let gone = in_flight(&router, post("k2", "{}"), &counter).await;
                gone.abort();
                eventually(|| shutdown.in_flight() == 0).await;
                let retry = send(&router, post("k2", "{}")).await;
                assert_eq!(retry.status, 500);
                assert_eq!(retry.problem(), "response-not-stored");
                assert_eq!(counter.runs(), 2);
            }

            #[tokio::test]
            async fn malformed_keys_are_400_and_claim_nothing() {
                let (layer, _store, _g) = layer().await;
                let (router, counter) = app(layer);
                let long = "k".repeat(256);
                for bad in [
                    "",
                    "\"\"",
                    "a b",
                    "\"abc",
                    "\"a\\nb\"",
                    "\"a\";x=1",
                    "a\"b",
                    long.as_str(),
                ] {
                    let r = send(&router, post(bad, "{}")).await;
                    assert_eq!(r.status, 400, "{bad:?}");
                    assert_eq!(r.problem(), "key-malformed", "{bad:?}");
                    assert_eq!(r.outcome, Some(Outcome::Rejected));
                }
                let non_ascii = req("POST")
                    .header(
                        "idempotency-key",
                        axum::http::HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap(),
                    )
                    .body(Body::from("{}"))
                    .unwrap();
                assert_eq!(send(&router, non_ascii).await.status, 400);
                let two = post_with_headers("a", &[("idempotency-key", "a")]);
                let r = send(&router, two).await;
                assert_eq!(r.status, 400);
                assert!(
                    r.json()["detail"]
                        .as_str()
                        .unwrap()
                        .contains("more than one")
                );
                assert_eq!(counter.runs(), 0);
                // Nothing was claimed: the same key now executes.
                assert_eq!(send(&router, post(&long[..255], "{}")).await.status, 201);
            }

            #[tokio::test]
            async fn a_missing_key_passes_through_or_is_400_when_required() {
                let (layer, _store, _g) = layer().await;
                let (router, counter) = app(layer.clone());
                for _ in 0..2 {
                    let r = send(&router, req("POST").body(Body::from("{}")).unwrap()).await;
                    assert_eq!(r.status, 201);
                    assert_eq!(r.outcome, Some(Outcome::PassedThrough));
                }
                assert_eq!(counter.runs(), 2);

                let (router, counter) = app(layer.require_key(true));
                let r = send(&router, req("POST").body(Body::from("{}")).unwrap()).await;
                assert_eq!(r.status, 400);
                assert_eq!(r.problem(), "key-missing");
                assert_eq!(counter.runs(), 0);
            }

            #[tokio::test]
            async fn unguarded_methods_pass_through_even_with_a_key() {
                let (layer, _store, _g) = layer().await;
                let (router, counter) = app(layer.require_key(true));
                for _ in 0..2 {
                    let r = send(
                        &router,
                        req("GET")
                            .header("idempotency-key", "k")
                            .body(Body::empty())
                            .unwrap(),
                    )
                    .await;
                    assert_eq!(r.status, 201);
                    assert_eq!(r.outcome, Some(Outcome::PassedThrough));
                }
                assert_eq!(counter.runs(), 2);
            }

            #[tokio::test]
            async fn a_body_over_the_limit_is_413_and_claims_nothing() {
                let (layer, _store, _g) = layer().await;
                let (router, counter) = app(layer.request_body_limit(16));
                let big = "x".repeat(17);
                let declared = send(&router, post("k", &big)).await;
                assert_eq!(declared.status, 413);
                assert_eq!(declared.problem(), "body-too-large");
                // No Content-Length: the limit holds while reading.
                let streamed = req("POST")
                    .header("idempotency-key", "k")
                    .body(Body::new($crate::common::Chunked::new(&[
                        "x".repeat(10),
                        "x".repeat(10),
                    ])))
                    .unwrap();
                let streamed = send(&router, streamed).await;
                assert_eq!(streamed.status, 413);
                assert_eq!(counter.runs(), 0);
                assert_eq!(send(&router, post("k", &big[..16])).await.status, 201);
            }

            #[tokio::test]
            async fn server_errors_release_the_key_client_errors_are_stored() {
                let (layer, _store, _g) = layer().await;
                let (router, counter) = app(layer);
                let failing = || post_with_headers("k5", &[("x-status", "503")]);
                assert_eq!(send(&router, failing()).await.status, 503);
                let again = send(&router, failing()).await;
                assert_eq!(again.status, 503);
                assert_eq!(again.outcome, Some(Outcome::Released));
                assert_eq!(counter.runs_of("k5"), 2);
                let rejected = || post_with_headers("k4", &[("x-status", "404")]);
                let first = send(&router, rejected()).await;
                let again = send(&router, rejected()).await;
                assert_eq!((first.status.as_u16(), again.status.as_u16()), (404, 404));
                assert_eq!(again.outcome, Some(Outcome::Replayed));
                assert_eq!(counter.runs_of("k4"), 1);
                // Refusals of a request the endpoint did not begin to process (a body
                // that does not parse or validate, a wrong media type) are not stored:
                // the client may correct the request and send it under the same key.
                for status in ["400", "415", "422"] {
                    let key = format!("k{status}");
                    let refused = || post_with_headers(&key, &[("x-status", status)]);
                    assert_eq!(send(&router, refused()).await.status.as_str(), status);
                    let again = send(&router, refused()).await;
                    assert_eq!(again.status.as_str(), status);
                    assert_eq!(again.outcome, Some(Outcome::Released));
                    assert_eq!(counter.runs_of(&key), 2);
                }
            }

            /// A request refused by axum's `Json` extractor (422, 400, 415), then sent
            /// again corrected under the same key, runs the handler once: the refusal
            /// is not stored.
            #[tokio::test]
            async fn a_corrected_request_after_a_validation_failure_runs_once() {
                use axum::{Json, Router, routing::post as route_post};
                #[derive(serde::Deserialize)]
                struct Payment {
                    amount: u64,
                }
                let (layer, _store, _g) = layer().await;
                let charges = Arc::new(std::sync::atomic::AtomicU64::new(0));
                let charged = charges.clone();
                let router = Router::new()
                    .route(
                        "/payments",
                        route_post(move |Json(payment): Json<Payment>| async move {
                            charged.fetch_add(payment.amount, std::sync::atomic::Ordering::SeqCst);
                            (axum::http::StatusCode::CREATED, "charged")
                        }),
                    )
                    .layer(layer);
                let payment = |content_type: &str, body: &str| {
                    axum::http::Request::post("/payments")
                        .header("idempotency-key", "order-1")
                        .header("content-type", content_type)
                        .body(Body::from(body.to_owned()))
                        .unwrap()
                };
                let json = "application/json";
                for (content_type, body, status) in [
                    (json, r#"{"amount":"ten"}"#, 422),
                    (json, r#"{"amount":"#, 400),
                    ("text/plain", r#"{"amount":10}"#, 415),
                ] {
                    let refused = send(&router, payment(content_type, body)).await;
                    assert_eq!(refused.status, status, "{body}");
                }
                let created = send(&router, payment(json, r#"{"amount":10}"#)).await;
                assert_eq!(created.status, 201);
                let replayed = send(&router, payment(json, r#"{"amount":10}"#)).await;
                assert_eq!(replayed.outcome, Some(Outcome::Replayed));
                assert_eq!(charges.load(std::sync::atomic::Ordering::SeqCst), 10);
            }

            /// A release that fails while the store is away is tried again in the
            /// background: the key frees as soon as the store answers, not when its lease
            /// lapses, so the client's retry runs instead of meeting 409 for a lease.
            #[tokio::test]
            async fn a_release_that_fails_is_tried_again_until_the_store_answers() {
                let (_, store, _g) = layer().await;
                let (store, releases) =
                    AlteredCompletions::counting_releases(store, Completion::ReleasesFailFirst(3));
                let layer = IdempotencyLayer::new(store).lease_duration(Duration::from_secs(60));
                let (router, counter) = app(layer);
                let failing = post_with_headers("k", &[("x-status", "503")]);
                assert_eq!(send(&router, failing).await.status, 503);
                // Without retries, 409 for the whole 60 s lease, and this gives up first.
                let created = retry_until_created(&router, "k", &[409]).await;
                assert_eq!(created.status, 201);
                assert_eq!(counter.runs_of("k"), 2);
                assert!(releases.load(std::sync::atomic::Ordering::SeqCst) >= 4);
            }

            /// A handler marks one answer as not to be stored, whatever the policy.
            #[tokio::test]
            async fn a_response_marked_no_store_releases_the_key() {
                let (layer, _store, _g) = layer().await;
                let (router, counter) = app(layer.store_response_if(|_, _| true));
                let refused =
                    || post_with_headers("k", &[("x-status", "409"), ("x-no-store", "1")]);
                assert_eq!(send(&router, refused()).await.status, 409);
                let again = send(&router, refused()).await;
                assert_eq!(again.status, 409);
                assert_eq!(again.outcome, Some(Outcome::Released));
                assert_eq!(counter.runs_of("k"), 2);
                // Unmarked, the same answer is stored.
                let kept = || post_with_headers("k2", &[("x-status", "409")]);
                assert_eq!(send(&router, kept()).await.status, 409);
                assert_eq!(send(&router, kept()).await.outcome, Some(Outcome::Replayed));
                assert_eq!(counter.runs_of("k2"), 1);
            }

            /// `Cache-Control: no-store` speaks to HTTP caches, and payment APIs send it
            /// on every response: it does not keep a response from being stored for
            /// replay, or the layer would do nothing for them and a retry would run again.
            #[tokio::test]
            async fn a_no_store_response_is_still_replayed() {
                let (layer, _store, _g) = layer().await;
                let (router, counter) = app(layer);
                let charge = || post_with_headers("k", &[("x-cache-control", "no-store")]);
                let first = send(&router, charge()).await;
                assert_eq!(first.status, 201);
                assert_eq!(first.header("cache-control"), Some("no-store"));
                let again = send(&router, charge()).await;
                assert_eq!(again.outcome, Some(Outcome::Replayed));
                assert_eq!(again.header("cache-control"), Some("no-store"));
                assert_eq!(again.body, first.body);
                assert_eq!(counter.runs_of("k"), 1);
            }

            #[tokio::test]
            async fn the_storage_policy_is_a_setting() {
                let (layer, _store, _g) = layer().await;
                // Store everything, 5xx included, as Stripe does.
                let (router, counter) = app(layer.store_response_if(|_, _| true));
                let failing = || post_with_headers("k", &[("x-status", "500")]);
                assert_eq!(
                    send(&router, failing()).await.outcome,
                    Some(Outcome::Executed)
                );
                assert_eq!(
                    send(&router, failing()).await.outcome,
                    Some(Outcome::Replayed)
                );
                assert_eq!(counter.runs(), 1);
            }

            #[tokio::test]
            async fn a_panicking_handler_releases_its_key() {
                let (layer, _store, _g) = layer().await;
                let (router, counter) = app(layer);
                let panicking = post_with_headers("k", &[("x-panic", "1")]);
                let r = send(&router, panicking).await;
                assert_eq!(r.status, 500);
                assert_eq!(r.problem(), "handler-failed");
                let retry = send(&router, post("k", "{}")).await;
                assert_eq!(retry.status, 201);
                assert_eq!(retry.outcome, Some(Outcome::Executed));
                assert_eq!(counter.runs(), 2);
            }

            #[tokio::test]
            async fn a_handler_that_panics_after_its_client_hung_up_releases_its_key() {
                let (layer, _store, _g) = layer().await;
                let (router, counter) = app(layer);
                let panicking = post_with_headers("k", &[("x-delay-ms", "200"), ("x-panic", "1")]);
                let client = in_flight(&router, panicking, &counter).await;
                // The client hangs up while the handler runs: nobody awaits the answer.
                client.abort();
                eventually(|| counter.finished() == 1).await;
                // Released, not held for a lease: the retry runs (409 only until then).
                let retry = retry_until_created(&router, "k", &[409]).await;
                assert_eq!(retry.outcome, Some(Outcome::Executed));
                assert_eq!(counter.runs(), 2);
            }

            #[tokio::test]
            async fn a_panicking_storage_policy_answers_500_and_releases_the_key() {
                let (layer, _store, _g) = layer().await;
                let armed = Arc::new(std::sync::atomic::AtomicBool::new(true));
                let trip = armed.clone();
                let layer = layer.store_response_if(move |status, _| {
                    if trip.swap(false, std::sync::atomic::Ordering::SeqCst) {
                        panic!("the storage policy broke");
                    }
                    status.is_success()
                });
                let (router, counter) = app(layer);
                let r = send(&router, post("k", "{}")).await;
                assert_eq!(r.status, 500);
                assert_eq!(r.problem(), "handler-failed");
                assert!(!armed.load(std::sync::atomic::Ordering::SeqCst));
                let retry = send(&router, post("k", "{}")).await;
                assert_eq!(retry.status, 201);
                assert_eq!(retry.outcome, Some(Outcome::Executed));
                assert_eq!(counter.runs(), 2);
            }

            #[tokio::test]
            async fn a_panicking_scope_function_answers_500_and_claims_nothing() {
                let (layer, _store, _g) = layer().await;
                let layer = layer.scope_with(|parts| {
                    if parts.headers.contains_key("x-panic-scope") {
                        panic!("the scope function broke");
                    }
                    Scope::anonymous()
                });
                let (router, counter) = app(layer);
                let r = send(&router, post_with_headers("k", &[("x-panic-scope", "1")])).await;
                assert_eq!(r.status, 500);
                assert_eq!(r.problem(), "handler-failed");
                let detail = String::from_utf8_lossy(&r.body);
                assert!(
                    !detail.contains("released"),
                    "nothing was claimed to release: {detail}"
                );
                assert_eq!(counter.runs(), 0);
                // Nothing was claimed: the same key runs at once.
                let retry = send(&router, post("k", "{}")).await;
                assert_eq!(retry.status, 201);
                assert_eq!(retry.outcome, Some(Outcome::Executed));
                assert_eq!(counter.runs(), 1);
            }

            #[tokio::test]
            async fn a_response_over_the_storage_limit_never_runs_twice() {
                let (layer, _store, _g) = layer().await;
                let (router, counter) = app(layer.response_body_limit(8));
                let first = send(&router, post("k", "{\"a\":1}")).await;
                assert_eq!(first.status, 201);
                assert!(first.body.len() > 8);
                assert!(
                    first.json()["echo"].is_string(),
                    "the client gets the whole body"
                );
                let retry = send(&router, post("k", "{\"a\":1}")).await;
                assert_eq!(retry.status, 500);
                assert_eq!(retry.problem(), "response-not-stored");
                assert_eq!(counter.runs(), 1);
            }

            #[tokio::test]
            async fn scopes_isolate_callers() {
                let (layer, _store, _g) = layer().await;
                let (router, counter) = app(layer);
                let as_user = |who: &str| {
                    req("POST")
                        .header("idempotency-key", "shared")
                        .header("authorization", format!("Bearer {who}"))
                        .body(Body::from("{}"))
                        .unwrap()
                };
                let alice = send(&router, as_user("alice")).await;
                let bob = send(&router, as_user("bob")).await;
                assert_eq!(counter.runs(), 2);
                assert_ne!(alice.body, bob.body);
                assert_eq!(send(&router, as_user("alice")).await.body, alice.body);
                assert_eq!(send(&router, as_user("bob")).await.body, bob.body);
                assert_eq!(counter.runs(), 2);
            }

            #[tokio::test]
            async fn one_credential_spelt_two_ways_is_one_scope() {
                let (layer, _store, _g) = layer().await;
                let (router, counter) = app(layer);
                let with = |authorization: &str| {
                    req("POST")
                        .header("idempotency-key", "k")
                        .header("authorization", authorization)
                        .body(Body::from("{}"))
                        .unwrap()
                };
                let first = send(&router, with("Bearer tok-123")).await;
                assert_eq!(first.status, 201);
                // The scheme is case-insensitive (RFC 9110, section 11.1).
                let retry = send(&router, with("bearer  tok-123")).await;
                assert_eq!(retry.header("idempotent-replayed"), Some("true"));
                assert_eq!(retry.body, first.body);
                assert_eq!(counter.runs(), 1);
                // The credential is not.
                assert_eq!(send(&router, with("Bearer TOK-123")).await.status, 201);
                assert_eq!(counter.runs(), 2);
            }

            /// A client whose answer was lost refreshes its token and retries with the
            /// same key: the same account, so the same request, replayed. Another
            /// account's key is its own, whatever the layer's `scope_with` says.
            async fn a_refreshed_token_is_the_same_account(
                (router, counter): (axum::Router, $crate::common::Counter),
                k: &str,
            ) {
                let body = "{\"amount\":1000}";
                let first = send(&router, post_as("acct7.first", k, body)).await;
                assert_eq!(first.outcome, Some(Outcome::Executed));
                let refreshed = send(&router, post_as("acct7.second", k, body)).await;
                assert_eq!(refreshed.outcome, Some(Outcome::Replayed));
                assert_eq!(refreshed.body, first.body);
                assert_eq!(counter.runs(), 1);
                let other = send(&router, post_as("acct8.x", k, body)).await;
                assert_eq!(other.outcome, Some(Outcome::Executed));
                assert_ne!(other.body, first.body);
                // And without a principal, the key is the anonymous scope's own.
                let anonymous = send(&router, post(k, body)).await;
                assert_eq!(anonymous.outcome, Some(Outcome::Executed));
                assert_eq!(counter.runs(), 3);
                let again = send(&router, post_as("acct8.y", k, body)).await;
                assert_eq!(again.body, other.body);
                assert_eq!(counter.runs(), 3);
            }

            #[tokio::test]
            async fn keys_are_scoped_by_the_principal_not_by_the_token() {
                let (layer, store, _g) = layer().await;
                a_refreshed_token_is_the_same_account(app_behind_auth(layer), "k1").await;
                // The principal comes before the app's scope function.
                let shared = IdempotencyLayer::new(store.clone()).scope_with(|_| Scope::new("all"));
                a_refreshed_token_is_the_same_account(app_behind_auth(shared), "k2").await;
                // A layer on the route reads it the same.
                let on_route = IdempotencyLayer::new(store).scope_with(|_| Scope::new("route"));
                a_refreshed_token_is_the_same_account(route_behind_auth(on_route), "k3").await;
            }

            /// `require_principal(true)`: a layer the authentication is not in front of
            /// answers `500 misconfigured`, runs nothing and keeps nothing; placed
            /// right, it serves.
            #[tokio::test]
            async fn a_required_principal_missing_is_500_misconfigured_and_runs_nothing() {
                let (layer, store, _g) = layer().await;
                let layer = layer.require_principal(true).require_key(true);
                let (wrong, counter) = app_with_auth_inside(layer.clone());
                let refused = send(&wrong, post_as("acct7.first", "k", "{}")).await;
                assert_eq!(refused.status, 500);
                assert_eq!(refused.problem(), "misconfigured");
                assert_eq!(refused.outcome, Some(Outcome::Rejected));
                assert_eq!(refused.header("cache-control"), Some("no-store"));
                assert_eq!(counter.runs(), 0);
                let hashed = {
                    let (parts, _) = post_as("acct7.first", "k", "{}").into_parts();
                    Scope::from_authorization(&parts)
                };
                for scope in [hashed, Scope::anonymous()] {
                    assert!(store.look_up(&scope, "k").await.unwrap().is_none());
                }
                // A request the layer does not guard passes as ever: a key is checked
                // first.
                let keyless = req("POST").body(Body::from("{}")).unwrap();
                assert_eq!(send(&wrong, keyless).await.problem(), "key-missing");
                assert_eq!(counter.runs(), 0);
                // The authentication outside it: the key runs once, scoped by account.
                let (right, counter) = app_behind_auth(layer);
                let ran = send(&right, post_as("acct7.first", "k", "{}")).await;
                assert_eq!(ran.outcome, Some(Outcome::Executed));
                let replayed = send(&right, post_as("acct7.second", "k", "{}")).await;
                assert_eq!(replayed.outcome, Some(Outcome::Replayed));
                assert_eq!(counter.runs(), 1);
            }

            /// A deploy that changes both how scopes and how fingerprints are computed:
            /// records the old layer stored under the `Authorization` hash with bytes
            /// fingerprints are found under the previous scope and compared the bytes'
            /// way: the done one replayed, the running one 409, nothing run again.
            #[tokio::test]
            async fn an_upgrade_to_principals_and_the_json_scheme_at_once_runs_nothing_again() {
                let (old_layer, store, _g) = layer().await;
                let old_layer = old_layer
                    .lease_duration(Duration::from_secs(60))
                    .fingerprint_scheme(tower_idempotency::FingerprintScheme::Bytes);
                let (old, old_counter) = app(old_layer);
                let body = r#"{"amount":1000,"currency":"EUR"}"#;
                let first = send(&old, post_as("acct7.first", "done", body)).await;
                assert_eq!(first.outcome, Some(Outcome::Executed));
                let held = post_as("acct7.first", "running", "{}");
                let (parts, _) = held.into_parts();
                let mut held = axum::http::Request::from_parts(parts, Body::from("{}"));
                held.headers_mut().insert("x-held", "1".parse().unwrap());
                let running = in_flight(&old, held, &old_counter).await;

                let new_layer = IdempotencyLayer::new(store.clone())
                    .require_principal(true)
                    .previous_scope_with(Scope::from_authorization);
                let (new, counter) = app_behind_auth(new_layer);
                let retry = send(&new, post_as("acct7.first", "done", body)).await;
                assert_eq!(retry.outcome, Some(Outcome::Replayed));
                assert_eq!(retry.body, first.body);
                let dup = send(&new, post_as("acct7.first", "running", "{}")).await;
                assert_eq!(dup.status, 409);
                let other = send(&new, post_as("acct7.first", "done", r#"{"amount":1}"#)).await;
                assert_eq!(other.status, 422);
                assert_eq!(counter.runs(), 0);
                old_counter.let_go(1);
                assert_eq!(running.await.unwrap().status, 201);
                assert_eq!(old_counter.runs(), 2);
            }

            /// A deploy that starts scoping by principal where the layer scoped by the
            /// `Authorization` hash: a retry of a request the old layer ran is
            /// replayed, one of a request it still runs gets 409, another request
            /// under its key 422; only a key the old scope never had runs. Without the
            /// transition setting, the retry would run again.
            #[tokio::test]
            async fn an_upgrade_to_principals_replays_keys_stored_under_the_authorization_hash() {
                let (old_layer, store, _g) = layer().await;
                let old_layer = old_layer.lease_duration(Duration::from_secs(60));
                let (old, old_counter) = app(old_layer);
                let body = "{\"amount\":1000}";
                let first = send(&old, post_as("acct7.first", "done", body)).await;
                assert_eq!(first.outcome, Some(Outcome::Executed));
                let held = post_as("acct7.first", "running", "{}");
                let (parts, _) = held.into_parts();
                let mut held = axum::http::Request::from_parts(parts, Body::from("{}"));
                held.headers_mut().insert("x-held", "1".parse().unwrap());
                let running = in_flight(&old, held, &old_counter).await;

                let new_layer = IdempotencyLayer::new(store.clone())
                    .require_principal(true)
                    .previous_scope_with(Scope::from_authorization);
                let (new, counter) = app_behind_auth(new_layer);
                let retry = send(&new, post_as("acct7.first", "done", body)).await;
                assert_eq!(retry.outcome, Some(Outcome::Replayed));
                assert_eq!(retry.body, first.body);
                assert_eq!(retry.header("idempotent-replayed"), Some("true"));
                let principal = tower_idempotency::Principal::new("acct7");
                // The claim it took under the principal is let go.
                assert!(
                    store
                        .look_up(principal.scope(), "done")
                        .await
                        .unwrap()
                        .is_none()
                );
                let other = send(&new, post_as("acct7.first", "done", "{\"amount\":1}")).await;
                assert_eq!(other.status, 422);
                assert_eq!(other.problem(), "key-reused");
                let dup = send(&new, post_as("acct7.first", "running", "{}")).await;
                assert_eq!(dup.status, 409);
                assert_eq!(dup.problem(), "in-progress");
                assert_eq!(counter.runs(), 0);
                assert!(
                    store
                        .look_up(principal.scope(), "running")
                        .await
                        .unwrap()
                        .is_none()
                );
                old_counter.let_go(1);
                let ran = running.await.unwrap();
                assert_eq!(ran.status, 201);
                let after = send(&new, post_as("acct7.first", "running", "{}")).await;
                assert_eq!(after.outcome, Some(Outcome::Replayed));
                assert_eq!(after.body, ran.body);
                // A key the old scope never had runs, under the principal, once.
                let fresh = send(&new, post_as("acct7.first", "fresh", "{}")).await;
                assert_eq!(fresh.outcome, Some(Outcome::Executed));
                let refreshed = send(&new, post_as("acct7.second", "fresh", "{}")).await;
                assert_eq!(refreshed.outcome, Some(Outcome::Replayed));
                assert_eq!((counter.runs(), old_counter.runs()), (1, 2));

                // The same deploy without the setting runs the retry a second time.
                let (unaware, unaware_counter) = app_behind_auth(IdempotencyLayer::new(store));
                let again = send(&unaware, post_as("acct7.first", "done", body)).await;
                assert_eq!(again.outcome, Some(Outcome::Executed));
                assert_eq!(unaware_counter.runs(), 1);
            }

            /// `Store::look_up` reads a key's record and changes nothing.
            #[tokio::test]
            async fn a_key_is_looked_up_without_being_changed() {
                let (_layer, store, _g) = layer().await;
                let scope = Scope::new("ops");
                assert!(store.look_up(&scope, "job-1").await.unwrap().is_none());
                let request = claim_request(&scope, Duration::from_secs(60), 3);
                let Claim::Acquired(lease) = store.claim(&request).await.unwrap() else {
                    panic!("a new key")
                };
                let running = store
                    .look_up(&scope, "job-1")
                    .await
                    .unwrap()
                    .expect("running");
                assert_eq!(running.token, lease.token);
                assert_eq!(running.fingerprint, Fingerprint::new([3; 32]));
                let tower_idempotency::store::KeyState::Running { lease_left } = running.state
                else {
                    panic!("running: {running:?}")
                };
                assert!(lease_left > Duration::from_secs(50), "{lease_left:?}");
                assert!(lease_left <= Duration::from_secs(60), "{lease_left:?}");
                assert!(running.expires_in > Duration::from_secs(50));
                assert!(!running.is_free());
                // Read again, it is still the claim's: the look-up took nothing over.
                assert!(
                    store
                        .renew(&lease, Duration::from_secs(60))
                        .await
                        .unwrap()
                        .is_kept()
                );
                let response = StoredResponse {
                    status: axum::http::StatusCode::CREATED,
                    headers: [(axum::http::header::LOCATION, "/p/1".parse().unwrap())]
                        .into_iter()
                        .collect(),
                    body: bytes::Bytes::from_static(b"{\"id\":1}"),
                };
                let ttl = Duration::from_secs(3600);
                assert!(
                    store
                        .complete(&lease, &response, ttl)
                        .await
                        .unwrap()
                        .is_kept()
                );
                let completed = store
                    .look_up(&scope, "job-1")
                    .await
                    .unwrap()
                    .expect("completed");
                assert_eq!(completed.token, lease.token);
                let tower_idempotency::store::KeyState::Completed { response: stored } =
                    completed.state
                else {
                    panic!("completed: {completed:?}")
                };
                assert_eq!(stored.status, response.status);
                assert_eq!(stored.headers, response.headers);
                assert_eq!(stored.body, response.body);
                assert!(completed.expires_in > Duration::from_secs(3500));
                // Another scope's key of the same name is not this one.
                assert!(
                    store
                        .look_up(&Scope::new("other"), "job-1")
                        .await
                        .unwrap()
                        .is_none()
                );
                // A released claim leaves nothing to read.
                let request = ClaimRequest {
                    key: "released",
                    ..claim_request(&scope, Duration::from_secs(60), 4)
                };
                let Claim::Acquired(released) = store.claim(&request).await.unwrap() else {
                    panic!("a new key")
                };
                assert!(store.look_up(&scope, "released").await.unwrap().is_some());
                assert!(store.release(&released).await.unwrap().is_kept());
                assert!(store.look_up(&scope, "released").await.unwrap().is_none());
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn two_hundred_concurrent_duplicates_run_once() {
                let (layer, _store, _g) = layer().await;
                let (router, counter) = app(layer);
                let barrier = Arc::new(tokio::sync::Barrier::new(200));
                let tasks: Vec<_> = (0..200)
                    .map(|_| {
                        let (router, barrier) = (router.clone(), barrier.clone());
                        tokio::spawn(async move {
                            let r = req("POST")
                                .header("idempotency-key", "race")
                                .header("x-delay-ms", "200")
                                .body(Body::from("{\"amount\":100}"))
                                .unwrap();
                            barrier.wait().await;
                            send(&router, r).await
                        })
                    })
                    .collect();
                let mut successes = Vec::new();
                let mut conflicts = 0;
                for t in tasks {
                    let r = t.await.unwrap();
                    match r.status.as_u16() {
                        201 => successes.push(r.body),
                        409 => {
                            assert!(r.header("retry-after").is_some());
                            assert_eq!(r.problem(), "in-progress");
                            conflicts += 1;
                        }
                        other => panic!("unexpected status {other}: {:?}", r.body),
                    }
                }
                assert_eq!(counter.runs(), 1, "the inner service ran more than once");
                assert!(!successes.is_empty());
                assert!(
                    successes.iter().all(|b| *b == successes[0]),
                    "successes differ"
                );
                assert_eq!(successes.len() + conflicts, 200);
            }

            #[tokio::test]
            async fn a_slow_live_handler_keeps_its_lease() {
                let (layer, _store, _g) = layer().await;
                // The handler is held three leases long; renewal must keep duplicates
                // out. (Renewed every 0.5 s, the lease outlasts a stall of a second.)
                let lease = Duration::from_millis(1500);
                let (router, counter) = app(layer.lease_duration(lease));
                let held = post_with_headers("k", &[("x-held", "1")]);
                let first = in_flight(&router, held, &counter).await;
                let until = tokio::time::Instant::now() + 3 * lease;
                let mut dups = Vec::new();
                while tokio::time::Instant::now() < until {
                    dups.push(send(&router, post("k", "{}")).await.status.as_u16());
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                counter.let_go(1);
                assert_eq!(first.await.unwrap().status, 201);
                assert!(dups.iter().all(|s| *s == 409), "{dups:?}");
                assert_eq!(counter.runs(), 1);
            }

            /// A handler that blocks its thread (a blocking SDK call, bcrypt, a PDF
            /// render) is not polled while it blocks: its lease is still renewed, and a
            /// retry sent when the lease would have lapsed, unrenewed, three times over
            /// gets 409, never a second run. Here in `block_in_place`.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_handler_that_blocks_its_thread_keeps_its_lease() {
                let (layer, _store, _g) = layer().await;
                $crate::common::a_blocked_handler_keeps_its_lease(layer, true).await;
            }

            /// A request on `k` with `headers`, held, and its duplicate, sent with
            /// `wait_for_running`: the first is let go once the duplicate waits for it.
            /// The first's answer, the duplicate's, the counter, and the store's guard.
            async fn a_duplicate_waits_for(
                headers: &[(&str, &str)],
            ) -> (
                $crate::common::Reply,
                $crate::common::Reply,
                $crate::common::Counter,
                impl Sized,
            ) {
                let (_layer, store, guard) = layer().await;
                let (store, counts) = AlteredCompletions::counting(store);
                let layer = IdempotencyLayer::new(store).wait_for_running(Duration::from_secs(30));
                let (router, counter) = app(layer);
                let mut held = vec![("x-held", "1")];
                held.extend_from_slice(headers);
                let first = in_flight(&router, post_with_headers("k", &held), &counter).await;
                let waiter = tokio::spawn({
                    let router = router.clone();
                    async move { send(&router, post("k", "{}")).await }
                });
                eventually(|| counts.registrations() >= 1).await;
                counter.let_go(1);
                let waited = waiter.await.unwrap();
                (first.await.unwrap(), waited, counter, guard)
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_duplicate_can_wait_for_the_running_request_and_replay_it() {
                let (first, waited, counter, _g) = a_duplicate_waits_for(&[]).await;
                assert_eq!(waited.status, 201);
                assert_eq!(waited.outcome, Some(Outcome::Replayed));
                assert_eq!(waited.body, first.body);
                assert_eq!(counter.runs(), 1);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_waiting_duplicate_runs_the_handler_when_the_first_fails() {
                // Released, not completed: the waiter claims the key and runs.
                let (first, waited, counter, _g) =
                    a_duplicate_waits_for(&[("x-status", "503")]).await;
                assert_eq!(first.status, 503);
                assert_eq!(waited.status, 201);
                assert_eq!(waited.outcome, Some(Outcome::Executed));
                assert_eq!(counter.runs(), 2);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_waiting_duplicate_gives_up_at_its_bound() {
                let (layer, _store, _g) = layer().await;
                let (router, counter) = app(layer.wait_for_running(Duration::from_millis(200)));
                let held = post_with_headers("k", &[("x-held", "1")]);
                let first = in_flight(&router, held, &counter).await;
                let waited = $crate::common::send_bounded(&router, post("k", "{}")).await;
                assert_eq!(waited.status, 409);
                // 409, not a replay: the wait ended at its bound, before the first finished.
                assert_eq!(waited.problem(), "in-progress");
                counter.let_go(1);
                assert_eq!(first.await.unwrap().status, 201);
                assert_eq!(counter.runs(), 1);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_waiting_duplicate_takes_the_key_over_when_its_holder_s_lease_lapses() {
                let (layer, store, _g) = layer().await;
                // A holder that crashed: it claimed, then never renewed, stored nor
                // released, and so sends no notification either.
                let scope = Scope::anonymous();
                let crashed = store
                    .claim(&claim_request(&scope, Duration::from_millis(300), 7))
                    .await
                    .unwrap();
                assert!(matches!(crashed, Claim::Acquired(_)));
                let layer = layer
                    .fingerprint_with(|_, _| Fingerprint::new([7; 32]))
                    .wait_for_running(Duration::from_secs(600));
                let (router, counter) = app(layer);
                // The waiter looks again when the lease lapses, not at its bound.
                let waited = tokio::time::timeout(
                    Duration::from_secs(10),
                    send(&router, post("job-1", "{}")),
                )
                .await
                .expect("still waiting: the lapsed lease was not taken over");
                assert_eq!(waited.status, 201);
                assert_eq!(waited.outcome, Some(Outcome::Executed));
                assert_eq!(counter.runs(), 1);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_waiting_duplicate_answers_503_at_close_and_never_runs() {
                let (_layer, store, _g) = layer().await;
                let (store, counts) = AlteredCompletions::counting(store);
                let layer = IdempotencyLayer::new(store).wait_for_running(Duration::from_secs(600));
                let shutdown = layer.shutdown_handle();
                let (router, counter) = app(layer);
                // The first fails, and so releases its key, once the waiter has answered.
                let failing = post_with_headers("k", &[("x-held", "1"), ("x-status", "503")]);
                let first = in_flight(&router, failing, &counter).await;
                let waiter = tokio::spawn({
                    let router = router.clone();
                    async move { send(&router, post("k", "{}")).await }
                });
                // The close comes once the duplicate waits. It may register more than
                // once: woken for nothing (the listener wakes every waiter when it
                // connects), it looks again, finds the key still running, and waits on.
                eventually(|| counts.registrations() >= 1).await;
                let drained = tokio::spawn({
                    let shutdown = shutdown.clone();
                    async move { shutdown.drain().await }
                });
                let waited = tokio::time::timeout(Duration::from_secs(30), waiter)
                    .await
                    .expect("the close did not end the wait")
                    .unwrap();
                assert_eq!(waited.status, 503);
                assert_eq!(waited.problem(), "shutting-down");
                counter.let_go(1);
                assert_eq!(first.await.unwrap().status, 503);
                tokio::time::timeout(Duration::from_secs(10), drained)
                    .await
                    .expect("drained")
                    .unwrap();
                // Released by the first, the key was claimed by nobody after the close.
                assert_eq!(counter.runs(), 1);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_renewal_on_its_way_when_the_handler_ends_is_not_cut_short() {
                let (_layer, store, _g) = layer().await;
                // Renewed every second; the renewal is held on its way to the store, and
                // the handler let go only once it is.
                let (store, counts) =
                    AlteredCompletions::counting_with(store, Completion::HeldRenew);
                let layer = IdempotencyLayer::new(store).lease_duration(Duration::from_secs(3));
                let (router, counter) = app(layer);
                let first = in_flight(
                    &router,
                    post_with_headers("k", &[("x-held", "1")]),
                    &counter,
                )
                .await;
                eventually(|| counts.renewals_started() == 1).await;
                counter.let_go(1);
                // Bounded: a response that waited for the held renewal would never come.
                let r = tokio::time::timeout(Duration::from_secs(30), first)
                    .await
                    .expect("the response waited for the renewal on its way")
                    .unwrap();
                assert_eq!(r.status, 201);
                assert_eq!(counts.renewals(), 0, "the renewal was not on its way");
                // It still reaches the store (dropped, it would close its connection).
                counts.let_renewals_go(1);
                eventually(|| counts.renewals() == 1).await;
                assert_eq!(counter.runs(), 1);
            }

            #[tokio::test]
            async fn a_slow_completion_keeps_its_lease() {
                let (_layer, store, _g) = layer().await;
                // The first completion takes three leases: renewal must keep duplicates
                // out while it is on its way, as while the handler ran. (Renewed every
                // 0.5 s, the lease outlasts a stall of a second.)
                let slow = AlteredCompletions::around(
                    store,
                    Completion::Slow(Duration::from_millis(4500)),
                );
                let layer = IdempotencyLayer::new(slow)
                    .lease_duration(Duration::from_millis(1500))
                    .store_timeout(Duration::from_secs(10));
                let (router, counter) = app(layer);
                let first = in_flight(&router, post("k", "{}"), &counter).await;
                let mut dups = Vec::new();
                while !first.is_finished() {
                    dups.push(send(&router, post("k", "{}")).await.status.as_u16());
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                assert_eq!(first.await.unwrap().status, 201);
                assert!(!dups.is_empty());
                // 409 while it runs; a replay if one was sent as the completion landed.
                assert!(dups.iter().all(|s| *s == 409 || *s == 201), "{dups:?}");
                assert_eq!(counter.runs(), 1);
                let replay = send(&router, post("k", "{}")).await;
                assert_eq!(replay.outcome, Some(Outcome::Replayed));
            }

            fn claim_request<'a>(scope: &'a Scope, lease: Duration, fp: u8) -> ClaimRequest<'a> {
                ClaimRequest {
                    scope,
                    key: "job-1",
                    fingerprint: Fingerprint::new([fp; 32]),
                    lease,
                    ttl: Duration::from_secs(60),
                }
            }

            fn stored(body: &'static str) -> StoredResponse {
                StoredResponse {
                    status: axum::http::StatusCode::OK,
                    headers: Default::default(),
                    body: body.into(),
                }
            }

            #[tokio::test]
            async fn a_lapsed_lease_is_taken_over_and_the_old_holder_is_fenced() {
                let (_layer, store, _g) = layer().await;
                let scope = Scope::new("workers");
                let lease = Duration::from_secs(2);
                let Claim::Acquired(old) =
                    store.claim(&claim_request(&scope, lease, 1)).await.unwrap()
                else {
                    panic!("first claim must acquire")
                };
                assert!(matches!(
                    store.claim(&claim_request(&scope, lease, 1)).await.unwrap(),
                    Claim::Running { .. }
                ));
                tokio::time::sleep(lease * 2).await;
                // A different request may not take over a lapsed key: it is still a mismatch.
                let Claim::Running { fingerprint, .. } =
                    store.claim(&claim_request(&scope, lease, 2)).await.unwrap()
                else {
                    panic!("a different fingerprint must not take over")
                };
                assert_eq!(fingerprint, Fingerprint::new([1; 32]));
                let Claim::Acquired(new) =
                    store.claim(&claim_request(&scope, lease, 1)).await.unwrap()
                else {
                    panic!("a lapsed lease must be taken over")
                };
                assert_eq!(new.token, old.token.next());
                assert!(!store.renew(&old, lease).await.unwrap().is_kept());
                assert!(
                    !store
                        .complete(&old, &stored("old"), Duration::from_secs(60))
                        .await
                        .unwrap()
                        .is_kept()
                );
                assert!(!store.release(&old).await.unwrap().is_kept());
                assert!(
                    store
                        .complete(&new, &stored("new"), Duration::from_secs(60))
                        .await
                        .unwrap()
                        .is_kept()
                );
                let Claim::Completed { response, .. } =
                    store.claim(&claim_request(&scope, lease, 1)).await.unwrap()
                else {
                    panic!("completed")
                };
                assert_eq!(response.body, "new");
                // A completed record is never overwritten, not even by its own holder.
                assert!(
                    !store
                        .complete(&new, &stored("again"), Duration::from_secs(60))
                        .await
                        .unwrap()
                        .is_kept()
                );
            }

            #[tokio::test]
            async fn an_expired_record_is_remembered_not_claimed_afresh() {
                let (_layer, store, _g) = layer().await;
                let scope = Scope::new("s");
                let mut request = claim_request(&scope, Duration::from_secs(10), 1);
                request.ttl = Duration::from_secs(2);
                let Claim::Acquired(lease) = store.claim(&request).await.unwrap() else {
                    panic!()
                };
                assert!(
                    store
                        .complete(&lease, &stored("x"), request.ttl)
                        .await
                        .unwrap()
                        .is_kept()
                );
                assert!(matches!(
                    store.claim(&request).await.unwrap(),
                    Claim::Completed { .. }
                ));
                tokio::time::sleep(Duration::from_secs(4)).await;
                // Its response gone, before the purge and after it alike: remembered
                // (the stores remember keys for 7 days by default), never taken again,
                // whichever request comes with the key.
                for purged in [false, true] {
                    if purged {
                        store.purge(100).await.unwrap();
                    }
                    for fingerprint in [Fingerprint::new([1; 32]), Fingerprint::new([9; 32])] {
                        request.fingerprint = fingerprint;
                        match store.claim(&request).await.unwrap() {
                            Claim::Remembered {
                                fingerprint,
                                status,
                                completed_at,
                                remembered_until,
                            } => {
                                assert_eq!(
                                    fingerprint,
                                    Fingerprint::new([1; 32]),
                                    "the first request's"
                                );
                                assert_eq!(status, 200, "stored(\"x\")'s");
                                let window = remembered_until.duration_since(completed_at).unwrap();
                                assert!(window >= Duration::from_secs(7 * 24 * 3600), "{window:?}");
                            }
                            other => panic!("purged {purged}: {other:?}"),
                        }
                    }
                }
                assert!(
                    !store
                        .complete(&lease, &stored("old"), request.ttl)
                        .await
                        .unwrap()
                        .is_kept()
                );
            }

            #[tokio::test]
            async fn a_late_retry_after_the_response_expired_is_410_and_runs_nothing() {
                let (layer, store, _g) = layer().await;
                let (router, counter) = app(layer.ttl(Duration::from_secs(1)));
                let first = send(&router, post("late", "{\"amount\":1}")).await;
                assert_eq!(first.status, 201);
                tokio::time::sleep(Duration::from_millis(1500)).await;
                // Before the purge reduced the record, and after it.
                for purged in [false, true] {
                    if purged {
                        store.purge(100).await.unwrap();
                    }
                    let late = send(&router, post("late", "{\"amount\":1}")).await;
                    assert_eq!(late.status, 410, "purged {purged}: {:?}", late.body);
                    assert_eq!(late.outcome, Some(Outcome::Expired));
                    assert_eq!(
                        late.header("content-type"),
                        Some("application/problem+json")
                    );
                    assert_eq!(late.header("idempotent-replayed"), None);
                    let doc: serde_json::Value = serde_json::from_slice(&late.body).unwrap();
                    assert!(doc["type"].as_str().unwrap().ends_with("#response-expired"));
                    assert_eq!(doc["status"], 410);
                    assert_eq!(doc["response_status"], 201);
                    let completed_at = doc["completed_at"].as_str().unwrap();
                    let until = doc["remembered_until"].as_str().unwrap();
                    assert_eq!((completed_at.len(), until.len()), (20, 20), "{doc}");
                    assert!(completed_at < until, "{doc}");
                    // Another request under the key: the key is another request's.
                    let other = send(&router, post("late", "{\"amount\":2}")).await;
                    assert_eq!(other.status, 422);
                }
                assert_eq!(counter.runs(), 1, "a late retry never runs again");
            }

            #[tokio::test]
            async fn a_key_deleted_and_claimed_afresh_fences_every_old_lease() {
                let (_layer, store, _g) = layer().await;
                let scope = Scope::new("s");
                let lease = Duration::from_millis(100);
                let Claim::Acquired(x) =
                    store.claim(&claim_request(&scope, lease, 1)).await.unwrap()
                else {
                    panic!("X acquires")
                };
                tokio::time::sleep(lease * 2).await;
                let Claim::Acquired(y) =
                    store.claim(&claim_request(&scope, lease, 1)).await.unwrap()
                else {
                    panic!("Y takes over")
                };
                assert!(
                    store.release(&y).await.unwrap().is_kept(),
                    "Y releases: the row is gone"
                );
                // Z, another request, claims the key afresh.
                let z_request = claim_request(&scope, Duration::from_secs(10), 2);
                let Claim::Acquired(z) = store.claim(&z_request).await.unwrap() else {
                    panic!("Z acquires")
                };
                assert_ne!(z.token, x.token);
                assert!(!store.renew(&x, lease).await.unwrap().is_kept());
                assert!(
                    !store
                        .complete(&x, &stored("X"), Duration::from_secs(60))
                        .await
                        .unwrap()
                        .is_kept()
                );
                assert!(!store.release(&x).await.unwrap().is_kept());
                assert!(
                    !store
                        .complete(&y, &stored("Y"), Duration::from_secs(60))
                        .await
                        .unwrap()
                        .is_kept()
                );
                assert!(matches!(
                    store.claim(&z_request).await.unwrap(),
                    Claim::Running { .. }
                ));
                assert!(
                    store
                        .complete(&z, &stored("Z"), Duration::from_secs(60))
                        .await
                        .unwrap()
                        .is_kept()
                );
                let Claim::Completed { response, .. } = store.claim(&z_request).await.unwrap()
                else {
                    panic!("completed")
                };
                assert_eq!(response.body, "Z");
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_running_request_outlives_a_shorter_ttl() {
                let (layer, _store, _g) = layer().await;
                let (router, counter) = app(layer.ttl(Duration::from_millis(100)));
                let held = post_with_headers("k", &[("x-held", "1")]);
                let first = in_flight(&router, held, &counter).await;
                tokio::time::sleep(Duration::from_millis(200)).await;
                // Past the TTL, but the holder's lease is live: still a conflict.
                assert_eq!(send(&router, post("k", "{}")).await.status, 409);
                counter.let_go(1);
                assert_eq!(first.await.unwrap().status, 201);
                assert_eq!(counter.runs(), 1);
            }

            #[tokio::test]
            async fn an_oversized_response_the_policy_rejects_releases_the_key() {
                let (layer, _store, _g) = layer().await;
                let (router, counter) = app(layer.response_body_limit(8));
                let failing = || {
                    req("POST")
                        .header("idempotency-key", "k")
                        .header("x-status", "503")
                        .body(Body::from("{\"a\":1}"))
                        .unwrap()
                };
                let first = send(&router, failing()).await;
                assert_eq!(first.status, 503);
                assert!(first.body.len() > 8, "the client still gets the whole body");
                assert_eq!(
                    send(&router, failing()).await.outcome,
                    Some(Outcome::Released)
                );
                assert_eq!(counter.runs(), 2, "a 5xx is never stored, in any size");
            }

            #[tokio::test]
            async fn purge_removes_expired_records_and_spares_live_claims() {
                let (_layer, store, _g) = layer().await;
                let scope = Scope::new("s");
                let short = |key: &'static str| ClaimRequest {
                    scope: &scope,
                    key,
                    fingerprint: Fingerprint::new([1; 32]),
                    lease: Duration::from_secs(30),
                    ttl: Duration::from_millis(20),
                };
                // Every claim first, then the completions: a claim may sweep what has
                // expired (the memory store does), and none comes after the first expiry.
                let Claim::Acquired(_live) = store.claim(&short("running")).await.unwrap() else {
                    panic!()
                };
                let mut leases = Vec::new();
                for key in ["done-1", "done-2", "done-3"] {
                    let Claim::Acquired(lease) = store.claim(&short(key)).await.unwrap() else {
                        panic!()
                    };
                    leases.push((key, lease));
                }
                for (key, lease) in &leases {
                    assert!(
                        store
                            .complete(lease, &stored(key), Duration::from_millis(20))
                            .await
                            .unwrap()
                            .is_kept()
                    );
                }
                tokio::time::sleep(Duration::from_millis(60)).await;
                assert_eq!(store.purge(2).await.unwrap(), 2);
                assert_eq!(store.purge(2).await.unwrap(), 1);
                assert_eq!(store.purge(2).await.unwrap(), 0, "the live claim stays");
                assert!(matches!(
                    store.claim(&short("running")).await.unwrap(),
                    Claim::Running { .. }
                ));
                // Its response gone, its key remembered.
                assert!(matches!(
                    store.claim(&short("done-1")).await.unwrap(),
                    Claim::Remembered { .. }
                ));
            }

            #[tokio::test]
            async fn the_background_purger_purges_batch_after_batch() {
                let (_layer, store, _g) = layer().await;
                // Every claim before the first completion, as above.
                let scope = Scope::new("s");
                let keys: Vec<String> = (0..5).map(|i| format!("k{i}")).collect();
                let mut leases = Vec::new();
                for key in &keys {
                    let request = ClaimRequest {
                        scope: &scope,
                        key,
                        fingerprint: Fingerprint::new([1; 32]),
                        lease: Duration::from_secs(30),
                        ttl: Duration::from_millis(20),
                    };
                    let Claim::Acquired(lease) = store.claim(&request).await.unwrap() else {
                        panic!()
                    };
                    leases.push(lease);
                }
                for lease in &leases {
                    let done = stored("k");
                    assert!(
                        store
                            .complete(lease, &done, Duration::from_millis(20))
                            .await
                            .unwrap()
                            .is_kept()
                    );
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                let (counted, purges) = AlteredCompletions::counting(store.clone());
                // Its first tick comes at once and the next in an hour: that one tick
                // must take all five expired records, two at a time.
                let purger =
                    tower_idempotency::store::spawn_purger(counted, Duration::from_secs(3600), 2);
                eventually(|| purges.deleted() == 5).await;
                purger.abort();
                assert_eq!(purges.calls(), 3, "batches of 2, 2 and 1");
                assert_eq!(
                    store.purge(100).await.unwrap(),
                    0,
                    "nothing is left to purge"
                );
            }

            #[tokio::test]
            async fn release_frees_the_key() {
                let (_layer, store, _g) = layer().await;
                let scope = Scope::new("s");
                let request = claim_request(&scope, Duration::from_secs(10), 1);
                let Claim::Acquired(lease) = store.claim(&request).await.unwrap() else {
                    panic!()
                };
                assert!(store.release(&lease).await.unwrap().is_kept());
                assert!(matches!(
                    store.claim(&request).await.unwrap(),
                    Claim::Acquired(_)
                ));
            }
        }
    };
}
