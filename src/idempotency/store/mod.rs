//! Where the idempotency layer keeps its records: the [`IdempotencyStore`] trait (from
//! `tower-ids-core`) and its implementations, [`MokaStore`] embedded, `RedisStore`
//! (feature `redis`) and `PostgresStore` (feature `postgres`).

#[doc(inline)]
pub use tower_ids_core::store::*;

pub use tower_ids_moka::{MokaStore, MokaStoreBuilder};
#[cfg(feature = "postgres")]
pub use tower_ids_postgres::{
    is_transient, PostgresMode, PostgresStore, PostgresStoreBuilder, Transaction, TransactionError,
    TransactionGuard,
};
// A default the fault tests wait out; users read it in the builder's docs.
#[cfg(feature = "postgres")]
#[doc(hidden)]
pub use tower_ids_postgres::DEFAULT_POSTGRES_COMMAND_TIMEOUT;
#[cfg(feature = "redis")]
pub use tower_ids_redis::{RedisStore, RedisStoreBuilder};

/// The engine every layer of this crate runs over `store`: it also counts the
/// database's passing faults in a handler's error as passing (with feature `postgres`,
/// whatever the store: a handler may write with sqlx beside any store).
pub(crate) fn engine_over<St: IdempotencyStore>(
    store: std::sync::Arc<St>,
) -> crate::idempotency::core::Engine<St> {
    #[allow(unused_mut)]
    let mut engine = crate::idempotency::core::Engine::new(store);
    #[cfg(feature = "postgres")]
    engine.recognise_transient(tower_ids_postgres::passing_fault);
    engine
}
