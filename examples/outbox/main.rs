//! The sending side of `examples/inbox`: payments accepted over HTTP, each committed with
//! its outbox message in the request's own transaction, and relays that publish the
//! committed messages to RabbitMQ or Kafka, where the inbox consumes them. The
//! walkthrough, requests → outbox → relay → broker → inbox, is in this folder's
//! `README.md`.
//!
//! ```sh
//! createdb -h 127.0.0.1 -U postgres outbox
//! cargo run --all-features --example outbox -- serve
//! cargo run --all-features --example outbox -- relay
//! ```
//!
//! `serve`: `POST /payments` with an `Idempotency-Key` header and a body
//! `{"payments":[{"account":"acct-3","amount":125},...]}` goes through an
//! [`IdempotencyLayer`] over a [`PostgresStore`] in [`PostgresMode::Transactional`]. In
//! the request's [`Transaction`], for each payment in account order, the handler takes
//! the account's next sequence number (a row lock held to the commit), writes the
//! payment to `sent_payments` under a key of its own (`pay-<UUIDv7>`), and
//! [enqueues](Outbox::enqueue) the message the inbox expects, partitioned by account,
//! with the payment's key as the message's idempotency key. The layer stores the `201`
//! and commits: the payments, their sequence numbers, their messages and the answer
//! stand together or not at all. A retry with the same key replays the `201`, and adds
//! nothing.
//!
//! `relay`: one [`Relay`] (run as many as you like) publishes the committed messages,
//! each account's in commit order, to RabbitMQ (an [`AmqpSink`] on the default exchange,
//! to the queue `<queue-prefix>.<n>`, n the account's [`queue_of`]) or Kafka (a
//! [`KafkaSink`], to the topic, keyed by account), and marks them published.
//!
//! # Events (the `event` field)
//!
//! `outbox.ready` (serve, with "listening on URL"), `payments.accepted` per request;
//! `relay.ready`, then the library's `outbox.*` events (`outbox.published` per message
//! at DEBUG, in an `outbox.publish` span with its `message_id`; `outbox.sink_unavailable`
//! and `outbox.sink_recovered` around an outage); at a stop `outbox.stopping` or
//! `relay.stopping`, then `outbox.stopped` or `relay.stopped`.

#[path = "../support/database.rs"]
mod database;
#[path = "../support/http1.rs"]
mod http1;
#[path = "../support/shutdown.rs"]
mod shutdown;

use std::{net::SocketAddr, time::Duration};

use axum::{
    extract::State,
    http::StatusCode,
    response::{IntoResponse, Response},
    routing::post,
    Json, Router,
};
use clap::{Parser, Subcommand, ValueEnum};
use serde::{Deserialize, Serialize};
use sqlx::{postgres::PgPoolOptions, PgPool};
use tower_ids::{
    correlation::CorrelationLayer,
    idempotency::{
        store::{PostgresMode, PostgresStore, Transaction},
        IdempotencyKey, IdempotencyLayer,
    },
    outbox::{amqp::AmqpSink, kafka::KafkaSink, Message, Outbox, Relay, Sink},
};

/// Payments one request may carry: enough for a batch, few enough that a request holds
/// its accounts' locks for milliseconds.
const MAX_PAYMENTS: usize = 100;

/// The largest amount one payment may carry (in cents: 1,000,000.00): the inbox adds
/// amounts into a `bigint` balance, so a payment it could never apply is refused here,
/// with a `400`, rather than accepted with a `201` and left to fail at the consumer.
const MAX_AMOUNT: i64 = 100_000_000;

/// The longest account name, in characters.
const MAX_ACCOUNT_CHARS: usize = 64;

/// The longest a relay waits between tries while the broker is away (the library's
/// default is 30 s): a broker back, or a connection the broker closed, is used again
/// within 5 s.
const MAX_OUTAGE_BACKOFF: Duration = Duration::from_secs(5);

