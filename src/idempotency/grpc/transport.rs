//! What the gRPC transport decides for the adapter: the key from the call's metadata,
//! the method as its scope, one message as its body, its code as its status, a
//! `tonic::Status` with `google.rpc` details for every refusal, and the whole call
//! (metadata, messages, trailers) kept for replay.

use std::{borrow::Cow, collections::HashMap, time::SystemTime};

use bytes::Bytes;
use http::{request, response, HeaderMap, Request, Response};
use tonic::Code as GrpcCode;
use tonic_types::{ErrorDetails, StatusExt as _};

use super::{
    call::{message_count, status_code, StoredCall},
    Grpc,
};
use crate::body::Body;
use crate::idempotency::{
    core::{refusal::Answered, Answer, Classified, OutcomeClass},
    extract::{ExtractKey, ExtractedKey},
    store::{Payload, PayloadFormat, Record},
    transport::{CompleteResponse, KeyOwner, Settings, Transport},
    Code, Fingerprint, IdempotencyKey, KeyRejection, ScopeKey, IDEMPOTENCY_KEY,
};

/// The `domain` of every `google.rpc.ErrorInfo` the layer answers; its `reason` is the
/// layer's stable code (`idempotency.in_flight`), as the HTTP layer's problems carry it.
pub const ERROR_DOMAIN: &str = "tower-ids";

/// A call's key: its `idempotency-key` metadata.
struct MetadataKey;

impl ExtractKey for MetadataKey {
    fn reads_body(&self) -> bool {
        false
    }

    fn extract_key(
        &self,
        parts: &request::Parts,
        _: &Bytes,
    ) -> Result<Option<ExtractedKey>, KeyRejection> {
        Ok(
            IdempotencyKey::from_headers(&parts.headers, &[IDEMPOTENCY_KEY])?
                .map(ExtractedKey::new),
        )
    }

    fn missing_detail(&self) -> Cow<'static, str> {
        Cow::Borrowed("this method requires `idempotency-key` metadata on every call")
    }
}

impl Transport for Grpc {
    type Status = GrpcCode;

    const NOUN: &'static str = "call";

    const KEEPS_TRAILERS: bool = true;

    fn covers<B>(_: &Settings<Self>, _: &Request<B>) -> bool {
        true
    }

    fn key(_: &Settings<Self>) -> &dyn ExtractKey {
        &MetadataKey
    }

    fn scope(_: &Settings<Self>, parts: &request::Parts, owner: KeyOwner<'_>) -> ScopeKey {
        ScopeKey::new("grpc", &[parts.uri.path()], owner.client, owner.key)
    }

    fn check_body(body: &[u8]) -> Result<(), (&'static str, Code, &'static str)> {
        match message_count(body) {
            Some(1) => Ok(()),
            Some(_) => Err((
                "streaming_unsupported",
                Code::StreamingUnsupported,
                "a call with an idempotency key must send exactly one message; streaming calls are not deduplicated, send them without the key",
            )),
            None => Err((
                "message_invalid",
                Code::MessageInvalid,
                "the call's body is not a sequence of length-prefixed gRPC messages",
            )),
        }
    }

    fn fingerprint(parts: &request::Parts, body: &[u8], shared: bool) -> Fingerprint {
        let path = parts.uri.path();
        if shared {
            Fingerprint::collision_resistant("grpc", path, None, None, body)
        } else {
            Fingerprint::new("grpc", path, None, None, body)
        }
    }

    fn render<B>(
        _: &Settings<Self>,
        _: Option<&IdempotencyKey>,
        answer: Answer,
    ) -> Response<Body<B>> {
        let reason = answer.code.as_str();
        let mut details = ErrorDetails::with_error_info(reason, ERROR_DOMAIN, HashMap::new());
        if let Some(delay) = answer.retry_after {
            details.set_retry_info(Some(delay));
        }
        tonic::Status::with_error_details(grpc(answer.code), answer.detail, details)
            .into_http::<()>()
            .map(|()| Body::complete(Bytes::new()))
    }

