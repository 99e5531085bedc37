//! Kafka through a Tansu broker: records keyed by the partition key, in commit order
//! per key, with the message's headers; a broker paused (SIGSTOP) mid-run is backed off
//! from, and nothing is lost.

use std::{collections::HashMap, time::Duration};

use rdkafka::{
    admin::{AdminClient, AdminOptions, NewTopic, TopicReplication},
    consumer::{Consumer as _, StreamConsumer},
    message::Headers as _,
    ClientConfig, Message as _,
};
use tower_ids::outbox::{kafka::KafkaSink, Message};

use crate::{database::TestDatabase, kafka_broker::Broker, outbox, rows, Running};

const MESSAGES: usize = 600;
const KEYS: usize = 12;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_keep_each_keys_order_and_headers_through_a_paused_broker() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let Some(db) = TestDatabase::create().await else {
        return;
    };
    let Some(broker) = Broker::start() else {
        return;
    };
    let (pool, outbox, _store) = outbox(&db, 8).await;
    let topic = format!("outbox-{}", uuid::Uuid::now_v7().simple());
    let admin: AdminClient<_> = ClientConfig::new()
        .set("bootstrap.servers", &broker.addr)
        .create()
        .unwrap();
    admin
        .create_topics(
            [&NewTopic::new(&topic, 3, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        )
        .await
        .unwrap();

    let mut connection = pool.acquire().await.unwrap();
    for n in 0..MESSAGES / 2 {
        let message = Message::new(&topic, n.to_string())
            .partition_key(format!("w{}", n % KEYS))
            .header("content-type", "text/plain");
        outbox.enqueue(&mut connection, message).await.unwrap();
    }
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", &broker.addr)
        .set("message.timeout.ms", "3000");
    let relay = outbox
        .relay(KafkaSink::from_config(config).unwrap())
        .poll_interval(Duration::from_millis(10))
        .max_outage_backoff(Duration::from_millis(500))
        .publish_timeout(Duration::from_secs(4))
        .build();
    let running = Running::start(relay);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while rows(&pool).await.1 < i64::try_from(MESSAGES / 2).unwrap() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{:?}",
            rows(&pool).await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The broker stops answering for longer than a record's timeout.
    let pid = broker.pid().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .unwrap()
        .success());
    for n in MESSAGES / 2..MESSAGES {
        let message = Message::new(&topic, n.to_string())
            .partition_key(format!("w{}", n % KEYS))
            .header("content-type", "text/plain");
        outbox.enqueue(&mut connection, message).await.unwrap();
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(std::process::Command::new("kill")
        .args(["-CONT", &pid])
        .status()
        .unwrap()
        .success());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while rows(&pool).await.1 < i64::try_from(MESSAGES).unwrap() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{:?}",
            rows(&pool).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    running.stop().await;

    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", &broker.addr)
        .set("group.id", format!("g-{}", uuid::Uuid::now_v7()))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "1000")
        .create()
        .unwrap();
    consumer.subscribe(&[&topic]).unwrap();
    let mut per_key: HashMap<String, Vec<usize>> = HashMap::new();
    let mut keys_seen = std::collections::HashSet::new();
    let mut received = 0;
    // A record the paused broker wrote but did not acknowledge is published again:
    // the same message key twice, which an inbox absorbs. Count distinct keys.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while keys_seen.len() < MESSAGES {
        let record = tokio::time::timeout_at(deadline, consumer.recv())
            .await
            .unwrap_or_else(|_| panic!("{} of {MESSAGES} distinct messages", keys_seen.len()))
            .unwrap();
        received += 1;
        let headers = record.headers().unwrap().detach();
        let header = |name: &str| {
            headers
                .iter()
                .find(|h| h.key == name)
                .and_then(|h| h.value)
                .map(|v| String::from_utf8(v.to_vec()).unwrap())
        };
        assert_eq!(header("content-type").as_deref(), Some("text/plain"));
        assert!(header("x-correlation-id").is_some());
        let key = header("idempotency-key").expect("the message's own key");
        let partition_key = String::from_utf8(record.key().unwrap().to_vec()).unwrap();
        let n: usize = std::str::from_utf8(record.payload().unwrap())
            .unwrap()
            .parse()
            .unwrap();
        if keys_seen.insert(key) {
            per_key.entry(partition_key).or_default().push(n);
        }
    }
    for (key, numbers) in &per_key {
        assert!(
            numbers.windows(2).all(|w| w[0] < w[1]),
            "{key}: first deliveries out of commit order: {numbers:?}"
        );
    }
    eprintln!(
        "kafka: {MESSAGES} messages, {received} records ({} published again after the pause)",
        received - MESSAGES
    );
}
