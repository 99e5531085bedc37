//! The core of tower-ids' idempotency layers, whatever the transport and the store:
//! the keys and their scope, the codes every refusal carries, the policy, the drain,
//! the store trait with its records, and the engine that runs each keyed request once.
//!
//! Most users never name this crate: `tower-ids` re-exports all of it under
//! `tower_ids::idempotency`, beside the HTTP, gRPC and message layers. A store's author
//! implements [`store::IdempotencyStore`] (and checks it against the store contract,
//! feature `test-util`); an adapter's author hands its requests to the engine.
//!
//! It depends on no web framework, database, broker or cache.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod code;
#[doc(hidden)]
pub mod engine;
pub mod header;
mod key;
mod rejection;
mod scope;
pub mod store;

#[doc(hidden)]
pub use self::code::event;
// The defaults, for the workspace's crates: users read them in the setters' docs.
#[doc(hidden)]
pub use self::engine::{
    DEFAULT_LEASE, DEFAULT_MAX_KEPT_BYTES, DEFAULT_MAX_RESPONSE_BYTES, DEFAULT_RETRY_AFTER,
    DEFAULT_TTL,
};
pub use self::{
    code::Code,
    engine::{
        observe::field, Drain, Drained, InFlight, Policy, PolicyError, ReplayInfo, Stopped,
        StorageRule, StoreFailure,
    },
    key::{AttemptId, IdempotencyKey},
    rejection::KeyRejection,
    scope::ClientId,
};
// The names every part of the engine and the stores use, at one path (the public one is
// `store::`).
#[doc(hidden)]
pub use self::scope::{Fingerprint, ScopeKey};

pub mod metrics {
    //! The names of the idempotency layers' metrics (feature `metrics`, on the
    //! [`metrics`](https://docs.rs/metrics) facade), and [`describe`] for their help
    //! texts. `tower_ids::idempotency`'s docs list what each counts.
    #![cfg_attr(not(feature = "metrics"), doc = "", doc = "[`describe`]: self")]

    #[cfg(feature = "metrics")]
    pub use crate::engine::observe::describe;
    pub use crate::engine::observe::{
        RELEASED, REQUESTS, REQUESTS_IN_FLIGHT, STORE_CALL_DURATION, STORE_FAILURES,
    };
}
