//! A transactional inbox: payments consumed from RabbitMQ or Kafka, each applied to the
//! database exactly once, the acknowledgement after the commit. The walkthrough is in
//! this folder's `README.md`.
//!
//! ```sh
//! createdb -h 127.0.0.1 -U postgres inbox
//! cargo run --all-features --example inbox -- --broker amqp publish --count 100
//! cargo run --all-features --example inbox -- --broker amqp consume
//! ```
//!
//! Each message is a payment, `{"idempotency_key": "...", "account": "...", "amount":
//! 125}`. The consume loop is the library's ([`AmqpConsumer`], [`KafkaConsumer`]): it
//! decodes each delivery, hands it to a [`MessageIdempotencyLayer`] over a
//! [`PostgresStore`] in [`PostgresMode::Transactional`], and acknowledges it only once
//! the layer has answered. The layer opens the delivery's transaction (which holds the
//! key), the handler writes the payment and the balance in it
//! ([`Transaction::current`]), and the layer stores the receipt in it and commits. A
//! consumer killed between the commit and the acknowledgement gets the message again,
//! and the redelivery is replayed: the handler does not run, the stored receipt comes
//! back. What becomes of each answer (acknowledged, requeued, published again with its
//! attempt counted, dead-lettered) is the driver's table.
//!
//! # Events (the `event` field)
//!
//! This example's, per delivery: `inbox.received`, then `inbox.handled` (the handler ran
//! and its transaction committed) or `inbox.replayed` (a duplicate: nothing ran), then
//! `inbox.acking` (DEBUG, just before the driver acknowledges); at a stop
//! `inbox.stopped`, and `inbox.published` from `publish`. Each carries `delivery` (the
//! AMQP `message_id`, or the Kafka `topic:partition:offset`) and `key`. The driver's:
//! `message.consuming`, one `message.settled` per delivery with its `outcome`, and
//! `message.dead_lettered`, `message.drained` or `message.drain_unsettled`.

use std::{fmt, sync::Arc, time::Duration};

use clap::{Parser, Subcommand, ValueEnum};
use serde::{Deserialize, Serialize};
use sqlx::{postgres::PgPoolOptions, PgPool};
use tower::{service_fn, util::BoxCloneService, Service, ServiceBuilder, ServiceExt as _};
#[cfg(doc)]
use tower_ids::idempotency::message::{amqp::AmqpConsumer, kafka::KafkaConsumer};
use tower_ids::idempotency::{
    extract::KeyRejection,
    message::{Handled, MessageIdempotencyLayer, MessageKey, Received},
    store::{PostgresMode, PostgresStore, Transaction},
    Drain, IdempotencyKey, InFlight, Policy,
};

mod amqp;
#[path = "../support/database.rs"]
mod database;
mod kafka;
#[path = "../support/shutdown.rs"]
mod shutdown;

/// How long a delivery waits before it is requeued (or, on Kafka, tried again) after
/// a retryable refusal: 1 s, long enough for a store or a database that failed to come
/// back, short enough that a payment is not held up for long.
const RETRY_PAUSE: Duration = Duration::from_secs(1);

#[derive(Parser, Debug)]
#[command(about = "A transactional inbox: payments from RabbitMQ or Kafka, each applied once")]
struct Cli {
    /// Where the payments come from: `amqp` (RabbitMQ) or `kafka`.
    #[arg(long, global = true, default_value = "amqp")]
    broker: BrokerKind,
    #[command(flatten)]
    amqp: amqp::AmqpArgs,
    #[command(flatten)]
    kafka: kafka::KafkaArgs,
    /// `text` or `json` (one object per line, with the span fields).
    #[arg(long, global = true, default_value = "text")]
    log_format: LogFormat,
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
    /// Consume payments and apply each one once.
    Consume(ConsumeArgs),
    /// Publish payments with fresh keys (and some twice, as a retrying sender would).
    Publish(PublishArgs),
}

#[derive(clap::Args, Debug)]
struct ConsumeArgs {
    /// The database the payments, the balances and the idempotency records go to.
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432/inbox")]
    database_url: String,
    /// This consumer's name, in its payments rows (`handled_by`).
    #[arg(long, default_value = "inbox-1")]
    instance: String,
    /// Sleep in the handler, in the open transaction, before the writes.
    #[arg(long, default_value_t = 0)]
    handler_delay_ms: u64,
    /// Sleep between the layer's answer (the commit) and the acknowledgement.
    #[arg(long, default_value_t = 0)]
    ack_delay_ms: u64,
    /// How long a duplicate of a payment in flight waits before it is requeued.
    #[arg(long, default_value_t = 1_000)]
    in_flight_retry_ms: u64,
    #[command(flatten)]
    drain: shutdown::DrainArgs,
}

