//! A protected request's path through the HTTP layer: its key, client and epoch read,
//! its body read within the limits, the engine asked, and its decision turned into a
//! response.

use std::{
    future::Future,
    sync::Arc,
    task::{Context, Poll},
};

use bytes::Bytes;
use http::{Request, Response};
use tower_service::Service;

use super::{
    answer::Reply,
    extract::ExtractedKey,
    layer::Settings,
    read::{buffered, fingerprint, read_body, FingerprintHash},
    stored::StoredResponse,
    EpochRejection, ExtractEpoch, NoEpoch,
};
use crate::body::Body;
use crate::idempotency::{
    client::{ClientRejection, IdentifyClient, NoClient},
    collect::{collect_up_to, BoxError, Collected},
    core::{
        observe, ClaimFlag, Claimed, Classified, Classifying, Decision, Detaching, Engine,
        Finished, Release, Unsettled,
    },
    response::{http_date, offer_transaction, unclaimed, ResponseFuture},
    store::{IdempotencyStore, MokaStore},
    AttemptId, ClientId, Code, Fingerprint, IdempotencyKey, KeyRejection, ScopeKey,
    IDEMPOTENCY_EXPIRES,
};

/// The service a protected route wraps, as the layer needs it: it takes the request
/// with its body buffered (or streamed on), and it and its future move across tasks.
pub(super) trait Handler<ReqBody, ResBody>:
    Service<
        Request<Body<ReqBody>>,
        Response = Response<ResBody>,
        Future: Send + 'static,
        Error: Send + 'static,
    > + Send
    + 'static
{
}

impl<S, ReqBody, ResBody> Handler<ReqBody, ResBody> for S where
    S: Service<
            Request<Body<ReqBody>>,
            Response = Response<ResBody>,
            Future: Send + 'static,
            Error: Send + 'static,
        > + Send
        + 'static
{
}

/// A request or response body the layer reads whole (within its limits).
pub(super) trait ReadableBody:
    http_body::Body<Data = Bytes, Error: Into<BoxError>> + Send + Unpin + 'static
{
}

impl<B> ReadableBody for B where
    B: http_body::Body<Data = Bytes, Error: Into<BoxError>> + Send + Unpin + 'static
{
}

/// Middleware that runs each idempotent request once and replays its response.
///
/// Made by [`IdempotencyLayer`](super::IdempotencyLayer); see the
/// [module docs](crate::idempotency).
pub struct Idempotency<S, St = MokaStore, C = NoClient, E = NoEpoch> {
    pub(super) inner: S,
    pub(super) engine: Engine<St>,
    pub(super) identify: C,
    pub(super) epoch: E,
    pub(super) settings: Arc<Settings>,
}

impl<S> Idempotency<S> {
    /// Wraps `inner` with the defaults, over a store of its own ([`MokaStore::new`]).
    pub fn new(inner: S) -> Self {
        use tower_layer::Layer as _;
        super::IdempotencyLayer::new().layer(inner)
    }
}

impl Idempotency<()> {
    /// The layer, to configure and apply with `ServiceBuilder` or axum's
    /// `MethodRouter::layer`: `Idempotency::layer().require_key(true)`.
    pub fn layer() -> super::IdempotencyLayer {
        super::IdempotencyLayer::new()
    }
}

impl<S, St, C, E> Idempotency<S, St, C, E> {
    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone, St, C: Clone, E: Clone> Clone for Idempotency<S, St, C, E> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            engine: self.engine.clone(),
            identify: self.identify.clone(),
            epoch: self.epoch.clone(),
            settings: self.settings.clone(),
        }
    }
}

impl<S: std::fmt::Debug, St, C, E> std::fmt::Debug for Idempotency<S, St, C, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

/// What one protected request is, once its key is read.
struct Protected {
    key: IdempotencyKey,
    client: Option<ClientId>,
    scope: ScopeKey,
    attempt: Option<AttemptId>,
    epoch: Option<u64>,
}

impl Protected {
    fn reply<'a>(&'a self, settings: &'a Settings) -> Reply<'a> {
        Reply::new(settings, Some(&self.key), self.attempt.as_ref())
    }
}

