//! The HTTP transport's constructors and setters on the layer: which requests it
//! covers, where their key, client and epoch come from, its replay hooks and the
//! storage rule over statuses.

use std::sync::Arc;

use http::{header, HeaderName, Method, StatusCode};

use super::IdempotencyLayer;
use crate::idempotency::{
    extract::{key::KeyFromHeader, ExtractKey},
    http::{Http, OnReplay},
    store::{IdempotencyStore, MokaStore},
};

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
        Self::over(store, Http::default())
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
    /// [`EpochFromExtension`]: crate::idempotency::EpochFromExtension
    /// [`EpochFromHeader`]: crate::idempotency::EpochFromHeader
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
    /// of the JSON body ([`KeyFromJson`](crate::idempotency::KeyFromJson), which can name the client
    /// too), or a closure over the request's parts and body. Scope, fingerprint and
    /// every guarantee stay the same; see [`ExtractKey`] for the answers.
    pub fn key(mut self, extract: impl ExtractKey) -> Self {
        self.http().key = Arc::new(extract);
        self
    }

    /// Adjusts what duplicates of this route get (status, headers, body) from a copy
    /// of the stored response; the record itself never changes. See [`OnReplay`], and
    /// [`JsonReplayMarker`](crate::idempotency::JsonReplayMarker) for `200` with `"replay": true`.
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
