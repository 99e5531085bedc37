use std::{fmt, sync::Arc, time::Duration};

use http::{HeaderMap, HeaderName, Method, StatusCode};
use tower_layer::Layer;

use super::service::Retry;
use tower_ids_correlation::DEFAULT_HEADER;

/// Attempts per logical request, the first included: 5.
///
/// Four retries ride out a restart or a failover (a few seconds with the default
/// backoff) without turning one user action into a long stream of load on a service
/// that is down.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;

/// The first retry waits up to 250 ms ([full jitter]), the next up to 500 ms, and so
/// on, doubling.
///
/// Long enough for a dropped connection or a lost race to clear, short enough that a
/// user waiting on the call barely notices one retry.
///
/// [full jitter]: https://aws.amazon.com/blogs/architecture/exponential-backoff-and-jitter/
pub const DEFAULT_BACKOFF_BASE: Duration = Duration::from_millis(250);

/// The doubling stops at 4 s.
///
/// A server that has not recovered in a few seconds will not recover in the next few
/// either; past this the deadline, not the backoff, should decide. With the default
/// five attempts the largest ceiling reached is 2 s; the cap matters when you raise
/// [`max_attempts`](RetryLayer::max_attempts).
pub const DEFAULT_BACKOFF_CAP: Duration = Duration::from_secs(4);

/// Everything, attempts and waits, within 30 s of the call.
///
/// Beyond that the caller upstream (a user, a gateway with a 30 s or 60 s timeout) has
/// usually given up; work done after that is wasted, and a retry storm outlives the
/// incident that caused it.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(30);

/// Each attempt gets at most 10 s to produce a response (headers; the body is yours to
/// read).
///
/// Far above a healthy API's tail latency, so only a hung connection or server trips
/// it, and short enough that at least two attempts fit in the default deadline.
pub const DEFAULT_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);

/// Decides whether a response is worth another attempt; see [`RetryLayer::retry_if`].
pub(crate) type RetryPredicate = Arc<dyn Fn(StatusCode, &HeaderMap) -> bool + Send + Sync>;

/// The default retryable responses: `408`, `429`, `5xx` but `501` and `505`, and `409`
/// with `Retry-After`.
///
/// - `408` Request Timeout, `429` Too Many Requests, and `5xx`: the server could not
///   answer now. `501` Not Implemented and `505` HTTP Version Not Supported are left
///   out: they will not change on a retry.
/// - `409` Conflict only with `Retry-After`: that is how the idempotency layer says
///   "a request with this key is in flight" (`idempotency.in_flight`) or "the request
///   you waited on failed" (`idempotency.original_failed`); a `409` without it is an
///   application's conflict, which a retry would only repeat.
/// - Every other `4xx` is the caller's to fix and is returned at once.
/// - A replayed answer (`idempotent-replayed: true`) is returned at once, whatever its
///   status: the server stored it for this key, so every retry would get it again.
pub fn default_retry_if(status: StatusCode, headers: &HeaderMap) -> bool {
    if headers
        .get(tower_ids_core::header::IDEMPOTENT_REPLAYED)
        .is_some_and(|value| value == "true")
    {
        return false;
    }
    match status.as_u16() {
        408 | 429 => true,
        409 => headers.contains_key(http::header::RETRY_AFTER),
        501 | 505 => false,
        _ => status.is_server_error(),
    }
}

/// Methods that can be repeated without a key (RFC 9110 § 9.2.2): GET, HEAD, OPTIONS,
/// TRACE (safe), PUT and DELETE.
pub(crate) fn is_idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

/// Methods that only read (RFC 9110 § 9.2.1); the layer never adds a key to them.
pub(crate) fn is_safe(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
    )
}

