//! The digests that name a request: its client ([`ClientId`]), its scope
//! ([`ScopeKey`]: client, method, path, key) and its fingerprint ([`Fingerprint`]).

use std::{borrow::Cow, fmt};

use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::Xxh3;

use crate::IdempotencyKey;

/// A client's identity, hashed: the raw credential never reaches the store or a log.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClientId([u8; 32]);

impl ClientId {
    /// Hashes `raw` (an API key, a token, a user ID) under a domain-separation prefix.
    pub fn new(raw: impl AsRef<[u8]>) -> Self {
        let mut digest = Sha256::new();
        digest.update(b"tower-ids.client.v1\0");
        digest.update(raw.as_ref());
        Self(digest.finalize().into())
    }

    /// The client `inner` as seen by `self`: one identity naming both, for a request
    /// whose caller is `self` (say, the API key the authentication checked) and whose
    /// payload names `inner` (say, the body's `partner_id`). Keys of one `inner` under
    /// two callers never meet, and neither meets the keys of `self` alone.
    pub fn and(&self, inner: &ClientId) -> Self {
        let mut digest = Sha256::new();
        digest.update(b"tower-ids.client-pair.v1\0");
        digest.update(self.0);
        digest.update(inner.0);
        Self(digest.finalize().into())
    }
}

/// The first 8 bytes in hex, without allocating: enough to tell clients and scopes apart
/// in a log line, as both display.
impl fmt::Display for ClientId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_short_hex(&self.0, f)
    }
}

/// Writes the first 8 bytes of `digest` in hex in one write: the span of every
/// protected request formats two of these when a subscriber records it, and a `write!`
/// per byte cost more than the rest of the field.
fn write_short_hex(digest: &[u8; 32], f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let mut hex = [0u8; 16];
    hex::encode_to_slice(&digest[..8], &mut hex).map_err(|_| fmt::Error)?;
    f.write_str(std::str::from_utf8(&hex).map_err(|_| fmt::Error)?)
}

impl fmt::Debug for ClientId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ClientId({self})")
    }
}

/// The digest that names one idempotent request: its transport, its operation (for HTTP
/// the method, path and, if the layer scopes by it, the query; for gRPC the method's
/// path), its client and its key. Stores index records by it; it holds nothing raw.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct ScopeKey([u8; 32]);

/// Feeds 8 bytes of the digest to the hasher as one `u64`: they are as uniform as any
/// hash of them would be.
impl std::hash::Hash for ScopeKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        let [a, b, c, d, e, f, g, h, ..] = self.0;
        state.write_u64(u64::from_le_bytes([a, b, c, d, e, f, g, h]));
    }
}

impl ScopeKey {
    /// The scope of a request: SHA-256 over the transport (`"http"`, `"grpc"`), the
    /// parts of the operation (`["POST", "/commands"]`), the client's hash and the key,
    /// each length-prefixed, so no two different lists of fields share one and no
    /// transport's scope is another's.
    pub fn new(
        transport: &str,
        operation: &[&str],
        client: Option<&ClientId>,
        key: &IdempotencyKey,
    ) -> Self {
        let mut digest = Sha256::new();
        digest.update(b"tower-ids.scope.v2\0");
        field(&mut digest, transport.as_bytes());
        for part in operation {
            field(&mut digest, part.as_bytes());
        }
        field(&mut digest, client.map_or(&[][..], |c| &c.0[..]));
        field(&mut digest, key.as_str().as_bytes());
        Self(digest.finalize().into())
    }

    /// The digest's bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Rebuilds a scope from stored bytes.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }
}

/// The first 8 bytes in hex, without allocating: enough to tell clients and scopes apart
/// in a log line, as both display.
impl fmt::Display for ScopeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_short_hex(&self.0, f)
    }
}

impl fmt::Debug for ScopeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ScopeKey({})", hex::encode(self.0))
    }
}

