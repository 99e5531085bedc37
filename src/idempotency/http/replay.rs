//! What a duplicate gets: the stored response, adjusted per route by a replay hook.

use std::borrow::Cow;

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use serde_json::Value;

use crate::idempotency::ReplayInfo;

/// Adjusts what a duplicate gets, from the stored response: its status, its headers,
/// its body. Set per route with
/// [`IdempotencyLayer::on_replay`](crate::idempotency::IdempotencyLayer::on_replay).
///
/// The hook gets a copy: the stored record is never changed, so every duplicate starts
/// from the response the handler gave, and a hook that runs twice does not compound.
/// It runs before the layer's replay headers (`idempotent-replayed: true`,
/// `idempotency-request-count`, ...) are added, so it cannot hide that the answer is a
/// replay; it does not run for a `410` (no response was kept) or for any refusal.
/// After it, a `Content-Length` the response carries is set to the body's new length.
///
/// **A replay never changes a stored status that is not a success**: the hook sees the
/// stored status (`response.status()`) and may mark the body of any replay, but a
/// status it sets is kept only over a stored 2xx. A stored refusal or failure is
/// replayed with its own status, so a client never reads a success for it, and a
/// problem's `status` member always equals the response's.
///
/// Implemented for closures `Fn(&mut Response<Bytes>, &ReplayInfo)`. For an API whose
/// contract says a replay answers `200 OK` with `"replay": true` in its JSON body,
/// [`JsonReplayMarker`] is ready-made:
///
/// ```
/// use bytes::Bytes;
/// use http::{Response, StatusCode};
/// use tower_ids::idempotency::{IdempotencyLayer, JsonReplayMarker, KeyFromJson, ReplayInfo};
///
/// // A partner contract's realtime calls: `200` with `"replay": true` on every replay.
/// let realtime = IdempotencyLayer::new()
///     .key(KeyFromJson::new("/correlation_id").client("/partner_id"))
///     .on_replay(JsonReplayMarker::new("replay").status(StatusCode::OK));
///
/// // The same, by hand, with a header of your own.
/// let by_hand = IdempotencyLayer::new().on_replay(
///     |response: &mut Response<Bytes>, replay: &ReplayInfo| {
///         *response.status_mut() = StatusCode::OK;
///         let count = replay.request_count().to_string();
///         response.headers_mut().insert("x-replays", count.parse().unwrap());
///     },
/// );
/// # let _ = (realtime, by_hand);
/// ```
pub trait OnReplay: Send + Sync + 'static {
    /// Adjusts `response`, a copy of the stored one, for the duplicate described by
    /// `replay`.
    fn on_replay(&self, response: &mut Response<Bytes>, replay: &ReplayInfo);
}

impl<F> OnReplay for F
where
    F: Fn(&mut Response<Bytes>, &ReplayInfo) + Send + Sync + 'static,
{
    fn on_replay(&self, response: &mut Response<Bytes>, replay: &ReplayInfo) {
        self(response, replay);
    }
}

/// Marks a replayed JSON object: sets a boolean field to `true`, and optionally the
/// status (a contract that answers `201` the first time and `200` to a replay).
///
/// A body that is not a JSON object is left as it is (the status is still set): a
/// problem the handler answered with, say, stays byte for byte what it was. Set on a
/// replay only; the first answer is the handler's, so give it the field as `false`
/// if your clients expect it always.
#[derive(Debug, Clone)]
pub struct JsonReplayMarker {
    field: Cow<'static, str>,
    status: Option<StatusCode>,
}

impl JsonReplayMarker {
    /// Sets the top-level field `field` (`"replay"`) to `true` on every replay.
    pub fn new(field: impl Into<Cow<'static, str>>) -> Self {
        Self {
            field: field.into(),
            status: None,
        }
    }

