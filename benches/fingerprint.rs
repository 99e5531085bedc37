//! The request fingerprint's hash, by measurement: version 1, SHA-256
//! (`Fingerprint::new_v1`, with the CPU's SHA extensions where `sha2` finds them),
//! against version 2, XXH3-128 (`Fingerprint::new`, a fast, stable, non-cryptographic
//! 128-bit hash), over the same fields, for request bodies of 64 bytes, 1 KiB and
//! 64 KiB.
//!
//! Rows (`fingerprint/<hash>/<size>`), each over method, path, query, content type and
//! body, length-prefixed, under a domain tag:
//! - `sha256`: `Fingerprint::new_v1`, what records written before version 2 hold.
//! - `xxh3_128`: `Fingerprint::new`, what the layer computes now.
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
                black_box(Fingerprint::new_v1(
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