/// A relay's pool: the connection of its round, one for trimming and the backlog
/// gauges, one spare for a round begun while a lost one is being replaced.
const RELAY_CONNECTIONS: u32 = 3;

#[derive(Parser, Debug)]
#[command(about = "Payments committed with their outbox messages, relayed to RabbitMQ or Kafka")]
struct Cli {
    /// The sender's database: payments, sequence numbers, the outbox and the
    /// idempotency records.
    #[arg(
        long,
        global = true,
        default_value = "postgres://postgres@127.0.0.1:5432/outbox"
    )]
    database_url: String,
    /// Where the messages go: `amqp` (RabbitMQ) or `kafka`. `serve` writes the
    /// destination into each message, so give both commands the same.
    #[arg(long, global = true, default_value = "amqp")]
    broker: BrokerKind,
    /// The RabbitMQ broker (`--broker amqp`).
    #[arg(
        long,
        global = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    amqp_url: String,
    /// The queues are `<queue-prefix>.0` to `<queue-prefix>.<queues - 1>`.
    #[arg(long, global = true, default_value = "inbox.payments")]
    queue_prefix: String,
    /// How many queues the accounts are spread over (an account always goes to one).
    #[arg(long, global = true, default_value_t = 4)]
    queues: u32,
    /// The Kafka bootstrap servers (`--broker kafka`).
    #[arg(long, global = true, default_value = "127.0.0.1:9092")]
    kafka_brokers: String,
    /// The topic (`--broker kafka`).
    #[arg(long, global = true, default_value = "inbox.payments")]
    topic: String,
    /// Partitions of the topic, when `relay` creates it.
    #[arg(long, global = true, default_value_t = 4)]
    partitions: i32,
    /// `text` or `json` (one object per line, with the span fields).
    #[arg(long, global = true, default_value = "text")]
    log_format: LogFormat,
    /// Where `serve` listens; port 0 picks a free one.
    #[arg(long, alias = "addr", global = true, default_value = "127.0.0.1:3000")]
    listen: SocketAddr,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum BrokerKind {
    Amqp,
    Kafka,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Accept payments over HTTP, each committed with its outbox message.
    Serve(ServeArgs),
    /// Publish the committed messages to the broker (run one per replica).
    Relay(RelayArgs),
}

#[derive(clap::Args, Debug)]
struct ServeArgs {
    /// Database connections: a request holds one from its claim to its commit, so
    /// this bounds the requests handled at once.
    #[arg(long, default_value_t = 32)]
    connections: u32,
    #[command(flatten)]
    timeouts: http1::Timeouts,
    #[command(flatten)]
    drain: shutdown::DrainArgs,
}

#[derive(clap::Args, Debug)]
struct RelayArgs {
    /// This relay's name, in its logs.
    #[arg(long, default_value = "relay-1")]
    instance: String,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let cli = Cli::parse();
    init_tracing(cli.log_format);
    match &cli.command {
        Command::Serve(args) => serve(&cli, args).await,
        Command::Relay(args) => relay(&cli, args).await,
    }
}

// ----------------------------------------------------------------------------------
// serve
// ----------------------------------------------------------------------------------

/// A request's body.
#[derive(Deserialize, Debug)]
struct Payments {
    payments: Vec<Payment>,
}

/// A payment to send: the account and the amount (in cents).
#[derive(Deserialize, Debug)]
struct Payment {
    account: String,
    amount: i64,
}

/// The message a payment becomes, as `examples/inbox` reads it.
#[derive(Serialize, Debug)]
struct Sent<'a> {
    idempotency_key: &'a str,
    account: &'a str,
    amount: i64,
}

/// The `201`: each payment's key, in the order of the request.
#[derive(Serialize, Debug)]
struct Accepted {
    keys: Vec<String>,
}

/// What the handler needs besides the transaction.
#[derive(Clone)]
struct App {
    outbox: Outbox,
    route: Route,
}

