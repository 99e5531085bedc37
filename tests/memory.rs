//! What a stored entry really costs, counted by a global allocator, against the weight
//! the moka store charges for it (`MOKA_ENTRY_OVERHEAD_BYTES` plus the response bytes).

use std::{
    alloc::System,
    sync::Arc,
    time::{Duration, SystemTime},
};

use bytes::Bytes;
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};
use tower_ids::idempotency::{
    store::Fingerprint,
    store::ScopeKey,
    store::{Begin, Claim, IdempotencyStore, Payload, PayloadFormat, Record},
    IdempotencyKey, MokaStore,
};
// The weight the store charges per entry, which its docs give (832 bytes).
use tower_ids_moka::MOKA_ENTRY_OVERHEAD_BYTES;

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const ENTRIES: usize = 5_000;

/// Stores `ENTRIES` completed records whose responses hold `body` and two headers, and
/// returns the live bytes per entry beyond the response's weight, and that weight.
async fn overhead_per_entry(store: &MokaStore, body: &Bytes) -> (f64, usize) {
    // Two headers as the HTTP layer encodes them (`content-type: application/json`,
    // `x-run: 1`); each record its own copy, as each response's would be.
    let head: &[u8] = b"\x02\x0ccontent-type\x10application/json\x05x-run\x011";
    let payload =
        |body: Bytes| Payload::new(PayloadFormat::HTTP, 201, Bytes::copy_from_slice(head), body);
    let response_bytes = payload(body.clone()).weight();
    let fingerprint = Fingerprint::new("POST", "/commands", None, None, b"");
    let region = Region::new(GLOBAL);
    for i in 0..ENTRIES {
        let key = IdempotencyKey::parse(format!("key-{i}").as_bytes()).unwrap();
        let scope = ScopeKey::new("http", &["POST", "/commands"], None, &key);
        let claim = Claim::new(fingerprint, Duration::from_secs(60), None);
        let Begin::Claimed { lease } = store.begin(&scope, claim).await.unwrap() else {
            panic!("a fresh key is claimed");
        };
        // Each record its own copy of the body, as each response would be.
        let record = Record::new(
            fingerprint,
            SystemTime::now(),
            None,
            None,
            Some(payload(Bytes::copy_from_slice(body))),
        );
        assert!(store
            .complete(&scope, &lease, Arc::new(record), Duration::from_secs(3600))
            .await
            .unwrap()
            .is_stored());
    }
    store.run_pending_tasks().await;
    let change = region.change();
    assert_eq!(store.entry_count(), ENTRIES as u64, "nothing evicted");
    let live = change.bytes_allocated as isize - change.bytes_deallocated as isize
        + change.bytes_reallocated;
    let per_entry = live as f64 / ENTRIES as f64;
    (per_entry - response_bytes as f64, response_bytes)
}

/// One test for both counts: the allocator counts every thread, so two tests running
/// at once would count each other.
#[tokio::test]
async fn what_stored_records_and_requests_in_flight_cost() {
    stored_records_cost_no_more_than_charged().await;
    records_the_layer_makes_cost_no_more_than_charged().await;
    a_request_in_flight_costs_under_a_kibibyte().await;
}

async fn a_request_in_flight_costs_under_a_kibibyte() {
    let store = MokaStore::new();
    let fingerprint = Fingerprint::new("POST", "/commands", None, None, b"");
    let mut leases = Vec::with_capacity(ENTRIES);
    let region = Region::new(GLOBAL);
    for i in 0..ENTRIES {
        let key = IdempotencyKey::parse(format!("flight-{i}").as_bytes()).unwrap();
        let scope = ScopeKey::new("http", &["POST", "/commands"], None, &key);
        let claim = Claim::new(fingerprint, Duration::from_secs(60), None);
        leases.push(store.begin(&scope, claim).await.unwrap());
    }
    let change = region.change();
    let live = change.bytes_allocated as isize - change.bytes_deallocated as isize
        + change.bytes_reallocated;
    // Less the vector of answers this test keeps.
    let kept = (leases.capacity() * std::mem::size_of::<Begin>()) as isize;
    let per_claim = (live - kept) as f64 / ENTRIES as f64;
    println!("memory: {per_claim:.0} bytes per request in flight");
    assert!(per_claim < 1024.0, "a claim costs {per_claim:.0} bytes");
}

async fn stored_records_cost_no_more_than_charged() {
    for size in [0usize, 1024] {
        let store = MokaStore::new();
        let body = Bytes::from(vec![b'x'; size]);
        let (overhead, response_bytes) = overhead_per_entry(&store, &body).await;
        println!(
            "memory: body of {size} bytes, response weight {response_bytes}: {overhead:.0} bytes of overhead per entry (charged {MOKA_ENTRY_OVERHEAD_BYTES})"
        );
        assert!(
            overhead <= MOKA_ENTRY_OVERHEAD_BYTES as f64,
            "an entry costs {overhead:.0} bytes beyond its response, more than the {MOKA_ENTRY_OVERHEAD_BYTES} charged"
        );
    }
}

/// The records the HTTP layer itself makes (a response it keeps decoded beside its
/// payload, so that a replay decodes nothing) are weighed with what they hold: the
/// bytes they leave allocated stay within what the store charges for them.
async fn records_the_layer_makes_cost_no_more_than_charged() {
    use http::{Request, Response};
    use http_body_util::{BodyExt, Full};
    use tower::{service_fn, Layer, ServiceExt};
    use tower_ids::idempotency::IdempotencyLayer;

    let store = MokaStore::new();
    let handler = service_fn(|_request: Request<_>| async {
        let response = Response::builder()
            .status(201)
            .header("content-type", "application/json")
            .header("x-run", "1")
            .body(Full::new(Bytes::from(vec![b'x'; 1024])))
            .unwrap();
        Ok::<_, std::convert::Infallible>(response)
    });
    let service = IdempotencyLayer::with_store(store.clone()).layer(handler);
    let send = |n: usize| {
        let request = Request::post("/commands")
            .header("idempotency-key", format!("layer-{n}"))
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap();
        let service = service.clone();
        async move {
            let response = service.oneshot(request).await.unwrap();
            assert_eq!(response.status(), 201);
            response.into_body().collect().await.unwrap();
        }
    };
    // The layer's and the store's lazily built state, before anything is counted.
    for n in 0..100 {
        send(n).await;
    }
    store.run_pending_tasks().await;
    let charged_before = store.weighted_bytes();
    let region = Region::new(GLOBAL);
    for n in 100..100 + ENTRIES {
        send(n).await;
    }
    store.run_pending_tasks().await;
    let change = region.change();
    let live = change.bytes_allocated as isize - change.bytes_deallocated as isize
        + change.bytes_reallocated;
    let per_entry = live as f64 / ENTRIES as f64;
    let charged = (store.weighted_bytes() - charged_before) as f64 / ENTRIES as f64;
    println!(
        "memory: a record the layer made leaves {per_entry:.0} bytes allocated, charged {charged:.0}"
    );
    assert!(
        per_entry <= charged,
        "a record the layer made costs {per_entry:.0} bytes, more than the {charged:.0} charged"
    );
}