    fn status(parts: &response::Parts, trailers: Option<&HeaderMap>) -> GrpcCode {
        status_code(&parts.headers, trailers)
    }

    fn status_before_body(_: &response::Parts) -> Option<GrpcCode> {
        None
    }

    fn class(code: GrpcCode) -> OutcomeClass {
        match code {
            GrpcCode::Ok => OutcomeClass::Success,
            GrpcCode::Unavailable | GrpcCode::ResourceExhausted | GrpcCode::Aborted => {
                OutcomeClass::NotProcessed
            }
            GrpcCode::Unknown
            | GrpcCode::DeadlineExceeded
            | GrpcCode::Unimplemented
            | GrpcCode::Internal
            | GrpcCode::DataLoss => OutcomeClass::Failed,
            _ => OutcomeClass::Refused,
        }
    }

    fn store_if(settings: &Settings<Self>, code: GrpcCode) -> Option<bool> {
        (settings.transport.store_if.as_ref()).map(|predicate| predicate(code))
    }

    fn answered(code: Code) -> Answered {
        Answered::Grpc(code_name(grpc(code)))
    }

    // The codes gRPC's HTTP mapping gives a 5xx: a transaction the handler took is
    // rolled back for them, as for the HTTP layer's server errors.
    fn is_server_error(code: GrpcCode) -> bool {
        matches!(
            code,
            GrpcCode::Unknown
                | GrpcCode::Internal
                | GrpcCode::DataLoss
                | GrpcCode::Unimplemented
                | GrpcCode::Unavailable
                | GrpcCode::DeadlineExceeded
        )
    }

    fn encode(
        settings: &Settings<Self>,
        code: GrpcCode,
        complete: CompleteResponse<'_>,
    ) -> Classified {
        let CompleteResponse {
            parts,
            body,
            trailers,
        } = complete;
        match StoredCall::encode(&parts.headers, &settings.per_attempt, body, trailers) {
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

    fn replay<B>(_: &Settings<Self>, record: &Record, _: u64) -> Option<Response<Body<B>>> {
        // A record another transport wrote cannot be told here: not replayable.
        let (headers, data, trailers) = record
            .payload
            .as_ref()
            .filter(|payload| payload.format() == PayloadFormat::GRPC)
            .and_then(|payload| StoredCall::decode(payload.body()))?;
        let mut response = Response::new(Body::with_trailers(data, trailers.map(Box::new)));
        *response.headers_mut() = headers;
        Some(response)
    }

    fn kept(_: &Settings<Self>, _: &mut response::Parts, _: Option<SystemTime>) {}
}

/// A gRPC status code's canonical name, as `grpc-status` documents and logs spell it.
const fn code_name(code: GrpcCode) -> &'static str {
    match code {
        GrpcCode::Ok => "OK",
        GrpcCode::Cancelled => "CANCELLED",
        GrpcCode::Unknown => "UNKNOWN",
        GrpcCode::InvalidArgument => "INVALID_ARGUMENT",
        GrpcCode::DeadlineExceeded => "DEADLINE_EXCEEDED",
        GrpcCode::NotFound => "NOT_FOUND",
        GrpcCode::AlreadyExists => "ALREADY_EXISTS",
        GrpcCode::PermissionDenied => "PERMISSION_DENIED",
        GrpcCode::ResourceExhausted => "RESOURCE_EXHAUSTED",
        GrpcCode::FailedPrecondition => "FAILED_PRECONDITION",
        GrpcCode::Aborted => "ABORTED",
        GrpcCode::OutOfRange => "OUT_OF_RANGE",
        GrpcCode::Unimplemented => "UNIMPLEMENTED",
        GrpcCode::Internal => "INTERNAL",
        GrpcCode::Unavailable => "UNAVAILABLE",
        GrpcCode::DataLoss => "DATA_LOSS",
        GrpcCode::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// The gRPC status code a call refused with `code` is answered with.
pub(crate) fn grpc(code: Code) -> tonic::Code {
    tonic::Code::from_i32(code.grpc_status())
}
