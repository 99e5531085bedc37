//! The HTTP layer's settings: which requests it covers, where their key, client and
//! epoch come from, its byte limits, its replay hooks, and the policy every idempotency
//! layer shares.

use std::{fmt, sync::Arc};

use http::{header, HeaderName, Method, StatusCode};
use tower_layer::Layer;

use super::{
    extract::{ExtractKey, KeyFromHeader},
    replay::OnReplay,
    Idempotency, NoEpoch,
};
use crate::idempotency::{
    client::NoClient,
    collect::Budget,
    core::{observe::LayerOrder, Drain, Engine, Policy, PolicyError, StorageRule},
    response::per_attempt_headers,
    store::{IdempotencyStore, MokaStore},
};

/// The largest request body read to fingerprint: 1 MiB; larger is `413`.
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 1024 * 1024;

/// The request bytes all requests in flight through one layer (and its clones) may
/// hold at once while their bodies are read and their work runs: 64 MiB.
///
/// That is 64 bodies at the 1 MiB request limit ([`DEFAULT_MAX_REQUEST_BYTES`]), or
/// about 65,000 of 1 KiB, more than one process usually has in flight; and it is the
/// default byte bound of the [`MokaStore`] too, so by default the layer's buffers and
/// its store together stay within 128 MiB (plus the responses being read, see the
/// [module docs](crate::idempotency#memory)). Without a budget, 3,000 requests in
/// flight with 1 MiB bodies held 2.6 GiB.
pub const DEFAULT_MAX_BUFFERED_BYTES: usize = 64 * 1024 * 1024;

/// The largest response kept for replay: 1 MiB; larger is streamed on, never stored.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 1024 * 1024;

pub(super) type StorePredicate = Arc<dyn Fn(StatusCode) -> bool + Send + Sync>;

#[derive(Clone)]
pub(super) struct Settings {
    pub(super) key: Arc<dyn ExtractKey>,
    pub(super) on_replay: Option<Arc<dyn OnReplay>>,
    pub(super) expiry_header: bool,
    pub(super) methods: Vec<Method>,
    pub(super) require_key: bool,
    pub(super) require_client: bool,
    pub(super) include_query: bool,
    pub(super) max_request_bytes: usize,
    pub(super) max_response_bytes: usize,
    pub(super) budget: Arc<Budget>,
    pub(super) not_replayed: Vec<HeaderName>,
    pub(super) per_attempt: Vec<HeaderName>,
    /// Overrides the policy's [`StorageRule`] when set.
    pub(super) store_if: Option<StorePredicate>,
    /// Warns once, for this layer and its clones, of a request without a correlation ID.
    pub(super) layer_order: Arc<LayerOrder>,
    /// The base of problem types, when not [`IDEMPOTENCY_PROBLEM_DOCS`](crate::IDEMPOTENCY_PROBLEM_DOCS).
    pub(super) problem_docs: Option<Arc<str>>,
}

/// Whether `rule` stores an answer with `status` (see [`StorageRule`]).
pub(super) fn stores(rule: StorageRule, status: StatusCode) -> bool {
    match rule {
        StorageRule::SuccessesOnly => !(status.is_client_error() || status.is_server_error()),
        StorageRule::AllButRetryable => !matches!(
            status,
            StatusCode::REQUEST_TIMEOUT
                | StatusCode::TOO_MANY_REQUESTS
                | StatusCode::SERVICE_UNAVAILABLE
        ),
        // `StorageRule::Default` and any rule added later.
        _ => !status.is_client_error() && status != StatusCode::SERVICE_UNAVAILABLE,
    }
}

/// Applies [`Idempotency`] to a service: one execution per key, full-response replay.
///
/// See the [module docs](crate::idempotency) for the contract, the headers and the
/// status codes. Configure one layer per route (`MethodRouter::layer` in axum).
///
/// # Clone
///
/// Clones share the store, the settings, the outcomes kept for the store and the byte
/// budget of request bodies ([`max_buffered_bytes`](Self::max_buffered_bytes)), all
/// behind `Arc`s: one layer cloned onto several routes has one budget for all of them.
#[must_use]
pub struct IdempotencyLayer<St = MokaStore, C = NoClient, E = NoEpoch> {
    pub(super) engine: Engine<St>,
    pub(super) identify: C,
    pub(super) epoch: E,
    pub(super) settings: Arc<Settings>,
}

impl IdempotencyLayer {
    /// A layer with its own in-memory store ([`MokaStore::new`]) and the defaults.
    pub fn new() -> Self {
        Self::with_store(MokaStore::new())
    }
}

impl Default for IdempotencyLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl<St: IdempotencyStore> IdempotencyLayer<St> {
    /// A layer over `store`, with the defaults: keys from `Idempotency-Key` (and
    /// `X-Idempotency-Key`) on `POST` and `PATCH`, optional, global (no client), TTL
    /// 24 h, lease 10 s (renewed while the handler runs; longer if the store needs it,
    /// see [`lease`](Policy::lease)), 1 MiB bodies, `409` for requests in flight, fail
    /// closed.
    ///
    /// Share one store between layers (per route) by passing clones of one store, or
    /// an `Arc` of it to [`with_shared_store`](Self::with_shared_store).
    pub fn with_store(store: St) -> Self {
        Self::with_shared_store(Arc::new(store))
    }

