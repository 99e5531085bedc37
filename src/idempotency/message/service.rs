//! A message's path through the message layer: its key read, the engine asked, and
//! its decision turned into what the consumer does with the delivery (`Handled`).

use crate::idempotency::code::event;
use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use serde::{de::DeserializeOwned, Serialize};
use tower_service::Service;
use tracing::Instrument as _;

use crate::correlation::CorrelationId;

use super::{layer::MessageSettings, ExtractMessageKey, MessageKey};
use crate::idempotency::{
    code::Code,
    core::{
        self, ClaimFlag, Claimed, Classified, Classifying, Decision, Detaching, Engine, Failure,
        Finished, OutcomeClass, Release, ReplayInfo, Unsettled, Verdict,
    },
    store::{IdempotencyStore, MokaStore, Payload, PayloadFormat, Record},
};

/// Middleware that handles each message key once and hands its stored outcome to every
/// duplicate. Made by [`MessageIdempotencyLayer`](super::MessageIdempotencyLayer); see
/// the [module docs](crate::idempotency::message).
pub struct MessageIdempotency<S, R, St, K> {
    pub(super) inner: S,
    pub(super) extract: Arc<K>,
    pub(super) engine: Engine<St>,
    pub(super) settings: Arc<MessageSettings<R>>,
}

impl<R> MessageIdempotency<(), R, MokaStore, super::NoMessageKey> {
    /// The layer, over a store of its own ([`MokaStore::new`]), to configure (its
    /// [`key`](super::MessageIdempotencyLayer::key) first) and apply with
    /// `ServiceBuilder`: `MessageIdempotency::layer().key(extract)`.
    pub fn layer() -> super::MessageIdempotencyLayer<R> {
        super::MessageIdempotencyLayer::new()
    }
}

impl<S, R, St, K> MessageIdempotency<S, R, St, K> {
    /// The wrapped handler.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped handler, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner handler.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone, R, St, K> Clone for MessageIdempotency<S, R, St, K> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            extract: self.extract.clone(),
            engine: self.engine.clone(),
            settings: self.settings.clone(),
        }
    }
}

impl<S: fmt::Debug, R, St, K> fmt::Debug for MessageIdempotency<S, R, St, K> {
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
#[non_exhaustive]
pub enum Handled<R> {
    /// The handler ran for this delivery, and its outcome is stored for duplicates
    /// (unless [`store_if`](super::MessageIdempotencyLayer::store_if) said not to; and
    /// a message without a key, or one run without the store under
    /// [`StoreFailure::FailOpen`](crate::idempotency::StoreFailure::FailOpen), is not
    /// deduplicated at all).
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
    code: Code,
    detail: String,
}

impl Refusal {
    fn new(code: Code, detail: impl Into<String>) -> Self {
        Self {
            code,
            detail: detail.into(),
        }
    }

    /// Why the message was refused:
    ///
    /// | Code | Retryable | When |
    /// |---|---|---|
    /// | `idempotency.key_missing` | no | [`require_key`](super::MessageIdempotencyLayer::require_key) and no key |
    /// | `idempotency.key_invalid` (or another [`KeyRejection::code`](crate::idempotency::extract::KeyRejection::code)) | no | the extractor refused the message |
    /// | `idempotency.fingerprint_mismatch` | no | the key came before with another fingerprint |
    /// | `idempotency.not_replayable` | no | the handler ran, but its outcome was too large to keep (or not serialisable) |
    /// | `idempotency.outcome_undecodable` | no | the stored outcome does not decode into the outcome type (it changed since) |
    /// | `idempotency.original_failed` | yes | waiting mode: the delivery waited for failed and stored nothing |
    /// | `idempotency.store_unavailable` | yes | the store failed (fail closed) |
    /// | `idempotency.pool_exhausted` | yes | every connection of the store's pool was in use |
    /// | `idempotency.not_committed` | yes | the store refused the outcome's transaction; or the handler failed on a transaction that broke under it (its backend terminated, its connection lost: a passing fault, not the handler's); or, over a store in transactional mode, `store_if` did not keep the outcome, so its writes were rolled back |
    /// | `idempotency.handler_unavailable` | yes | the handler failed on a passing fault ([`transient_if`](super::MessageIdempotencyLayer::transient_if)): the database unreachable or restarting, a serialization failure or deadlock, the pool timing out; nothing is kept, and the drivers requeue it uncounted |
    /// | `idempotency.outcome_unknown` | yes | the outcome's commit got no answer and could not be read back: the redelivery replays it if it landed |
    pub fn code(&self) -> Code {
        self.code
    }

    /// Whether a redelivery can succeed: requeue the message if so, else reject it.
    pub fn retryable(&self) -> bool {
        self.code.retryable()
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.detail)
    }
}

impl std::error::Error for Refusal {}

