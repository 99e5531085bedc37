//! RabbitMQ through a TCP proxy that the test cuts: the relay backs off while the
//! broker cannot be reached, resumes when it can, and loses nothing.

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

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
