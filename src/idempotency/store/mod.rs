//! Where the idempotency layer keeps its records: the [`IdempotencyStore`] trait and
//! its embedded implementation, [`MokaStore`].

#[cfg(any(feature = "redis", feature = "postgres"))]
mod codec;
#[cfg(any(feature = "redis", feature = "postgres"))]
mod deadline;
mod moka;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "redis")]
mod redis;

use std::{
    any::Any,
    future::Future,
    sync::{Arc, Mutex, OnceLock, PoisonError},
    time::{Duration, SystemTime},
};

use bytes::Bytes;
#[cfg(any(feature = "redis", feature = "postgres"))]
use tracing::Instrument as _;

pub use self::moka::{
    MokaStore, MokaStoreBuilder, DEFAULT_MOKA_MAX_BYTES, MOKA_ENTRY_OVERHEAD_BYTES,
};
#[cfg(feature = "postgres")]
pub use self::postgres::{
    PostgresMode, PostgresStore, PostgresStoreBuilder, Transaction, TransactionError,
    TransactionGuard, DEFAULT_POSTGRES_CLEANUP_BATCH, DEFAULT_POSTGRES_CLEANUP_INTERVAL,
    DEFAULT_POSTGRES_COMMAND_TIMEOUT, DEFAULT_POSTGRES_TABLE,
};
#[cfg(feature = "redis")]
pub use self::redis::{
    RedisStore, RedisStoreBuilder, DEFAULT_REDIS_COMMAND_TIMEOUT, DEFAULT_REDIS_PREFIX,
};
pub use super::scope::{Fingerprint, ScopeKey};
use super::AttemptId;

/// A claim sent to a store outside the process whose answer has not come back. If the
/// caller gives up on it (an error, a timeout, a dropped future), the claim may still
/// have landed, or land later; so, dropped before [`answered`](Self::answered), it is
/// released from a task of its own, again and again until the store answers or the
/// claim, held for `hold`, would have run out anyway. A release is fenced by the
/// claim's token, so it never touches another request's claim, nor a record.
#[cfg(any(feature = "redis", feature = "postgres"))]
struct SentClaim<'a, St: IdempotencyStore + Clone> {
    /// Borrowed: a clone is made only if the claim must be given up.
    store: &'a St,
    scope: ScopeKey,
    lease: Option<Lease>,
    hold: Duration,
}

#[cfg(any(feature = "redis", feature = "postgres"))]
impl<'a, St: IdempotencyStore + Clone> SentClaim<'a, St> {
    fn new(store: &'a St, scope: ScopeKey, lease: Lease, hold: Duration) -> Self {
        Self {
            store,
            scope,
            lease: Some(lease),
            hold,
        }
    }

    /// The store answered: whatever it says of the claim is known.
    fn answered(mut self) {
        self.lease = None;
    }
}

#[cfg(any(feature = "redis", feature = "postgres"))]
impl<St: IdempotencyStore + Clone> Drop for SentClaim<'_, St> {
    fn drop(&mut self) {
        let Some(lease) = self.lease.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (store, scope, hold) = (self.store.clone(), self.scope, self.hold);
        let release = async move {
            let until = tokio::time::Instant::now() + hold;
            let mut pause = Duration::from_millis(50);
            loop {
                match store.release(&scope, &lease).await {
                    Ok(released) => {
                        tracing::debug!(
                            event = "idempotency.unanswered_claim_released",
                            released,
                            "gave up a claim whose answer never came; its request ran nothing"
                        );
                        return;
                    }
                    Err(_) if tokio::time::Instant::now() + pause < until => {
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(Duration::from_millis(500));
                    }
                    Err(_) => return,
                }
            }
        };
        runtime.spawn(release.instrument(tracing::Span::current()));
    }
}

