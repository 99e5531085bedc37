//! The issue's fault trials for the drivers under a database that fails as an ordinary
//! bad day does: a backlog of 60 payments (a 400 ms handler in the delivery's
//! transaction) through a PostgreSQL server of the test's own whose client backends are
//! all terminated every 0.3 s for 40 s, then SIGKILLed and restarted four times, on
//! RabbitMQ and on Kafka. Nothing may be dead-lettered, no attempt counted, and every
//! payment applied once.
//!
//! They take a minute or two each, so they run with `TOWER_IDS_FULL_TRIALS=1` only; CI
//! runs the short forms (`a_flapping_database_dead_letters_nothing_and_applies_each_message_once`,
//! `a_handler_failing_on_the_databases_passing_faults_is_requeued_uncounted`):
//!
//! ```sh
//! TOWER_IDS_FULL_TRIALS=1 cargo test --all-features -p tower-ids-message --test consumer trials -- --nocapture --test-threads 1
//! ```

use std::time::Duration;

use sqlx::{postgres::PgPoolOptions, Connection as _, PgPool};
use tower_ids::idempotency::message::{amqp::AmqpConsumer, kafka::KafkaConsumer};

use super::{
    inbox, kafka_broker, payment_of, rabbitmq, rows, server::PostgresServer, support,
    support::full_trials, tables, Runs,
};

const PAYMENTS: usize = 60;
const FLAP: Duration = Duration::from_secs(40);
const FLAP_EVERY: Duration = Duration::from_millis(300);
const KILLS: usize = 4;

/// What a trial saw.
struct Tally {
    terminated: usize,
    requeued: usize,
    counted: usize,
    dead_lettered: usize,
    repeated: usize,
}

/// Terminates every other client backend of the server every 0.3 s for `FLAP`, on a
/// connection of its own; returns how many it terminated.
async fn flap(url: &str) -> usize {
    let mut terminated = 0;
    let until = tokio::time::Instant::now() + FLAP;
    let mut own = None;
    while tokio::time::Instant::now() < until {
        if own.is_none() {
            own = sqlx::PgConnection::connect(url).await.ok();
        }
        if let Some(connection) = own.as_mut() {
            let killed: Result<Vec<bool>, _> = sqlx::query_scalar(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                 WHERE pid <> pg_backend_pid() AND backend_type = 'client backend'",
            )
            .fetch_all(&mut *connection)
            .await;
            match killed {
                Ok(killed) => terminated += killed.iter().filter(|k| **k).count(),
                Err(_) => own = None,
            }
        }
        tokio::time::sleep(FLAP_EVERY).await;
    }
    terminated
}

/// SIGKILLs the whole server and starts it again (crash recovery), `KILLS` times, 2 s
/// apart; the blocking parts off the runtime's one thread.
async fn crash(mut server: PostgresServer) -> PostgresServer {
    for _ in 0..KILLS {
        tokio::time::sleep(Duration::from_secs(2)).await;
        server = tokio::task::spawn_blocking(move || {
            server.kill();
            std::thread::sleep(Duration::from_millis(500));
            server.restart();
            server
        })
        .await
        .unwrap();
    }
    server
}

