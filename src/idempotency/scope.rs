use std::{borrow::Cow, fmt, marker::PhantomData};

use http::{header, HeaderMap, HeaderName, HeaderValue, Method, Request};
use sha2::{Digest, Sha256};

use super::IdempotencyKey;

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

    /// The first 8 bytes in hex: enough to tell clients apart in a log line.
    pub fn short(&self) -> String {
        hex::encode(&self.0[..8])
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

/// The first 8 bytes in hex, as [`short`](Self::short), written without allocating.
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
        write!(f, "ClientId({})", self.short())
    }
}

/// Tells which client sent a request, so keys are scoped per client.
///
/// Three answers:
/// - `Ok(Some(client))`: the request comes from `client`; its keys are its own.
/// - `Ok(None)`: no identifiable client. The key is then global to the route, shared
///   with every other caller without one (see the [module docs](crate::idempotency)),
///   unless the layer has [`require_client`](super::IdempotencyLayer::require_client),
///   which answers `401`.
/// - `Err(InvalidClient)`: the request names its client ambiguously or wrongly (say,
///   two different API keys); the layer answers `400 idempotency.client_invalid` and
///   neither the handler nor the store sees the request.
///
/// Never identify a client by IP address or `User-Agent`: neither is unique to a
/// client nor stable across its retries.
///
/// Implemented for closures `Fn(&Request<B>) -> Option<ClientId>` and
/// `Fn(&Request<B>) -> Result<Option<ClientId>, InvalidClient>` (see
/// [`IntoClientIdentity`]):
///
/// ```
/// use http::Request;
/// use tower_ids::idempotency::{ClientId, IdempotencyLayer, IdentifyClient, InvalidClient};
///
/// // A tenant header: absent is no client; anything but one short value is refused.
/// let tenant = |request: &Request<()>| {
///     let mut tenants = request.headers().get_all("x-tenant").iter();
///     match (tenants.next(), tenants.next()) {
///         (None, _) => Ok(None),
///         (Some(tenant), None) if tenant.len() <= 64 => Ok(Some(ClientId::new(tenant))),
///         _ => Err(InvalidClient::new("send one x-tenant header of at most 64 bytes")),
///     }
/// };
/// let twice = Request::post("/").header("x-tenant", "a").header("x-tenant", "b").body(())?;
/// assert_eq!(tenant.identify_client(&twice).unwrap_err().code(), "refused");
/// let layer = IdempotencyLayer::new().client(tenant);
///
/// // Or an `Option`, for a client that is known or not but never refused.
/// let user = |request: &Request<()>| request.extensions().get::<String>().map(ClientId::new);
/// assert_eq!(user.identify_client(&Request::new(())), Ok(None));
/// # Ok::<(), http::Error>(())
/// ```
pub trait IdentifyClient<B> {
    /// The client of `request`, if known, or why the request cannot be accepted.
    fn identify_client(&self, request: &Request<B>) -> Result<Option<ClientId>, InvalidClient>;
}

impl<B, F, R> IdentifyClient<B> for F
where
    F: Fn(&Request<B>) -> R,
    R: IntoClientIdentity,
{
    fn identify_client(&self, request: &Request<B>) -> Result<Option<ClientId>, InvalidClient> {
        self(request).into_client_identity()
    }
}

/// What a closure used as an [`IdentifyClient`] returns: `Option<ClientId>`, for a
/// client that is known or not, or `Result<Option<ClientId>, InvalidClient>`, to
/// refuse a request too.
pub trait IntoClientIdentity {
    /// The answer as [`IdentifyClient::identify_client`] gives it.
    fn into_client_identity(self) -> Result<Option<ClientId>, InvalidClient>;
}

impl IntoClientIdentity for Option<ClientId> {
    fn into_client_identity(self) -> Result<Option<ClientId>, InvalidClient> {
        Ok(self)
    }
}

impl IntoClientIdentity for Result<Option<ClientId>, InvalidClient> {
    fn into_client_identity(self) -> Result<Option<ClientId>, InvalidClient> {
        self
    }
}

/// Why the client of a request could not be told: the layer answers
/// `400 idempotency.client_invalid` with this message as the problem's `detail`, and
/// logs it in its WARN `idempotency.rejected` event.
///
/// The message is fixed text (or names a header the server configured): it never
/// carries the credential or anything else the request sent, so it is safe to send
/// back and to log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidClient(ClientError);

#[derive(Debug, Clone, PartialEq, Eq)]
enum ClientError {
    Repeated(HeaderName),
    Refused(&'static str),
}

impl InvalidClient {
    /// Refuses the request with `message`, which the client reads.
    pub fn new(message: &'static str) -> Self {
        Self(ClientError::Refused(message))
    }

