//! The RabbitMQ the tests run against, the names each test owns on it, and the
//! `control_plane` controller as a child process.

use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use futures_util::StreamExt as _;
use lapin::{
    options::{
        BasicPublishOptions, ConfirmSelectOptions, ExchangeDeleteOptions, QueueDeleteOptions,
    },
    types::FieldTable,
    BasicProperties, Channel, Connection, ConnectionProperties,
};
use serde_json::{json, Value};
use tower_ids::{
    correlation::{CorrelationId, MessageCorrelation},
    idempotency::IdempotencyKey,
};

pub use rabbitmq::{connect, url};
use tower_ids_test_support::rabbitmq;

use super::demo::example_path;

/// An exchange and a controller queue of this test's own, with a queue collecting
/// every outcome published on the exchange; removed by [`remove`](Self::remove), or on
/// drop (from a thread of its own) if the test failed before.
pub struct Topology {
    pub exchange: String,
    pub queue: String,
    pub dir: PathBuf,
    pub channel: Channel,
    outcomes: Arc<Mutex<Vec<Outcome>>>,
    removed: bool,
}

/// One outcome as the broker delivered it.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub body: Vec<u8>,
    pub json: Value,
    pub correlation_header: Option<String>,
}

static NEXT: AtomicU64 = AtomicU64::new(0);