/// A record store for the idempotency layer, shared behind an `Arc`.
///
/// Every state change is atomic per scope: of any number of concurrent [`begin`]s for
/// one scope, exactly one gets [`Begin::Claimed`]; [`renew`], [`complete`] and
/// [`release`] act only for the lease that claim returned, so a worker whose lease ran
/// out can never overwrite the record of the one that took over. Each may be called
/// again with the same lease after an answer was lost (a timeout, a dropped
/// connection) with the effect of one call.
///
/// [`begin`]: Self::begin
/// [`renew`]: Self::renew
/// [`complete`]: Self::complete
/// [`release`]: Self::release
pub trait IdempotencyStore: Send + Sync + 'static {
    /// Counts one more request for `scope` and claims it if no live record exists.
    fn begin(
        &self,
        scope: &ScopeKey,
        claim: Claim,
    ) -> impl Future<Output = Result<Begin, StoreError>> + Send;

    /// Keeps the claim `lease` holds on `scope` for another `claim.lease` from now,
    /// while its request runs. If the claim is gone and nothing took its place (the
    /// store lost it, or it ran out unrenewed), it is put back from `claim`.
    ///
    /// Must be safe to repeat: renewing twice with one lease is renewing once.
    fn renew(
        &self,
        scope: &ScopeKey,
        lease: &Lease,
        claim: &Claim,
    ) -> impl Future<Output = Result<Renewal, StoreError>> + Send;

    /// Stores the outcome of the claimed request for `ttl`, unless another request
    /// stored its outcome ([`Completion::Superseded`]) or holds the scope now
    /// ([`Completion::ClaimedByAnother`]: the layer tries again once that claim is
    /// settled). A claim that is gone with nothing in its place does not stop it: the
    /// request ran, and its outcome is what keeps it from running again.
    ///
    /// Must be safe to repeat: completing twice with one lease stores once, and the
    /// second call answers [`Completion::Stored`] (the layer retries a completion
    /// whose answer was lost).
    fn complete(
        &self,
        scope: &ScopeKey,
        lease: &Lease,
        record: Arc<Record>,
        ttl: Duration,
    ) -> impl Future<Output = Result<Completion, StoreError>> + Send;

    /// Gives the scope up so a retry runs again; `Ok(false)` if `lease` no longer
    /// holds it.
    fn release(
        &self,
        scope: &ScopeKey,
        lease: &Lease,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Waits up to `timeout` for the request in flight on `scope` to settle.
    fn wait(
        &self,
        scope: &ScopeKey,
        timeout: Duration,
    ) -> impl Future<Output = Result<Settled, StoreError>> + Send;

    /// The longest from this store answering again after an outage to one of its calls
    /// succeeding: a call's timeout (one sent just before the store came back may
    /// wait it out), plus the time to reconnect. The layers refuse a lease a quarter
    /// of which does not cover it, and the pause before a failed renewal is tried
    /// again (see [the guarantees](crate::guide::guarantees)). Default zero, for a
    /// store in process.
    fn recovery_time(&self) -> Duration {
        Duration::ZERO
    }
}

/// The open database transaction that holds a claim, from
/// [`Begin::ClaimedByTransaction`]: offered to the handler (in the request's extensions,
/// and as [`TransactionOffer::current`] while it runs) to make its writes in; the layer
/// stores the outcome in it and commits, or rolls it back to give the key up.
pub trait HandlerTransaction: Send + Sync + 'static {
    /// What the handler takes the transaction from. The HTTP and gRPC layers put it in
    /// the request's extensions (and the PostgreSQL store's `Transaction` in it, as
    /// itself).
    fn offer(&self) -> TransactionOffer;

    /// Whether the handler used the transaction. A server error of a handler that did
    /// is rolled back and its key released, whatever the layer's storage rule: the
    /// rollback undid its writes, so a retry may run again. Default `false`.
    fn taken(&self) -> bool {
        false
    }

    /// After the handler: stores `outcome` (the record and its TTL) in the transaction
    /// and commits; with no outcome (the response is not stored, or the handler
    /// failed), rolls it back. Either way the claim ends with it.
    fn settle(
        self: Box<Self>,
        scope: ScopeKey,
        outcome: Option<(Arc<Record>, Duration)>,
    ) -> std::pin::Pin<Box<dyn Future<Output = Settlement> + Send>>;
}

impl std::fmt::Debug for dyn HandlerTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandlerTransaction").finish_non_exhaustive()
    }
}

/// What a store's [`HandlerTransaction`] offers the handler to run its writes in: the
/// store's own handle, opaque to the layers, read back by its type.
#[derive(Clone)]
pub struct TransactionOffer(Arc<dyn std::any::Any + Send + Sync>);

tokio::task_local! {
    /// The offer of the claimed request whose handler is being polled.
    static CURRENT_OFFER: TransactionOffer;
}

impl TransactionOffer {
    /// Offers `handle`.
    pub fn new<T: std::any::Any + Send + Sync>(handle: T) -> Self {
        Self(Arc::new(handle))
    }

    /// The handle, if it is a `T`.
    pub fn get<T: std::any::Any>(&self) -> Option<&T> {
        self.0.downcast_ref()
    }

    /// The handle offered to the handler being run, if it is a `T`: how a handler whose
    /// input has no extensions (a message consumer's) finds its transaction. Set while
    /// the layer polls the handler's future, not in tasks it spawns.
    pub fn current<T: std::any::Any + Clone>() -> Option<T> {
        CURRENT_OFFER
            .try_with(|offer| offer.get::<T>().cloned())
            .ok()
            .flatten()
    }