/// A digest of what the request asks for: method, path, query, content type and body.
/// The same key with another fingerprint is a conflict, never a replay.
///
/// Two hashes over the same fields: [`new`](Self::new), XXH3-128 followed by a 16-byte
/// tag, and [`collision_resistant`](Self::collision_resistant), SHA-256. The HTTP and
/// gRPC layers compute the first where the scope is one client's, and the second where
/// every caller shares the scope (no client identified):
///
/// - A fingerprint is only compared within one scope. Where the scope is one client's,
///   a collision (by chance 2^-128 a pair, or made on purpose from two bodies of the
///   client's own) can only get that client its own earlier answer instead of `422`:
///   never another client's response, never a second run. So a fast hash is enough.
/// - Where callers share a scope, one that can guess another's key and body could
///   otherwise send a different body that collides with it first; XXH3 is not made to
///   resist that, SHA-256 is.
///
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Fingerprint([u8; 32]);

/// The last 16 bytes of a [`Fingerprint::new`], which no SHA-256 digest is likely to
/// end with: the two kinds never compare equal.
const FAST_TAG: [u8; 16] = *b"tower-ids.fp.v2\0";

impl Fingerprint {
    /// The fingerprint of a request in one client's scope: XXH3-128 over method, path,
    /// query, content type and body, each length-prefixed.
    ///
    /// The content type is compared as a media type (RFC 9110, section 8.3.1): type,
    /// subtype and parameter names are case-insensitive, so they are lowercased;
    /// whitespace around `;` is optional, so parameters are joined by `"; "`, the form
    /// most clients send; empty parameters are dropped. Parameter values are kept as
    /// sent (`charset=UTF-8` and `charset=utf-8` differ, as `boundary` values may).
    /// `Application/JSON` and `application/json` are one fingerprint;
    /// `application/json` and `text/plain` are two.
    pub fn new(
        method: &str,
        path: &str,
        query: Option<&str>,
        content_type: Option<&[u8]>,
        body: &[u8],
    ) -> Self {
        let mut digest = Xxh3::new();
        digest.update(b"tower-ids.fingerprint.v2\0");
        let media_type = media_type(content_type.unwrap_or(b""));
        for bytes in [
            method.as_bytes(),
            path.as_bytes(),
            query.unwrap_or("").as_bytes(),
            &media_type,
            body,
        ] {
            digest.update(&(bytes.len() as u64).to_be_bytes());
            digest.update(bytes);
        }
        let mut fingerprint = [0; 32];
        fingerprint[..16].copy_from_slice(&digest.digest128().to_be_bytes());
        fingerprint[16..].copy_from_slice(&FAST_TAG);
        Self(fingerprint)
    }

    /// The fingerprint of a request in a scope every caller shares: SHA-256 over the
    /// same fields, which no caller can make collide with another's on purpose.
    pub fn collision_resistant(
        method: &str,
        path: &str,
        query: Option<&str>,
        content_type: Option<&[u8]>,
        body: &[u8],
    ) -> Self {
        let mut digest = Sha256::new();
        digest.update(b"tower-ids.fingerprint.v1\0");
        field(&mut digest, method.as_bytes());
        field(&mut digest, path.as_bytes());
        field(&mut digest, query.unwrap_or("").as_bytes());
        field(&mut digest, &media_type(content_type.unwrap_or(b"")));
        field(&mut digest, body);
        Self(digest.finalize().into())
    }

    /// The digest's bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Rebuilds a fingerprint from stored bytes.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", hex::encode(&self.0[..8]))
    }
}

