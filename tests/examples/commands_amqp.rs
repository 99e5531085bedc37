//! The demo service with `--amqp-url`: each published command also reaches RabbitMQ,
//! with the delivery's correlation ID and an idempotency key in its headers (in memory
//! the request's; in DB mode the outbox message's own, sent by the library's relay).
//! Each test owns its exchange (and in DB mode its database) and removes it; without a
//! broker or a database (and outside CI) the test says SKIPPED and passes.

#[cfg(feature = "postgres")]
use tower_ids_test_support::postgres as database;
#[path = "demo.rs"]
mod demo;
use tower_ids_test_support as support;
use tower_ids_test_support::rabbitmq;

use std::time::Duration;

use demo::Demo;
use futures_util::StreamExt as _;
use http::StatusCode;
use lapin::{options::ExchangeDeleteOptions, Channel, Connection, Consumer};
use rabbitmq::{connect, url};
use serde_json::Value;
use support::{client, send};
use tower_ids::{correlation::MessageCorrelation, idempotency::IdempotencyKey};

async fn create(demo: &Demo, correlation_id: &str, key: &str) -> support::Reply {
    send(
        &client(),
        "POST",
        format!("{}/commands", demo.url),
        &[
            ("content-type", "application/json"),
            ("x-correlation-id", correlation_id),
            ("x-api-key", "amqp-client"),
            ("idempotency-key", key),
        ],
        r#"{"device_id":"thermostat-42","name":"set_temperature","payload":{"celsius":21.5}}"#,
    )
    .await
}

/// An exchange of this test's own, declared as the demo declares it, and a consumer
/// of an exclusive queue bound to its `command.#` events: bound before the demo starts.
async fn bound_consumer(connection: &Connection, name: &str) -> (Channel, String, Consumer) {
    let exchange = format!("tower-ids.test.{name}.{}", std::process::id());
    let channel = connection.create_channel().await.unwrap();
    let consumer = rabbitmq::topic_consumer(&channel, &exchange, "command.#").await;
    (channel, exchange, consumer)
}

async fn next_delivery(consumer: &mut Consumer) -> lapin::message::Delivery {
    tokio::time::timeout(Duration::from_secs(10), consumer.next())
        .await
        .expect("the event reaches the queue within 10 s")
        .expect("the consumer is open")
        .unwrap()
}

#[tokio::test]
async fn a_created_command_reaches_the_exchange_with_both_ids_and_a_replay_adds_nothing() {
    let Some(connection) = connect().await else {
        return;
    };
    let (channel, exchange, mut consumer) = bound_consumer(&connection, "commands").await;

    let demo = Demo::start(&["--amqp-url", &url(), "--amqp-exchange", &exchange]);
    demo.events("commands.amqp_connected").await;
    let created = create(&demo, "amqp-demo-1", "amqp-create-1").await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.text());
    let command_id = created.json()["id"].as_str().unwrap().to_owned();

    let delivery = next_delivery(&mut consumer).await;
    assert_eq!(delivery.routing_key.as_str(), "command.created");
    let body: Value = serde_json::from_slice(&delivery.data).unwrap();
    assert_eq!(body["type"], "command.created");
    assert_eq!(body["command_id"], command_id.as_str());
    assert_eq!(body["payload"]["celsius"], 21.5);
    let headers = delivery.properties.headers();
    let correlation = MessageCorrelation::new()
        .read(headers)
        .unwrap()
        .expect("a correlation header");
    assert!(
        correlation.as_str().starts_with("amqp-demo-1."),
        "{correlation}"
    );
    // The same ID the `commands.published` line was logged under.
    let published = &demo.events("commands.published").await[0];
    assert_eq!(published["span"]["correlation_id"], correlation.as_str());
    assert_eq!(published["fields"]["amqp"], true);
    let key = IdempotencyKey::from_carrier(headers)
        .unwrap()
        .expect("an idempotency-key header");
    assert_eq!(key.as_str(), "amqp-create-1");

    // A replay answers the first response and publishes nothing.
    let replayed = create(&demo, "amqp-demo-2", "amqp-create-1").await;
    assert_eq!(replayed.header("idempotent-replayed"), Some("true"));
    let more = tokio::time::timeout(Duration::from_millis(500), consumer.next()).await;
    assert!(more.is_err(), "a replay published again: {more:?}");

    drop(demo);
    channel
        .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
        .await
        .unwrap();
}