#[derive(clap::Args, Debug)]
struct PublishArgs {
    /// Payments, each with a key of its own.
    #[arg(long, default_value_t = 100)]
    count: usize,
    /// Of those, how many are published a second time, unchanged.
    #[arg(long, default_value_t = 10)]
    duplicates: usize,
    /// Accounts the payments are spread over.
    #[arg(long, default_value_t = 10)]
    accounts: usize,
}

/// A payment as it travels: the sender's key for it, the account and the amount (in
/// cents).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
struct Payment {
    idempotency_key: String,
    account: String,
    amount: i64,
}

/// The handler's outcome, stored with the payment and handed back to a redelivery.
#[derive(Serialize, Deserialize, Debug, Clone)]
struct Receipt {
    payment_id: i64,
    /// The account's balance just after this payment.
    balance: i64,
}

type HandlerError = Box<dyn std::error::Error + Send + Sync>;

/// The handler behind its idempotency layer, and this example's lines around it: what
/// a driver runs.
type Inbox = BoxCloneService<Received<Payment>, Handled<Receipt>, HandlerError>;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let cli = Cli::parse();
    init_tracing(cli.log_format);
    match cli.command {
        Command::Publish(args) => {
            let payments = payments(&args);
            let total: i64 = payments.iter().map(|p| p.amount).sum();
            // Each payment once, then the duplicates, as a sender that retried would.
            let mut sent: Vec<&Payment> = payments.iter().collect();
            sent.extend(payments.iter().take(args.duplicates));
            match cli.broker {
                BrokerKind::Amqp => amqp::publish(&cli.amqp, &sent).await?,
                BrokerKind::Kafka => kafka::publish(&cli.kafka, &sent).await?,
            }
            tracing::info!(
                event = "inbox.published",
                payments = payments.len(),
                messages = sent.len(),
                total,
                "published; once consumed, the balances add up to the total"
            );
            Ok(())
        }
        Command::Consume(args) => {
            let concurrency = match cli.broker {
                BrokerKind::Amqp => usize::from(cli.amqp.prefetch),
                BrokerKind::Kafka => cli.kafka.partitions_at_once,
            };
            let (inbox, layer) = inbox(&args, concurrency).await?;
            let drain = args.drain.timeout();
            let stopped = match cli.broker {
                BrokerKind::Amqp => amqp::consume(&cli.amqp, inbox, drain).await,
                BrokerKind::Kafka => kafka::consume(&cli.kafka, inbox, drain).await?,
            };
            // A transactional store owes nothing once a delivery is answered; another
            // store may (an outcome kept while it was away).
            shutdown::drain(&[layer], drain).await;
            tracing::info!(event = "inbox.stopped", left = ?stopped.left, "stopped");
            Ok(())
        }
    }
}

/// `count` payments with fresh keys, spread over the accounts, of 1 to 1,000.00.
fn payments(args: &PublishArgs) -> Vec<Payment> {
    let batch = uuid::Uuid::now_v7();
    (0..args.count)
        .map(|n| Payment {
            idempotency_key: format!("pay-{batch}-{n}"),
            account: format!("acct-{}", n % args.accounts.max(1)),
            amount: rand::random_range(100..=100_000),
        })
        .collect()
}

/// The database (with its tables), the store in transactional mode, the handler behind
/// the layer, and the lines around it.
async fn inbox(args: &ConsumeArgs, concurrency: usize) -> Result<(Inbox, Drain), HandlerError> {
    // A delivery holds one connection from its claim to its commit; one more for the
    // claim's first read and the store's cleaner.
    let connections = u32::try_from(concurrency + 2).unwrap_or(u32::MAX);
    let pool = database::connect(
        PgPoolOptions::new().max_connections(connections),
        &args.database_url,
    )
    .await?;
    schema(&pool).await?;
    let store = PostgresStore::builder(pool)
        .mode(PostgresMode::Transactional)
        .build()?;
    store.migrate().await?;
    let layer = MessageIdempotencyLayer::with_store(store)
        .key(|received: &Received<Payment>| payment_key(received.message()))
        .require_key(true)
        .policy(Policy::new().in_flight(InFlight::Reject {
            retry_after: Duration::from_millis(args.in_flight_retry_ms),
        }))?;
    let drain = layer.drain();
    let handler_delay = Duration::from_millis(args.handler_delay_ms);
    let instance: Arc<str> = args.instance.as_str().into();
    let handler = service_fn(move |received: Received<Payment>| {
        apply(received, handler_delay, instance.clone())
    });
    let inbox = ServiceBuilder::new().layer(layer).service(handler);
    let ack_delay = Duration::from_millis(args.ack_delay_ms);
    let observed = service_fn(move |received| observed(inbox.clone(), received, ack_delay));
    Ok((BoxCloneService::new(observed), drain))
}

