//! The demo service on a six-node Redis Cluster made by the test, as the example's
//! README runs it: two replicas started with `--redis-cluster-url` (three seeds) and
//! `--redis-wait-replicas 1`; a command sent to one is replayed by the other.

use tower_ids_test_support::redis_cluster as cluster_server;
#[path = "demo.rs"]
mod demo;
use tower_ids_test_support as support;

use cluster_server::RedisCluster;
use demo::Demo;
use http::StatusCode;
use support::{client, send};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_demo_replicas_on_a_redis_cluster_replay_each_other() {
    let Some(cluster) = RedisCluster::start() else {
        return;
    };
    let urls = cluster.urls();
    let mut args = Vec::new();
    for url in &urls[..3] {
        args.extend(["--redis-cluster-url", url.as_str()]);
    }
    args.extend(["--redis-wait-replicas", "1"]);
    let a = Demo::start(&args);
    let b = Demo::start(&args);
    let stored = a.events("commands.store").await;
    assert_eq!(stored[0]["fields"]["store"], "redis", "{stored:?}");

    let client = client();
    let body =
        r#"{"device_id":"thermostat-42","name":"set_temperature","payload":{"celsius":21.5}}"#;
    let headers = |attempt| {
        [
            ("content-type", "application/json"),
            ("x-api-key", "demo-client"),
            ("idempotency-key", "cluster-1"),
            ("attempt-id", attempt),
        ]
    };
    let url = |demo: &Demo| format!("{}/commands", demo.url);
    let first = send(&client, "POST", url(&a), &headers("a1"), body).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());
    assert_eq!(first.header("idempotent-replayed"), Some("false"));
    let replay = send(&client, "POST", url(&b), &headers("a2"), body).await;
    assert_eq!(replay.status, StatusCode::CREATED, "{}", replay.text());
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.header("original-attempt-id"), Some("a1"));
    assert_eq!(replay.header("idempotency-request-count"), Some("2"));
    assert_eq!(replay.body, first.body, "the same command, byte for byte");
    assert_eq!(
        cluster.keys("tower-ids:idem:*:r").len(),
        1,
        "one record in the cluster"
    );
}
