//! A message's path through the message layer: its key read, the engine asked, and
//! its decision turned into what the consumer does with the delivery (`Handled`).

use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};
use tower_ids_core::event;

use bytes::Bytes;
use serde::{de::DeserializeOwned, Serialize};
use tower_service::Service;
use tracing::Instrument as _;

use super::{layer::MessageSettings, ExtractMessageKey, MessageKey};
use tower_ids_core::{
    engine::{
        self as core, observe, Answer, ClaimFlag, Classified, Classify, Classifying, Detaching,
        Engine, Exchange, Keyed, OutcomeClass, Release, Resolution,
    },
    store::{IdempotencyStore, Payload, PayloadFormat, Record, TransactionOffer},
    Code, ReplayInfo,
};
use tower_ids_moka::MokaStore;

/// Middleware that handles each message key once and hands its stored outcome to every
/// duplicate. Made by [`MessageIdempotencyLayer`](super::MessageIdempotencyLayer); see
/// the [module docs](crate).
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
    /// [`StoreFailure::FailOpen`](tower_ids_core::StoreFailure::FailOpen), is not
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
    /// | `idempotency.key_invalid` (or another [`KeyRejection::code`](tower_ids_core::KeyRejection::code)) | no | the extractor refused the message |
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
        // The layer's own span, as every transport's keyed work has where the current
        // span lacks the layer's fields.
        let span = observe::protected_span(Some(key.key()), Some(&key.scope_key()), None);
        let engine = self.engine.clone();
        ResponseFuture {
            work: Detaching::claiming(|claimed| async move {
                let work = deduplicate(inner, engine, settings, message, key, claimed);
                match span {
                    Some(span) => work.instrument(span).await,
                    None => work.await,
                }
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

/// A refusal of a message the layer cannot key, counted and logged as every
/// transport's refusals are.
fn refuse<R>(code: Code, reason: &'static str, detail: String) -> Handled<R> {
    core::refusal::rejected(reason, code, &detail, core::refusal::Answered::Message);
    Handled::Refused(Refusal::new(code, detail))
}

/// The noun of the engine's answers for a message.
const NOUN: &str = "message";

/// Hands a keyed message to the engine, and says what became of it.
async fn deduplicate<S, R, St, M>(
    inner: S,
    engine: Engine<St>,
    settings: Arc<MessageSettings<R>>,
    message: M,
    key: MessageKey,
    claimed: ClaimFlag,
) -> Result<Handled<R>, S::Error>
where
    S: Service<M, Response = R> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    R: Serialize + DeserializeOwned + Send + 'static,
    St: IdempotencyStore,
    M: Send + 'static,
{
    let _in_flight = engine.track();
    let keyed = Keyed {
        scope: key.scope_key(),
        fingerprint: key.fingerprint_digest(),
        epoch: None,
        // The delivery that ran is named by its correlation ID.
        attempt: None,
        noun: NOUN,
    };
    let delivery = Delivery { inner, message };
    Ok(
        match engine.handle(keyed, &claimed, delivery, &*settings).await {
            Resolution::Ran { output, .. } => Handled::Ran(output),
            Resolution::FailOpen(Delivery { mut inner, message }) => {
                return inner.call(message).await.map(Handled::Ran)
            }
            Resolution::Replay {
                record,
                request_count,
            } => replay(record, request_count),
            Resolution::Answer(answer) => answered(answer),
            Resolution::Failed(error) => return Err(error),
        },
    )
}

/// A claimed message's handler, for the engine (which puts the transaction it offers,
/// if any, where [`Transaction::current`](tower_ids_core::store::Transaction)
/// finds it).
struct Delivery<S, M> {
    inner: S,
    message: M,
}

impl<S, R, M> Exchange for Delivery<S, M>
where
    S: Service<M, Response = R> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    R: Send + 'static,
    M: Send + 'static,
{
    type Output = R;
    type Error = S::Error;

    fn run(
        mut self,
        _: Option<TransactionOffer>,
    ) -> impl Future<Output = Result<R, S::Error>> + Send {
        self.inner.call(self.message)
    }
}

/// The engine's answer, as the consumer acts on it.
fn answered<R>(answer: Answer) -> Handled<R> {
    match (answer.code, answer.retry_after) {
        (Code::InFlight, Some(retry_after)) => Handled::InFlight { retry_after },
        (code, _) => Handled::Refused(Refusal::new(code, answer.detail)),
    }
}

/// The stored outcome, decoded, for a duplicate of a message that was handled.
fn replay<R: DeserializeOwned>(record: Arc<Record>, request_count: u64) -> Handled<R> {
    let Some(stored) = record
        .payload
        .as_ref()
        .filter(|payload| payload.format() == PayloadFormat::MESSAGE)
        .map(Payload::body)
    else {
        core::replay_failed(request_count);
        return answered(Answer::not_replayable(NOUN, record, request_count));
    };
    match serde_json::from_slice(stored) {
        Ok(outcome) => Handled::Replayed {
            outcome,
            replay: ReplayInfo::of(&record, request_count),
        },
        Err(error) => {
            core::replay_failed(request_count);
            tracing::warn!(
                target: "tower_ids::idempotency::message",
                event = event::OUTCOME_UNDECODABLE,
                error = %error,
                request_count,
                "the stored outcome does not decode into the outcome type"
            );
            answered(Answer::undecodable(NOUN))
        }
    }
}

/// What of an outcome is kept: its JSON, a success by every storage rule, unless the
/// layer's `store_if` refuses it; one over the limit, or that does not serialise, is
/// recorded as run without it.
impl<R: Serialize> Classify<R> for MessageSettings<R> {
    fn classify(&self, outcome: &R, context: Classifying) -> Classified {
        let overridden = self.store_if.as_ref().map(|store_if| store_if(outcome));
        if !context.keeps(OutcomeClass::Success, false, overridden) {
            return Classified::Release(Release::NotStored);
        }
        match serde_json::to_vec(outcome) {
            Ok(json) if json.len() <= self.max_response_bytes => {
                let json = Bytes::from(json);
                Classified::Store(Payload::new(PayloadFormat::MESSAGE, 0, Bytes::new(), json))
            }
            Ok(_) => Classified::TooLarge {
                max_bytes: self.max_response_bytes,
            },
            Err(error) => Classified::Unencodable(error.to_string()),
        }
    }

    /// Every outcome a message handler returns is a success; its failures are errors.
    fn succeeded(&self, _: &R) -> bool {
        true
    }
}
