//! What a duplicate learns of the request that ran, whatever its transport.

use std::time::SystemTime;

use crate::{store::Record, AttemptId};

/// What a duplicate learns of the request that ran, for a replay hook of the HTTP layer
/// (`OnReplay`) and the message layer's replays.
#[derive(Debug, Clone)]
pub struct ReplayInfo {
    pub request_count: u64,
    pub first_seen: SystemTime,
    pub original_attempt: Option<AttemptId>,
    pub expires_at: Option<SystemTime>,
}

impl ReplayInfo {
    /// What `record`, seen by `request_count` requests, tells a duplicate.
    pub fn of(record: &Record, request_count: u64) -> Self {
        Self {
            request_count,
            first_seen: record.first_seen,
            original_attempt: record.original_attempt.clone(),
            expires_at: record.expires_at,
        }
    }

    /// Requests (or deliveries) seen with this key, this one included.
    pub fn request_count(&self) -> u64 {
        self.request_count
    }

    /// When the request that ran arrived.
    pub fn first_seen(&self) -> SystemTime {
        self.first_seen
    }

    /// The attempt ID of the request that ran, if it sent one (for messages, the
    /// correlation ID of the delivery that ran).
    pub fn original_attempt(&self) -> Option<&AttemptId> {
        self.original_attempt.as_ref()
    }

    /// When the store lets the record go (and the key runs again): its TTL from when it
    /// was stored. `None` for a record that does not say.
    pub fn expires_at(&self) -> Option<SystemTime> {
        self.expires_at
    }
}