/// Retries requests of an HTTP client with one idempotency key across every attempt, a
/// new correlation ID and `attempt-id` per attempt, and backoff with full jitter.
///
/// ```
/// use std::time::Duration;
/// use tower::ServiceBuilder;
/// use tower_ids_client::RetryLayer;
/// # let client = tower::service_fn(|_: http::Request<http_body_util::Full<bytes::Bytes>>| async {
/// #     Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
/// # });
///
/// // `client` is any tower HTTP client, hyper-util's legacy `Client` for one.
/// let client = ServiceBuilder::new()
///     .layer(
///         RetryLayer::new()
///             .max_attempts(4)
///             .backoff(Duration::from_millis(100), Duration::from_secs(2))
///             .deadline(Duration::from_secs(10))
///             .attempt_timeout(Duration::from_secs(3)),
///     )
///     .service(client);
/// # let _ = client;
/// ```
///
/// See the [module docs](super) for the headers and the retry rules.
///
/// # Clone
///
/// Settings are shared behind an `Arc`; clones of the layer and of the service it makes
/// share nothing else. Each call has its own key, attempt counter and deadline.
#[derive(Clone)]
#[must_use]
pub struct RetryLayer {
    pub(super) settings: Arc<Settings>,
}

#[derive(Clone)]
pub(crate) struct Settings {
    pub(crate) max_attempts: u32,
    pub(crate) backoff_base: Duration,
    pub(crate) backoff_cap: Duration,
    pub(crate) deadline: Duration,
    pub(crate) attempt_timeout: Duration,
    pub(crate) add_keys: bool,
    pub(crate) attempt_ids: bool,
    pub(crate) correlation_header: HeaderName,
    pub(crate) retry_if: RetryPredicate,
}

impl RetryLayer {
    /// The defaults: [`DEFAULT_MAX_ATTEMPTS`], [`DEFAULT_BACKOFF_BASE`] doubling to
    /// [`DEFAULT_BACKOFF_CAP`], [`DEFAULT_DEADLINE`], [`DEFAULT_ATTEMPT_TIMEOUT`]; keys
    /// added, attempt IDs sent, `x-correlation-id`, [`default_retry_if`].
    pub fn new() -> Self {
        Self {
            settings: Arc::new(Settings {
                max_attempts: DEFAULT_MAX_ATTEMPTS,
                backoff_base: DEFAULT_BACKOFF_BASE,
                backoff_cap: DEFAULT_BACKOFF_CAP,
                deadline: DEFAULT_DEADLINE,
                attempt_timeout: DEFAULT_ATTEMPT_TIMEOUT,
                add_keys: true,
                attempt_ids: true,
                correlation_header: DEFAULT_HEADER,
                retry_if: Arc::new(default_retry_if),
            }),
        }
    }

    fn settings(&mut self) -> &mut Settings {
        Arc::make_mut(&mut self.settings)
    }

    /// Attempts per logical request, the first included; `1` turns retries off.
    /// Default [`DEFAULT_MAX_ATTEMPTS`].
    ///
    /// # Panics
    ///
    /// When `attempts` is 0.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        assert!(attempts >= 1, "a request needs at least one attempt");
        self.settings().max_attempts = attempts;
        self
    }

    /// Exponential backoff with full jitter: before retry `n` (1 for the first) the
    /// layer waits a uniformly random time in `[0, min(cap, base * 2^(n-1))]`, or the
    /// server's `Retry-After` if that is longer. Defaults [`DEFAULT_BACKOFF_BASE`] and
    /// [`DEFAULT_BACKOFF_CAP`].
    pub fn backoff(mut self, base: Duration, cap: Duration) -> Self {
        let settings = self.settings();
        settings.backoff_base = base;
        settings.backoff_cap = cap;
        self
    }

    /// The time every attempt and wait must fit in, counted from the call. A wait that
    /// would reach past it is not started: the layer returns the last response (or
    /// error) at once. `Duration::MAX` for none. Default [`DEFAULT_DEADLINE`].
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.settings().deadline = deadline;
        self
    }

    /// The time one attempt gets to produce a response (its headers), after which it is
    /// abandoned and retried; also bounded by what is left of the deadline.
    /// `Duration::MAX` for none. Default [`DEFAULT_ATTEMPT_TIMEOUT`].
    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.settings().attempt_timeout = timeout;
        self
    }

    /// Add an `Idempotency-Key` (a UUIDv7) to requests with a method that is not safe
    /// (POST, PATCH, PUT, DELETE, ...) and no key of the caller's. Default on.
    ///
    /// Off, a POST or PATCH without the caller's key is sent once and never retried.
    pub fn add_keys(mut self, add: bool) -> Self {
        self.settings().add_keys = add;
        self
    }

    /// Send `attempt-id: 1`, `2`, ... on each attempt. Default on.
    pub fn attempt_ids(mut self, send: bool) -> Self {
        self.settings().attempt_ids = send;
        self
    }

    /// The correlation header set on every attempt. Default `x-correlation-id`.
    pub fn correlation_header(mut self, name: HeaderName) -> Self {
        self.settings().correlation_header = name;
        self
    }

    /// Which responses are worth another attempt. Default [`default_retry_if`].
    ///
    /// Errors of the inner client (connect, reset) and attempts that time out are
    /// always retried; requests that are not safe to repeat are never retried, whatever
    /// this says.
    ///
    /// ```
    /// use http::{HeaderMap, StatusCode};
    /// use tower_ids_client::{default_retry_if, RetryLayer};
    ///
    /// // Also retry 404s, for a read-after-write on an eventually consistent store.
    /// let layer = RetryLayer::new().retry_if(|status: StatusCode, headers: &HeaderMap| {
    ///     status == StatusCode::NOT_FOUND || default_retry_if(status, headers)
    /// });
    /// # let _ = layer;
    /// ```
    pub fn retry_if(
        mut self,
        predicate: impl Fn(StatusCode, &HeaderMap) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.settings().retry_if = Arc::new(predicate);
        self
    }
}

