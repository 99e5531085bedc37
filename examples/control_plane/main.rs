//! Control signals over AMQP (RabbitMQ), as the swarm contract says: every signal
//! carries a `correlationId` (new per attempt) and an `idempotencyKey` (one per user
//! action); the controller deduplicates on `(swarmId, signal, idempotencyKey)` and
//! every outcome echoes both.
//!
//! ```sh
//! # RabbitMQ on 127.0.0.1:5672 (guest/guest), then in two terminals:
//! cargo run --all-features --example control_plane -- controller
//! cargo run --all-features --example control_plane -- orchestrator --swarm swarm-42 --signal swarm-start
//! ```
//!
//! # Orchestrator (`orchestrator`)
//!
//! Sends one signal for one user action: a fresh `idempotencyKey` (or `--key`), and per
//! attempt a fresh `correlationId`. It waits `--timeout-ms` for the outcome (matched on
//! the key and the signal, so a late outcome of an earlier attempt counts) and sends
//! again on a timeout, up to `--attempts`; prints the outcome as one JSON line on
//! stdout (its logs go to stderr) and exits 0, or exits 1 when none came.
//!
//! # Controller (`controller`)
//!
//! Consumes `sig.#` from its queue through the library's driver, [`AmqpConsumer`]
//! (manual acks, a prefetch of `--prefetch`). Per delivery: the correlation ID from the
//! envelope's `correlationId` (else the `x-correlation-id` header), extended for the
//! delivery (`attempt-001.Aq9`), in the span of every log line; the signal through the [`MessageIdempotencyLayer`], keyed on
//! `(swarmId, type, idempotencyKey)` with the signal's `data` as fingerprint; the
//! handler sleeps `--handler-ms`, appends one line to `--executions-file` (if given) and
//! builds the outcome. The outcome (the stored one, unchanged, on a duplicate) is
//! published to `ev.outcome.<type>.<swarmId>` with a publisher confirm, and only then
//! does the driver ack the delivery. A duplicate of a signal in flight is requeued after
//! a second (`--in-flight requeue`, the default) or waits for the outcome
//! (`--in-flight wait`). A signal that is not an envelope, or whose key is refused, goes
//! to the dead-letter queue `<queue>.dead`; an outcome that cannot be published counts
//! as a failed attempt. With `--redis-url` (feature `redis`) the records are in Redis,
//! shared by every controller on the queue and kept across their restarts; otherwise
//! in memory.
//!
//! `--ack-delay-ms` sleeps between publishing the outcome and acking: the window in
//! which the tests kill it.
//!
//! On Ctrl-C or SIGTERM the driver stops taking deliveries (those prefetched but not
//! started go back to the queue), lets those in flight publish and ack within
//! `--drain-timeout-ms` (default 10 s), then the controller waits up to as long for what
//! its idempotency layer still owes the store (an outcome kept while Redis was away)
//! and exits 0.
//!
//! # Topology
//!
//! | Name | Default | |
//! |---|---|---|
//! | exchange | `ph.control` | topic, durable |
//! | controller queue | `ph.control.swarm-controller` | durable, bound to `sig.#` |
//! | signal routing key | `sig.<type>.<swarmId>` | persistent messages |
//! | outcome routing key | `ev.outcome.<type>.<swarmId>` | |
//!
//! # Events (the `event` field)
//!
//! `controller.ready`, `controller.received`, `controller.executed` (the handler ran),
//! `controller.outcome_published` (with `replayed`), the driver's `message.settled` (with
//! its `outcome`: `handled`, `replayed`, `in_flight`, `requeued`, `retried`,
//! `dead_lettered`), `controller.stopping` (with `signal`), `message.drained`,
//! `shutdown.drained` or `shutdown.drain_incomplete`, `controller.stopped`; `orchestrator.sent`,
//! `orchestrator.timeout`, `orchestrator.outcome`; and the idempotency layer's
//! (`idempotency.replayed`, `idempotency.stored`, ... at DEBUG: `RUST_LOG=info,tower_ids::idempotency=debug`).

use std::{
    convert::Infallible,
    io::Write as _,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};
