//! The message layer's settings: where a message's key comes from, which outcomes are
//! kept, and the policy every idempotency layer shares.

use std::{fmt, marker::PhantomData, sync::Arc};

use tower_layer::Layer;

use super::{MessageIdempotency, NoMessageKey};
use tower_ids_core::{
    engine::Engine, store::IdempotencyStore, Drain, Policy, PolicyError, DEFAULT_MAX_RESPONSE_BYTES,
};
use tower_ids_moka::MokaStore;

pub(super) type OutcomePredicate<R> = Arc<dyn Fn(&R) -> bool + Send + Sync>;

pub(super) struct MessageSettings<R> {
    pub(super) require_key: bool,
    pub(super) max_response_bytes: usize,
    pub(super) store_if: Option<OutcomePredicate<R>>,
}

impl<R> Clone for MessageSettings<R> {
    fn clone(&self) -> Self {
        Self {
            require_key: self.require_key,
            max_response_bytes: self.max_response_bytes,
            store_if: self.store_if.clone(),
        }
    }
}

/// Applies [`MessageIdempotency`] to a message handler: each key handled once, its
/// outcome stored and handed back, unchanged, for every duplicate.
///
/// `K` reads the key of a message ([`ExtractMessageKey`](super::ExtractMessageKey));
/// `R` is the handler's outcome, stored as JSON. See the
/// [module docs](crate).
///
/// # Clone
///
/// Clones share the store, the extractor, the settings and the outcomes kept for the
/// store (behind `Arc`s): one layer cloned onto several consumers of one queue is one
/// deduplication.
#[must_use]
pub struct MessageIdempotencyLayer<R, St = MokaStore, K = NoMessageKey> {
    pub(super) extract: Arc<K>,
    pub(super) engine: Engine<St>,
    pub(super) settings: Arc<MessageSettings<R>>,
    pub(super) outcome: PhantomData<fn() -> R>,
}

impl<R> MessageIdempotencyLayer<R> {
    /// A layer over its own in-memory store ([`MokaStore::new`]): for one process.
    /// Several consumer processes, or a consumer that must survive its restart, need a
    /// store they share ([`with_store`](Self::with_store) with `RedisStore` or
    /// `PostgresStore`). Say where keys are with [`key`](Self::key).
    pub fn new() -> Self {
        Self::with_store(MokaStore::new())
    }
}

impl<R> Default for MessageIdempotencyLayer<R> {
    fn default() -> Self {
        Self::new()
    }
}

impl<R, St: IdempotencyStore> MessageIdempotencyLayer<R, St> {
    /// A layer over `store` with the defaults: no key until [`key`](Self::key) says
    /// where it is, keys optional, TTL 24 h, lease 10 s (renewed while the handler
    /// runs), outcomes up to 1 MiB, duplicates of a message in flight handed back as
    /// [`Handled::InFlight`](super::Handled::InFlight), fail closed.
    pub fn with_store(store: St) -> Self {
        Self::with_shared_store(Arc::new(store))
    }

    /// A layer over a store already behind an `Arc` (one store for HTTP routes and
    /// consumers alike: their scopes never meet).
    pub fn with_shared_store(store: Arc<St>) -> Self {
        Self {
            extract: Arc::new(NoMessageKey),
            engine: crate::layer::engine_over(store),
            settings: Arc::new(MessageSettings {
                require_key: false,
                max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
                store_if: None,
            }),
            outcome: PhantomData,
        }
    }
}

impl<R, St, K> MessageIdempotencyLayer<R, St, K> {
    /// Where a message's key (and what scopes and fingerprints it) comes from: an
    /// [`ExtractMessageKey`](super::ExtractMessageKey), or a closure
    /// `Fn(&M) -> Result<Option<MessageKey>, KeyRejection>`.
    pub fn key<K2>(self, extract: K2) -> MessageIdempotencyLayer<R, St, K2> {
        MessageIdempotencyLayer {
            extract: Arc::new(extract),
            engine: self.engine,
            settings: self.settings,
            outcome: PhantomData,
        }
    }

    fn settings(&mut self) -> &mut MessageSettings<R> {
        Arc::make_mut(&mut self.settings)
    }

    /// Refuse a message without a key (`idempotency.key_missing`, not to be requeued).
    /// Default: run it without deduplication.
    pub fn require_key(mut self, require: bool) -> Self {
        self.settings().require_key = require;
        self
    }

