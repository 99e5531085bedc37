//! The dispatch feed: acks out of order never move the cursor back, a crash between
//! storing a page and acking it redelivers the page once, and dispatch on Kafka (in
//! memory, and on PostgreSQL through the library's outbox and relay) publishes one
//! record per event, keeps each warehouse's order, and a duplicate record changes
//! nothing.

use std::time::Duration;

use base64::{engine::general_purpose::URL_SAFE_NO_PAD, Engine as _};
use http::StatusCode;
use serde_json::{json, Value};

use super::{
    book, client, counts, events_once, executor, get, kafka, movement, planner, post, TestDatabase,
    ACME, GLOBEX,
};

fn cursor(owner: &str, seq: i64) -> String {
    URL_SAFE_NO_PAD.encode(format!("v1:{owner}:{seq}"))
}

#[tokio::test]
async fn acks_out_of_order_never_move_the_cursor_back() {
    acks_and_pages(&[]).await;
    if let Some(database) = TestDatabase::create().await {
        acks_and_pages(&["--database-url", database.url()]).await;
    }
}

async fn acks_and_pages(args: &[&str]) {
    let planner = planner(args).await;
    let http = client();
    for n in 1..=3 {
        let call = movement("acme", &format!("c-ack-{n}"), "frn:wh:1");
        book(&http, &planner, ACME, &call).await;
    }
    let page = get(
        &http,
        &format!("{}/wes/v1/dispatch/pending?limit=10", planner.url),
        ACME,
    )
    .await;
    let cursors: Vec<String> = page.json()["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|event| event["cursor"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(cursors.len(), 3);
    assert_eq!(page.json()["next_cursor"], cursors[2].as_str());

    let ack_url = format!("{}/wes/v1/dispatch/ack", planner.url);
    let ack = |cursor: String| {
        let (http, url) = (http.clone(), ack_url.clone());
        async move { post(&http, &url, ACME, &json!({ "cursor": cursor })).await }
    };
    let second = ack(cursors[1].clone()).await;
    assert_eq!(
        second.json(),
        json!({"advanced": true, "cursor": cursors[1]})
    );
    for earlier_or_equal in [&cursors[0], &cursors[1]] {
        let noop = ack(earlier_or_equal.clone()).await;
        assert_eq!(noop.status, StatusCode::OK);
        assert_eq!(
            noop.json(),
            json!({"advanced": false, "cursor": cursors[1]})
        );
    }
    assert_eq!(
        counts(&http, &planner, ACME).await["acked"],
        cursors[1].as_str()
    );
    let third = ack(cursors[2].clone()).await;
    assert_eq!(third.json()["advanced"], true);

    // The next page starts after the acked cursor.
    let next = get(
        &http,
        &format!(
            "{}/wes/v1/dispatch/pending?since={}",
            planner.url, cursors[1]
        ),
        ACME,
    )
    .await;
    assert_eq!(next.json()["events"].as_array().unwrap().len(), 1);

    // A cursor the feed never gave is refused alike by the ack and by the feed.
    for (cursor, status, code) in [
        (cursor("acme", 4), 422, "dispatch.cursor_ahead"),
        (cursor("acme", 99), 422, "dispatch.cursor_ahead"),
        (cursor("globex", 1), 403, "dispatch.cursor_foreign"),
        (cursor("acme", 0), 400, "dispatch.cursor_invalid"),
        ("not-a-cursor".to_owned(), 400, "dispatch.cursor_invalid"),
    ] {
        let refused = ack(cursor.clone()).await;
        assert_eq!(
            refused.status.as_u16(),
            status,
            "{args:?}: {}",
            refused.text()
        );
        assert_eq!(refused.json()["code"], code);
        let page = get(
            &http,
            &format!("{}/wes/v1/dispatch/pending?since={cursor}", planner.url),
            ACME,
        )
        .await;
        assert_eq!(page.status.as_u16(), status, "{args:?}: {}", page.text());
        assert_eq!(page.json()["code"], code);
    }
    assert_eq!(
        counts(&http, &planner, ACME).await["acked"],
        cursors[2].as_str()
    );
    // The last cursor is the end of the feed, not past it: an empty page.
    let end = get(
        &http,
        &format!(
            "{}/wes/v1/dispatch/pending?since={}",
            planner.url, cursors[2]
        ),
        ACME,
    )
    .await;
    assert_eq!(end.status, StatusCode::OK, "{}", end.text());
    assert_eq!(end.json(), json!({"events": [], "next_cursor": cursors[2]}));
}

#[tokio::test]
async fn a_crash_between_storing_a_page_and_acking_it_redelivers_the_page_once() {
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    let planner = planner(&[]).await;
    let http = client();
    for n in 1..=3 {
        let call = movement("acme", &format!("c-crash-{n}"), &format!("frn:wh:{n}"));
        book(&http, &planner, ACME, &call).await;
    }
    let planner_url = planner.url.clone();
    let args = [
        "--database-url",
        database.url(),
        "--planner-url",
        &planner_url,
        "--poll-interval-ms",
        "50",
    ];
    let mut crashing = executor(&[&args[..], &["--exit-after-storing-page"]].concat()).await;
    let status = crashing
        .exited_within(Duration::from_secs(20))
        .await
        .expect("the executor exits after storing its first page");
    assert_eq!(status.code(), Some(3));
    let pool = database.pool(1).await;
    let stored = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM executor_events")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    assert_eq!(stored().await, 3, "the page was stored");
    assert_eq!(
        counts(&http, &planner, ACME).await["acked"],
        "",
        "and not acked"
    );

    // Restarted, it gets the same page again, stores nothing new, and acks it.
    let executor = executor(&args).await;
    let acked = executor.events("partner.page_acked").await;
    assert_eq!(acked.len(), 1);
    let stored_lines = executor.logged("partner.page_stored");
    assert_eq!(stored_lines[0]["fields"]["new"], 0, "every event was known");
    assert_eq!(stored().await, 3, "no event stored twice");
    let page = get(
        &http,
        &format!("{}/wes/v1/dispatch/pending", planner.url),
        ACME,
    )
    .await;
    assert_eq!(
        counts(&http, &planner, ACME).await["acked"],
        page.json()["next_cursor"]
    );
}

/// Acme's events the Kafka test books, over three warehouses.
const KAFKA_EVENTS: usize = 12;

#[tokio::test]
async fn dispatch_on_kafka_keeps_each_warehouses_order_and_a_duplicate_record_changes_nothing() {
    let Some(broker) = tokio::task::spawn_blocking(kafka::Broker::start)
        .await
        .unwrap()
    else {
        return;
    };
    dispatch_on_kafka(&broker, &[]).await;
    if let Some(database) = TestDatabase::create().await {
        dispatch_on_kafka(&broker, &["--database-url", database.url()]).await;
        // Through the library's outbox: one row per event, every one published.
        let pool = database.pool(1).await;
        let (rows, pending): (i64, i64) = sqlx::query_as(
            "SELECT count(*), count(*) FILTER (WHERE published_at IS NULL) FROM tower_ids_outbox",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(rows, KAFKA_EVENTS as i64 + 1);
        assert_eq!(pending, 0);
        pool.close().await;
    }
}

/// A record of the topic as the broker holds it.
struct Record {
    partition: i32,
    key: String,
    headers: Vec<(String, String)>,
    payload: Value,
}

impl Record {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, value)| value.as_str())
    }
}