    /// Runs `work` with this offer as [`current`](Self::current).
    pub(crate) async fn scope<F: Future>(self, work: F) -> F::Output {
        CURRENT_OFFER.scope(self, work).await
    }
}

impl std::fmt::Debug for TransactionOffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransactionOffer").finish_non_exhaustive()
    }
}

/// How a [`HandlerTransaction`] ended.
#[derive(Debug)]
pub enum Settlement {
    /// The handler's writes and the record committed together.
    Committed,
    /// Nothing to store: the handler's writes were rolled back.
    RolledBack,
    /// The transaction did not commit (the database refused it, a statement before the
    /// commit failed, or another request holds the key): nothing the handler wrote in
    /// it stands, and the key is free to run again. Only for a commit known not to have
    /// landed: one whose answer was lost is [`Unknown`](Self::Unknown) until the store
    /// has found out.
    Failed(StoreError),
    /// The commit was sent but its answer was lost, and the store could not find out in
    /// time whether it landed. The claim ends with the transaction: a retry replays the
    /// outcome if the commit landed, and runs again once the database has settled that
    /// it did not.
    Unknown(StoreError),
}

/// What [`IdempotencyStore::begin`] is asked to claim.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Claim {
    /// The request's fingerprint, kept to refuse the key with another payload.
    pub fingerprint: Fingerprint,
    /// How long the claim holds the scope if it is never completed or released.
    pub lease: Duration,
    /// The control epoch the request belongs to, when the layer binds keys to one.
    pub epoch: Option<u64>,
}

impl Claim {
    /// A claim of the request with `fingerprint`, holding its scope for `lease`, in the
    /// control `epoch` if the layer binds keys to one.
    pub fn new(fingerprint: Fingerprint, lease: Duration, epoch: Option<u64>) -> Self {
        Self {
            fingerprint,
            lease,
            epoch,
        }
    }
}

/// The answer of [`IdempotencyStore::begin`].
#[derive(Debug)]
pub enum Begin {
    /// This request holds the scope: run it, then complete or release the lease.
    Claimed {
        /// Proof of the claim, for `complete` and `release`.
        lease: Lease,
    },
    /// This request holds the scope for as long as `transaction`, a database
    /// transaction the store opened, lives: no lease, no renewals. Settling it stores
    /// the outcome (committing with it whatever the handler wrote in it) or gives the
    /// key up (rolling back); a process, session or connection that dies ends it, and
    /// the key is free at once.
    ClaimedByTransaction {
        /// When the claiming request arrived, and the claim's token, for its record.
        lease: Lease,
        /// The transaction that holds the claim.
        transaction: Box<dyn HandlerTransaction>,
    },
    /// Another request's open transaction holds the scope
    /// ([`ClaimedByTransaction`](Self::ClaimedByTransaction)): what it runs is not
    /// visible until it commits, so neither its fingerprint nor the request count is
    /// known. Duplicates are told it is in flight; its record answers them once it
    /// commits.
    Locked,
    /// Another request holds the scope and has not finished.
    InFlight {
        /// The fingerprint of the request in flight.
        fingerprint: Fingerprint,
        /// When the request in flight arrived.
        first_seen: SystemTime,
        /// The epoch of the request in flight.
        epoch: Option<u64>,
        /// Requests seen for this scope, this one included.
        request_count: u64,
    },
    /// The scope has a stored outcome.
    Completed {
        /// The outcome.
        record: Arc<Record>,
        /// Requests seen for this scope, this one included.
        request_count: u64,
    },
}

/// The answer of [`IdempotencyStore::renew`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewal {
    /// The claim holds for another lease.
    Extended,
    /// The claim was gone, and nothing had taken its place: it is back. The store lost
    /// it (a restart without persistence) or it ran out unrenewed, so a duplicate may
    /// have run meanwhile.
    Restored,
    /// Another request holds the scope, or an outcome is stored for it.
    Lost,
}

/// The answer of [`IdempotencyStore::complete`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Completion {
    /// The outcome is stored (now, or by an earlier call with the same lease).
    Stored,
    /// The outcome is stored, but the claim had gone (the store lost it, or it ran
    /// out): a duplicate may have run meanwhile.
    StoredWithoutClaim,
    /// Another request stored its outcome; this one is not stored, and never will be.
    Superseded,
    /// Another request's claim holds the scope (this one's ran out and was taken),
    /// and no outcome is stored: this one is not stored now. The layer keeps it and
    /// tries again until that claim is settled: completed (then this one is
    /// [`Superseded`](Self::Superseded)) or released without running (then this one
    /// is stored, and keeps the handler from running again).
    ClaimedByAnother,
}