/// `raw`, a `Content-Type` value, in the canonical form [`Fingerprint::new`] hashes:
/// `type/subtype; name=value; name=value`, type, subtype and names lowercased, values
/// as sent, optional whitespace around `;` and empty parameters gone. Borrowed, with
/// no allocation, when `raw` is already canonical (`application/json`,
/// `application/json; charset=utf-8`).
fn media_type(raw: &[u8]) -> Cow<'_, [u8]> {
    let raw = trim_ows(raw);
    // The common case, a bare lowercase type (`application/json`), is canonical as it
    // is; checked in one pass that vectorises rather than byte by byte below.
    if raw.iter().fold(true, |plain, &b| {
        plain & !b.is_ascii_uppercase() & (b != b';')
    }) {
        return Cow::Borrowed(raw);
    }
    let mut out = Canonical::new(raw);
    let mut parts = split_parameters(raw);
    if let Some(essence) = parts.next() {
        out.extend_lowercase(essence);
    }
    for parameter in parts.filter(|p| !p.is_empty()) {
        let (name, value) = match parameter.iter().position(|&b| b == b'=') {
            Some(eq) => parameter.split_at(eq),
            None => (parameter, &[][..]),
        };
        out.extend(b"; ");
        out.extend_lowercase(name);
        out.extend(value);
    }
    out.finish()
}

/// The pieces of `raw` between the `;` that are not inside a quoted string, each
/// without the optional whitespace around it.
fn split_parameters(raw: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = Some(raw);
    std::iter::from_fn(move || {
        let text = rest?;
        let (mut quoted, mut escaped) = (false, false);
        let end = text.iter().position(|&b| {
            match b {
                _ if escaped => escaped = false,
                b'\\' if quoted => escaped = true,
                b'"' => quoted = !quoted,
                b';' if !quoted => return true,
                _ => {}
            }
            false
        });
        let (piece, next) = match end {
            Some(end) => (&text[..end], Some(&text[end + 1..])),
            None => (text, None),
        };
        rest = next;
        Some(trim_ows(piece))
    })
}

fn trim_ows(mut raw: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = raw {
        raw = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = raw {
        raw = rest;
    }
    raw
}

/// Bytes written one at a time that stay a borrow of `source` for as long as they
/// repeat it, and become a copy at the first byte that differs.
struct Canonical<'a> {
    source: &'a [u8],
    len: usize,
    owned: Option<Vec<u8>>,
}

impl<'a> Canonical<'a> {
    fn new(source: &'a [u8]) -> Self {
        Self {
            source,
            len: 0,
            owned: None,
        }
    }

    fn push(&mut self, byte: u8) {
        match &mut self.owned {
            Some(owned) => owned.push(byte),
            None if self.source.get(self.len) == Some(&byte) => self.len += 1,
            None => {
                let mut owned = Vec::with_capacity(self.source.len() + 8);
                owned.extend_from_slice(&self.source[..self.len]);
                owned.push(byte);
                self.owned = Some(owned);
            }
        }
    }

    fn extend(&mut self, bytes: &[u8]) {
        bytes.iter().for_each(|&b| self.push(b));
    }

    fn extend_lowercase(&mut self, bytes: &[u8]) {
        bytes
            .iter()
            .for_each(|&b| self.push(b.to_ascii_lowercase()));
    }

    fn finish(self) -> Cow<'a, [u8]> {
        match self.owned {
            Some(owned) => Cow::Owned(owned),
            None => Cow::Borrowed(&self.source[..self.len]),
        }
    }
}

/// Length-prefixed, so no two different field lists hash the same bytes.
fn field(digest: &mut Sha256, bytes: &[u8]) {
    digest.update((bytes.len() as u64).to_be_bytes());
    digest.update(bytes);
}

