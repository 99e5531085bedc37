//! The request fingerprint's hash, by measurement: SHA-256 (what `Fingerprint::new`
//! computes, with the CPU's SHA extensions where `sha2` finds them) against XXH3-128 (a
//! fast, stable, non-cryptographic 128-bit hash) over the same bytes, for request bodies
//! of 64 bytes, 1 KiB and 64 KiB.
//!
//! Rows (`fingerprint/<hash>/<size>`):
//! - `sha256`: `Fingerprint::new` (method, path, query, content type and body, each
//!   length-prefixed, under a domain tag).
//! - `xxh3_128`: the same fields, length-prefixed, streamed into XXH3-128.
//!
//! Run: `cargo bench --bench fingerprint`
#![allow(missing_docs)]

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use http::Method;
use tower_ids::idempotency::store::Fingerprint;
use xxhash_rust::xxh3::Xxh3;

const SIZES: [(&str, usize); 3] = [("64B", 64), ("1KiB", 1024), ("64KiB", 64 * 1024)];
const PATH: &str = "/commands";
const CONTENT_TYPE: &[u8] = b"application/json";

fn xxh3_128(method: &Method, path: &str, content_type: &[u8], body: &[u8]) -> u128 {
    let mut hasher = Xxh3::new();
    hasher.update(b"tower-ids.fingerprint.v2\0");
    for field in [method.as_str().as_bytes(), path.as_bytes(), b"", content_type, body] {
        hasher.update(&(field.len() as u64).to_be_bytes());
        hasher.update(field);
    }
    hasher.digest128()
}

fn fingerprint(c: &mut Criterion) {
    let mut group = c.benchmark_group("fingerprint");
    for (label, size) in SIZES {
        let body = vec![b'x'; size];
        group.bench_function(format!("sha256/{label}"), |b| {
            b.iter(|| {
                black_box(Fingerprint::new(
                    &Method::POST,
                    PATH,
                    None,
                    Some(CONTENT_TYPE),
                    black_box(&body),
                ))
            })
        });
        group.bench_function(format!("xxh3_128/{label}"), |b| {
            b.iter(|| black_box(xxh3_128(&Method::POST, PATH, CONTENT_TYPE, black_box(&body))))
        });
    }
    group.finish();
}

criterion_group!(benches, fingerprint);
criterion_main!(benches);