impl Default for RetryLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for RetryLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.settings.fmt(f)
    }
}

impl fmt::Debug for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryLayer")
            .field("max_attempts", &self.max_attempts)
            .field("backoff_base", &self.backoff_base)
            .field("backoff_cap", &self.backoff_cap)
            .field("deadline", &self.deadline)
            .field("attempt_timeout", &self.attempt_timeout)
            .field("add_keys", &self.add_keys)
            .field("attempt_ids", &self.attempt_ids)
            .field("correlation_header", &self.correlation_header)
            .finish_non_exhaustive()
    }
}

impl<S> Layer<S> for RetryLayer {
    type Service = Retry<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Retry::new(inner, self.settings.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replayed_answer_is_never_retried() {
        let mut replayed = HeaderMap::new();
        replayed.insert(
            tower_ids_core::header::IDEMPOTENT_REPLAYED,
            http::HeaderValue::from_static("true"),
        );
        for code in [500, 502, 503, 429] {
            let status = StatusCode::from_u16(code).unwrap();
            assert!(!default_retry_if(status, &replayed), "{code}");
        }
    }

    #[test]
    fn default_retry_if_covers_what_a_retry_can_change() {
        let mut with_retry_after = HeaderMap::new();
        with_retry_after.insert(http::header::RETRY_AFTER, http::HeaderValue::from(1));
        let none = HeaderMap::new();
        for code in [408, 429, 500, 502, 503, 504, 599] {
            let status = StatusCode::from_u16(code).unwrap();
            assert!(default_retry_if(status, &none), "{code}");
        }
        for code in [
            200, 201, 204, 301, 304, 400, 401, 403, 404, 409, 410, 413, 422, 501, 505,
        ] {
            let status = StatusCode::from_u16(code).unwrap();
            assert!(!default_retry_if(status, &none), "{code}");
        }
        assert!(default_retry_if(StatusCode::CONFLICT, &with_retry_after));
        assert!(!default_retry_if(
            StatusCode::BAD_REQUEST,
            &with_retry_after
        ));
    }

    #[test]
    fn methods() {
        for m in ["GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"] {
            assert!(is_idempotent(&m.parse().unwrap()), "{m}");
        }
        for m in ["POST", "PATCH", "CONNECT", "PURGE"] {
            assert!(!is_idempotent(&m.parse().unwrap()), "{m}");
        }
        assert!(!is_safe(&Method::PUT) && !is_safe(&Method::DELETE) && is_safe(&Method::GET));
    }

    #[test]
    #[should_panic(expected = "at least one attempt")]
    fn zero_attempts_is_refused() {
        let _ = RetryLayer::new().max_attempts(0);
    }
}
