//! The HTTP transport: which requests a layer covers, what a refusal and a replay are
//! (`transport`, what the adapter asks of HTTP), the settings the layer's HTTP setters
//! fill in (`settings`), and a response kept and given back (`stored`, `replay`).

#[cfg(test)]
mod budget_tests;
mod replay;
mod settings;
mod stored;
mod transport;

pub use self::{
    replay::{JsonReplayMarker, OnReplay},
    settings::Http,
};
#[cfg(all(feature = "postgres", feature = "axum"))]
pub use tower_ids_postgres::TransactionRejection;
