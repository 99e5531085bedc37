//! The demo service with `--amqp-url`: each published command also reaches RabbitMQ,
//! with the delivery's correlation ID and the request's idempotency key in its headers.
//! Each test owns its exchange and removes it; without a broker (and outside CI) the
//! broker test says SKIPPED and passes.

#[path = "support/demo.rs"]
mod demo;
#[path = "support/rabbitmq.rs"]
mod rabbitmq;
#[path = "support/mod.rs"]
mod support;

use std::time::Duration;

use demo::Demo;
use futures_util::StreamExt as _;
use http::StatusCode;
use lapin::{
    options::{
        BasicConsumeOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
        QueueDeclareOptions,
    },
    types::FieldTable,
    Channel, Connection, Consumer, ExchangeKind,
};
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
    channel
        .exchange_declare(
            exchange.as_str().into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let queue = channel
        .queue_declare(
            "".into(),
            QueueDeclareOptions {
                exclusive: true,
                auto_delete: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    channel
        .queue_bind(
            queue.name().clone(),
            exchange.as_str().into(),
            "command.#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let consumer = channel
        .basic_consume(
            queue.name().clone(),
            "".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
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