    /// The header `name`, which names the client, was sent more than once with
    /// different values: which one the authentication in front of this layer checked
    /// cannot be known.
    pub fn repeated(name: HeaderName) -> Self {
        Self(ClientError::Repeated(name))
    }

    /// A stable code for log lines: `repeated` or `refused`.
    pub fn code(&self) -> &'static str {
        match self.0 {
            ClientError::Repeated(_) => "repeated",
            ClientError::Refused(_) => "refused",
        }
    }
}

impl fmt::Display for InvalidClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            ClientError::Repeated(name) => write!(
                f,
                "the {name} header, which names the client, was sent more than once with different values; send it once"
            ),
            ClientError::Refused(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for InvalidClient {}

/// No client identity: keys are global to the route.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoClient;

impl<B> IdentifyClient<B> for NoClient {
    fn identify_client(&self, _request: &Request<B>) -> Result<Option<ClientId>, InvalidClient> {
        Ok(None)
    }
}

/// The one value of header `name`: `None` when absent or empty, refused when repeated
/// with different values (a repeat of the same value is that value, as for the
/// idempotency key).
fn single_value<'r>(
    headers: &'r HeaderMap,
    name: &HeaderName,
) -> Result<Option<&'r HeaderValue>, InvalidClient> {
    let mut values = headers.get_all(name).iter();
    let Some(first) = values.next() else {
        return Ok(None);
    };
    if values.any(|value| value != first) {
        return Err(InvalidClient::repeated(name.clone()));
    }
    Ok((!first.is_empty()).then_some(first))
}

/// The client is the value of a header, such as an API key in `x-api-key`.
///
/// Absent or empty: no client. Sent twice with different values: refused
/// ([`InvalidClient::repeated`]), never the first one silently.
#[derive(Debug, Clone)]
pub struct ClientFromHeader(HeaderName);

impl ClientFromHeader {
    /// Identifies clients by the value of `name`.
    pub fn new(name: HeaderName) -> Self {
        Self(name)
    }
}

impl<B> IdentifyClient<B> for ClientFromHeader {
    fn identify_client(&self, request: &Request<B>) -> Result<Option<ClientId>, InvalidClient> {
        let value = single_value(request.headers(), &self.0)?;
        Ok(value.map(|value| ClientId::new(value.as_bytes())))
    }
}

/// The client is whoever holds the `Authorization` credentials (a bearer token, say):
/// the whole header value is hashed. Use an auth layer's extension
/// ([`ClientFromExtension`]) instead when tokens rotate but the subject stays.
///
/// Absent or empty: no client. Two different `Authorization` headers: refused.
#[derive(Debug, Clone, Copy, Default)]
pub struct ClientFromAuthorization;

impl<B> IdentifyClient<B> for ClientFromAuthorization {
    fn identify_client(&self, request: &Request<B>) -> Result<Option<ClientId>, InvalidClient> {
        let value = single_value(request.headers(), &header::AUTHORIZATION)?;
        Ok(value.map(|value| ClientId::new(value.as_bytes())))
    }
}

/// The client is an extension an authentication layer put on the request, such as the
/// authenticated user's ID.
pub struct ClientFromExtension<T>(PhantomData<fn() -> T>);

impl<T> ClientFromExtension<T> {
    /// Identifies clients by the `T` extension.
    pub fn new() -> Self {
        Self(PhantomData)
    }
}

impl<T> Default for ClientFromExtension<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Clone for ClientFromExtension<T> {
    fn clone(&self) -> Self {
        Self::new()
    }
}

impl<T> fmt::Debug for ClientFromExtension<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClientFromExtension")
    }
}

impl<B, T> IdentifyClient<B> for ClientFromExtension<T>
where
    T: AsRef<[u8]> + Send + Sync + 'static,
{
    fn identify_client(&self, request: &Request<B>) -> Result<Option<ClientId>, InvalidClient> {
        Ok(request.extensions().get::<T>().map(ClientId::new))
    }
}

/// The digest that names one idempotent request: client, method, path, optionally the
/// query, and the key. Stores index records by it; it holds nothing raw.
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
    /// The scope of a request: SHA-256 over the client's hash, method, path, query
    /// (pass `None` unless the layer scopes by query) and key, each length-prefixed so
    /// no two different requests share one.
    pub fn new(
        client: Option<&ClientId>,
        method: &Method,
        path: &str,
        query: Option<&str>,
        key: &IdempotencyKey,
    ) -> Self {
        let mut digest = Sha256::new();
        digest.update(b"tower-ids.scope.v1\0");
        field(&mut digest, client.map_or(&[][..], |c| &c.0[..]));
        field(&mut digest, method.as_str().as_bytes());
        field(&mut digest, path.as_bytes());
        field(&mut digest, query.unwrap_or("").as_bytes());
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

    /// The first 8 bytes in hex, for log lines.
    pub fn short(&self) -> String {
        hex::encode(&self.0[..8])
    }
}

