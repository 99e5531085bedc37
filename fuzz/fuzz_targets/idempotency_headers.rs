//! Arbitrary bytes as idempotency-key, x-idempotency-key and attempt-id headers: the
//! parsers never panic, and whatever they accept obeys the contract.
#![no_main]

use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;
use tower_ids::idempotency::{
    header::{IDEMPOTENCY_KEY, X_IDEMPOTENCY_KEY},
    AttemptId, IdempotencyKey,
};

fuzz_target!(|data: &[u8]| {
    if let Ok(key) = IdempotencyKey::parse(data) {
        let text = key.as_str();
        assert!((1..=255).contains(&text.len()));
        assert!(text.bytes().all(|b| (0x21..=0x7e).contains(&b)));
    }

    // Split the input into three header values.
    let mut parts = data.splitn(3, |&b| b == 0);
    let mut headers = HeaderMap::new();
    for name in [IDEMPOTENCY_KEY, X_IDEMPOTENCY_KEY, http::HeaderName::from_static("attempt-id")] {
        if let Some(value) = parts.next().and_then(|p| HeaderValue::from_bytes(p).ok()) {
            headers.append(name, value);
        }
    }
    let _ = IdempotencyKey::from_headers(&headers, &[IDEMPOTENCY_KEY, X_IDEMPOTENCY_KEY]);
    let _ = AttemptId::from_headers(&headers);
});
