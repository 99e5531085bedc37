//! A covered call's path through the layer: its key, client and epoch read, its body
//! read within the limits, the engine asked, and its decision turned into a response.

use std::{
    future::Future,
    marker::PhantomData,
    sync::Arc,
    task::{Context, Poll},
    time::SystemTime,
};

use bytes::Bytes;
use http::{Request, Response};
use tower_service::Service;
use tracing::{Instrument as _, Span};

use super::{read::read_body, Reply};
use crate::body::Body;
use crate::idempotency::{
    collect::{collect_up_to, BoxError, Collected},
    core::{
        observe, Answer, ClaimFlag, Classified, Classify, Classifying, Detaching, Engine, Exchange,
        Keyed, OutcomeClass, Release, Resolution,
    },
    extract::{
        ClientRejection, EpochRejection, ExtractEpoch, ExtractedKey, IdentifyClient, NoClient,
        NoEpoch,
    },
    http::Http,
    response::{offer_transaction, unclaimed, ResponseFuture},
    store::{IdempotencyStore, MokaStore, TransactionOffer},
    transport::{CompleteResponse, KeyOwner, Settings, Transport},
    AttemptId, ClientId, Code, IdempotencyKey, KeyRejection, ScopeKey,
};

/// The service a covered route wraps, as the layer needs it: it takes the request
/// with its body buffered (or streamed on), and it and its future move across tasks.
pub(crate) trait Handler<ReqBody, ResBody>:
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
pub(crate) trait ReadableBody:
    http_body::Body<Data = Bytes, Error: Into<BoxError>> + Send + Unpin + 'static
{
}

impl<B> ReadableBody for B where
    B: http_body::Body<Data = Bytes, Error: Into<BoxError>> + Send + Unpin + 'static
{
}

/// Middleware that runs each idempotent call once and replays its response.
///
/// Made by [`IdempotencyLayer`](super::IdempotencyLayer); see the
/// [module docs](crate::idempotency).
pub struct Idempotency<S, St = MokaStore, C = NoClient, E = NoEpoch, T = Http> {
    pub(crate) inner: S,
    pub(crate) engine: Engine<St>,
    pub(crate) identify: C,
    pub(crate) epoch: E,
    pub(crate) settings: Arc<Settings<T>>,
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

impl<S, St, C, E, T> Idempotency<S, St, C, E, T> {
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

impl<S: Clone, St, C: Clone, E: Clone, T> Clone for Idempotency<S, St, C, E, T> {
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

impl<S: std::fmt::Debug, St, C, E, T> std::fmt::Debug for Idempotency<S, St, C, E, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

/// What one covered call is, once its key is read.
struct Protected {
    key: IdempotencyKey,
    client: Option<ClientId>,
    scope: ScopeKey,
    attempt: Option<AttemptId>,
    epoch: Option<u64>,
}

impl Protected {
    fn reply<'a, T>(&'a self, settings: &'a Settings<T>) -> Reply<'a, T> {
        Reply {
            settings,
            key: Some(&self.key),
            attempt: self.attempt.as_ref(),
        }
    }
}

impl<S, St, C, E, T, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S, St, C, E, T>
where
    S: Service<Request<Body<ReqBody>>, Response = Response<ResBody>>
        + Handler<ReqBody, ResBody>
        + Clone,
    St: IdempotencyStore,
    C: IdentifyClient<ReqBody>,
    E: ExtractEpoch<ReqBody>,
    T: Transport,
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

