//! RabbitMQ through a TCP proxy that the test cuts: the relay backs off while the
//! broker cannot be reached, resumes when it can, and loses nothing; a connection closed
//! while a round is publishing lets no message overtake an earlier one of its key.

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use futures_util::StreamExt as _;
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{
        tcp::{OwnedReadHalf, OwnedWriteHalf},
        TcpListener, TcpStream,
    },
    sync::broadcast,
};
use tower_ids::outbox::{amqp::AmqpSink, Message};

use crate::{database::TestDatabase, outbox, rows, Queue, Running};

/// Forwards 127.0.0.1:PORT to RabbitMQ; `cut` closes every connection and refuses new
/// ones until `restore`; `close` closes every connection as the broker does when told
/// to (`rabbitmqctl close_all_connections`), and lets new ones in at once.
struct Proxy {
    port: u16,
    open: Arc<AtomicBool>,
    cuts: broadcast::Sender<()>,
    closes: broadcast::Sender<()>,
}

impl Proxy {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let open = Arc::new(AtomicBool::new(true));
        let (cuts, _) = broadcast::channel(4);
        let (closes, _) = broadcast::channel(4);
        let (accept_open, accept_cuts, accept_closes) =
            (open.clone(), cuts.clone(), closes.clone());
        tokio::spawn(async move {
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    return;
                };
                if !accept_open.load(Ordering::SeqCst) {
                    continue; // dropped: the client sees the connection closed
                }
                let (mut cut, close) = (accept_cuts.subscribe(), accept_closes.subscribe());
                let closing = Arc::new(tokio::sync::Notify::new());
                tokio::spawn(async move {
                    let Ok(outbound) = TcpStream::connect("127.0.0.1:5672").await else {
                        return;
                    };
                    let (client_reads, client_writes) = inbound.into_split();
                    let (broker_reads, broker_writes) = outbound.into_split();
                    tokio::select! {
                        () = to_broker(client_reads, broker_writes, close, closing.clone()) => {}
                        () = to_client(broker_reads, client_writes, closing) => {}
                        _ = cut.recv() => {}
                    }
                });
            }
        });
        Self {
            port,
            open,
            cuts,
            closes,
        }
    }

    /// A sink to RabbitMQ through the proxy, quick to give up connecting.
    fn sink(&self) -> AmqpSink {
        AmqpSink::new(
            format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port),
            "",
        )
        .connect_timeout(Duration::from_millis(500))
    }

    fn cut(&self) {
        self.open.store(false, Ordering::SeqCst);
        let _ = self.cuts.send(());
    }

    fn restore(&self) {
        self.open.store(true, Ordering::SeqCst);
    }

    /// What RabbitMQ does to a connection it is told to close, at the worst moment for
    /// a relay: once the client sends again, the broker takes that, drops whatever the
    /// client sends after it, and sends the client a `connection.close` once it has
    /// dropped some (so the client is still sending when it reads it). The sockets go 30 ms
    /// after.
    async fn close(&self) {
        let _ = self.closes.send(());
        tokio::time::sleep(Duration::from_millis(30)).await;
        let _ = self.cuts.send(());
    }
}

/// Copies what the client sends to the broker until either end goes; after `close`,
/// copies the next read, then drops the rest, and tells `closing` once it has dropped
/// some.
async fn to_broker(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut close: broadcast::Receiver<()>,
    closing: Arc<tokio::sync::Notify>,
) {
    let mut buffer = vec![0; 16 * 1024];
    let (mut armed, mut deaf, mut told) = (false, false, false);
    loop {
        let read = tokio::select! {
            read = from.read(&mut buffer) => read,
            _ = close.recv(), if !armed => {
                armed = true;
                continue;
            }
        };
        let read = match read {
            Ok(0) | Err(_) => return,
            Ok(read) => read,
        };
        if deaf {
            if !told {
                closing.notify_one();
                told = true;
            }
            continue;
        }
        if to.write_all(&buffer[..read]).await.is_err() {
            return;
        }
        deaf = armed;
    }
}

