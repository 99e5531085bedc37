//! The customisation points of the HTTP layer, for a key, a client or an epoch
//! read your own way: the traits, what they return, and the defaults that read
//! nothing. The extractors the crate ships ([`KeyFromHeader`], [`KeyFromJson`],
//! [`ClientFromHeader`], ...) are at the [top of the module](crate::idempotency).
//!
//! [`KeyFromHeader`]: crate::idempotency::KeyFromHeader
//! [`KeyFromJson`]: crate::idempotency::KeyFromJson
//! [`ClientFromHeader`]: crate::idempotency::ClientFromHeader

// Where a call's key, client and epoch come from, for every transport: the adapter and
// the transports read them here.
pub(super) mod client;
pub(super) mod epoch;
pub(super) mod key;

pub use self::{
    client::{ClientRejection, IdentifyClient, IntoClientIdentity, NoClient},
    epoch::{EpochRejection, ExtractEpoch, NoEpoch},
    key::{ExtractKey, ExtractedKey, IntoExtractedKey},
};
pub use tower_ids_core::KeyRejection;
