use std::{
    fmt,
    future::Future,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{SystemTime, UNIX_EPOCH},
};

use base64::{engine::general_purpose::URL_SAFE_NO_PAD, Engine as _};
use bytes::Bytes;
use http::HeaderValue;
use tokio::task::futures::TaskLocalFuture;
use tracing::{instrument::Instrumented, Instrument as _};
use uuid::Uuid;

/// Longest correlation ID accepted from outside, and the bound extension respects.
///
/// 128 bytes holds a UUID (36) with several levels of extension, and is short enough that
/// a hostile client cannot make every log line carry a kilobyte of its choosing.
pub const DEFAULT_MAX_LEN: usize = 128;

/// Separator between a correlation ID and an extension (`abcd.1`, `abcd.1.Qz4`).
pub const EXTENSION_SEPARATOR: char = '.';

/// The smallest length bound a layer accepts: a generated UUIDv7 (36 bytes) must fit.
pub const MIN_MAX_LEN: usize = 36;

/// Random bits in [`CorrelationId::extend_random`]: among ten siblings the chance of any
/// two colliding is 45 in 2^24, about one in 370,000; they encode to 4 base64url
/// characters.
pub const RANDOM_EXTENSION_BITS: u32 = 24;

/// Seconds per tick of the coarse clock in [`CorrelationId::extend_redelivery`]. A queue
/// rarely redelivers faster than this, so consecutive deliveries land in different ticks.
pub const REDELIVERY_TICK_SECS: u64 = 30;

tokio::task_local! {
    static CURRENT: CorrelationId;
}

/// The correlation ID of one unit of work (one attempt).
///
/// Cheap to clone: clones share one allocation, including the counter behind
/// [`next_child`](Self::next_child), so the handler, the task-local and the outbound
/// layer all number the children of one request from the same sequence.
///
/// A `CorrelationId` always holds a valid value: 1 to its length bound of letters,
/// digits and `-._:` (see [`CorrelationId::parse`]), so it is safe in a log line and
/// in a header.
///
/// See the [module docs](crate) for the layers that create it.
#[derive(Clone)]
pub struct CorrelationId(Arc<Inner>);

struct Inner {
    value: HeaderValue,
    max_len: usize,
    children: AtomicU64,
}

impl CorrelationId {
    /// A fresh UUIDv7 (time-ordered, 74 random bits), bounded by [`DEFAULT_MAX_LEN`].
    pub fn new() -> Self {
        Self::new_with_max_len(DEFAULT_MAX_LEN)
    }

    pub(crate) fn new_with_max_len(max_len: usize) -> Self {
        let mut buf = [0u8; uuid::fmt::Hyphenated::LENGTH];
        // No shared context: per-process monotonicity costs a lock and buys nothing for
        // an ID that only has to be unique; the 74 random bits make it so.
        let uuid = Uuid::new_v7(uuid::Timestamp::now(uuid::NoContext));
        uuid.hyphenated().encode_lower(&mut buf);
        // Bytes that own the array: one allocation that holds its own reference count,
        // where a copied `Vec` would allocate again on its first clone.
        let value = HeaderValue::from_maybe_shared(Bytes::from_owner(buf))
            .expect("a UUID is a valid header value");
        Self::from_trusted(value, max_len)
    }

    /// Parses an ID under the default rules: 1 to [`DEFAULT_MAX_LEN`] bytes of ASCII
    /// letters, digits and `-`, `.`, `_`, `:`.
    pub fn parse(value: &str) -> Result<Self, CorrelationIdError> {
        Self::parse_with(value, DEFAULT_MAX_LEN, &DefaultValidator)
    }

    /// Parses an ID with a custom length bound and validator.
    ///
    /// The bound and "visible ASCII" always apply; the validator decides the rest.
    pub fn parse_with<V: ValidateCorrelationId + ?Sized>(
        value: &str,
        max_len: usize,
        validator: &V,
    ) -> Result<Self, CorrelationIdError> {
        let header = HeaderValue::from_str(value)
            .map_err(|_| CorrelationIdError::new(Reason::NotVisibleAscii))?;
        Self::from_header_value(&header, max_len, validator)
    }

