//! The gRPC transport's settings: the storage rule over codes, and the layer's way
//! from HTTP to gRPC.

use std::{fmt, sync::Arc};

use tonic::Code;

use crate::idempotency::{
    adapter::{Idempotency, IdempotencyLayer},
    client::NoClient,
    http::{Http, NoEpoch},
    store::MokaStore,
};

/// The idempotency layer for unary tonic calls: [`IdempotencyLayer`] with the gRPC
/// transport, made by [`IdempotencyLayer::for_grpc`]. See the [module docs](super).
pub type GrpcIdempotencyLayer<St = MokaStore, C = NoClient> =
    IdempotencyLayer<St, C, NoEpoch, Grpc>;

/// The middleware [`GrpcIdempotencyLayer`] applies: [`Idempotency`] with the gRPC
/// transport.
pub type GrpcIdempotency<S, St = MokaStore, C = NoClient> = Idempotency<S, St, C, NoEpoch, Grpc>;

type StorePredicate = Arc<dyn Fn(Code) -> bool + Send + Sync>;

/// The gRPC transport of [`IdempotencyLayer`] and [`Idempotency`]: the key from the
/// call's `idempotency-key` metadata, the call's code as its status, every refusal a
/// `tonic::Status` with `google.rpc` details.
#[derive(Clone, Default)]
pub struct Grpc {
    /// Overrides the policy's [`StorageRule`](crate::idempotency::StorageRule) when set.
    pub(super) store_if: Option<StorePredicate>,
}

impl fmt::Debug for Grpc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Grpc")
            .field("store_if", &self.store_if.is_some())
            .finish()
    }
}

impl<St, C> IdempotencyLayer<St, C, NoEpoch, Http> {
    /// This layer for unary gRPC calls, as `tonic::transport::Server::builder().layer(..)`
    /// takes it: the key from `idempotency-key` metadata, statuses for answers. It keeps
    /// the store, the policy, the client and the settings every transport has (set them
    /// before or after); the HTTP ones (methods, key extractors, replay hooks) are left
    /// behind. See the [gRPC module](crate::idempotency::grpc).
    ///
    /// ```
    /// use tower_ids::idempotency::{grpc::GrpcIdempotencyLayer, IdempotencyLayer};
    ///
    /// let layer: GrpcIdempotencyLayer = IdempotencyLayer::new().for_grpc().require_key(true);
    /// # let _ = layer;
    /// ```
    pub fn for_grpc(self) -> GrpcIdempotencyLayer<St, C> {
        let settings = Arc::unwrap_or_clone(self.settings);
        IdempotencyLayer {
            engine: self.engine,
            identify: self.identify,
            epoch: NoEpoch,
            settings: Arc::new(crate::idempotency::adapter::Settings {
                require_key: settings.require_key,
                require_client: settings.require_client,
                max_request_bytes: settings.max_request_bytes,
                max_response_bytes: settings.max_response_bytes,
                budget: settings.budget,
                per_attempt: settings.per_attempt,
                layer_order: settings.layer_order,
                transport: Grpc::default(),
            }),
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
