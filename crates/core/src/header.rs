//! The header names the idempotency layers read and write, as `http::header` lists
//! the standard ones. The [module docs](crate#headers) say which goes
//! on what.

use http::HeaderName;

/// `Idempotency-Key`, the IETF draft's header.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// `X-Idempotency-Key`, accepted too, as older clients send it.
pub const X_IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("x-idempotency-key");

/// `Attempt-Id`: the client's name for one attempt; echoed, never part of deduplication.
pub const ATTEMPT_ID: HeaderName = HeaderName::from_static("attempt-id");

/// `idempotent-replayed`: `true` on a replay, `false` on every other response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// `idempotency-first-seen`: when the original request arrived, as an HTTP-date.
pub const IDEMPOTENCY_FIRST_SEEN: HeaderName = HeaderName::from_static("idempotency-first-seen");

/// `idempotency-expires`: when the stored response expires and the key runs again, as
/// an HTTP-date; on first answers and replays of a route that opts in with
/// `IdempotencyLayer::expiry_header`. No standard
/// names this yet (the IETF draft's issue 35 discusses one); the name follows
/// `Expires` and this crate's `idempotency-first-seen`.
pub const IDEMPOTENCY_EXPIRES: HeaderName = HeaderName::from_static("idempotency-expires");

/// `idempotency-request-count`: requests seen with this key, this one included.
pub const IDEMPOTENCY_REQUEST_COUNT: HeaderName =
    HeaderName::from_static("idempotency-request-count");

/// `original-attempt-id`: on a replay, the attempt ID of the request that ran (else
/// its correlation ID).
pub const ORIGINAL_ATTEMPT_ID: HeaderName = HeaderName::from_static("original-attempt-id");

/// `idempotency-epoch`: the default header of
/// `EpochFromHeader`.
pub const IDEMPOTENCY_EPOCH: HeaderName = HeaderName::from_static("idempotency-epoch");
