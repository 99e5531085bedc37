//! The store's unit tests: claims under contention, fencing by the lease's token,
//! and eviction (what a full store drops, keeps and sweeps).

use super::{shard::SWEEP_SCOPES_AT, *};
use tower_ids_core::{Fingerprint, IdempotencyKey};

fn scope(key: &str) -> ScopeKey {
    let key = IdempotencyKey::parse(key.as_bytes()).unwrap();
    ScopeKey::new("http", &["POST", "/"], None, &key)
}

fn claim() -> Claim {
    Claim::new(
        Fingerprint::new("POST", "/", None, None, b""),
        Duration::from_secs(60),
        None,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_concurrent_begins_exactly_one_claims() {
    let store = MokaStore::new();
    let begins: Vec<_> = (0..64)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move { store.begin(&scope("k"), claim()).await.unwrap() })
        })
        .collect();
    let mut claimed = 0;
    let mut counts = Vec::new();
    for begin in begins {
        match begin.await.unwrap() {
            Begin::Claimed { .. } => claimed += 1,
            Begin::InFlight { request_count, .. } => counts.push(request_count),
            other => panic!("nothing was completed, and moka claims with leases: {other:?}"),
        }
    }
    assert_eq!(claimed, 1);
    counts.sort_unstable();
    assert_eq!(
        counts,
        (2..=64).collect::<Vec<u64>>(),
        "every request counted once"
    );
}

#[tokio::test]
async fn only_the_lease_holder_settles() {
    let store = MokaStore::new();
    let Begin::Claimed { lease } = store.begin(&scope("k"), claim()).await.unwrap() else {
        panic!("claimed");
    };
    let stranger = Lease::new(lease.token + 1000, lease.first_seen);
    let record = Arc::new(Record::new(
        claim().fingerprint,
        lease.first_seen,
        None,
        None,
        None,
    ));
    let ttl = Duration::from_secs(60);
    assert!(!store.release(&scope("k"), &stranger).await.unwrap());
    assert_eq!(
        store
            .complete(&scope("k"), &stranger, record.clone(), ttl)
            .await
            .unwrap(),
        Completion::ClaimedByAnother
    );
    assert_eq!(
        store.renew(&scope("k"), &stranger, &claim()).await.unwrap(),
        Renewal::Lost
    );
    assert!(store.release(&scope("k"), &lease).await.unwrap());
    // Released and not taken: a late outcome is still stored, so its key never
    // runs again.
    assert_eq!(
        store
            .complete(&scope("k"), &lease, record.clone(), ttl)
            .await
            .unwrap(),
        Completion::StoredWithoutClaim
    );
    assert_eq!(
        store
            .complete(&scope("k"), &lease, record, ttl)
            .await
            .unwrap(),
        Completion::Stored,
        "completing again is completing once"
    );
    assert!(matches!(
        store.begin(&scope("k"), claim()).await.unwrap(),
        Begin::Completed { .. }
    ));
}

// Eviction.

async fn store_one(store: &MokaStore, key: &str) {
    let claim = Claim::new(
        Fingerprint::new("POST", "/", None, None, b""),
        Duration::from_secs(60),
        None,
    );
    let Begin::Claimed { lease } = store.begin(&scope(key), claim.clone()).await.unwrap() else {
        panic!("{key} is new");
    };
    let record = Record::new(claim.fingerprint, lease.first_seen, None, None, None);
    let ttl = Duration::from_secs(3600);
    assert!(store
        .complete(&scope(key), &lease, Arc::new(record), ttl)
        .await
        .unwrap()
        .is_stored());
}

fn slots(store: &MokaStore) -> usize {
    store
        .shards
        .iter()
        .map(|shard| shard.lock().unwrap().scopes.len())
        .sum()
}

/// A store with room for about `room` records, after `stored` were stored.
async fn overfilled(room: usize, stored: usize) -> MokaStore {
    let store = MokaStore::builder()
        .max_bytes(room * MOKA_ENTRY_OVERHEAD_BYTES)
        .build();
    for i in 0..stored {
        store_one(&store, &format!("key-{i}")).await;
    }
    store.run_pending_tasks().await;
    store
}

#[tokio::test]
async fn an_evicted_record_is_gone_and_its_key_runs_again() {
    let store = overfilled(100, 300).await;

    assert!(store.entry_count() <= 100, "{}", store.entry_count());
    let claim = Claim::new(
        Fingerprint::new("POST", "/", None, None, b""),
        Duration::from_secs(60),
        None,
    );
    assert!(matches!(
        store.begin(&scope("key-0"), claim).await.unwrap(),
        Begin::Claimed { .. }
    ));
}

#[tokio::test]
async fn the_slots_of_evicted_records_are_swept() {
    let store = overfilled(1_000, 20_000).await;
    let live = usize::try_from(store.entry_count()).unwrap();
    assert!(live <= 1_000, "{live}");
    let slots = slots(&store);
    assert!(
        slots <= live + live / 2 + SHARDS * SWEEP_SCOPES_AT,
        "{slots} slots for {live} records"
    );
}

#[tokio::test]
async fn a_full_store_keeps_the_newest_record_for_its_retry() {
    // Room for about 100 records.
    let store = MokaStore::builder()
        .max_bytes(100 * MOKA_ENTRY_OVERHEAD_BYTES)
        .build();
    for i in 0..100 {
        store_one(&store, &format!("old-{i}")).await;
    }
    // The old records are popular: each retried twice.
    for _ in 0..2 {
        for i in 0..100 {
            let claim = Claim::new(
                Fingerprint::new("POST", "/", None, None, b""),
                Duration::from_secs(60),
                None,
            );
            store
                .begin(&scope(&format!("old-{i}")), claim)
                .await
                .unwrap();
        }
    }
    store_one(&store, "new").await;
    store.run_pending_tasks().await;

    let claim = Claim::new(
        Fingerprint::new("POST", "/", None, None, b""),
        Duration::from_secs(60),
        None,
    );
    let retry = store.begin(&scope("new"), claim).await.unwrap();
    assert!(
        matches!(retry, Begin::Completed { .. }),
        "the newest record was evicted before its retry: {retry:?}"
    );
    assert!(store.weighted_bytes() <= 100 * MOKA_ENTRY_OVERHEAD_BYTES);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keeps_the_store_contract() {
    tower_ids_core::store::contract::keeps_the_store_contract(Arc::new(MokaStore::new())).await;
}
