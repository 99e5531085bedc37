use std::{fmt, marker::PhantomData, sync::Arc, time::Duration};

use tower_layer::Layer;

use super::{MessageIdempotency, NoMessageKey};
use crate::idempotency::{
    core::{Drain, Engine},
    store::{IdempotencyStore, MokaStore},
    InFlight, StoreFailure, DEFAULT_MAX_RESPONSE_BYTES,
};
#[cfg(doc)]
use crate::idempotency::{DEFAULT_LEASE, DEFAULT_MAX_KEPT_BYTES, DEFAULT_TTL};

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
/// [module docs](crate::idempotency::message).
///
/// # Clone
///
/// Clones share the store, the extractor, the settings and the outcomes kept for the
/// store (behind `Arc`s): one layer cloned onto several consumers of one queue is one
/// deduplication.
#[must_use]
pub struct MessageIdempotencyLayer<R, K = NoMessageKey, St = MokaStore> {
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

impl<R, St: IdempotencyStore> MessageIdempotencyLayer<R, NoMessageKey, St> {
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
            engine: Engine::new(store),
            settings: Arc::new(MessageSettings {
                require_key: false,
                max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
                store_if: None,
            }),
            outcome: PhantomData,
        }
    }
}

impl<R, K, St> MessageIdempotencyLayer<R, K, St> {
    /// Where a message's key (and what scopes and fingerprints it) comes from: an
    /// [`ExtractMessageKey`](super::ExtractMessageKey), or a closure
    /// `Fn(&M) -> Result<Option<MessageKey>, KeyRejection>`.
    pub fn key<K2>(self, extract: K2) -> MessageIdempotencyLayer<R, K2, St> {
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

    /// How long an outcome is kept for duplicates: at least the longest redelivery or
    /// retry window. Default [`DEFAULT_TTL`] (24 h).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.engine.policy.ttl = ttl;
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

    /// The most outcome bytes kept for outcomes the store could not take when their
    /// handler ended (stored from a task of their own meanwhile). Default
    /// [`DEFAULT_MAX_KEPT_BYTES`] (64 MiB).
    pub fn max_kept_bytes(mut self, max: usize) -> Self {
        self.engine.policy.max_kept_bytes = max;
        self
    }

    /// What a duplicate of a message still being handled gets:
    /// [`InFlight::Reject`] (the default) hands back
    /// [`Handled::InFlight`](super::Handled::InFlight) at once, for the consumer to
    /// requeue it; [`InFlight::Wait`] waits up to its timeout for the outcome.
    pub fn in_flight(mut self, in_flight: InFlight) -> Self {
        self.engine.policy.in_flight = in_flight;
        self
    }

    /// What to do when the store fails. Default [`StoreFailure::FailClosed`]: the
    /// message is refused as retryable (`idempotency.store_unavailable`) and nothing
    /// runs.
    pub fn on_store_failure(mut self, failure: StoreFailure) -> Self {
        self.engine.policy.store_failure = failure;
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

impl<R, K, St: IdempotencyStore> MessageIdempotencyLayer<R, K, St> {
    /// The longest store outage the claim of a message in flight outlives; the claim
    /// holds the key for the lease and half again, renewed every quarter of it while
    /// the handler runs, so a lost consumer locks its key for at most one and a half
    /// leases. Default
    /// [`DEFAULT_LEASE`] (10 s). A redelivery of the message of a consumer that was
    /// killed mid-handler waits out the rest of it ([`Handled::InFlight`](super::Handled::InFlight)).
    ///
    /// # Panics
    ///
    /// If the lease is too short for the store, as the HTTP
    /// layer's [`lease`](crate::idempotency::IdempotencyLayer::lease) says.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.engine.set_lease(lease);
        self
    }
}

impl<R, K, St> Clone for MessageIdempotencyLayer<R, K, St> {
    fn clone(&self) -> Self {
        Self {
            extract: self.extract.clone(),
            engine: self.engine.clone(),
            settings: self.settings.clone(),
            outcome: PhantomData,
        }
    }
}

impl<R, K, St> fmt::Debug for MessageIdempotencyLayer<R, K, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MessageIdempotencyLayer")
            .field("require_key", &self.settings.require_key)
            .field("ttl", &self.engine.policy.ttl)
            .field("lease", &self.engine.policy.lease)
            .field("in_flight", &self.engine.policy.in_flight)
            .field("store_failure", &self.engine.policy.store_failure)
            .finish_non_exhaustive()
    }
}

impl<S, R, K, St: IdempotencyStore> Layer<S> for MessageIdempotencyLayer<R, K, St> {
    type Service = MessageIdempotency<S, K, R, St>;

    fn layer(&self, inner: S) -> Self::Service {
        MessageIdempotency {
            inner,
            extract: self.extract.clone(),
            engine: self.engine.clone(),
            settings: self.settings.clone(),
        }
    }
}