#[tokio::test]
async fn an_unreachable_broker_at_start_leaves_publishing_by_log() {
    // Port 1: nothing listens there, so the connection is refused at once.
    let demo = Demo::start(&["--amqp-url", "amqp://guest:guest@127.0.0.1:1/%2f"]);
    let warned = &demo.events("commands.amqp_unavailable").await[0];
    assert_eq!(warned["level"], "WARN");
    let created = create(&demo, "amqp-down-1", "amqp-down-1").await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.text());
    let published = &demo.events("commands.published").await[0];
    assert_eq!(published["fields"]["amqp"], false);
    assert!(published["span"]["correlation_id"]
        .as_str()
        .unwrap()
        .starts_with("amqp-down-1."));
}

/// A request with a W3C `traceparent`: its access line, the publisher's line (its
/// work runs later, in the background) and the AMQP event all carry its trace.
#[cfg(feature = "opentelemetry")]
#[tokio::test]
async fn a_requests_trace_reaches_the_publishers_lines_and_the_amqp_event() {
    use tower_ids::correlation::TraceContext;

    let Some(connection) = connect().await else {
        return;
    };
    let (channel, exchange, mut consumer) = bound_consumer(&connection, "traced").await;
    let demo = Demo::start(&["--amqp-url", &url(), "--amqp-exchange", &exchange]);
    demo.events("commands.amqp_connected").await;
    let trace_id = "0af7651916cd43dd8448eb211c80319c";
    let created = send(
        &client(),
        "POST",
        format!("{}/commands", demo.url),
        &[
            ("content-type", "application/json"),
            ("x-correlation-id", "traced-create-1"),
            ("x-api-key", "amqp-client"),
            ("idempotency-key", "traced-create-1"),
            ("traceparent", &format!("00-{trace_id}-b7ad6b7169203331-01")),
        ],
        r#"{"device_id":"d-traced","name":"reboot","payload":{}}"#,
    )
    .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.text());

    let delivery = next_delivery(&mut consumer).await;
    let headers = delivery.properties.headers();
    let trace = TraceContext::extract(headers).expect("a traceparent on the event");
    assert_eq!(trace.trace_id(), trace_id);
    assert!(
        !trace.traceparent().contains("b7ad6b7169203331"),
        "the publisher's own span is the parent, not the caller's: {}",
        trace.traceparent()
    );

    let published = &demo.events("commands.published").await[0];
    assert_eq!(published["span"]["name"], "publish");
    assert_eq!(published["span"]["trace_id"], trace_id);
    let access = demo.outcomes("executed", 1).await;
    assert_eq!(access[0]["span"]["trace_id"], trace_id);
    // Every line logged under the request's ID, or a delivery's extension of it.
    let lines: Vec<Value> = demo
        .lines()
        .into_iter()
        .filter(|line| {
            line["span"]["correlation_id"]
                .as_str()
                .is_some_and(|id| id.starts_with("traced-create-1"))
        })
        .collect();
    assert!(lines.len() >= 2, "{lines:#?}");
    for line in &lines {
        assert_eq!(line["span"]["trace_id"], trace_id, "{line}");
    }

    drop(demo);
    channel
        .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
        .await
        .unwrap();
}

/// DB mode (`--database-url`): the library's outbox relay publishes each command, through
/// the demo's sink, to the demo's exchange.
#[cfg(feature = "postgres")]
mod db_mode {
    use sqlx::PgPool;

    use super::*;
    use crate::database::TestDatabase;

    /// The outbox messages of `command_id`: (idempotency key, published, attempts).
    async fn messages(pool: &PgPool, command_id: &str) -> Vec<(String, bool, i32)> {
        sqlx::query_as(
            "SELECT idempotency_key, published_at IS NOT NULL, attempts FROM tower_ids_outbox \
             WHERE convert_from(payload, 'UTF8')::json ->> 'command_id' = $1 ORDER BY id",
        )
        .bind(command_id)
        .fetch_all(pool)
        .await
        .unwrap()
    }

