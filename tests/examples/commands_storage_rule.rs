//! Which answers of the demo its idempotency layer keeps, tried through the `commands`
//! process as a client would (issue 35, item 6), in memory, on Redis and in DB mode:
//!
//! - a refusal of the handler's own is not stored (the layer's `StorageRule::Default`): after
//!   `422 body.invalid_fields` or `422 body.too_deep`, the corrected command under the
//!   same key runs, once, and its retry is a replay;
//! - a `500` after the handler's writes (`--fail-after-write-percent 100`) is stored in
//!   memory and on Redis, and replayed: the handler ran once, and the command it wrote
//!   stands. In DB mode the layer rolls the request's transaction back and releases the
//!   key instead: nothing stands, the retry runs again, and on a replica that does not
//!   fail it commits one command (one row in `commands`, one in `tower_ids_outbox`);
//! - a payload nested deeper than 32 levels is `422 body.too_deep`, and a `device_id`
//!   with U+0000 `422 body.invalid_fields`, whatever keeps the commands (32,000 levels
//!   were `201` in memory and `503 commands.database_unavailable` in DB mode, where
//!   PostgreSQL's `json` input ran out of stack; U+0000 was `201` in memory).
//!
//! The Redis test starts a `redis-server` of its own, the DB tests make a database of
//! their own on `TOWER_IDS_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`); without them they print `SKIPPED` and
//! pass, except in CI (`CI` set). The tests build the example first, so `cargo test
//! --all-features --test commands_storage_rule` runs alone.

#[cfg(feature = "postgres")]
use tower_ids_test_support::postgres as database;
#[path = "demo.rs"]
mod demo;
use tower_ids_test_support as support;
#[cfg(feature = "redis")]
use tower_ids_test_support::redis as server;

use demo::Demo;
use http::StatusCode;
use serde_json::Value;
use support::{client, send, Reply};

const COMMAND: &str =
    r#"{"device_id":"thermostat-42","name":"set_temperature","payload":{"celsius":21.5}}"#;

/// The demo's `MAX_PAYLOAD_DEPTH`.
const MAX_DEPTH: usize = 32;

async fn create(url: &str, key: &str, body: &str) -> Reply {
    send(
        &client(),
        "POST",
        format!("{url}/commands"),
        &[
            ("content-type", "application/json"),
            ("x-api-key", "storage-rule"),
            ("idempotency-key", key),
        ],
        body,
    )
    .await
}

/// A create body whose payload is `depth` arrays, one inside the other.
fn nested(depth: usize) -> String {
    format!(
        r#"{{"device_id":"d-deep","name":"deep","payload":{}{}}}"#,
        "[".repeat(depth),
        "]".repeat(depth)
    )
}

/// The start of a reply's body, for a failed assertion (a deep payload is 64 KB).
fn start(reply: &Reply) -> String {
    reply.text().chars().take(300).collect()
}

