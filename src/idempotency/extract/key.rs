//! Where the idempotency key of a request comes from: its headers (the default), a
//! field of its JSON body, or a function of yours over the request's parts and body.

use std::borrow::Cow;

use bytes::Bytes;
use http::{request::Parts, HeaderName};
use serde_json::Value;

use crate::idempotency::{
    ClientId, IdempotencyKey, KeyRejection, IDEMPOTENCY_KEY, X_IDEMPOTENCY_KEY,
};

/// Reads the idempotency key of a request, and optionally a client the payload names.
///
/// Set with [`IdempotencyLayer::key`](crate::idempotency::IdempotencyLayer::key); the default is
/// [`KeyFromHeader`]. The key then goes where a header key goes: scoped by client,
/// method and path, the request fingerprinted (body included), every guarantee the same.
///
/// Three answers:
/// - `Ok(Some(key))`: the request is deduplicated on `key` (and the client
///   [`ExtractedKey::client`] names, if any, within the client the layer's
///   [`IdentifyClient`](crate::idempotency::extract::IdentifyClient) names).
/// - `Ok(None)`: no key. `400 idempotency.key_missing` with
///   [`require_key`](crate::idempotency::IdempotencyLayer::require_key), else the request passes
///   through untouched.
/// - `Err(rejection)`: `400` with the [`KeyRejection`]'s code; neither the handler nor
///   the store sees the request.
///
/// Implemented for closures `Fn(&Parts, &Bytes) -> R`, where `R` is an
/// `Option<IdempotencyKey>`, an `Option<ExtractedKey>`, or either in a
/// `Result<_, KeyRejection>` (see [`IntoExtractedKey`]). A closure reads the body, so
/// the layer reads it (within its limits) before calling it:
///
/// ```
/// use bytes::Bytes;
/// use http::request::Parts;
/// use tower_ids::idempotency::{extract::KeyRejection, IdempotencyKey, IdempotencyLayer};
///
/// // The key is the `X-Request-Nonce` header, prefixed by the tenant in the path.
/// let layer = IdempotencyLayer::new().key(|parts: &Parts, _body: &Bytes| {
///     let Some(nonce) = parts.headers.get("x-request-nonce") else {
///         return Ok(None);
///     };
///     let tenant = parts.uri.path().split('/').nth(1).unwrap_or("");
///     let text = format!("{tenant}:{}", nonce.to_str().map_err(|_| KeyRejection::new("send an ASCII nonce"))?);
///     IdempotencyKey::new(&text).map(Some)
/// });
/// # let _ = layer;
/// ```
pub trait ExtractKey: Send + Sync + 'static {
    /// Whether the key depends on the body. `true` (the default) makes the layer read
    /// the body first (it reads it anyway to fingerprint a request with a key); `false`
    /// lets a request without a key pass through with its body unread, and the
    /// extractor is given an empty body.
    fn reads_body(&self) -> bool {
        true
    }

    /// The key of the request whose head is `parts` and whose whole body is `body`.
    fn extract_key(
        &self,
        parts: &Parts,
        body: &Bytes,
    ) -> Result<Option<ExtractedKey>, KeyRejection>;

    /// The `detail` of the `400 idempotency.key_missing` for a request without a key
    /// when the layer requires one: where the client should put it.
    fn missing_detail(&self) -> Cow<'static, str> {
        Cow::Borrowed("this route requires an idempotency key, the same on every retry")
    }
}

impl<F, R> ExtractKey for F
where
    F: Fn(&Parts, &Bytes) -> R + Send + Sync + 'static,
    R: IntoExtractedKey,
{
    fn extract_key(
        &self,
        parts: &Parts,
        body: &Bytes,
    ) -> Result<Option<ExtractedKey>, KeyRejection> {
        self(parts, body).into_extracted_key()
    }
}

/// What a closure used as an [`ExtractKey`] returns.
pub trait IntoExtractedKey {
    /// The answer as [`ExtractKey::extract_key`] gives it.
    fn into_extracted_key(self) -> Result<Option<ExtractedKey>, KeyRejection>;
}

impl IntoExtractedKey for Option<IdempotencyKey> {
    fn into_extracted_key(self) -> Result<Option<ExtractedKey>, KeyRejection> {
        Ok(self.map(ExtractedKey::new))
    }
}

impl IntoExtractedKey for Option<ExtractedKey> {
    fn into_extracted_key(self) -> Result<Option<ExtractedKey>, KeyRejection> {
        Ok(self)
    }
}

impl IntoExtractedKey for Result<Option<IdempotencyKey>, KeyRejection> {
    fn into_extracted_key(self) -> Result<Option<ExtractedKey>, KeyRejection> {
        self.map(|key| key.map(ExtractedKey::new))
    }
}

