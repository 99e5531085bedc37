//! The settings every transport's layer has: the client, whether a key and a client
//! are required, the byte limits, the drain and the policy.

use std::{fmt, sync::Arc};

use tower_layer::Layer;

use super::Idempotency;
use crate::idempotency::{
    collect::Budget,
    core::{Drain, Engine, Policy, PolicyError},
    extract::{NoClient, NoEpoch},
    http::Http,
    store::{IdempotencyStore, MokaStore},
    transport::Settings,
};

/// Applies [`Idempotency`] to a service: one execution per key, full-response replay.
///
/// See the [module docs](crate::idempotency) for the contract, the headers and the
/// status codes. Configure one layer per route (`MethodRouter::layer` in axum). The
/// last type parameter is the transport: [`Http`] (the default), or
/// [`Grpc`](crate::idempotency::grpc::Grpc) for unary tonic calls
/// ([`for_grpc`](Self::for_grpc)); the settings below are every transport's, and
/// each has its own beside them.
///
/// # Clone
///
/// Clones share the store, the settings, the outcomes kept for the store and the byte
/// budget of request bodies ([`max_buffered_bytes`](Self::max_buffered_bytes)), all
/// behind `Arc`s: one layer cloned onto several routes has one budget for all of them.
#[must_use]
pub struct IdempotencyLayer<St = MokaStore, C = NoClient, E = NoEpoch, T = Http> {
    pub(crate) engine: Engine<St>,
    pub(crate) identify: C,
    pub(crate) epoch: E,
    pub(crate) settings: Arc<Settings<T>>,
}

impl<St: IdempotencyStore, T> IdempotencyLayer<St, NoClient, NoEpoch, T> {
    /// A layer over `store`, with every transport's defaults and `transport`'s.
    pub(crate) fn over(store: Arc<St>, transport: T) -> Self {
        Self {
            engine: crate::idempotency::store::engine_over(store),
            identify: NoClient,
            epoch: NoEpoch,
            settings: Arc::new(Settings::new(transport)),
        }
    }
}

impl<St, C, E, T: Clone> IdempotencyLayer<St, C, E, T> {
    pub(crate) fn settings(&mut self) -> &mut Settings<T> {
        Arc::make_mut(&mut self.settings)
    }

    /// Scope keys by the client `identify` names (an API key header, the
    /// `Authorization` credentials, an auth layer's extension; a gRPC call's metadata
    /// is its headers). Default: none, keys are global.
    pub fn client<C2>(self, identify: C2) -> IdempotencyLayer<St, C2, E, T> {
        IdempotencyLayer {
            engine: self.engine,
            identify,
            epoch: self.epoch,
            settings: self.settings,
        }
    }

    /// Refuse a covered call without a key (`400 idempotency.key_missing`, gRPC
    /// `INVALID_ARGUMENT`). Default: let it through untouched.
    pub fn require_key(mut self, require: bool) -> Self {
        self.settings().require_key = require;
        self
    }

    /// Refuse a covered call that has an idempotency key but no client the
    /// [`client`](Self::client) identifier can name (no `x-api-key`, say) with `401
    /// idempotency.client_missing` (gRPC `UNAUTHENTICATED`): it never reaches the
    /// handler or the store. Default off: such a call's key is global to the route,
    /// shared with every other caller without a client (see the
    /// [module docs](crate::idempotency)).
    ///
    /// The `401` carries no `WWW-Authenticate`. RFC 9110 wants one, with a challenge
    /// naming the scheme and realm, and only the authentication in front of this layer
    /// knows those; a made-up challenge would mislead clients. Put that authentication
    /// first, so anonymous requests get its `401` and its challenge; this one is the
    /// backstop for a route whose authentication lets anonymous requests through.
    /// With the default identifier, [`NoClient`], every call with a key is refused.
    pub fn require_client(mut self, require: bool) -> Self {
        self.settings().require_client = require;
        self
    }

    /// A handle to wait, when the service stops, for what this layer (and its clones)
    /// still owes the store: handlers that run on for clients that hung up, outcomes
    /// kept until the store takes them, releases not yet answered. See [`Drain`].
    ///
    /// ```
    /// use std::time::Duration;
    /// use axum::{routing::post, Router};
    /// use tower_ids::{correlation::CorrelationLayer, idempotency::IdempotencyLayer};
    ///
    /// # async fn run() -> std::io::Result<()> {
    /// let idempotency = IdempotencyLayer::new();
    /// let drain = idempotency.drain();
    /// let app = Router::new()
    ///     .route("/orders", post(|| async { "created" }).layer(idempotency))
    ///     .layer(CorrelationLayer::new());
    /// let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    /// axum::serve(listener, app)
    ///     .with_graceful_shutdown(async { /* e.g. tokio::signal::ctrl_c() */ })
    ///     .await?;
    /// // Every connection is done; now what the layer still owes the store.
    /// let drained = drain.wait(Duration::from_secs(10)).await;
    /// assert!(drained.is_complete());
    /// # Ok(())
    /// # }
    /// # tokio::runtime::Runtime::new().unwrap().block_on(run()).unwrap();
    /// ```
    pub fn drain(&self) -> Drain {
        self.engine.drain()
    }

