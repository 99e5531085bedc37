//! The requests to `serve`: [`REQUESTS`] of [`PER_REQUEST`] payments each, [`CONCURRENCY`]
//! at once, each tried until it is answered `201` and then sent again with its key, which
//! must replay the same `201`; what was sent is kept to check the databases against.

use std::{
    collections::{BTreeMap, HashMap},
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use http::StatusCode;
use serde_json::json;

use crate::{support, ACCOUNTS, ATTEMPTS, CONCURRENCY, PER_REQUEST, REQUESTS};

/// What the requests sent.
#[derive(Default)]
pub(crate) struct Sent {
    /// Every payment's key, with its account and amount.
    pub(crate) payments: HashMap<String, (String, i64)>,
    /// Retries that replayed the `201`.
    pub(crate) replayed: usize,
    /// Answers other than `201` (tried again), by status; connection errors as `0`.
    pub(crate) refused: BTreeMap<u16, usize>,
}

/// Sends [`REQUESTS`] requests, [`CONCURRENCY`] at once; each until it is answered
/// `201`, then once more with its key, which must replay the same `201`.
pub(crate) async fn send_requests(url: &str) -> Sent {
    let client = support::client();
    let next = Arc::new(AtomicUsize::new(0));
    let sent = Arc::new(Mutex::new(Sent::default()));
    let run = uuid::Uuid::now_v7();
    let workers: Vec<_> = (0..CONCURRENCY)
        .map(|_| {
            let (client, next, sent) = (client.clone(), next.clone(), sent.clone());
            let url = format!("{url}/payments");
            tokio::spawn(async move {
                loop {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    if n >= REQUESTS {
                        return;
                    }
                    let payments: Vec<(String, i64)> = (0..PER_REQUEST)
                        .map(|_| {
                            (
                                format!("acct-{}", rand::random_range(0..ACCOUNTS)),
                                rand::random_range(1..=100_000_i64),
                            )
                        })
                        .collect();
                    let body = json!({
                        "payments": payments
                            .iter()
                            .map(|(account, amount)| json!({"account": account, "amount": amount}))
                            .collect::<Vec<_>>(),
                    })
                    .to_string();
                    let key = format!("req-{run}-{n}");
                    let headers = [
                        ("idempotency-key", key.as_str()),
                        ("content-type", "application/json"),
                    ];
                    let mut created = None;
                    for _ in 0..ATTEMPTS {
                        match support::try_send(&client, "POST", url.clone(), &headers, &body).await
                        {
                            Ok(reply) if reply.status == StatusCode::CREATED => {
                                created = Some(reply);
                                break;
                            }
                            Ok(reply) => {
                                *sent
                                    .lock()
                                    .unwrap()
                                    .refused
                                    .entry(reply.status.as_u16())
                                    .or_default() += 1;
                            }
                            Err(_) => {
                                *sent.lock().unwrap().refused.entry(0).or_default() += 1;
                            }
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    let created = created
                        .unwrap_or_else(|| panic!("request {n}: no 201 in {ATTEMPTS} tries"));
                    let again = support::send(&client, "POST", url.clone(), &headers, &body).await;
                    assert!(
                        again.replayed_created() && again.body == created.body,
                        "request {n}: its retry replays the same 201: {again:?}"
                    );
                    let keys = created.json()["keys"].clone();
                    let keys: Vec<String> = serde_json::from_value(keys).unwrap();
                    assert_eq!(keys.len(), PER_REQUEST);
                    let mut sent = sent.lock().unwrap();
                    sent.replayed += 1;
                    for (key, payment) in keys.into_iter().zip(payments) {
                        assert!(sent.payments.insert(key, payment).is_none(), "a key twice");
                    }
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }
    Arc::try_unwrap(sent)
        .ok()
        .expect("the workers are done")
        .into_inner()
        .unwrap()
}
