//! The store contract (feature `test-util`): what every [`IdempotencyStore`] must do,
//! as one call a store's tests make, so that no store quietly differs. The moka,
//! Redis and PostgreSQL stores run it in their tests; a store of yours should too:
//!
//! ```
//! use std::sync::Arc;
//!
//! use tower_ids_core::store::{contract::keeps_the_store_contract, IdempotencyStore};
//!
//! // The body of a `#[tokio::test]` of your store.
//! async fn my_store_keeps_the_contract(store: impl IdempotencyStore) {
//!     keeps_the_store_contract(Arc::new(store)).await;
//! }
//! ```
//!
//! Leases and TTLs are real time (a store outside the process keeps its own clock), a
//! few hundred milliseconds each: the whole contract takes a few seconds.

use std::{
    sync::Arc,
    time::{Duration, SystemTime},
};

use crate::store::{
    Begin, Claim, Completion, Fingerprint, IdempotencyStore, Lease, Payload, PayloadFormat, Record,
    Renewal, ScopeKey, Waited,
};
use bytes::Bytes;

/// A scope no other case of this run uses.
fn scope(case: u8) -> ScopeKey {
    let mut bytes: [u8; 32] = rand_bytes();
    bytes[0] = case;
    ScopeKey::from_bytes(bytes)
}

fn rand_bytes() -> [u8; 32] {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let mut bytes = [0; 32];
    bytes[8..24].copy_from_slice(&nanos.to_be_bytes());
    bytes[24..28].copy_from_slice(&std::process::id().to_be_bytes());
    bytes
}

fn claim(lease: Duration) -> Claim {
    Claim::new(Fingerprint::from_bytes([1; 32]), lease, None)
}

fn record(lease: &Lease, body: &'static str) -> Arc<Record> {
    Arc::new(Record::new(
        Fingerprint::from_bytes([1; 32]),
        lease.first_seen,
        None,
        None,
        Some(Payload::new(
            PayloadFormat::HTTP,
            201,
            Bytes::from_static(HEAD),
            Bytes::from_static(body.as_bytes()),
        )),
    ))
}

const LONG: Duration = Duration::from_secs(60);
const SHORT: Duration = Duration::from_millis(300);

async fn claimed<St: IdempotencyStore>(store: &St, scope: &ScopeKey, lease: Duration) -> Lease {
    match store.begin(scope, claim(lease)).await.unwrap() {
        Begin::Claimed { lease } => lease,
        other => panic!("expected a claim, got {other:?}"),
    }
}

/// The head of every payload the contract stores: opaque bytes, given back as they
/// were.
const HEAD: &[u8] = b"\x01\x05x-run\x011";

/// The body of a completed record, once its payload's format, status and head are
/// checked to be given back unchanged.
fn body_of(begin: &Begin) -> Option<Bytes> {
    match begin {
        Begin::Completed { record, .. } => record.payload.as_ref().map(payload_body),
        _ => None,
    }
}

fn payload_body(payload: &Payload) -> Bytes {
    assert_eq!(payload.format(), PayloadFormat::HTTP);
    assert_eq!(payload.status(), 201);
    assert_eq!(payload.head().as_ref(), HEAD);
    payload.body().clone()
}

/// Runs every case of the contract against `store`, each on scopes of its own, and
/// panics at the first the store breaks, naming it. Call it from a test running on
/// tokio's multi-threaded or current-thread runtime.
pub async fn keeps_the_store_contract<St: IdempotencyStore>(store: Arc<St>) {
    one_of_concurrent_begins_claims(&store).await;
    a_completed_scope_replays_and_counts(&store).await;
    completing_twice_is_completing_once(&store).await;
    a_stranger_settles_nothing(&store).await;
    renewal_keeps_a_claim_past_its_lease(&store).await;
    a_lapsed_claim_is_taken_over_and_its_worker_fenced(&store).await;
    a_late_outcome_yields_to_a_record_never_to_a_claim(&store).await;
    a_released_scope_is_claimed_again(&store).await;
    a_late_outcome_after_a_lapse_is_stored_without_its_claim(&store).await;
    renewal_restores_a_lapsed_claim_no_one_took(&store).await;
    waits_end_in_every_way(&store).await;
    a_record_expires_after_its_ttl(&store).await;
}

async fn one_of_concurrent_begins_claims<St: IdempotencyStore>(store: &Arc<St>) {
    let scope = scope(1);
    let begins: Vec<_> = (0..32)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move { store.begin(&scope, claim(LONG)).await.unwrap() })
        })
        .collect();
    let (mut claims, mut counts) = (0, Vec::new());
    for begin in begins {
        match begin.await.unwrap() {
            Begin::Claimed { .. } => claims += 1,
            Begin::InFlight { request_count, .. } => counts.push(request_count),
            other => panic!("nothing completed yet: {other:?}"),
        }
    }
    counts.sort_unstable();
    assert_eq!(claims, 1, "exactly one claim");
    assert_eq!(
        counts,
        (2..=32).collect::<Vec<u64>>(),
        "each request counted once"
    );
}