    /// Validates a header value and takes it as an ID without copying it.
    pub(crate) fn from_header_value<V: ValidateCorrelationId + ?Sized>(
        value: &HeaderValue,
        max_len: usize,
        validator: &V,
    ) -> Result<Self, CorrelationIdError> {
        let len = value.len();
        if len == 0 {
            return Err(CorrelationIdError::new(Reason::Empty));
        }
        if len > max_len {
            return Err(CorrelationIdError::new(Reason::TooLong { len, max_len }));
        }
        let bytes = value.as_bytes();
        // Any validator sees visible ASCII only (VCHAR: no space, tab or control, nothing
        // past 0x7e). Folding without short-circuit lets the loop vectorise.
        let visible = bytes
            .iter()
            .fold(true, |ok, &b| ok & (b.wrapping_sub(0x21) < 0x5e));
        if !visible {
            return Err(CorrelationIdError::new(Reason::NotVisibleAscii));
        }
        let text = std::str::from_utf8(bytes)
            .map_err(|_| CorrelationIdError::new(Reason::NotVisibleAscii))?;
        validator.validate(text)?;
        Ok(Self::from_trusted(value.clone(), max_len))
    }

    fn from_trusted(value: HeaderValue, max_len: usize) -> Self {
        Self(Arc::new(Inner {
            value,
            max_len,
            children: AtomicU64::new(0),
        }))
    }

    /// Returns the same ID bounded by `max_len` for its extensions.
    pub(crate) fn with_max_len(self, max_len: usize) -> Self {
        if self.0.max_len == max_len {
            self
        } else {
            Self::from_trusted(self.0.value.clone(), max_len)
        }
    }

    /// The ID as text.
    pub fn as_str(&self) -> &str {
        // Every constructor checked the value is visible ASCII.
        self.0.value.to_str().unwrap_or_default()
    }

    /// The ID as a header value (a reference-counted clone, no copy).
    pub fn to_header_value(&self) -> HeaderValue {
        self.0.value.clone()
    }

    /// The length bound this ID's extensions respect.
    pub fn max_len(&self) -> usize {
        self.0.max_len
    }

    /// The current task's correlation ID, set by [`CorrelationLayer`](super::CorrelationLayer)
    /// or [`scope`](Self::scope).
    ///
    /// Task-locals do not follow `tokio::spawn`: hand the ID to the new task with
    /// `tokio::spawn(id.next_child().scope(work))`.
    pub fn current() -> Option<Self> {
        CURRENT.try_with(Self::clone).ok()
    }

    /// Whether the current task has an ID ([`current`](Self::current) without the
    /// clone).
    #[doc(hidden)]
    pub fn is_current() -> bool {
        CURRENT.try_with(|_| ()).is_ok()
    }

    /// Runs `future` with this ID as the task-local and inside a `correlation` span
    /// carrying `correlation_id`.
    pub fn scope<F: Future>(self, future: F) -> Instrumented<TaskLocalFuture<Self, F>> {
        let span = tracing::info_span!(target: "tower_ids::correlation", "correlation", correlation_id = %self);
        CURRENT.scope(self, future).instrument(span)
    }

    /// Runs `f` with this ID as the task-local (no span); for synchronous code.
    pub fn sync_scope<R>(self, f: impl FnOnce() -> R) -> R {
        CURRENT.sync_scope(self, f)
    }

    /// Runs `future` with this ID as the task-local, without a span of its own: for a
    /// consumer that makes its own span (record `correlation_id` in it).
    pub fn task_local<F: Future>(self, future: F) -> TaskLocalFuture<Self, F> {
        CURRENT.scope(self, future)
    }

