use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use http::{header, HeaderValue, StatusCode};
use serde::{de::DeserializeOwned, Serialize};
use tower_service::Service;
use tracing::Instrument as _;

use super::{layer::MessageSettings, ExtractMessageKey, MessageKey};
use crate::{
    correlation::CorrelationId,
    idempotency::{
        lease::{self, KeptOutcomes, LeaseGuard, Unsettled},
        store::{Begin, Chain, IdempotencyStore, Record, Settled, StoredResponse},
        AttemptId, Fingerprint, InFlight, ReplayInfo, StoreFailure,
    },
};

/// Middleware that handles each message key once and hands its stored outcome to every
/// duplicate. Made by [`MessageIdempotencyLayer`](super::MessageIdempotencyLayer); see
/// the [module docs](crate::idempotency::message).
pub struct MessageIdempotency<S, K, R, St> {
    pub(super) inner: S,
    pub(super) extract: Arc<K>,
    pub(super) store: Arc<St>,
    pub(super) kept: Arc<KeptOutcomes>,
    pub(super) settings: Arc<MessageSettings<R>>,
}

impl<S: Clone, K, R, St> Clone for MessageIdempotency<S, K, R, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            extract: self.extract.clone(),
            store: self.store.clone(),
            kept: self.kept.clone(),
            settings: self.settings.clone(),
        }
    }
}

impl<S: fmt::Debug, K, R, St> fmt::Debug for MessageIdempotency<S, K, R, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MessageIdempotency")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

/// What became of one message.
///
/// | Variant | The consumer |
/// |---|---|
/// | `Ran` | publishes the outcome, acks |
/// | `Replayed` | publishes the outcome (the stored one, unchanged), acks |
/// | `InFlight` | requeues the message (nack with requeue), ideally after `retry_after` |
/// | `Refused` | requeues it if [`Refusal::retryable`], else rejects it (dead-letters it) |
#[derive(Debug)]
pub enum Handled<R> {
    /// The handler ran for this delivery, and its outcome is stored for duplicates
    /// (unless [`store_if`](super::MessageIdempotencyLayer::store_if) said not to; and
    /// a message without a key, or one run without the store under
    /// [`StoreFailure::FailOpen`], is not deduplicated at all).
    Ran(R),
    /// A duplicate: the handler did not run. `outcome` is the stored one, decoded
    /// unchanged.
    Replayed {
        /// The outcome stored when the handler ran.
        outcome: R,
        /// What is known of the delivery that ran.
        replay: ReplayInfo,
    },
    /// A delivery with this key is being handled (here or by another consumer): the
    /// handler did not run. Requeue the message; a later delivery gets the outcome.
    InFlight {
        /// When a redelivery makes sense.
        retry_after: Duration,
    },
    /// The message was not handled, for the reason given.
    Refused(Refusal),
}

impl<R> Handled<R> {
    /// The outcome, when there is one (`Ran` or `Replayed`).
    pub fn outcome(&self) -> Option<&R> {
        match self {
            Self::Ran(outcome) | Self::Replayed { outcome, .. } => Some(outcome),
            Self::InFlight { .. } | Self::Refused(_) => None,
        }
    }

    /// The outcome, when there is one.
    pub fn into_outcome(self) -> Option<R> {
        match self {
            Self::Ran(outcome) | Self::Replayed { outcome, .. } => Some(outcome),
            Self::InFlight { .. } | Self::Refused(_) => None,
        }
    }

    /// Whether this delivery was a duplicate given the stored outcome.
    pub fn is_replay(&self) -> bool {
        matches!(self, Self::Replayed { .. })
    }
}

/// Why a message was not handled: a stable `code` (the HTTP layer's codes where the
/// meaning is the same), a `detail` in the layer's words, and whether a redelivery can
/// succeed.
#[derive(Debug, Clone)]
pub struct Refusal {
    code: &'static str,
    detail: String,
    retryable: bool,
}

impl Refusal {
    fn new(code: &'static str, detail: impl Into<String>, retryable: bool) -> Self {
        Self {
            code,
            detail: detail.into(),
            retryable,
        }
    }

