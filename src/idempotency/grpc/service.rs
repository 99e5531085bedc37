//! A keyed unary call's path through the gRPC layer: its key and client read from its
//! metadata, its message read within the limits, the engine asked, and its decision
//! turned into the call's answer.

use std::{
    sync::Arc,
    task::{Context, Poll},
};

use bytes::Bytes;
use http::{Request, Response};
use tower_service::Service;

use super::{
    answer::{http_status, Refusal, Reply},
    call::{message_count, status_code, StoredCall},
    layer::Settings,
};
use crate::body::Body;
use crate::idempotency::{
    client::{IdentifyClient, NoClient},
    collect::{collect_up_to, read_within, BoxError, Collected, Read},
    core::{
        observe, refusal, ClaimFlag, Claimed, Classified, Classifying, Decision, Detaching, Engine,
        Finished, Release, Unsettled,
    },
    response::{offer_transaction, unclaimed, ResponseFuture},
    store::{IdempotencyStore, MokaStore, Payload, PayloadFormat},
    AttemptId, ClientId, Code, Fingerprint, IdempotencyKey, ScopeKey, IDEMPOTENCY_KEY,
};

/// Middleware that runs each keyed unary gRPC call once and replays its response.
/// Made by [`GrpcIdempotencyLayer`](super::GrpcIdempotencyLayer); see the
/// [module docs](super).
pub struct GrpcIdempotency<S, St = MokaStore, C = NoClient> {
    pub(super) inner: S,
    pub(super) engine: Engine<St>,
    pub(super) identify: C,
    pub(super) settings: Arc<Settings>,
}

impl GrpcIdempotency<()> {
    /// The layer, to configure and apply with `Server::builder().layer(..)`:
    /// `GrpcIdempotency::layer().require_key(true)`.
    pub fn layer() -> super::GrpcIdempotencyLayer {
        super::GrpcIdempotencyLayer::new()
    }
}

impl<S, St, C> GrpcIdempotency<S, St, C> {
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

impl<S: Clone, St, C: Clone> Clone for GrpcIdempotency<S, St, C> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            engine: self.engine.clone(),
            identify: self.identify.clone(),
            settings: self.settings.clone(),
        }
    }
}

impl<S: std::fmt::Debug, St, C> std::fmt::Debug for GrpcIdempotency<S, St, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcIdempotency")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

/// A keyed call: what scopes it, and what its responses echo.
struct Protected {
    key: IdempotencyKey,
    client: Option<ClientId>,
    scope: ScopeKey,
    attempt: Option<AttemptId>,
}

impl Protected {
    fn reply(&self) -> Reply<'_> {
        Reply {
            key: Some(&self.key),
            attempt: self.attempt.as_ref(),
        }
    }
}

impl<S, St, C, ReqBody, ResBody> Service<Request<ReqBody>> for GrpcIdempotency<S, St, C>
where
    S: Service<Request<Body<ReqBody>>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: IdempotencyStore,
    C: IdentifyClient<ReqBody>,
    ReqBody: http_body::Body<Data = bytes::Bytes, Error: Into<BoxError>> + Send + Unpin + 'static,
    ResBody: http_body::Body<Data = bytes::Bytes, Error: Into<BoxError>> + Send + Unpin + 'static,
{
    type Response = Response<Body<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let protected = match protect(&self.settings, &self.identify, &request) {
            Decided::Protected(protected) => protected,
            Decided::PassThrough(attempt) => {
                return unclaimed(async move {
                    let response = inner.call(request.map(Body::inner)).await?;
                    let reply = Reply {
                        key: None,
                        attempt: attempt.as_ref(),
                    };
                    Ok(reply.finish(response.map(Body::inner)))
                });
            }
            Decided::Refused(refused) => return unclaimed(std::future::ready(Ok(refused))),
        };
        let engine = self.engine.clone();
        let settings = self.settings.clone();
        ResponseFuture {
            work: Detaching::claiming(|claimed| {
                deduplicate(inner, engine, settings, request, protected, claimed)
            }),
        }
    }
}

/// What becomes of a call before its message is read.
enum Decided<B> {
    /// It has a key: deduplicate it.
    Protected(Protected),
    /// It has none, and may pass without one.
    PassThrough(Option<AttemptId>),
    /// It is refused.
    Refused(Response<Body<B>>),
}