/// Where a payment's message goes: the destination `serve` writes into it.
#[derive(Clone, Debug)]
enum Route {
    /// The queue `<prefix>.<queue_of(account, queues)>`, on the default exchange.
    Queues { prefix: String, queues: u32 },
    /// The topic, keyed by account.
    Topic(String),
}

impl Route {
    fn new(cli: &Cli) -> Self {
        match cli.broker {
            BrokerKind::Amqp => Route::Queues {
                prefix: cli.queue_prefix.clone(),
                queues: cli.queues.max(1),
            },
            BrokerKind::Kafka => Route::Topic(cli.topic.clone()),
        }
    }

    fn destination(&self, account: &str) -> String {
        match self {
            Route::Queues { prefix, queues } => format!("{prefix}.{}", queue_of(account, *queues)),
            Route::Topic(topic) => topic.clone(),
        }
    }
}

/// The queue an account's payments go to: FNV-1a (64 bits) of the account, modulo
/// `queues`. Stable across processes, versions and machines, so every `serve` sends an
/// account to the same queue, and the queue's one consumer sees its payments in order.
fn queue_of(account: &str, queues: u32) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in account.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash % u64::from(queues.max(1))
}

async fn serve(
    cli: &Cli,
    args: &ServeArgs,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let pool = database::connect(
        PgPoolOptions::new().max_connections(args.connections),
        &cli.database_url,
    )
    .await?;
    schema(&pool).await?;
    let store = PostgresStore::builder(pool.clone())
        .mode(PostgresMode::Transactional)
        .build()?;
    store.migrate().await?;
    let outbox = Outbox::new(pool);
    outbox.migrate().await?;
    let layer = IdempotencyLayer::with_store(store).require_key(true);
    let drain = layer.drain();
    let app = Router::new()
        .route("/payments", post(pay))
        .layer(layer)
        .layer(CorrelationLayer::new())
        .with_state(App {
            outbox,
            route: Route::new(cli),
        });

    let listener = tokio::net::TcpListener::bind(cli.listen).await?;
    let url = format!("http://{}", listener.local_addr()?);
    tracing::info!(event = "outbox.ready", url = %url, broker = ?cli.broker, "listening on {url}");
    http1::serve(listener, app, args.timeouts, async {
        shutdown::signal().await;
        tracing::info!(
            event = "outbox.stopping",
            "stopping: no new requests, finishing those in flight"
        );
    })
    .await;
    shutdown::drain(&[drain], args.drain.timeout()).await;
    tracing::info!(event = "outbox.stopped", "stopped");
    Ok(())
}

/// The sender's tables; created once, whoever starts first (concurrent `CREATE TABLE
/// IF NOT EXISTS` can collide, hence the lock). `payment_sequences` numbers each
/// account's payments in commit order; `sent_payments` keeps what was sent, for the
/// reader (and the test) to compare with what the inbox applied.
async fn schema(pool: &PgPool) -> Result<(), sqlx::Error> {
    let mut transaction = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('examples/outbox schema'))")
        .execute(&mut *transaction)
        .await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS payment_sequences (
           account text PRIMARY KEY,
           seq bigint NOT NULL);
         CREATE TABLE IF NOT EXISTS sent_payments (
           key text PRIMARY KEY,
           account text NOT NULL,
           amount bigint NOT NULL,
           seq bigint NOT NULL,
           sent_at timestamptz NOT NULL DEFAULT now(),
           UNIQUE (account, seq))",
    )
    .execute(&mut *transaction)
    .await?;
    transaction.commit().await
}

/// Whether the inbox can apply `payment`: an account it can store and an amount its
/// balances can add.
fn applicable(payment: &Payment) -> bool {
    let chars = payment.account.chars().count();
    (1..=MAX_ACCOUNT_CHARS).contains(&chars)
        && !payment.account.chars().any(char::is_control)
        && (1..=MAX_AMOUNT).contains(&payment.amount)
}

