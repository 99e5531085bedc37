//! The retry loop.
//!
//! Why not `tower::retry::Retry` with a `Policy`: the policy decides with
//! `&mut Result<S::Response, S::Error>` and the service's error type is the inner one,
//! so it cannot turn "a retry is due but the streaming body is gone" or "the deadline
//! passed" into a typed error; when `clone_request` returns `None` (a streaming body)
//! tower returns the failed attempt as if it were the answer, which is what this layer
//! must not do. The first attempt's headers would also need a second layer, and the
//! deadline per-call state the policy does not get. The loop below is short, and every
//! rule of the module docs is in one place.

use std::{
    fmt,
    future::poll_fn,
    sync::Arc,
    task::{Context, Poll},
    time::{Duration, SystemTime},
};

use http::{request::Parts, HeaderValue, Request, Response, StatusCode};
use tokio::time::Instant;
use tower_service::Service;
use uuid::Uuid;

use super::{
    backoff,
    layer::{is_idempotent, is_safe, Settings},
    ReplayableBody, ResponseFuture, RetryError, RetryLayer, RetryOutcome, StopReason,
};
use tower_ids_core::{
    header::{ATTEMPT_ID, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, X_IDEMPOTENCY_KEY},
    IdempotencyKey,
};
use tower_ids_correlation::CorrelationId;

/// Client middleware that retries requests safely; made by [`RetryLayer`].
///
/// Its error is [`RetryError`], and every response it returns carries a
/// [`RetryOutcome`] extension. See the [module docs](super).
#[derive(Clone)]
pub struct Retry<S> {
    inner: S,
    settings: Arc<Settings>,
}

impl<S> Retry<S> {
    pub(crate) fn new(inner: S, settings: Arc<Settings>) -> Self {
        Self { inner, settings }
    }

    /// The layer, to configure and apply with `ServiceBuilder`.
    pub fn layer() -> RetryLayer {
        RetryLayer::new()
    }

    /// The wrapped client.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped client, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The wrapped client.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: fmt::Debug> fmt::Debug for Retry<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Retry")
            .field("inner", &self.inner)
            .field("settings", &self.settings)
            .finish()
    }
}

impl<S, B, ResBody> Service<Request<B>> for Retry<S>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: fmt::Display + Send + 'static,
    B: ReplayableBody + Send + 'static,
    ResBody: Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = RetryError<S::Error>;
    type Future = ResponseFuture<ResBody, S::Error>;

    /// The inner client's readiness; its error is [`RetryError::Transport`] with
    /// `attempts: 0`.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner
            .poll_ready(cx)
            .map_err(|source| RetryError::Transport {
                attempts: 0,
                exhausted: false,
                source,
            })
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // The key, the parent ID (read from the caller's task-local) and the clock all
        // belong to the moment of the call, not of the first poll.
        let call = LogicalRequest::new(&self.settings, request);
        let clone = self.inner.clone();
        let ready = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::new(Box::pin(run(ready, self.settings.clone(), call)))
    }
}

/// One logical request: what stays the same across its attempts.
pub(super) struct LogicalRequest<B> {
    parts: Parts,
    /// `None` once a body that cannot be replayed has been sent.
    body: Option<B>,
    key: Option<IdempotencyKey>,
    parent: CorrelationId,
    /// Safe to send more than once: an idempotent method, or an idempotency key.
    repeatable: bool,
    /// `None` when the deadline is too far to represent.
    deadline: Option<Instant>,
}

impl<B> LogicalRequest<B> {
    pub(super) fn new(settings: &Settings, request: Request<B>) -> Self {
        let deadline = Instant::now().checked_add(settings.deadline);
        let (mut parts, body) = request.into_parts();
        let key_names = [IDEMPOTENCY_KEY, X_IDEMPOTENCY_KEY];
        let caller_key = key_names
            .iter()
            .any(|name| parts.headers.contains_key(name));
        let mut key = IdempotencyKey::from_headers(&parts.headers, &key_names)
            .ok()
            .flatten();
        if !caller_key && settings.add_keys && !is_safe(&parts.method) {
            let (value, new) = new_key();
            parts.headers.insert(IDEMPOTENCY_KEY, value);
            key = Some(new);
        }
        let keyed = caller_key || key.is_some();
        let parent = parts
            .extensions
            .get::<CorrelationId>()
            .cloned()
            .or_else(|| {
                let value = parts.headers.get(&settings.correlation_header)?;
                CorrelationId::parse(value.to_str().ok()?).ok()
            })
            .or_else(CorrelationId::current)
            .unwrap_or_default();
        Self {
            repeatable: keyed || is_idempotent(&parts.method),
            parts,
            body: Some(body),
            key,
            parent,
            deadline,
        }
    }
}

