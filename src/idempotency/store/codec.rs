//! The records' binary encoding, shared by the stores that keep records outside the
//! process (Redis, PostgreSQL).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};
use serde::{Deserialize, Serialize};

use super::{Payload, Record, StoreError, StoredResponse};
use crate::idempotency::{AttemptId, Fingerprint};

#[derive(Serialize, Deserialize)]
struct EncodedRecord {
    fingerprint: [u8; 32],
    first_seen_ms: u64,
    original_attempt: Option<serde_bytes::ByteBuf>,
    epoch: Option<u64>,
    response: Option<EncodedResponse>,
    expires_at_ms: Option<u64>,
}

/// Byte fields as byte strings (`serde_bytes`): one copy each, not a sequence of
/// single bytes.
///
/// A [`Payload::Message`] is written with status [`MESSAGE_STATUS`] and no headers:
/// the layout records have always had, so a store holding records written before
/// message payloads existed reads them as it did (as HTTP payloads, which the
/// message layer still decodes).
#[derive(Serialize, Deserialize)]
struct EncodedResponse {
    status: u16,
    headers: Vec<(serde_bytes::ByteBuf, serde_bytes::ByteBuf)>,
    #[serde(with = "serde_bytes")]
    body: Vec<u8>,
}

/// The status of an encoded message payload: no HTTP response has it.
const MESSAGE_STATUS: u16 = 0;

pub(super) fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, StoreError> {
    postcard::to_stdvec(value).map_err(|e| StoreError::with_source("could not encode", e))
}

pub(super) fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, StoreError> {
    postcard::from_bytes(bytes)
        .map_err(|e| StoreError::with_source("corrupt value in the store", e))
}

/// A record in postcard: compact binary, every field, headers in order.
pub(super) fn encode_record(record: &Record) -> Result<Vec<u8>, StoreError> {
    encode(&EncodedRecord {
        fingerprint: *record.fingerprint.as_bytes(),
        first_seen_ms: millis(record.first_seen),
        original_attempt: record
            .original_attempt
            .as_ref()
            .map(|a| serde_bytes::ByteBuf::from(a.to_header_value().as_bytes())),
        epoch: record.epoch,
        response: record.payload.as_ref().map(|payload| match payload {
            Payload::Http(response) => EncodedResponse {
                status: response.status.as_u16(),
                headers: response
                    .headers
                    .iter()
                    .map(|(name, value)| {
                        (
                            serde_bytes::ByteBuf::from(name.as_str().as_bytes()),
                            serde_bytes::ByteBuf::from(value.as_bytes()),
                        )
                    })
                    .collect(),
                body: response.body.to_vec(),
            },
            Payload::Message(outcome) => EncodedResponse {
                status: MESSAGE_STATUS,
                headers: Vec::new(),
                body: outcome.to_vec(),
            },
        }),
        expires_at_ms: record.expires_at.map(millis),
    })
}

/// Decodes what [`encode_record`] wrote.
pub(super) fn decode_record(bytes: &[u8]) -> Result<Record, StoreError> {
    let encoded: EncodedRecord = decode(bytes)?;
    let corrupt = |what: &str| StoreError::new(format!("corrupt record in the store: {what}"));
    let payload = match encoded.response {
        None => None,
        Some(response) if response.status == MESSAGE_STATUS => {
            Some(Payload::Message(Bytes::from(response.body)))
        }
        Some(response) => Some(Payload::Http(StoredResponse {
            status: StatusCode::from_u16(response.status).map_err(|_| corrupt("status"))?,
            headers: response
                .headers
                .into_iter()
                .map(|(name, value)| {
                    Ok((
                        HeaderName::from_bytes(&name).map_err(|_| corrupt("header name"))?,
                        HeaderValue::from_bytes(&value).map_err(|_| corrupt("header value"))?,
                    ))
                })
                .collect::<Result<_, StoreError>>()?,
            body: Bytes::from(response.body),
        })),
    };
    let original_attempt = match encoded.original_attempt {
        None => None,
        Some(bytes) => Some(AttemptId::from_header_value(
            HeaderValue::from_bytes(&bytes).map_err(|_| corrupt("attempt id"))?,
        )),
    };
    Ok(Record {
        fingerprint: Fingerprint::from_bytes(encoded.fingerprint),
        first_seen: from_millis(encoded.first_seen_ms),
        original_attempt,
        epoch: encoded.epoch,
        payload,
        expires_at: encoded.expires_at_ms.map(from_millis),
    })
}

pub(super) fn millis(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

pub(super) fn from_millis(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

#[cfg(test)]
mod tests {

    use super::*;

    #[test]
    fn records_round_trip_through_the_encoding() {
        let record = Record {
            fingerprint: Fingerprint::new("POST", "/a", Some("q=1"), None, b"body"),
            first_seen: from_millis(1_795_000_000_123),
            original_attempt: Some(AttemptId::from_header_value(HeaderValue::from_static("2"))),
            epoch: Some(7),
            expires_at: Some(from_millis(1_795_086_400_123)),
            payload: Some(Payload::Http(StoredResponse {
                status: StatusCode::CREATED,
                headers: vec![
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
                ],
                body: Bytes::from_static(b"{\"id\":1}"),
            })),
        };
        let encoded = encode_record(&record).unwrap();
        let decoded = decode_record(&encoded).unwrap();
        assert_eq!(decoded.fingerprint, record.fingerprint);
        assert_eq!(decoded.first_seen, record.first_seen);
        assert_eq!(decoded.epoch, Some(7));
        assert_eq!(decoded.expires_at, record.expires_at);
        assert_eq!(decoded.original_attempt.as_ref().unwrap().as_str(), "2");
        let response = decoded.response().unwrap();
        assert_eq!(response.status, StatusCode::CREATED);
        assert_eq!(response.headers, record.response().unwrap().headers);
        assert_eq!(response.body, Bytes::from_static(b"{\"id\":1}"));
        // Compact: a few bytes of framing around the content.
        assert!(
            encoded.len() < 32 + 8 + 2 + 1 + 2 + 40 + 8 + 20 + 8,
            "{} bytes",
            encoded.len()
        );
        assert!(decode_record(&encoded[..encoded.len() - 1]).is_err());
    }

    #[test]
    fn message_payloads_round_trip() {
        let fingerprint = Fingerprint::from_bytes([7; 32]);
        let outcome = Bytes::from_static(b"{\"status\":\"done\"}");
        let record = Record::new(
            fingerprint,
            from_millis(1_795_000_000_123),
            None,
            None,
            Some(Payload::Message(outcome.clone())),
        );
        let decoded = decode_record(&encode_record(&record).unwrap()).unwrap();
        assert!(matches!(&decoded.payload, Some(Payload::Message(body)) if *body == outcome));
        assert!(decoded.response().is_none());
    }
}