#[cfg(test)]
mod tests {
    use http::Method;
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn each_field_and_each_hash_tells_requests_apart() {
        type Fields<'a> = (
            &'a str,
            &'a str,
            Option<&'a str>,
            Option<&'a [u8]>,
            &'a [u8],
        );
        let fields: [Fields<'_>; 6] = [
            (
                "POST",
                "/commands",
                Some("a=1"),
                Some(b"application/json"),
                b"{}",
            ),
            (
                "PUT",
                "/commands",
                Some("a=1"),
                Some(b"application/json"),
                b"{}",
            ),
            (
                "POST",
                "/command",
                Some("a=1"),
                Some(b"application/json"),
                b"{}",
            ),
            (
                "POST",
                "/commands",
                Some("a=2"),
                Some(b"application/json"),
                b"{}",
            ),
            ("POST", "/commands", Some("a=1"), Some(b"text/plain"), b"{}"),
            (
                "POST",
                "/commands",
                Some("a=1"),
                Some(b"application/json"),
                b"[]",
            ),
        ];
        let mut seen = std::collections::HashSet::new();
        for (method, path, query, content_type, body) in fields {
            let fast = Fingerprint::new(method, path, query, content_type, body);
            let strong = Fingerprint::collision_resistant(method, path, query, content_type, body);
            assert!(
                seen.insert(*fast.as_bytes()),
                "{method} {path} {query:?}: fast"
            );
            assert!(
                seen.insert(*strong.as_bytes()),
                "{method} {path} {query:?}: collision resistant"
            );
        }
        // Moving bytes between fields is another request (the fields are length-prefixed).
        assert_ne!(
            Fingerprint::new("POST", "/a", Some("b"), None, b""),
            Fingerprint::new("POST", "/ab", None, None, b"")
        );
    }

    fn scope(
        client: Option<&str>,
        method: &Method,
        path: &str,
        query: Option<&str>,
        key: &str,
    ) -> ScopeKey {
        let key = IdempotencyKey::parse(key.as_bytes()).unwrap();
        let client = client.map(ClientId::new);
        match query {
            Some(query) => ScopeKey::new(
                "http",
                &[method.as_str(), path, query],
                client.as_ref(),
                &key,
            ),
            None => ScopeKey::new("http", &[method.as_str(), path], client.as_ref(), &key),
        }
    }

    fn method() -> impl Strategy<Value = Method> {
        prop_oneof![Just(Method::POST), Just(Method::PATCH), Just(Method::PUT)]
    }

    proptest! {
        #[test]
        fn the_same_request_has_the_same_scope(
            client in proptest::option::of("[a-z]{0,8}"),
            method in method(),
            path in "/[a-z/]{0,12}",
            query in proptest::option::of("[a-z=&]{0,8}"),
            key in "[!#-~][!-~]{0,15}",
        ) {
            let a = scope(client.as_deref(), &method, &path, query.as_deref(), &key);
            let b = scope(client.as_deref(), &method, &path, query.as_deref(), &key);
            prop_assert_eq!(a, b);
        }

        #[test]
        fn any_difference_is_another_scope(
            a in (proptest::option::of("[a-z]{0,3}"), method(), "/[a-z]{0,3}", proptest::option::of("[a-z]{0,3}"), "[a-c]{1,3}"),
            b in (proptest::option::of("[a-z]{0,3}"), method(), "/[a-z]{0,3}", proptest::option::of("[a-z]{0,3}"), "[a-c]{1,3}"),
        ) {
            // An absent query and an empty one are one query.
            let same = a.0 == b.0 && a.1 == b.1 && a.2 == b.2
                && a.3.as_deref().unwrap_or("") == b.3.as_deref().unwrap_or("") && a.4 == b.4;
            let scope_a = scope(a.0.as_deref(), &a.1, &a.2, a.3.as_deref(), &a.4);
            let scope_b = scope(b.0.as_deref(), &b.1, &b.2, b.3.as_deref(), &b.4);
            prop_assert_eq!(scope_a == scope_b, same);
        }
    }

    #[test]
    fn the_short_forms_in_log_lines_are_the_first_eight_bytes_in_hex() {
        let client = ClientId::new("alice");
        let scope = scope(Some("alice"), &Method::POST, "/orders", None, "k1");
        for (shown, bytes) in [
            (client.to_string(), client.0),
            (scope.to_string(), *scope.as_bytes()),
        ] {
            assert_eq!(shown, hex::encode(&bytes[..8]));
            assert_eq!(shown.len(), 16);
        }
    }

    fn canonical(raw: &str) -> String {
        String::from_utf8(media_type(raw.as_bytes()).into_owned()).unwrap()
    }

    #[test]
    fn media_types_are_compared_case_insensitively_and_values_as_sent() {
        for (raw, expected) in [
            ("application/json", "application/json"),
            ("Application/JSON", "application/json"),
            ("  application/json\t", "application/json"),
            ("text/html;charset=utf-8", "text/html; charset=utf-8"),
            (
                "Text/HTML;Charset=\"utf-8\"",
                "text/html; charset=\"utf-8\"",
            ),
            ("text/html ;  charset=UTF-8 ; ", "text/html; charset=UTF-8"),
            ("text/plain;;", "text/plain"),
            (
                "multipart/form-data; Boundary=\"a;B \\\" c\"",
                "multipart/form-data; boundary=\"a;B \\\" c\"",
            ),
            ("a/b; x=1;Y=Two", "a/b; x=1; y=Two"),
            ("", ""),
        ] {
            assert_eq!(canonical(raw), expected, "{raw:?}");
        }
    }

    #[test]
    fn a_canonical_media_type_is_borrowed_not_copied() {
        for raw in [
            "application/json",
            "application/json; charset=utf-8",
            " application/json ",
        ] {
            assert!(
                matches!(media_type(raw.as_bytes()), Cow::Borrowed(_)),
                "{raw:?}"
            );
        }
        assert!(matches!(media_type(b"Application/JSON"), Cow::Owned(_)));
    }

    #[test]
    fn the_fingerprint_ignores_media_type_case_but_not_values() {
        let print = |content_type: &str| {
            Fingerprint::new("POST", "/a", None, Some(content_type.as_bytes()), b"{}")
        };
        assert_eq!(print("application/json"), print("Application/JSON"));
        assert_eq!(
            print("text/html; charset=utf-8"),
            print("TEXT/html;CHARSET=utf-8")
        );
        assert_ne!(print("application/json"), print("text/plain"));
        assert_ne!(
            print("text/html; charset=utf-8"),
            print("text/html; charset=UTF-8")
        );
        assert_ne!(print("application/json"), print("application/json; x=1"));
    }

    proptest! {
        #[test]
        fn canonical_media_types_are_fixed_points(raw in "[ -~\t]{0,40}") {
            let once = media_type(raw.as_bytes()).into_owned();
            let twice = media_type(&once).into_owned();
            prop_assert_eq!(&twice, &once);
            prop_assert!(matches!(media_type(&once), Cow::Borrowed(_)));
        }

        #[test]
        fn changing_the_case_of_type_and_names_changes_nothing(
            essence in "[a-zA-Z]{1,8}/[a-zA-Z+.-]{1,8}",
            names in proptest::collection::vec("[a-zA-Z]{1,6}", 0..3),
            value in "[a-zA-Z0-9-]{1,6}",
            space in "[ \t]{0,2}",
        ) {
            let build = |upper: bool| {
                let case = |s: &str| if upper { s.to_ascii_uppercase() } else { s.to_ascii_lowercase() };
                let mut text = case(&essence);
                for name in &names {
                    text.push_str(&format!("{space};{space}{}={value}", case(name)));
                }
                text
            };
            prop_assert_eq!(canonical(&build(true)), canonical(&build(false)));
        }
    }

    #[test]
    fn field_boundaries_matter() {
        // Without length prefixes these would hash the same bytes.
        let a = scope(None, &Method::POST, "/ab", None, "c");
        let b = scope(None, &Method::POST, "/a", None, "bc");
        assert_ne!(a, b);
        // No client and a client whose credential is empty are different clients.
        assert_ne!(
            scope(None, &Method::POST, "/a", None, "k"),
            scope(Some(""), &Method::POST, "/a", None, "k")
        );
    }
}