    /// The next child of this ID by sequence: `id.1`, `id.2`, ... .
    ///
    /// The counter belongs to this ID and is shared by its clones, so children of one
    /// parent are numbered uniquely however many places create them. Use it for work
    /// spawned by iteration. If the child would pass the length bound, a fresh ID
    /// replaces it (see [`replace`](Self::replace)).
    pub fn next_child(&self) -> Self {
        let n = self.0.children.fetch_add(1, Ordering::Relaxed) + 1;
        self.extend_unchecked(itoa::Buffer::new().format(n))
            .unwrap_or_else(|| self.replace_because("too_long"))
    }

    /// Extends this ID with a random suffix of [`RANDOM_EXTENSION_BITS`] bits, 4
    /// base64url characters (`id.Qz4_`), for children created without knowledge of
    /// their siblings.
    pub fn extend_random(&self) -> Self {
        let bits = rand::random::<u32>() & ((1 << RANDOM_EXTENSION_BITS) - 1);
        let bytes = bits.to_be_bytes();
        let suffix = URL_SAFE_NO_PAD.encode(&bytes[1..]);
        self.extend_unchecked(&suffix)
            .unwrap_or_else(|| self.replace_because("too_long"))
    }

    /// Extends this ID for one delivery of a queue message that may be delivered again:
    /// the low 8 bits of a 30-second clock ([`REDELIVERY_TICK_SECS`]) and 10 random
    /// bits, 3 base64url characters (`id.Aq9`).
    ///
    /// The 8-bit tick wraps every 256 ticks (2 h 8 min): deliveries in different ticks
    /// of one such window never collide, two in the same tick collide with a chance of
    /// one in 1,024, and so do two exactly a whole window apart.
    pub fn extend_redelivery(&self) -> Self {
        self.extend_redelivery_at(SystemTime::now())
    }

    /// [`extend_redelivery`](Self::extend_redelivery) at a given time, for tests and
    /// for consumers that read the delivery time from the message.
    pub fn extend_redelivery_at(&self, delivered_at: SystemTime) -> Self {
        let secs = delivered_at
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let tick = (secs / REDELIVERY_TICK_SECS) & 0xff;
        let random = u64::from(rand::random::<u16>() & 0x3ff);
        let bits = (tick << 10) | random; // 18 bits
        let bytes = bits.to_be_bytes();
        let suffix = URL_SAFE_NO_PAD.encode(&bytes[5..]);
        // Three bytes encode to four characters of which the first carries the six
        // unused high bits; dropping it keeps exactly the 18 meaningful bits.
        self.extend_unchecked(&suffix[1..])
            .unwrap_or_else(|| self.replace_because("too_long"))
    }

    /// Extends this ID with a suffix of your own, such as an item's identifier.
    ///
    /// The suffix is checked by the default rules; an extension past the length bound
    /// replaces the ID instead.
    pub fn extend(&self, suffix: &str) -> Result<Self, CorrelationIdError> {
        if suffix.is_empty() {
            return Err(CorrelationIdError::new(Reason::Empty));
        }
        DefaultValidator.validate(suffix)?;
        Ok(self
            .extend_unchecked(suffix)
            .unwrap_or_else(|| self.replace_because("too_long")))
    }

    /// `self.suffix`, or `None` when that passes the length bound.
    fn extend_unchecked(&self, suffix: &str) -> Option<Self> {
        let parent = self.as_str();
        let len = parent.len() + 1 + suffix.len();
        if len > self.0.max_len {
            return None;
        }
        let mut text = String::with_capacity(len);
        text.push_str(parent);
        text.push(EXTENSION_SEPARATOR);
        text.push_str(suffix);
        let value = HeaderValue::from_str(&text).ok()?;
        Some(Self::from_trusted(value, self.0.max_len))
    }