impl<S, St, C, E, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S, St, C, E>
where
    S: Service<Request<Body<ReqBody>>, Response = Response<ResBody>>
        + Handler<ReqBody, ResBody>
        + Clone,
    St: IdempotencyStore,
    C: IdentifyClient<ReqBody>,
    E: ExtractEpoch<ReqBody>,
    ReqBody: ReadableBody,
    ResBody: ReadableBody,
{
    type Response = Response<Body<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // The ready service goes into the future; a fresh clone stays for the next call.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let settings = self.settings.clone();

        if !settings.methods.contains(request.method()) {
            return unclaimed(pass_through(inner, request, None));
        }
        let attempt = match AttemptId::from_headers(request.headers()) {
            Ok(attempt) => attempt,
            Err(error) => {
                let reply = Reply::new(&settings, None, None);
                return unclaimed(ready(reply.reject_key(&error)));
            }
        };
        // Read from the head now (the body type changes once it is read), applied once
        // the key is known: a request without a key never hears of them.
        let identity = Identity {
            epoch: self.epoch.extract_epoch(&request),
            client: self.identify.identify_client(&request),
            attempt,
        };
        let engine = self.engine.clone();
        if settings.key.reads_body() {
            // The key is in the body: read it first (within the limits), then decide.
            return ResponseFuture {
                work: Detaching::claiming(|claimed| {
                    run_keyed_by_body(inner, engine, settings, request, identity, claimed)
                }),
            };
        }
        let (parts, body) = request.into_parts();
        let extracted = settings.key.extract_key(&parts, &Bytes::new());
        let protected = protect(&settings, extracted, identity, &parts);
        let request = Request::from_parts(parts, body);
        match protected {
            Decided::Protected(protected) => ResponseFuture {
                work: Detaching::claiming(|claimed| {
                    run(inner, engine, settings, request, protected, claimed)
                }),
            },
            Decided::PassThrough(attempt) => unclaimed(pass_through(inner, request, attempt)),
            Decided::Refused(refused) => unclaimed(ready(refused)),
        }
    }
}

/// What the head of a covered request says besides its key, read before its body.
struct Identity {
    epoch: Result<Option<u64>, EpochRejection>,
    client: Result<Option<ClientId>, ClientRejection>,
    attempt: Option<AttemptId>,
}

/// What a covered request is, once its key is extracted.
enum Decided<B> {
    Protected(Protected),
    /// No key, and none required: passed through, with its attempt ID echoed.
    PassThrough(Option<AttemptId>),
    /// A `400` or `401`.
    Refused(Response<Body<B>>),
}

/// Decides what a covered request is, once its key is extracted.
fn protect<B>(
    settings: &Settings,
    extracted: Result<Option<ExtractedKey>, KeyRejection>,
    identity: Identity,
    parts: &http::request::Parts,
) -> Decided<B> {
    let Identity {
        epoch,
        client,
        attempt,
    } = identity;
    let keyless = Reply::new(settings, None, attempt.as_ref());
    let (key, named) = match extracted {
        Ok(Some(extracted)) => extracted.into_parts(),
        Ok(None) if settings.require_key => {
            return Decided::Refused(keyless.refuse(
                "missing",
                Code::KeyMissing,
                settings.key.missing_detail().into_owned(),
            ));
        }
        Ok(None) => return Decided::PassThrough(attempt),
        Err(rejection) => {
            return Decided::Refused(keyless.refuse(
                rejection.reason(),
                rejection.code(),
                rejection.to_string(),
            ));
        }
    };
    // From here on every answer names the key.
    let reply = Reply::new(settings, Some(&key), attempt.as_ref());
    let epoch = match epoch {
        Ok(epoch) => epoch,
        Err(error) => {
            return Decided::Refused(reply.refuse(
                "epoch_invalid",
                Code::EpochInvalid,
                error.to_string(),
            ));
        }
    };
    let client = match client {
        Ok(client) => client,
        Err(error) => return Decided::Refused(reply.reject_client(&error)),
    };
    // The client the payload names, within the one the head names.
    let client = match (client, named) {
        (Some(caller), Some(named)) => Some(caller.and(&named)),
        (caller, named) => caller.or(named),
    };
    if client.is_none() && settings.require_client {
        return Decided::Refused(reply.refuse(
            "client_missing",
            Code::ClientMissing,
            "this route keeps idempotency keys per client, and this request names none; send your credentials".into(),
        ));
    }
    let (method, path) = (parts.method.as_str(), parts.uri.path());
    let scope = match parts.uri.query().filter(|_| settings.include_query) {
        Some(query) => ScopeKey::new("http", &[method, path, query], client.as_ref(), &key),
        None => ScopeKey::new("http", &[method, path], client.as_ref(), &key),
    };
    Decided::Protected(Protected {
        key,
        client,
        scope,
        attempt,
        epoch,
    })
}

fn ready<B, E>(response: Response<Body<B>>) -> impl Future<Output = Result<Response<Body<B>>, E>> {
    std::future::ready(Ok(response))
}