impl Topology {
    pub async fn new(connection: &Connection, name: &str) -> Self {
        let unique = format!(
            "tower-ids.test.{name}.{}.{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let dir = std::env::temp_dir().join(&unique);
        std::fs::create_dir_all(&dir).unwrap();
        let channel = connection.create_channel().await.unwrap();
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let exchange = format!("{unique}.x");
        // Every outcome, in the order published: an exclusive queue that goes with
        // this connection.
        let mut consumer = rabbitmq::topic_consumer(&channel, &exchange, "ev.outcome.#").await;
        let outcomes = Arc::new(Mutex::new(Vec::new()));
        let sink = outcomes.clone();
        tokio::spawn(async move {
            while let Some(Ok(delivery)) = consumer.next().await {
                let correlation_header = MessageCorrelation::new()
                    .read(delivery.properties.headers())
                    .ok()
                    .flatten()
                    .map(|id| id.to_string());
                sink.lock().unwrap().push(Outcome {
                    json: serde_json::from_slice(&delivery.data).unwrap_or(Value::Null),
                    body: delivery.data,
                    correlation_header,
                });
            }
        });
        Self {
            queue: format!("{unique}.q"),
            exchange,
            dir,
            channel,
            outcomes,
            removed: false,
        }
    }

    /// Publishes a signal envelope (persistent, confirmed) with both IDs in the
    /// envelope and the headers.
    pub async fn signal(&self, swarm: &str, signal: &str, key: &str, correlation: &str) {
        let envelope = json!({
            "timestamp": "2025-09-12T12:30:08Z",
            "version": "1",
            "kind": "signal",
            "type": signal,
            "origin": "orchestrator-test",
            "scope": {"swarmId": swarm, "role": "swarm-controller", "instance": null},
            "correlationId": correlation,
            "idempotencyKey": key,
            "data": {},
        });
        let mut headers = FieldTable::default();
        MessageCorrelation::new().inject(&mut headers, &CorrelationId::parse(correlation).unwrap());
        IdempotencyKey::new(key).unwrap().inject(&mut headers);
        self.channel
            .basic_publish(
                self.exchange.as_str().into(),
                format!("sig.{signal}.{swarm}").as_str().into(),
                BasicPublishOptions::default(),
                envelope.to_string().as_bytes(),
                BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_headers(headers),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }

    /// The outcomes collected so far.
    pub fn outcomes(&self) -> Vec<Outcome> {
        self.outcomes.lock().unwrap().clone()
    }

    /// Waits until `n` outcomes were collected, and returns them.
    pub async fn wait_outcomes(&self, n: usize, within: Duration) -> Vec<Outcome> {
        let deadline = Instant::now() + within;
        loop {
            let outcomes = self.outcomes();
            if outcomes.len() >= n {
                return outcomes;
            }
            assert!(
                Instant::now() < deadline,
                "{} outcomes after {within:?}, expected {n}",
                outcomes.len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The lines of the controllers' executions file: one per run of the handler.
    pub fn executions(&self) -> Vec<String> {
        std::fs::read_to_string(self.executions_file())
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    pub fn executions_file(&self) -> PathBuf {
        self.dir.join("executions")
    }

    /// Deletes the queue and the exchange.
    pub async fn remove(mut self) {
        delete(&self.channel, &self.queue, &self.exchange).await;
        let _ = std::fs::remove_dir_all(&self.dir);
        self.removed = true;
    }
}

async fn delete(channel: &Channel, queue: &str, exchange: &str) {
    // The queue, and the dead-letter queue the controller's driver declares beside it.
    for queue in [queue.to_owned(), format!("{queue}.dead")] {
        let _ = channel
            .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    let _ = channel
        .exchange_delete(exchange.into(), ExchangeDeleteOptions::default())
        .await;
}

impl Drop for Topology {
    fn drop(&mut self) {
        if self.removed {
            return;
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        let (queue, exchange) = (self.queue.clone(), self.exchange.clone());
        // A failed test: remove its names from a runtime of their own.
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                if let Ok(Ok(connection)) = tokio::time::timeout(
                    Duration::from_secs(5),
                    Connection::connect(&url(), ConnectionProperties::default()),
                )
                .await
                {
                    if let Ok(channel) = connection.create_channel().await {
                        delete(&channel, &queue, &exchange).await;
                    }
                }
            });
        })
        .join();
    }
}

/// A controller child process, its JSON log collected line by line.
pub struct Controller {
    child: Child,
    pub name: String,
    lines: Arc<Mutex<Vec<Value>>>,
}

impl Controller {
    /// Starts `control_plane controller` on the test's names (executions counted in
    /// its file), with `args`, and waits until it consumes.
    pub fn start(topology: &Topology, name: &str, args: &[&str]) -> Self {
        Self::start_at(&example_path("control_plane"), topology, name, args)
    }

    fn start_at(binary: &Path, topology: &Topology, name: &str, args: &[&str]) -> Self {
        let mut child = Command::new(binary)
            .args(["--amqp-url", &url(), "--exchange", &topology.exchange])
            .args(["--log-format", "json", "controller"])
            .args(["--queue", &topology.queue, "--instance", name])
            .arg("--executions-file")
            .arg(topology.executions_file())
            .args(args)
            // The layer's steps (`idempotency.replayed`, ...) are DEBUG.
            .env("RUST_LOG", "info,lapin=warn,tower_ids::idempotency=debug")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the control_plane example runs");
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = lines.clone();
        std::thread::spawn(move || {
            for line in stdout.lines() {
                let Ok(line) = line else { return };
                let value: Value = serde_json::from_str(&line)
                    .unwrap_or_else(|_| panic!("not one JSON object per line: {line}"));
                sink.lock().unwrap().push(value);
            }
        });
        let controller = Self {
            child,
            name: name.to_owned(),
            lines,
        };
        controller.wait_event("controller.ready", Duration::from_secs(30));
        controller
    }

    /// Every log line so far.
    pub fn lines(&self) -> Vec<Value> {
        self.lines.lock().unwrap().clone()
    }

    /// The log lines with `event`.
    pub fn events(&self, event: &str) -> Vec<Value> {
        self.lines()
            .into_iter()
            .filter(|line| line["fields"]["event"] == event)
            .collect()
    }

    /// Waits for the first log line with `event`.
    pub fn wait_event(&self, event: &str, within: Duration) -> Value {
        let deadline = Instant::now() + within;
        loop {
            if let Some(line) = self.events(event).into_iter().next() {
                return line;
            }
            assert!(
                Instant::now() < deadline,
                "controller {} logged no {event} within {within:?}",
                self.name
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGKILL: no ack, no goodbye; the broker requeues what it had unacked.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The correlation ID of the span a log line was written in.
pub fn span_correlation(line: &Value) -> Option<String> {
    line["spans"]
        .as_array()?
        .iter()
        .find(|span| span["name"] == "correlation")
        .and_then(|span| span["correlation_id"].as_str())
        .map(str::to_owned)
}