    /// Replaces this ID with a fresh one and ties the two together in the log.
    ///
    /// Emits, at INFO, `Replacing correlation id` (`corr_id` = old, `new_corr_id` = new)
    /// and then `Replaced correlation id` (`corr_id` = new, `old_corr_id` = old), so a
    /// search for either ID finds the link. Put the new ID in place with
    /// [`scope`](Self::scope).
    pub fn replace(&self) -> Self {
        self.replace_because("replaced")
    }

    /// Replaces this ID with `new`, emitting the same pair of events as
    /// [`replace`](Self::replace).
    pub fn replace_with(&self, new: Self) -> Self {
        announce_replacement(self.as_str(), new.as_str(), "replaced");
        new
    }

    fn replace_because(&self, reason: &'static str) -> Self {
        let new = Self::new_with_max_len(self.0.max_len);
        announce_replacement(self.as_str(), new.as_str(), reason);
        new
    }

    /// Combines several units of work into one: a fresh ID, and the replace pair of
    /// events once for each incoming ID, all naming the same new ID.
    ///
    /// An ID given twice is announced once. The new ID takes the largest length bound
    /// among the incoming ones (the default bound when there are none).
    pub fn combine<'a>(ids: impl IntoIterator<Item = &'a CorrelationId>) -> Self {
        let mut incoming: Vec<&CorrelationId> = Vec::new();
        for id in ids {
            if !incoming.contains(&id) {
                incoming.push(id);
            }
        }
        let max_len = incoming
            .iter()
            .map(|id| id.max_len())
            .max()
            .unwrap_or(DEFAULT_MAX_LEN);
        let new = Self::new_with_max_len(max_len);
        for old in incoming {
            announce_replacement(old.as_str(), new.as_str(), "combined");
        }
        new
    }

    /// Adopts the real ID once it is known, leaving this provisional one.
    ///
    /// Work that starts before the real ID can be read (parsing, validating,
    /// deduplicating a message) runs under a fresh provisional ID; when the real one is
    /// extracted (the `correlationId` of an envelope, say) this validates it with the
    /// default rules and emits the replace pair from the provisional ID to it. An invalid
    /// value is refused with a WARN event that never carries the value itself.
    pub fn restore(&self, real: &str) -> Result<Self, CorrelationIdError> {
        match Self::parse_with(real, self.0.max_len, &DefaultValidator) {
            Ok(real) => {
                announce_replacement(self.as_str(), real.as_str(), "restored");
                Ok(real)
            }
            Err(invalid) => {
                tracing::warn!(
                    target: "tower_ids::correlation",
                    event = "correlation.restore_rejected",
                    corr_id = self.as_str(),
                    reason = invalid.reason(),
                    detail = %invalid,
                    "Refused to restore an invalid correlation id"
                );
                Err(invalid)
            }
        }
    }
}

fn announce_replacement(old: &str, new: &str, reason: &'static str) {
    tracing::info!(
        target: "tower_ids::correlation",
        event = "correlation.replacing",
        corr_id = old,
        new_corr_id = new,
        reason,
        "Replacing correlation id"
    );
    tracing::info!(
        target: "tower_ids::correlation",
        event = "correlation.replaced",
        corr_id = new,
        old_corr_id = old,
        reason,
        "Replaced correlation id"
    );
}

impl Default for CorrelationId {
    fn default() -> Self {
        Self::new()
    }
}

impl PartialEq for CorrelationId {
    fn eq(&self, other: &Self) -> bool {
        self.0.value == other.0.value
    }
}

impl Eq for CorrelationId {}

impl std::hash::Hash for CorrelationId {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_str().hash(state);
    }
}

impl PartialEq<str> for CorrelationId {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for CorrelationId {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl fmt::Display for CorrelationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for CorrelationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("CorrelationId")
            .field(&self.as_str())
            .finish()
    }
}