    /// The command's status, once its outbox message is published or dead (within 10 s).
    async fn settled_status(pool: &PgPool, command_id: &str) -> String {
        for _ in 0..200 {
            let settled: Option<(String, bool)> = sqlx::query_as(
                "SELECT c.status, bool_and(o.published_at IS NOT NULL OR o.dead_at IS NOT NULL) \
                 FROM commands c JOIN tower_ids_outbox o \
                   ON convert_from(o.payload, 'UTF8')::json ->> 'command_id' = c.id::text \
                 WHERE c.id = $1::uuid GROUP BY c.status",
            )
            .bind(command_id)
            .fetch_optional(pool)
            .await
            .unwrap();
            if let Some((status, true)) = settled {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the outbox message of {command_id} still pending after 10 s");
    }

    #[tokio::test]
    async fn the_relay_publishes_each_command_once_with_its_ids_and_one_outbox_row_per_key() {
        let Some(connection) = connect().await else {
            return;
        };
        let Some(database) = TestDatabase::create().await else {
            return;
        };
        let (channel, exchange, mut consumer) = bound_consumer(&connection, "db").await;
        let demo = Demo::start(&[
            "--database-url",
            database.url(),
            "--amqp-url",
            &url(),
            "--amqp-exchange",
            &exchange,
        ]);
        demo.events("commands.amqp_connected").await;
        let created = create(&demo, "amqp-db-1", "amqp-db-create-1").await;
        assert_eq!(created.status, StatusCode::CREATED, "{}", created.text());
        let command_id = created.json()["id"].as_str().unwrap().to_owned();

        let delivery = next_delivery(&mut consumer).await;
        assert_eq!(delivery.routing_key.as_str(), "command.created");
        let body: Value = serde_json::from_slice(&delivery.data).unwrap();
        assert_eq!(body["type"], "command.created");
        assert_eq!(body["command_id"], command_id.as_str());
        assert_eq!(body["device_id"], "thermostat-42");
        assert_eq!(body["payload"]["celsius"], 21.5);
        let headers = delivery.properties.headers();
        let correlation = MessageCorrelation::new()
            .read(headers)
            .unwrap()
            .expect("a correlation header");
        assert!(
            correlation.as_str().starts_with("amqp-db-1."),
            "the request's ID extended for the publication: {correlation}"
        );
        let published = &demo.events("commands.published").await[0];
        assert_eq!(published["span"]["name"], "outbox.publish");
        assert_eq!(published["span"]["correlation_id"], correlation.as_str());
        assert_eq!(published["fields"]["command_id"], command_id.as_str());
        assert_eq!(published["fields"]["device_id"], "thermostat-42");
        assert_eq!(published["fields"]["amqp"], true);
        #[cfg(feature = "opentelemetry")]
        assert!(
            tower_ids::correlation::TraceContext::extract(headers).is_some(),
            "a traceparent on the event"
        );

        // One outbox row for the key, published, whose own idempotency key the event
        // carries; the command is sent.
        let pool = database.pool(1).await;
        assert_eq!(settled_status(&pool, &command_id).await, "sent");
        let rows = messages(&pool, &command_id).await;
        let [(message_key, true, 1)] = &rows[..] else {
            panic!("one published outbox row, one attempt: {rows:?}");
        };
        let key = IdempotencyKey::from_carrier(headers)
            .unwrap()
            .expect("an idempotency-key header");
        assert_eq!(key.as_str(), message_key, "the message's own key");

        // A replay answers the first response, enqueues and publishes nothing.
        let replayed = create(&demo, "amqp-db-2", "amqp-db-create-1").await;
        assert_eq!(replayed.header("idempotent-replayed"), Some("true"));
        let more = tokio::time::timeout(Duration::from_millis(500), consumer.next()).await;
        assert!(more.is_err(), "a replay published again: {more:?}");
        let total: i64 = sqlx::query_scalar("SELECT count(*) FROM tower_ids_outbox")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(total, 1, "one outbox row per key");

        drop(demo);
        pool.close().await;
        channel
            .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
            .await
            .unwrap();
    }

    /// A command cancelled within `--publish-delay-ms` is never published: its message
    /// is marked done, and the next command of the same device is published after it.
    #[tokio::test]
    async fn a_command_cancelled_before_its_publish_delay_is_never_published() {
        let Some(connection) = connect().await else {
            return;
        };
        let Some(database) = TestDatabase::create().await else {
            return;
        };
        let (channel, exchange, mut consumer) = bound_consumer(&connection, "db-cancel").await;
        let demo = Demo::start(&[
            "--database-url",
            database.url(),
            "--amqp-url",
            &url(),
            "--amqp-exchange",
            &exchange,
            "--publish-delay-ms",
            "1000",
        ]);
        demo.events("commands.amqp_connected").await;
        let cancelled = create(&demo, "amqp-db-cancel-1", "amqp-db-cancel-1").await;
        assert_eq!(
            cancelled.status,
            StatusCode::CREATED,
            "{}",
            cancelled.text()
        );
        let cancelled_id = cancelled.json()["id"].as_str().unwrap().to_owned();
        let answer = send(
            &client(),
            "POST",
            format!("{}/commands/{cancelled_id}/cancel", demo.url),
            &[],
            "",
        )
        .await;
        assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
        assert_eq!(answer.json()["status"], "cancelled");
        let kept = create(&demo, "amqp-db-cancel-2", "amqp-db-cancel-2").await;
        let kept_id = kept.json()["id"].as_str().unwrap().to_owned();

        let delivery = next_delivery(&mut consumer).await;
        let body: Value = serde_json::from_slice(&delivery.data).unwrap();
        assert_eq!(
            body["command_id"],
            kept_id.as_str(),
            "only the one not cancelled"
        );
        let more = tokio::time::timeout(Duration::from_millis(500), consumer.next()).await;
        assert!(
            more.is_err(),
            "the cancelled command was published: {more:?}"
        );

        let skipped = &demo.events("commands.publish_skipped").await[0];
        assert_eq!(skipped["fields"]["command_id"], cancelled_id.as_str());
        assert_eq!(skipped["fields"]["reason"], "cancelled");
        let pool = database.pool(1).await;
        assert_eq!(settled_status(&pool, &cancelled_id).await, "cancelled");
        assert_eq!(settled_status(&pool, &kept_id).await, "sent");
        let published: Vec<Value> = demo.logged("commands.published");
        assert_eq!(published.len(), 1, "{published:?}");
        assert_eq!(published[0]["fields"]["command_id"], kept_id.as_str());

        drop(demo);
        pool.close().await;
        channel
            .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
            .await
            .unwrap();
    }

    /// An exchange no queue is bound to: the event is dropped by the broker, as before
    /// the library's relay, and the command is sent (not refused, retried and
    /// dead-lettered, as the library's `mandatory` `AmqpSink` would).
    #[tokio::test]
    async fn an_event_no_queue_takes_still_sends_the_command() {
        let Some(connection) = connect().await else {
            return;
        };
        let Some(database) = TestDatabase::create().await else {
            return;
        };
        let exchange = format!("tower-ids.test.db-unbound.{}", std::process::id());
        let demo = Demo::start(&[
            "--database-url",
            database.url(),
            "--amqp-url",
            &url(),
            "--amqp-exchange",
            &exchange,
        ]);
        demo.events("commands.amqp_connected").await;
        let created = create(&demo, "amqp-db-unbound-1", "amqp-db-unbound-1").await;
        let command_id = created.json()["id"].as_str().unwrap().to_owned();
        let pool = database.pool(1).await;
        assert_eq!(settled_status(&pool, &command_id).await, "sent");
        let rows = messages(&pool, &command_id).await;
        assert!(matches!(rows[..], [(_, true, 1)]), "{rows:?}");
        assert_eq!(
            demo.events("commands.published").await[0]["fields"]["amqp"],
            true
        );

        drop(demo);
        pool.close().await;
        let channel = connection.create_channel().await.unwrap();
        channel
            .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
            .await
            .unwrap();
    }
}