async fn a_completed_scope_replays_and_counts<St: IdempotencyStore>(store: &Arc<St>) {
    let scope = scope(2);
    let lease = claimed(&**store, &scope, LONG).await;
    let completion = store
        .complete(&scope, &lease, record(&lease, "one"), LONG)
        .await
        .unwrap();
    assert_eq!(completion, Completion::Stored);
    let begin = store.begin(&scope, claim(LONG)).await.unwrap();
    assert_eq!(body_of(&begin).as_deref(), Some(&b"one"[..]));
    let Begin::Completed { request_count, .. } = begin else {
        unreachable!()
    };
    assert_eq!(request_count, 2, "the claim and this duplicate");
}

async fn completing_twice_is_completing_once<St: IdempotencyStore>(store: &Arc<St>) {
    let scope = scope(3);
    let lease = claimed(&**store, &scope, LONG).await;
    for _ in 0..2 {
        let completion = store
            .complete(&scope, &lease, record(&lease, "once"), LONG)
            .await
            .unwrap();
        assert_eq!(
            completion,
            Completion::Stored,
            "a repeated completion is a no-op"
        );
    }
    assert_eq!(
        store.renew(&scope, &lease, &claim(LONG)).await.unwrap(),
        Renewal::Lost,
        "a completed claim is not renewed back"
    );
}

async fn a_stranger_settles_nothing<St: IdempotencyStore>(store: &Arc<St>) {
    let scope = scope(4);
    let lease = claimed(&**store, &scope, LONG).await;
    let stranger = Lease::new(lease.token ^ 0xdead_beef, lease.first_seen);
    assert!(!store.release(&scope, &stranger).await.unwrap());
    assert_eq!(
        store.renew(&scope, &stranger, &claim(LONG)).await.unwrap(),
        Renewal::Lost
    );
    assert_eq!(
        store
            .complete(&scope, &stranger, record(&stranger, "stranger"), LONG)
            .await
            .unwrap(),
        Completion::ClaimedByAnother,
        "a claim holds the scope: not stored now, to be tried again"
    );
    assert!(matches!(
        store.begin(&scope, claim(LONG)).await.unwrap(),
        Begin::InFlight { .. }
    ));
}

async fn renewal_keeps_a_claim_past_its_lease<St: IdempotencyStore>(store: &Arc<St>) {
    let scope = scope(5);
    let lease = claimed(&**store, &scope, SHORT).await;
    for _ in 0..4 {
        tokio::time::sleep(SHORT / 2).await;
        assert_eq!(
            store.renew(&scope, &lease, &claim(SHORT)).await.unwrap(),
            Renewal::Extended
        );
    }
    // Twice the lease has passed since the claim.
    assert!(
        matches!(
            store.begin(&scope, claim(SHORT)).await.unwrap(),
            Begin::InFlight { .. }
        ),
        "a renewed claim still holds"
    );
}

async fn a_lapsed_claim_is_taken_over_and_its_worker_fenced<St: IdempotencyStore>(store: &Arc<St>) {
    let scope = scope(6);
    let stale = claimed(&**store, &scope, SHORT).await;
    tokio::time::sleep(SHORT + SHORT / 2).await;
    let fresh = claimed(&**store, &scope, LONG).await;
    assert_ne!(stale.token, fresh.token);
    assert_eq!(
        store.renew(&scope, &stale, &claim(SHORT)).await.unwrap(),
        Renewal::Lost
    );
    assert_eq!(
        store
            .complete(&scope, &fresh, record(&fresh, "fresh"), LONG)
            .await
            .unwrap(),
        Completion::Stored
    );
    assert_eq!(
        store
            .complete(&scope, &stale, record(&stale, "stale"), LONG)
            .await
            .unwrap(),
        Completion::Superseded,
        "the stale worker cannot overwrite"
    );
    let begin = store.begin(&scope, claim(LONG)).await.unwrap();
    assert_eq!(body_of(&begin).as_deref(), Some(&b"fresh"[..]));
}