impl Completion {
    /// Whether the outcome is now in the store.
    pub fn is_stored(self) -> bool {
        matches!(self, Self::Stored | Self::StoredWithoutClaim)
    }
}

/// A claim on a scope, unique to one [`Begin::Claimed`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Lease {
    /// The claim's unique value (a fencing token): a counter in memory, 128 random
    /// bits in Redis.
    pub token: u128,
    /// When the claiming request arrived.
    pub first_seen: SystemTime,
}

impl Lease {
    /// The lease a store hands out: its fencing `token`, and when the claiming request
    /// arrived.
    pub fn new(token: u128, first_seen: SystemTime) -> Self {
        Self { token, first_seen }
    }
}

/// The outcome of an executed request, as stored.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Record {
    /// The fingerprint of the request that ran.
    pub fingerprint: Fingerprint,
    /// When it arrived.
    pub first_seen: SystemTime,
    /// Its attempt ID, if it sent one.
    pub original_attempt: Option<AttemptId>,
    /// The control epoch it ran in, when the layer binds keys to one.
    pub epoch: Option<u64>,
    /// What duplicates get back; `None` when it was too large to keep (the request ran,
    /// and duplicates are told so rather than run it again).
    pub payload: Option<Payload>,
    /// When the store lets it go: set by the layer as it completes the request (then
    /// plus the TTL, the expiry it gives the store), and kept with the record. `None`
    /// for a record built without it.
    pub expires_at: Option<SystemTime>,
}

impl Record {
    /// A record, as a store that keeps records its own way reads one back.
    pub fn new(
        fingerprint: Fingerprint,
        first_seen: SystemTime,
        original_attempt: Option<AttemptId>,
        epoch: Option<u64>,
        payload: Option<Payload>,
    ) -> Self {
        Self {
            fingerprint,
            first_seen,
            original_attempt,
            epoch,
            payload,
            expires_at: None,
        }
    }

    /// The record, saying when the store lets it go.
    pub fn with_expiry(mut self, expires_at: SystemTime) -> Self {
        self.expires_at = Some(expires_at);
        self
    }

    /// Bytes the record holds for its outcome ([`Payload::weight`]).
    pub fn weight(&self) -> usize {
        self.payload.as_ref().map_or(0, Payload::weight)
    }
}

/// What a record hands back to duplicates: the transport's answer as its layer
/// encoded it, opaque to the store. The store keeps its [`format`](Self::format) tag,
/// its [`status`](Self::status), its head and its body, and gives them back as they
/// were.
#[derive(Clone)]
pub struct Payload {
    format: PayloadFormat,
    status: u16,
    /// Encoded when a store first asks for it, if the payload was made from its decoded
    /// form: a store in this process never asks.
    head: OnceLock<Bytes>,
    body: Bytes,
    decoded: Option<Decoded>,
}

/// What the layer that made a payload reads it as, kept beside it (and weighed with it)
/// so that a replay from a store in this process decodes nothing.
#[derive(Clone)]
struct Decoded {
    value: Arc<dyn Any + Send + Sync>,
    bytes: usize,
    encode_head: fn(&(dyn Any + Send + Sync)) -> Bytes,
}

/// Which layer encoded a [`Payload`]: a layer replays only its own format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PayloadFormat(u8);

impl PayloadFormat {
    /// An HTTP response: the head holds its status and headers, the body its body.
    pub const HTTP: Self = Self(1);
    /// A gRPC call's response: its metadata, messages and trailers, in the body.
    pub const GRPC: Self = Self(2);
    /// A message handler's outcome: its JSON, in the body.
    pub const MESSAGE: Self = Self(3);

    /// The format tagged `tag`, as a store reads it back.
    pub const fn from_tag(tag: u8) -> Self {
        Self(tag)
    }

    /// The tag a store keeps.
    pub const fn tag(self) -> u8 {
        self.0
    }
}

impl Payload {
    /// A payload of `format`: its `status` as the transport numbers it (the HTTP
    /// status, the gRPC code, `0` for a message outcome), for operators and logs; its
    /// `head` and `body`, opaque.
    pub fn new(format: PayloadFormat, status: u16, head: Bytes, body: Bytes) -> Self {
        Self {
            format,
            status,
            head: OnceLock::from(head),
            body,
            decoded: None,
        }
    }