        if !T::covers(&settings, &request) {
            return unclaimed(pass_through(inner, request, None));
        }
        let attempt = match AttemptId::from_headers(request.headers()) {
            Ok(attempt) => attempt,
            Err(error) => {
                let reply = Reply {
                    settings: &*settings,
                    key: None,
                    attempt: None,
                };
                let refused = reply.refuse(error.reason(), error.code(), error.to_string());
                return unclaimed(ready(refused));
            }
        };
        // Read from the head now (the body type changes once it is read), applied once
        // the key is known: a call without a key never hears of them.
        let identity = Identity {
            epoch: self.epoch.extract_epoch(&request),
            client: self.identify.identify_client(&request),
            attempt,
        };
        let engine = self.engine.clone();
        if T::key(&settings).reads_body() {
            // The key is in the body: read it first (within the limits), then decide.
            return ResponseFuture {
                work: Detaching::claiming(|claimed| {
                    run_keyed_by_body(inner, engine, settings, request, identity, claimed)
                }),
            };
        }
        let (parts, body) = request.into_parts();
        let extracted = T::key(&settings).extract_key(&parts, &Bytes::new());
        let protected = protect(&settings, extracted, identity, &parts);
        let request = Request::from_parts(parts, body);
        match protected {
            Covered::Protected(protected) => ResponseFuture {
                work: Detaching::claiming(|claimed| {
                    run(inner, engine, settings, request, protected, claimed)
                }),
            },
            Covered::PassThrough(attempt) => unclaimed(pass_through(inner, request, attempt)),
            Covered::Refused(refused) => unclaimed(ready(refused)),
        }
    }
}

/// What the head of a covered call says besides its key, read before its body.
struct Identity {
    epoch: Result<Option<u64>, EpochRejection>,
    client: Result<Option<ClientId>, ClientRejection>,
    attempt: Option<AttemptId>,
}

/// What a covered call is, once its key is extracted.
enum Covered<B> {
    Protected(Protected),
    /// No key, and none required: passed through, with its attempt ID echoed.
    PassThrough(Option<AttemptId>),
    /// Refused before the engine is asked.
    Refused(Response<Body<B>>),
}

/// Decides what a covered call is, once its key is extracted.
fn protect<T: Transport, B>(
    settings: &Settings<T>,
    extracted: Result<Option<ExtractedKey>, KeyRejection>,
    identity: Identity,
    parts: &http::request::Parts,
) -> Covered<B> {
    let Identity {
        epoch,
        client,
        attempt,
    } = identity;
    let keyless = Reply {
        settings,
        key: None,
        attempt: attempt.as_ref(),
    };
    let (key, named) = match extracted {
        Ok(Some(extracted)) => extracted.into_parts(),
        Ok(None) if settings.require_key => {
            let detail = T::key(settings).missing_detail().into_owned();
            return Covered::Refused(keyless.refuse("missing", Code::KeyMissing, detail));
        }
        Ok(None) => return Covered::PassThrough(attempt),
        Err(rejection) => {
            return Covered::Refused(keyless.refuse(
                rejection.reason(),
                rejection.code(),
                rejection.to_string(),
            ));
        }
    };
    // From here on every answer names the key.
    let reply = Reply {
        settings,
        key: Some(&key),
        attempt: attempt.as_ref(),
    };
    let epoch = match epoch {
        Ok(epoch) => epoch,
        Err(error) => {
            let refused = reply.refuse("epoch_invalid", Code::EpochInvalid, error.to_string());
            return Covered::Refused(refused);
        }
    };
    let client = match client {
        Ok(client) => client,
        // Fixed text or a configured header name, never what the call sent.
        Err(error) => {
            let refused = reply.refuse(
                error.logged_reason(),
                Code::ClientInvalid,
                error.to_string(),
            );
            return Covered::Refused(refused);
        }
    };
    // The client the payload names, within the one the head names.
    let client = match (client, named) {
        (Some(caller), Some(named)) => Some(caller.and(&named)),
        (caller, named) => caller.or(named),
    };
    if client.is_none() && settings.require_client {
        let detail = format!(
            "this {} keeps idempotency keys per client, and this one names none; send your credentials",
            T::NOUN
        );
        return Covered::Refused(reply.refuse("client_missing", Code::ClientMissing, detail));
    }
    let owner = KeyOwner {
        client: client.as_ref(),
        key: &key,
    };
    let scope = T::scope(settings, parts, owner);
    Covered::Protected(Protected {
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
    Ok(passed(response, attempt.as_ref()))
}

/// A response of a call that claimed no key, marked as not replayed.
fn passed<B>(response: Response<B>, attempt: Option<&AttemptId>) -> Response<Body<B>> {
    let mut response = response.map(Body::inner);
    crate::idempotency::response::echo(response.headers_mut(), false, None, attempt);
    response
}

/// A covered call whose key is in its head: its body read (within the limits), then
/// deduplicated.
///
/// An `async` block rather than an `async fn` here and in [`deduplicate`]: an `async fn`
/// keeps its arguments twice in its future (as captured and as locals), and these
/// futures are moved whole on every call.
#[allow(clippy::manual_async_fn)]
fn run<S, St, T, ReqBody, ResBody>(
    inner: S,
    engine: Engine<St>,
    settings: Arc<Settings<T>>,
    request: Request<ReqBody>,
    protected: Protected,
    claimed: ClaimFlag,
) -> impl Future<Output = Result<Response<Body<ResBody>>, S::Error>> + Send
where
    S: Handler<ReqBody, ResBody>,
    St: IdempotencyStore,
    T: Transport,
    ReqBody: ReadableBody,
    ResBody: ReadableBody,
{
    async move {
        let span = record_protected(&protected, &settings);
        let work = async move {
            let _in_flight = engine.track();
            // The body's bytes of the layer's budget, held until this work ends (dropped
            // with it on every path, including a cancelled or abandoned future).
            let (request, _budget) = match read_body(request, protected.reply(&settings)).await {
                Ok(read) => read,
                Err(refused) => return Ok(refused),
            };
            deduplicate(inner, engine, settings, request, protected, claimed).await
        };
        match span {
            Some(span) => work.instrument(span).await,
            None => work.await,
        }
    }
}

/// Records the covered call's key, scope and client on its span (see
/// [`field`](crate::idempotency::field)), where its access line and every event of the
/// call pick them up.
/// `None` when that is the current span; else the layer's own span, which has them
/// (see [`observe::protected_span`]).
fn record_protected<T>(protected: &Protected, settings: &Settings<T>) -> Option<Span> {
    // Warns once if the correlation layer is not outside this one.
    settings.layer_order.check();
    let client = protected.client.as_ref();
    observe::protected_span(Some(&protected.key), Some(&protected.scope), client)
}

/// [`run`] for a route whose key is in the body: the body is read (within the limits,
/// as a refusal of the head is), the key extracted, and the call deduplicated, passed
/// through without a key, or refused.
async fn run_keyed_by_body<S, St, T, ReqBody, ResBody>(
    mut inner: S,
    engine: Engine<St>,
    settings: Arc<Settings<T>>,
    request: Request<ReqBody>,
    identity: Identity,
    claimed: ClaimFlag,
) -> Result<Response<Body<ResBody>>, S::Error>
where
    S: Handler<ReqBody, ResBody>,
    St: IdempotencyStore,
    T: Transport,
    ReqBody: ReadableBody,
    ResBody: ReadableBody,
{
    let keyless = Reply {
        settings: &*settings,
        key: None,
        attempt: identity.attempt.as_ref(),
    };
    let (request, _budget) = match read_body(request, keyless).await {
        Ok(read) => read,
        Err(refused) => return Ok(refused),
    };
    let (parts, body) = request.into_parts();
    let extracted =
        T::key(&settings).extract_key(&parts, &body.complete_bytes().unwrap_or_default());
    let protected = protect(&settings, extracted, identity, &parts);
    let request = Request::from_parts(parts, body);
    match protected {
        Covered::Protected(protected) => {
            // Counted from here: until its key is read, the call may pass through.
            let _in_flight = engine.track();
            let span = record_protected(&protected, &settings);
            let work = deduplicate(inner, engine, settings, request, protected, claimed);
            match span {
                Some(span) => work.instrument(span).await,
                None => work.await,
            }
        }
        Covered::PassThrough(attempt) => {
            let response = inner.call(request).await?;
            Ok(passed(response, attempt.as_ref()))
        }
        Covered::Refused(refused) => Ok(refused),
    }
}

/// Hands a covered call whose body is read to the engine, and renders what it says:
/// the handler's response (with what the layer says of it), a replay, or an answer.
#[allow(clippy::manual_async_fn)] // See `run`.
fn deduplicate<S, St, T, ReqBody, ResBody>(
    inner: S,
    engine: Engine<St>,
    settings: Arc<Settings<T>>,
    request: Request<Body<ReqBody>>,
    protected: Protected,
    claimed: ClaimFlag,
) -> impl Future<Output = Result<Response<Body<ResBody>>, S::Error>> + Send
where
    S: Handler<ReqBody, ResBody>,
    St: IdempotencyStore,
    T: Transport,
    ReqBody: ReadableBody,
    ResBody: ReadableBody,
{
    async move {
        let Protected {
            key,
            client,
            scope,
            attempt,
            epoch,
        } = protected;
        let reply = Reply {
            settings: &*settings,
            key: Some(&key),
            attempt: attempt.as_ref(),
        };
        let (parts, body) = request.into_parts();
        let bytes = body.complete_bytes().unwrap_or_default();
        if let Err((reason, code, detail)) = T::check_body(&bytes) {
            return Ok(reply.refuse(reason, code, detail.into()));
        }
        // The fast hash where the scope is one client's; a scope every caller shares
        // takes SHA-256, which no caller can collide on purpose (see `Fingerprint`).
        let fingerprint = T::fingerprint(&parts, &bytes, client.is_none());
        let keyed = Keyed {
            scope,
            fingerprint,
            epoch,
            attempt: attempt.clone(),
            noun: T::NOUN,
        };
        let call = Call {
            inner,
            request: Request::from_parts(parts, body),
            max_response_bytes: settings.max_response_bytes,
            response: PhantomData,
        };
        match engine
            .handle(keyed, &claimed, call, &Keeping(&settings))
            .await
        {
            Resolution::Ran { output, expires_at } => Ok(ran(reply, output, expires_at)),
            Resolution::FailOpen(Call {
                mut inner, request, ..
            }) => {
                let response = Box::pin(inner.call(request)).await?;
                Ok(reply.finish(response.map(Body::inner)))
            }
            Resolution::Replay {
                record,
                request_count,
            } => Ok(reply.replay(record, request_count)),
            Resolution::Answer(answer) => Ok(reply.answer(answer)),
            Resolution::Failed(error) => Err(error),
        }
    }
}

/// The response of a handler that ran, as the layer answers it: what it says of the
/// kept outcome, and the body read so far followed by the rest.
fn ran<T: Transport, B>(
    reply: Reply<'_, T>,
    (mut parts, body): (http::response::Parts, Collected<B>),
    expires_at: Option<SystemTime>,
) -> Response<Body<B>> {
    T::kept(reply.settings, &mut parts, expires_at);
    let body = match body {
        Collected::Complete { body, trailers } => {
            Body::with_trailers(body, trailers.filter(|_| T::KEEPS_TRAILERS))
        }
        Collected::TooLarge { prefix, rest } => Body::prefixed(prefix, rest),
        // Classified as failed, so answered as such by the engine.
        Collected::Failed(_) => return reply.answer(Answer::response_failed()),
    };
    reply.finish(Response::from_parts(parts, body))
}

/// A claimed call's handler, for the engine: the response read within the limit of
/// what is kept (the rest streamed on).
struct Call<S, ReqBody, ResBody> {
    inner: S,
    request: Request<Body<ReqBody>>,
    max_response_bytes: usize,
    response: PhantomData<fn() -> ResBody>,
}

impl<S, ReqBody, ResBody> Exchange for Call<S, ReqBody, ResBody>
where
    S: Handler<ReqBody, ResBody>,
    ReqBody: ReadableBody,
    ResBody: ReadableBody,
{
    type Output = (http::response::Parts, Collected<ResBody>);
    type Error = S::Error;

    fn run(
        mut self,
        offer: Option<TransactionOffer>,
    ) -> impl Future<Output = Result<Self::Output, S::Error>> + Send {
        if let Some(offer) = offer {
            offer_transaction(offer, self.request.extensions_mut());
        }
        async move {
            let (parts, body) = self.inner.call(self.request).await?.into_parts();
            Ok((parts, collect_up_to(body, self.max_response_bytes).await))
        }
    }
}

/// What of a response is kept, by the layer's settings.
struct Keeping<'a, T>(&'a Settings<T>);

impl<T: Transport, B> Classify<(http::response::Parts, Collected<B>)> for Keeping<'_, T> {
    fn classify(
        &self,
        (parts, body): &(http::response::Parts, Collected<B>),
        context: Classifying,
    ) -> Classified {
        classify(self.0, parts, body, context)
    }

    fn succeeded(&self, (parts, body): &(http::response::Parts, Collected<B>)) -> bool {
        let status = match body {
            Collected::Complete { trailers, .. } => Some(T::status(parts, trailers.as_deref())),
            Collected::TooLarge { .. } => T::status_before_body(parts),
            Collected::Failed(_) => None,
        };
        status.is_some_and(|status| T::class(status) == OutcomeClass::Success)
    }
}

/// What of a response is kept: the whole of it if the storage rule keeps its status (a
/// server error in a transaction the handler took is rolled back, not stored: nothing
/// it wrote remains, so its retry may run again); a response over the limit is
/// recorded as run without it (where the transport says its status only after the
/// body, whatever that status); the rest give the key back.
fn classify<T: Transport, B>(
    settings: &Settings<T>,
    parts: &http::response::Parts,
    body: &Collected<B>,
    context: Classifying,
) -> Classified {
    let storable = |status: T::Status| {
        let class = T::class(status);
        context.keeps(
            class,
            T::is_server_error(status),
            T::store_if(settings, status),
        )
    };
    match body {
        Collected::Failed(error) => Classified::Failed(error.to_string()),
        Collected::TooLarge { .. } => match T::status_before_body(parts) {
            Some(status) if !storable(status) => Classified::Release(Release::NotStored),
            _ => Classified::TooLarge {
                max_bytes: settings.max_response_bytes,
            },
        },
        Collected::Complete { body, trailers } => {
            let status = T::status(parts, trailers.as_deref());
            if !storable(status) {
                return Classified::Release(Release::NotStored);
            }
            let complete = CompleteResponse {
                parts,
                body,
                trailers: trailers.as_deref(),
            };
            T::encode(settings, status, complete)
        }
    }
}
