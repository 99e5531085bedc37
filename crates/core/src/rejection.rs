//! Why a key extractor refused a request or a message: the HTTP layer's and the
//! message layer's extractors say it the same way.

use std::{borrow::Cow, fmt};

use crate::{key::KeyError, Code};

/// Why a request's key could not be read; the layer answers `400` (see
/// [`code`](Self::code)) and logs a WARN `idempotency.rejected`.
///
/// Its text names where the key was looked for (a header or a field the server
/// configured) and what was wrong, never the request's own text.
#[derive(Debug, Clone)]
pub struct KeyRejection {
    kind: Kind,
}

#[derive(Debug, Clone)]
enum Kind {
    Key(KeyError),
    NotJson,
    FieldNotString {
        pointer: Cow<'static, str>,
    },
    FieldInvalid {
        pointer: Cow<'static, str>,
        error: KeyError,
    },
    ClientField {
        pointer: Cow<'static, str>,
        missing: bool,
    },
    Refused(&'static str),
}

impl KeyRejection {
    /// Refuses the request's key with `message`, which the client reads:
    /// `400 idempotency.key_invalid`.
    pub fn new(message: &'static str) -> Self {
        Self {
            kind: Kind::Refused(message),
        }
    }

    /// The refusal's [`Code`]: [`KeyInvalid`](Code::KeyInvalid),
    /// [`KeyRepeated`](Code::KeyRepeated), [`KeysDisagree`](Code::KeysDisagree),
    /// [`AttemptIdInvalid`](Code::AttemptIdInvalid), [`BodyNotJson`](Code::BodyNotJson)
    /// or [`ClientInvalid`](Code::ClientInvalid).
    pub fn code(&self) -> Code {
        match &self.kind {
            Kind::Key(error) => error.refusal(),
            Kind::NotJson => Code::BodyNotJson,
            Kind::ClientField { .. } => Code::ClientInvalid,
            Kind::FieldNotString { .. } | Kind::FieldInvalid { .. } | Kind::Refused(_) => {
                Code::KeyInvalid
            }
        }
    }

    /// A short stable reason for the log line: the key parser's (`empty`, `too_long`,
    /// `not_visible_ascii`, `malformed_string`, `repeated` for one key header sent on more
    /// than one line, `conflicting` for two key headers with different keys,
    /// `invalid_attempt_id`), `body_not_json`, `field_not_string`,
    /// `field_invalid`, `client_field_missing`, `client_field_invalid` or `refused`.
    pub fn reason(&self) -> &'static str {
        match &self.kind {
            Kind::Key(error) => error.reason(),
            Kind::NotJson => "body_not_json",
            Kind::FieldNotString { .. } => "field_not_string",
            Kind::FieldInvalid { .. } => "field_invalid",
            Kind::ClientField { missing: true, .. } => "client_field_missing",
            Kind::ClientField { missing: false, .. } => "client_field_invalid",
            Kind::Refused(_) => "refused",
        }
    }
}

impl KeyRejection {
    #[doc(hidden)]
    pub fn not_json() -> Self {
        Self {
            kind: Kind::NotJson,
        }
    }

    #[doc(hidden)]
    pub fn field_invalid(pointer: Cow<'static, str>, rejection: KeyRejection) -> Self {
        match rejection.kind {
            Kind::Key(error) => Self {
                kind: Kind::FieldInvalid { pointer, error },
            },
            _ => rejection,
        }
    }

    #[doc(hidden)]
    pub fn field_not_string(pointer: Cow<'static, str>) -> Self {
        Self {
            kind: Kind::FieldNotString { pointer },
        }
    }

    #[doc(hidden)]
    pub fn client_field(pointer: Cow<'static, str>, missing: bool) -> Self {
        Self {
            kind: Kind::ClientField { pointer, missing },
        }
    }
}

impl From<KeyError> for KeyRejection {
    fn from(error: KeyError) -> Self {
        Self {
            kind: Kind::Key(error),
        }
    }
}

impl fmt::Display for KeyRejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Key(error) => error.fmt(f),
            Kind::NotJson => f.write_str(
                "this route reads the idempotency key from the JSON body, and the body is not JSON",
            ),
            Kind::FieldNotString { pointer } => {
                write!(f, "the {pointer} field of the body, the idempotency key, must be a string")
            }
            Kind::FieldInvalid { pointer, error } => {
                write!(f, "the {pointer} field of the body: {error}")
            }
            Kind::ClientField {
                pointer,
                missing: true,
            } => write!(f, "the {pointer} field of the body, which names the client, is missing"),
            Kind::ClientField {
                pointer,
                missing: false,
            } => write!(
                f,
                "the {pointer} field of the body, which names the client, must be a non-empty string or an integer"
            ),
            Kind::Refused(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for KeyRejection {}