/// `POST /payments`: each payment numbered, written and enqueued in the request's
/// transaction, which the layer commits with the `201`.
async fn pay(
    State(app): State<App>,
    tx: Transaction,
    Json(body): Json<Payments>,
) -> Result<(StatusCode, Json<Accepted>), Problem> {
    let payments = body.payments;
    if payments.is_empty() || payments.len() > MAX_PAYMENTS {
        return Err(Problem::invalid(format!(
            "a request carries 1 to {MAX_PAYMENTS} payments"
        )));
    }
    if let Some(bad) = payments.iter().find(|p| !applicable(p)) {
        return Err(Problem::invalid(format!(
            "a payment needs an account of 1 to {MAX_ACCOUNT_CHARS} printable characters and an amount of 1 to {MAX_AMOUNT}: {bad:?}"
        )));
    }
    // Account order: two requests lock the accounts they share in the same order, so
    // they wait for each other but never deadlock.
    let mut order: Vec<usize> = (0..payments.len()).collect();
    order.sort_by(|&a, &b| payments[a].account.cmp(&payments[b].account));
    let mut keys = vec![String::new(); payments.len()];
    // The transaction's connection, for the payments' writes and their messages alike.
    let mut connection = tx.lock().await.map_err(Problem::internal)?;
    for index in order {
        let payment = &payments[index];
        let key = format!("pay-{}", uuid::Uuid::now_v7());
        {
            // The next number of the account: the row stays locked to the commit, so
            // numbers follow commit order.
            sqlx::query(
                "WITH next AS (
                   INSERT INTO payment_sequences (account, seq) VALUES ($2, 1)
                   ON CONFLICT (account) DO UPDATE SET seq = payment_sequences.seq + 1
                   RETURNING seq)
                 INSERT INTO sent_payments (key, account, amount, seq)
                 SELECT $1, $2, $3, seq FROM next",
            )
            .bind(&key)
            .bind(&payment.account)
            .bind(payment.amount)
            .execute(&mut *connection)
            .await
            .map_err(Problem::internal)?;
        }
        let body = serde_json::to_vec(&Sent {
            idempotency_key: &key,
            account: &payment.account,
            amount: payment.amount,
        })
        .map_err(Problem::internal)?;
        let message = Message::new(app.route.destination(&payment.account), body)
            .partition_key(payment.account.clone())
            .header("content-type", "application/json")
            .idempotency_key(IdempotencyKey::new(&key).map_err(Problem::internal)?);
        app.outbox
            .enqueue(&mut connection, message)
            .await
            .map_err(Problem::internal)?;
        keys[index] = key;
    }
    tracing::info!(
        event = "payments.accepted",
        payments = keys.len(),
        "payments committed with their messages"
    );
    Ok((StatusCode::CREATED, Json(Accepted { keys })))
}

/// An error answer, `application/problem+json`.
#[derive(Debug)]
struct Problem {
    status: StatusCode,
    code: &'static str,
    detail: String,
}

impl Problem {
    fn invalid(detail: String) -> Self {
        Self {
            status: StatusCode::UNPROCESSABLE_ENTITY,
            code: "payments.invalid",
            detail,
        }
    }

    /// A database failure: the layer rolls the transaction back (a 5xx is never
    /// stored), and a retry with the same key runs again from scratch.
    fn internal(error: impl std::fmt::Display) -> Self {
        tracing::warn!(event = "payments.failed", error = %error, "the payments were not committed");
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            code: "payments.failed",
            detail: "the payments were not committed; retry with the same key".to_owned(),
        }
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let body = serde_json::json!({
            "type": format!("about:blank#{}", self.code),
            "title": self.status.canonical_reason().unwrap_or_default(),
            "status": self.status.as_u16(),
            "code": self.code,
            "detail": self.detail,
        });
        (
            self.status,
            [(http::header::CONTENT_TYPE, "application/problem+json")],
            body.to_string(),
        )
            .into_response()
    }
}