impl IntoExtractedKey for Result<Option<ExtractedKey>, KeyRejection> {
    fn into_extracted_key(self) -> Result<Option<ExtractedKey>, KeyRejection> {
        self
    }
}

/// A key an [`ExtractKey`] found, and the client the payload names, if any.
#[derive(Debug, Clone)]
pub struct ExtractedKey {
    key: IdempotencyKey,
    client: Option<ClientId>,
}

impl ExtractedKey {
    /// The key alone: the request is scoped by the client the layer's
    /// [`IdentifyClient`](crate::idempotency::extract::IdentifyClient) names, if any.
    pub fn new(key: IdempotencyKey) -> Self {
        Self { key, client: None }
    }

    /// Scopes the key by `client` too (say, the `partner_id` of the body). When the
    /// layer's [`IdentifyClient`](crate::idempotency::extract::IdentifyClient) names a client as well, the
    /// scope is both ([`ClientId::and`]): a payload cannot reach another caller's keys.
    pub fn client(mut self, client: ClientId) -> Self {
        self.client = Some(client);
        self
    }

    /// The key.
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    pub(crate) fn into_parts(self) -> (IdempotencyKey, Option<ClientId>) {
        (self.key, self.client)
    }
}

/// The key is read from headers: `Idempotency-Key`, then `X-Idempotency-Key` (the
/// default; see [`IdempotencyKey::from_headers`] for repeats and disagreements).
///
/// The body is not read to find the key, so a request without one passes through
/// with its body unread.
#[derive(Debug, Clone)]
pub struct KeyFromHeader(Vec<HeaderName>);

impl KeyFromHeader {
    /// Reads the key from `names`, in order.
    pub fn new(names: impl IntoIterator<Item = HeaderName>) -> Self {
        Self(names.into_iter().collect())
    }
}

impl Default for KeyFromHeader {
    fn default() -> Self {
        Self(vec![IDEMPOTENCY_KEY, X_IDEMPOTENCY_KEY])
    }
}

impl ExtractKey for KeyFromHeader {
    fn reads_body(&self) -> bool {
        false
    }

    fn extract_key(
        &self,
        parts: &Parts,
        _body: &Bytes,
    ) -> Result<Option<ExtractedKey>, KeyRejection> {
        Ok(IdempotencyKey::from_headers(&parts.headers, &self.0)?.map(ExtractedKey::new))
    }

    fn missing_detail(&self) -> Cow<'static, str> {
        Cow::Borrowed("this route requires an Idempotency-Key header, the same on every retry")
    }
}

/// The key is a string field of the JSON body, named by a JSON pointer (RFC 6901), and
/// optionally the client is another field: for APIs whose payloads carry their own
/// idempotency key, such as a partner's `correlation_id` scoped by its `partner_id`.
///
/// ```
/// use tower_ids::idempotency::{IdempotencyLayer, KeyFromJson};
///
/// // Idempotent on (partner_id, correlation_id), both read from the body.
/// let realtime = IdempotencyLayer::new()
///     .key(KeyFromJson::new("/correlation_id").client("/partner_id"))
///     .require_key(true);
/// # let _ = realtime;
/// ```
///
/// | The body | Answer |
/// |---|---|
/// | not JSON | `400 idempotency.body_not_json` |
/// | no key field (or `null`) | `400 idempotency.key_missing` with [`require_key`](crate::idempotency::IdempotencyLayer::require_key), else passed through |
/// | a key field that is not a string | `400 idempotency.key_invalid` |
/// | a key that is not 1 to 255 visible ASCII characters | `400 idempotency.key_invalid` |
/// | with [`client`](Self::client): no client field, or one that is not a string or an integer | `400 idempotency.client_invalid` |
///
/// The body is parsed once more to find the fields (the handler parses it again);
/// the layer's request limit ([`max_request_bytes`](crate::idempotency::IdempotencyLayer::max_request_bytes))
/// bounds that work.
#[derive(Debug, Clone)]
pub struct KeyFromJson {
    key: Cow<'static, str>,
    client: Option<Cow<'static, str>>,
}

impl KeyFromJson {
    /// Reads the key from the string at `pointer` (`/correlation_id`, `/meta/key`).
    ///
    /// # Panics
    ///
    /// If `pointer` is not a JSON pointer: empty, or not starting with `/`.
    pub fn new(pointer: impl Into<Cow<'static, str>>) -> Self {
        let key = pointer.into();
        check_pointer(&key);
        Self { key, client: None }
    }

    /// Scopes each key by the client named at `pointer` (a string or an integer), which
    /// every request must then carry.
    ///
    /// # Panics
    ///
    /// If `pointer` is not a JSON pointer.
    pub fn client(mut self, pointer: impl Into<Cow<'static, str>>) -> Self {
        let pointer = pointer.into();
        check_pointer(&pointer);
        self.client = Some(pointer);
        self
    }
}

