use tower_ids_core::IdempotencyKey;
use tower_ids_correlation::CorrelationId;

/// What the retry layer did, in the extensions of the response it returns.
///
/// ```
/// # use tower_ids_client::{RetryOutcome, StopReason};
/// # fn inspect<B>(response: &http::Response<B>) {
/// let outcome = response.extensions().get::<RetryOutcome>().unwrap();
/// if outcome.replayed() {
///     // The server had already done this; this is its stored answer.
/// }
/// if outcome.stop_reason() == StopReason::AttemptsExhausted {
///     // A 5xx (or 408, 429, 409 in flight) after every attempt.
/// }
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct RetryOutcome {
    pub(crate) attempts: u32,
    pub(crate) replayed: bool,
    pub(crate) stop: StopReason,
    pub(crate) idempotency_key: Option<IdempotencyKey>,
    pub(crate) correlation_id: CorrelationId,
}

impl RetryOutcome {
    /// Attempts made, this response's included (1 when there was no retry).
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// `true` when the server answered `idempotent-replayed: true`: the action ran
    /// earlier (on a previous attempt, or a previous call with this key) and this is
    /// its stored response.
    pub fn replayed(&self) -> bool {
        self.replayed
    }

    /// Why this response is the last.
    pub fn stop_reason(&self) -> StopReason {
        self.stop
    }

    /// `true` when the response is one the layer would have retried but stopped
    /// (every attempt used, the deadline, or a request not safe to repeat).
    pub fn gave_up(&self) -> bool {
        self.stop != StopReason::NotRetryable
    }

    /// The idempotency key sent on every attempt: the caller's, or the one the layer
    /// added. `None` when there was none (or the caller's was not a valid key).
    pub fn idempotency_key(&self) -> Option<&IdempotencyKey> {
        self.idempotency_key.as_ref()
    }

    /// The correlation ID of the last attempt (`parent.n`).
    pub fn correlation_id(&self) -> &CorrelationId {
        &self.correlation_id
    }
}

/// Why the retry layer returned the response it did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StopReason {
    /// The response is not one to retry: a success, a redirect, or a 4xx other than
    /// `408`, `429` and `409` with `Retry-After` (see
    /// [`default_retry_if`](super::default_retry_if)).
    NotRetryable,
    /// A retryable response after every attempt was used.
    AttemptsExhausted,
    /// A retryable response, and the next attempt could not start before the deadline
    /// (the backoff or the server's `Retry-After` reached past it).
    DeadlineReached,
    /// A retryable response to a request that is not safe to repeat: a method other than
    /// GET, HEAD, OPTIONS, PUT, DELETE, TRACE without an idempotency key.
    NotSafeToRepeat,
}

impl StopReason {
    /// A stable code: `not_retryable`, `attempts_exhausted`, `deadline_reached`,
    /// `not_safe_to_repeat`.
    pub fn code(self) -> &'static str {
        match self {
            Self::NotRetryable => "not_retryable",
            Self::AttemptsExhausted => "attempts_exhausted",
            Self::DeadlineReached => "deadline_reached",
            Self::NotSafeToRepeat => "not_safe_to_repeat",
        }
    }
}