// ----------------------------------------------------------------------------------
// relay
// ----------------------------------------------------------------------------------

async fn relay(
    cli: &Cli,
    args: &RelayArgs,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let pool = database::connect(
        PgPoolOptions::new().max_connections(RELAY_CONNECTIONS),
        &cli.database_url,
    )
    .await?;
    let outbox = Outbox::new(pool);
    outbox.migrate().await?;
    match cli.broker {
        BrokerKind::Amqp => {
            declare_queues(cli).await?;
            let sink = AmqpSink::new(&cli.amqp_url, "");
            run(
                args,
                cli,
                outbox
                    .relay(sink)
                    .max_outage_backoff(MAX_OUTAGE_BACKOFF)
                    .build(),
            )
            .await;
        }
        BrokerKind::Kafka => {
            create_topic(cli).await?;
            // Nothing to flush at the end: each publication waited for its
            // acknowledgement.
            let sink = KafkaSink::new(&cli.kafka_brokers)?;
            run(
                args,
                cli,
                outbox
                    .relay(sink)
                    .max_outage_backoff(MAX_OUTAGE_BACKOFF)
                    .build(),
            )
            .await;
        }
    }
    tracing::info!(event = "relay.stopped", instance = %args.instance, "stopped");
    Ok(())
}

/// Runs `relay` until Ctrl-C or SIGTERM; its round under way finishes first.
async fn run<S: Sink>(args: &RelayArgs, cli: &Cli, relay: Relay<S>) {
    tracing::info!(
        event = "relay.ready",
        instance = %args.instance,
        broker = ?cli.broker,
        "relaying committed messages"
    );
    relay
        .run(async {
            let signal = shutdown::signal().await;
            tracing::info!(event = "relay.stopping", instance = %args.instance, signal, "stopping after this round");
        })
        .await;
}

/// Declares the queues (durable, as the inbox declares them), so that a message
/// published before its consumer first started is kept, not returned unroutable.
async fn declare_queues(cli: &Cli) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    use lapin::{
        options::QueueDeclareOptions, types::FieldTable, Connection, ConnectionProperties,
    };
    let connection = Connection::connect(&cli.amqp_url, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    for n in 0..cli.queues.max(1) {
        let queue = format!("{}.{n}", cli.queue_prefix);
        channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await?;
    }
    let _ = connection.close(200, "declared".into()).await;
    Ok(())
}

/// Creates the topic with `--partitions` if it is missing.
async fn create_topic(cli: &Cli) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    use rdkafka::{
        admin::{AdminClient, AdminOptions, NewTopic, TopicReplication},
        error::RDKafkaErrorCode,
        ClientConfig,
    };
    let admin: AdminClient<_> = ClientConfig::new()
        .set("bootstrap.servers", &cli.kafka_brokers)
        .create()?;
    let topic = NewTopic::new(&cli.topic, cli.partitions, TopicReplication::Fixed(1));
    for created in admin.create_topics([&topic], &AdminOptions::new()).await? {
        match created {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => return Err(format!("creating {topic}: {code}").into()),
        }
    }
    Ok(())
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "info,lapin=warn".into());
    // Straight to stdout, a line at a time: a killed process loses no line it logged.
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stdout);
    match format {
        LogFormat::Json => logs
            .json()
            .with_current_span(true)
            .with_span_list(true)
            .init(),
        LogFormat::Text => logs.init(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_account_always_goes_to_the_same_queue() {
        assert_eq!(queue_of("acct-3", 4), queue_of("acct-3", 4));
        // FNV-1a of "" is its offset basis.
        assert_eq!(queue_of("", 1_000_000), 0xcbf2_9ce4_8422_2325 % 1_000_000);
        let used: std::collections::HashSet<u64> =
            (0..50).map(|n| queue_of(&format!("acct-{n}"), 4)).collect();
        assert_eq!(used.len(), 4, "50 accounts use every queue");
    }
}