    /// A layer over a store already behind an `Arc`.
    pub fn with_shared_store(store: Arc<St>) -> Self {
        Self {
            engine: Engine::new(store),
            identify: NoClient,
            epoch: NoEpoch,
            settings: Arc::new(Settings {
                key: Arc::new(KeyFromHeader::default()),
                on_replay: None,
                expiry_header: false,
                methods: vec![Method::POST, Method::PATCH],
                require_key: false,
                require_client: false,
                include_query: false,
                max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
                max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
                budget: Budget::new(DEFAULT_MAX_BUFFERED_BYTES),
                not_replayed: vec![header::SET_COOKIE],
                per_attempt: per_attempt_headers(),
                store_if: None,
                layer_order: Arc::default(),
                problem_docs: None,
            }),
        }
    }
}

impl<St, C, E> IdempotencyLayer<St, C, E> {
    fn settings(&mut self) -> &mut Settings {
        Arc::make_mut(&mut self.settings)
    }

    /// Scope keys by the client `identify` names (an API key header, the
    /// `Authorization` credentials, an auth layer's extension). Default: none, keys
    /// are global.
    pub fn client<C2>(self, identify: C2) -> IdempotencyLayer<St, C2, E> {
        IdempotencyLayer {
            engine: self.engine,
            identify,
            epoch: self.epoch,
            settings: self.settings,
        }
    }

    /// Bind keys to the control epoch `epoch` reads ([`EpochFromExtension`] for the
    /// server's current epoch, [`EpochFromHeader`] for one the client declares): a key
    /// first seen in one epoch is refused in another with `422
    /// idempotency.epoch_mismatch`. 422, not 409: no retry of that request can succeed,
    /// the client must derive a new key in the current epoch. Default: no binding.
    ///
    /// [`EpochFromExtension`]: super::EpochFromExtension
    /// [`EpochFromHeader`]: super::EpochFromHeader
    pub fn epoch<E2>(self, epoch: E2) -> IdempotencyLayer<St, C, E2> {
        IdempotencyLayer {
            engine: self.engine,
            identify: self.identify,
            epoch,
            settings: self.settings,
        }
    }

    /// The base URL of problem types: each problem's `type` (and its `Link: <...>;
    /// rel="describedby"` header) is `base` followed by its `code`, so
    /// `"https://api.example.com/problems/"` makes
    /// `https://api.example.com/problems/idempotency.in_flight`; your page then holds
    /// an anchor or a path per code. Default
    /// [`IDEMPOTENCY_PROBLEM_DOCS`](crate::IDEMPOTENCY_PROBLEM_DOCS), this crate's
    /// status table, which has an anchor per code.
    ///
    /// # Panics
    ///
    /// If `base` is not an absolute URL that can be sent in a header.
    pub fn problem_docs(mut self, base: &str) -> Self {
        self.settings().problem_docs = Some(crate::problem::checked_docs_base(base));
        self
    }

    /// Answer `400` to a covered request without a key. Default: let it through
    /// untouched.
    pub fn require_key(mut self, require: bool) -> Self {
        self.settings().require_key = require;
        self
    }

    /// Answer `401 idempotency.client_missing` to a covered request that has an
    /// idempotency key but no client the [`client`](Self::client) identifier can name
    /// (no `x-api-key`, say): it never reaches the handler or the store. Default off:
    /// such a request's key is global to the route, shared with every other caller
    /// without a client (see the [module docs](crate::idempotency)).
    ///
    /// The `401` carries no `WWW-Authenticate`. RFC 9110 wants one, with a challenge
    /// naming the scheme and realm, and only the authentication in front of this layer
    /// knows those; a made-up challenge would mislead clients. Put that authentication
    /// first, so anonymous requests get its `401` and its challenge; this one is the
    /// backstop for a route whose authentication lets anonymous requests through.
    /// With the default identifier, [`NoClient`], every request with a key is refused.
    pub fn require_client(mut self, require: bool) -> Self {
        self.settings().require_client = require;
        self
    }