/// A fresh UUIDv7 key, as a header value and as a key.
fn new_key() -> (HeaderValue, IdempotencyKey) {
    let mut buf = [0u8; uuid::fmt::Hyphenated::LENGTH];
    let uuid = Uuid::new_v7(uuid::Timestamp::now(uuid::NoContext));
    let text = uuid.hyphenated().encode_lower(&mut buf);
    (
        HeaderValue::from_str(text).expect("a UUID is a valid header value"),
        IdempotencyKey::parse(text.as_bytes()).expect("a UUID is a valid key"),
    )
}

/// How one attempt ended.
enum Attempt<T, E> {
    Response(Response<T>),
    /// The inner client failed.
    Failed(E),
    /// The inner client was not ready for a retry; not retried.
    NotReady(E),
    /// No response within the per-attempt timeout.
    TimedOut,
    /// No response before the overall deadline.
    DeadlineHit,
}

/// How the loop goes on after an attempt.
enum Decision<T, E> {
    /// This response is the answer, for this reason.
    Answer(Response<T>, StopReason),
    /// The layer stops with this error.
    Fail(RetryError<E>),
    /// Another attempt after `delay`; `status` is this attempt's, if it had one.
    Retry {
        delay: Duration,
        status: Option<StatusCode>,
    },
}

/// The attempts of one logical request, until one is the answer or the layer stops:
/// each attempt is built, sent within its time limit and decided on, in that order.
pub(super) async fn run<S, B, T>(
    mut service: S,
    settings: Arc<Settings>,
    mut call: LogicalRequest<B>,
) -> Result<Response<T>, RetryError<S::Error>>
where
    S: Service<Request<B>, Response = Response<T>>,
    S::Error: fmt::Display,
    B: ReplayableBody,
{
    let max_attempts = if call.repeatable {
        settings.max_attempts
    } else {
        1
    };
    let mut last_status: Option<StatusCode> = None;
    let mut attempt: u32 = 0;
    loop {
        attempt += 1;
        let correlation_id = call.parent.next_child();
        let request = attempt_request(&settings, &mut call, attempt, max_attempts, &correlation_id);
        let mut log = AttemptLog::new(attempt, &correlation_id, call.key.as_ref());
        let outcome = send(&mut service, request, attempt, &settings, call.deadline).await;
        let decision = decide(
            &settings,
            &call,
            attempt,
            max_attempts,
            last_status,
            outcome,
            &mut log,
        );
        match decision {
            Decision::Answer(response, stop) => {
                return Ok(finish(response, attempt, stop, call, correlation_id))
            }
            Decision::Fail(error) => return Err(error),
            Decision::Retry { delay, status } => {
                if status.is_some() {
                    last_status = status;
                }
                tokio::time::sleep(delay).await;
            }
        }
    }
}

/// Sends attempt `attempt` and waits for it until the per-attempt timeout or the
/// overall deadline, whichever comes first (the outcome says which). A retry waits for
/// the client to be ready first; the first attempt's readiness is the caller's
/// `poll_ready`.
async fn send<S, B, T>(
    service: &mut S,
    request: Request<B>,
    attempt: u32,
    settings: &Settings,
    deadline: Option<Instant>,
) -> Attempt<T, S::Error>
where
    S: Service<Request<B>, Response = Response<T>>,
{
    let attempt_end = Instant::now().checked_add(settings.attempt_timeout);
    let (end, by_deadline) = match (attempt_end, deadline) {
        (Some(a), Some(d)) if d <= a => (Some(d), true),
        (None, Some(d)) => (Some(d), true),
        (a, _) => (a, false),
    };
    let ready = attempt > 1;
    let send = async {
        if ready {
            if let Err(error) = poll_fn(|cx| service.poll_ready(cx)).await {
                return Attempt::NotReady(error);
            }
        }
        match service.call(request).await {
            Ok(response) => Attempt::Response(response),
            Err(error) => Attempt::Failed(error),
        }
    };
    match end {
        Some(end) => match tokio::time::timeout_at(end, send).await {
            Ok(outcome) => outcome,
            Err(_) if by_deadline => Attempt::DeadlineHit,
            Err(_) => Attempt::TimedOut,
        },
        None => send.await,
    }
}