    /// The largest request body read (a gRPC call's messages, framed). Default 1 MiB;
    /// larger is `413` (gRPC `RESOURCE_EXHAUSTED`), and
    /// nothing runs.
    pub fn max_request_bytes(mut self, max: usize) -> Self {
        self.settings().max_request_bytes = max;
        self
    }

    /// The request bytes all calls in flight through this layer and its clones may
    /// hold at once. Default 64 MiB: 64 bodies at the 1 MiB request limit, or about
    /// 65,000 of 1 KiB, more than one process usually has in flight; it is the default
    /// bound of the [`MokaStore`] too, so by default the layer's buffers and its store
    /// together stay within 128 MiB (plus the responses being read, see the
    /// [module docs](crate::idempotency#memory)). Without a budget, 3,000 requests in
    /// flight with 1 MiB bodies held 2.6 GiB.
    ///
    /// Reading a body takes its bytes from this budget, its declared `Content-Length`
    /// up front when it has one (so a body that cannot fit is refused before a byte of
    /// it is read), chunk by chunk otherwise, and holds them until the call's work
    /// ends (its response returned, or its stored outcome written). A call the budget
    /// cannot take now is answered `503 idempotency.overloaded` (gRPC `UNAVAILABLE`)
    /// with `Retry-After: 1` and a WARN `idempotency.overloaded`: the handler does not
    /// run and the store is not asked. A body larger than the whole budget could never
    /// fit, so it is `413`, as one over [`max_request_bytes`](Self::max_request_bytes).
    ///
    /// A client that declares a large body and sends it slowly holds its share for as
    /// long as it takes: put a request body timeout in front (tower-http's
    /// `RequestBodyTimeoutLayer`, say). Calling this makes a new budget for this layer
    /// and the clones made of it afterwards; layers built separately never share one.
    pub fn max_buffered_bytes(mut self, max: usize) -> Self {
        self.settings().budget = Budget::new(max);
        self
    }

    /// The largest response kept. Default 1 MiB; a larger
    /// one is streamed on and not kept, and its retries are `410` (gRPC
    /// `FAILED_PRECONDITION`) `idempotency.not_replayable`, never run again.
    pub fn max_response_bytes(mut self, max: usize) -> Self {
        self.settings().max_response_bytes = max;
        self
    }
}

impl<St: IdempotencyStore, C, E, T> IdempotencyLayer<St, C, E, T> {
    /// Sets the settings every idempotency layer shares: see [`Policy`].
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
    /// ([`store::is_transient`](crate::idempotency::store::is_transient) on an
    /// `sqlx::Error` or a `BoxError`, feature `postgres`).
    ///
    /// A handler that fails so (its service's `Err`, not a response: an axum handler's
    /// errors are responses, and a `503` it answers is never kept anyway) is answered
    /// `503 idempotency.handler_unavailable` (gRPC `UNAVAILABLE`) with `Retry-After`,
    /// WARN `idempotency.transient_failure`; nothing is kept and the key is free, so
    /// the client's retry runs it again. Any other error is passed on as it is. Hooks
    /// add up; each sees only errors of its type.
    pub fn transient_if<Error: std::fmt::Display + 'static>(
        mut self,
        hook: impl Fn(&Error) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.engine.transient_if(hook);
        self
    }
}

impl<St, C: Clone, E: Clone, T> Clone for IdempotencyLayer<St, C, E, T> {
    fn clone(&self) -> Self {
        Self {
            engine: self.engine.clone(),
            identify: self.identify.clone(),
            epoch: self.epoch.clone(),
            settings: self.settings.clone(),
        }
    }
}

impl<St, C, E, T: fmt::Debug> fmt::Debug for IdempotencyLayer<St, C, E, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("require_key", &self.settings.require_key)
            .field("require_client", &self.settings.require_client)
            .field("policy", self.engine.policy())
            .field("max_buffered_bytes", &self.settings.budget.capacity())
            .field("transport", &self.settings.transport)
            .finish_non_exhaustive()
    }
}

impl<S, St: IdempotencyStore, C: Clone, E: Clone, T> Layer<S> for IdempotencyLayer<St, C, E, T> {
    type Service = Idempotency<S, St, C, E, T>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency {
            inner,
            engine: self.engine.clone(),
            identify: self.identify.clone(),
            epoch: self.epoch.clone(),
            settings: self.settings.clone(),
        }
    }
}
