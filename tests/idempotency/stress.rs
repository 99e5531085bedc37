//! 1,000 concurrent requests over 100 keys from 10 clients.

use std::{collections::HashMap, sync::Arc, time::Duration};
use tower_ids::idempotency::Policy;

use http::HeaderName;
use tower_ids::idempotency::{ClientFromHeader, IdempotencyLayer, InFlight};

use crate::{start, BODY};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_client_and_key_runs_exactly_once_under_a_burst() {
    let layer = IdempotencyLayer::new()
        .client(ClientFromHeader::new(HeaderName::from_static("x-api-key")))
        .policy(Policy::new().in_flight(InFlight::Wait {
            timeout: Duration::from_secs(30),
        }))
        .unwrap();
    let app = Arc::new(start(layer).await);

    let mut tasks = Vec::new();
    for i in 0..1000 {
        let app = app.clone();
        let client = format!("client-{}", i % 10);
        let key = format!("key-{}", (i / 10) % 10);
        tasks.push(tokio::spawn(async move {
            let reply = app
                .post(
                    "/commands",
                    &[
                        ("x-api-key", &client),
                        ("idempotency-key", &key),
                        ("x-delay-ms", "20"),
                    ],
                    BODY,
                )
                .await;
            (client, key, reply)
        }));
    }
    let mut seen: HashMap<(String, String), Vec<super::Reply>> = HashMap::new();
    for task in tasks {
        let (client, key, reply) = task.await.unwrap();
        seen.entry((client, key)).or_default().push(reply);
    }

    assert_eq!(seen.len(), 100, "10 clients x 10 keys");
    assert_eq!(app.runs.get(), 100, "each (client, key) ran exactly once");
    for ((client, key), replies) in &seen {
        assert_eq!(replies.len(), 10);
        let first = &replies[0];
        for reply in replies {
            assert_eq!(
                reply.status,
                http::StatusCode::CREATED,
                "{client} {key}: {}",
                reply.text()
            );
            assert_eq!(
                reply.body, first.body,
                "{client} {key}: every response identical"
            );
            assert_eq!(reply.header("x-run"), first.header("x-run"));
        }
        let replayed = replies
            .iter()
            .filter(|r| r.header("idempotent-replayed") == Some("true"))
            .count();
        assert_eq!(replayed, 9, "{client} {key}: one execution, nine replays");
    }
}