/// The call's key, client and scope, or what else becomes of it.
fn protect<B, C: IdentifyClient<B>, R>(
    settings: &Settings,
    identify: &C,
    request: &Request<B>,
) -> Decided<R> {
    let headers = request.headers();
    let attempt = match AttemptId::from_headers(headers) {
        Ok(attempt) => attempt,
        Err(error) => {
            let refusal = Refusal::new(error.refusal(), error.to_string());
            return Decided::Refused(Reply::default().refuse(error.reason(), refusal));
        }
    };
    let keyless = Reply {
        key: None,
        attempt: attempt.as_ref(),
    };
    let key = match IdempotencyKey::from_headers(headers, &[IDEMPOTENCY_KEY]) {
        Ok(Some(key)) => key,
        Ok(None) if settings.require_key => {
            return Decided::Refused(keyless.refuse(
                "missing",
                Refusal::new(
                    Code::KeyMissing,
                    "this method requires `idempotency-key` metadata on every call",
                ),
            ));
        }
        Ok(None) => return Decided::PassThrough(attempt),
        Err(error) => {
            let refusal = Refusal::new(error.refusal(), error.to_string());
            return Decided::Refused(keyless.refuse(error.reason(), refusal));
        }
    };
    let reply = Reply {
        key: Some(&key),
        attempt: attempt.as_ref(),
    };
    let client = match identify.identify_client(request) {
        Ok(client) => client,
        Err(error) => {
            // Fixed text or a configured header name, never what the call sent.
            let refusal = Refusal::new(Code::ClientInvalid, error.to_string());
            return Decided::Refused(reply.refuse(error.logged_reason(), refusal));
        }
    };
    if client.is_none() && settings.require_client {
        let refusal = Refusal::new(
                Code::ClientMissing,
            "this method keeps idempotency keys per client, and this call names none; send your credentials",
        );
        return Decided::Refused(reply.refuse("client_missing", refusal));
    }
    let scope = ScopeKey::new("grpc", &[request.uri().path()], client.as_ref(), &key);
    Decided::Protected(Protected {
        key,
        client,
        scope,
        attempt,
    })
}

/// Reads the call's message, asks the engine what to do with it, and does it.
async fn deduplicate<S, St, ReqBody, ResBody>(
    mut inner: S,
    engine: Engine<St>,
    settings: Arc<Settings>,
    request: Request<ReqBody>,
    protected: Protected,
    claimed: ClaimFlag,
) -> Result<Response<Body<ResBody>>, S::Error>
where
    S: Service<Request<Body<ReqBody>>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    St: IdempotencyStore,
    ReqBody: http_body::Body<Data = bytes::Bytes, Error: Into<BoxError>> + Unpin,
    ResBody: http_body::Body<Data = bytes::Bytes, Error: Into<BoxError>> + Unpin,
{
    settings.layer_order.check();
    observe::protected(&protected.key, &protected.scope, protected.client.as_ref());
    let _in_flight = engine.track();
    let reply = protected.reply();
    let (parts, body) = request.into_parts();
    let max = settings.max_request_bytes.min(settings.budget.capacity());
    // Held until the call's work ends, as the HTTP layer holds a body's bytes.
    let mut reservation = settings.budget.reserve();
    let message = match read_within(body, max, None, &mut reservation).await {
        Read::Complete(message) => message,
        Read::TooLarge => {
            refusal::body_too_large(max);
            return Ok(reply.status(Refusal::new(
                Code::BodyTooLarge,
                format!("the call's messages are over the idempotency limit of {max} bytes; nothing ran"),
            )));
        }
        Read::Overloaded { requested } => {
            refusal::overloaded(settings.budget.capacity(), requested);
            return Ok(reply.status(
                Refusal::new(
                Code::Overloaded,
                    "the server holds as many calls as it can right now, so it ran nothing; retry later",
                )
                .retry_after(std::time::Duration::from_secs(1)),
            ));
        }
        Read::Failed(error) => {
            refusal::body_unreadable(&error);
            return Ok(reply.status(Refusal::new(
                Code::BodyUnreadable,
                "the call's messages could not be read to the end",
            )));
        }
    };
    match message_count(&message) {
        Some(1) => {}
        Some(_) => {
            return Ok(reply.refuse("streaming_unsupported", Refusal::new(
                Code::StreamingUnsupported,
                "a call with an idempotency key must send exactly one message; streaming calls are not deduplicated, send them without the key",
            )));
        }
        None => {
            return Ok(reply.refuse(
                "message_invalid",
                Refusal::new(
                    Code::MessageInvalid,
                    "the call's body is not a sequence of length-prefixed gRPC messages",
                ),
            ));
        }
    }
    // As the HTTP layer: the fast hash where the scope is one client's, SHA-256 where
    // every caller shares it.
    let path = parts.uri.path();
    let fingerprint = match protected.client {
        Some(_) => Fingerprint::new("grpc", path, None, None, &message),
        None => Fingerprint::collision_resistant("grpc", path, None, None, &message),
    };
    let decision = engine
        .decide(protected.scope, fingerprint, None, &claimed)
        .await;
    let request = Request::from_parts(parts, Body::complete(message));
    match decision {
        Decision::Run(claimed) => {
            Box::pin(execute(inner, &settings, request, claimed, reply)).await
        }
        Decision::FailOpen => {
            let response = Box::pin(inner.call(request)).await?;
            Ok(reply.finish(response.map(Body::inner)))
        }
        Decision::Answer(verdict) => Ok(reply.decided(verdict)),
    }
}