fn assert_problem(reply: &Reply, status: StatusCode, code: &str) {
    assert_eq!(reply.status, status, "{}", start(reply));
    assert_eq!(
        reply.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(reply.json()["code"], code, "{}", start(reply));
}

fn assert_ran(reply: &Reply, status: StatusCode) {
    assert_eq!(reply.status, status, "{}", start(reply));
    assert_eq!(reply.header("idempotent-replayed"), Some("false"));
}

fn assert_replays(reply: &Reply, first: &Reply) {
    assert_eq!(reply.status, first.status, "{}", start(reply));
    assert_eq!(reply.header("idempotent-replayed"), Some("true"));
    assert_eq!(reply.body, first.body, "the first answer, byte for byte");
}

/// The commands `GET /commands` lists.
async fn listed(url: &str) -> Vec<Value> {
    let reply = send(&client(), "GET", format!("{url}/commands"), &[], "").await;
    assert_eq!(reply.status, StatusCode::OK);
    reply.json().as_array().unwrap().clone()
}

/// Refusals of the handler, each followed by the corrected command under the same key:
/// each corrected command runs (a stored refusal would answer it `422
/// idempotency.fingerprint_mismatch`) and is replayed after that. Creates four commands.
async fn refusals_are_not_kept(url: &str) {
    // A field of the wrong type: serde's refusal, 422 body.invalid_fields.
    let invalid = r#"{"device_id":42,"name":"set_temperature","payload":{"celsius":21.5}}"#;
    let refused = create(url, "fix-1", invalid).await;
    assert_problem(
        &refused,
        StatusCode::UNPROCESSABLE_ENTITY,
        "body.invalid_fields",
    );
    assert_eq!(refused.header("idempotent-replayed"), Some("false"));
    // Sent again, it is refused again by the handler, not replayed.
    let again = create(url, "fix-1", invalid).await;
    assert_problem(
        &again,
        StatusCode::UNPROCESSABLE_ENTITY,
        "body.invalid_fields",
    );
    assert_eq!(again.header("idempotent-replayed"), Some("false"));
    let corrected = create(url, "fix-1", COMMAND).await;
    assert_ran(&corrected, StatusCode::CREATED);
    assert_replays(&create(url, "fix-1", COMMAND).await, &corrected);

    // Text PostgreSQL cannot hold: refused in every mode, before any write.
    let nul = r#"{"device_id":"a\u0000b","name":"reboot","payload":{}}"#;
    let refused = create(url, "nul-1", nul).await;
    assert_problem(
        &refused,
        StatusCode::UNPROCESSABLE_ENTITY,
        "body.invalid_fields",
    );
    assert_ran(&create(url, "nul-1", COMMAND).await, StatusCode::CREATED);

    // Too deep: refused in every mode, with no Retry-After (retrying will not help).
    for depth in [32_000, MAX_DEPTH + 1] {
        let deep = create(url, "deep-1", &nested(depth)).await;
        assert_problem(&deep, StatusCode::UNPROCESSABLE_ENTITY, "body.too_deep");
        assert_eq!(deep.header("idempotent-replayed"), Some("false"));
        assert_eq!(deep.header("retry-after"), None);
    }
    let deepest = create(url, "deep-1", &nested(MAX_DEPTH)).await;
    assert_ran(&deepest, StatusCode::CREATED);
    assert_eq!(
        deepest.json()["payload"].to_string(),
        format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH))
    );
    assert_replays(&create(url, "deep-1", &nested(MAX_DEPTH)).await, &deepest);

    // Brackets inside strings are text, not nesting.
    let text = format!(
        r#"{{"device_id":"d-text","name":"note","payload":{{"text":"{}\"{}"}}}}"#,
        "[".repeat(100),
        "{".repeat(100)
    );
    assert_ran(&create(url, "text-1", &text).await, StatusCode::CREATED);
}

#[tokio::test]
async fn in_memory_a_refusal_is_not_stored_and_the_corrected_command_runs_once() {
    let demo = Demo::start(&[]);
    refusals_are_not_kept(&demo.url).await;
    assert_eq!(listed(&demo.url).await.len(), 4, "one command per key");
}

/// With every handler failing after its writes (memory or Redis): the `500` is stored
/// and replayed, the handler ran once, and what it wrote stands.
async fn a_server_error_is_stored_and_replayed(demo: &Demo) {
    let failed = create(&demo.url, "fail-1", COMMAND).await;
    assert_problem(
        &failed,
        StatusCode::INTERNAL_SERVER_ERROR,
        "commands.failed_after_write",
    );
    assert_eq!(failed.header("idempotent-replayed"), Some("false"));
    let retried = create(&demo.url, "fail-1", COMMAND).await;
    assert_replays(&retried, &failed);

    let commands = listed(&demo.url).await;
    assert_eq!(commands.len(), 1, "the write stood: {commands:?}");
    assert_eq!(commands[0]["device_id"], "thermostat-42");
    assert_eq!(demo.outcomes("executed", 1).await.len(), 1);
    assert_eq!(demo.outcomes("replayed", 1).await.len(), 1);
    assert_eq!(
        demo.logged("commands.failed_after_write").len(),
        1,
        "the handler ran once"
    );
}

