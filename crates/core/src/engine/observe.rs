//! What the idempotency layer tells operators beyond its events: its metrics (feature
//! `metrics`, on the `metrics` facade; without it every call here compiles to nothing)
//! and the warning for a layer order that leaves its answers without a correlation ID.
//!
//! The metrics, as the module docs list them:
//!
//! | Name | Kind | Labels |
//! |---|---|---|
//! | [`REQUESTS`] | counter | `outcome` |
//! | [`REQUESTS_IN_FLIGHT`] | gauge | |
//! | [`STORE_CALL_DURATION`] | histogram, seconds | `operation` |
//! | [`STORE_FAILURES`] | counter | `operation` |
//! | [`RELEASED`] | counter | `reason` |

use crate::code::event;
use std::{
    future::Future,
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use tracing::Span;

use crate::{store::StoreError, ClientId, IdempotencyKey, ScopeKey};
use tower_ids_correlation::CorrelationId;

/// Counter: protected requests the layer answered, by `outcome`.
pub const REQUESTS: &str = "tower_ids_idempotency_requests_total";
/// Gauge: protected requests inside the layer now (reading the body, waiting for the
/// store, running the handler, storing the outcome).
pub const REQUESTS_IN_FLIGHT: &str = "tower_ids_idempotency_requests_in_flight";
/// Histogram: how long each store call took, in seconds, by `operation`.
pub const STORE_CALL_DURATION: &str = "tower_ids_idempotency_store_call_duration_seconds";
/// Counter: store calls that failed, by `operation`.
pub const STORE_FAILURES: &str = "tower_ids_idempotency_store_failures_total";
/// Counter: keys given up after their request ran, so a retry runs again, by `reason`.
pub const RELEASED: &str = "tower_ids_idempotency_released_total";

/// Describes the layer's metrics to the installed recorder (their help text and
/// unit), for exporters that show them, such as Prometheus' `# HELP` lines. Call it
/// once, after installing the recorder; the metrics are recorded without it too.
#[cfg(feature = "metrics")]
pub fn describe() {
    use metrics::Unit;
    metrics::describe_counter!(
        REQUESTS,
        "Protected requests the idempotency layer answered, by outcome"
    );
    metrics::describe_gauge!(
        REQUESTS_IN_FLIGHT,
        "Protected requests inside the idempotency layer now"
    );
    metrics::describe_histogram!(
        STORE_CALL_DURATION,
        Unit::Seconds,
        "Idempotency store call latency, by operation"
    );
    metrics::describe_counter!(
        STORE_FAILURES,
        "Idempotency store calls that failed, by operation"
    );
    metrics::describe_counter!(
        RELEASED,
        "Idempotency keys released after their request ran, by reason"
    );
}

/// The label values known in advance: each series is exported at 0 from the moment a
/// layer is built, so `rate()` and dashboards see it before its first increment.
#[cfg(feature = "metrics")]
const OUTCOMES: [&str; 10] = [
    "executed",
    "replayed",
    "in_flight",
    "conflict",
    "not_replayable",
    "original_failed",
    "rejected",
    "store_unavailable",
    "pool_exhausted",
    "fail_open",
];
#[cfg(feature = "metrics")]
const OPERATIONS: [&str; 5] = ["begin", "renew", "complete", "release", "wait"];

/// Registers every counter series with a known label, and the in-flight gauge, at 0
/// (on the recorder installed now; a recorder installed later sees them from their
/// first change).
pub fn register() {
    #[cfg(feature = "metrics")]
    {
        for outcome in OUTCOMES {
            metrics::counter!(REQUESTS, "outcome" => outcome).increment(0);
        }
        for operation in OPERATIONS {
            metrics::counter!(STORE_FAILURES, "operation" => operation).increment(0);
        }
        for reason in super::lease::Release::ALL {
            metrics::counter!(RELEASED, "reason" => reason.as_str()).increment(0);
        }
        metrics::gauge!(REQUESTS_IN_FLIGHT).increment(0.0);
    }
}

/// One protected request answered with `outcome`: `executed`, `replayed`,
/// `in_flight`, `conflict`, `not_replayable`, `original_failed`, `rejected`,
/// `store_unavailable` or `fail_open`; counted, and recorded on the request's span.
/// (The engine counts its decisions with [`count`] and records them with
/// [`record_decision`].)
#[inline]
pub fn outcome(outcome: &'static str) {
    count(outcome);
    record(field::OUTCOME, outcome);
}

/// Counts one protected request answered with `outcome`.
#[inline]
pub fn count(outcome: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!(REQUESTS, "outcome" => outcome).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = outcome;
}

/// The fields the layer records on the span current when it runs (the request's span:
/// [`AccessSpan`](https://docs.rs/tower-ids-correlation/latest/tower_ids_correlation/struct.AccessSpan.html) and the correlation layer's default
/// span declare them), so that the request's one access line carries them. A span that
/// does not declare a field ignores it. They are recorded when the subscriber enables
/// INFO, as it must for the request's span (INFO by default) to be recorded at all.
pub mod field {
    /// What the layer did with the request: `executed`, `replayed`, `in_flight`,
    /// `conflict`, `not_replayable`, `original_failed`, `rejected`,
    /// `store_unavailable` or `fail_open`.
    pub const OUTCOME: &str = "idempotency_outcome";
    /// The idempotency key, once validated.
    pub const KEY: &str = "idempotency_key";
    /// The key's scope (a digest of client, method, path and key), as the store keys it.
    pub const SCOPE: &str = "idempotency_scope";
    /// The client the key is scoped to, as the client identifier displays it.
    pub const CLIENT: &str = "idempotency_client";
    /// How many requests the store has seen with this key (on a replay or a request
    /// in flight).
    pub const REQUEST_COUNT: &str = "idempotency_request_count";
    /// Milliseconds spent in store calls on the request's path (the claim or lookup,
    /// any wait, and the completion), as a float.
    pub const STORE_MS: &str = "idempotency_store_ms";
}

/// The span the layer records in: the current one, or none without a subscriber that
/// records INFO spans (a cheap check of a global, where looking the current span up
/// is a call into the dispatcher).
#[inline]
pub fn request_span() -> Span {
    if tracing::level_enabled!(tracing::Level::INFO) {
        Span::current()
    } else {
        Span::none()
    }
}

/// Records `value` in the current span's field `name` (see [`field`]).
#[inline]
pub fn record(name: &'static str, value: impl tracing::Value) {
    request_span().record(name, value);
}

/// Records the time spent in store calls on the request's path, once per request (a
/// text formatter appends each recording), in milliseconds to the microsecond.
#[inline]
pub fn store_time(spent: Duration) {
    record(field::STORE_MS, tower_ids_correlation::log_millis(spent));
}

/// The span a protected request's events and fields go in: the current span when it
/// declares the layer's fields (the correlation layer's request span, an
/// [`AccessSpan`](https://docs.rs/tower-ids-correlation/latest/tower_ids_correlation/struct.AccessSpan.html)), which gets the key, scope and client
/// now; else a span of the layer's own, `idempotency`, with them and the correlation ID,
/// so that a formatter that prints only the current span still ties the layer's lines
/// to the request. `None` when that is the current span, which the work is already in.
/// The same for every transport.
pub fn protected_span(
    key: Option<&IdempotencyKey>,
    scope: Option<&ScopeKey>,
    client: Option<&ClientId>,
) -> Option<Span> {
    if !tracing::level_enabled!(tracing::Level::INFO) {
        return None;
    }
    let current = Span::current();
    if current.has_field(field::OUTCOME) {
        if let (Some(key), Some(scope)) = (key, scope) {
            protected(&current, key, scope, client);
        }
        return None;
    }
    let correlation_id = CorrelationId::current();
    Some(tracing::info_span!(
        target: "tower_ids::idempotency",
        "idempotency",
        correlation_id = correlation_id.as_ref().map(CorrelationId::as_str),
        idempotency_key = key.map(IdempotencyKey::as_str),
        idempotency_scope = scope.map(tracing::field::display),
        idempotency_client = client.map(tracing::field::display),
        idempotency_outcome = tracing::field::Empty,
        idempotency_request_count = tracing::field::Empty,
        idempotency_store_ms = tracing::field::Empty,
    ))
}

/// Records a protected request's key, scope and client on its request's span.
fn protected(span: &Span, key: &IdempotencyKey, scope: &ScopeKey, client: Option<&ClientId>) {
    let scope = tracing::field::display(scope);
    let client = client.map(tracing::field::display);
    record_three_on(
        span,
        [
            (field::KEY, Some(&key.as_str())),
            (field::SCOPE, Some(&scope)),
            (
                field::CLIENT,
                client.as_ref().map(|c| c as &dyn tracing::Value),
            ),
        ],
    );
}

/// Records up to three fields on the current span in one recording: a formatter that
/// serialises all of a span's fields again on every recording (json-subscriber does)
/// pays once, not three times. A field the span does not declare, or a `None`, is left
/// out.
pub fn record_three(values: [(&'static str, Option<&dyn tracing::Value>); 3]) {
    record_three_on(&request_span(), values);
}

/// [`record_three`] on `span`.
fn record_three_on(span: &Span, values: [(&'static str, Option<&dyn tracing::Value>); 3]) {
    let Some(metadata) = span.metadata() else {
        return;
    };
    let fields = metadata.fields();
    // A slot for a field the span lacks holds the span's first field with no value,
    // which records nothing.
    let Some(filler) = fields.iter().next() else {
        return;
    };
    let [a, b, c] = values.map(|(name, value)| match fields.field(name) {
        Some(field) => (field, value),
        None => (filler.clone(), None),
    });
    if a.1.is_none() && b.1.is_none() && c.1.is_none() {
        return;
    }
    span.record_all(&fields.value_set(&[(&a.0, a.1), (&b.0, b.1), (&c.0, c.1)]));
}

/// Records the engine's decision on the current span: its outcome, the request count
/// when the store gave one, and the store time unless a completion comes after.
pub fn record_decision(
    outcome: &'static str,
    request_count: Option<u64>,
    store_time: Option<Duration>,
) {
    if !tracing::level_enabled!(tracing::Level::INFO) {
        return;
    }
    let millis = store_time.map(tower_ids_correlation::log_millis);
    record_three([
        (field::OUTCOME, Some(&outcome)),
        (
            field::REQUEST_COUNT,
            request_count.as_ref().map(|c| c as &dyn tracing::Value),
        ),
        (
            field::STORE_MS,
            millis.as_ref().map(|m| m as &dyn tracing::Value),
        ),
    ]);
}

/// A key released with `reason`.
#[inline]
pub fn released(reason: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!(RELEASED, "reason" => reason).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = reason;
}

/// Times the store call `call` as `operation`, and counts it if it fails.
#[inline]
pub async fn store_call<T>(
    operation: &'static str,
    call: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    let mut spent = Duration::ZERO;
    timed_store_call(operation, &mut spent, call).await
}

/// [`store_call`], adding the time it took to `spent`.
#[inline]
pub async fn timed_store_call<T>(
    operation: &'static str,
    spent: &mut Duration,
    call: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    let started = std::time::Instant::now();
    let result = call.await;
    let elapsed = started.elapsed();
    *spent += elapsed;
    #[cfg(feature = "metrics")]
    {
        metrics::histogram!(STORE_CALL_DURATION, "operation" => operation)
            .record(elapsed.as_secs_f64());
        if result.is_err() {
            metrics::counter!(STORE_FAILURES, "operation" => operation).increment(1);
        }
    }
    #[cfg(not(feature = "metrics"))]
    let _ = operation;
    result
}

/// Counts one protected request in flight until dropped.
#[must_use]
pub struct InFlight(());

impl InFlight {
    #[inline]
    pub fn enter() -> Self {
        #[cfg(feature = "metrics")]
        metrics::gauge!(REQUESTS_IN_FLIGHT).increment(1.0);
        Self(())
    }
}

impl Drop for InFlight {
    #[inline]
    fn drop(&mut self) {
        #[cfg(feature = "metrics")]
        metrics::gauge!(REQUESTS_IN_FLIGHT).decrement(1.0);
    }
}

/// Warns once per layer (and its clones) when a protected request runs with no
/// correlation ID in scope: the correlation layer is inside the idempotency layer, or
/// missing, so its replays and refusals carry no correlation ID at all.
#[derive(Debug, Default)]
pub struct LayerOrder {
    warned: AtomicBool,
}

impl LayerOrder {
    /// The first time no correlation ID is current, the WARN.
    pub fn check(&self) {
        if !CorrelationId::is_current() && !self.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                target: "tower_ids::idempotency",
                event = event::UNCORRELATED,
                "no correlation id in scope: the idempotency layer runs outside the correlation layer (or without one), so its replays and refusals carry none; put CorrelationLayer outside it (ServiceBuilder: add it first; axum: `Router::layer` it last, after the routes); logged once per layer"
            );
        }
    }
}
