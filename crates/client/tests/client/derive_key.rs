//! Key derivation (`derive_key`), against vectors computed by an independent
//! implementation.

use tower_ids::client::derive_key;

/// Computed once with an independent implementation, Python's hashlib, over the same
/// byte layout:
///
/// ```python
/// D = b"tower-ids.idempotency-key.v1\0"
/// def key(c, e, r):
///     c = c.encode()
///     return hashlib.sha256(D + struct.pack(">Q", len(c)) + c + struct.pack(">Q", 8)
///         + struct.pack(">Q", e) + struct.pack(">Q", len(r)) + r).digest()
/// ```
#[test]
fn derived_keys_match_independent_vectors() {
    let order = br#"{"order":42,"amount_cents":1999}"#;
    let all_bytes: Vec<u8> = (0..=255).collect();
    let vectors: [(&str, u64, &[u8], &str); 4] = [
        (
            "",
            0,
            b"",
            "4512a2ffeac4bf08be71e7fffcb6f540e68683d95d3be4a4af393c06bf7dadff",
        ),
        (
            "charge-card",
            1,
            order,
            "76b2e0a3e90057d55d9959d2b8a9c9e897acb7e9da99da5160a880d104fb4c95",
        ),
        (
            "charge-card",
            2,
            order,
            "b07b2b770609aa747c6c60839ecdf129a585467cd9f253835c0e127a7d25576e",
        ),
        (
            "nightly-report",
            u64::MAX,
            &all_bytes,
            "ee092fe464e4690f0bafd90bb1e8e8e1d95894699605f3ae9d5d1dd93eaf8b48",
        ),
    ];
    for (computation, epoch, bytes, hex) in vectors {
        assert_eq!(
            derive_key(computation, epoch, bytes).to_hex(),
            hex,
            "{computation} {epoch}"
        );
    }
    let key = derive_key("charge-card", 1, order);
    assert_eq!(
        key.to_base64url(),
        "drLgo-kAV9VdmVnSuKnJ6Jest-namdpRYKiA0QT7TJU"
    );
    assert_eq!(key.to_string(), key.to_hex());
}
