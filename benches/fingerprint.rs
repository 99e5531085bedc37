//! The request fingerprint's two hashes, by measurement: SHA-256
//! (`Fingerprint::collision_resistant`, with the CPU's SHA extensions where `sha2` finds
//! them), against XXH3-128 (`Fingerprint::new`, a fast, stable, non-cryptographic 128-bit
//! hash), over the same fields, for request bodies of 64 bytes, 1 KiB and 64 KiB.
//!
//! Rows (`fingerprint/<hash>/<size>`), each over method, path, query, content type and
//! body, length-prefixed, under a domain tag:
//! - `sha256`: `Fingerprint::collision_resistant`, what the layers compute where every
//!   caller shares the scope.
//! - `xxh3_128`: `Fingerprint::new`, what they compute where the scope is one client's.
//!
//! Run: `cargo bench --bench fingerprint`
#![allow(missing_docs)]

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use tower_ids::idempotency::store::Fingerprint;

const SIZES: [(&str, usize); 3] = [("64B", 64), ("1KiB", 1024), ("64KiB", 64 * 1024)];
const PATH: &str = "/commands";
const CONTENT_TYPE: &[u8] = b"application/json";

fn fingerprint(c: &mut Criterion) {
    let mut group = c.benchmark_group("fingerprint");
    for (label, size) in SIZES {
        let body = vec![b'x'; size];
        group.bench_function(format!("sha256/{label}"), |b| {
            b.iter(|| {
                black_box(Fingerprint::collision_resistant(
                    "POST",
                    PATH,
                    None,
                    Some(CONTENT_TYPE),
                    black_box(&body),
                ))
            })
        });
        group.bench_function(format!("xxh3_128/{label}"), |b| {
            b.iter(|| {
                black_box(Fingerprint::new(
                    "POST",
                    PATH,
                    None,
                    Some(CONTENT_TYPE),
                    black_box(&body),
                ))
            })
        });
    }
    group.finish();
}

criterion_group!(benches, fingerprint);
criterion_main!(benches);
