//! The HTTP transport's settings: which requests a layer covers, where their key,
//! client and epoch come from, its replay hooks and the storage rule over statuses.

use std::{fmt, sync::Arc};

use http::{header, HeaderName, Method, StatusCode};

use super::{
    extract::{ExtractKey, KeyFromHeader},
    replay::OnReplay,
};
use crate::idempotency::{
    adapter::IdempotencyLayer,
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

pub use tower_ids_core::DEFAULT_MAX_RESPONSE_BYTES;

type StorePredicate = Arc<dyn Fn(StatusCode) -> bool + Send + Sync>;

/// The HTTP transport of [`IdempotencyLayer`] and [`Idempotency`](crate::idempotency::Idempotency),
/// the default: its settings, set with the layer's HTTP setters (which requests it
/// covers, where their key comes from, what a replay carries).
#[derive(Clone)]
pub struct Http {
    pub(crate) key: Arc<dyn ExtractKey>,
    pub(crate) on_replay: Option<Arc<dyn OnReplay>>,
    pub(crate) expiry_header: bool,
    pub(crate) methods: Vec<Method>,
    pub(crate) include_query: bool,
    pub(crate) not_replayed: Vec<HeaderName>,
    /// Overrides the policy's [`StorageRule`](crate::idempotency::StorageRule) when set.
    pub(crate) store_if: Option<StorePredicate>,
    /// The base of problem types, when not [`IDEMPOTENCY_PROBLEM_DOCS`](crate::IDEMPOTENCY_PROBLEM_DOCS).
    pub(crate) problem_docs: Option<Arc<str>>,
}

impl fmt::Debug for Http {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Http")
            .field("methods", &self.methods)
            .field("include_query", &self.include_query)
            .field("expiry_header", &self.expiry_header)
            .finish_non_exhaustive()
    }
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
    /// see [`lease`](crate::idempotency::Policy::lease)), 1 MiB bodies, `409` for requests in flight, fail
    /// closed.
    ///
    /// Share one store between layers (per route) by passing clones of one store, or
    /// an `Arc` of it to [`with_shared_store`](Self::with_shared_store).
    pub fn with_store(store: St) -> Self {
        Self::with_shared_store(Arc::new(store))
    }

    /// A layer over a store already behind an `Arc`.
    pub fn with_shared_store(store: Arc<St>) -> Self {
        Self::over(
            store,
            Http {
                key: Arc::new(KeyFromHeader::default()),
                on_replay: None,
                expiry_header: false,
                methods: vec![Method::POST, Method::PATCH],
                include_query: false,
                not_replayed: vec![header::SET_COOKIE],
                store_if: None,
                problem_docs: None,
            },
        )
    }
}

/// The HTTP transport's own settings.
impl<St, C, E> IdempotencyLayer<St, C, E, Http> {
    fn http(&mut self) -> &mut Http {
        &mut self.settings().transport
    }

    /// Bind keys to the control epoch `epoch` reads ([`EpochFromExtension`] for the
    /// server's current epoch, [`EpochFromHeader`] for one the client declares): a key
    /// first seen in one epoch is refused in another with `422
    /// idempotency.epoch_mismatch`. 422, not 409: no retry of that request can succeed,
    /// the client must derive a new key in the current epoch. Default: no binding.
    ///
    /// [`EpochFromExtension`]: super::EpochFromExtension
    /// [`EpochFromHeader`]: super::EpochFromHeader
    pub fn epoch<E2>(self, epoch: E2) -> IdempotencyLayer<St, C, E2, Http> {
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
        self.http().problem_docs = Some(crate::problem::checked_docs_base(base));
        self
    }

    /// The methods whose requests are deduplicated. Default `POST` and `PATCH`.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.http().methods = methods.into_iter().collect();
        self
    }

    /// The headers the key is read from, in order. Default `Idempotency-Key` and
    /// `X-Idempotency-Key`; when several are present, or one is repeated, they must
    /// name the same key (see [`IdempotencyKey::from_headers`](crate::idempotency::IdempotencyKey::from_headers)).
    ///
    /// Shorthand for `.key(KeyFromHeader::new(names))`.
    pub fn key_headers(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        self.http().key = Arc::new(KeyFromHeader::new(names));
        self
    }

    /// Where the key comes from: the headers ([`KeyFromHeader`], the default), a field
    /// of the JSON body ([`KeyFromJson`](super::KeyFromJson), which can name the client
    /// too), or a closure over the request's parts and body. Scope, fingerprint and
    /// every guarantee stay the same; see [`ExtractKey`] for the answers.
    pub fn key(mut self, extract: impl ExtractKey) -> Self {
        self.http().key = Arc::new(extract);
        self
    }

    /// Adjusts what duplicates of this route get (status, headers, body) from a copy
    /// of the stored response; the record itself never changes. See [`OnReplay`], and
    /// [`JsonReplayMarker`](super::JsonReplayMarker) for `200` with `"replay": true`.
    /// Default: the stored response as it is.
    pub fn on_replay(mut self, hook: impl OnReplay) -> Self {
        self.http().on_replay = Some(Arc::new(hook));
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
        self.http().expiry_header = advertise;
        self
    }

    /// Make the query string part of the scope: `?a=1` and `?a=2` with one key are
    /// two requests. Default off (the query is always part of the fingerprint, so the
    /// same key with another query is a `422`).
    pub fn scope_query(mut self, include: bool) -> Self {
        self.http().include_query = include;
        self
    }

    /// Keep `name` out of replays (it is still stored). Default: `Set-Cookie` only.
    pub fn not_replayed(mut self, name: HeaderName) -> Self {
        self.http().not_replayed.push(name);
        self
    }

    /// Replay `Set-Cookie` too (off by default: a replay should not hand one client's
    /// fresh session cookie to another attempt).
    pub fn replay_set_cookie(mut self, replay: bool) -> Self {
        let settings = self.http();
        settings
            .not_replayed
            .retain(|name| name != header::SET_COOKIE);
        if !replay {
            settings.not_replayed.push(header::SET_COOKIE);
        }
        self
    }

    /// Which responses are stored, when the policy's [`StorageRule`](crate::idempotency::StorageRule) is not the rule
    /// this route needs: `predicate` is given each status and overrides the rule. A
    /// refusal the layer makes itself (a bad key or client, a body over the limit) is
    /// never stored: nothing ran.
    pub fn store_if(
        mut self,
        predicate: impl Fn(StatusCode) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.http().store_if = Some(Arc::new(predicate));
        self
    }
}