    /// A handle to wait, when the service stops, for what this layer (and its clones)
    /// still owes the store: handlers that run on for clients that hung up, outcomes
    /// kept until the store takes them, releases not yet answered. See [`Drain`].
    pub fn drain(&self) -> Drain {
        self.engine.drain()
    }

    /// The largest outcome (the handler's response) kept, as JSON; a larger one is
    /// returned to this delivery and recorded as run without it, so its duplicates are
    /// refused (`idempotency.not_replayable`), never run again. Default
    /// [`DEFAULT_MAX_RESPONSE_BYTES`] (1 MiB), as the HTTP layer's.
    pub fn max_response_bytes(mut self, max: usize) -> Self {
        self.settings().max_response_bytes = max;
        self
    }

    /// Which outcomes are stored; for the others the key is released, so a redelivery
    /// runs again (an outcome that says "try later", say). Default: every `Ok`
    /// outcome; a handler's `Err` is never stored.
    pub fn store_if(mut self, predicate: impl Fn(&R) -> bool + Send + Sync + 'static) -> Self {
        self.settings().store_if = Some(Arc::new(predicate));
        self
    }
}

impl<R, St: IdempotencyStore, K> MessageIdempotencyLayer<R, St, K> {
    /// Sets the settings every idempotency layer shares: see [`Policy`]. For
    /// messages, the ttl is at least the longest redelivery window; a duplicate of a
    /// message in flight is handed back as [`Handled::InFlight`](super::Handled::InFlight)
    /// (to requeue) under [`InFlight::Reject`](tower_ids_core::InFlight::Reject);
    /// a store failure that fails closed refuses the message as retryable
    /// (`idempotency.store_unavailable`). Every storage rule stores every outcome
    /// here (a handler's `Err` is never stored); choose with
    /// [`store_if`](Self::store_if).
    ///
    /// # Errors
    ///
    /// [`PolicyError`] if the policy's lease is too short for the store (see
    /// [`Policy::lease`]): its text names the shortest lease that would do.
    pub fn policy(mut self, policy: Policy) -> Result<Self, PolicyError> {
        self.engine.set_policy(policy)?;
        Ok(self)
    }

    /// Also counts as a passing fault a handler's error of type `E` that `hook` says is
    /// one, beside the database faults the layer recognises by itself
    /// ([`store::is_transient`](https://docs.rs/tower-ids/latest/tower_ids/idempotency/store/fn.is_transient.html) on an
    /// `sqlx::Error` or a `BoxError`, feature `postgres`: a connection lost or
    /// terminated, the server restarting, a serialization failure or deadlock, the
    /// pool timing out).
    ///
    /// A handler that fails so is refused retryable (`idempotency.handler_unavailable`,
    /// WARN `idempotency.transient_failure`): the drivers hand it over again after
    /// their pause without counting an attempt, so a database that flaps for a minute
    /// dead-letters nothing. Nothing of it is kept. Any other error is the handler's
    /// failure, counted toward the dead-letter queue. Hooks add up; each sees only
    /// errors of its type.
    pub fn transient_if<E: std::fmt::Display + 'static>(
        mut self,
        hook: impl Fn(&E) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.engine.transient_if(hook);
        self
    }
}

impl<R, St, K> Clone for MessageIdempotencyLayer<R, St, K> {
    fn clone(&self) -> Self {
        Self {
            extract: self.extract.clone(),
            engine: self.engine.clone(),
            settings: self.settings.clone(),
            outcome: PhantomData,
        }
    }
}

impl<R, St, K> fmt::Debug for MessageIdempotencyLayer<R, St, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MessageIdempotencyLayer")
            .field("require_key", &self.settings.require_key)
            .field("policy", self.engine.policy())
            .finish_non_exhaustive()
    }
}

impl<S, R, St: IdempotencyStore, K> Layer<S> for MessageIdempotencyLayer<R, St, K> {
    type Service = MessageIdempotency<S, R, St, K>;

    fn layer(&self, inner: S) -> Self::Service {
        MessageIdempotency {
            inner,
            extract: self.extract.clone(),
            engine: self.engine.clone(),
            settings: self.settings.clone(),
        }
    }
}

/// The engine a message layer runs over `store`: with feature `postgres`, it also counts
/// the database's passing faults in a handler's error as passing (whatever the store: a
/// handler may write with sqlx beside any store).
pub(crate) fn engine_over<St: IdempotencyStore>(store: Arc<St>) -> Engine<St> {
    #[allow(unused_mut)]
    let mut engine = Engine::new(store);
    #[cfg(feature = "postgres")]
    engine.recognise_transient(tower_ids_postgres::passing_fault);
    engine
}