    /// The stable code:
    ///
    /// | Code | Retryable | When |
    /// |---|---|---|
    /// | `idempotency.key_missing` | no | [`require_key`](super::MessageIdempotencyLayer::require_key) and no key |
    /// | `idempotency.key_invalid` (or another [`KeyRejection::code`](crate::idempotency::KeyRejection::code)) | no | the extractor refused the message |
    /// | `idempotency.fingerprint_mismatch` | no | the key came before with another fingerprint |
    /// | `idempotency.not_replayable` | no | the handler ran, but its outcome was too large to keep (or not serialisable) |
    /// | `idempotency.outcome_undecodable` | no | the stored outcome does not decode into the outcome type (it changed since) |
    /// | `idempotency.original_failed` | yes | waiting mode: the delivery waited for failed and stored nothing |
    /// | `idempotency.store_unavailable` | yes | the store failed (fail closed) |
    /// | `idempotency.not_committed` | yes | the store refused the outcome's transaction |
    /// | `idempotency.outcome_unknown` | yes | the outcome's commit got no answer and could not be read back: the redelivery replays it if it landed |
    pub fn code(&self) -> &'static str {
        self.code
    }

    /// Whether a redelivery can succeed: requeue the message if so, else reject it.
    pub fn retryable(&self) -> bool {
        self.retryable
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.detail)
    }
}

impl std::error::Error for Refusal {}

type BoxFuture<R, E> = Pin<Box<dyn Future<Output = Result<Handled<R>, E>> + Send>>;

/// Response future of [`MessageIdempotency`].
///
/// Dropped once its message has claimed its key (the consumer's task was cancelled),
/// it hands the rest of its work to a task of its own, as the HTTP layer's does: a
/// handler that started runs to completion and its outcome is stored for the
/// redelivery. Dropped before the claim, it is cancelled.
pub struct ResponseFuture<R: 'static, E: 'static> {
    inner: Option<BoxFuture<R, E>>,
    claimed: Option<Arc<AtomicBool>>,
    unwinding: bool,
}

impl<R, E> Future for ResponseFuture<R, E> {
    type Output = Result<Handled<R>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let Some(inner) = this.inner.as_mut() else {
            panic!("ResponseFuture polled after completion");
        };
        this.unwinding = true;
        let poll = inner.as_mut().poll(cx);
        this.unwinding = false;
        let output = std::task::ready!(poll);
        this.inner = None;
        Poll::Ready(output)
    }
}

impl<R: 'static, E: 'static> Drop for ResponseFuture<R, E> {
    fn drop(&mut self) {
        let Some(unfinished) = self.inner.take() else {
            return;
        };
        if !self.unwinding {
            crate::idempotency::lease::detach_claimed(unfinished, self.claimed.as_deref());
        }
    }
}

impl<R: 'static, E: 'static> fmt::Debug for ResponseFuture<R, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<S, K, R, St, M> Service<M> for MessageIdempotency<S, K, R, St>
where
    S: Service<M, Response = R> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    K: ExtractMessageKey<M>,
    R: Serialize + DeserializeOwned + Send + 'static,
    St: IdempotencyStore,
    M: Send + 'static,
{
    type Response = Handled<R>;
    type Error = S::Error;
    type Future = ResponseFuture<R, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, message: M) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let settings = self.settings.clone();
        let key = match self.extract.extract_key(&message) {
            Ok(Some(key)) => key,
            Ok(None) if settings.require_key => {
                return ready(refuse(
                    "idempotency.key_missing",
                    "missing",
                    "this consumer requires an idempotency key on every message".into(),
                ));
            }
            Ok(None) => {
                return boxed(async move { inner.call(message).await.map(Handled::Ran) });
            }
            Err(rejection) => {
                return ready(refuse(
                    rejection.code(),
                    rejection.reason(),
                    rejection.to_string(),
                ));
            }
        };
        let claimed = Arc::new(AtomicBool::new(false));
        let span = tracing::info_span!(
            "idempotency",
            idempotency_key = key.key().as_str(),
            scope = %key.scope_key(),
        );
        let work = deduplicate(
            inner,
            self.store.clone(),
            self.kept.clone(),
            settings,
            message,
            key,
            claimed.clone(),
        )
        .instrument(span);
        ResponseFuture {
            inner: Some(Box::pin(work)),
            claimed: Some(claimed),
            unwinding: false,
        }
    }
}

fn boxed<R, E>(
    future: impl Future<Output = Result<Handled<R>, E>> + Send + 'static,
) -> ResponseFuture<R, E> {
    ResponseFuture {
        inner: Some(Box::pin(future)),
        claimed: None,
        unwinding: false,
    }
}

fn ready<R: Send + 'static, E: Send + 'static>(handled: Handled<R>) -> ResponseFuture<R, E> {
    boxed(std::future::ready(Ok(handled)))
}