/// The first 8 bytes in hex, as [`short`](Self::short), written without allocating.
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
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The fingerprint of a request: SHA-256 over method, path, query, content type
    /// and body, each length-prefixed.
    ///
    /// The content type is compared as a media type (RFC 9110, section 8.3.1): type,
    /// subtype and parameter names are case-insensitive, so they are lowercased;
    /// whitespace around `;` is optional, so parameters are joined by `"; "`, the form
    /// most clients send; empty parameters are dropped. Parameter values are kept as
    /// sent (`charset=UTF-8` and `charset=utf-8` differ, as `boundary` values may).
    /// `Application/JSON` and `application/json` are one fingerprint;
    /// `application/json` and `text/plain` are two.
    pub fn new(
        method: &Method,
        path: &str,
        query: Option<&str>,
        content_type: Option<&[u8]>,
        body: &[u8],
    ) -> Self {
        let mut digest = Sha256::new();
        digest.update(b"tower-ids.fingerprint.v1\0");
        field(&mut digest, method.as_str().as_bytes());
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

    fn scope(
        client: Option<&str>,
        method: &Method,
        path: &str,
        query: Option<&str>,
        key: &str,
    ) -> ScopeKey {
        let key = IdempotencyKey::parse(key.as_bytes()).unwrap();
        ScopeKey::new(
            client.map(ClientId::new).as_ref(),
            method,
            path,
            query,
            &key,
        )
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

    fn request(headers: &[(&str, &str)]) -> Request<()> {
        let mut request = Request::post("/");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        request.body(()).unwrap()
    }

    #[test]
    fn the_short_forms_in_log_lines_are_the_first_eight_bytes_in_hex() {
        let client = ClientId::new("alice");
        let scope = scope(Some("alice"), &Method::POST, "/orders", None, "k1");
        for (shown, short, bytes) in [
            (client.to_string(), client.short(), client.0),
            (scope.to_string(), scope.short(), *scope.as_bytes()),
        ] {
            assert_eq!(shown, short);
            assert_eq!(shown, hex::encode(&bytes[..8]));
            assert_eq!(shown.len(), 16);
        }
    }

    #[test]
    fn a_client_header_sent_twice_with_different_values_is_refused() {
        let api_key = ClientFromHeader::new(HeaderName::from_static("x-api-key"));
        let identify = |headers: &[(&str, &str)]| {
            let request = request(headers);
            (
                api_key.identify_client(&request),
                ClientFromAuthorization.identify_client(&request),
            )
        };

        let (key, auth) = identify(&[
            ("x-api-key", "alice"),
            ("x-api-key", "bob"),
            ("authorization", "Bearer a"),
            ("authorization", "Bearer b"),
        ]);
        let (key, auth) = (key.unwrap_err(), auth.unwrap_err());
        assert_eq!((key.code(), auth.code()), ("repeated", "repeated"));
        assert_eq!(
            key.to_string(),
            "the x-api-key header, which names the client, was sent more than once with different values; send it once"
        );
        assert!(!key.to_string().contains("alice"));
        assert!(auth.to_string().starts_with("the authorization header"));

        let (key, auth) = identify(&[
            ("x-api-key", "alice"),
            ("x-api-key", "alice"),
            ("authorization", "Bearer a"),
        ]);
        assert_eq!(
            key,
            Ok(Some(ClientId::new("alice"))),
            "the same value twice"
        );
        assert_eq!(auth, Ok(Some(ClientId::new("Bearer a"))));

        assert_eq!(identify(&[]), (Ok(None), Ok(None)));
        assert_eq!(
            identify(&[("x-api-key", ""), ("authorization", "")]),
            (Ok(None), Ok(None)),
            "an empty credential is no client, not one client shared by all"
        );
    }

    #[test]
    fn closures_identify_with_an_option_or_a_result() {
        fn check<C: IdentifyClient<()>>(identify: C) -> Result<Option<ClientId>, InvalidClient> {
            identify.identify_client(&request(&[("x-user", "u1")]))
        }
        let user = |request: &Request<()>| request.headers().get("x-user").map(ClientId::new);
        assert_eq!(check(user), Ok(Some(ClientId::new("u1"))));
        let refuse = |_: &Request<()>| -> Result<Option<ClientId>, InvalidClient> {
            Err(InvalidClient::new("no users today"))
        };
        let refused = check(refuse).unwrap_err();
        assert_eq!(refused.code(), "refused");
        assert_eq!(refused.to_string(), "no users today");
        assert_eq!(check(NoClient), Ok(None));
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
            Fingerprint::new(
                &Method::POST,
                "/a",
                None,
                Some(content_type.as_bytes()),
                b"{}",
            )
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
