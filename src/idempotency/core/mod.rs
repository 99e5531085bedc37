//! The deduplication engine every transport shares.
//!
//! An adapter (the HTTP layer, the message layer) turns its request into a scope, a
//! fingerprint and an optional epoch, asks [`Engine::decide`] what to do, and
//! translates the [`Decision`] into its transport's answer; nothing else. The engine
//! owns the store, the outcomes kept for it, the lease and its renewal, the one
//! completion path ([`Claimed`]), and every event and metric of the decision, so a
//! fix or a metric lands once for every transport.

mod claimed;
mod detach;
mod drain;
mod engine;
mod kept;
mod lease;
pub(crate) mod observe;
pub(crate) mod refusal;
mod replay;
mod settings;
#[cfg(test)]
mod tests;
mod transient;

#[cfg(any(feature = "amqp", feature = "kafka", feature = "outbox"))]
pub(crate) use self::drain::InHand;
pub use self::drain::{Drain, Drained, Stopped};
pub use self::replay::ReplayInfo;
pub use self::settings::{
    InFlight, Policy, PolicyError, StorageRule, StoreFailure, DEFAULT_LEASE,
    DEFAULT_MAX_KEPT_BYTES, DEFAULT_RETRY_AFTER, DEFAULT_TTL,
};
pub(crate) use self::{
    claimed::{Claimed, Classified, Classifying, Failure, Finished, Unsettled},
    detach::{ClaimFlag, Detaching},
    engine::{replay_failed, Decision, Engine, Verdict},
    lease::Release,
    settings::OutcomeClass,
};