async fn pass_through<S, ReqBody, ResBody>(
    mut inner: S,
    request: Request<ReqBody>,
    attempt: Option<AttemptId>,
) -> Result<Response<Body<ResBody>>, S::Error>
where
    S: Service<Request<Body<ReqBody>>, Response = Response<ResBody>>,
{
    let response = inner.call(request.map(Body::inner)).await?;
    let reply = Reply {
        key: None,
        attempt: attempt.as_ref(),
        docs: None,
    };
    Ok(reply.finish(response.map(Body::inner)))
}

/// A protected request whose key is in its head: its body read (within the limits),
/// then deduplicated.
///
/// An `async` block rather than an `async fn` here and in [`deduplicate`]: an `async fn`
/// keeps its arguments twice in its future (as captured and as locals), and these
/// futures are moved whole on every request.
#[allow(clippy::manual_async_fn)]
fn run<S, St, ReqBody, ResBody>(
    inner: S,
    engine: Engine<St>,
    settings: Arc<Settings>,
    request: Request<ReqBody>,
    protected: Protected,
    claimed: ClaimFlag,
) -> impl Future<Output = Result<Response<Body<ResBody>>, S::Error>> + Send
where
    S: Handler<ReqBody, ResBody>,
    St: IdempotencyStore,
    ReqBody: ReadableBody,
    ResBody: ReadableBody,
{
    async move {
        record_protected(&protected, &settings);
        let _in_flight = engine.track();
        // The body's bytes of the layer's budget, held until this work ends (dropped
        // with it on every path, including a cancelled or abandoned future).
        let (request, _budget) =
            match read_body(request, &settings, protected.reply(&settings)).await {
                Ok(read) => read,
                Err(refused) => return Ok(refused),
            };
        deduplicate(inner, engine, settings, request, protected, claimed).await
    }
}

/// Records the protected request's key, scope and client on the request's span (see
/// [`field`](crate::idempotency::field)), where its access line and every event of the
/// request pick them up.
fn record_protected(protected: &Protected, settings: &Settings) {
    // Warns once if the correlation layer is not outside this one.
    settings.layer_order.check();
    observe::protected(&protected.key, &protected.scope, protected.client.as_ref());
}

/// [`run`] for a route whose key is in the body: the body is read (within the limits,
/// as a refusal of the head is), the key extracted, and
/// the request deduplicated, passed through without a key, or refused.
async fn run_keyed_by_body<S, St, ReqBody, ResBody>(
    mut inner: S,
    engine: Engine<St>,
    settings: Arc<Settings>,
    request: Request<ReqBody>,
    identity: Identity,
    claimed: ClaimFlag,
) -> Result<Response<Body<ResBody>>, S::Error>
where
    S: Handler<ReqBody, ResBody>,
    St: IdempotencyStore,
    ReqBody: ReadableBody,
    ResBody: ReadableBody,
{
    let keyless = Reply::new(&settings, None, identity.attempt.as_ref());
    let (request, _budget) = match read_body(request, &settings, keyless).await {
        Ok(read) => read,
        Err(refused) => return Ok(refused),
    };
    let (parts, body) = request.into_parts();
    let extracted = settings
        .key
        .extract_key(&parts, &body.complete_bytes().unwrap_or_default());
    let protected = protect(&settings, extracted, identity, &parts);
    let request = Request::from_parts(parts, body);
    match protected {
        Decided::Protected(protected) => {
            // Counted from here: until its key is read, the request may pass through.
            let _in_flight = engine.track();
            record_protected(&protected, &settings);
            deduplicate(inner, engine, settings, request, protected, claimed).await
        }
        Decided::PassThrough(attempt) => {
            let response = inner.call(request).await?;
            let reply = Reply {
                key: None,
                attempt: attempt.as_ref(),
                docs: None,
            };
            Ok(reply.finish(response.map(Body::inner)))
        }
        Decided::Refused(refused) => Ok(refused),
    }
}

/// Asks the engine what to do with a protected request whose body is read, and does
/// it: runs the handler, or answers for the engine.
#[allow(clippy::manual_async_fn)] // See `run`.
fn deduplicate<S, St, ReqBody, ResBody>(
    mut inner: S,
    engine: Engine<St>,
    settings: Arc<Settings>,
    request: Request<Body<ReqBody>>,
    protected: Protected,
    claimed: ClaimFlag,
) -> impl Future<Output = Result<Response<Body<ResBody>>, S::Error>> + Send
where
    S: Handler<ReqBody, ResBody>,
    St: IdempotencyStore,
    ReqBody: ReadableBody,
    ResBody: ReadableBody,
{
    async move {
        let (parts, body) = request.into_parts();
        let bytes = buffered(&body);
        // The fast hash where the scope is one client's; a scope every caller shares
        // takes SHA-256, which no caller can collide on purpose (see `Fingerprint`).
        let hash: FingerprintHash = match protected.client {
            Some(_) => Fingerprint::new,
            None => Fingerprint::collision_resistant,
        };
        let fingerprint = fingerprint(hash, &parts, &bytes);
        let decision = engine
            .decide(protected.scope, fingerprint, protected.epoch, &claimed)
            .await;
        let request = Request::from_parts(parts, body);
        let reply = protected.reply(&settings);
        match decision {
            // Boxed, so the replay path's future stays small.
            Decision::Run(claimed) => {
                Box::pin(execute(inner, &settings, request, claimed, reply)).await
            }
            Decision::FailOpen => {
                let response = Box::pin(inner.call(request)).await?;
                Ok(reply.finish(response.map(Body::inner)))
            }
            Decision::Answer(verdict) => Ok(reply.decided(verdict, &settings)),
        }
    }
}

