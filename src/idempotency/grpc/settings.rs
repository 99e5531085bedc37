//! The gRPC transport's settings: the storage rule over codes.

use std::{fmt, sync::Arc};

use tonic::Code;

type StorePredicate = Arc<dyn Fn(Code) -> bool + Send + Sync>;

/// The gRPC transport of [`IdempotencyLayer`](crate::idempotency::IdempotencyLayer) and
/// [`Idempotency`](crate::idempotency::Idempotency): the key from the call's
/// `idempotency-key` metadata, the call's code as its status, every refusal a
/// `tonic::Status` with `google.rpc` details.
#[derive(Clone, Default)]
pub struct Grpc {
    /// Overrides the policy's [`StorageRule`](crate::idempotency::StorageRule) when set.
    pub(crate) store_if: Option<StorePredicate>,
}

impl fmt::Debug for Grpc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Grpc")
            .field("store_if", &self.store_if.is_some())
            .finish()
    }
}