impl std::str::FromStr for CorrelationId {
    type Err = CorrelationIdError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

/// Serialises as the plain string, for message envelopes.
impl serde::Serialize for CorrelationId {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

/// Deserialises with the default rules ([`CorrelationId::parse`]); an invalid value is
/// an error that does not repeat it. To adopt the ID of a message you started working
/// on under a provisional one, deserialise a `String` and use
/// [`restore`](CorrelationId::restore) instead, which logs the link.
impl<'de> serde::Deserialize<'de> for CorrelationId {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        Self::parse(&text).map_err(serde::de::Error::custom)
    }
}

impl From<&CorrelationId> for HeaderValue {
    fn from(id: &CorrelationId) -> Self {
        id.to_header_value()
    }
}

/// Why a correlation ID was refused.
///
/// Its `Display` and [`reason`](Self::reason) describe the value (its length, the position
/// of the first bad byte) but never repeat it, so they are safe to log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CorrelationIdError {
    reason: Reason,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Reason {
    Empty,
    TooLong { len: usize, max_len: usize },
    NotVisibleAscii,
    InvalidCharacter { position: usize },
    MultipleValues,
    Custom(&'static str),
}

impl CorrelationIdError {
    fn new(reason: Reason) -> Self {
        Self { reason }
    }

    /// A refusal by a custom validator; `reason` is a short stable code, such as
    /// `"not_a_uuid"`, that goes into the WARN event and the problem response.
    pub fn custom(reason: &'static str) -> Self {
        Self::new(Reason::Custom(reason))
    }

    pub(crate) fn multiple_values() -> Self {
        Self::new(Reason::MultipleValues)
    }

    pub(crate) fn not_visible_ascii() -> Self {
        Self::new(Reason::NotVisibleAscii)
    }

    /// A short stable reason: `empty`, `too_long`, `not_visible_ascii`,
    /// `invalid_character`, `multiple_values`, or a custom validator's code.
    pub fn reason(&self) -> &'static str {
        match self.reason {
            Reason::Empty => "empty",
            Reason::TooLong { .. } => "too_long",
            Reason::NotVisibleAscii => "not_visible_ascii",
            Reason::InvalidCharacter { .. } => "invalid_character",
            Reason::MultipleValues => "multiple_values",
            Reason::Custom(code) => code,
        }
    }
}

impl fmt::Display for CorrelationIdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.reason {
            Reason::Empty => f.write_str("the correlation id is empty"),
            Reason::TooLong { len, max_len } => write!(
                f,
                "the correlation id is {len} bytes long, more than the {max_len} allowed"
            ),
            Reason::NotVisibleAscii => {
                f.write_str("the correlation id holds a space, a control character or a byte that is not ASCII")
            }
            Reason::InvalidCharacter { position } => write!(
                f,
                "the correlation id holds a character other than letters, digits and -._: at byte {position}"
            ),
            Reason::MultipleValues => f.write_str("the correlation id header appears more than once"),
            Reason::Custom(code) => write!(f, "the correlation id was refused: {code}"),
        }
    }
}

impl std::error::Error for CorrelationIdError {}

/// Decides whether an incoming correlation ID may be used.
///
/// Runs after the layer has checked the length bound and that the value is visible
/// ASCII. Implemented for closures `Fn(&str) -> Result<(), CorrelationIdError>`.
///
/// ```
/// use tower_ids_correlation::{CorrelationLayer, CorrelationIdError};
///
/// // Accept only UUIDs.
/// let layer = CorrelationLayer::new().validator(|id: &str| {
///     uuid::Uuid::try_parse(id)
///         .map(|_| ())
///         .map_err(|_| CorrelationIdError::custom("not_a_uuid"))
/// });
/// # let _ = layer;
/// ```
pub trait ValidateCorrelationId {
    /// `Ok(())` to accept `candidate`.
    fn validate(&self, candidate: &str) -> Result<(), CorrelationIdError>;
}

impl<F> ValidateCorrelationId for F
where
    F: Fn(&str) -> Result<(), CorrelationIdError>,
{
    fn validate(&self, candidate: &str) -> Result<(), CorrelationIdError> {
        self(candidate)
    }
}

