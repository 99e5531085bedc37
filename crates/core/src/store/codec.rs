//! The records' binary encoding, shared by the stores that keep records outside the
//! process (Redis, PostgreSQL).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::{Payload, PayloadFormat, Record, StoreError};
use crate::{AttemptId, Fingerprint};

#[derive(Serialize, Deserialize)]
struct EncodedRecord {
    fingerprint: [u8; 32],
    first_seen_ms: u64,
    original_attempt: Option<serde_bytes::ByteBuf>,
    epoch: Option<u64>,
    payload: Option<EncodedPayload>,
    expires_at_ms: Option<u64>,
}

/// A [`Payload`] as the store keeps it: its format's tag, its status, and its head and
/// body as byte strings (`serde_bytes`: one copy each, not a sequence of single bytes).
#[derive(Serialize, Deserialize)]
struct EncodedPayload {
    format: u8,
    status: u16,
    #[serde(with = "serde_bytes")]
    head: Vec<u8>,
    #[serde(with = "serde_bytes")]
    body: Vec<u8>,
}

pub fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, StoreError> {
    postcard::to_stdvec(value).map_err(|e| StoreError::with_source("could not encode", e))
}

pub fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, StoreError> {
    postcard::from_bytes(bytes)
        .map_err(|e| StoreError::with_source("corrupt value in the store", e))
}

/// A record in postcard: compact binary, every field, headers in order.
pub fn encode_record(record: &Record) -> Result<Vec<u8>, StoreError> {
    encode(&EncodedRecord {
        fingerprint: *record.fingerprint.as_bytes(),
        first_seen_ms: millis(record.first_seen),
        original_attempt: record
            .original_attempt
            .as_ref()
            .map(|a| serde_bytes::ByteBuf::from(a.to_header_value().as_bytes())),
        epoch: record.epoch,
        payload: record.payload.as_ref().map(|payload| EncodedPayload {
            format: payload.format().tag(),
            status: payload.status(),
            head: payload.head().to_vec(),
            body: payload.body().to_vec(),
        }),
        expires_at_ms: record.expires_at.map(millis),
    })
}

/// Decodes what [`encode_record`] wrote.
pub fn decode_record(bytes: &[u8]) -> Result<Record, StoreError> {
    let encoded: EncodedRecord = decode(bytes)?;
    let corrupt = |what: &str| StoreError::new(format!("corrupt record in the store: {what}"));
    let payload = encoded.payload.map(|payload| {
        Payload::new(
            PayloadFormat::from_tag(payload.format),
            payload.status,
            Bytes::from(payload.head),
            Bytes::from(payload.body),
        )
    });
    let original_attempt = match encoded.original_attempt {
        None => None,
        Some(bytes) => Some(AttemptId::from_stored(&bytes).ok_or_else(|| corrupt("attempt id"))?),
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

pub fn millis(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

pub fn from_millis(ms: u64) -> SystemTime {
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
            original_attempt: AttemptId::from_stored(b"2"),
            epoch: Some(7),
            expires_at: Some(from_millis(1_795_086_400_123)),
            payload: Some(Payload::new(
                PayloadFormat::HTTP,
                201,
                Bytes::from_static(b"head"),
                Bytes::from_static(b"{\"id\":1}"),
            )),
        };
        let encoded = encode_record(&record).unwrap();
        let decoded = decode_record(&encoded).unwrap();
        assert_eq!(decoded.fingerprint, record.fingerprint);
        assert_eq!(decoded.first_seen, record.first_seen);
        assert_eq!(decoded.epoch, Some(7));
        assert_eq!(decoded.expires_at, record.expires_at);
        assert_eq!(decoded.original_attempt.as_ref().unwrap().as_str(), "2");
        let payload = decoded.payload.unwrap();
        assert_eq!(payload.format(), PayloadFormat::HTTP);
        assert_eq!(payload.status(), 201);
        assert_eq!(payload.head(), &Bytes::from_static(b"head"));
        assert_eq!(payload.body(), &Bytes::from_static(b"{\"id\":1}"));
        // Compact: a few bytes of framing around the content.
        assert!(
            encoded.len() < 32 + 8 + 2 + 1 + 2 + 4 + 8 + 8 + 8,
            "{} bytes",
            encoded.len()
        );
        assert!(decode_record(&encoded[..encoded.len() - 1]).is_err());
    }

    #[test]
    fn a_record_without_its_outcome_round_trips() {
        let record = Record::new(
            Fingerprint::from_bytes([7; 32]),
            from_millis(1_795_000_000_123),
            None,
            None,
            None,
        );
        let decoded = decode_record(&encode_record(&record).unwrap()).unwrap();
        assert!(decoded.payload.is_none());
    }
}