/// Waits until every payment has its row, or fails after `limit`.
async fn applied(pool: &PgPool, limit: Duration) {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Ok(rows) = tokio::time::timeout(Duration::from_secs(2), rows_or_none(pool)).await {
            if rows.is_some_and(|rows| rows.len() == PAYMENTS) {
                return;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "every payment applied within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn rows_or_none(pool: &PgPool) -> Option<std::collections::HashMap<String, i64>> {
    sqlx::query_as::<_, (String, i64)>("SELECT key, count(*) FROM payments GROUP BY key")
        .fetch_all(pool)
        .await
        .ok()
        .map(|rows| rows.into_iter().collect())
}

/// The settled lines' tally.
fn tally(logs: &support::Logs, terminated: usize, runs: &Runs, dead_lettered: usize) -> Tally {
    let settled = logs.events("message.settled");
    let outcome = |name: &str| {
        (settled.iter())
            .filter(|line| line["fields"]["outcome"] == name)
            .count()
    };
    Tally {
        terminated,
        requeued: outcome("requeued"),
        counted: outcome("retried"),
        dead_lettered: dead_lettered.max(outcome("dead_lettered")),
        repeated: runs.repeated(),
    }
}

fn assert_clean(broker: &str, tally: &Tally, rows: &std::collections::HashMap<String, i64>) {
    eprintln!(
        "{broker}: {PAYMENTS} payments, {} backends terminated, {KILLS} SIGKILLs: {} deliveries requeued uncounted, {} handlers ran again, {} attempts counted, {} dead letters",
        tally.terminated, tally.requeued, tally.repeated, tally.counted, tally.dead_lettered
    );
    assert!(
        tally.terminated > 0 && tally.requeued > 0,
        "the faults reached the deliveries"
    );
    assert_eq!(
        tally.dead_lettered, 0,
        "{broker}: a passing fault dead-letters nothing"
    );
    assert_eq!(
        tally.counted, 0,
        "{broker}: no attempt counted for a passing fault"
    );
    assert_eq!(rows.len(), PAYMENTS);
    assert!(
        rows.values().all(|n| *n == 1),
        "{broker}: each payment applied once: {rows:?}"
    );
}

async fn database() -> Option<(PostgresServer, PgPool)> {
    let server = PostgresServer::start()?;
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .acquire_timeout(Duration::from_secs(2))
        .connect(&server.url())
        .await
        .unwrap();
    tables(&pool).await;
    Some((server, pool))
}

// One thread: the log capture is the test thread's.
#[tokio::test]
async fn trials_rabbitmq_through_a_flapping_then_crashing_database() {
    if !full_trials() {
        eprintln!("trials: set TOWER_IDS_FULL_TRIALS=1 to run the two-minute trial");
        return;
    }
    let Some((server, pool)) = database().await else {
        return;
    };
    let Some(vhost) = rabbitmq::Vhost::create("trial-flap").await else {
        return;
    };
    let connection = lapin::Connection::connect(&vhost.url, Default::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    let runs = Runs::default();
    let consumer = AmqpConsumer::new(&vhost.url, "payments")
        .prefetch(4)
        .max_attempts(2)
        .retry_pause(Duration::from_millis(100));
    let (logs, _capture) = support::Logs::capture();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(consumer.run(inbox(pool.clone(), runs.clone()), async {
        let _ = stopped.await;
    }));
    // The driver declares the queue; publish once it has.
    tokio::time::sleep(Duration::from_secs(1)).await;
    for n in 0..PAYMENTS {
        super::publish(
            &channel,
            "payments",
            Some(&format!("p-{n}")),
            &payment_of("held", n as i64),
        )
        .await;
    }
    let terminated = flap(&server.url()).await;
    let server = crash(server).await;
    applied(&pool, Duration::from_secs(180)).await;
    stop.send(()).unwrap();
    assert!(running.await.unwrap().is_complete());
    let dead = super::dead_letter_count(&channel, "payments").await as usize;
    let tally = tally(&logs, terminated, &runs, dead);
    assert_clean("RabbitMQ", &tally, &rows(&pool).await);
    drop(server);
}

// One thread: the log capture is the test thread's.
#[tokio::test]
async fn trials_kafka_through_a_flapping_then_crashing_database() {
    use rdkafka::{
        consumer::{BaseConsumer, Consumer as _},
        producer::{FutureProducer, FutureRecord},
        ClientConfig,
    };
    if !full_trials() {
        eprintln!("trials: set TOWER_IDS_FULL_TRIALS=1 to run the two-minute trial");
        return;
    }
    let Some((server, pool)) = database().await else {
        return;
    };
    let Some(broker) = kafka_broker::Broker::start() else {
        return;
    };
    let topic = broker.topic("payments", 2).await;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &broker.addr)
        .create()
        .unwrap();
    for n in 0..PAYMENTS {
        let key = format!("p-{n}");
        let body = payment_of("held", n as i64);
        let headers = rdkafka::message::OwnedHeaders::new().insert(rdkafka::message::Header {
            key: "idempotency-key",
            value: Some(key.as_str()),
        });
        producer
            .send(
                FutureRecord::to(&topic)
                    .key(&key)
                    .payload(&body)
                    .headers(headers),
                Duration::from_secs(5),
            )
            .await
            .unwrap();
    }
    let runs = Runs::default();
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", &broker.addr)
        .set("group.id", format!("g-{}", uuid::Uuid::now_v7()))
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "1000");
    let consumer = KafkaConsumer::new(config, [topic.clone()])
        .unwrap()
        .max_attempts(2)
        .retry_pause(Duration::from_millis(100))
        .create_dead_letter_topics(true);
    let (logs, _capture) = support::Logs::capture();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(consumer.run(inbox(pool.clone(), runs.clone()), async {
        let _ = stopped.await;
    }));
    let terminated = flap(&server.url()).await;
    let server = crash(server).await;
    applied(&pool, Duration::from_secs(180)).await;
    stop.send(()).unwrap();
    assert!(running.await.unwrap().is_complete());
    let reader: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &broker.addr)
        .create()
        .unwrap();
    let dead = reader
        .fetch_watermarks(&format!("{topic}.dead"), 0, Duration::from_secs(5))
        .map_or(0, |(low, high)| (high - low) as usize);
    let tally = tally(&logs, terminated, &runs, dead);
    assert_clean("Kafka", &tally, &rows(&pool).await);
    drop(server);
}
