//! Kafka record headers as a `Carrier` (feature `kafka`), through a real broker (Tansu,
//! started per test on loopback): the correlation ID, the idempotency key and the trace
//! context survive the broker; a key repeated in the headers is refused; and a record
//! delivered twice is handled once by `MessageIdempotencyLayer`.

use tower_ids_test_support::kafka;

use std::{
    convert::Infallible,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use kafka::Broker;
use rdkafka::{
    admin::{AdminClient, AdminOptions, NewTopic, TopicReplication},
    consumer::{Consumer, StreamConsumer},
    message::{Header, OwnedHeaders},
    producer::{FutureProducer, FutureRecord},
    ClientConfig, Message,
};
use tower::{service_fn, Service, ServiceBuilder, ServiceExt};
use tower_ids::{
    correlation::{Carrier, CorrelationId, MessageCorrelation},
    idempotency::{
        extract::KeyRejection,
        message::{Handled, MessageIdempotencyLayer, MessageKey},
        IdempotencyKey,
    },
};

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

fn config(broker: &Broker) -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", &broker.addr);
    config
}

async fn topic(broker: &Broker, partitions: i32) -> String {
    let name = format!("t-{}", uuid::Uuid::now_v7());
    let admin: AdminClient<_> = config(broker).create().unwrap();
    let new = NewTopic::new(&name, partitions, TopicReplication::Fixed(1));
    for result in admin
        .create_topics([&new], &AdminOptions::new())
        .await
        .unwrap()
    {
        result.unwrap();
    }
    name
}

async fn produce(broker: &Broker, topic: &str, key: &str, payload: &str, headers: OwnedHeaders) {
    let producer: FutureProducer = config(broker).create().unwrap();
    let record = FutureRecord::to(topic)
        .key(key)
        .payload(payload)
        .headers(headers);
    producer
        .send(record, Duration::from_secs(10))
        .await
        .map_err(|(error, _)| error)
        .unwrap();
}

/// A consumer of `topic` in a group of its own, from the start.
fn consumer(broker: &Broker, topic: &str) -> StreamConsumer {
    let consumer: StreamConsumer = config(broker)
        .set("group.id", format!("g-{}", uuid::Uuid::now_v7()))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "1000")
        .create()
        .unwrap();
    consumer.subscribe(&[topic]).unwrap();
    consumer
}

/// The headers and payload of the next `n` records.
async fn consume(consumer: &StreamConsumer, n: usize) -> Vec<(OwnedHeaders, String)> {
    let mut records = Vec::new();
    while records.len() < n {
        let message = tokio::time::timeout(Duration::from_secs(30), consumer.recv())
            .await
            .expect("a record within 30 s")
            .unwrap();
        let headers = message.headers().map(|h| h.detach()).unwrap_or_default();
        let payload = String::from_utf8(message.payload().unwrap().to_vec()).unwrap();
        records.push((headers, payload));
    }
    records
}

#[tokio::test]
async fn ids_keys_and_trace_context_cross_the_broker_in_record_headers() {
    let Some(broker) = Broker::start() else {
        return;
    };
    let topic = topic(&broker, 1).await;
    let correlation = MessageCorrelation::new();
    let id = CorrelationId::new();
    let mut headers = OwnedHeaders::new();
    correlation.inject(&mut headers, &id);
    IdempotencyKey::new("dispatch-7")
        .unwrap()
        .inject(&mut headers);
    headers.set("traceparent", TRACEPARENT);
    // `set` replaces: the header is there once.
    headers.set("traceparent", TRACEPARENT);
    produce(&broker, &topic, "frn:wh:1", "{}", headers).await;

    let received = consume(&consumer(&broker, &topic), 1).await;
    let headers = &received[0].0;
    assert_eq!(
        correlation.read(headers).unwrap().unwrap().as_str(),
        id.as_str()
    );
    assert_eq!(
        IdempotencyKey::from_carrier(headers)
            .unwrap()
            .unwrap()
            .as_str(),
        "dispatch-7"
    );
    assert_eq!(headers.get("traceparent"), Some(TRACEPARENT.as_bytes()));
    assert!(!headers.is_repeated("traceparent"));
    // Each delivery extends the publisher's ID.
    let delivery = correlation.for_delivery(headers);
    assert!(delivery.as_str().starts_with(id.as_str()));
}

#[tokio::test]
async fn a_correlation_id_sent_twice_in_one_record_is_refused() {
    let Some(broker) = Broker::start() else {
        return;
    };
    let topic = topic(&broker, 1).await;
    let headers = OwnedHeaders::new()
        .insert(Header {
            key: "x-correlation-id",
            value: Some("one"),
        })
        .insert(Header {
            key: "x-correlation-id",
            value: Some("two"),
        });
    produce(&broker, &topic, "k", "{}", headers).await;
    let received = consume(&consumer(&broker, &topic), 1).await;
    let headers = &received[0].0;
    assert!(headers.is_repeated("x-correlation-id"));
    assert!(MessageCorrelation::new().read(headers).is_err());
    // The delivery gets an ID of its own instead.
    let delivery = MessageCorrelation::new().for_delivery(headers);
    assert!(!delivery.as_str().starts_with("one") && !delivery.as_str().starts_with("two"));
}

#[tokio::test]
async fn a_record_delivered_twice_is_handled_once() {
    let Some(broker) = Broker::start() else {
        return;
    };
    let topic = topic(&broker, 3).await;
    for _ in 0..2 {
        let mut headers = OwnedHeaders::new();
        IdempotencyKey::new("dispatch-9")
            .unwrap()
            .inject(&mut headers);
        MessageCorrelation::new().inject(&mut headers, &CorrelationId::new());
        produce(
            &broker,
            &topic,
            "frn:wh:2",
            r#"{"movement":"mv-9"}"#,
            headers,
        )
        .await;
    }
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let key = |record: &(OwnedHeaders, String)| -> Result<Option<MessageKey>, KeyRejection> {
        Ok(IdempotencyKey::from_carrier(&record.0)?.map(|key| {
            MessageKey::new(key)
                .scope("planner-1")
                .fingerprint(&record.1)
        }))
    };
    let mut service = ServiceBuilder::new()
        .layer(MessageIdempotencyLayer::new().key(key).require_key(true))
        .service(service_fn(move |record: (OwnedHeaders, String)| {
            let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
            async move { Ok::<_, Infallible>(format!("run {n} of {}", record.1)) }
        }));
    let mut outcomes = Vec::new();
    for record in consume(&consumer(&broker, &topic), 2).await {
        let handled = service.ready().await.unwrap().call(record).await.unwrap();
        outcomes.push(handled);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran once");
    assert!(matches!(outcomes[0], Handled::Ran(_)));
    assert!(outcomes[1].is_replay());
    assert_eq!(outcomes[0].outcome(), outcomes[1].outcome());
}
