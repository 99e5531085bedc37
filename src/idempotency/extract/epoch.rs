//! Where a request's control epoch comes from: an extension your control layer sets,
//! a header the client declares, or a function of yours.

use std::{fmt, marker::PhantomData};

use http::{HeaderName, Request};

use crate::idempotency::header::IDEMPOTENCY_EPOCH;

/// Reads the control epoch a request belongs to, binding its key to that epoch.
///
/// The epoch a key is first seen in is stored with its record; a later request with the
/// same key in another epoch is refused with `422 idempotency.epoch_mismatch`, never
/// replayed and never run. Set it from the server's current control epoch (an extension
/// your control layer puts on the request, [`EpochFromExtension`]) to refuse stale
/// retries that arrive after an epoch transition, or from a header the client sends
/// ([`EpochFromHeader`]) when clients derive their keys per epoch.
///
/// `Ok(None)` leaves the request unbound. Implemented for closures
/// `Fn(&Request<B>) -> Result<Option<u64>, EpochRejection>`.
pub trait ExtractEpoch<B> {
    /// The epoch of `request`.
    fn extract_epoch(&self, request: &Request<B>) -> Result<Option<u64>, EpochRejection>;
}

impl<B, F> ExtractEpoch<B> for F
where
    F: Fn(&Request<B>) -> Result<Option<u64>, EpochRejection>,
{
    fn extract_epoch(&self, request: &Request<B>) -> Result<Option<u64>, EpochRejection> {
        self(request)
    }
}

/// No epoch binding (the default).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoEpoch;

impl<B> ExtractEpoch<B> for NoEpoch {
    fn extract_epoch(&self, _request: &Request<B>) -> Result<Option<u64>, EpochRejection> {
        Ok(None)
    }
}

/// The epoch is a decimal `u64` in a header (default `idempotency-epoch`); absent means
/// unbound, anything but one decimal number is `400 idempotency.epoch_invalid`.
#[derive(Debug, Clone)]
pub struct EpochFromHeader(HeaderName);

impl EpochFromHeader {
    /// Reads the epoch from `name`.
    pub fn new(name: HeaderName) -> Self {
        Self(name)
    }
}

impl Default for EpochFromHeader {
    fn default() -> Self {
        Self(IDEMPOTENCY_EPOCH)
    }
}

impl<B> ExtractEpoch<B> for EpochFromHeader {
    fn extract_epoch(&self, request: &Request<B>) -> Result<Option<u64>, EpochRejection> {
        let mut values = request.headers().get_all(&self.0).iter();
        let Some(value) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(EpochRejection);
        }
        let text = value.to_str().map_err(|_| EpochRejection)?;
        if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
            return Err(EpochRejection);
        }
        text.parse().map(Some).map_err(|_| EpochRejection)
    }
}

/// The epoch is an extension a layer before this one put on the request, typically
/// the server's current control epoch.
pub struct EpochFromExtension<T>(PhantomData<fn() -> T>);

impl<T> EpochFromExtension<T> {
    /// Reads the epoch from the `T` extension.
    pub fn new() -> Self {
        Self(PhantomData)
    }
}

impl<T> Default for EpochFromExtension<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Clone for EpochFromExtension<T> {
    fn clone(&self) -> Self {
        Self::new()
    }
}

impl<T> fmt::Debug for EpochFromExtension<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("EpochFromExtension")
    }
}

impl<B, T> ExtractEpoch<B> for EpochFromExtension<T>
where
    T: Copy + Into<u64> + Send + Sync + 'static,
{
    fn extract_epoch(&self, request: &Request<B>) -> Result<Option<u64>, EpochRejection> {
        Ok(request.extensions().get::<T>().map(|epoch| (*epoch).into()))
    }
}

/// The request's epoch could not be read; the layer answers
/// `400 idempotency.epoch_invalid`.
#[derive(Debug, Clone, Copy)]
pub struct EpochRejection;

impl fmt::Display for EpochRejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the epoch must be one decimal number")
    }
}

impl std::error::Error for EpochRejection {}