/// Response future of [`MessageIdempotency`].
///
/// Dropped once its message has claimed its key (the consumer's task was cancelled),
/// it hands the rest of its work to a task of its own, as the HTTP layer's does: a
/// handler that started runs to completion and its outcome is stored for the
/// redelivery. Dropped before the claim, it is cancelled.
pub struct ResponseFuture<R: 'static, E: 'static> {
    work: Detaching<Result<Handled<R>, E>>,
}

impl<R, E> Future for ResponseFuture<R, E> {
    type Output = Result<Handled<R>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.work).poll(cx)
    }
}

impl<R: 'static, E: 'static> fmt::Debug for ResponseFuture<R, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<S, R, St, K, M> Service<M> for MessageIdempotency<S, R, St, K>
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
                    Code::KeyMissing,
                    "missing",
                    "this consumer requires an idempotency key on every message".into(),
                ));
            }
            Ok(None) => {
                return unclaimed(async move { inner.call(message).await.map(Handled::Ran) });
            }
            Err(rejection) => {
                return ready(refuse(
                    rejection.code(),
                    rejection.reason(),
                    rejection.to_string(),
                ));
            }
        };
        // The correlation ID again, so a formatter that prints only the current span
        // still ties the layer's lines to the delivery.
        let correlation_id = CorrelationId::current();
        let span = tracing::info_span!(
            "idempotency",
            correlation_id = correlation_id.as_ref().map(CorrelationId::as_str),
            idempotency_key = key.key().as_str(),
            idempotency_scope = %key.scope_key(),
            idempotency_outcome = tracing::field::Empty,
            idempotency_request_count = tracing::field::Empty,
            idempotency_store_ms = tracing::field::Empty,
        );
        let engine = self.engine.clone();
        ResponseFuture {
            work: Detaching::claiming(|claimed| {
                deduplicate(inner, engine, settings, message, key, claimed).instrument(span)
            }),
        }
    }
}

fn unclaimed<R, E>(
    future: impl Future<Output = Result<Handled<R>, E>> + Send + 'static,
) -> ResponseFuture<R, E> {
    ResponseFuture {
        work: Detaching::new(future),
    }
}

fn ready<R: Send + 'static, E: Send + 'static>(handled: Handled<R>) -> ResponseFuture<R, E> {
    unclaimed(std::future::ready(Ok(handled)))
}

/// A refusal of a message the layer cannot key: in a span of the layer's own, as a
/// keyed message's events are, which records the outcome as the HTTP layer's request
/// span does.
fn refuse<R>(code: Code, reason: &'static str, detail: String) -> Handled<R> {
    let correlation_id = CorrelationId::current();
    let span = tracing::info_span!(
        "idempotency",
        correlation_id = correlation_id.as_ref().map(CorrelationId::as_str),
        idempotency_outcome = tracing::field::Empty
    );
    span.in_scope(|| {
        core::refusal::rejected(reason, code, &detail, core::refusal::Answered::Settled)
    });
    Handled::Refused(Refusal::new(code, detail))
}

/// Asks the engine what to do with a keyed message, and does it: runs the handler, or
/// answers for the engine.
async fn deduplicate<S, R, St, M>(
    mut inner: S,
    engine: Engine<St>,
    settings: Arc<MessageSettings<R>>,
    message: M,
    key: MessageKey,
    claimed: ClaimFlag,
) -> Result<Handled<R>, S::Error>
where
    S: Service<M, Response = R> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: 'static,
    R: Serialize + DeserializeOwned + Send + 'static,
    St: IdempotencyStore,
{
    let _in_flight = engine.track();
    let decision = engine
        .decide(key.scope_key(), key.fingerprint_digest(), None, &claimed)
        .await;
    match decision {
        Decision::Run(claimed) => Box::pin(execute(inner, &settings, message, claimed)).await,
        Decision::FailOpen => inner.call(message).await.map(Handled::Ran),
        Decision::Answer(verdict) => Ok(decided(verdict)),
    }
}

/// What a delivery gets instead of running the handler.
fn decided<R: DeserializeOwned>(verdict: Verdict) -> Handled<R> {
    match verdict {
        Verdict::Replay {
            record,
            request_count,
        } => replay(&record, request_count),
        Verdict::NotReplayable { .. } => not_replayable(),
        Verdict::InFlight { retry_after, .. } => Handled::InFlight { retry_after },
        // Messages carry no epoch, so a mismatch cannot happen; a conflict if it did.
        Verdict::Conflict | Verdict::EpochMismatch { .. } => Handled::Refused(Refusal::new(Code::FingerprintMismatch,
            "this idempotency key came before with a different message; use a new key for a new command")),
        Verdict::OriginalFailed => Handled::Refused(Refusal::new(Code::OriginalFailed,
            "the delivery with this key that was being handled failed and stored nothing; a redelivery runs it again")),
        Verdict::StoreUnavailable => Handled::Refused(Refusal::new(Code::StoreUnavailable,
            "the idempotency store cannot check this key now, so nothing ran; requeue")),
        Verdict::PoolExhausted => Handled::Refused(Refusal::new(Code::PoolExhausted,
            "every database connection is in use, so nothing ran; requeue")),
    }
}