    /// Answers replays of a stored success with `status` (say `200`); a stored 4xx or
    /// 5xx keeps its own status (see [`OnReplay`]).
    pub fn status(mut self, status: StatusCode) -> Self {
        self.status = Some(status);
        self
    }
}

impl OnReplay for JsonReplayMarker {
    fn on_replay(&self, response: &mut Response<Bytes>, _replay: &ReplayInfo) {
        if let Some(status) = self.status {
            *response.status_mut() = status;
        }
        let Ok(Value::Object(mut object)) = serde_json::from_slice::<Value>(response.body()) else {
            return;
        };
        object.insert(self.field.to_string(), Value::Bool(true));
        if let Ok(bytes) = serde_json::to_vec(&object) {
            *response.body_mut() = Bytes::from(bytes);
        }
    }
}

/// Runs `hook` on `response`, then makes a `Content-Length` it carries true again.
pub(super) fn apply(
    hook: &dyn OnReplay,
    mut response: Response<Bytes>,
    replay: &ReplayInfo,
) -> Response<Bytes> {
    let stored = response.status();
    hook.on_replay(&mut response, replay);
    if !stored.is_success() {
        *response.status_mut() = stored;
    }
    if response.headers().contains_key(header::CONTENT_LENGTH) {
        let len = HeaderValue::from(response.body().len());
        response.headers_mut().insert(header::CONTENT_LENGTH, len);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::SystemTime;

    fn info() -> ReplayInfo {
        ReplayInfo {
            request_count: 2,
            first_seen: SystemTime::UNIX_EPOCH,
            original_attempt: None,
            expires_at: None,
        }
    }

    fn stored(status: StatusCode, body: &'static str) -> Response<Bytes> {
        let mut response = Response::new(Bytes::from_static(body.as_bytes()));
        *response.status_mut() = status;
        response
            .headers_mut()
            .insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
        response
    }

    #[test]
    fn a_json_object_is_marked_and_its_length_follows() {
        let marker = JsonReplayMarker::new("replay").status(StatusCode::OK);
        let replay = apply(
            &marker,
            stored(StatusCode::CREATED, r#"{"movement":"m-1"}"#),
            &info(),
        );
        assert_eq!(replay.status(), StatusCode::OK);
        let body: Value = serde_json::from_slice(replay.body()).unwrap();
        assert_eq!(body, serde_json::json!({"movement": "m-1", "replay": true}));
        assert_eq!(
            replay.headers()[header::CONTENT_LENGTH],
            replay.body().len().to_string().as_str()
        );
    }

    #[test]
    fn a_stored_refusal_or_failure_keeps_its_status() {
        let marker = JsonReplayMarker::new("replay").status(StatusCode::OK);
        let by_hand = |response: &mut Response<Bytes>, _: &ReplayInfo| {
            *response.status_mut() = StatusCode::OK;
        };
        let problem = r#"{"type":"about:blank","status":403}"#;
        for hook in [&marker as &dyn OnReplay, &by_hand] {
            for (status, expected) in [
                (StatusCode::CREATED, StatusCode::OK),
                (StatusCode::FORBIDDEN, StatusCode::FORBIDDEN),
                (
                    StatusCode::UNPROCESSABLE_ENTITY,
                    StatusCode::UNPROCESSABLE_ENTITY,
                ),
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    StatusCode::INTERNAL_SERVER_ERROR,
                ),
            ] {
                let replay = apply(hook, stored(status, problem), &info());
                assert_eq!(replay.status(), expected, "stored {status}");
            }
        }
    }

    #[test]
    fn a_body_that_is_not_an_object_is_left_alone() {
        let marker = JsonReplayMarker::new("replay");
        for body in ["[1,2]", "plain text", ""] {
            let replay = apply(&marker, stored(StatusCode::ACCEPTED, body), &info());
            assert_eq!(replay.body(), body.as_bytes());
            assert_eq!(replay.status(), StatusCode::ACCEPTED);
        }
    }
}