/// Runs the claimed call: the engine renews its claim while it runs, this adapter says
/// what of its response is kept, and the engine stores it or gives the key back.
async fn execute<S, St, ReqBody, ResBody>(
    mut inner: S,
    settings: &Settings,
    mut request: Request<Body<ReqBody>>,
    claimed: Claimed<St>,
    reply: Reply<'_>,
) -> Result<Response<Body<ResBody>>, S::Error>
where
    S: Service<Request<Body<ReqBody>>, Response = Response<ResBody>>,
    St: IdempotencyStore,
    ResBody: http_body::Body<Data = bytes::Bytes, Error: Into<BoxError>> + Unpin,
{
    if let Some(offer) = claimed.transaction_offer() {
        offer_transaction(offer, request.extensions_mut());
    }
    // Pinned here: the engine takes a pointer to it rather than moving it again.
    let work = std::pin::pin!(async {
        let (parts, body) = inner.call(request).await?.into_parts();
        Ok((
            parts,
            collect_up_to(body, settings.max_response_bytes).await,
        ))
    });
    let classify = |(parts, body): &(http::response::Parts, Collected<ResBody>),
                    context: Classifying| {
        classify(settings, parts, body, context)
    };
    let attempt = reply.attempt.cloned();
    let ((parts, produced), finished) = claimed.run(work, classify, attempt).await?;
    let response = match (produced, finished) {
        (_, Finished::Unsettled(unsettled)) => {
            return Ok(reply.status(Refusal::unsettled(&unsettled)))
        }
        (_, Finished::Failed) | (Collected::Failed(_), _) => {
            return Ok(reply.status(Refusal::new(
                Code::ResponseFailed,
                "the response could not be produced; nothing was stored, so a retry runs again",
            )))
        }
        // A success whose writes were rolled back must not say it succeeded.
        (Collected::Complete { trailers, .. }, Finished::RolledBack(error))
            if status_code(&parts.headers, trailers.as_deref()) == tonic::Code::Ok =>
        {
            return Ok(reply.status(Refusal::unsettled(&Unsettled::NotCommitted(error))))
        }
        (Collected::Complete { body, trailers }, _) => {
            Response::from_parts(parts, Body::with_trailers(body, trailers))
        }
        (Collected::TooLarge { prefix, rest }, _) => {
            Response::from_parts(parts, Body::prefixed(prefix, rest))
        }
    };
    Ok(reply.finish(response))
}

/// What of a call's response is kept: the whole call if the storage rule keeps its
/// code (a server error in a transaction the handler took is rolled back and
/// released). A response over the limit is recorded as run whatever its code: its
/// status comes after the limit, past the point where the key must be settled.
fn classify<B>(
    settings: &Settings,
    parts: &http::response::Parts,
    produced: &Collected<B>,
    context: Classifying,
) -> Classified {
    match produced {
        Collected::Failed(error) => Classified::Failed(error.to_string()),
        Collected::TooLarge { .. } => Classified::TooLarge {
            max_bytes: settings.max_response_bytes,
        },
        Collected::Complete { body, trailers } => {
            let code = status_code(&parts.headers, trailers.as_deref());
            let stores = match &settings.store_if {
                Some(predicate) => predicate(code),
                None => super::layer::stores(context.rule, code),
            };
            if !stores || (http_status(code) >= 500 && context.transaction_taken) {
                return Classified::Release(Release::NotStored);
            }
            match StoredCall::encode(
                &parts.headers,
                &settings.per_attempt,
                body,
                trailers.as_deref(),
            ) {
                Some(call) => {
                    let status = u16::try_from(i32::from(code)).unwrap_or(u16::MAX);
                    Classified::Store(Payload::new(
                        PayloadFormat::GRPC,
                        status,
                        Bytes::new(),
                        call,
                    ))
                }
                None => Classified::Unencodable("the call's metadata could not be encoded".into()),
            }
        }
    }
}
