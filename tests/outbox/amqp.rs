//! RabbitMQ through a TCP proxy that the test cuts: the relay backs off while the
//! broker cannot be reached, resumes when it can, and loses nothing.

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use futures_util::StreamExt as _;
use tokio::{
    net::{TcpListener, TcpStream},
    sync::broadcast,
};
use tower_ids::outbox::{amqp::AmqpSink, Message};

use crate::{database::TestDatabase, outbox, rows, Queue};

/// Forwards 127.0.0.1:PORT to RabbitMQ; `cut` closes every connection and refuses new
/// ones until `restore`.
struct Proxy {
    port: u16,
    open: Arc<AtomicBool>,
    cuts: broadcast::Sender<()>,
}

impl Proxy {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let open = Arc::new(AtomicBool::new(true));
        let (cuts, _) = broadcast::channel(4);
        let (accept_open, accept_cuts) = (open.clone(), cuts.clone());
        tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    return;
                };
                if !accept_open.load(Ordering::SeqCst) {
                    continue; // dropped: the client sees the connection closed
                }
                let mut cut = accept_cuts.subscribe();
                tokio::spawn(async move {
                    let Ok(mut outbound) = TcpStream::connect("127.0.0.1:5672").await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = cut.recv() => {}
                    }
                });
            }
        });
        Self { port, open, cuts }
    }

    fn cut(&self) {
        self.open.store(false, Ordering::SeqCst);
        let _ = self.cuts.send(());
    }

    fn restore(&self) {
        self.open.store(true, Ordering::SeqCst);
    }
}

#[tokio::test]
async fn a_broker_that_cannot_be_reached_is_backed_off_from_and_nothing_is_lost() {
    let Some(db) = TestDatabase::create().await else {
        return;
    };
    let Some(queue) = Queue::declare("outage").await else {
        return;
    };
    let (pool, outbox, _store) = outbox(&db, 8).await;
    let proxy = Proxy::start().await;
    let sink = AmqpSink::new(
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", proxy.port),
        "",
    )
    .connect_timeout(Duration::from_millis(500));
    let relay = outbox
        .relay(sink)
        .poll_interval(Duration::from_millis(10))
        .max_outage_backoff(Duration::from_millis(400))
        .publish_timeout(Duration::from_secs(2))
        .build();
    let (logs, _guard) = crate::support::Logs::capture();
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let running = tokio::spawn(async move {
        relay
            .run(async move {
                let _ = stopped.wait_for(|stop| *stop).await;
            })
            .await;
    });

    let enqueue = |from: usize, to: usize| {
        let (pool, outbox, queue) = (pool.clone(), outbox.clone(), queue.name.clone());
        async move {
            let mut connection = pool.acquire().await.unwrap();
            for n in from..to {
                let message =
                    Message::new(&queue, n.to_string()).partition_key(format!("k{}", n % 5));
                outbox.enqueue(&mut connection, message).await.unwrap();
            }
        }
    };
    enqueue(0, 100).await;
    let first = queue.receive(100, Duration::from_secs(20)).await;
    proxy.cut();
    enqueue(100, 300).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(rows(&pool).await.0, 200, "nothing published while cut");
    proxy.restore();
    let rest = queue.receive(200, Duration::from_secs(20)).await;
    stop.send(true).unwrap();
    running.await.unwrap();

    let mut per_key: std::collections::HashMap<String, Vec<usize>> = Default::default();
    for message in first.iter().chain(&rest) {
        per_key
            .entry(message.headers["x-partition-key"].clone())
            .or_default()
            .push(message.payload.parse().unwrap());
    }
    for (key, numbers) in &per_key {
        assert!(
            numbers.windows(2).all(|w| w[0] < w[1]),
            "{key}: {numbers:?}"
        );
    }
    assert_eq!(per_key.values().map(Vec::len).sum::<usize>(), 300);
    assert_eq!(rows(&pool).await, (0, 300, 0));
    let unavailable = logs.events("outbox.sink_unavailable");
    assert_eq!(unavailable.len(), 1, "one WARN per outage: {}", logs.raw());
    assert_eq!(unavailable[0]["level"], "WARN");
    assert_eq!(logs.events("outbox.sink_recovered").len(), 1);
    queue.delete().await;
}

/// A queue full to its `x-max-length` with `x-overflow: reject-publish` nacks what it
/// cannot take: backpressure, not a refusal of the message. The relay backs off without
/// counting attempts (two attempts would dead-letter here), and once a consumer makes
/// room every message is published, none dead.
#[tokio::test]
async fn a_full_queue_is_backed_off_from_and_counts_no_attempt() {
    let Some(db) = TestDatabase::create().await else {
        return;
    };
    let mut arguments = lapin::types::FieldTable::default();
    arguments.insert("x-max-length".into(), lapin::types::AMQPValue::LongInt(2));
    arguments.insert(
        "x-overflow".into(),
        lapin::types::AMQPValue::LongString("reject-publish".into()),
    );
    let Some(queue) = Queue::declare_with("full", arguments).await else {
        return;
    };
    let (pool, outbox, _store) = outbox(&db, 8).await;
    let relay = outbox
        .relay(AmqpSink::new("amqp://guest:guest@127.0.0.1:5672/%2f", ""))
        .max_attempts(2)
        .retry_backoff(Duration::from_millis(10), Duration::from_millis(10))
        .max_outage_backoff(Duration::from_millis(200))
        .build();
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let running = tokio::spawn(async move {
        relay
            .run(async move {
                let _ = stopped.wait_for(|stop| *stop).await;
            })
            .await;
    });
    let mut connection = pool.acquire().await.unwrap();
    for n in 0..10 {
        let message = Message::new(&queue.name, n.to_string()).partition_key("k");
        outbox.enqueue(&mut connection, message).await.unwrap();
    }
    // The queue takes two; the rest are nacked, round after round.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (pending, _, dead) = rows(&pool).await;
    let attempts: i32 = sqlx::query_scalar(
        "SELECT coalesce(max(attempts), 0) FROM tower_ids_outbox WHERE published_at IS NULL",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        pending >= 8,
        "the full queue took at most two: {pending} pending"
    );
    assert_eq!((dead, attempts), (0, 0), "no attempt counted, none dead");

    // A consumer makes room: every message arrives (a message taken while an earlier
    // one was nacked comes again after it).
    let mut consumer = queue
        .channel
        .basic_consume(
            queue.name.as_str().into(),
            "".into(),
            lapin::options::BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await
        .unwrap();
    let mut seen = std::collections::BTreeSet::new();
    while seen.len() < 10 {
        let delivery = tokio::time::timeout(Duration::from_secs(20), consumer.next())
            .await
            .unwrap_or_else(|_| panic!("only {seen:?} within 20 s"))
            .expect("the consumer stays open")
            .unwrap();
        seen.insert(
            String::from_utf8(delivery.data)
                .unwrap()
                .parse::<usize>()
                .unwrap(),
        );
    }
    stop.send(true).unwrap();
    running.await.unwrap();
    assert_eq!(seen, (0..10).collect());
    let (pending, published, dead) = rows(&pool).await;
    assert_eq!((pending, published, dead), (0, 10, 0));
    queue.delete().await;
}
