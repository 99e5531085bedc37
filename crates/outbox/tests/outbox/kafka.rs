//! Kafka through a Tansu broker: records keyed by the partition key, in commit order
//! per key, with the message's headers; a broker paused (SIGSTOP) mid-run is backed off
//! from, and nothing is lost.

use std::{collections::HashMap, time::Duration};

use rdkafka::{
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
    let Some(db) = TestDatabase::create().await else {
        return;
    };
    let Some(broker) = Broker::start() else {
        return;
    };
    let (pool, outbox, _store) = outbox(&db, 8).await;
    let topic = broker.topic("outbox", 3).await;

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

/// A stop while the broker does not answer: the round under way cannot finish, so the
/// relay waits for it only its drain timeout, returns the round's messages by name,
/// and leaves them pending; the next relay publishes them once the broker is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_mid_round_waits_its_drain_timeout_and_names_what_it_left() {
    let Some(db) = TestDatabase::create().await else {
        return;
    };
    let Some(broker) = Broker::start() else {
        return;
    };
    let (pool, outbox, _store) = outbox(&db, 8).await;
    let topic = broker.topic("outbox", 1).await;
    let relay = |drain: Duration| {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &broker.addr)
            .set("message.timeout.ms", "20000");
        outbox
            .relay(KafkaSink::from_config(config).unwrap())
            .poll_interval(Duration::from_millis(10))
            .publish_timeout(Duration::from_secs(30))
            .drain_timeout(drain)
            .build()
    };
    let signal = |signal: &str| {
        assert!(std::process::Command::new("kill")
            .args([signal, &broker.pid().to_string()])
            .status()
            .unwrap()
            .success());
    };

    signal("-STOP");
    let mut connection = pool.acquire().await.unwrap();
    for n in 0..5 {
        let message = Message::new(&topic, n.to_string()).partition_key("k");
        outbox.enqueue(&mut connection, message).await.unwrap();
    }
    let ids: Vec<i64> = sqlx::query_scalar("SELECT id FROM tower_ids_outbox ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    // On this thread, so that its events are captured.
    let (logs, _guard) = crate::support::Logs::capture();
    let first = relay(Duration::from_millis(500));
    let (stop, stopping) = tokio::sync::oneshot::channel::<()>();
    let asked = std::sync::OnceLock::new();
    let run = first.run(async {
        let _ = stopping.await;
        let _ = asked.set(std::time::Instant::now());
    });
    // The round takes the five at once (an idle relay polls every 10 ms) and waits on
    // the paused broker for up to 30 s.
    let ask = async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        stop.send(()).unwrap();
    };
    let (stopped, ()) =
        tokio::time::timeout(Duration::from_secs(8), async { tokio::join!(run, ask) })
            .await
            .expect("the relay stops within its drain timeout, not its publish timeout");
    let asked = *asked.get().unwrap();
    let took = asked.elapsed();
    assert!(
        took >= Duration::from_millis(450) && took < Duration::from_secs(3),
        "stopped after {took:?}, for a 500 ms drain timeout"
    );
    let mut left = stopped.left.clone();
    left.sort();
    let mut expected: Vec<String> = ids.iter().map(|id| format!("outbox:{id}")).collect();
    expected.sort();
    assert_eq!(left, expected, "the round's five messages, by name");
    assert!(!stopped.is_complete());
    let warned = logs.events("outbox.drain_unsettled");
    assert_eq!(warned.len(), 1, "{}", logs.raw());
    assert_eq!(warned[0]["level"], "WARN");
    assert_eq!(rows(&pool).await.0, 5, "the five are still pending");

    // Back: the next relay publishes them, and a stop with nothing in hand is complete.
    signal("-CONT");
    let second = relay(Duration::from_secs(10));
    let published = async {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while rows(&pool).await.1 < 5 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{:?}",
                rows(&pool).await
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let stopped = second.run(published).await;
    assert!(stopped.is_complete(), "{stopped:?}");
}
