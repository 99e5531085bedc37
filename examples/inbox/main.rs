//! A transactional inbox: payments consumed from RabbitMQ or Kafka, each applied to the
//! database exactly once, the acknowledgement after the commit. The walkthrough is in
//! this folder's `README.md`.
//!
//! ```sh
//! createdb -h 127.0.0.1 -U postgres inbox
//! cargo run --example inbox --features postgres,amqp -- --broker amqp publish --count 100
//! cargo run --example inbox --features postgres,amqp -- --broker amqp consume
//! ```
//!
//! Each message is a payment, `{"idempotency_key": "...", "account": "...", "amount":
//! 125}`. It goes through a [`MessageIdempotencyLayer`] over a [`PostgresStore`] in
//! [`PostgresMode::Transactional`]: the layer opens the delivery's transaction (which
//! holds the key), the handler writes the payment and the balance in it
//! ([`Transaction::current`]), and the layer stores the receipt in it and commits. Only
//! then does the layer's future return, and only then is the message acknowledged: a
//! basic ack on RabbitMQ, the offset commit on Kafka. A consumer killed between the
//! commit and the acknowledgement gets the message again, and the redelivery is
//! replayed: the handler does not run, the stored receipt comes back.
//!
//! | [`Handled`] | The consumer |
//! |---|---|
//! | `Ran(receipt)` | logs `inbox.handled`, acks |
//! | `Replayed { receipt, .. }` | logs `inbox.replayed`, acks |
//! | `InFlight { retry_after }` | requeues after `retry_after` (Kafka: tries again) |
//! | `Refused(r)`, `r.retryable()` | requeues after a second (Kafka: tries again) |
//! | `Refused(r)` otherwise | rejects, no requeue (Kafka: logs and commits past it) |
//! | the handler failed | the layer rolled its writes back; requeues after a second |
//!
//! # Events (the `event` field)
//!
//! `inbox.ready`; per delivery `inbox.received`, then `inbox.handled` (the handler ran
//! and its transaction committed) or `inbox.replayed` (a duplicate: nothing ran), then
//! `inbox.acking` (DEBUG, just before the ack is sent) and `inbox.acked`; or
//! `inbox.requeued`, `inbox.rejected`, `inbox.failed`, `inbox.ack_failed`
//! (`inbox.consume_failed` when Kafka fails to hand a record over). At a stop
//! `inbox.stopping`, `shutdown.drained` and `inbox.stopped`; `inbox.published` from
//! `publish`. Every event of a delivery carries `delivery` (the AMQP `message_id`, or
//! the Kafka `partition:offset`) and `key`.

use std::{fmt, sync::Arc, time::Duration};

use clap::{Parser, Subcommand, ValueEnum};
use serde::{Deserialize, Serialize};
use sqlx::{postgres::PgPoolOptions, PgPool};
use tower::{service_fn, util::BoxCloneService, Service, ServiceBuilder, ServiceExt as _};
use tower_ids::idempotency::{
    extract::KeyRejection,
    message::{Handled, MessageIdempotencyLayer, MessageKey},
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
/// a retryable refusal or a failed handler: 1 s, long enough for a store or a database
/// that failed to come back, short enough that a payment is not held up for long.
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

/// What the handler gets: the payment and the delivery it came in.
struct Delivered {
    payment: Payment,
    /// The AMQP `message_id`, or the Kafka `partition:offset`.
    delivery: String,
}

/// The handler's outcome, stored with the payment and handed back to a redelivery.
#[derive(Serialize, Deserialize, Debug, Clone)]
struct Receipt {
    payment_id: i64,
    /// The account's balance just after this payment.
    balance: i64,
}

type HandlerError = Box<dyn std::error::Error + Send + Sync>;

/// The handler behind its idempotency layer.
type Inbox = BoxCloneService<Delivered, Handled<Receipt>, HandlerError>;

/// What the broker adapter does with the delivery.
enum Next {
    /// Acknowledge it: the payment is in the database.
    Ack,
    /// Give it back, to come again after this pause.
    Retry(Duration),
    /// Drop it for good (dead-letter it).
    Reject,
}

/// The parts of a consumer both brokers share.
struct Consumer {
    inbox: Inbox,
    drain: Drain,
    ack_delay: Duration,
    drain_timeout: Duration,
}

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
                BrokerKind::Kafka => 1,
            };
            let consumer = consumer(&args, concurrency).await?;
            match cli.broker {
                BrokerKind::Amqp => amqp::consume(&cli.amqp, consumer).await,
                BrokerKind::Kafka => kafka::consume(&cli.kafka, consumer).await,
            }
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

