//! The idempotency key and the attempt ID as the wire carries them: parsed from their
//! headers (a bare token or the draft's quoted string), validated before they reach a
//! log line.

use std::fmt;

use http::{HeaderMap, HeaderName, HeaderValue};
use tower_ids_correlation::Carrier;

use super::header::{ATTEMPT_ID, IDEMPOTENCY_KEY};
use crate::KeyRejection;

/// A client's idempotency key: opaque, 1 to [`MAX_LEN`](Self::MAX_LEN) visible ASCII
/// characters.
///
/// Parsed from a bare token (`abc-123`) or the draft's structured-field string
/// (`"abc-123"`); both name the same key. Cheap to clone.
#[derive(Clone)]
pub struct IdempotencyKey(
    // A header value, so a bare key shares the request header's bytes and is echoed on
    // the response without a copy.
    HeaderValue,
);

impl IdempotencyKey {
    /// Longest idempotency key accepted, in characters: enough for any UUID, ULID or
    /// derived digest, and a bound on what one key costs the store.
    pub const MAX_LEN: usize = 255;

    /// Parses a header value: a structured-field Item whose value is a String (RFC
    /// 8941, `"abc-123"`, with `\"` and `\\` escapes and any parameters, which are
    /// ignored: `"abc-123";p=1` is `abc-123`), or a bare token (`abc-123`, any visible
    /// ASCII, taken whole).
    pub fn parse(raw: &[u8]) -> Result<Self, KeyRejection> {
        let raw = trim_ows(raw);
        match raw.first() {
            Some(b'"') => Self::new(&sf_string(raw)?),
            _ => Self::new(std::str::from_utf8(raw).map_err(|_| KeyError::NotVisibleAscii)?),
        }
    }

    /// [`parse`](Self::parse) for a header value: a bare key keeps the value's bytes
    /// rather than copying them.
    #[doc(hidden)]
    pub fn from_header_value(value: &HeaderValue) -> Result<Self, KeyRejection> {
        let bytes = value.as_bytes();
        match bytes {
            [b'"' | b' ' | b'\t', ..] | [.., b' ' | b'\t'] => Self::parse(bytes),
            _ => {
                let text = std::str::from_utf8(bytes).map_err(|_| KeyError::NotVisibleAscii)?;
                check_visible(text, Self::MAX_LEN)?;
                Ok(Self(value.clone()))
            }
        }
    }

    /// Takes `text` as it is, as a key from a message or a body field, where no header
    /// quoting applies: 1 to [`MAX_LEN`](Self::MAX_LEN) visible ASCII characters, else refused.
    pub fn new(text: &str) -> Result<Self, KeyRejection> {
        check_visible(text, Self::MAX_LEN)?;
        let value = HeaderValue::from_str(text).map_err(|_| KeyError::NotVisibleAscii)?;
        Ok(Self(value))
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        // Every constructor checked it is visible ASCII.
        self.0.to_str().unwrap_or_default()
    }

    /// The key as a header value (shared, not copied), as `Idempotency-Key` echoes it:
    /// the layers' and the retry layer's path; [`as_str`](Self::as_str) is yours.
    #[doc(hidden)]
    pub fn to_header_value(&self) -> HeaderValue {
        self.0.clone()
    }

    /// Reads the key from the headers `names` (the layer's are `Idempotency-Key` and
    /// `X-Idempotency-Key`).
    ///
    /// `Ok(None)` when none is present. A header sent on more than one line is refused
    /// (`repeated`), even with the same key on each: RFC 9110 (section 5.3) combines
    /// the lines into one value, `"k", "k"`, which is not an RFC 8941 Item, and RFC 8941
    /// (section 4.2) says such a field must be ignored as a whole, never taken apart.
    /// Two of the headers must name the same key, else the request is refused as
    /// ambiguous (`conflicting`).
    pub fn from_headers(
        headers: &HeaderMap,
        names: &[HeaderName],
    ) -> Result<Option<Self>, KeyRejection> {
        let mut found: Option<(Self, &HeaderName)> = None;
        for name in names {
            let mut values = headers.get_all(name).iter();
            let Some(first) = values.next() else {
                continue;
            };
            if values.next().is_some() {
                return Err(KeyError::Repeated { name: name.clone() }.into());
            }
            let key = Self::from_header_value(first)?;
            match &found {
                Some((previous, first_name)) if *previous != key => {
                    return Err(KeyError::Conflicting {
                        first: (*first_name).clone(),
                        second: name.clone(),
                    }
                    .into());
                }
                Some(_) => {}
                None => found = Some((key, name)),
            }
        }
        Ok(found.map(|(key, _)| key))
    }
}

