//! What the HTTP transport decides for the adapter: which requests are covered, what
//! scopes and fingerprints one, how a refusal reads (a problem, RFC 9457), what of a
//! response is kept and how it is replayed.

use std::time::SystemTime;

use http::{header, request, response, HeaderMap, HeaderValue, Request, Response, StatusCode};

use super::{replay, stored::StoredResponse, Http};
use crate::body::Body;
use crate::idempotency::{
    core::{refusal::Answered, Answer, Classified, OutcomeClass, ReplayInfo},
    extract::ExtractKey,
    response::http_date,
    store::Record,
    transport::{CompleteResponse, KeyOwner, Settings, Transport},
    Code, Fingerprint, IdempotencyKey, ScopeKey, IDEMPOTENCY_EXPIRES,
};

impl Transport for Http {
    type Status = StatusCode;

    const NOUN: &'static str = "request";

    // What a replay cannot give back (it keeps no trailers) the first answer does not
    // give either.
    const KEEPS_TRAILERS: bool = false;

    fn covers<B>(settings: &Settings<Self>, request: &Request<B>) -> bool {
        settings.transport.methods.contains(request.method())
    }

    fn key(settings: &Settings<Self>) -> &dyn ExtractKey {
        &*settings.transport.key
    }

    fn scope(settings: &Settings<Self>, parts: &request::Parts, owner: KeyOwner<'_>) -> ScopeKey {
        let KeyOwner { client, key } = owner;
        let (method, path) = (parts.method.as_str(), parts.uri.path());
        match parts
            .uri
            .query()
            .filter(|_| settings.transport.include_query)
        {
            Some(query) => ScopeKey::new("http", &[method, path, query], client, key),
            None => ScopeKey::new("http", &[method, path], client, key),
        }
    }

    fn check_body(_: &[u8]) -> Result<(), (&'static str, Code, &'static str)> {
        Ok(())
    }

    fn fingerprint(parts: &request::Parts, body: &[u8], shared: bool) -> Fingerprint {
        let hash = if shared {
            Fingerprint::collision_resistant
        } else {
            Fingerprint::new
        };
        hash(
            parts.method.as_str(),
            parts.uri.path(),
            parts.uri.query(),
            parts
                .headers
                .get(header::CONTENT_TYPE)
                .map(HeaderValue::as_bytes),
            body,
        )
    }

    fn render<B>(
        settings: &Settings<Self>,
        key: Option<&IdempotencyKey>,
        answer: Answer,
    ) -> Response<Body<B>> {
        let mut response = crate::problem::idempotency(answer.code, answer.detail)
            .docs(settings.transport.problem_docs.as_deref())
            .idempotency_key(key.map(IdempotencyKey::as_str))
            .into_response();
        if let Some(delay) = answer.retry_after {
            let seconds = delay.as_secs().max(u64::from(delay.subsec_nanos() > 0));
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }

    fn status(parts: &response::Parts, _: Option<&HeaderMap>) -> StatusCode {
        parts.status
    }

    fn status_before_body(parts: &response::Parts) -> Option<StatusCode> {
        Some(parts.status)
    }

    fn class(status: StatusCode) -> OutcomeClass {
        match status {
            StatusCode::REQUEST_TIMEOUT
            | StatusCode::TOO_MANY_REQUESTS
            | StatusCode::SERVICE_UNAVAILABLE => OutcomeClass::NotProcessed,
            _ if status.is_client_error() => OutcomeClass::Refused,
            _ if status.is_server_error() => OutcomeClass::Failed,
            _ => OutcomeClass::Success,
        }
    }

    fn store_if(settings: &Settings<Self>, status: StatusCode) -> Option<bool> {
        (settings.transport.store_if.as_ref()).map(|predicate| predicate(status))
    }

    fn answered(code: Code) -> Answered {
        Answered::Http(code.http_status().as_u16())
    }

    fn is_server_error(status: StatusCode) -> bool {
        status.is_server_error()
    }

    fn encode(
        settings: &Settings<Self>,
        status: StatusCode,
        complete: CompleteResponse<'_>,
    ) -> Classified {
        let CompleteResponse { parts, body, .. } = complete;
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

    fn replay<B>(
        settings: &Settings<Self>,
        record: &Record,
        request_count: u64,
    ) -> Option<Response<Body<B>>> {
        let http = &settings.transport;
        let stored = record.payload.as_ref().and_then(StoredResponse::of)?;
        let mut response = Response::new(stored.body.clone());
        *response.status_mut() = stored.status;
        let headers = response.headers_mut();
        headers.reserve(stored.headers.len() + 5);
        for (name, value) in &stored.headers {
            if !http.not_replayed.contains(name) {
                headers.append(name.clone(), value.clone());
            }
        }
        // The route's hook adjusts this copy; the stored record stays as it is.
        if let Some(hook) = &http.on_replay {
            let info = ReplayInfo::of(record, request_count);
            response = replay::apply(&**hook, response, &info);
        }
        let mut response = response.map(Body::complete);
        if let Some(expires_at) = record.expires_at.filter(|_| http.expiry_header) {
            response
                .headers_mut()
                .entry(IDEMPOTENCY_EXPIRES)
                .or_insert_with(|| http_date(expires_at));
        }
        Some(response)
    }

    fn kept(
        settings: &Settings<Self>,
        parts: &mut response::Parts,
        expires_at: Option<SystemTime>,
    ) {
        if let Some(expires_at) = expires_at.filter(|_| settings.transport.expiry_header) {
            // Never over a header of the handler's own.
            parts
                .headers
                .entry(IDEMPOTENCY_EXPIRES)
                .or_insert_with(|| http_date(expires_at));
        }
    }
}
