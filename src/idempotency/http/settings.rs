//! The HTTP transport's settings, which the layer's HTTP setters fill in.

use std::{fmt, sync::Arc};

use http::{header, HeaderName, Method, StatusCode};

use super::replay::OnReplay;
use crate::idempotency::extract::{key::KeyFromHeader, ExtractKey};

type StorePredicate = Arc<dyn Fn(StatusCode) -> bool + Send + Sync>;

/// The HTTP transport of [`IdempotencyLayer`](crate::idempotency::IdempotencyLayer) and [`Idempotency`](crate::idempotency::Idempotency),
/// the default: its settings, set with the layer's HTTP setters (which requests it
/// covers, where their key comes from, what a replay carries).
#[derive(Clone)]
pub struct Http {
    pub(crate) key: Arc<dyn ExtractKey>,
    pub(crate) on_replay: Option<Arc<dyn OnReplay>>,
    pub(crate) expiry_header: bool,
    pub(crate) methods: Vec<Method>,
    pub(crate) include_query: bool,
    pub(crate) not_replayed: Vec<HeaderName>,
    /// Overrides the policy's [`StorageRule`](crate::idempotency::StorageRule) when set.
    pub(crate) store_if: Option<StorePredicate>,
    /// The base of problem types, when not [`IDEMPOTENCY_PROBLEM_DOCS`](crate::IDEMPOTENCY_PROBLEM_DOCS).
    pub(crate) problem_docs: Option<Arc<str>>,
}

impl fmt::Debug for Http {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Http")
            .field("methods", &self.methods)
            .field("include_query", &self.include_query)
            .field("expiry_header", &self.expiry_header)
            .finish_non_exhaustive()
    }
}

impl Default for Http {
    fn default() -> Self {
        Self {
            key: Arc::new(KeyFromHeader::default()),
            on_replay: None,
            expiry_header: false,
            methods: vec![Method::POST, Method::PATCH],
            include_query: false,
            not_replayed: vec![header::SET_COOKIE],
            store_if: None,
            problem_docs: None,
        }
    }
}