/// The default rules: ASCII letters, digits, and the separators `-`, `.`, `_`, `:`.
///
/// Those separators cover UUIDs, ULIDs, tower-http's request IDs, and this crate's
/// extensions (`.` and base64url's `-` and `_`); nothing a log format or a shell would
/// read as markup gets through.
#[derive(Debug, Clone, Copy, Default)]
pub struct DefaultValidator;

impl ValidateCorrelationId for DefaultValidator {
    fn validate(&self, candidate: &str) -> Result<(), CorrelationIdError> {
        let bytes = candidate.as_bytes();
        if bytes.iter().fold(true, |ok, &b| ok & is_id_byte(b)) {
            return Ok(());
        }
        let position = bytes.iter().position(|&b| !is_id_byte(b)).unwrap_or(0);
        Err(CorrelationIdError::new(Reason::InvalidCharacter {
            position,
        }))
    }
}

fn is_id_byte(b: u8) -> bool {
    ID_BYTES[usize::from(b)]
}

/// The default alphabet as a table: one load per byte on the hot path.
static ID_BYTES: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        table[b] = c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_' | b':');
        b += 1;
    }
    table
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_accepts_the_default_alphabet() {
        for ok in [
            "a",
            "abcd-efgh.1",
            "01J9Z3:tenant_7",
            &"x".repeat(DEFAULT_MAX_LEN),
        ] {
            assert_eq!(CorrelationId::parse(ok).unwrap().as_str(), ok);
        }
    }

    #[test]
    fn parse_refuses_with_a_reason_that_never_holds_the_value() {
        let too_long = "y".repeat(DEFAULT_MAX_LEN + 1);
        let cases = [
            ("", "empty"),
            (too_long.as_str(), "too_long"),
            ("has space", "not_visible_ascii"),
            ("quote\"", "invalid_character"),
            ("ünïcode", "not_visible_ascii"),
            ("tab\there", "not_visible_ascii"),
            ("bell\u{7}", "not_visible_ascii"),
        ];
        for (value, code) in cases {
            let error = CorrelationId::parse(value).unwrap_err();
            assert_eq!(error.reason(), code, "{value:?}");
            if !value.is_empty() {
                assert!(
                    !error.to_string().contains(value),
                    "{error} repeats the value"
                );
            }
        }
    }

    #[test]
    fn serde_round_trip_validates() {
        let id = CorrelationId::parse("abc-1").unwrap();
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(json, "\"abc-1\"");
        assert_eq!(serde_json::from_str::<CorrelationId>(&json).unwrap(), id);
        let error = serde_json::from_str::<CorrelationId>("\"bad value\"").unwrap_err();
        assert!(!error.to_string().contains("bad value"));
    }

    #[test]
    fn new_ids_are_uuid_v7_and_distinct() {
        let a = CorrelationId::new();
        let b = CorrelationId::new();
        assert_ne!(a, b);
        assert_eq!(Uuid::parse_str(a.as_str()).unwrap().get_version_num(), 7);
    }

    #[test]
    fn extend_checks_the_suffix() {
        let parent = CorrelationId::parse("p").unwrap();
        assert_eq!(parent.extend("item-9").unwrap(), "p.item-9");
        assert_eq!(parent.extend("").unwrap_err().reason(), "empty");
        assert_eq!(
            parent.extend("a/b").unwrap_err().reason(),
            "invalid_character"
        );
    }

    #[test]
    fn a_custom_bound_applies_to_extensions() {
        let parent = CorrelationId::parse_with(&"p".repeat(38), 40, &DefaultValidator).unwrap();
        assert_eq!(parent.max_len(), 40);
        assert_eq!(parent.next_child().as_str().len(), 40, "`.1` still fits");
        let replaced = parent.extend("ab").unwrap();
        assert!(
            Uuid::parse_str(replaced.as_str()).is_ok(),
            "past the bound: a fresh UUID"
        );
        assert_eq!(replaced.max_len(), 40, "which keeps the bound");
    }
}
