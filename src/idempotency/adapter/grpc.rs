//! The gRPC transport's constructors and setters on the layer.

use std::sync::Arc;

use tonic::Code;

use super::{Idempotency, IdempotencyLayer};
use crate::idempotency::{
    extract::{NoClient, NoEpoch},
    grpc::Grpc,
    store::MokaStore,
};

/// The idempotency layer for unary tonic calls: [`IdempotencyLayer`] with the gRPC
/// transport, made by [`IdempotencyLayer::new_for_grpc`] (or
/// [`for_grpc`](IdempotencyLayer::for_grpc) from a layer over another store). See the
/// [module docs](crate::idempotency::grpc).
pub type GrpcIdempotencyLayer<St = MokaStore, C = NoClient> =
    IdempotencyLayer<St, C, NoEpoch, Grpc>;

/// The middleware [`GrpcIdempotencyLayer`] applies: [`Idempotency`] with the gRPC
/// transport.
pub type GrpcIdempotency<S, St = MokaStore, C = NoClient> = Idempotency<S, St, C, NoEpoch, Grpc>;

impl IdempotencyLayer<MokaStore, NoClient, NoEpoch, Grpc> {
    /// A layer for unary gRPC calls, as `tonic::transport::Server::builder().layer(..)`
    /// takes it, with its own in-memory store ([`MokaStore::new`]) and the defaults:
    /// the key from `idempotency-key` metadata, statuses for answers. See the
    /// [gRPC module](crate::idempotency::grpc).
    ///
    /// ```
    /// use tower_ids::idempotency::{grpc::GrpcIdempotencyLayer, IdempotencyLayer};
    ///
    /// let layer: GrpcIdempotencyLayer = IdempotencyLayer::new_for_grpc().require_key(true);
    /// # let _ = layer;
    /// ```
    pub fn new_for_grpc() -> Self {
        Self::over(Arc::new(MokaStore::new()), Grpc::default())
    }
}

impl<St, C, E> IdempotencyLayer<St, C, E> {
    /// This layer for unary gRPC calls, with its store, policy, client and the settings
    /// every transport has (set them before or after); the HTTP ones (methods, key
    /// extractors, the epoch, replay hooks) are left behind.
    ///
    /// ```
    /// use tower_ids::idempotency::{grpc::GrpcIdempotencyLayer, IdempotencyLayer, MokaStore};
    ///
    /// let store = MokaStore::builder().max_bytes(16 << 20).build();
    /// let layer: GrpcIdempotencyLayer = IdempotencyLayer::with_store(store).for_grpc();
    /// # let _ = layer;
    /// ```
    pub fn for_grpc(self) -> GrpcIdempotencyLayer<St, C> {
        IdempotencyLayer {
            engine: self.engine,
            identify: self.identify,
            epoch: NoEpoch,
            settings: Arc::new(Arc::unwrap_or_clone(self.settings).with_transport(Grpc::default())),
        }
    }
}

/// The gRPC transport's own settings.
impl<St, C> GrpcIdempotencyLayer<St, C> {
    /// Which calls are stored, when the policy's [`StorageRule`](crate::idempotency::StorageRule) is not the rule this
    /// service needs: `predicate` is given each call's code and overrides the rule.
    pub fn store_if(mut self, predicate: impl Fn(Code) -> bool + Send + Sync + 'static) -> Self {
        self.settings().transport.store_if = Some(Arc::new(predicate));
        self
    }
}