fn check_pointer(pointer: &str) {
    assert!(
        pointer.starts_with('/'),
        "a JSON pointer starts with `/`, as `/correlation_id`"
    );
}

impl ExtractKey for KeyFromJson {
    fn extract_key(
        &self,
        _parts: &Parts,
        body: &Bytes,
    ) -> Result<Option<ExtractedKey>, KeyRejection> {
        let value: Value = serde_json::from_slice(body).map_err(|_| KeyRejection::not_json())?;
        let key = match value.pointer(&self.key) {
            None | Some(Value::Null) => return Ok(None),
            Some(Value::String(text)) => IdempotencyKey::new(text)
                .map_err(|error| KeyRejection::field_invalid(self.key.clone(), error))?,
            Some(_) => return Err(KeyRejection::field_not_string(self.key.clone())),
        };
        let mut extracted = ExtractedKey::new(key);
        if let Some(pointer) = &self.client {
            let client = match value.pointer(pointer) {
                Some(Value::String(text)) if !text.is_empty() => ClientId::new(text),
                Some(Value::Number(number)) if number.is_i64() || number.is_u64() => {
                    ClientId::new(number.to_string())
                }
                found => {
                    let missing = matches!(found, None | Some(Value::Null));
                    return Err(KeyRejection::client_field(pointer.clone(), missing));
                }
            };
            extracted = extracted.client(client);
        }
        Ok(Some(extracted))
    }

    fn missing_detail(&self) -> Cow<'static, str> {
        Cow::Owned(format!(
            "this route requires an idempotency key in the {} field of the JSON body, the same on every retry",
            self.key
        ))
    }
}

#[cfg(test)]
mod tests {
    use http::Request;

    use super::*;
    use crate::idempotency::Code;

    fn parts() -> Parts {
        Request::post("/realtime").body(()).unwrap().into_parts().0
    }

    fn json(extractor: &KeyFromJson, body: &str) -> Result<Option<ExtractedKey>, KeyRejection> {
        extractor.extract_key(&parts(), &Bytes::copy_from_slice(body.as_bytes()))
    }

    #[test]
    fn a_json_field_is_the_key_and_another_the_client() {
        let extractor = KeyFromJson::new("/correlation_id").client("/partner_id");
        let found = json(&extractor, r#"{"partner_id":"p-1","correlation_id":"c-1"}"#)
            .unwrap()
            .unwrap();
        assert_eq!(found.key().as_str(), "c-1");
        assert_eq!(found.client, Some(ClientId::new("p-1")));
        let numeric = json(&extractor, r#"{"partner_id":7,"correlation_id":"c-1"}"#)
            .unwrap()
            .unwrap();
        assert_eq!(numeric.client, Some(ClientId::new("7")));
    }

    #[test]
    fn each_way_a_json_body_can_be_wrong_has_its_own_answer() {
        let extractor = KeyFromJson::new("/correlation_id").client("/partner_id");
        let cases = [
            ("not json", Code::BodyNotJson, "body_not_json"),
            (
                r#"{"correlation_id":7,"partner_id":"p"}"#,
                Code::KeyInvalid,
                "field_not_string",
            ),
            (
                r#"{"correlation_id":"a b","partner_id":"p"}"#,
                Code::KeyInvalid,
                "field_invalid",
            ),
            (
                r#"{"correlation_id":"c"}"#,
                Code::ClientInvalid,
                "client_field_missing",
            ),
            (
                r#"{"correlation_id":"c","partner_id":[1]}"#,
                Code::ClientInvalid,
                "client_field_invalid",
            ),
        ];
        for (body, code, reason) in cases {
            let error = json(&extractor, body).unwrap_err();
            assert_eq!((error.code(), error.reason()), (code, reason), "{body}");
            assert!(
                !error.to_string().contains("a b"),
                "never the value: {error}"
            );
        }
        assert!(json(&extractor, r#"{"partner_id":"p"}"#).unwrap().is_none());
        assert!(json(&extractor, r#"{"correlation_id":null}"#)
            .unwrap()
            .is_none());
    }

    #[test]
    fn headers_are_read_without_the_body() {
        let extractor = KeyFromHeader::default();
        assert!(!extractor.reads_body());
        let (parts, ()) = Request::post("/")
            .header("idempotency-key", "\"k-1\"")
            .body(())
            .unwrap()
            .into_parts();
        let found = extractor
            .extract_key(&parts, &Bytes::new())
            .unwrap()
            .unwrap();
        assert_eq!(found.key().as_str(), "k-1");
    }

    #[test]
    #[should_panic(expected = "JSON pointer")]
    fn a_field_name_is_not_a_pointer() {
        let _ = KeyFromJson::new("correlation_id");
    }
}