/// Every record of `topic` (its 3 partitions, from the start, without a group): waits
/// up to 30 s for `count` of them, then 2 s more for any extra.
async fn topic_records(brokers: &str, topic: &str, count: usize) -> Vec<Record> {
    use rdkafka::{
        consumer::{Consumer, StreamConsumer},
        message::Headers,
        Message, Offset, TopicPartitionList,
    };
    let consumer: StreamConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("reader-{}", uuid::Uuid::now_v7()))
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut partitions = TopicPartitionList::new();
    for partition in 0..3 {
        partitions
            .add_partition_offset(topic, partition, Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&partitions).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut records = Vec::new();
    loop {
        let wait = if records.len() >= count {
            Duration::from_secs(2)
        } else {
            deadline.saturating_duration_since(tokio::time::Instant::now())
        };
        let message = match tokio::time::timeout(wait, consumer.recv()).await {
            Ok(received) => received.expect("the topic can be read"),
            Err(_) => break,
        };
        records.push(Record {
            partition: message.partition(),
            key: String::from_utf8(message.key().unwrap_or_default().to_vec()).unwrap(),
            headers: message
                .headers()
                .map(|headers| {
                    headers
                        .iter()
                        .map(|header| {
                            let value = header.value.unwrap_or_default();
                            (
                                header.key.to_owned(),
                                String::from_utf8(value.to_vec()).unwrap(),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default(),
            payload: serde_json::from_slice(message.payload().unwrap_or_default()).unwrap(),
        });
    }
    records
}

/// The planner (in memory, or with `args` on PostgreSQL through the library's outbox
/// and relay) publishes one record per event, each warehouse's in feed order on one
/// partition, with the event's key and a publication's correlation ID; an executor
/// consumes them once each, and a record sent again changes nothing.
async fn dispatch_on_kafka(broker: &kafka::Broker, args: &[&str]) {
    let topic = format!("dispatch-{}", uuid::Uuid::now_v7());
    let kafka = [
        "--kafka-brokers",
        broker.addr.as_str(),
        "--kafka-topic",
        &topic,
    ];
    let planner = planner(&[args, &kafka[..]].concat()).await;
    let http = client();
    // Booked at once: the feed's order is the order the calls committed in.
    let calls: Vec<Value> = (1..=KAFKA_EVENTS)
        .map(|n| {
            movement(
                "acme",
                &format!("c-kafka-{n}"),
                &format!("frn:wh:{}", n % 3),
            )
        })
        .collect();
    futures_util::future::join_all(calls.iter().map(|call| book(&http, &planner, ACME, call)))
        .await;
    // Another partner's event on the same topic is not acme's executor's.
    let globex = movement("globex", "c-kafka-globex", "frn:wh:1");
    book(&http, &planner, GLOBEX, &globex).await;
    let feed = get(
        &http,
        &format!("{}/wes/v1/dispatch/pending", planner.url),
        ACME,
    )
    .await;
    let feed = feed.json()["events"].as_array().unwrap().clone();
    assert_eq!(feed.len(), KAFKA_EVENTS);
    let order = |events: &[Value], warehouse: &str| -> Vec<String> {
        events
            .iter()
            .filter(|event| event["warehouse_frn"] == warehouse)
            .map(|event| event["correlation_id"].as_str().unwrap().to_owned())
            .collect()
    };

    // On the topic: one record per event, keyed by its warehouse, its payload the
    // event, its `idempotency-key` the event's correlation ID, and a correlation ID of
    // its publication; each warehouse's records on one partition, in feed order.
    let records = topic_records(&broker.addr, &topic, KAFKA_EVENTS + 1).await;
    assert_eq!(
        records.len(),
        KAFKA_EVENTS + 1,
        "{args:?}: one record per event"
    );
    let mut publications = std::collections::HashSet::new();
    for record in &records {
        let event = &record.payload;
        assert_eq!(record.key, event["warehouse_frn"], "{args:?}");
        assert_eq!(
            record.header("idempotency-key"),
            event["correlation_id"].as_str(),
            "{args:?}"
        );
        let publication = record.header("x-correlation-id").expect("x-correlation-id");
        assert!(publications.insert(publication.to_owned()), "{args:?}");
        let mut fields: Vec<&str> = event
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        fields.sort_unstable();
        assert_eq!(
            fields,
            [
                "correlation_id",
                "executor_id",
                "movement_id",
                "planner_id",
                "warehouse_frn"
            ],
            "{args:?}"
        );
        if event["executor_id"] == "acme" {
            let listed = feed
                .iter()
                .find(|listed| listed["correlation_id"] == event["correlation_id"])
                .expect("the record is an event of the feed");
            for field in ["planner_id", "warehouse_frn", "movement_id"] {
                assert_eq!(event[field], listed[field], "{args:?}");
            }
        }
    }
    let acme: Vec<Value> = records
        .iter()
        .filter(|record| record.payload["executor_id"] == "acme")
        .map(|record| record.payload.clone())
        .collect();
    for warehouse in ["frn:wh:0", "frn:wh:1", "frn:wh:2"] {
        let partitions: std::collections::HashSet<i32> = records
            .iter()
            .filter(|record| record.key == warehouse)
            .map(|record| record.partition)
            .collect();
        assert_eq!(
            partitions.len(),
            1,
            "{args:?}: {warehouse} on one partition"
        );
        assert_eq!(
            order(&acme, warehouse),
            order(&feed, warehouse),
            "{args:?}: {warehouse}"
        );
        assert_eq!(order(&feed, warehouse).len(), KAFKA_EVENTS / 3);
    }

    let group = format!("executor-{}", uuid::Uuid::now_v7());
    let executor = executor(&[&kafka[..], &["--kafka-group", &group]].concat()).await;
    let received = events_once(&http, &executor, KAFKA_EVENTS).await;
    assert!(received.iter().all(|event| event["source"] == "kafka"));
    assert!(received
        .iter()
        .all(|event| event["body"]["executor_id"] == "acme"));
    // Each warehouse's events arrive in the planner's order (its feed order).
    for warehouse in ["frn:wh:0", "frn:wh:1", "frn:wh:2"] {
        assert_eq!(
            order(&received, warehouse),
            order(&feed, warehouse),
            "{args:?}: {warehouse}"
        );
    }

    // Each first handling's line names its key and its delivery's correlation ID.
    let handled = executor.logged("partner.kafka_handled");
    for line in &handled {
        assert_eq!(line["span"]["idempotency_outcome"], "executed", "{line}");
        assert!(line["span"]["idempotency_key"].is_string(), "{line}");
        assert!(line["fields"]["correlation_id"].is_string(), "{line}");
    }

    // A publisher that re-emits from a stale position sends a record again: the
    // executor's idempotency layer replays it, nothing is stored twice, and the replay
    // has its line too, with the key and this delivery's correlation ID.
    let producer: rdkafka::producer::FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &broker.addr)
        .create()
        .unwrap();
    let produce = |key: &str, warehouse: &str, payload: &Value| {
        let mut headers = rdkafka::message::OwnedHeaders::new();
        tower_ids::idempotency::IdempotencyKey::new(key)
            .unwrap()
            .inject(&mut headers);
        let (producer, topic, warehouse, payload) = (
            producer.clone(),
            topic.clone(),
            warehouse.to_owned(),
            payload.to_string(),
        );
        async move {
            let record = rdkafka::producer::FutureRecord::to(&topic)
                .key(&warehouse)
                .payload(&payload)
                .headers(headers);
            producer
                .send(record, Duration::from_secs(10))
                .await
                .map_err(|(error, _)| error)
                .unwrap();
        }
    };
    let again = &feed[0];
    let payload = json!({
        "executor_id": "acme",
        "planner_id": again["planner_id"],
        "correlation_id": again["correlation_id"],
        "warehouse_frn": again["warehouse_frn"],
        "movement_id": again["movement_id"],
    });
    let key = again["correlation_id"].as_str().unwrap();
    produce(key, again["warehouse_frn"].as_str().unwrap(), &payload).await;
    let duplicate = executor.events("partner.kafka_duplicate").await;
    assert_eq!(duplicate.len(), 1);
    assert_eq!(duplicate[0]["fields"]["idempotency_key"], key);
    assert_eq!(duplicate[0]["fields"]["idempotency_outcome"], "replayed");
    assert_eq!(duplicate[0]["fields"]["idempotency_request_count"], 2);
    assert!(duplicate[0]["span"]["correlation_id"].is_string());
    assert_eq!(handled.len(), KAFKA_EVENTS, "handled once each");
    assert_eq!(executor.logged("partner.kafka_handled").len(), KAFKA_EVENTS);
    assert_eq!(
        events_once(&http, &executor, KAFKA_EVENTS).await.len(),
        KAFKA_EVENTS
    );

    // A record refused for its payload is not stored: the corrected record under the
    // same key is handled (one partition: same record key, so in this order).
    let corrected = json!({
        "executor_id": "acme",
        "planner_id": "planner-1",
        "correlation_id": "c-kafka-corrected",
        "warehouse_frn": "frn:wh:9",
        "movement_id": "mv-9",
    });
    let mut malformed = corrected.clone();
    malformed.as_object_mut().unwrap().remove("warehouse_frn");
    produce("c-kafka-corrected", "frn:wh:9", &malformed).await;
    produce("c-kafka-corrected", "frn:wh:9", &corrected).await;
    let received = events_once(&http, &executor, KAFKA_EVENTS + 1).await;
    assert_eq!(
        received[KAFKA_EVENTS]["correlation_id"],
        "c-kafka-corrected"
    );
    let handled = executor.logged("partner.kafka_handled");
    assert_eq!(
        handled.len(),
        KAFKA_EVENTS + 2,
        "the refused record, then the corrected one"
    );
    assert_eq!(handled[KAFKA_EVENTS]["fields"]["stored"], "None");
    assert!(executor.logged("partner.kafka_refused").is_empty());
}
