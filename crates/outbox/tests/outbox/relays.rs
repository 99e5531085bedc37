//! Several relays on one outbox: the work is shared, nothing is published twice, and
//! each partition key's messages are published in the order their transactions
//! committed, with enqueuing transactions racing each other.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use tower_ids::outbox::{Confirm, Message, Outgoing, Sink, SinkError};

use crate::{database::TestDatabase, outbox, rows, Running};

/// A sink that records what it was given, in order, taking a little while for each.
#[derive(Clone, Default)]
pub(crate) struct Counting {
    pub(crate) published: Arc<Mutex<Vec<(String, String)>>>,
}

impl Sink for Counting {
    async fn publish(&self, message: &Outgoing<'_>) -> Result<Confirm, SinkError> {
        // The publication's correlation ID is the task's, as its header says.
        let current = tower_ids::correlation::CorrelationId::current().expect("a correlation ID");
        let header = message
            .headers()
            .find(|(name, _)| *name == "x-correlation-id");
        assert_eq!(header.map(|(_, value)| value), Some(current.as_str()));
        tokio::time::sleep(Duration::from_micros(rand::random_range(0..300))).await;
        self.published.lock().unwrap().push((
            message.partition_key().unwrap_or_default().to_owned(),
            String::from_utf8(message.payload().to_vec()).unwrap(),
        ));
        Ok(Confirm::taken())
    }
}