/// A worker's claim lapses, another request claims the scope and gives it up without
/// running (its own store call failed): the first worker's outcome, which met that
/// claim, is stored once it is gone, and is what answers the next request. Once a
/// record holds the scope, a late outcome is dropped.
async fn a_late_outcome_yields_to_a_record_never_to_a_claim<St: IdempotencyStore>(store: &Arc<St>) {
    let (scope, recorded) = (scope(14), scope(15));
    let late = claimed(&**store, &scope, SHORT).await;
    tokio::time::sleep(SHORT + SHORT / 2).await;
    let retry = claimed(&**store, &scope, LONG).await;
    assert_eq!(
        store
            .complete(&scope, &late, record(&late, "late"), LONG)
            .await
            .unwrap(),
        Completion::ClaimedByAnother,
        "another claim holds the scope: try again once it is settled"
    );
    assert!(store.release(&scope, &retry).await.unwrap());
    assert!(
        store
            .complete(&scope, &late, record(&late, "late"), LONG)
            .await
            .unwrap()
            .is_stored(),
        "the claim was released without running: the late outcome is stored"
    );
    let begin = store.begin(&scope, claim(LONG)).await.unwrap();
    assert_eq!(body_of(&begin).as_deref(), Some(&b"late"[..]));

    // And a record, unlike a claim, is final.
    let scope = recorded;
    let late = claimed(&**store, &scope, SHORT).await;
    tokio::time::sleep(SHORT + SHORT / 2).await;
    let other = claimed(&**store, &scope, LONG).await;
    store
        .complete(&scope, &other, record(&other, "other"), LONG)
        .await
        .unwrap();
    assert_eq!(
        store
            .complete(&scope, &late, record(&late, "late"), LONG)
            .await
            .unwrap(),
        Completion::Superseded
    );
    let begin = store.begin(&scope, claim(LONG)).await.unwrap();
    assert_eq!(body_of(&begin).as_deref(), Some(&b"other"[..]));
}

async fn a_released_scope_is_claimed_again<St: IdempotencyStore>(store: &Arc<St>) {
    let scope = scope(7);
    let lease = claimed(&**store, &scope, LONG).await;
    assert!(store.release(&scope, &lease).await.unwrap());
    assert!(
        !store.release(&scope, &lease).await.unwrap(),
        "released once"
    );
    let again = claimed(&**store, &scope, LONG).await;
    assert_ne!(again.token, lease.token);
}

async fn a_late_outcome_after_a_lapse_is_stored_without_its_claim<St: IdempotencyStore>(
    store: &Arc<St>,
) {
    let scope = scope(8);
    let lease = claimed(&**store, &scope, SHORT).await;
    tokio::time::sleep(SHORT + SHORT / 2).await;
    assert_eq!(
        store
            .complete(&scope, &lease, record(&lease, "late"), LONG)
            .await
            .unwrap(),
        Completion::StoredWithoutClaim,
        "no one took the scope: the outcome keeps it from running again"
    );
    let begin = store.begin(&scope, claim(LONG)).await.unwrap();
    assert_eq!(body_of(&begin).as_deref(), Some(&b"late"[..]));
}

async fn renewal_restores_a_lapsed_claim_no_one_took<St: IdempotencyStore>(store: &Arc<St>) {
    let scope = scope(9);
    let lease = claimed(&**store, &scope, SHORT).await;
    tokio::time::sleep(SHORT + SHORT / 2).await;
    assert_eq!(
        store.renew(&scope, &lease, &claim(LONG)).await.unwrap(),
        Renewal::Restored
    );
    assert!(matches!(
        store.begin(&scope, claim(LONG)).await.unwrap(),
        Begin::InFlight { .. }
    ));
    assert_eq!(
        store
            .complete(&scope, &lease, record(&lease, "restored"), LONG)
            .await
            .unwrap(),
        Completion::Stored
    );
}

async fn waits_end_in_every_way<St: IdempotencyStore>(store: &Arc<St>) {
    // Completed while waiting.
    let scope_done = scope(10);
    let lease = claimed(&**store, &scope_done, LONG).await;
    let waiter = {
        let store = store.clone();
        tokio::spawn(async move { store.wait(&scope_done, Duration::from_secs(5)).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    store
        .complete(&scope_done, &lease, record(&lease, "waited"), LONG)
        .await
        .unwrap();
    match waiter.await.unwrap().unwrap() {
        Waited::Completed { record, .. } => {
            assert_eq!(payload_body(record.payload.as_ref().unwrap()), "waited")
        }
        other => panic!("expected the record, got {other:?}"),
    }

    // Released while waiting.
    let scope_released = scope(11);
    let lease = claimed(&**store, &scope_released, LONG).await;
    let waiter = {
        let store = store.clone();
        tokio::spawn(async move { store.wait(&scope_released, Duration::from_secs(5)).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    store.release(&scope_released, &lease).await.unwrap();
    assert!(matches!(waiter.await.unwrap().unwrap(), Waited::Released));

    // Still running at the deadline.
    let scope_running = scope(12);
    claimed(&**store, &scope_running, LONG).await;
    assert!(matches!(
        store
            .wait(&scope_running, Duration::from_millis(100))
            .await
            .unwrap(),
        Waited::TimedOut
    ));
}

async fn a_record_expires_after_its_ttl<St: IdempotencyStore>(store: &Arc<St>) {
    let scope = scope(13);
    let lease = claimed(&**store, &scope, LONG).await;
    store
        .complete(&scope, &lease, record(&lease, "brief"), SHORT)
        .await
        .unwrap();
    assert!(matches!(
        store.begin(&scope, claim(LONG)).await.unwrap(),
        Begin::Completed { .. }
    ));
    tokio::time::sleep(SHORT + SHORT / 2).await;
    assert!(
        matches!(
            store.begin(&scope, claim(LONG)).await.unwrap(),
            Begin::Claimed { .. }
        ),
        "an expired key runs again"
    );
}
