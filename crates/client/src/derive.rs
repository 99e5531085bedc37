//! Idempotency keys derived from what a request is, for deterministic callers.

use std::fmt;

use base64::{engine::general_purpose::URL_SAFE_NO_PAD, Engine as _};
use http::HeaderValue;
use sha2::{Digest, Sha256};

/// The domain-separation prefix of [`derive_key`]: a digest made for another purpose
/// from the same bytes can never equal a derived key. `v1` names this byte layout; a
/// new layout gets a new prefix.
pub const DERIVED_KEY_DOMAIN: &[u8] = b"tower-ids.idempotency-key.v1\0";

/// Derives an idempotency key from the computation, an epoch and the request's bytes:
/// a caller that replays the same work (a workflow step re-run after a crash, a
/// consumer re-processing a message) sends the same key without storing one.
///
/// The key is SHA-256 over [`DERIVED_KEY_DOMAIN`], then each field as an 8-byte
/// big-endian length followed by its bytes: `computation` (UTF-8), `epoch` (8 bytes,
/// big-endian), `request_bytes`. The length prefixes keep the fields apart: `("ab", "c")`
/// and `("a", "bc")` give different keys.
///
/// ```
/// use tower_ids_client::derive_key;
///
/// let body = br#"{"order":42,"amount_cents":1999}"#;
/// let key = derive_key("charge-card", 1, body);
/// assert_eq!(key, derive_key("charge-card", 1, body), "the same work, the same key");
/// assert_ne!(key, derive_key("charge-card", 2, body), "a new epoch is a new action");
/// assert_eq!(key.to_hex().len(), 64);
/// assert_eq!(key.to_base64url().len(), 43);
///
/// let request = http::Request::post("http://billing/charges")
///     .header("idempotency-key", key.to_header_value())
///     // When the server binds keys to epochs (`IdempotencyLayer::epoch` with
///     // `EpochFromHeader`), declare the epoch the key was derived in.
///     .header("idempotency-epoch", 1)
///     .body(http_body_util::Full::new(bytes::Bytes::from_static(body)))
///     .unwrap();
/// # let _ = request;
/// ```
///
/// # Trade-offs
///
/// - **A derived key cannot make a second, identical request.** Charging the same card
///   the same amount twice on purpose gives the same key, and the server replays the
///   first charge instead of running the second. Put what makes the second one
///   different into `epoch` (an attempt of the user's, a billing period, the version of
///   the record the request acts on) or into `computation`.
/// - **A predictable key is guessable.** Anyone who knows (or can enumerate) the inputs
///   can compute the key. When the server scopes keys by client (the idempotency
///   layer's [`client`](https://docs.rs/tower-ids/latest/tower_ids/idempotency/struct.IdempotencyLayer.html#method.client)), another client's
///   key names another entry and guessing it gains nothing. When it does not, another
///   caller who sends the key first makes your request a "duplicate" of theirs (it gets
///   `422`, or their response). Then mix a secret of your own into `computation`.
/// - **A new epoch is a new key.** A server that binds keys to control epochs
///   ([`IdempotencyLayer::epoch`](https://docs.rs/tower-ids/latest/tower_ids/idempotency/struct.IdempotencyLayer.html#method.epoch)) refuses
///   a key first seen in another epoch with `422 idempotency.epoch_mismatch`; derive
///   again with the current epoch rather than retrying.
/// - **The request bytes must be identical on every run**: serialise deterministically
///   (field order, no timestamps generated at send time), or derive from the logical
///   inputs rather than the encoded body.
pub fn derive_key(computation: &str, epoch: u64, request_bytes: &[u8]) -> DerivedKey {
    let mut hasher = Sha256::new();
    hasher.update(DERIVED_KEY_DOMAIN);
    for field in [computation.as_bytes(), &epoch.to_be_bytes(), request_bytes] {
        hasher.update((field.len() as u64).to_be_bytes());
        hasher.update(field);
    }
    DerivedKey(hasher.finalize().into())
}

/// An idempotency key made by [`derive_key`]: 32 bytes, sent as hex (64 characters) or
/// base64url (43); both are valid keys.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct DerivedKey([u8; 32]);

impl DerivedKey {
    /// The digest.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lowercase hex, 64 characters.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// base64url without padding, 43 characters.
    pub fn to_base64url(&self) -> String {
        URL_SAFE_NO_PAD.encode(self.0)
    }

    /// The hex form as a header value, for `Idempotency-Key`.
    pub fn to_header_value(&self) -> HeaderValue {
        HeaderValue::from_str(&self.to_hex()).expect("hex is a valid header value")
    }
}

/// The hex form.
impl fmt::Display for DerivedKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for DerivedKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("DerivedKey").field(&self.to_hex()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_kept_apart() {
        assert_ne!(derive_key("ab", 0, b"c"), derive_key("a", 0, b"bc"));
        assert_ne!(
            derive_key("a", 1, b""),
            derive_key("a", 0, b"\0\0\0\0\0\0\0\x01")
        );
        assert_ne!(derive_key("", 0, b""), derive_key("", 1, b""));
    }

    #[test]
    fn both_forms_are_valid_idempotency_keys() {
        let key = derive_key("x", 7, b"y");
        for text in [key.to_hex(), key.to_base64url()] {
            let parsed = tower_ids_core::IdempotencyKey::parse(text.as_bytes()).unwrap();
            assert_eq!(parsed.as_str(), text);
        }
        assert_eq!(key.to_string(), key.to_hex());
        assert_eq!(key.to_header_value(), key.to_hex().as_str());
    }
}
