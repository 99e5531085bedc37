//! Collecting a body whole within a byte limit and a shared byte budget: a request's,
//! to fingerprint it and hand it on unchanged, and a response's, to store it. What the
//! HTTP and gRPC adapters share of their bodies.

mod budget;

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body_util::BodyExt;

pub(crate) use self::budget::{Budget, Reservation};

/// The error type the bodies read here are boxed to.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What reading a request body came to.
pub(crate) enum Read {
    Complete(Bytes),
    TooLarge,
    /// The budget could not take the `requested` bytes the body needed in all.
    Overloaded {
        requested: usize,
    },
    /// The body's error, as text: the body's error type need not be `Send`.
    Failed(String),
}

/// Reads `body` whole if it fits in `max` bytes, holding in `reservation` the bytes it
/// keeps: `declared` up front when the length is known; otherwise the first frame,
/// kept as it came, then the buffer the frames are copied into, grown by doubling (a
/// buffer of the declared length when there is one).
///
/// While a frame or a smaller buffer is copied into a bigger one, both are alive for
/// that copy only; the copy never awaits, so at most one is under way per thread.
pub(crate) async fn read_within<B>(
    mut body: B,
    max: usize,
    declared: Option<usize>,
    reservation: &mut Reservation,
) -> Read
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let declared_len = declared.unwrap_or(0);
    // Never less than the declared length, which is held up front.
    let take = |reservation: &mut Reservation, bytes: usize| {
        let bytes = bytes.max(declared_len);
        reservation
            .grow_to(bytes)
            .map_err(|_| Read::Overloaded { requested: bytes })
    };
    if let Err(overloaded) = take(reservation, declared_len) {
        return overloaded;
    }
    let mut first: Option<Bytes> = None;
    let mut buffer: Option<Vec<u8>> = None;
    let mut len = 0usize;
    while let Some(data) = next_data(&mut body).await {
        let data = match data {
            Ok(data) => data,
            Err(error) => return Read::Failed(error),
        };
        if data.is_empty() {
            continue;
        }
        len += data.len();
        if len > max {
            return Read::TooLarge;
        }
        match (&first, &mut buffer) {
            (None, None) => {
                if let Err(overloaded) = take(reservation, len) {
                    return overloaded;
                }
                first = Some(data);
            }
            (_, Some(kept)) if kept.capacity() - kept.len() >= data.len() => {
                kept.extend_from_slice(&data);
            }
            _ => {
                let previous = first.take();
                let old: &[u8] = match (&previous, &buffer) {
                    (Some(frame), _) => frame,
                    (None, Some(kept)) => kept,
                    (None, None) => &[],
                };
                let capacity = if declared_len >= len {
                    declared_len
                } else {
                    len.max(old.len() * 2).min(max)
                };
                if let Err(overloaded) = take(reservation, capacity) {
                    return overloaded;
                }
                let mut bigger = Vec::with_capacity(capacity);
                bigger.extend_from_slice(old);
                bigger.extend_from_slice(&data);
                buffer = Some(bigger);
            }
        }
    }
    if declared.is_some_and(|declared| declared != len) {
        return Read::Failed(format!(
            "the body is {len} bytes long, its Content-Length {declared_len}"
        ));
    }
    let (bytes, held) = match buffer {
        Some(mut kept) => {
            // Held until the work ends: no more than the body (shrinking is in place).
            kept.shrink_to_fit();
            let capacity = kept.capacity();
            (Bytes::from(kept), capacity)
        }
        None => (first.unwrap_or_default(), len),
    };
    reservation.shrink_to(held);
    Read::Complete(bytes)
}

/// A handler's response body, as read for storing.
pub(crate) enum Collected<B> {
    /// Every data frame, and the trailers if it had any (a gRPC status; the HTTP layer
    /// neither keeps nor forwards them).
    Complete {
        body: Bytes,
        /// Boxed: most bodies have none, and this enum is moved on every request.
        #[cfg_attr(not(feature = "grpc"), allow(dead_code))]
        trailers: Option<Box<HeaderMap>>,
    },
    TooLarge {
        prefix: Bytes,
        rest: B,
    },
    /// The body's error, as text: the body's error type need not be `Send`.
    Failed(String),
}

/// Reads `body` whole, trailers included, if its data fits in `max` bytes; a
/// single-frame body is kept without a copy.
pub(crate) async fn collect_up_to<B>(mut body: B, max: usize) -> Collected<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let mut first: Option<Bytes> = None;
    let mut joined: Option<BytesMut> = None;
    let mut trailers: Option<Box<HeaderMap>> = None;
    let mut len = 0usize;
    while let Some(frame) = body.frame().await {
        let data = match frame.map(http_body::Frame::into_data) {
            Ok(Ok(data)) => data,
            Ok(Err(frame)) => {
                if let Ok(more) = frame.into_trailers() {
                    trailers.get_or_insert_default().extend(more);
                }
                continue;
            }
            Err(error) => return Collected::Failed(error.into().to_string()),
        };
        len += data.len();
        if len > max {
            let mut prefix =
                joined.unwrap_or_else(|| BytesMut::from(first.take().unwrap_or_default()));
            prefix.extend_from_slice(&data);
            return Collected::TooLarge {
                prefix: prefix.freeze(),
                rest: body,
            };
        }
        match (&mut first, &mut joined) {
            (None, None) => first = Some(data),
            (Some(_), None) => {
                let mut buf = BytesMut::from(first.take().unwrap_or_default());
                buf.extend_from_slice(&data);
                joined = Some(buf);
            }
            (_, Some(buf)) => buf.extend_from_slice(&data),
        }
    }
    Collected::Complete {
        body: joined.map_or_else(|| first.unwrap_or_default(), BytesMut::freeze),
        trailers,
    }
}

/// The next data frame of `body`; trailers are skipped (the fingerprint and replays
/// cover the body only), and an error is kept as text (the body's error type need not
/// be `Send`).
async fn next_data<B>(body: &mut B) -> Option<Result<Bytes, String>>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    loop {
        match body.frame().await? {
            Ok(frame) => match frame.into_data() {
                Ok(data) => return Some(Ok(data)),
                Err(_trailers) => continue,
            },
            Err(error) => return Some(Err(error.into().to_string())),
        }
    }
}