/// What follows attempt `attempt`'s `outcome`, logged: the answer, a stop, or a retry
/// after a backoff. The checks run in this order: the outcome itself, then whether the
/// request may be sent again, whether the wait would pass the deadline, and whether
/// the body is still there to send.
fn decide<T, B, E: fmt::Display>(
    settings: &Settings,
    call: &LogicalRequest<B>,
    attempt: u32,
    max_attempts: u32,
    last_status: Option<StatusCode>,
    outcome: Attempt<T, E>,
    log: &mut AttemptLog<'_>,
) -> Decision<T, E> {
    let (response, error) = match retryable(settings, attempt, last_status, outcome, log) {
        Ok(failed) => failed,
        Err(decision) => return decision,
    };
    let status = response.as_ref().map(Response::status);

    // Stop: not safe to repeat, or every attempt used.
    let stop = if !call.repeatable {
        Some(StopReason::NotSafeToRepeat)
    } else if attempt >= max_attempts {
        Some(StopReason::AttemptsExhausted)
    } else {
        None
    };
    if let Some(stop) = stop {
        log.give_up(stop.code(), error.as_ref().map(display));
        let exhausted = stop == StopReason::AttemptsExhausted;
        return match (response, error) {
            (Some(response), _) => Decision::Answer(response, stop),
            (None, Some(source)) => Decision::Fail(RetryError::Transport {
                attempts: attempt,
                exhausted,
                source,
            }),
            (None, None) => Decision::Fail(RetryError::TimedOut {
                attempts: attempt,
                exhausted,
                timeout: settings.attempt_timeout,
            }),
        };
    }

    // Stop: the next attempt cannot start before the deadline.
    let delay = backoff_delay(settings, attempt, response.as_ref());
    if starts_past(delay, call.deadline) {
        log.delay = Some(delay);
        log.give_up(
            StopReason::DeadlineReached.code(),
            error.as_ref().map(display),
        );
        return match response {
            Some(response) => Decision::Answer(response, StopReason::DeadlineReached),
            None => Decision::Fail(RetryError::DeadlineExceeded {
                attempts: attempt,
                deadline: settings.deadline,
                last_status,
                source: error,
            }),
        };
    }

    // Stop: the body streamed and is gone.
    if call.body.is_none() {
        log.give_up("body_not_replayable", error.as_ref().map(display));
        return Decision::Fail(RetryError::BodyNotReplayable {
            attempts: attempt,
            last_status: status,
            source: error,
        });
    }

    log.delay = Some(delay);
    log.retry(error.as_ref().map(display));
    // Returning drops the failed response (and its connection) before the wait.
    Decision::Retry { delay, status }
}

/// An attempt worth another: its response (one the settings retry) or its error, or
/// neither after a per-attempt timeout.
type Retryable<T, E> = (Option<Response<T>>, Option<E>);

/// What the attempt was, and whether it is worth another: `Err` with the decision when
/// the outcome settles it alone (an answer, a client not ready, the deadline hit).
fn retryable<T, E: fmt::Display>(
    settings: &Settings,
    attempt: u32,
    last_status: Option<StatusCode>,
    outcome: Attempt<T, E>,
    log: &mut AttemptLog<'_>,
) -> Result<Retryable<T, E>, Decision<T, E>> {
    match outcome {
        Attempt::Response(response) => {
            log.outcome = Outcome::Status(response.status());
            if !(settings.retry_if)(response.status(), response.headers()) {
                log.done();
                return Err(Decision::Answer(response, StopReason::NotRetryable));
            }
            Ok((Some(response), None))
        }
        Attempt::Failed(error) => {
            log.outcome = Outcome::Kind("transport_error");
            Ok((None, Some(error)))
        }
        Attempt::NotReady(error) => {
            log.outcome = Outcome::Kind("not_ready");
            log.give_up("not_ready", Some(&error));
            Err(Decision::Fail(RetryError::Transport {
                attempts: attempt,
                exhausted: false,
                source: error,
            }))
        }
        Attempt::TimedOut => {
            log.outcome = Outcome::Kind("timed_out");
            Ok((None, None))
        }
        Attempt::DeadlineHit => {
            log.outcome = Outcome::Kind("deadline_exceeded");
            log.give_up("deadline_reached", None);
            Err(Decision::Fail(RetryError::DeadlineExceeded {
                attempts: attempt,
                deadline: settings.deadline,
                last_status,
                source: None,
            }))
        }
    }
}

/// The wait before the attempt after `attempt`: full-jitter backoff, or longer if the
/// response asked for it (`Retry-After`).
fn backoff_delay<T>(settings: &Settings, attempt: u32, response: Option<&Response<T>>) -> Duration {
    let ceiling = backoff::ceiling(settings.backoff_base, settings.backoff_cap, attempt);
    let delay = backoff::full_jitter(ceiling, rand::random());
    match response.and_then(|r| backoff::retry_after(r.headers(), SystemTime::now())) {
        Some(asked) => delay.max(asked),
        None => delay,
    }
}

