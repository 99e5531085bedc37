use std::{fmt, sync::Arc, time::Duration};

use http::HeaderName;
use tonic::Code;
use tower_layer::Layer;

use super::GrpcIdempotency;
use crate::idempotency::{
    core::{observe::LayerOrder, Drain, Engine, InFlight, StoreFailure},
    http::{per_attempt_headers, Budget, NoClient},
    store::{IdempotencyStore, MokaStore},
    DEFAULT_MAX_BUFFERED_BYTES, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_RESPONSE_BYTES,
};
#[cfg(doc)]
use crate::idempotency::{DEFAULT_LEASE, DEFAULT_RETRY_AFTER, DEFAULT_TTL};

/// Which statuses are stored and replayed, by default: `OK` and the server errors
/// (`UNKNOWN`, `DEADLINE_EXCEEDED`, `UNIMPLEMENTED`, `INTERNAL`, `DATA_LOSS`), as the
/// HTTP layer's [`default_store_if`](crate::idempotency::default_store_if) stores 2xx
/// and 5xx. An error the handler answered after its side effect (`INTERNAL`, say) is
/// stored, so its retry gets the same error and does not run the call again. The
/// handler's refusals (`INVALID_ARGUMENT`, `NOT_FOUND`, `ALREADY_EXISTS`,
/// `PERMISSION_DENIED`, `FAILED_PRECONDITION`, `OUT_OF_RANGE`, `UNAUTHENTICATED`,
/// `CANCELLED`), as the HTTP layer's 4xx, and the codes gRPC defines as "nothing was
/// done, retry" (`UNAVAILABLE`, `RESOURCE_EXHAUSTED`, `ABORTED`) release the key, so
/// a corrected call under the same key runs.
pub fn default_store_code(code: Code) -> bool {
    matches!(
        code,
        Code::Ok
            | Code::Unknown
            | Code::DeadlineExceeded
            | Code::Unimplemented
            | Code::Internal
            | Code::DataLoss
    )
}

type StorePredicate = Arc<dyn Fn(Code) -> bool + Send + Sync>;

#[derive(Clone)]
pub(super) struct Settings {
    pub(super) require_key: bool,
    pub(super) require_client: bool,
    pub(super) max_request_bytes: usize,
    pub(super) max_response_bytes: usize,
    pub(super) budget: Arc<Budget>,
    pub(super) per_attempt: Vec<HeaderName>,
    pub(super) store_if: StorePredicate,
    /// Warns once, for this layer and its clones, of a call without a correlation ID.
    pub(super) layer_order: Arc<LayerOrder>,
}

/// Runs each unary gRPC call once per `idempotency-key` and replays its response to
/// every retry: a layer for `tonic::transport::Server::builder().layer(..)`. See the
/// [module docs](super).
pub struct GrpcIdempotencyLayer<St = MokaStore, C = NoClient> {
    pub(super) engine: Engine<St>,
    pub(super) identify: C,
    pub(super) settings: Arc<Settings>,
}

impl GrpcIdempotencyLayer {
    /// The layer over a [`MokaStore`] of its own, with the defaults.
    pub fn new() -> Self {
        Self::with_store(MokaStore::new())
    }
}

impl Default for GrpcIdempotencyLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl<St: IdempotencyStore> GrpcIdempotencyLayer<St> {
    /// The layer over `store`.
    pub fn with_store(store: St) -> Self {
        Self::with_shared_store(Arc::new(store))
    }

    /// The layer over a store shared with other layers (an HTTP layer's, say: the
    /// scopes never meet, as gRPC calls are scoped apart from HTTP methods).
    pub fn with_shared_store(store: Arc<St>) -> Self {
        Self {
            engine: Engine::new(store),
            identify: NoClient,
            settings: Arc::new(Settings {
                require_key: false,
                require_client: false,
                max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
                max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
                budget: Budget::new(DEFAULT_MAX_BUFFERED_BYTES),
                per_attempt: per_attempt_headers(),
                store_if: Arc::new(default_store_code),
                layer_order: Arc::default(),
            }),
        }
    }
}

impl<St, C> GrpcIdempotencyLayer<St, C> {
    fn settings(&mut self) -> &mut Settings {
        Arc::make_mut(&mut self.settings)
    }