/// A refusal of a message the layer cannot key, with its WARN event.
fn refuse<R>(code: &'static str, reason: &'static str, detail: String) -> Handled<R> {
    tracing::warn!(
        event = "idempotency.rejected",
        reason,
        code,
        detail = detail.as_str(),
        "message refused"
    );
    Handled::Refused(Refusal::new(code, detail, false))
}

async fn deduplicate<S, R, St, M>(
    inner: S,
    store: Arc<St>,
    kept: Arc<KeptOutcomes>,
    settings: Arc<MessageSettings<R>>,
    message: M,
    key: MessageKey,
    claimed: Arc<AtomicBool>,
) -> Result<Handled<R>, S::Error>
where
    S: Service<M, Response = R> + Send + 'static,
    S::Future: Send + 'static,
    R: Serialize + DeserializeOwned + Send + 'static,
    St: IdempotencyStore,
{
    let scope = key.scope_key();
    let fingerprint = key.fingerprint_digest();
    let claim = lease::claim(fingerprint, settings.lease, None);
    if let Some(waiting) = kept.get(&scope) {
        // This layer handled the message and holds its outcome until the store takes
        // it: never run it again, whatever the store says.
        waiting.nudge();
        let wait = match settings.in_flight {
            InFlight::Reject { retry_after } => Err(retry_after),
            InFlight::Wait { timeout } if waiting.settled(timeout).await => Ok(()),
            InFlight::Wait { .. } => Err(Duration::from_secs(1)),
        };
        if let Err(retry_after) = wait {
            return Ok(in_flight(None, retry_after));
        }
    }
    let begin = match store.begin(&scope, claim.clone()).await {
        Ok(begin) => begin,
        Err(error) => {
            return match settings.store_failure {
                StoreFailure::FailClosed => {
                    tracing::warn!(
                        event = "idempotency.store_failed",
                        error = %Chain(&error),
                        phase = "begin",
                        mode = "fail_closed",
                        "idempotency store failed; message not handled"
                    );
                    Ok(store_unavailable())
                }
                StoreFailure::FailOpen => {
                    tracing::warn!(
                        event = "idempotency.store_failed",
                        error = %Chain(&error),
                        phase = "begin",
                        mode = "fail_open",
                        "idempotency store failed; handling the message without deduplication"
                    );
                    let mut inner = inner;
                    inner.call(message).await.map(Handled::Ran)
                }
            };
        }
    };
    match begin {
        Begin::Claimed { lease } => {
            claimed.store(true, Ordering::Release);
            tracing::debug!(
                event = "idempotency.accepted",
                "idempotency key accepted; handling the message"
            );
            let guard = LeaseGuard::new(store, scope, claim, lease, kept);
            Box::pin(execute(inner, settings, message, guard)).await
        }
        Begin::Completed {
            record,
            request_count,
        } => Ok(settled(&record, fingerprint, request_count)),
        Begin::InFlight {
            fingerprint: running,
            request_count,
            ..
        } => {
            if running != fingerprint {
                return Ok(conflict());
            }
            match settings.in_flight {
                InFlight::Reject { retry_after } => Ok(in_flight(Some(request_count), retry_after)),
                InFlight::Wait { timeout } => match store.wait(&scope, timeout).await {
                    Ok(Settled::Completed { record }) => {
                        Ok(settled(&record, fingerprint, request_count))
                    }
                    Ok(Settled::TimedOut) => {
                        Ok(in_flight(Some(request_count), Duration::from_secs(1)))
                    }
                    Ok(Settled::Released) => {
                        tracing::info!(
                            event = "idempotency.original_failed",
                            "the delivery this one waited for did not complete; requeue"
                        );
                        Ok(Handled::Refused(Refusal::new(
                            "idempotency.original_failed",
                            "the delivery with this key that was being handled failed and stored nothing; a redelivery runs it again",
                            true,
                        )))
                    }
                    Err(error) => {
                        tracing::warn!(
                            event = "idempotency.store_failed",
                            error = %Chain(&error),
                            phase = "wait",
                            "idempotency store failed while waiting"
                        );
                        Ok(store_unavailable())
                    }
                },
            }
        }
    }
}

fn store_unavailable<R>() -> Handled<R> {
    Handled::Refused(Refusal::new(
        "idempotency.store_unavailable",
        "the idempotency store cannot check this key now, so nothing ran; requeue",
        true,
    ))
}

fn in_flight<R>(request_count: Option<u64>, retry_after: Duration) -> Handled<R> {
    tracing::info!(
        event = "idempotency.in_flight",
        request_count,
        retry_after_ms = u64::try_from(retry_after.as_millis()).unwrap_or(u64::MAX),
        "a delivery with this idempotency key is still being handled"
    );
    Handled::InFlight { retry_after }
}

