//! The gRPC layer's settings: what it reads of a call, what it keeps, and the policy
//! every idempotency layer shares.

use std::{fmt, sync::Arc};

use http::HeaderName;
use tonic::Code;
use tower_layer::Layer;

use super::GrpcIdempotency;
use crate::idempotency::{
    client::NoClient,
    collect::Budget,
    core::{observe::LayerOrder, Drain, Engine, Policy, PolicyError, StorageRule},
    response::per_attempt_headers,
    store::{IdempotencyStore, MokaStore},
    DEFAULT_MAX_BUFFERED_BYTES, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_RESPONSE_BYTES,
};

/// Whether `rule` stores a call that ended with `code` (see [`StorageRule`]).
pub(super) fn stores(rule: StorageRule, code: Code) -> bool {
    match rule {
        StorageRule::SuccessesOnly => code == Code::Ok,
        StorageRule::AllButRetryable => !matches!(
            code,
            Code::Unavailable | Code::ResourceExhausted | Code::Aborted
        ),
        // `StorageRule::Default` and any rule added later.
        _ => matches!(
            code,
            Code::Ok
                | Code::Unknown
                | Code::DeadlineExceeded
                | Code::Unimplemented
                | Code::Internal
                | Code::DataLoss
        ),
    }
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
    /// Overrides the policy's [`StorageRule`] when set.
    pub(super) store_if: Option<StorePredicate>,
    /// Warns once, for this layer and its clones, of a call without a correlation ID.
    pub(super) layer_order: Arc<LayerOrder>,
}

/// Runs each unary gRPC call once per `idempotency-key` and replays its response to
/// every retry: a layer for `tonic::transport::Server::builder().layer(..)`. See the
/// [module docs](super).
#[must_use]
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
                store_if: None,
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

    /// Which calls are stored, when the policy's [`StorageRule`] is not the rule this
    /// service needs: `predicate` is given each call's code and overrides the rule.
    pub fn store_if(mut self, predicate: impl Fn(Code) -> bool + Send + Sync + 'static) -> Self {
        self.settings().store_if = Some(Arc::new(predicate));
        self
    }
}

impl<St: IdempotencyStore, C> GrpcIdempotencyLayer<St, C> {
    /// Sets the settings every idempotency layer shares: see [`Policy`]. A duplicate
    /// of a call in flight is `ABORTED` with the in-flight policy's `retry_after` in
    /// `RetryInfo`; a store failure that fails closed is `UNAVAILABLE`.
    ///
    /// # Errors
    ///
    /// [`PolicyError`] if the policy's lease is too short for the store (see
    /// [`Policy::lease`]): its text names the shortest lease that would do.
    pub fn policy(mut self, policy: Policy) -> Result<Self, PolicyError> {
        self.engine.set_policy(policy)?;
        Ok(self)
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
            .field("policy", self.engine.policy())
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
