//! The deduplication engine every transport shares.
//!
//! An adapter (the HTTP and gRPC layer, the message layer) turns its request into a
//! scope, a fingerprint and an optional epoch ([`Keyed`]), hands [`Engine::handle`] its
//! handler ([`Exchange`]) and what of its output is kept ([`Classify`]), and renders
//! the [`Resolution`] it gets back; nothing else. The engine owns the decision, the
//! store, the outcomes kept for it, the lease and its renewal, the one completion path,
//! the answers' text ([`Answer`]), and every event and metric, so a fix, a refusal's
//! wording or a metric lands once for every transport.

mod answer;
mod claimed;
mod decide;
mod detach;
mod drain;
mod handle;
mod kept;
mod lease;
pub mod observe;
pub mod refusal;
mod replay;
mod settings;
#[cfg(test)]
mod tests;
mod transient;

pub use self::drain::InHand;
pub use self::drain::{Drain, Drained, Stopped};
pub use self::replay::ReplayInfo;
pub use self::settings::{
    InFlight, Policy, PolicyError, StorageRule, StoreFailure, DEFAULT_LEASE,
    DEFAULT_MAX_KEPT_BYTES, DEFAULT_MAX_RESPONSE_BYTES, DEFAULT_RETRY_AFTER, DEFAULT_TTL,
};
pub use self::{
    answer::Answer,
    claimed::{Classified, Classify, Classifying},
    decide::{replay_failed, Engine},
    detach::{ClaimFlag, Detaching},
    handle::{Exchange, Keyed, Resolution},
    lease::Release,
    settings::OutcomeClass,
};