fn not_replayable<R>() -> Handled<R> {
    Handled::Refused(Refusal::new(Code::NotReplayable,
        "the message with this key was handled, but its outcome was not kept; it will not run again"))
}

/// The stored outcome, decoded, for a duplicate of a message that was handled.
fn replay<R: DeserializeOwned>(record: &Record, request_count: u64) -> Handled<R> {
    let Some(stored) = record
        .payload
        .as_ref()
        .filter(|payload| payload.format() == PayloadFormat::MESSAGE)
        .map(Payload::body)
    else {
        core::replay_failed(request_count);
        return not_replayable();
    };
    match serde_json::from_slice(stored) {
        Ok(outcome) => Handled::Replayed {
            outcome,
            replay: ReplayInfo::of(record, request_count),
        },
        Err(error) => {
            core::replay_failed(request_count);
            tracing::warn!(
                event = event::OUTCOME_UNDECODABLE,
                error = %error,
                request_count,
                "the stored outcome does not decode into the outcome type"
            );
            Handled::Refused(Refusal::new(Code::OutcomeUndecodable,
                "the message with this key was handled, but its stored outcome does not decode into this consumer's outcome type; it will not run again"))
        }
    }
}

/// Runs the claimed message: the engine renews its claim while the handler runs, this
/// adapter says what of the outcome is kept, and the engine stores it or gives the key
/// back.
async fn execute<S, R, St, M>(
    mut inner: S,
    settings: &MessageSettings<R>,
    message: M,
    claimed: Claimed<St>,
) -> Result<Handled<R>, S::Error>
where
    S: Service<M, Response = R> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: 'static,
    R: Serialize + Send + 'static,
    St: IdempotencyStore,
{
    let classify = |outcome: &R, context: Classifying| classify(settings, outcome, context);
    // The delivery that ran is named by its correlation ID.
    let work = std::pin::pin!(inner.call(message));
    let (outcome, finished) = match claimed.run(work, classify, None).await {
        Ok(ran) => ran,
        Err(Failure::Handler(error)) => return Err(error),
        // What the handler failed on was its transaction's connection: a passing fault,
        // requeued uncounted, never a step toward the dead-letter queue.
        Err(Failure::TransactionBroke(_, error)) => {
            return Ok(Handled::Refused(Refusal::new(
                Code::NotCommitted,
                format!(
                "the handler's transaction broke under it ({}); nothing it wrote stands; requeue",
                crate::idempotency::store::Chain(&error)
            ),
            )))
        }
        Err(Failure::Transient(_)) => {
            return Ok(Handled::Refused(Refusal::new(
                Code::HandlerUnavailable,
                "the handler failed on a passing fault (its database unavailable, or its transaction in conflict); nothing of it is kept; requeue",
            )))
        }
    };
    Ok(match finished {
        Finished::Unsettled(Unsettled::NotCommitted(error)) => Handled::Refused(Refusal::new(Code::NotCommitted,
            format!("the outcome's transaction did not commit ({error}); requeue"))),
        Finished::Unsettled(Unsettled::Unknown(error)) => Handled::Refused(Refusal::new(Code::OutcomeUnknown,
            format!("whether the outcome's transaction committed is not known ({error}); requeue: the redelivery replays it if it committed"))),
        // Acked, the delivery would be lost: its writes were rolled back.
        Finished::RolledBack(error) => Handled::Refused(Refusal::new(Code::NotCommitted,
            format!("the outcome's transaction was rolled back ({error}); requeue"))),
        Finished::Kept { .. } | Finished::NotKept | Finished::Released | Finished::Failed => {
            Handled::Ran(outcome)
        }
    })
}

/// What of an outcome is kept: its JSON, a success by every storage rule, unless the
/// layer's `store_if` refuses it; one over the limit, or that does not serialise, is
/// recorded as run without it.
fn classify<R: Serialize>(
    settings: &MessageSettings<R>,
    outcome: &R,
    context: Classifying,
) -> Classified {
    let overridden = settings.store_if.as_ref().map(|store_if| store_if(outcome));
    if !context.keeps(OutcomeClass::Success, false, overridden) {
        return Classified::Release(Release::NotStored);
    }
    match serde_json::to_vec(outcome) {
        Ok(json) if json.len() <= settings.max_response_bytes => {
            let json = Bytes::from(json);
            Classified::Store(Payload::new(PayloadFormat::MESSAGE, 0, Bytes::new(), json))
        }
        Ok(_) => Classified::TooLarge {
            max_bytes: settings.max_response_bytes,
        },
        Err(error) => Classified::Unencodable(error.to_string()),
    }
}