const KEYS: usize = 20;
const WRITERS: usize = 16;
const PER_WRITER: usize = 125;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_relays_share_the_work_and_keep_each_keys_commit_order() {
    let Some(db) = TestDatabase::create().await else {
        return;
    };
    let (pool, outbox, _store) = outbox(&db, 24).await;
    sqlx::raw_sql("CREATE TABLE sequences (key text PRIMARY KEY, last bigint NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();

    // Three relays, running while the writers write.
    let sink = Counting::default();
    let relays: Vec<Running> = (0..3)
        .map(|_| {
            Running::start(
                outbox
                    .relay(sink.clone())
                    .batch_size(32)
                    .poll_interval(Duration::from_millis(5))
                    .build(),
            )
        })
        .collect();

    // Writers: each transaction takes the key's next sequence number (a row lock held
    // to its commit, as a domain write would), enqueues, and sometimes dawdles before
    // committing, so transactions of one key overlap and commit out of ID order if the
    // outbox let them.
    let mut writers = Vec::new();
    for writer in 0..WRITERS {
        let pool = pool.clone();
        let outbox = outbox.clone();
        writers.push(tokio::spawn(async move {
            for n in 0..PER_WRITER {
                let key = format!("k{}", (writer * 7 + n) % KEYS);
                let mut tx = pool.begin().await.unwrap();
                let message = Message::new("events", String::new()).partition_key(&key);
                // Enqueue first: the enqueue's lock on the key orders the transactions.
                let id = outbox.enqueue(&mut tx, message).await.unwrap();
                let seq: i64 = sqlx::query_scalar(
                    "INSERT INTO sequences (key, last) VALUES ($1, 1) \
                     ON CONFLICT (key) DO UPDATE SET last = sequences.last + 1 RETURNING last",
                )
                .bind(&key)
                .fetch_one(&mut *tx)
                .await
                .unwrap();
                sqlx::query("UPDATE tower_ids_outbox SET payload = $1 WHERE id = $2")
                    .bind(seq.to_string().into_bytes())
                    .bind(id.0)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                if rand::random_range(0..4) == 0 {
                    tokio::time::sleep(Duration::from_millis(rand::random_range(1..5))).await;
                }
                tx.commit().await.unwrap();
            }
        }));
    }
    for writer in writers {
        writer.await.unwrap();
    }
    let total = WRITERS * PER_WRITER;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while sink.published.lock().unwrap().len() < total {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} of {total} published",
            sink.published.lock().unwrap().len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for relay in relays {
        relay.stop().await;
    }

    let published = sink.published.lock().unwrap().clone();
    assert_eq!(published.len(), total, "every message once");
    let mut last: HashMap<String, i64> = HashMap::new();
    for (key, seq) in &published {
        let seq: i64 = seq.parse().unwrap();
        let previous = last.insert(key.clone(), seq).unwrap_or(0);
        assert_eq!(
            seq,
            previous + 1,
            "key {key}: {seq} published after {previous}, not in commit order"
        );
    }
    assert_eq!(last.len(), KEYS);
    assert_eq!(rows(&pool).await, (0, i64::try_from(total).unwrap(), 0));
}

/// Takes every message but those for `refused`.
struct Refusing(Counting);

impl Sink for Refusing {
    async fn publish(&self, message: &Outgoing<'_>) -> Result<Confirm, SinkError> {
        if message.destination() == "refused" {
            return Err(SinkError::rejected("no such queue"));
        }
        self.0.publish(message).await
    }
}

#[tokio::test]
async fn a_key_waiting_out_a_backoff_holds_up_no_other_key() {
    let Some(db) = TestDatabase::create().await else {
        return;
    };
    let (pool, outbox, _store) = outbox(&db, 4).await;
    let mut connection = pool.acquire().await.unwrap();
    // Key `stuck`: a refused message, then more than a whole window of its own.
    outbox
        .enqueue(
            &mut connection,
            Message::new("refused", "0").partition_key("stuck"),
        )
        .await
        .unwrap();
    for n in 1..=20 {
        let message = Message::new("events", n.to_string()).partition_key("stuck");
        outbox.enqueue(&mut connection, message).await.unwrap();
    }
    outbox
        .enqueue(
            &mut connection,
            Message::new("events", "free").partition_key("other"),
        )
        .await
        .unwrap();
    let sink = Counting::default();
    let relay = outbox
        .relay(Refusing(sink.clone()))
        .batch_size(2)
        .retry_backoff(Duration::from_secs(3600), Duration::from_secs(3600))
        .build();
    let first = relay.round().await.unwrap();
    assert_eq!((first.rejected, first.published), (1, 0), "{first:?}");
    for _ in 0..3 {
        relay.round().await.unwrap();
    }
    let published = sink.published.lock().unwrap().clone();
    assert_eq!(
        published,
        vec![("other".to_owned(), "free".to_owned())],
        "the other key goes on; the stuck key's later messages wait for its head"
    );
}

/// An idle relay is woken by a commit, not by its poll: with the fallback poll an hour
/// away, a message committed after the relay went idle is published at once, and so is
/// one whose backoff ends while it waits. (The latency itself is measured in
/// `benches/outbox.rs`.)
#[tokio::test]
async fn an_idle_relay_is_woken_by_a_commit_and_by_a_backoff_that_ends() {
    let Some(db) = TestDatabase::create().await else {
        return;
    };
    let (pool, outbox, _store) = outbox(&db, 4).await;
    let sink = Counting::default();
    let relay = outbox
        .relay(Refusing(sink.clone()))
        .poll_interval(Duration::from_secs(3600))
        .retry_backoff(Duration::from_millis(300), Duration::from_millis(300))
        .max_attempts(2)
        .build();
    let running = Running::start(relay);
    let published = |count: usize| {
        let sink = sink.clone();
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            while sink.published.lock().unwrap().len() < count {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "not woken: {:?}",
                    sink.published.lock().unwrap()
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    // Idle by now; then one commit at a time.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut transaction = pool.begin().await.unwrap();
    outbox
        .enqueue(&mut transaction, Message::new("events", "1"))
        .await
        .unwrap();
    transaction.commit().await.unwrap();
    published(1).await;
    // Refused once, its backoff ends while the relay is idle: its second attempt is
    // dead-lettered without waiting for the poll.
    let mut connection = pool.acquire().await.unwrap();
    outbox
        .enqueue(&mut connection, Message::new("refused", "x"))
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while rows(&pool).await.2 == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the backoff's end did not wake the relay"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    outbox
        .enqueue(&mut connection, Message::new("events", "2"))
        .await
        .unwrap();
    published(2).await;
    running.stop().await;
    assert_eq!(rows(&pool).await, (0, 2, 1));
}

/// The relay listens on a connection of its own: on a pool of one connection, an idle
/// relay still has it for its rounds.
#[tokio::test]
async fn a_relay_on_a_pool_of_one_connection_listens_and_still_publishes() {
    let Some(db) = TestDatabase::create().await else {
        return;
    };
    let (pool, outbox, _store) = outbox(&db, 4).await;
    let one = tower_ids::outbox::Outbox::new(db.pool(1).await);
    let sink = Counting::default();
    let relay = one.relay(sink.clone()).build();
    let running = Running::start(relay);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut connection = pool.acquire().await.unwrap();
    outbox
        .enqueue(&mut connection, Message::new("events", "1"))
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while sink.published.lock().unwrap().is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the relay never published: its one connection is taken"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    running.stop().await;
}
