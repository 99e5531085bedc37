//! The planner's webhook dispatch: each event of an executor's feed POSTed to its
//! webhook, serialised per (executor, warehouse): the next event of a warehouse is not
//! delivered until the previous one was acknowledged (`2xx`) or dead-lettered after its
//! attempts. Lanes of other warehouses go on meanwhile.

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
    time::Duration,
};

use tokio::sync::Mutex;

use serde_json::json;

use crate::db::{DispatchEvent, PlannerDb};

/// How webhooks are delivered.
pub(crate) struct Delivery {
    /// Each executor's webhook base URL.
    pub(crate) urls: HashMap<String, String>,
    pub(crate) token: String,
    /// Attempts per event before it is dead-lettered.
    pub(crate) attempts: u32,
    /// The pause after the first failed attempt, doubled after each.
    pub(crate) backoff: Duration,
}

/// Runs the dispatcher for as long as the process runs.
pub(crate) fn spawn(db: PlannerDb, delivery: Delivery) {
    let delivery = Arc::new(delivery);
    let executors: Vec<String> = delivery.urls.keys().cloned().collect();
    // The lanes with a delivery under way: their next event waits. Held while the
    // heads are read, so a delivery that settles meanwhile is not read as pending.
    let busy: Arc<Mutex<HashSet<(String, String)>>> = Arc::default();
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("a plain HTTP client");
    tokio::spawn(async move {
        loop {
            let mut lanes = busy.lock().await;
            match db.webhook_heads(&executors).await {
                Ok(heads) => {
                    for (executor, event) in heads {
                        let lane = (executor.clone(), event.warehouse_frn.clone());
                        if !lanes.insert(lane.clone()) {
                            continue;
                        }
                        let (db, client, delivery, busy) =
                            (db.clone(), client.clone(), delivery.clone(), busy.clone());
                        tokio::spawn(async move {
                            deliver(&db, &client, &delivery, &executor, &event).await;
                            busy.lock().await.remove(&lane);
                        });
                    }
                }
                Err(problem) => {
                    tracing::warn!(
                        event = "partner.webhook_lanes_failed",
                        ?problem,
                        "reading the lanes failed"
                    );
                }
            }
            drop(lanes);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
}

/// Delivers one event, retrying with backoff, then settles it: delivered, or
/// dead-lettered with its last error. The executor keeps webhooks 24 hours by
/// `(planner_id, correlation_id)`, so a delivery repeated after a crash is replayed
/// there, not handled twice.
async fn deliver(
    db: &PlannerDb,
    client: &reqwest::Client,
    delivery: &Delivery,
    executor: &str,
    event: &DispatchEvent,
) {
    let url = format!("{}/wes/v1/webhooks/dispatch", delivery.urls[executor]);
    let body = json!({
        "planner_id": event.planner_id,
        "correlation_id": event.correlation_id,
        "warehouse_frn": event.warehouse_frn,
        "movement_id": event.movement_id,
    })
    .to_string();
    let mut pause = delivery.backoff;
    let mut error = String::new();
    for attempt in 1..=delivery.attempts {
        let sent = client
            .post(&url)
            .bearer_auth(&delivery.token)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(body.clone())
            .send()
            .await;
        match sent {
            Ok(answer) if answer.status().is_success() => {
                tracing::info!(
                    event = "partner.webhook_delivered",
                    seq = event.seq,
                    attempt,
                    status = answer.status().as_u16(),
                    "webhook delivered"
                );
                settle(db, event.seq, None).await;
                return;
            }
            Ok(answer) => error = format!("the executor answered {}", answer.status()),
            Err(failed) => error = format!("the executor could not be reached: {failed}"),
        }
        tracing::warn!(event = "partner.webhook_failed", seq = event.seq, attempt, error = %error, "webhook not delivered");
        if attempt < delivery.attempts {
            tokio::time::sleep(pause).await;
            pause *= 2;
        }
    }
    tracing::warn!(event = "partner.webhook_dead_lettered", seq = event.seq, error = %error, "webhook dead-lettered");
    settle(db, event.seq, Some(error)).await;
}

/// Records the outcome, retrying until the database takes it: until then the lane
/// stays busy, so its next event waits.
async fn settle(db: &PlannerDb, seq: i64, error: Option<String>) {
    while db.webhook_settled(seq, error.clone()).await.is_err() {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