/// Whether an attempt started `delay` from now would start at or after `deadline`
/// (or so far ahead that the clock cannot say when).
fn starts_past(delay: Duration, deadline: Option<Instant>) -> bool {
    match (Instant::now().checked_add(delay), deadline) {
        (_, None) => false,
        (Some(next), Some(deadline)) => next >= deadline,
        (None, Some(_)) => true,
    }
}

/// The request for attempt `attempt`: the logical request's head with this attempt's
/// correlation ID and attempt ID, and a copy of the body (the body itself on the last
/// attempt, or when it cannot be copied).
fn attempt_request<B: ReplayableBody>(
    settings: &Settings,
    call: &mut LogicalRequest<B>,
    attempt: u32,
    max_attempts: u32,
    correlation_id: &CorrelationId,
) -> Request<B> {
    let original = call
        .body
        .take()
        .expect("the loop stops before an attempt without a body");
    let body = if attempt < max_attempts {
        match original.try_replay() {
            Some(copy) => {
                call.body = Some(original);
                copy
            }
            None => original,
        }
    } else {
        original
    };
    let mut parts = call.parts.clone();
    parts.headers.insert(
        settings.correlation_header.clone(),
        correlation_id.to_header_value(),
    );
    if settings.attempt_ids {
        parts.headers.insert(ATTEMPT_ID, HeaderValue::from(attempt));
    }
    parts.extensions.insert(correlation_id.clone());
    #[cfg(feature = "opentelemetry")]
    tower_ids_correlation::inject_trace_context(&mut parts.headers);
    Request::from_parts(parts, body)
}

fn finish<T, B>(
    mut response: Response<T>,
    attempts: u32,
    stop: StopReason,
    call: LogicalRequest<B>,
    correlation_id: CorrelationId,
) -> Response<T> {
    let replayed = response
        .headers()
        .get(IDEMPOTENT_REPLAYED)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
    response.extensions_mut().insert(RetryOutcome {
        attempts,
        replayed,
        stop,
        idempotency_key: call.key,
        correlation_id,
    });
    response
}

fn display<E: fmt::Display>(error: &E) -> &dyn fmt::Display {
    error
}

/// The fields of the `client.attempt` event.
struct AttemptLog<'a> {
    attempt: u32,
    correlation_id: &'a CorrelationId,
    key: Option<&'a IdempotencyKey>,
    outcome: Outcome,
    /// The wait before the next attempt.
    delay: Option<Duration>,
    reason: Option<&'static str>,
    error: Option<String>,
}

/// The status (`503`) or what went wrong (`transport_error`, `timed_out`, ...).
enum Outcome {
    Status(StatusCode),
    Kind(&'static str),
}

impl Outcome {
    fn as_str(&self) -> &str {
        match self {
            Self::Status(status) => status.as_str(),
            Self::Kind(kind) => kind,
        }
    }
}

/// One event, three levels: a tracing level is fixed per call site.
macro_rules! attempt_event {
    ($level:expr, $log:expr, $decision:literal, $message:literal) => {
        tracing::event!(
            $level,
            event = "client.attempt",
            attempt = $log.attempt,
            correlation_id = %$log.correlation_id,
            idempotency_key = $log.key.map(IdempotencyKey::as_str),
            outcome = $log.outcome.as_str(),
            decision = $decision,
            delay_ms = $log.delay.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            reason = $log.reason,
            error = $log.error.as_deref(),
            $message
        )
    };
}

impl<'a> AttemptLog<'a> {
    /// The event of attempt `attempt`, its outcome yet to be told.
    fn new(
        attempt: u32,
        correlation_id: &'a CorrelationId,
        key: Option<&'a IdempotencyKey>,
    ) -> Self {
        Self {
            attempt,
            correlation_id,
            key,
            outcome: Outcome::Kind(""),
            delay: None,
            reason: None,
            error: None,
        }
    }

    /// DEBUG: the response is the answer.
    fn done(&self) {
        attempt_event!(tracing::Level::DEBUG, self, "done", "Request answered");
    }

    /// INFO: another attempt follows after `delay`.
    fn retry(&mut self, error: Option<&dyn fmt::Display>) {
        self.error = error.map(ToString::to_string);
        attempt_event!(tracing::Level::INFO, self, "retry", "Retrying request");
    }

    /// WARN: a failed attempt, and the layer stops.
    fn give_up(&mut self, reason: &'static str, error: Option<&dyn fmt::Display>) {
        self.reason = Some(reason);
        self.error = error.map(ToString::to_string);
        attempt_event!(
            tracing::Level::WARN,
            self,
            "give_up",
            "Giving up on request"
        );
    }
}