// By text: a header value's hash would include its `sensitive` flag, which its
// equality ignores.
impl PartialEq for IdempotencyKey {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for IdempotencyKey {}

impl std::hash::Hash for IdempotencyKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_str().hash(state);
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("IdempotencyKey")
            .field(&self.as_str())
            .finish()
    }
}

/// The client's attempt ID (`attempt-id`): 1 to 128 visible ASCII characters (a counter
/// or a UUID fits many times over), echoed on the response and never used to decide a duplicate.
#[derive(Clone, PartialEq, Eq)]
pub struct AttemptId(HeaderValue);

impl AttemptId {
    const MAX_LEN: usize = 128;

    /// Reads `attempt-id`: `Ok(None)` when absent; refused when repeated or not 1 to
    /// 128 visible ASCII characters.
    #[doc(hidden)]
    pub fn from_headers(headers: &HeaderMap) -> Result<Option<Self>, KeyRejection> {
        let mut values = headers.get_all(ATTEMPT_ID).iter();
        let Some(value) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(KeyError::AttemptId.into());
        }
        let text = std::str::from_utf8(value.as_bytes()).map_err(|_| KeyError::AttemptId)?;
        check_visible(text, Self::MAX_LEN).map_err(|_| KeyError::AttemptId)?;
        Ok(Some(Self(value.clone())))
    }

    /// Wraps a stored attempt ID.
    #[doc(hidden)]
    pub fn from_header_value(value: HeaderValue) -> Self {
        Self(value)
    }

    /// The attempt ID a store kept as `bytes`; `None` for bytes no header carries.
    #[doc(hidden)]
    pub fn from_stored(bytes: &[u8]) -> Option<Self> {
        HeaderValue::from_bytes(bytes)
            .ok()
            .map(Self::from_header_value)
    }

    /// The attempt ID as text.
    pub fn as_str(&self) -> &str {
        self.0.to_str().unwrap_or_default()
    }

    /// The attempt ID as a header value.
    #[doc(hidden)]
    pub fn to_header_value(&self) -> HeaderValue {
        self.0.clone()
    }
}

impl fmt::Debug for AttemptId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("AttemptId").field(&self.as_str()).finish()
    }
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

/// The String of an RFC 8941 Item: `"` chars `"`, where chars are printable ASCII
/// and `\` only escapes `"` or `\`, followed by any parameters, which are ignored.
fn sf_string(raw: &[u8]) -> Result<String, KeyError> {
    let item: sfv::Item = sfv::Parser::new(raw)
        .with_version(sfv::Version::Rfc8941)
        .parse_item()
        .map_err(|_| KeyError::MalformedString)?;
    match item.bare_item {
        sfv::BareItem::String(text) => Ok(text.as_str().to_owned()),
        _ => Err(KeyError::MalformedString),
    }
}

fn check_visible(text: &str, max_len: usize) -> Result<(), KeyError> {
    if text.is_empty() {
        return Err(KeyError::Empty);
    }
    if text.len() > max_len {
        return Err(KeyError::TooLong { len: text.len() });
    }
    if !text.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
        return Err(KeyError::NotVisibleAscii);
    }
    Ok(())
}

/// Why an idempotency key (or attempt ID) was refused: the text of a
/// [`KeyRejection`]. Neither its `Display` nor its reason repeats the value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KeyError {
    Empty,
    TooLong {
        len: usize,
    },
    NotVisibleAscii,
    MalformedString,
    /// One header sent on several lines.
    Repeated {
        name: HeaderName,
    },
    /// Two headers naming different keys.
    Conflicting {
        first: HeaderName,
        second: HeaderName,
    },
    AttemptId,
}

