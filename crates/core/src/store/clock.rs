//! The time a store reads to decide expiry.

use std::time::SystemTime;
#[cfg(any(test, feature = "test-util"))]
use std::{
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

/// The time the store reads to decide expiry; injectable so tests need not sleep.
pub trait Clock: Send + Sync + 'static {
    /// Now.
    fn now(&self) -> SystemTime;
}

/// The system clock.
#[derive(Debug, Clone, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> SystemTime {
        SystemTime::now()
    }
}

/// A clock that moves only when told to, for tests of TTL and leases (feature
/// `test-util`).
#[cfg(any(test, feature = "test-util"))]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
#[derive(Debug, Clone)]
pub struct ManualClock(Arc<Mutex<SystemTime>>);

#[cfg(any(test, feature = "test-util"))]
impl ManualClock {
    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) += by;
    }
}

#[cfg(any(test, feature = "test-util"))]
impl Default for ManualClock {
    /// A clock stopped at the current system time.
    fn default() -> Self {
        Self(Arc::new(Mutex::new(SystemTime::now())))
    }
}

#[cfg(any(test, feature = "test-util"))]
impl Clock for ManualClock {
    fn now(&self) -> SystemTime {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
