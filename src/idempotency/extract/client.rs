//! Who sent a request, for scoping its key: the [`IdentifyClient`] trait and the
//! identifiers the layer ships (a header, the `Authorization` credentials, an
//! extension an authentication layer set).

use std::{fmt, marker::PhantomData};

use http::{header, HeaderMap, HeaderName, HeaderValue, Request};

use crate::idempotency::ClientId;

/// Tells which client sent a request, so keys are scoped per client.
///
/// Three answers:
/// - `Ok(Some(client))`: the request comes from `client`; its keys are its own.
/// - `Ok(None)`: no identifiable client. The key is then global to the route, shared
///   with every other caller without one (see the [module docs](crate::idempotency)),
///   unless the layer has [`require_client`](crate::idempotency::IdempotencyLayer::require_client),
///   which answers `401`.
/// - `Err(ClientRejection)`: the request names its client ambiguously or wrongly (say,
///   two different API keys); the layer answers `400 idempotency.client_invalid` and
///   neither the handler nor the store sees the request.
///
/// Never identify a client by IP address or `User-Agent`: neither is unique to a
/// client nor stable across its retries.
///
/// Implemented for closures `Fn(&Request<B>) -> Option<ClientId>` and
/// `Fn(&Request<B>) -> Result<Option<ClientId>, ClientRejection>` (see
/// [`IntoClientIdentity`]):
///
/// ```
/// use http::Request;
/// use tower_ids::idempotency::{
///     extract::{IdentifyClient, ClientRejection},
///     ClientId, IdempotencyLayer,
/// };
///
/// // A tenant header: absent is no client; anything but one short value is refused.
/// let tenant = |request: &Request<()>| {
///     let mut tenants = request.headers().get_all("x-tenant").iter();
///     match (tenants.next(), tenants.next()) {
///         (None, _) => Ok(None),
///         (Some(tenant), None) if tenant.len() <= 64 => Ok(Some(ClientId::new(tenant))),
///         _ => Err(ClientRejection::new("send one x-tenant header of at most 64 bytes")),
///     }
/// };
/// let twice = Request::post("/").header("x-tenant", "a").header("x-tenant", "b").body(())?;
/// assert_eq!(tenant.identify_client(&twice).unwrap_err().reason(), "refused");
/// let layer = IdempotencyLayer::new().client(tenant);
///
/// // Or an `Option`, for a client that is known or not but never refused.
/// let user = |request: &Request<()>| request.extensions().get::<String>().map(ClientId::new);
/// assert_eq!(user.identify_client(&Request::new(())), Ok(None));
/// # Ok::<(), http::Error>(())
/// ```
pub trait IdentifyClient<B> {
    /// The client of `request`, if known, or why the request cannot be accepted.
    fn identify_client(&self, request: &Request<B>) -> Result<Option<ClientId>, ClientRejection>;
}

impl<B, F, R> IdentifyClient<B> for F
where
    F: Fn(&Request<B>) -> R,
    R: IntoClientIdentity,
{
    fn identify_client(&self, request: &Request<B>) -> Result<Option<ClientId>, ClientRejection> {
        self(request).into_client_identity()
    }
}

/// What a closure used as an [`IdentifyClient`] returns: `Option<ClientId>`, for a
/// client that is known or not, or `Result<Option<ClientId>, ClientRejection>`, to
/// refuse a request too.
pub trait IntoClientIdentity {
    /// The answer as [`IdentifyClient::identify_client`] gives it.
    fn into_client_identity(self) -> Result<Option<ClientId>, ClientRejection>;
}

impl IntoClientIdentity for Option<ClientId> {
    fn into_client_identity(self) -> Result<Option<ClientId>, ClientRejection> {
        Ok(self)
    }
}

impl IntoClientIdentity for Result<Option<ClientId>, ClientRejection> {
    fn into_client_identity(self) -> Result<Option<ClientId>, ClientRejection> {
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
pub struct ClientRejection(ClientError);

#[derive(Debug, Clone, PartialEq, Eq)]
enum ClientError {
    Repeated(HeaderName),
    Refused(&'static str),
}

impl ClientRejection {
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

    /// A short stable reason: `repeated` or `refused`.
    pub fn reason(&self) -> &'static str {
        match self.0 {
            ClientError::Repeated(_) => "repeated",
            ClientError::Refused(_) => "refused",
        }
    }

    /// The `reason` of the `idempotency.rejected` event, for every transport.
    pub(crate) fn logged_reason(&self) -> &'static str {
        match self.0 {
            ClientError::Repeated(_) => "client_repeated",
            ClientError::Refused(_) => "client_refused",
        }
    }
}

impl fmt::Display for ClientRejection {
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

impl std::error::Error for ClientRejection {}

/// No client identity: keys are global to the route.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoClient;

impl<B> IdentifyClient<B> for NoClient {
    fn identify_client(&self, _request: &Request<B>) -> Result<Option<ClientId>, ClientRejection> {
        Ok(None)
    }
}

/// The one value of header `name`: `None` when absent or empty, refused when repeated
/// with different values (a repeat of the same value is that value, as for the
/// idempotency key).
fn single_value<'r>(
    headers: &'r HeaderMap,
    name: &HeaderName,
) -> Result<Option<&'r HeaderValue>, ClientRejection> {
    let mut values = headers.get_all(name).iter();
    let Some(first) = values.next() else {
        return Ok(None);
    };
    if values.any(|value| value != first) {
        return Err(ClientRejection::repeated(name.clone()));
    }
    Ok((!first.is_empty()).then_some(first))
}

/// The client is the value of a header, such as an API key in `x-api-key`.
///
/// Absent or empty: no client. Sent twice with different values: refused
/// ([`ClientRejection::repeated`]), never the first one silently.
#[derive(Debug, Clone)]
pub struct ClientFromHeader(HeaderName);

impl ClientFromHeader {
    /// Identifies clients by the value of `name`.
    pub fn new(name: HeaderName) -> Self {
        Self(name)
    }
}

impl<B> IdentifyClient<B> for ClientFromHeader {
    fn identify_client(&self, request: &Request<B>) -> Result<Option<ClientId>, ClientRejection> {
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
    fn identify_client(&self, request: &Request<B>) -> Result<Option<ClientId>, ClientRejection> {
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
    fn identify_client(&self, request: &Request<B>) -> Result<Option<ClientId>, ClientRejection> {
        Ok(request.extensions().get::<T>().map(ClientId::new))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(headers: &[(&str, &str)]) -> Request<()> {
        let mut request = Request::post("/");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        request.body(()).unwrap()
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
        assert_eq!((key.reason(), auth.reason()), ("repeated", "repeated"));
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
        fn check<C: IdentifyClient<()>>(identify: C) -> Result<Option<ClientId>, ClientRejection> {
            identify.identify_client(&request(&[("x-user", "u1")]))
        }
        let user = |request: &Request<()>| request.headers().get("x-user").map(ClientId::new);
        assert_eq!(check(user), Ok(Some(ClientId::new("u1"))));
        let refuse = |_: &Request<()>| -> Result<Option<ClientId>, ClientRejection> {
            Err(ClientRejection::new("no users today"))
        };
        let refused = check(refuse).unwrap_err();
        assert_eq!(refused.reason(), "refused");
        assert_eq!(refused.to_string(), "no users today");
        assert_eq!(check(NoClient), Ok(None));
    }
}