/// Copies the broker's frames to the client, a whole frame at a time, until either end
/// goes; once `closing`, sends the client a `connection.close` (320,
/// `CONNECTION_FORCED`) between two frames, and nothing after it.
async fn to_client(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    closing: Arc<tokio::sync::Notify>,
) {
    loop {
        // A frame: type, channel, size (7 bytes), the payload, 0xCE.
        let mut header = [0u8; 7];
        tokio::select! {
            read = from.read_exact(&mut header) => if read.is_err() { return },
            () = closing.notified() => {
                let _ = to.write_all(&connection_close()).await;
                return std::future::pending().await;
            }
        }
        let size = u32::from_be_bytes([header[3], header[4], header[5], header[6]]);
        let mut rest = vec![0; size as usize + 1];
        if from.read_exact(&mut rest).await.is_err()
            || to.write_all(&header).await.is_err()
            || to.write_all(&rest).await.is_err()
        {
            return;
        }
    }
}

/// An AMQP 0-9-1 `connection.close` frame, as RabbitMQ sends it to a connection it was
/// told to close.
fn connection_close() -> Vec<u8> {
    let text = b"CONNECTION_FORCED - closed by the test";
    let mut method = Vec::new();
    method.extend(10u16.to_be_bytes()); // class: connection
    method.extend(50u16.to_be_bytes()); // method: close
    method.extend(320u16.to_be_bytes()); // reply code
    method.push(text.len() as u8);
    method.extend(text);
    method.extend([0, 0, 0, 0]); // the class and method that caused it: none
    let mut frame = vec![1, 0, 0]; // a method frame on channel 0
    frame.extend((method.len() as u32).to_be_bytes());
    frame.extend(method);
    frame.push(0xCE);
    frame
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
    let relay = outbox
        .relay(proxy.sink())
        .poll_interval(Duration::from_millis(10))
        .max_outage_backoff(Duration::from_millis(400))
        .publish_timeout(Duration::from_secs(2))
        .build();
    let (logs, _guard) = crate::support::Logs::capture();
    let running = Running::start(relay);

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
    running.stop().await;

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

/// What `rabbitmqctl close_all_connections` does to a relay in the middle of a round:
/// the sink's connection drops with a key's messages sent on it and unconfirmed, and
/// the sink connects again at once. A message of that key sent on the new connection
/// must not reach the queue before the earlier ones that the old one lost: the first
/// copy of each message the queue holds (a consumer's inbox drops the repeats) is in
/// the key's commit order.
#[tokio::test]
async fn a_connection_closed_mid_round_lets_no_message_overtake_an_earlier_one_of_its_key() {
    const MESSAGES: usize = 4_000;
    const KEYS: usize = 4;
    let Some(db) = TestDatabase::create().await else {
        return;
    };
    let Some(queue) = Queue::declare("reset").await else {
        return;
    };
    let (pool, outbox, _store) = outbox(&db, 8).await;
    let mut transaction = pool.begin().await.unwrap();
    for n in 0..MESSAGES {
        let message =
            Message::new(&queue.name, n.to_string()).partition_key(format!("k{}", n % KEYS));
        outbox.enqueue(&mut transaction, message).await.unwrap();
    }
    transaction.commit().await.unwrap();

    let proxy = Proxy::start().await;
    let relay = outbox
        .relay(proxy.sink())
        .poll_interval(Duration::from_millis(10))
        .batch_size(256)
        .max_outage_backoff(Duration::from_millis(50))
        .publish_timeout(Duration::from_secs(2))
        .build();
    let running = Running::start(relay);
    // A close after each round the relay marks, so that each lands while it is at
    // work: the next round's first publication is what the broker takes last.
    let (mut closes, mut published) = (0, 0);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (pending, now_published, _) = rows(&pool).await;
        if pending == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{:?} (pending, published, dead) after {closes} closes",
            rows(&pool).await
        );
        if now_published > published && closes < 20 {
            published = now_published;
            proxy.close().await;
            closes += 1;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    running.stop().await;
    assert!(closes >= 5, "only {closes} closes");

    let copies = queue.waiting().await as usize;
    let received = queue.receive(copies, Duration::from_secs(20)).await;
    let mut seen = std::collections::HashSet::new();
    let mut last: std::collections::HashMap<String, usize> = Default::default();
    let mut overtaken = Vec::new();
    for message in &received {
        let n: usize = message.payload.parse().unwrap();
        if !seen.insert(n) {
            continue;
        }
        let key = message.headers["x-partition-key"].clone();
        if let Some(previous) = last.insert(key.clone(), n) {
            if n < previous {
                overtaken.push(format!("{key}: {n} after {previous}"));
            }
        }
    }
    assert!(
        overtaken.is_empty(),
        "{} messages overtaken by a later one of their key ({closes} closes, {copies} \
         copies): {:?}",
        overtaken.len(),
        &overtaken[..overtaken.len().min(10)]
    );
    assert_eq!(
        seen.len(),
        MESSAGES,
        "every message, {copies} copies in all"
    );
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
    let running = Running::start(relay);
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
    running.stop().await;
    assert_eq!(seen, (0..10).collect());
    let (pending, published, dead) = rows(&pool).await;
    assert_eq!((pending, published, dead), (0, 10, 0));
    queue.delete().await;
}

/// An exchange that does not exist makes RabbitMQ close the channel at the first
/// message, which fails every confirm pending on it: each message is then sent again
/// alone on a new channel, refused there, and dead-lettered after its attempts with the
/// broker's reason. Channels that close round after round hold no message back for
/// good.
#[tokio::test]
async fn a_missing_exchange_refuses_each_message_for_itself_and_dead_letters_them() {
    const MESSAGES: usize = 12;
    let Some(db) = TestDatabase::create().await else {
        return;
    };
    let Some(queue) = Queue::declare("missing").await else {
        return;
    };
    let (pool, outbox, _store) = outbox(&db, 4).await;
    let mut connection = pool.acquire().await.unwrap();
    for n in 0..MESSAGES {
        let message = Message::new(&queue.name, n.to_string()).partition_key(format!("k{}", n % 3));
        outbox.enqueue(&mut connection, message).await.unwrap();
    }
    drop(connection);
    let exchange = format!("{}-missing", queue.name);
    let relay = outbox
        .relay(AmqpSink::new(crate::rabbitmq::url(), exchange.as_str()))
        .max_attempts(2)
        .retry_backoff(Duration::from_millis(20), Duration::from_millis(20))
        .build();
    let mut rounds = Vec::new();
    for _ in 0..200 {
        rounds.push(relay.round().await.unwrap());
        if rows(&pool).await.0 == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(
        rows(&pool).await,
        (0, 0, MESSAGES as i64),
        "every message dead: {rounds:?}"
    );
    let dead = outbox.dead_letters(100).await.unwrap();
    assert_eq!(dead.len(), MESSAGES);
    for letter in &dead {
        assert_eq!(letter.attempts, 2);
        let error = letter.last_error.as_deref().unwrap_or_default();
        assert!(error.contains("no exchange"), "{error}");
    }
    assert_eq!(queue.waiting().await, 0);
    queue.delete().await;
}

/// Sustained backpressure: a queue capped at 16 messages with `reject-publish`, a
/// consumer slower than the relay, 8 keys of 250 messages each. A nacked message's key
/// goes one message at a time from then on, so no later message of a key reaches the
/// queue before an earlier one; what was in flight behind the spell's first nack is the
/// only window, and the test prints what it let through.
#[tokio::test]
async fn a_full_queue_under_sustained_backpressure_keeps_each_keys_order() {
    sustained_backpressure(false).await;
}

/// The same, the relay's connection closed by the broker every 200 messages consumed.
#[tokio::test]
async fn a_full_queue_under_backpressure_and_closed_connections_keeps_each_keys_order() {
    sustained_backpressure(true).await;
}

async fn sustained_backpressure(closing: bool) {
    const KEYS: usize = 8;
    const PER_KEY: usize = 250;
    let Some(db) = TestDatabase::create().await else {
        return;
    };
    let mut arguments = lapin::types::FieldTable::default();
    arguments.insert("x-max-length".into(), lapin::types::AMQPValue::LongInt(16));
    arguments.insert(
        "x-overflow".into(),
        lapin::types::AMQPValue::LongString("reject-publish".into()),
    );
    let Some(queue) = Queue::declare_with("capped", arguments).await else {
        return;
    };
    let (pool, outbox, _store) = outbox(&db, 8).await;
    let mut transaction = pool.begin().await.unwrap();
    for n in 0..KEYS * PER_KEY {
        let message =
            Message::new(&queue.name, n.to_string()).partition_key(format!("k{}", n % KEYS));
        outbox.enqueue(&mut transaction, message).await.unwrap();
    }
    transaction.commit().await.unwrap();

    let (logs, _capture) = crate::support::Logs::capture();
    let proxy = Proxy::start().await;
    let relay = outbox
        .relay(proxy.sink())
        .batch_size(256)
        .max_attempts(2)
        .max_outage_backoff(Duration::from_millis(20))
        .build();
    let running = Running::start(relay);
    queue
        .channel
        .basic_qos(8, lapin::options::BasicQosOptions::default())
        .await
        .unwrap();
    let mut consumer = queue
        .channel
        .basic_consume(
            queue.name.as_str().into(),
            "".into(),
            lapin::options::BasicConsumeOptions::default(),
            lapin::types::FieldTable::default(),
        )
        .await
        .unwrap();
    let mut seen = std::collections::HashSet::new();
    let mut last: std::collections::HashMap<String, usize> = Default::default();
    let (mut overtaken, mut copies) = (Vec::new(), 0);
    while seen.len() < KEYS * PER_KEY {
        let delivery = tokio::time::timeout(Duration::from_secs(30), consumer.next())
            .await
            .unwrap_or_else(|_| panic!("only {} messages within 30 s", seen.len()))
            .expect("the consumer stays open")
            .unwrap();
        copies += 1;
        if closing && copies % 200 == 0 {
            proxy.close().await;
        }
        let n: usize = std::str::from_utf8(&delivery.data)
            .unwrap()
            .parse()
            .unwrap();
        let key = format!("k{}", n % KEYS);
        // The consumer is slower than the relay: the queue stays full.
        tokio::time::sleep(Duration::from_millis(1)).await;
        delivery
            .ack(lapin::options::BasicAckOptions::default())
            .await
            .unwrap();
        if !seen.insert(n) {
            continue;
        }
        if let Some(previous) = last.insert(key.clone(), n) {
            if n < previous {
                overtaken.push(format!("{key}: {n} after {previous}"));
            }
        }
    }
    // A confirm lost with a closed connection leaves its message pending though the
    // queue had it: the relay publishes it again (a repeat) and marks it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while rows(&pool).await.0 > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{:?}",
            rows(&pool).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    running.stop().await;
    let spells = logs.events("outbox.destination_full").len();
    eprintln!(
        "{} messages through a queue of 16{}: {copies} deliveries, {} overtaken by a later one of their key, {spells} full spells",
        KEYS * PER_KEY,
        if closing { ", its connection closed every 200" } else { "" },
        overtaken.len()
    );
    assert_eq!(spells, 1, "the queue was full: one spell of backpressure");
    // 0 to 5 in trials here; 184 when every nack let the key's next message through.
    assert!(
        overtaken.len() <= 4 * KEYS,
        "at most what the spell's first round had in flight: {overtaken:?}"
    );
    let (pending, published, dead) = rows(&pool).await;
    assert_eq!((pending, published, dead), (0, (KEYS * PER_KEY) as i64, 0));
    queue.delete().await;
}