/// Runs the claimed request: the engine renews its claim while the handler and its
/// response body run, this adapter says what of the response is kept, and the engine
/// stores it or gives the key back.
async fn execute<S, St, ReqBody, ResBody>(
    mut inner: S,
    settings: &Settings,
    mut request: Request<Body<ReqBody>>,
    claimed: Claimed<St>,
    reply: Reply<'_>,
) -> Result<Response<Body<ResBody>>, S::Error>
where
    S: Handler<ReqBody, ResBody>,
    St: IdempotencyStore,
    ResBody: ReadableBody,
{
    if let Some(offer) = claimed.transaction_offer() {
        offer_transaction(offer, request.extensions_mut());
    }
    // Runs in the caller's task; if the caller goes away, the response future's drop moves
    // this work to a task of its own, so it still completes and is stored.
    // Pinned here: the engine takes a pointer to it rather than moving it again.
    let work = std::pin::pin!(async {
        let (parts, body) = inner.call(request).await?.into_parts();
        let body = collect_up_to(body, settings.max_response_bytes).await;
        Ok((parts, body))
    });
    let classify = |(parts, body): &(http::response::Parts, Collected<ResBody>),
                    context: Classifying| {
        classify(settings, parts, body, context)
    };
    let attempt = reply.attempt.cloned();
    let ((mut parts, body), finished) = claimed.run(work, classify, attempt).await?;
    let response = match (body, finished) {
        (_, Finished::Unsettled(unsettled)) => return Ok(reply.unsettled(&unsettled)),
        (_, Finished::Failed) | (Collected::Failed(_), _) => return Ok(reply.response_failed()),
        // A success whose writes were rolled back must not say it succeeded.
        (_, Finished::RolledBack(error)) if parts.status.is_success() => {
            return Ok(reply.unsettled(&Unsettled::NotCommitted(error)))
        }
        (Collected::Complete { body, .. }, Finished::Kept { expires_at }) => {
            if let Some(expires_at) = expires_at.filter(|_| settings.expiry_header) {
                // Never over a header of the handler's own.
                parts
                    .headers
                    .entry(IDEMPOTENCY_EXPIRES)
                    .or_insert_with(|| http_date(expires_at));
            }
            Response::from_parts(parts, Body::complete(body))
        }
        (Collected::Complete { body, .. }, _) => Response::from_parts(parts, Body::complete(body)),
        (Collected::TooLarge { prefix, rest }, _) => {
            Response::from_parts(parts, Body::prefixed(prefix, rest))
        }
    };
    Ok(reply.finish(response))
}

/// What of a response is kept: the whole of it if the storage rule keeps its status (a
/// server error in a transaction the handler took is rolled back, not stored: nothing
/// it wrote remains, so its retry may run again); a response over the limit is
/// recorded as run without it; the rest give the key back.
fn classify<B>(
    settings: &Settings,
    parts: &http::response::Parts,
    body: &Collected<B>,
    context: Classifying,
) -> Classified {
    let status = parts.status;
    let stores = match &settings.store_if {
        Some(predicate) => predicate(status),
        None => super::layer::stores(context.rule, status),
    };
    let storable = stores && !(status.is_server_error() && context.transaction_taken);
    match body {
        Collected::Failed(error) => Classified::Failed(error.to_string()),
        _ if !storable => Classified::Release(Release::NotStored),
        Collected::TooLarge { .. } => Classified::TooLarge {
            max_bytes: settings.max_response_bytes,
        },
        Collected::Complete { body, .. } => {
            // At most as many as the response has: no slack for the record to hold.
            let mut headers = Vec::with_capacity(parts.headers.len());
            headers.extend(
                parts
                    .headers
                    .iter()
                    .filter(|(name, _)| !settings.per_attempt.contains(name))
                    .map(|(name, value)| (name.clone(), value.clone())),
            );
            let response = StoredResponse {
                status,
                headers,
                body: body.clone(),
            };
            Classified::Store(response.into_payload())
        }
    }
}