    /// Scope keys by the client `identify` names, from the call's metadata or an auth
    /// layer's extension: the HTTP layer's [`IdentifyClient`](crate::idempotency::extract::IdentifyClient)
    /// extractors and closures work as they are. Default: none, keys are global.
    pub fn client<C2>(self, identify: C2) -> GrpcIdempotencyLayer<St, C2> {
        GrpcIdempotencyLayer {
            engine: self.engine,
            identify,
            settings: self.settings,
        }
    }

    /// Refuse a call without `idempotency-key` metadata (`INVALID_ARGUMENT
    /// idempotency.key_missing`). Default `false`: such a call passes through, not
    /// deduplicated.
    pub fn require_key(mut self, require: bool) -> Self {
        self.settings().require_key = require;
        self
    }

    /// Refuse a keyed call whose client is not identified (`UNAUTHENTICATED
    /// idempotency.client_missing`). Default `false`.
    pub fn require_client(mut self, require: bool) -> Self {
        self.settings().require_client = require;
        self
    }

    /// How long an outcome is replayed. Default [`DEFAULT_TTL`].
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

    /// The largest request read (its messages, framed). Default
    /// [`DEFAULT_MAX_REQUEST_BYTES`]; larger is `RESOURCE_EXHAUSTED`, and nothing runs.
    pub fn max_request_bytes(mut self, max: usize) -> Self {
        self.settings().max_request_bytes = max;
        self
    }

    /// The request bytes all calls in flight through this layer and its clones may
    /// hold at once. Default [`DEFAULT_MAX_BUFFERED_BYTES`]; a call the budget cannot
    /// take now is `UNAVAILABLE idempotency.overloaded`, and nothing runs.
    pub fn max_buffered_bytes(mut self, max: usize) -> Self {
        self.settings().budget = Budget::new(max);
        self
    }

    /// The largest response kept. Default [`DEFAULT_MAX_RESPONSE_BYTES`]; a larger
    /// one is streamed on and not kept, and its retries are `FAILED_PRECONDITION
    /// idempotency.not_replayable` (never run again).
    pub fn max_response_bytes(mut self, max: usize) -> Self {
        self.settings().max_response_bytes = max;
        self
    }

    /// What a duplicate does while the first runs. Default [`InFlight::Reject`] with
    /// [`DEFAULT_RETRY_AFTER`]: `ABORTED` with that delay in `RetryInfo`.
    pub fn in_flight(mut self, in_flight: InFlight) -> Self {
        self.engine.policy.in_flight = in_flight;
        self
    }

    /// What to do when the store fails. Default [`StoreFailure::FailClosed`]:
    /// `UNAVAILABLE`, and nothing runs.
    pub fn on_store_failure(mut self, failure: StoreFailure) -> Self {
        self.engine.policy.store_failure = failure;
        self
    }

    /// Which statuses are stored; the others release the key, so a retry runs again.
    /// Default [`default_store_code`].
    pub fn store_if(mut self, predicate: impl Fn(Code) -> bool + Send + Sync + 'static) -> Self {
        self.settings().store_if = Arc::new(predicate);
        self
    }
}

impl<St: IdempotencyStore, C> GrpcIdempotencyLayer<St, C> {
    /// The longest store outage a running call's claim outlives. Default
    /// [`DEFAULT_LEASE`]; as the HTTP layer's
    /// [`lease`](crate::idempotency::IdempotencyLayer::lease).
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

impl<St, C: Clone> Clone for GrpcIdempotencyLayer<St, C> {
    fn clone(&self) -> Self {
        Self {
            engine: self.engine.clone(),
            identify: self.identify.clone(),
            settings: self.settings.clone(),
        }
    }
}

impl<St, C> fmt::Debug for GrpcIdempotencyLayer<St, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GrpcIdempotencyLayer")
            .field("require_key", &self.settings.require_key)
            .field("require_client", &self.settings.require_client)
            .field("ttl", &self.engine.policy.ttl)
            .finish_non_exhaustive()
    }
}

impl<S, St: IdempotencyStore, C: Clone> Layer<S> for GrpcIdempotencyLayer<St, C> {
    type Service = GrpcIdempotency<S, St, C>;

    fn layer(&self, inner: S) -> Self::Service {
        GrpcIdempotency {
            inner,
            engine: self.engine.clone(),
            identify: self.identify.clone(),
            settings: self.settings.clone(),
        }
    }
}