impl KeyError {
    /// A short stable reason: `empty`, `too_long`, `not_visible_ascii`, `malformed_string`,
    /// `repeated` (one key header sent on more than one line), `conflicting` (two
    /// key headers with different keys) or `invalid_attempt_id`.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            KeyError::Empty => "empty",
            KeyError::TooLong { .. } => "too_long",
            KeyError::NotVisibleAscii => "not_visible_ascii",
            KeyError::MalformedString => "malformed_string",
            KeyError::Repeated { .. } => "repeated",
            KeyError::Conflicting { .. } => "conflicting",
            KeyError::AttemptId => "invalid_attempt_id",
        }
    }

    /// The code every transport refuses this key (or attempt ID) with.
    pub(crate) fn refusal(&self) -> crate::Code {
        use crate::Code;
        match self {
            KeyError::AttemptId => Code::AttemptIdInvalid,
            KeyError::Repeated { .. } => Code::KeyRepeated,
            KeyError::Conflicting { .. } => Code::KeysDisagree,
            _ => Code::KeyInvalid,
        }
    }
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyError::Empty => f.write_str("the idempotency key is empty"),
            KeyError::TooLong { len } => write!(
                f,
                "the idempotency key is {len} characters long, more than the {} allowed",
                IdempotencyKey::MAX_LEN
            ),
            KeyError::NotVisibleAscii => f.write_str(
                "the idempotency key holds a space, a control character or a non-ASCII byte",
            ),
            KeyError::MalformedString => f.write_str(
                "the idempotency key starts with a quote but is not a valid structured-field string",
            ),
            // The names are the layer's configured key headers, never the client's text.
            KeyError::Repeated { name } => write!(
                f,
                "the {name} header was sent more than once; send it once"
            ),
            KeyError::Conflicting { first, second } => write!(
                f,
                "the {first} and {second} headers name different idempotency keys; they must agree"
            ),
            KeyError::AttemptId => write!(
                f,
                "the attempt-id header must appear once, with 1 to {} visible ASCII characters",
                AttemptId::MAX_LEN
            ),
        }
    }
}

/// A message's key, carried in its headers as its correlation ID is.
impl IdempotencyKey {
    /// The key in a message's `idempotency-key` header: `Ok(None)` when absent; refused
    /// when not 1 to 255 visible ASCII characters (taken as it is, no header quoting).
    pub fn from_carrier(carrier: &impl Carrier) -> Result<Option<Self>, KeyRejection> {
        let Some(raw) = carrier.get(IDEMPOTENCY_KEY.as_str()) else {
            return Ok(None);
        };
        let text = std::str::from_utf8(raw)
            .map_err(|_| KeyRejection::new("the idempotency-key header is not text"))?;
        Ok(Some(Self::new(text)?))
    }