    /// The methods whose requests are deduplicated. Default `POST` and `PATCH`.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.settings().methods = methods.into_iter().collect();
        self
    }

    /// The headers the key is read from, in order. Default `Idempotency-Key` and
    /// `X-Idempotency-Key`; when several are present, or one is repeated, they must
    /// name the same key (see [`IdempotencyKey::from_headers`](crate::idempotency::IdempotencyKey::from_headers)).
    ///
    /// Shorthand for `.key(KeyFromHeader::new(names))`.
    pub fn key_headers(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        self.settings().key = Arc::new(KeyFromHeader::new(names));
        self
    }

    /// Where the key comes from: the headers ([`KeyFromHeader`], the default), a field
    /// of the JSON body ([`KeyFromJson`](super::KeyFromJson), which can name the client
    /// too), or a closure over the request's parts and body. Scope, fingerprint and
    /// every guarantee stay the same; see [`ExtractKey`] for the answers.
    pub fn key(mut self, extract: impl ExtractKey) -> Self {
        self.settings().key = Arc::new(extract);
        self
    }

    /// Adjusts what duplicates of this route get (status, headers, body) from a copy
    /// of the stored response; the record itself never changes. See [`OnReplay`], and
    /// [`JsonReplayMarker`](super::JsonReplayMarker) for `200` with `"replay": true`.
    /// Default: the stored response as it is.
    pub fn on_replay(mut self, hook: impl OnReplay) -> Self {
        self.settings().on_replay = Some(Arc::new(hook));
        self
    }

    /// Say on every stored answer, first and replayed, when it expires: the header
    /// `idempotency-expires` ([`IDEMPOTENCY_EXPIRES`](crate::idempotency::header::IDEMPOTENCY_EXPIRES)),
    /// an HTTP-date, the TTL from when the layer completed the request; after it the key
    /// runs again. An outcome the store could only take later (it was down) expires
    /// that much later than it says: never earlier. Not on answers that were not
    /// stored (a handler's 4xx, an outcome still waiting for the store), nor on
    /// refusals, nor over a header the handler set. Default off. (No standard names
    /// this header yet.)
    pub fn expiry_header(mut self, advertise: bool) -> Self {
        self.settings().expiry_header = advertise;
        self
    }

    /// Make the query string part of the scope: `?a=1` and `?a=2` with one key are
    /// two requests. Default off (the query is always part of the fingerprint, so the
    /// same key with another query is a `422`).
    pub fn scope_query(mut self, include: bool) -> Self {
        self.settings().include_query = include;
        self
    }

    /// A handle to wait, when the service stops, for what this layer (and its clones)
    /// still owes the store: handlers that run on for clients that hung up, outcomes
    /// kept until the store takes them, releases not yet answered. See [`Drain`].
    pub fn drain(&self) -> Drain {
        self.engine.drain()
    }

    /// The largest request body read. Default [`DEFAULT_MAX_REQUEST_BYTES`].
    pub fn max_request_bytes(mut self, max: usize) -> Self {
        self.settings().max_request_bytes = max;
        self
    }

    /// The request bytes all requests in flight through this layer and its clones may
    /// hold at once. Default [`DEFAULT_MAX_BUFFERED_BYTES`] (64 MiB).
    ///
    /// Reading a body takes its bytes from this budget, its declared `Content-Length`
    /// up front when it has one (so a body that cannot fit is refused before a byte of
    /// it is read), chunk by chunk otherwise, and holds them until the request's work
    /// ends (its response returned, or its stored outcome written). A request the
    /// budget cannot take now is answered `503 idempotency.overloaded` with
    /// `Retry-After: 1` and a WARN `idempotency.overloaded`: the handler does not run
    /// and the store is not asked. A body larger than the whole budget could never
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

    /// The largest response kept. Default [`DEFAULT_MAX_RESPONSE_BYTES`].
    pub fn max_response_bytes(mut self, max: usize) -> Self {
        self.settings().max_response_bytes = max;
        self
    }

    /// Keep `name` out of replays (it is still stored). Default: `Set-Cookie` only.
    pub fn not_replayed(mut self, name: HeaderName) -> Self {
        self.settings().not_replayed.push(name);
        self
    }

    /// Replay `Set-Cookie` too (off by default: a replay should not hand one client's
    /// fresh session cookie to another attempt).
    pub fn replay_set_cookie(mut self, replay: bool) -> Self {
        let settings = self.settings();
        settings
            .not_replayed
            .retain(|name| name != header::SET_COOKIE);
        if !replay {
            settings.not_replayed.push(header::SET_COOKIE);
        }
        self
    }

    /// Which responses are stored, when the policy's [`StorageRule`] is not the rule
    /// this route needs: `predicate` is given each status and overrides the rule. A
    /// refusal the layer makes itself (a bad key or client, a body over the limit) is
    /// never stored: nothing ran.
    pub fn store_if(
        mut self,
        predicate: impl Fn(StatusCode) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.settings().store_if = Some(Arc::new(predicate));
        self
    }
}

impl<St: IdempotencyStore, C, E> IdempotencyLayer<St, C, E> {
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
}

impl<St, C: Clone, E: Clone> Clone for IdempotencyLayer<St, C, E> {
    fn clone(&self) -> Self {
        Self {
            engine: self.engine.clone(),
            identify: self.identify.clone(),
            epoch: self.epoch.clone(),
            settings: self.settings.clone(),
        }
    }
}

impl<St, C, E> fmt::Debug for IdempotencyLayer<St, C, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("methods", &self.settings.methods)
            .field("require_key", &self.settings.require_key)
            .field("require_client", &self.settings.require_client)
            .field("policy", self.engine.policy())
            .field("max_buffered_bytes", &self.settings.budget.capacity())
            .finish_non_exhaustive()
    }
}

impl<S, St: IdempotencyStore, C: Clone, E: Clone> Layer<S> for IdempotencyLayer<St, C, E> {
    type Service = Idempotency<S, St, C, E>;

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