/// The database (with its tables), the store in transactional mode, and the handler
/// behind the layer.
async fn consumer(
    args: &ConsumeArgs,
    concurrency: usize,
) -> Result<Consumer, Box<dyn std::error::Error + Send + Sync>> {
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
        .key(payment_key)
        .require_key(true)
        .policy(Policy::new().in_flight(InFlight::Reject {
            retry_after: Duration::from_millis(args.in_flight_retry_ms),
        }));
    let drain = layer.drain();
    let handler_delay = Duration::from_millis(args.handler_delay_ms);
    let instance: Arc<str> = args.instance.as_str().into();
    let handler =
        service_fn(move |delivered: Delivered| apply(delivered, handler_delay, instance.clone()));
    Ok(Consumer {
        inbox: BoxCloneService::new(ServiceBuilder::new().layer(layer).service(handler)),
        drain,
        ack_delay: Duration::from_millis(args.ack_delay_ms),
        drain_timeout: args.drain.timeout(),
    })
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
fn payment_key(delivered: &Delivered) -> Result<Option<MessageKey>, KeyRejection> {
    let payment = &delivered.payment;
    let key = IdempotencyKey::new(&payment.idempotency_key)?;
    Ok(Some(MessageKey::new(key).scope("payments").fingerprint(
        format!("{}\n{}", payment.account, payment.amount),
    )))
}

/// The handler: the payment's row and the account's new balance, both written in the
/// delivery's transaction, which the layer commits with the receipt.
async fn apply(
    delivered: Delivered,
    delay: Duration,
    instance: Arc<str>,
) -> Result<Receipt, HandlerError> {
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let transaction = Transaction::current().ok_or(NoTransaction)?;
    let mut connection = transaction.lock().await?;
    let Delivered { payment, delivery } = delivered;
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

/// Runs one delivery through the inbox and says what to do with it; logs what became
/// of it. Called in the delivery's span.
async fn handle(inbox: &mut Inbox, delivered: Delivered) -> Next {
    let key = delivered.payment.idempotency_key.clone();
    let delivery = delivered.delivery.clone();
    let handled = match inbox.ready().await {
        Ok(ready) => ready.call(delivered).await,
        Err(error) => Err(error),
    };
    match handled {
        Ok(Handled::Ran(receipt)) => {
            tracing::info!(
                event = "inbox.handled",
                delivery,
                key,
                payment_id = receipt.payment_id,
                balance = receipt.balance,
                "payment applied and committed"
            );
            Next::Ack
        }
        Ok(Handled::Replayed { outcome, replay }) => {
            tracing::info!(
                event = "inbox.replayed",
                delivery,
                key,
                payment_id = outcome.payment_id,
                request_count = replay.request_count(),
                "payment applied before: its receipt replayed, nothing written"
            );
            Next::Ack
        }
        Ok(Handled::InFlight { retry_after }) => {
            requeued(&delivery, &key, "in_flight", retry_after);
            Next::Retry(retry_after)
        }
        Ok(Handled::Refused(refusal)) if refusal.retryable() => {
            requeued(&delivery, &key, refusal.code(), RETRY_PAUSE);
            Next::Retry(RETRY_PAUSE)
        }
        Ok(Handled::Refused(refusal)) => {
            tracing::warn!(
                event = "inbox.rejected",
                delivery,
                key,
                reason = refusal.code(),
                "payment refused for good"
            );
            Next::Reject
        }
        Err(error) => {
            tracing::warn!(
                event = "inbox.failed",
                delivery,
                key,
                error = %error,
                "the handler failed: its writes were rolled back"
            );
            requeued(&delivery, &key, "handler_failed", RETRY_PAUSE);
            Next::Retry(RETRY_PAUSE)
        }
        // An answer a later version adds: trying again never loses a payment.
        Ok(_) => {
            requeued(&delivery, &key, "unknown", RETRY_PAUSE);
            Next::Retry(RETRY_PAUSE)
        }
    }
}

fn requeued(delivery: &str, key: &str, reason: &str, after: Duration) {
    tracing::info!(
        event = "inbox.requeued",
        delivery,
        key,
        reason,
        after_ms = u64::try_from(after.as_millis()).unwrap_or(u64::MAX),
        "payment not applied yet; it comes again"
    );
}

/// Waits `delay`, then sends the acknowledgement `ack` (an AMQP ack, a Kafka offset
/// commit) and logs it. `inbox.acking` comes first: a process killed after it may or
/// may not have acknowledged, one killed before it has not.
async fn acknowledge<E: fmt::Display>(
    delay: Duration,
    delivery: &str,
    ack: impl std::future::Future<Output = Result<(), E>>,
) {
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    tracing::debug!(event = "inbox.acking", delivery, "acknowledging");
    match ack.await {
        Ok(()) => tracing::info!(event = "inbox.acked", delivery, "acknowledged"),
        Err(error) => tracing::warn!(
            event = "inbox.ack_failed",
            delivery,
            error = %error,
            "could not acknowledge; the payment comes again and is replayed"
        ),
    }
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
