//! A gRPC call's bytes: the request's messages counted, the response's status found,
//! and the call kept as a record's payload for replay.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};
use serde::{Deserialize, Serialize};

/// The length-prefixed messages of a gRPC request body (a flag byte, a 4-byte
/// big-endian length, the message): how many there are, or `None` when the body is not
/// a sequence of whole messages.
pub(super) fn message_count(mut body: &[u8]) -> Option<usize> {
    let mut count = 0;
    while !body.is_empty() {
        let [_, a, b, c, d, rest @ ..] = body else {
            return None;
        };
        let len = usize::try_from(u32::from_be_bytes([*a, *b, *c, *d])).ok()?;
        body = rest.get(len..)?;
        count += 1;
    }
    Some(count)
}

/// The status a call answered: `grpc-status` from its trailers, or from its head for
/// a trailers-only response; `Unknown` when neither has one.
pub(super) fn status_code(head: &HeaderMap, trailers: Option<&HeaderMap>) -> tonic::Code {
    trailers
        .and_then(|t| t.get(GRPC_STATUS))
        .or_else(|| head.get(GRPC_STATUS))
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<i32>().ok())
        .map_or(tonic::Code::Unknown, tonic::Code::from)
}

const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");

/// A call kept for replay: its head's metadata (but the per-attempt headers), its
/// messages as sent, and its trailers. Stored in postcard as a message payload, so the
/// stores keep it as they keep a consumer's outcome, with no format of their own.
/// Encoded from the response's own bytes, and decoded with the messages left in the
/// payload's buffer: no copy of the body either way.
#[derive(Serialize, Deserialize)]
pub(super) struct StoredCall<'a> {
    #[serde(borrow)]
    headers: Vec<(&'a serde_bytes::Bytes, &'a serde_bytes::Bytes)>,
    #[serde(borrow)]
    data: &'a serde_bytes::Bytes,
    #[serde(borrow)]
    trailers: Option<Vec<(&'a serde_bytes::Bytes, &'a serde_bytes::Bytes)>>,
}

type Pairs<'a> = Vec<(&'a serde_bytes::Bytes, &'a serde_bytes::Bytes)>;

fn pairs<'a>(headers: impl Iterator<Item = (&'a HeaderName, &'a HeaderValue)>) -> Pairs<'a> {
    headers
        .map(|(name, value)| {
            (
                serde_bytes::Bytes::new(name.as_str().as_bytes()),
                serde_bytes::Bytes::new(value.as_bytes()),
            )
        })
        .collect()
}

fn header_map(pairs: &Pairs<'_>) -> Option<HeaderMap> {
    let mut map = HeaderMap::with_capacity(pairs.len());
    for (name, value) in pairs {
        map.append(
            HeaderName::from_bytes(name).ok()?,
            HeaderValue::from_bytes(value).ok()?,
        );
    }
    Some(map)
}

impl StoredCall<'_> {
    /// The payload bytes of a call: the head's headers but those `per_attempt` names,
    /// the messages, the trailers.
    pub(super) fn encode(
        head: &HeaderMap,
        per_attempt: &[HeaderName],
        data: &Bytes,
        trailers: Option<&HeaderMap>,
    ) -> Option<Bytes> {
        let call = StoredCall {
            headers: pairs(head.iter().filter(|(name, _)| !per_attempt.contains(name))),
            data: serde_bytes::Bytes::new(data),
            trailers: trailers.map(|t| pairs(t.iter())),
        };
        postcard::to_stdvec(&call).ok().map(Bytes::from)
    }

    /// The head's headers, the messages (a slice of `payload`) and the trailers of a
    /// stored call; `None` for bytes that are not one.
    pub(super) fn decode(payload: &Bytes) -> Option<(HeaderMap, Bytes, Option<HeaderMap>)> {
        let call: StoredCall<'_> = postcard::from_bytes(payload).ok()?;
        let trailers = match &call.trailers {
            Some(trailers) => Some(header_map(trailers)?),
            None => None,
        };
        let data = payload.slice_ref(call.data);
        Some((header_map(&call.headers)?, data, trailers))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn framed(messages: &[&[u8]]) -> Vec<u8> {
        let mut body = Vec::new();
        for message in messages {
            body.push(0);
            body.extend_from_slice(&(message.len() as u32).to_be_bytes());
            body.extend_from_slice(message);
        }
        body
    }

    #[test]
    fn messages_are_counted_by_their_length_prefixes() {
        assert_eq!(message_count(&framed(&[b"abc"])), Some(1));
        assert_eq!(message_count(&framed(&[b""])), Some(1));
        assert_eq!(message_count(&framed(&[b"a", b"bc", b""])), Some(3));
        assert_eq!(message_count(&[]), Some(0));
        let mut cut = framed(&[b"abc"]);
        cut.pop();
        assert_eq!(message_count(&cut), None);
        assert_eq!(message_count(&[0, 0, 0]), None);
    }

    #[test]
    fn a_stored_call_decodes_to_what_was_kept() {
        let mut head = HeaderMap::new();
        head.insert("content-type", HeaderValue::from_static("application/grpc"));
        head.insert("x-correlation-id", HeaderValue::from_static("c-1"));
        head.append("x-tag", HeaderValue::from_static("a"));
        head.append("x-tag", HeaderValue::from_static("b"));
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        let data = Bytes::from(framed(&[b"reply"]));
        let per_attempt = [HeaderName::from_static("x-correlation-id")];
        let stored = StoredCall::encode(&head, &per_attempt, &data, Some(&trailers)).unwrap();
        let (headers, body, kept) = StoredCall::decode(&stored).unwrap();
        assert_eq!(headers.len(), 3);
        assert!(!headers.contains_key("x-correlation-id"));
        let tags: Vec<_> = headers.get_all("x-tag").iter().collect();
        assert_eq!(tags, ["a", "b"]);
        assert_eq!(body, data);
        assert_eq!(kept.unwrap()["grpc-status"], "0");
        assert!(StoredCall::decode(&Bytes::from_static(br#"{"json":"outcome"}"#)).is_none());
    }

    #[test]
    fn the_status_comes_from_the_trailers_or_the_head() {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("5"));
        let mut head = HeaderMap::new();
        assert_eq!(status_code(&head, Some(&trailers)), tonic::Code::NotFound);
        head.insert("grpc-status", HeaderValue::from_static("3"));
        assert_eq!(status_code(&head, None), tonic::Code::InvalidArgument);
        assert_eq!(status_code(&HeaderMap::new(), None), tonic::Code::Unknown);
    }
}