use tower_ids::idempotency::Policy;

#[path = "../support/shutdown.rs"]
mod shutdown;

use clap::{Parser, Subcommand, ValueEnum};
use futures_util::StreamExt as _;
use lapin::{
    options::{
        BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions,
        QueueBindOptions, QueueDeclareOptions,
    },
    types::FieldTable,
    BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tower::{service_fn, Service, ServiceBuilder, ServiceExt as _};
use tower_ids::{
    correlation::{CorrelationId, MessageCorrelation},
    idempotency::{
        extract::KeyRejection,
        message::{amqp::AmqpConsumer, Handled, MessageIdempotencyLayer, MessageKey, Received},
        store::IdempotencyStore,
        IdempotencyKey, InFlight, MokaStore,
    },
};
use tracing::Instrument as _;
use tracing_subscriber::{
    fmt::writer::BoxMakeWriter, layer::SubscriberExt as _, util::SubscriberInitExt as _,
};

#[derive(Parser, Debug)]
#[command(about = "Control signals over AMQP with correlation IDs and idempotency keys")]
struct Cli {
    /// The broker.
    #[arg(
        long,
        global = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    amqp_url: String,
    /// The topic exchange signals and outcomes go through.
    #[arg(long, global = true, default_value = "ph.control")]
    exchange: String,
    /// `text` or `json` (one object per line, with the span fields).
    #[arg(long, global = true, default_value = "text")]
    log_format: LogFormat,
    #[command(subcommand)]
    role: Role,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand, Debug)]
enum Role {
    /// Consume signals, run each command once, publish outcomes.
    Controller(ControllerArgs),
    /// Send one signal, retrying on a timeout, and print its outcome.
    Orchestrator(OrchestratorArgs),
}