    /// A payload of `format` made from `value`, what its layer reads it as, which
    /// weighs `bytes` beside `body`; its head is `encode_head(value)`, encoded only when
    /// a store asks for it.
    pub(crate) fn from_decoded<T: Any + Send + Sync>(
        format: PayloadFormat,
        status: u16,
        body: Bytes,
        value: T,
        bytes: usize,
        encode_head: fn(&(dyn Any + Send + Sync)) -> Bytes,
    ) -> Self {
        Self {
            format,
            status,
            head: OnceLock::new(),
            body,
            decoded: Some(Decoded {
                value: Arc::new(value),
                bytes,
                encode_head,
            }),
        }
    }

    /// Which layer encoded it.
    pub fn format(&self) -> PayloadFormat {
        self.format
    }

    /// The answer's status as its transport numbers it.
    pub fn status(&self) -> u16 {
        self.status
    }

    /// What the layer keeps besides the body (an HTTP response's status and headers).
    pub fn head(&self) -> &Bytes {
        self.head.get_or_init(|| match &self.decoded {
            Some(decoded) => (decoded.encode_head)(&*decoded.value),
            None => Bytes::new(),
        })
    }

    /// The answer's body (an HTTP response's body, a message outcome's JSON).
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// Bytes held: the head, the body, and what the layer that made it keeps of it
    /// decoded.
    pub fn weight(&self) -> usize {
        self.head.get().map_or(0, Bytes::len)
            + self.body.len()
            + self.decoded.as_ref().map_or(0, |decoded| decoded.bytes)
    }

    /// What the layer that made this payload reads it as, if it is kept with it (in a
    /// store in this process) and is a `T`.
    pub(crate) fn decoded<T: Any>(&self) -> Option<&T> {
        self.decoded.as_ref()?.value.downcast_ref()
    }
}

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Payload")
            .field("format", &self.format)
            .field("status", &self.status)
            .field("head_bytes", &self.head.get().map(Bytes::len))
            .field("body_bytes", &self.body.len())
            .finish()
    }
}

/// How a wait on a request in flight ended.
#[derive(Debug)]
pub enum Settled {
    /// It completed; here is its record.
    Completed {
        /// The outcome.
        record: Arc<Record>,
        /// Requests seen for this scope, this one included, if the store counted the
        /// waiting one as it read the record (else the count `begin` gave stands).
        request_count: Option<u64>,
    },
    /// It was released (failed, panicked, or was not storable): a retry runs again.
    Released,
    /// It ended without storing anything, and the store claimed the key for the one
    /// that waited, as [`Begin::ClaimedByTransaction`] does: that one runs now, in this
    /// transaction.
    ClaimedByTransaction {
        /// When the claim was made, and its token.
        lease: Lease,
        /// The transaction that holds the claim.
        transaction: Box<dyn HandlerTransaction>,
    },
    /// It is still running.
    TimedOut,
}

/// A store that could not answer.
#[derive(Debug)]
pub struct StoreError {
    message: String,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
    exhausted: bool,
}

impl StoreError {
    /// An error described by `message`.
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            source: None,
            exhausted: false,
        }
    }

    /// An error caused by `source`.
    pub fn with_source(
        message: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Self {
            message: message.into(),
            source: Some(source.into()),
            exhausted: false,
        }
    }

    /// The store is up but had no room for the call (every connection of its pool was
    /// in use for as long as the call could wait): the layers answer that with a code
    /// of its own (`idempotency.pool_exhausted`), whatever the store-failure rule, as
    /// running more work would only add to the load.
    pub fn exhausted(mut self) -> Self {
        self.exhausted = true;
        self
    }

    /// Whether the store had no room for the call ([`exhausted`](Self::exhausted)).
    pub fn is_exhausted(&self) -> bool {
        self.exhausted
    }
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// An error and its causes, `: `-separated, for a log field: "claiming a key in Redis:
/// Connection refused", not just "claiming a key in Redis".
pub(crate) struct Chain<'a>(pub(crate) &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(cause) = source {
            write!(f, ": {cause}")?;
            source = cause.source();
        }
        Ok(())
    }
}

/// The time the store reads to decide expiry; injectable so tests need not sleep.
pub trait Clock: Send + Sync + 'static {
    /// Now.
    fn now(&self) -> SystemTime;
}

/// The system clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> SystemTime {
        SystemTime::now()
    }
}

/// A clock that moves only when told to, for tests of TTL and leases.
#[derive(Debug, Clone)]
pub struct ManualClock(Arc<Mutex<SystemTime>>);

impl ManualClock {
    /// A clock stopped at the current system time.
    pub fn new() -> Self {
        Self(Arc::new(Mutex::new(SystemTime::now())))
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) += by;
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> SystemTime {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
