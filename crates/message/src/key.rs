//! A message's key, what scopes it and what it must come with, and the extractors
//! that read them.

use std::fmt;

use sha2::{Digest, Sha256};

use tower_ids_core::{Fingerprint, IdempotencyKey, KeyRejection, ScopeKey};

/// What a message is deduplicated on: its idempotency key, the parts that scope it, and
/// the payload the key must always come with.
///
/// For a control signal deduplicated on `(swarmId, signal, idempotencyKey)`:
///
/// ```
/// use tower_ids_core::IdempotencyKey;
/// use tower_ids_message::MessageKey;
///
/// # fn main() -> Result<(), tower_ids_core::KeyRejection> {
/// let key = MessageKey::new(IdempotencyKey::new("a1c3-1111-2222-9f")?)
///     .scope("swarm-42")
///     .scope("swarm-start") // swarm-stop with the same key is another command
///     .fingerprint(br#"{}"#); // the signal's data: the same key with other data is refused
/// # let _ = key;
/// # Ok(())
/// # }
/// ```
///
/// Scope parts are hashed in order, each length-prefixed, with the key last, under a
/// prefix of their own: no two different lists of parts share a scope, and no message
/// scope is an HTTP request's.
#[derive(Clone)]
pub struct MessageKey {
    key: IdempotencyKey,
    scope: Sha256,
    fingerprint: Option<Sha256>,
}

impl MessageKey {
    /// Deduplicates on `key` alone, with an empty fingerprint (every message with the
    /// key is the same command).
    pub fn new(key: IdempotencyKey) -> Self {
        let mut scope = Sha256::new();
        scope.update(b"tower-ids.message-scope.v1\0");
        Self {
            key,
            scope,
            fingerprint: None,
        }
    }

    /// Adds `part` to what scopes the key (the swarm, the signal's type, the sender).
    pub fn scope(mut self, part: impl AsRef<[u8]>) -> Self {
        field(&mut self.scope, part.as_ref());
        self
    }

    /// Adds `part` to what the key must come with: a later message with the key and
    /// another fingerprint is refused (`idempotency.fingerprint_mismatch`), never run
    /// and never given the first one's outcome.
    pub fn fingerprint(mut self, part: impl AsRef<[u8]>) -> Self {
        let digest = self.fingerprint.get_or_insert_with(|| {
            let mut digest = Sha256::new();
            digest.update(b"tower-ids.message-fingerprint.v1\0");
            digest
        });
        field(digest, part.as_ref());
        self
    }

    /// The idempotency key.
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    pub(super) fn scope_key(&self) -> ScopeKey {
        let mut scope = self.scope.clone();
        scope.update(b"key\0");
        field(&mut scope, self.key.as_str().as_bytes());
        ScopeKey::from_bytes(scope.finalize().into())
    }

    pub(super) fn fingerprint_digest(&self) -> Fingerprint {
        let digest = self.fingerprint.clone().unwrap_or_else(|| {
            let mut digest = Sha256::new();
            digest.update(b"tower-ids.message-fingerprint.v1\0");
            digest
        });
        Fingerprint::from_bytes(digest.finalize().into())
    }
}

fn field(digest: &mut Sha256, bytes: &[u8]) {
    digest.update((bytes.len() as u64).to_be_bytes());
    digest.update(bytes);
}

impl fmt::Debug for MessageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MessageKey")
            .field("key", &self.key)
            .field("scope", &self.scope_key())
            .finish_non_exhaustive()
    }
}

/// Reads what a message is deduplicated on.
///
/// `Ok(None)` for a message without a key (run without deduplication, or refused with
/// [`require_key`](super::MessageIdempotencyLayer::require_key)); `Err` refuses it
/// ([`Handled::Refused`](super::Handled::Refused), not to be requeued). Implemented for
/// closures `Fn(&M) -> Result<Option<MessageKey>, KeyRejection>`.
pub trait ExtractMessageKey<M>: Send + Sync + 'static {
    /// The key of `message`.
    fn extract_key(&self, message: &M) -> Result<Option<MessageKey>, KeyRejection>;
}

impl<M, F> ExtractMessageKey<M> for F
where
    F: Fn(&M) -> Result<Option<MessageKey>, KeyRejection> + Send + Sync + 'static,
{
    fn extract_key(&self, message: &M) -> Result<Option<MessageKey>, KeyRejection> {
        self(message)
    }
}

/// The extractor of a layer not told where keys are: every message is without a key
/// (run without deduplication, or refused with
/// [`require_key`](super::MessageIdempotencyLayer::require_key)). Set one with
/// [`key`](super::MessageIdempotencyLayer::key).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoMessageKey;

impl<M> ExtractMessageKey<M> for NoMessageKey {
    fn extract_key(&self, _message: &M) -> Result<Option<MessageKey>, KeyRejection> {
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(text: &str) -> IdempotencyKey {
        IdempotencyKey::new(text).unwrap()
    }

    #[test]
    fn parts_scope_the_key_in_order() {
        let start = MessageKey::new(key("k"))
            .scope("swarm-42")
            .scope("swarm-start");
        let stop = MessageKey::new(key("k"))
            .scope("swarm-42")
            .scope("swarm-stop");
        let again = MessageKey::new(key("k"))
            .scope("swarm-42")
            .scope("swarm-start");
        assert_ne!(start.scope_key(), stop.scope_key());
        assert_eq!(start.scope_key(), again.scope_key());
        // Length prefixes: ("ab", "c") is not ("a", "bc").
        let ab = MessageKey::new(key("k")).scope("ab").scope("c");
        let bc = MessageKey::new(key("k")).scope("a").scope("bc");
        assert_ne!(ab.scope_key(), bc.scope_key());
    }

    #[test]
    fn the_fingerprint_is_the_payload() {
        let a = MessageKey::new(key("k")).fingerprint("{}");
        let b = MessageKey::new(key("k")).fingerprint("{\"n\":1}");
        assert_ne!(a.fingerprint_digest(), b.fingerprint_digest());
        assert_eq!(a.scope_key(), b.scope_key());
    }

    #[test]
    fn a_key_travels_in_message_headers() {
        let mut headers = http::HeaderMap::new();
        assert!(IdempotencyKey::from_carrier(&headers).unwrap().is_none());
        key("\"quoted\"").inject(&mut headers);
        let read = IdempotencyKey::from_carrier(&headers).unwrap().unwrap();
        assert_eq!(read.as_str(), "\"quoted\"", "taken as it is");
    }
}