#[tokio::test]
async fn in_memory_a_500_after_the_writes_is_replayed_and_the_handler_runs_once() {
    let demo = Demo::start(&["--fail-after-write-percent", "100"]);
    a_server_error_is_stored_and_replayed(&demo).await;
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn on_redis_a_500_after_the_writes_is_replayed_and_the_handler_runs_once() {
    let Some(redis) = server::RedisServer::start() else {
        return;
    };
    let demo = Demo::start(&[
        "--redis-url",
        &redis.url(),
        "--fail-after-write-percent",
        "100",
    ]);
    let stored = demo.events("commands.store").await;
    assert_eq!(stored[0]["fields"]["store"], "redis");
    a_server_error_is_stored_and_replayed(&demo).await;
}

#[cfg(feature = "postgres")]
mod db_mode {
    use std::time::Duration;

    use sqlx::{PgPool, Row};

    use super::*;
    use crate::database::TestDatabase;

    /// Rows in `commands` and in the outbox (`tower_ids_outbox`).
    async fn rows(pool: &PgPool) -> (i64, i64) {
        let row = sqlx::query(
            "SELECT (SELECT count(*) FROM commands) AS commands, \
                    (SELECT count(*) FROM tower_ids_outbox) AS outbox",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        (row.get("commands"), row.get("outbox"))
    }

    #[tokio::test]
    async fn a_refusal_is_not_stored_and_the_corrected_command_runs_once() {
        let Some(database) = TestDatabase::create().await else {
            return;
        };
        let demo = Demo::start(&["--database-url", database.url()]);
        refusals_are_not_kept(&demo.url).await;

        let pool = database.pool(1).await;
        assert_eq!(
            rows(&pool).await,
            (4, 4),
            "one command and one event per key"
        );
        assert_eq!(listed(&demo.url).await.len(), 4);
        pool.close().await;
    }

    /// Two replicas on one database, A failing every `POST` after its writes, B none: A's
    /// `500` is rolled back and the key released, so A's retry runs again (and fails
    /// again), and B's runs and commits one command, which A then replays.
    #[tokio::test]
    async fn a_500_after_the_writes_is_rolled_back_and_the_retry_commits_one_command() {
        let Some(database) = TestDatabase::create().await else {
            return;
        };
        let failing = Demo::start(&[
            "--database-url",
            database.url(),
            "--fail-after-write-percent",
            "100",
        ]);
        let healthy = Demo::start(&["--database-url", database.url()]);
        let pool = database.pool(1).await;

        let failed = create(&failing.url, "fail-1", COMMAND).await;
        assert_problem(
            &failed,
            StatusCode::INTERNAL_SERVER_ERROR,
            "commands.failed_after_write",
        );
        assert_eq!(failed.header("idempotent-replayed"), Some("false"));
        assert_eq!(rows(&pool).await, (0, 0), "rolled back");

        let again = create(&failing.url, "fail-1", COMMAND).await;
        assert_problem(
            &again,
            StatusCode::INTERNAL_SERVER_ERROR,
            "commands.failed_after_write",
        );
        assert_eq!(
            again.header("idempotent-replayed"),
            Some("false"),
            "the key was released: the retry ran again"
        );
        assert_eq!(rows(&pool).await, (0, 0));

        let created = create(&healthy.url, "fail-1", COMMAND).await;
        assert_ran(&created, StatusCode::CREATED);
        assert_replays(&create(&failing.url, "fail-1", COMMAND).await, &created);
        assert_eq!(rows(&pool).await, (1, 1), "one command, one event");

        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(failing.logged("commands.failed_after_write").len(), 2);
        assert_eq!(healthy.logged("commands.failed_after_write").len(), 0);
        pool.close().await;
    }
}
