//! How the HTTP layer keeps a response in a record: its status as the payload's status,
//! its headers (in order, repeats kept) as the payload's head, its body as the body.

use std::{any::Any, borrow::Cow};

use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};

use crate::idempotency::store::{Payload, PayloadFormat};

/// A response kept for replay: status, every header in order (repeats kept), body.
#[derive(Debug, Clone)]
pub(super) struct StoredResponse {
    pub(super) status: StatusCode,
    pub(super) headers: Vec<(HeaderName, HeaderValue)>,
    pub(super) body: Bytes,
}

impl StoredResponse {
    /// The payload a record keeps of this response, holding the response itself
    /// (weighed with it), so that a replay from a store in this process decodes nothing;
    /// its head is encoded only when a store asks for it.
    pub(super) fn into_payload(self) -> Payload {
        let (status, body, bytes) = (self.status.as_u16(), self.body.clone(), self.weight());
        Payload::from_decoded(PayloadFormat::HTTP, status, body, self, bytes, encode_head)
    }

    /// The bytes it holds beyond the body (which it shares with the payload): itself in
    /// its shared allocation, its headers' slots (as many as allocated), and per header
    /// its name, its value and the value's share of a buffer it may hold with others.
    fn weight(&self) -> usize {
        const SHARED_BUFFER: usize = 4 * std::mem::size_of::<usize>();
        let slot = std::mem::size_of::<(HeaderName, HeaderValue)>();
        let arc = 2 * std::mem::size_of::<usize>();
        arc + std::mem::size_of::<Self>()
            + self.headers.capacity() * slot
            + self
                .headers
                .iter()
                .map(|(name, value)| name.as_str().len() + value.len() + SHARED_BUFFER)
                .sum::<usize>()
    }

    /// The response `payload` keeps: as the layer kept it with the payload, else
    /// decoded from its bytes; `None` if it is not an HTTP payload this layer can read.
    pub(super) fn of(payload: &Payload) -> Option<Cow<'_, Self>> {
        match payload.decoded::<Self>() {
            Some(kept) => Some(Cow::Borrowed(kept)),
            None => Self::decode(payload).map(Cow::Owned),
        }
    }

    /// The response `payload` keeps, if it is an HTTP payload this layer can read.
    fn decode(payload: &Payload) -> Option<Self> {
        if payload.format() != PayloadFormat::HTTP {
            return None;
        }
        let status = StatusCode::from_u16(payload.status()).ok()?;
        let head = payload.head();
        let pairs: Vec<(&serde_bytes::Bytes, &serde_bytes::Bytes)> =
            postcard::from_bytes(head).ok()?;
        let headers = pairs
            .into_iter()
            .map(|(name, value)| {
                // The value shares the head's buffer: no copy.
                let value = HeaderValue::from_maybe_shared(head.slice_ref(value)).ok()?;
                Some((HeaderName::from_bytes(name).ok()?, value))
            })
            .collect::<Option<_>>()?;
        Some(Self {
            status,
            headers,
            body: payload.body().clone(),
        })
    }
}

/// The head of an HTTP payload: the response's headers, in order, as byte strings.
fn encode_head(response: &(dyn Any + Send + Sync)) -> Bytes {
    let Some(response) = response.downcast_ref::<StoredResponse>() else {
        return Bytes::new();
    };
    let pairs: Vec<(&serde_bytes::Bytes, &serde_bytes::Bytes)> = response
        .headers
        .iter()
        .map(|(name, value)| {
            let name = serde_bytes::Bytes::new(name.as_str().as_bytes());
            (name, serde_bytes::Bytes::new(value.as_bytes()))
        })
        .collect();
    // A `Vec` of byte-string pairs always encodes.
    Bytes::from(postcard::to_stdvec(&pairs).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_response_round_trips_through_its_payload_with_every_header_in_order() {
        let headers = vec![
            (
                HeaderName::from_static("set-cookie"),
                HeaderValue::from_static("a=1"),
            ),
            (
                HeaderName::from_static("x-multi"),
                HeaderValue::from_static("one"),
            ),
            (
                HeaderName::from_static("set-cookie"),
                HeaderValue::from_static("b=2"),
            ),
        ];
        let response = StoredResponse {
            status: StatusCode::CREATED,
            headers: headers.clone(),
            body: Bytes::from_static(b"{\"id\":1}"),
        };
        let payload = response.into_payload();
        assert_eq!(payload.format(), PayloadFormat::HTTP);
        assert_eq!(payload.status(), 201);
        // As a store outside the process gives it back: the bytes alone.
        let read = Payload::new(
            payload.format(),
            payload.status(),
            payload.head().clone(),
            payload.body().clone(),
        );
        let decoded = StoredResponse::decode(&read).unwrap();
        assert_eq!(decoded.status, StatusCode::CREATED);
        assert_eq!(decoded.headers, headers);
        assert_eq!(decoded.body, Bytes::from_static(b"{\"id\":1}"));
        let other = Payload::new(PayloadFormat::MESSAGE, 0, Bytes::new(), Bytes::new());
        assert!(StoredResponse::decode(&other).is_none());
    }
}
