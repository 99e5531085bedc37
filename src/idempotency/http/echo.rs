//! The idempotency key of the request the layer is answering, for everything that
//! answers it: the `idempotency_key` member of its problem details and the
//! `Idempotency-Key` header echoed on its response.
//!
//! The key is current on this thread while the layer's code for its request runs: in
//! `call` from the moment the key is read ([`KeyScope::enter`]) and in every poll of the
//! request's response future. A thread-local rather than a parameter, so the places
//! that build answers stay as they are; it never outlives the code that set it, so it
//! cannot leak from one request to another on the same thread.

use std::cell::RefCell;

use http::{header::Entry, Response};

use crate::idempotency::{IdempotencyKey, IDEMPOTENCY_KEY};

thread_local! {
    static CURRENT: RefCell<Option<IdempotencyKey>> = const { RefCell::new(None) };
}

/// The key of the request the idempotency layer is answering on this thread, if any.
pub(crate) fn current_key() -> Option<IdempotencyKey> {
    CURRENT.with(|current| current.borrow().clone())
}

/// Makes a key current until dropped, then puts back the one it replaced.
pub(super) struct KeyScope {
    previous: Option<IdempotencyKey>,
}

impl KeyScope {
    pub(super) fn enter(key: Option<&IdempotencyKey>) -> Self {
        let previous = CURRENT.with(|current| current.replace(key.cloned()));
        Self { previous }
    }
}

impl Drop for KeyScope {
    fn drop(&mut self) {
        let previous = self.previous.take();
        CURRENT.with(|current| *current.borrow_mut() = previous);
    }
}

/// Echoes `key` on the response as `Idempotency-Key`, unless the handler set that
/// header itself.
pub(super) fn echo<B>(response: &mut Response<B>, key: &IdempotencyKey) {
    if let Entry::Vacant(entry) = response.headers_mut().entry(IDEMPOTENCY_KEY) {
        entry.insert(key.to_header_value());
    }
}
