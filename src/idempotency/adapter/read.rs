//! Reading a covered call's body: within the size limit and the layer's byte budget,
//! whole, so it can be fingerprinted, and handed on unchanged.

use std::future::Future;

use bytes::Bytes;
use http::{header, Request, Response};

use super::Reply;
use crate::body::Body;
use crate::idempotency::{
    collect::{read_within, BoxError, Read, Reservation},
    core::{refusal, Answer},
    transport::Transport,
};

/// A request whose body is read whole, with the bytes it holds of the layer's budget.
type ReadRequest<B> = (Request<Body<B>>, Reservation);

/// Reads the whole body so it can be fingerprinted, and hands it on unchanged, with
/// the bytes it holds of the layer's budget; or the answer that refuses it: too large,
/// the budget full now, or failed mid-read. The refusals are counted (`rejected`) and
/// logged here, as the engine never sees them.
//
// An `async` block, made after the request is taken apart: an `async fn` would keep the
// request as captured and its head again as a local across the read (see `service::run`).
#[allow(clippy::manual_async_fn)]
pub(super) fn read_body<'a, T, B, R>(
    request: Request<B>,
    reply: Reply<'a, T>,
) -> impl Future<Output = Result<ReadRequest<B>, Response<Body<R>>>> + 'a
where
    T: Transport,
    B: http_body::Body<Data = Bytes> + Unpin + 'a,
    B::Error: Into<BoxError>,
    R: 'a,
{
    let (parts, body) = request.into_parts();
    async move {
        let budget = &reply.settings.budget;
        // A body larger than the whole budget could never be read: too large, not busy.
        let max = reply.settings.max_request_bytes.min(budget.capacity());
        let too_large = || {
            refusal::body_too_large(max);
            reply.answer(Answer::body_too_large(T::NOUN, max))
        };
        let declared = parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let declared = match declared.map(usize::try_from) {
            Some(Ok(len)) if len <= max => Some(len),
            Some(_) => return Err(too_large()),
            None => None,
        };
        let mut reservation = budget.reserve();
        match read_within(body, max, declared, &mut reservation).await {
            Read::Complete(bytes) => Ok((
                Request::from_parts(parts, Body::complete(bytes)),
                reservation,
            )),
            Read::TooLarge => Err(too_large()),
            Read::Overloaded { requested } => {
                refusal::overloaded(budget.capacity(), requested);
                Err(reply.answer(Answer::overloaded(T::NOUN)))
            }
            Read::Failed(error) => {
                refusal::body_unreadable(&error);
                Err(reply.answer(Answer::body_unreadable(T::NOUN)))
            }
        }
    }
}