fn conflict<R>() -> Handled<R> {
    tracing::warn!(
        event = "idempotency.conflict",
        "idempotency key reused with another message"
    );
    Handled::Refused(Refusal::new(
        "idempotency.fingerprint_mismatch",
        "this idempotency key came before with a different message; use a new key for a new command",
        false,
    ))
}

/// The answer to a duplicate of a message that was handled.
fn settled<R: DeserializeOwned>(
    record: &Record,
    fingerprint: Fingerprint,
    request_count: u64,
) -> Handled<R> {
    if record.fingerprint != fingerprint {
        return conflict();
    }
    let Some(stored) = &record.response else {
        tracing::info!(
            event = "idempotency.not_replayable",
            request_count,
            "the message was handled but its outcome was not kept"
        );
        return Handled::Refused(Refusal::new(
            "idempotency.not_replayable",
            "the message with this key was handled, but its outcome was not kept; it will not run again",
            false,
        ));
    };
    let outcome = match serde_json::from_slice(&stored.body) {
        Ok(outcome) => outcome,
        Err(error) => {
            tracing::warn!(
                event = "idempotency.outcome_undecodable",
                error = %error,
                request_count,
                "the stored outcome does not decode into the outcome type"
            );
            return Handled::Refused(Refusal::new(
                "idempotency.outcome_undecodable",
                "the message with this key was handled, but its stored outcome does not decode into this consumer's outcome type; it will not run again",
                false,
            ));
        }
    };
    tracing::info!(
        event = "idempotency.replayed",
        request_count,
        original_attempt = record.original_attempt.as_ref().map(AttemptId::as_str),
        "replayed the stored outcome"
    );
    Handled::Replayed {
        outcome,
        replay: ReplayInfo {
            request_count,
            first_seen: record.first_seen,
            original_attempt: record.original_attempt.clone(),
        },
    }
}

/// Runs the claimed message, renewing its claim while the handler runs, then stores
/// its outcome or releases the key.
async fn execute<S, R, St, M>(
    mut inner: S,
    settings: Arc<MessageSettings<R>>,
    message: M,
    mut guard: LeaseGuard<St>,
) -> Result<Handled<R>, S::Error>
where
    S: Service<M, Response = R> + Send + 'static,
    S::Future: Send + 'static,
    R: Serialize + Send + 'static,
    St: IdempotencyStore,
{
    let fingerprint = guard.claim().fingerprint;
    let outcome = match guard.renewing(inner.call(message)).await {
        Ok(outcome) => outcome,
        Err(error) => {
            guard.release("handler_error").await;
            return Err(error);
        }
    };
    if let Some(store_if) = &settings.store_if {
        if !store_if(&outcome) {
            guard.release("not_stored").await;
            return Ok(Handled::Ran(outcome));
        }
    }
    let response = match serde_json::to_vec(&outcome) {
        Ok(json) if json.len() <= settings.max_outcome_bytes => Some(StoredResponse {
            status: StatusCode::OK,
            headers: vec![(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            body: Bytes::from(json),
        }),
        Ok(json) => {
            tracing::warn!(
                event = "idempotency.response_too_large",
                bytes = json.len(),
                max_bytes = settings.max_outcome_bytes,
                "outcome over the idempotency limit: not kept; duplicates are refused, never run"
            );
            None
        }
        Err(error) => {
            tracing::warn!(
                event = "idempotency.outcome_unserialisable",
                error = %error,
                "the outcome does not serialise: not kept; duplicates are refused, never run"
            );
            None
        }
    };
    // The delivery that ran, named by its correlation ID: replays log it.
    let original_attempt =
        CorrelationId::current().map(|id| AttemptId::from_header_value(id.to_header_value()));
    let record = Record {
        fingerprint,
        first_seen: guard.first_seen(),
        original_attempt,
        epoch: None,
        response,
    };
    match guard
        .complete(record, settings.ttl, settings.max_kept_bytes)
        .await
    {
        Ok(()) => Ok(Handled::Ran(outcome)),
        Err(Unsettled::NotCommitted(error)) => Ok(Handled::Refused(Refusal::new(
            "idempotency.not_committed",
            format!("the outcome's transaction did not commit ({error}); requeue"),
            true,
        ))),
        Err(Unsettled::Unknown(error)) => Ok(Handled::Refused(Refusal::new(
            "idempotency.outcome_unknown",
            format!("whether the outcome's transaction committed is not known ({error}); requeue: the redelivery replays it if it committed"),
            true,
        ))),
    }
}