    /// Writes this key into the `idempotency-key` header of an outgoing message (with
    /// the correlation ID, [`MessageCorrelation::inject`](tower_ids_correlation::MessageCorrelation::inject)),
    /// unless it carries one.
    pub fn inject(&self, carrier: &mut impl Carrier) {
        if carrier.get(IDEMPOTENCY_KEY.as_str()).is_none() {
            carrier.set(IDEMPOTENCY_KEY.as_str(), self.as_str());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::header::{IDEMPOTENCY_KEY, X_IDEMPOTENCY_KEY};

    #[test]
    fn bare_and_quoted_forms_name_the_same_key() {
        let bare = IdempotencyKey::parse(b"abc-123").unwrap();
        let quoted = IdempotencyKey::parse(b"\"abc-123\"").unwrap();
        assert_eq!(bare, quoted);
        assert_eq!(
            IdempotencyKey::parse(br#""a\"b\\c""#).unwrap().as_str(),
            r#"a"b\c"#
        );
    }

    #[test]
    fn an_item_with_parameters_is_its_string() {
        // RFC 8941 section 3.1.2: parameters a recipient does not know are ignored.
        for raw in [
            &b"\"abc\";p=1"[..],
            b"\"abc\"; a; b=?0; c=\"x\";d=1.5",
            b" \"abc\";p ",
        ] {
            assert_eq!(
                IdempotencyKey::parse(raw).unwrap().as_str(),
                "abc",
                "{raw:?}"
            );
        }
        // Not an Item: a list, a parameter key in capitals, a string followed by junk.
        for raw in [
            &b"\"a\", \"b\""[..],
            b"\"abc\";P=1",
            b"\"abc\"x",
            b"\"abc\";p=",
            b"\"abc\";",
        ] {
            assert_eq!(
                IdempotencyKey::parse(raw).unwrap_err().reason(),
                "malformed_string",
                "{raw:?}"
            );
        }
    }

    #[test]
    fn refusals_have_codes() {
        let long = "k".repeat(IdempotencyKey::MAX_LEN + 1);
        for (raw, code) in [
            (&b""[..], "empty"),
            (b"\"\"", "empty"),
            (long.as_bytes(), "too_long"),
            (b"has space", "not_visible_ascii"),
            (b"\"has space\"", "not_visible_ascii"),
            (b"\"unterminated", "malformed_string"),
            (br#""bad\escape""#, "malformed_string"),
            (b"caf\xc3\xa9", "not_visible_ascii"),
        ] {
            assert_eq!(
                IdempotencyKey::parse(raw).unwrap_err().reason(),
                code,
                "{raw:?}"
            );
        }
        assert!(IdempotencyKey::parse("k".repeat(IdempotencyKey::MAX_LEN).as_bytes()).is_ok());
    }

    fn headers(pairs: &[(&HeaderName, &str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.append(*name, HeaderValue::from_str(value).unwrap());
        }
        headers
    }

    #[test]
    fn a_repeated_header_and_two_disagreeing_headers_are_told_apart() {
        let names = [IDEMPOTENCY_KEY, X_IDEMPOTENCY_KEY];
        let read =
            |pairs: &[(&HeaderName, &str)]| IdempotencyKey::from_headers(&headers(pairs), &names);

        let repeated = read(&[(&IDEMPOTENCY_KEY, "a"), (&IDEMPOTENCY_KEY, "b")]).unwrap_err();
        assert_eq!(repeated.reason(), "repeated");
        assert_eq!(
            repeated.to_string(),
            "the idempotency-key header was sent more than once; send it once"
        );
        let disagree = read(&[(&IDEMPOTENCY_KEY, "a"), (&X_IDEMPOTENCY_KEY, "b")]).unwrap_err();
        assert_eq!(disagree.reason(), "conflicting");
        assert_eq!(
            disagree.to_string(),
            "the idempotency-key and x-idempotency-key headers name different idempotency keys; they must agree"
        );
        // The repeat is found before the disagreement, whatever the order of values.
        let both = read(&[
            (&X_IDEMPOTENCY_KEY, "a"),
            (&IDEMPOTENCY_KEY, "a"),
            (&IDEMPOTENCY_KEY, "b"),
        ]);
        assert_eq!(both.unwrap_err().reason(), "repeated");

        // RFC 8941 section 4.2: `a, a` is not an Item, so even the same key twice is
        // refused.
        let same = read(&[(&IDEMPOTENCY_KEY, "a"), (&IDEMPOTENCY_KEY, "a")]);
        assert_eq!(same.unwrap_err().reason(), "repeated");
        // The two headers naming one key, in either form, are one key.
        let agree = read(&[(&IDEMPOTENCY_KEY, "a"), (&X_IDEMPOTENCY_KEY, "\"a\"")]);
        assert_eq!(agree.unwrap().unwrap().as_str(), "a");
        assert_eq!(read(&[]).unwrap(), None);
    }

    fn quote(text: &str) -> String {
        let mut quoted = String::from("\"");
        for c in text.chars() {
            if c == '"' || c == '\\' {
                quoted.push('\\');
            }
            quoted.push(c);
        }
        quoted.push('"');
        quoted
    }

    proptest::proptest! {
        #[test]
        fn any_visible_token_is_its_own_key(text in "[!#-~][!-~]{0,254}") {
            // Starts with anything visible but a quote: a bare token.
            let key = IdempotencyKey::parse(text.as_bytes()).unwrap();
            proptest::prop_assert_eq!(key.as_str(), text.as_str());
        }

        #[test]
        fn quoting_round_trips(text in "[!-~]{1,255}") {
            let key = IdempotencyKey::parse(quote(&text).as_bytes()).unwrap();
            proptest::prop_assert_eq!(key.as_str(), text.as_str());
        }

        #[test]
        fn anything_else_is_refused_with_a_code(raw in proptest::collection::vec(proptest::num::u8::ANY, 0..300)) {
            match IdempotencyKey::parse(&raw) {
                Ok(key) => {
                    let len = key.as_str().len();
                    proptest::prop_assert!((1..=IdempotencyKey::MAX_LEN).contains(&len));
                    proptest::prop_assert!(key.as_str().bytes().all(|b| (0x21..=0x7e).contains(&b)));
                }
                Err(error) => {
                    proptest::prop_assert!(!error.reason().is_empty());
                }
            }
        }

        #[test]
        fn too_long_is_refused(text in "[!#-~]{256,400}") {
            proptest::prop_assert_eq!(IdempotencyKey::parse(text.as_bytes()).unwrap_err().reason(), "too_long");
        }
    }
}
