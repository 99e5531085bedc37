//! The Kafka side: a Tansu broker of the test's own, a topic of [`PARTITIONS`]
//! partitions created up front, the arguments that point the relays and
//! [`KAFKA_CONSUMERS`] consumers of one group at it; and the fault, the broker paused.

use crate::{
    chaos::{Fault, Fleet},
    database::TestDatabase,
    kafka_broker,
    processes::signal,
    Trial, KAFKA_CONSUMERS, PARTITIONS, PAUSE,
};

/// The Kafka trial: a Tansu broker (stopped when the returned one drops), two
/// databases, the topic and a group of its own, and the broker paused as its fault.
/// `None` without Tansu or PostgreSQL (said loudly; under CI they fail).
pub(crate) async fn trial() -> Option<(Trial, kafka_broker::Broker)> {
    let broker = kafka_broker::Broker::start()?;
    let (Some(sender), Some(consumer)) =
        (TestDatabase::create().await, TestDatabase::create().await)
    else {
        return None;
    };
    let topic = broker.topic("outbox-proof", PARTITIONS).await;
    let group = format!("outbox-proof-{}", uuid::Uuid::now_v7());
    let outbox: Vec<String> = [
        "--broker",
        "kafka",
        "--kafka-brokers",
        &broker.addr,
        "--topic",
        &topic,
        "--partitions",
        &PARTITIONS.to_string(),
    ]
    .map(str::to_owned)
    .into();
    let mut relay = outbox.clone();
    relay.extend(
        [
            "--log-format",
            "json",
            "--database-url",
            sender.url(),
            "relay",
        ]
        .map(str::to_owned),
    );
    let consumers = (0..KAFKA_CONSUMERS)
        .map(|_| {
            [
                "--broker",
                "kafka",
                "--kafka-brokers",
                &broker.addr,
                "--topic",
                &topic,
                "--group",
                &group,
                "--session-timeout-ms",
                "1000",
                "--log-format",
                "json",
                "consume",
                "--database-url",
                consumer.url(),
                "--in-flight-retry-ms",
                "100",
            ]
            .map(str::to_owned)
            .into()
        })
        .collect();
    let trial = Trial {
        broker: "Kafka",
        outbox,
        fleet: Fleet {
            relay,
            consumers,
            fault: Fault::Pause { pid: broker.pid() },
        },
        sender,
        consumer,
    };
    Some((trial, broker))
}

/// Pauses the broker: SIGSTOP, [`PAUSE`], SIGCONT (why a pause and not a restart: the
/// docs atop `main.rs`). Says what it did.
pub(crate) fn pause(pid: u32) -> String {
    signal(pid, "-STOP");
    std::thread::sleep(PAUSE);
    signal(pid, "-CONT");
    format!("broker paused {} s (SIGSTOP, SIGCONT)", PAUSE.as_secs())
}
