use std::{error::Error, fmt, time::Duration};

use http::StatusCode;

/// Why the retry layer ended without a response.
///
/// When the last attempt got a response, the layer returns it as `Ok`, even a `503`
/// after every attempt was used: the response (its status, its problem body) says more
/// than an error could, and [`RetryOutcome`](super::RetryOutcome) on its extensions
/// says why the layer stopped. An `Err` means there was no response to return:
///
/// | Variant | The layer stopped because |
/// |---|---|
/// | [`Transport`](Self::Transport) | the inner client failed (connect, reset, closed early) and no retry followed |
/// | [`TimedOut`](Self::TimedOut) | the last attempt got no response within the per-attempt timeout, and no retry followed |
/// | [`DeadlineExceeded`](Self::DeadlineExceeded) | the overall deadline passed during an attempt, or came before the retry could start |
/// | [`BodyNotReplayable`](Self::BodyNotReplayable) | a retry was due but the request's streaming body was already sent |
///
/// `E` is the inner client's error (`hyper_util::client::legacy::Error` for hyper-util).
/// See the [module docs](super) for the retry rules.
#[derive(Debug)]
#[non_exhaustive]
pub enum RetryError<E> {
    /// The inner client failed on the last attempt: every attempt was used
    /// (`exhausted`), or the request was not safe to repeat, or the client was no
    /// longer ready for a retry (`exhausted == false`).
    #[non_exhaustive]
    Transport {
        /// Attempts made, this one included.
        attempts: u32,
        /// `true` when the attempt limit stopped the layer.
        exhausted: bool,
        /// The inner client's error.
        source: E,
    },
    /// The last attempt got no response within the per-attempt timeout: every attempt
    /// was used (`exhausted`), or the request was not safe to repeat.
    #[non_exhaustive]
    TimedOut {
        /// Attempts made, this one included.
        attempts: u32,
        /// `true` when the attempt limit stopped the layer.
        exhausted: bool,
        /// The per-attempt timeout.
        timeout: Duration,
    },
    /// The overall deadline passed during an attempt (which was abandoned), or the last
    /// attempt failed without a response and the next could not start before it.
    #[non_exhaustive]
    DeadlineExceeded {
        /// Attempts made, the abandoned one included.
        attempts: u32,
        /// The deadline, counted from the call.
        deadline: Duration,
        /// The status of the last response received, if any attempt got one.
        last_status: Option<StatusCode>,
        /// The inner client's error, when the last attempt failed with one.
        source: Option<E>,
    },
    /// A retry was due, but the request body streams and was already sent once; the
    /// layer never sends a body twice, nor passes a failed attempt off as the answer.
    /// Buffer the body ([`ReplayBody::buffered`](super::ReplayBody::buffered),
    /// `http_body_util::Full`) to make the request retryable.
    #[non_exhaustive]
    BodyNotReplayable {
        /// Attempts made (the one that sent the body included).
        attempts: u32,
        /// The status of the last attempt, when it got a (retryable) response.
        last_status: Option<StatusCode>,
        /// The inner client's error, when the last attempt failed with one.
        source: Option<E>,
    },
}

impl<E> RetryError<E> {
    /// Attempts made.
    pub fn attempts(&self) -> u32 {
        match self {
            Self::Transport { attempts, .. }
            | Self::TimedOut { attempts, .. }
            | Self::DeadlineExceeded { attempts, .. }
            | Self::BodyNotReplayable { attempts, .. } => *attempts,
        }
    }

    /// `true` when the attempt limit stopped the layer.
    pub fn is_exhausted(&self) -> bool {
        matches!(
            self,
            Self::Transport {
                exhausted: true,
                ..
            } | Self::TimedOut {
                exhausted: true,
                ..
            }
        )
    }

    /// The status of the last response received, if any attempt got one.
    pub fn last_status(&self) -> Option<StatusCode> {
        match self {
            Self::DeadlineExceeded { last_status, .. }
            | Self::BodyNotReplayable { last_status, .. } => *last_status,
            Self::Transport { .. } | Self::TimedOut { .. } => None,
        }
    }

    /// The inner client's error from the last attempt, if it failed with one.
    pub fn inner(&self) -> Option<&E> {
        match self {
            Self::Transport { source, .. } => Some(source),
            Self::DeadlineExceeded { source, .. } | Self::BodyNotReplayable { source, .. } => {
                source.as_ref()
            }
            Self::TimedOut { .. } => None,
        }
    }

    /// The inner client's error from the last attempt, if it failed with one.
    pub fn into_inner(self) -> Option<E> {
        match self {
            Self::Transport { source, .. } => Some(source),
            Self::DeadlineExceeded { source, .. } | Self::BodyNotReplayable { source, .. } => {
                source
            }
            Self::TimedOut { .. } => None,
        }
    }

    /// A stable code: `client.transport`, `client.timed_out`, `client.deadline_exceeded`
    /// or `client.body_not_replayable`.
    pub fn code(&self) -> &'static str {
        match self {
            Self::Transport { .. } => "client.transport",
            Self::TimedOut { .. } => "client.timed_out",
            Self::DeadlineExceeded { .. } => "client.deadline_exceeded",
            Self::BodyNotReplayable { .. } => "client.body_not_replayable",
        }
    }
}

fn plural(n: u32) -> &'static str {
    if n == 1 {
        "attempt"
    } else {
        "attempts"
    }
}

impl<E: fmt::Display> fmt::Display for RetryError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let attempts = self.attempts();
        let word = plural(attempts);
        match self {
            Self::Transport {
                exhausted, source, ..
            } => {
                let why = if *exhausted {
                    "every attempt used"
                } else {
                    "not retried"
                };
                write!(f, "request failed after {attempts} {word} ({why}): {source}")
            }
            Self::TimedOut {
                exhausted, timeout, ..
            } => {
                let why = if *exhausted {
                    "every attempt used"
                } else {
                    "not retried"
                };
                write!(
                    f,
                    "no response within {timeout:?} after {attempts} {word} ({why})"
                )
            }
            Self::DeadlineExceeded { deadline, .. } => {
                write!(f, "the retry deadline of {deadline:?} passed after {attempts} {word}")
            }
            Self::BodyNotReplayable { .. } => write!(
                f,
                "a retry was due after {attempts} {word} but the streaming request body was already sent; buffer it to make the request retryable"
            ),
        }
    }
}

impl<E: Error + 'static> Error for RetryError<E> {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.inner().map(|e| e as &(dyn Error + 'static))
    }
}