#[derive(clap::Args, Debug)]
struct ControllerArgs {
    /// The queue this controller (and its replicas) consume.
    #[arg(long, default_value = "ph.control.swarm-controller")]
    queue: String,
    /// This controller's name, in the outcomes' `origin`.
    #[arg(long, default_value = "swarm-controller-1")]
    instance: String,
    /// Keep the idempotency records in Redis (feature `redis`).
    #[arg(long)]
    redis_url: Option<String>,
    /// How long executing a signal takes.
    #[arg(long, default_value_t = 200)]
    handler_ms: u64,
    /// Pause between publishing an outcome and acking its delivery.
    #[arg(long, default_value_t = 0)]
    ack_delay_ms: u64,
    /// Append one line per execution (not per delivery) to this file.
    #[arg(long)]
    executions_file: Option<PathBuf>,
    /// A duplicate of a signal in flight: `requeue` it, or `wait` for the outcome.
    #[arg(long, default_value = "requeue")]
    in_flight: InFlightMode,
    /// Deliveries handled at once (the channel's prefetch).
    #[arg(long, default_value_t = 16)]
    prefetch: u16,
    /// How long a killed controller's keys stay claimed.
    #[arg(long, default_value_t = 10_000)]
    lease_ms: u64,
    /// How long outcomes are kept for duplicates.
    #[arg(long, default_value_t = 24 * 60 * 60)]
    retention_secs: u64,
    #[command(flatten)]
    drain: shutdown::DrainArgs,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum InFlightMode {
    Requeue,
    Wait,
}

#[derive(clap::Args, Debug)]
struct OrchestratorArgs {
    #[arg(long, default_value = "swarm-42")]
    swarm: String,
    /// `swarm-start` or `swarm-stop`.
    #[arg(long, default_value = "swarm-start")]
    signal: String,
    /// The user action's key; a fresh UUIDv7 when not given.
    #[arg(long)]
    key: Option<String>,
    /// How long to wait for the outcome of one attempt.
    #[arg(long, default_value_t = 2_000)]
    timeout_ms: u64,
    #[arg(long, default_value_t = 5)]
    attempts: u32,
    #[arg(long, default_value = "orchestrator-1")]
    origin: String,
}

/// The envelope of signals and outcomes (`kind=signal` / `kind=outcome`).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(rename_all = "camelCase")]
struct Envelope {
    timestamp: String,
    version: String,
    kind: String,
    #[serde(rename = "type")]
    kind_of: String,
    origin: String,
    scope: Scope,
    correlation_id: Option<String>,
    idempotency_key: Option<String>,
    #[serde(default)]
    data: Value,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(rename_all = "camelCase")]
struct Scope {
    swarm_id: String,
    role: String,
    instance: Option<String>,
}

fn now() -> String {
    time::OffsetDateTime::from(SystemTime::now())
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "info,lapin=warn".into());
    // The orchestrator prints its outcome on stdout, so it logs to stderr.
    let writer = match cli.role {
        Role::Controller(_) => BoxMakeWriter::new(std::io::stdout),
        Role::Orchestrator(_) => BoxMakeWriter::new(std::io::stderr),
    };
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer);
    match cli.log_format {
        LogFormat::Json => logs
            .json()
            .with_current_span(true)
            .with_span_list(true)
            .finish()
            .with(traces())
            .init(),
        LogFormat::Text => logs.finish().with(traces()).init(),
    }
    let connection = Connection::connect(&cli.amqp_url, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel
        .exchange_declare(
            cli.exchange.as_str().into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    match cli.role {
        Role::Controller(args) => {
            let stopped = controller(channel, cli.exchange, cli.amqp_url, args).await;
            // Deliveries prefetched but never started go back to the queue now.
            let _ = connection.close(200, "stopped".into()).await;
            stopped
        }
        Role::Orchestrator(args) => {
            let outcome = orchestrator(channel, cli.exchange, args).await?;
            let _ = connection.close(200, "done".into()).await;
            match outcome {
                Some(outcome) => {
                    println!("{}", serde_json::to_string(&outcome)?);
                    Ok(())
                }
                None => std::process::exit(1),
            }
        }
    }
}

// ----------------------------------------------------------------------------------
// Controller
// ----------------------------------------------------------------------------------

/// `(swarmId, type, idempotencyKey)`, the data as fingerprint.
fn signal_key(envelope: &Envelope) -> Result<Option<MessageKey>, KeyRejection> {
    let Some(key) = &envelope.idempotency_key else {
        return Ok(None);
    };
    let key = IdempotencyKey::new(key)?;
    Ok(Some(
        MessageKey::new(key)
            .scope(&envelope.scope.swarm_id)
            .scope(&envelope.kind_of)
            .fingerprint(envelope.data.to_string()),
    ))
}

async fn controller(
    channel: Channel,
    exchange: String,
    amqp_url: String,
    args: ControllerArgs,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    #[cfg(feature = "redis")]
    if let Some(url) = &args.redis_url {
        let store = tower_ids::idempotency::store::RedisStore::builder(url.as_str())
            .build()
            .await?;
        return consume(channel, exchange, amqp_url, args, store).await;
    }
    #[cfg(not(feature = "redis"))]
    if args.redis_url.is_some() {
        return Err("--redis-url needs the redis feature".into());
    }
    consume(channel, exchange, amqp_url, args, MokaStore::new()).await
}

async fn consume<St: IdempotencyStore>(
    channel: Channel,
    exchange: String,
    amqp_url: String,
    args: ControllerArgs,
    store: St,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    channel
        .queue_declare(
            args.queue.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    channel
        .queue_bind(
            args.queue.as_str().into(),
            exchange.as_str().into(),
            "sig.#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;

    let in_flight = match args.in_flight {
        InFlightMode::Requeue => InFlight::Reject {
            retry_after: Duration::from_secs(1),
        },
        InFlightMode::Wait => InFlight::Wait {
            timeout: Duration::from_secs(30),
        },
    };
    let executions = args
        .executions_file
        .as_ref()
        .map(|path| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map(|file| Arc::new(Mutex::new(file)))
        })
        .transpose()?;
    let instance = args.instance.clone();
    let handler_time = Duration::from_millis(args.handler_ms);
    // The command itself: runs once per (swarmId, type, idempotencyKey).
    let execute = service_fn(move |signal: Received<Envelope>| {
        let executions = executions.clone();
        let instance = instance.clone();
        async move {
            let signal = signal.into_message();
            tokio::time::sleep(handler_time).await;
            let (status, retryable) = match signal.kind_of.as_str() {
                "swarm-start" => ("Running", false),
                "swarm-stop" => ("Stopped", false),
                _ => ("Unsupported", false),
            };
            if let Some(file) = &executions {
                let line = format!(
                    "{} {} {} {} {}\n",
                    signal.scope.swarm_id,
                    signal.kind_of,
                    signal.idempotency_key.as_deref().unwrap_or("-"),
                    signal.correlation_id.as_deref().unwrap_or("-"),
                    instance
                );
                let mut file = file.lock().unwrap_or_else(|e| e.into_inner());
                let _ = file.write_all(line.as_bytes());
                let _ = file.flush();
            }
            tracing::info!(event = "controller.executed", signal = %signal.kind_of, swarm = %signal.scope.swarm_id, status, "executed the signal");
            Ok::<_, Infallible>(Envelope {
                timestamp: now(),
                version: "1".into(),
                kind: "outcome".into(),
                kind_of: signal.kind_of,
                origin: format!("swarm-controller:{instance}"),
                scope: Scope {
                    instance: Some(instance.clone()),
                    ..signal.scope
                },
                correlation_id: signal.correlation_id,
                idempotency_key: signal.idempotency_key,
                data: serde_json::json!({ "status": status, "retryable": retryable }),
            })
        }
    });
    let idempotency = MessageIdempotencyLayer::with_store(store)
        .key(|signal: &Received<Envelope>| signal_key(signal.message()))
        .require_key(true)
        .policy(
            Policy::new()
                .in_flight(in_flight)
                .lease(Duration::from_millis(args.lease_ms))
                .ttl(Duration::from_secs(args.retention_secs)),
        )?;
    let drain = idempotency.drain();
    let service = ServiceBuilder::new().layer(idempotency).service(execute);
    let context = Arc::new(Context {
        channel,
        exchange,
        ack_delay: Duration::from_millis(args.ack_delay_ms),
        correlation: MessageCorrelation::new(),
    });
    // Each answer's outcome published before the driver acknowledges the signal.
    let controller = service_fn(move |signal: Received<Envelope>| {
        answer(service.clone(), signal, context.clone())
    });
    tracing::info!(event = "controller.ready", queue = %args.queue, instance = %args.instance, "consuming");
    let stop = async {
        let signal = shutdown::signal().await;
        tracing::info!(
            event = "controller.stopping",
            signal,
            "stopping: no new deliveries, finishing those in flight"
        );
    };
    let stopped = AmqpConsumer::new(amqp_url, &args.queue)
        // The contract puts the ID in the envelope: a signal without the header is
        // still logged under its sender's ID.
        .correlation_from(|signal: &Envelope| signal.correlation_id.as_deref())
        .prefetch(args.prefetch)
        .retry_pause(Duration::from_secs(1))
        .drain_timeout(args.drain.timeout())
        .run(controller, stop)
        .await;
    shutdown::drain(&[drain], args.drain.timeout()).await;
    tracing::info!(event = "controller.stopped", left = ?stopped.left, "stopped");
    Ok(())
}

struct Context {
    channel: Channel,
    exchange: String,
    ack_delay: Duration,
    correlation: MessageCorrelation,
}

/// The outcome could not be published: the driver counts the signal's attempt and
/// publishes it again (dead-lettered after five).
#[derive(Debug)]
struct NotPublished(lapin::Error);

impl std::fmt::Display for NotPublished {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the outcome was not published")
    }
}

impl std::error::Error for NotPublished {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

/// One signal: handled behind the idempotency layer; a first run's outcome or a
/// replayed one published (confirmed), then handed back for the driver to acknowledge.
/// A controller killed between the two gets the signal again and publishes the same
/// outcome.
async fn answer<S>(
    mut service: S,
    signal: Received<Envelope>,
    context: Arc<Context>,
) -> Result<Handled<Envelope>, NotPublished>
where
    S: Service<Received<Envelope>, Response = Handled<Envelope>, Error = Infallible>,
{
    let envelope = signal.message();
    tracing::info!(
        event = "controller.received",
        signal = %envelope.kind_of,
        swarm = %envelope.scope.swarm_id,
        idempotency_key = envelope.idempotency_key.as_deref(),
        attempts = signal.attempts(),
        "signal received"
    );
    let handled = match service.ready().await {
        Ok(ready) => ready.call(signal).await,
        Err(never) => match never {},
    };
    let handled = match handled {
        Ok(handled) => handled,
        Err(never) => match never {},
    };
    let (outcome, replayed) = match &handled {
        Handled::Ran(outcome) => (outcome, false),
        Handled::Replayed { outcome, .. } => (outcome, true),
        // Requeued or dead-lettered: the driver's `message.settled` line says which.
        _ => return Ok(handled),
    };
    publish(outcome, &context).await.map_err(NotPublished)?;
    tracing::info!(
        event = "controller.outcome_published",
        replayed,
        signal = %outcome.kind_of,
        swarm = %outcome.scope.swarm_id,
        idempotency_key = outcome.idempotency_key.as_deref(),
        echoed_correlation_id = outcome.correlation_id.as_deref(),
        "outcome published"
    );
    if !context.ack_delay.is_zero() {
        tokio::time::sleep(context.ack_delay).await;
    }
    Ok(handled)
}

/// Publishes the outcome to `ev.outcome.<type>.<swarmId>` and waits for the broker's
/// confirm.
async fn publish(outcome: &Envelope, context: &Context) -> Result<(), lapin::Error> {
    let routing = format!("ev.outcome.{}.{}", outcome.kind_of, outcome.scope.swarm_id);
    let mut headers = FieldTable::default();
    // This delivery's ID in the header; the envelope echoes the attempt that ran.
    context.correlation.inject_current(&mut headers);
    if let Some(key) = outcome
        .idempotency_key
        .as_deref()
        .and_then(|key| IdempotencyKey::new(key).ok())
    {
        key.inject(&mut headers);
    }
    let body = serde_json::to_vec(outcome).unwrap_or_default();
    let properties = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_headers(headers);
    context
        .channel
        .basic_publish(
            context.exchange.as_str().into(),
            routing.as_str().into(),
            BasicPublishOptions::default(),
            &body,
            properties,
        )
        .await?
        .await?;
    Ok(())
}

// ----------------------------------------------------------------------------------
// Orchestrator
// ----------------------------------------------------------------------------------

async fn orchestrator(
    channel: Channel,
    exchange: String,
    args: OrchestratorArgs,
) -> Result<Option<Envelope>, Box<dyn std::error::Error + Send + Sync>> {
    // A reply queue of its own, bound to this signal's outcomes.
    let queue = channel
        .queue_declare(
            "".into(),
            QueueDeclareOptions {
                exclusive: true,
                auto_delete: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    let outcomes_key = format!("ev.outcome.{}.{}", args.signal, args.swarm);
    channel
        .queue_bind(
            queue.name().clone(),
            exchange.as_str().into(),
            outcomes_key.as_str().into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut outcomes = channel
        .basic_consume(
            queue.name().clone(),
            "".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await?;

    // One key for the user action, whatever the attempts.
    let key = match &args.key {
        Some(key) => IdempotencyKey::new(key)?,
        None => IdempotencyKey::new(CorrelationId::new().as_str())?,
    };
    let action = tracing::info_span!("action", idempotency_key = key.as_str());
    for attempt in 1..=args.attempts {
        // A new correlation ID per attempt.
        let id = CorrelationId::new();
        let sent = async {
            let signal = Envelope {
                timestamp: now(),
                version: "1".into(),
                kind: "signal".into(),
                kind_of: args.signal.clone(),
                origin: args.origin.clone(),
                scope: Scope {
                    swarm_id: args.swarm.clone(),
                    role: "swarm-controller".into(),
                    instance: None,
                },
                correlation_id: Some(id.to_string()),
                idempotency_key: Some(key.to_string()),
                data: serde_json::json!({}),
            };
            let mut headers = FieldTable::default();
            // This attempt's ID (the task-local) and, with `--features opentelemetry`,
            // its span's trace context.
            MessageCorrelation::new().inject_current(&mut headers);
            key.inject(&mut headers);
            channel
                .basic_publish(
                    exchange.as_str().into(),
                    format!("sig.{}.{}", args.signal, args.swarm).as_str().into(),
                    BasicPublishOptions::default(),
                    &serde_json::to_vec(&signal)?,
                    BasicProperties::default()
                        .with_content_type("application/json".into())
                        .with_delivery_mode(2)
                        .with_headers(headers),
                )
                .await?
                .await?;
            tracing::info!(event = "orchestrator.sent", attempt, signal = %args.signal, swarm = %args.swarm, "signal sent");
            let deadline = tokio::time::sleep(Duration::from_millis(args.timeout_ms));
            tokio::pin!(deadline);
            loop {
                let delivery = tokio::select! {
                    delivery = outcomes.next() => delivery,
                    () = &mut deadline => return Ok::<_, Box<dyn std::error::Error + Send + Sync>>(None),
                };
                let Some(Ok(delivery)) = delivery else {
                    return Err("the outcome consumer was cancelled".into());
                };
                let Ok(outcome) = serde_json::from_slice::<Envelope>(&delivery.data) else {
                    continue;
                };
                // Matched on the user action: a late outcome of an earlier attempt counts.
                if outcome.idempotency_key.as_deref() == Some(key.as_str())
                    && outcome.kind_of == args.signal
                {
                    tracing::info!(
                        event = "orchestrator.outcome",
                        attempt,
                        echoed_correlation_id = outcome.correlation_id.as_deref(),
                        outcome_trace_id = message_trace_id(delivery.properties.headers()),
                        status = %outcome.data["status"],
                        "outcome received"
                    );
                    return Ok(Some(outcome));
                }
            }
        }
        .instrument(attempt_span(&action, &id));
        // The task-local too, for anything that reads CorrelationId::current().
        if let Some(outcome) = id.clone().task_local(sent).await? {
            return Ok(Some(outcome));
        }
        tracing::warn!(parent: &action, event = "orchestrator.timeout", attempt, correlation_id = %id, "no outcome in time; sending again under a new correlation id");
    }
    Ok(None)
}

/// The span of one attempt: `correlation`, a child of the user action's span, with the
/// attempt's ID and (with `--features opentelemetry`) the action's `trace_id`, which the
/// signal carries to the controller and the controller's outcome carries back.
fn attempt_span(action: &tracing::Span, id: &CorrelationId) -> tracing::Span {
    let span = tracing::info_span!(
        parent: action,
        "correlation",
        correlation_id = %id,
        trace_id = tracing::field::Empty,
    );
    #[cfg(feature = "opentelemetry")]
    if let Some(trace) = tower_ids::correlation::TraceContext::of(&span) {
        span.record("trace_id", trace.trace_id());
    }
    span
}

/// The trace ID of a message's `traceparent` (with `--features opentelemetry`).
fn message_trace_id(headers: &Option<FieldTable>) -> Option<String> {
    #[cfg(feature = "opentelemetry")]
    return tower_ids::correlation::TraceContext::extract(headers)
        .map(|trace| trace.trace_id().to_owned());
    #[cfg(not(feature = "opentelemetry"))]
    {
        let _ = headers;
        None
    }
}

/// With `--features opentelemetry`, a layer sending the spans to OpenTelemetry too
/// (exported nowhere: add an exporter to the provider), so each signal's trace context
/// travels on the AMQP messages both ways (`traceparent`) and both roles' lines carry its
/// `trace_id`.
#[cfg(feature = "opentelemetry")]
fn traces<S>() -> Option<impl tracing_subscriber::Layer<S>>
where
    S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
{
    use opentelemetry::trace::TracerProvider as _;
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
    Some(tracing_opentelemetry::layer().with_tracer(provider.tracer("control_plane")))
}

#[cfg(not(feature = "opentelemetry"))]
fn traces<S: tracing::Subscriber>() -> Option<impl tracing_subscriber::Layer<S>> {
    None::<tracing_subscriber::layer::Identity>
}