/// The payments and the balances; created once, whoever starts first (concurrent
/// `CREATE TABLE IF NOT EXISTS` can collide, hence the lock). `payments.key` is not
/// unique on purpose: the inbox, not a constraint, keeps each payment to one row.
async fn schema(pool: &PgPool) -> Result<(), sqlx::Error> {
    let mut transaction = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('examples/inbox schema'))")
        .execute(&mut *transaction)
        .await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS payments (
           id bigserial PRIMARY KEY,
           key text NOT NULL,
           account text NOT NULL,
           amount bigint NOT NULL,
           delivery text NOT NULL,
           handled_by text NOT NULL,
           applied_at timestamptz NOT NULL DEFAULT now());
         CREATE TABLE IF NOT EXISTS accounts (
           account text PRIMARY KEY,
           balance bigint NOT NULL)",
    )
    .execute(&mut *transaction)
    .await?;
    transaction.commit().await
}

/// The payment's key, scoped to payments; the account and the amount are the
/// fingerprint, so a key sent again with another amount is refused, never applied.
fn payment_key(payment: &Payment) -> Result<Option<MessageKey>, KeyRejection> {
    let key = IdempotencyKey::new(&payment.idempotency_key)?;
    Ok(Some(MessageKey::new(key).scope("payments").fingerprint(
        format!("{}\n{}", payment.account, payment.amount),
    )))
}

/// The handler: the payment's row and the account's new balance, both written in the
/// delivery's transaction, which the layer commits with the receipt.
async fn apply(
    received: Received<Payment>,
    delay: Duration,
    instance: Arc<str>,
) -> Result<Receipt, HandlerError> {
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let transaction = Transaction::current().ok_or(NoTransaction)?;
    let mut connection = transaction.lock().await?;
    let delivery = received.delivery().to_owned();
    let payment = received.into_message();
    let payment_id: i64 = sqlx::query_scalar(
        "INSERT INTO payments (key, account, amount, delivery, handled_by)
         VALUES ($1, $2, $3, $4, $5) RETURNING id",
    )
    .bind(&payment.idempotency_key)
    .bind(&payment.account)
    .bind(payment.amount)
    .bind(&delivery)
    .bind(&*instance)
    .fetch_one(&mut *connection)
    .await?;
    let balance: i64 = sqlx::query_scalar(
        "INSERT INTO accounts (account, balance) VALUES ($1, $2)
         ON CONFLICT (account) DO UPDATE SET balance = accounts.balance + excluded.balance
         RETURNING balance",
    )
    .bind(&payment.account)
    .bind(payment.amount)
    .fetch_one(&mut *connection)
    .await?;
    Ok(Receipt {
        payment_id,
        balance,
    })
}

/// The handler ran outside a transactional layer: its writes would not commit with
/// the record, so it writes nothing.
#[derive(Debug)]
struct NoTransaction;

impl fmt::Display for NoTransaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("no delivery transaction: the store is not in transactional mode")
    }
}

impl std::error::Error for NoTransaction {}

/// One delivery through the inbox, in the lines the example logs around it; the
/// driver settles it by the answer. `ack_delay` holds a settled one back: a window for
/// the tests' kills between the commit and the acknowledgement. `inbox.acking` comes
/// last: a process killed after it may or may not have acknowledged, one killed before
/// it has not.
async fn observed<S>(
    mut inbox: S,
    received: Received<Payment>,
    ack_delay: Duration,
) -> Result<Handled<Receipt>, HandlerError>
where
    S: Service<Received<Payment>, Response = Handled<Receipt>, Error = HandlerError>,
{
    let delivery = received.delivery().to_owned();
    let key = received.message().idempotency_key.clone();
    tracing::info!(
        event = "inbox.received",
        delivery,
        key,
        attempts = received.attempts(),
        "payment received"
    );
    let handled = inbox.ready().await?.call(received).await?;
    match &handled {
        Handled::Ran(receipt) => tracing::info!(
            event = "inbox.handled",
            delivery,
            key,
            payment_id = receipt.payment_id,
            balance = receipt.balance,
            "payment applied and committed"
        ),
        Handled::Replayed { outcome, replay } => tracing::info!(
            event = "inbox.replayed",
            delivery,
            key,
            payment_id = outcome.payment_id,
            request_count = replay.request_count(),
            "payment applied before: its receipt replayed, nothing written"
        ),
        // Requeued, or dead-lettered: the driver's line says which.
        _ => return Ok(handled),
    }
    if !ack_delay.is_zero() {
        tokio::time::sleep(ack_delay).await;
    }
    tracing::debug!(event = "inbox.acking", delivery, key, "acknowledging");
    Ok(handled)
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
