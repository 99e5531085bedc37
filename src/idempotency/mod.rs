//! Idempotency keys: run each user action once, replay its response to every retry.
//!
//! The client sends an `Idempotency-Key` that stays the same across every retry of one
//! action (and a new correlation ID, and optionally an `attempt-id`, per attempt). The
//! first request runs; its full response (status, every header, body) is stored; every
//! duplicate within the TTL gets that response back, byte for byte, without reaching
//! the handler. The contract follows the IETF Idempotency-Key draft and Stripe.
//!
//! # Example
//!
//! ```no_run
//! use axum::{routing::{get, post}, Router};
//! use http::HeaderName;
//! use tower_ids::{
//!     correlation::CorrelationLayer,
//!     idempotency::{ClientFromHeader, IdempotencyLayer, MokaStore},
//! };
//!
//! async fn create() -> &'static str { "created" }
//! async fn list() -> &'static str { "[]" }
//!
//! # async fn run() {
//! let store = MokaStore::new(); // one store, shared by every route that uses it
//! let idempotent = IdempotencyLayer::with_store(store)
//!     .client(ClientFromHeader::new(HeaderName::from_static("x-api-key")))
//!     .require_key(true);
//!
//! let app: Router = Router::new()
//!     .route("/commands", post(create).layer(idempotent).get(list))
//!     .layer(CorrelationLayer::new()); // outermost: its span covers the idempotency events
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await.unwrap();
//! axum::serve(listener, app).await.unwrap();
//! # }
//! ```
//!
//! # The contract
//!
//! (For messages rather than HTTP requests, see [`message`].)
//!
//! - **Key**: `Idempotency-Key`, or `X-Idempotency-Key` (both present and different:
//!   `400 idempotency.keys_disagree`; one of them repeated with different values:
//!   `400 idempotency.key_repeated`; repeated with the same key: accepted, see
//!   [`IdempotencyKey::from_headers`]). A bare token or the draft's quoted
//!   structured-field string (`"abc"` and `abc` are one key). Opaque, 1 to 255
//!   visible ASCII characters, else `400`. Covered methods: `POST` and `PATCH` by
//!   default. With
//!   [`require_key`](IdempotencyLayer::require_key) a covered request without a key is
//!   `400`; otherwise it passes through untouched.
//! - **Key from the payload**: with [`key`](IdempotencyLayer::key) the key comes from
//!   an [`ExtractKey`](extract::ExtractKey) instead: [`KeyFromJson`] (a string field of the JSON body,
//!   named by a JSON pointer, optionally with a client field:
//!   `KeyFromJson::new("/correlation_id").client("/partner_id")`), or a closure over
//!   the request's parts and its buffered body. The body is then read before the key
//!   is known (within the same limits); a body that is not JSON is `400
//!   idempotency.body_not_json`, a key field that is not a string `400
//!   idempotency.key_invalid`, a missing client field `400 idempotency.client_invalid`.
//! - **Scope**: client + method + path (+ the query, with
//!   [`scope_query`](IdempotencyLayer::scope_query)) + key, hashed. The client comes
//!   from an [`IdentifyClient`](extract::IdentifyClient) (an API key header, the `Authorization` credentials, an
//!   auth layer's extension), hashed, never stored raw, and never the IP address or
//!   `User-Agent`. A client header sent twice with different values is `400
//!   idempotency.client_invalid` (which one the authentication checked cannot be
//!   known), never the first value silently. Without a client the key is global to
//!   the route, shared with every other caller without one: clients should then send
//!   UUIDv7 (or v4) keys, because anyone who can guess another client's key can make
//!   that client's request look like a duplicate. On a route that identifies clients,
//!   [`require_client`](IdempotencyLayer::require_client) refuses a request with a key
//!   but no client (`401`) instead of scoping it globally.
//! - **Fingerprint**: a hash of method, path, query, content type and body: XXH3-128
//!   where the scope is one client's, SHA-256 where every caller shares it (why, and
//!   how records written before still match: [`Fingerprint`]). The same
//!   key with another fingerprint is `422`, never a replay, never a second run. The
//!   content type is compared as a media type: `Application/JSON;Charset=utf-8` and
//!   `application/json; charset=utf-8` are one (parameter values are compared as sent;
//!   see [`Fingerprint::new`]). The body is read up to 1 MiB (more: `413`) and handed
//!   on unchanged, within a byte budget shared by the requests in flight (over it:
//!   `503` with `Retry-After`; see [Memory](#memory)).
//! - **First request**: runs; the response is read up to 1 MiB and stored with its
//!   status, every header in order (repeats kept), body, arrival time and attempt ID.
//!   Server errors are stored too, as the draft's section 2.6 asks, so a handler that
//!   failed after its side effect never runs again; a handler's own refusal (a 4xx)
//!   and `503` release the key, so a corrected request under the same key runs
//!   ([`StorageRule`] says why; the [`Policy`]'s other rules, or a rule of the route's
//!   own with [`store_if`](IdempotencyLayer::store_if), change it per route). A refusal the layer makes itself is never stored. A response over the limit is streamed
//!   to this client and not stored; the request is recorded as run, and later
//!   duplicates get `410 Gone` (`idempotency.not_replayable`) rather than a truncated
//!   replay or a second run.
//! - **Duplicate**: the stored status, headers and body; the per-attempt headers
//!   (correlation ID, `attempt-id`, `Date`) are this attempt's. `Set-Cookie` is stored
//!   but not replayed (see [`not_replayed`](IdempotencyLayer::not_replayed)). A
//!   per-route [`on_replay`](IdempotencyLayer::on_replay) hook ([`OnReplay`]) may
//!   adjust a copy of it (say `200` with `"replay": true`, [`JsonReplayMarker`]); the
//!   stored record never changes.
//! - **In flight**: a duplicate of a request still running gets `409` with
//!   `Retry-After`, or, with [`InFlight::Wait`], waits for the outcome and replays it.
//!   Either way the handler runs once.
//! - **The client goes away**: the handler runs in the request's own task; if the
//!   client disconnects and the response future is dropped mid-handler, the rest of the
//!   work moves to a task of its own (same span, same correlation ID), runs to
//!   completion, and its outcome is stored for the retry. A handler that panics or
//!   fails releases the key; waiters get `409` `idempotency.original_failed`.
//! - **TTL** 24 h ([`Policy::ttl`]); expired keys run again. A **lease** of 10 s
//!   ([`Policy::lease`]) on requests in flight: the claim holds the key for the lease
//!   and half again and is renewed every quarter of it while the handler runs, so a
//!   handler may run longer than its lease, a store outage shorter than the lease never
//!   frees a running request's key, and a lost worker locks its key for at most one
//!   and a half leases.
//! - **No store command acts after its request gave up.** Every command to Redis or
//!   PostgreSQL carries a deadline by the store's own clock and changes nothing past
//!   it, so a claim answered `503` (it sat in a paused server's socket) never takes
//!   the key when the server comes back.
//! - **Once the handler has produced an outcome, the key is never released.** If the
//!   store cannot take the outcome, the client still gets its answer; the layer keeps
//!   the outcome (up to [`max_kept_bytes`](Policy::max_kept_bytes)) and
//!   stores it from a task of its own, with backoff, renewing the claim, until it is
//!   stored; duplicates get `409` (or wait) meanwhile. [The guarantees
//!   page](crate::guide::guarantees) says what holds under which fault, for each store.
//! - **A graceful stop drains**: [`drain`](IdempotencyLayer::drain) gives a
//!   [`Drain`] to wait on, once the server has stopped taking requests, for detached
//!   handlers and kept outcomes; what it cannot settle by its deadline is named in a
//!   WARN ([a graceful stop](crate::guide::guarantees#a-graceful-stop)).
//! - **Stores**: [`MokaStore`] in process (the default), `RedisStore` (feature
//!   `redis`) for a service that runs as several replicas, or `PostgresStore` (feature
//!   `postgres`) for records that outlive anything, with the handler's writes committed
//!   in the record's transaction.
//! - **Store failure** when a request arrives: `503` and nothing runs (fail closed,
//!   the default), or run without deduplication with a WARN
//!   ([`StoreFailure::FailOpen`]).
//! - **Epoch binding** (optional, [`epoch`](IdempotencyLayer::epoch)): the control
//!   epoch a key is first seen in is stored with it; the same key in another epoch is
//!   `422 idempotency.epoch_mismatch`, never replayed and never run.
//!
//! # Headers
//!
//! | Header | On | Meaning |
//! |---|---|---|
//! | `Idempotency-Key` / `X-Idempotency-Key` | request | the key, stable across retries |
//! | `attempt-id` | request | the client's name for this attempt; never used to decide a duplicate |
//! | `idempotent-replayed` | every response of the layer | `true` on a replay, else `false` |
//! | `Idempotency-Key` | every response to a request with a valid key | the key, echoed (under this name whichever header carried it), unless the handler set the header |
//! | `attempt-id` | response | this request's attempt ID, echoed |
//! | `original-attempt-id` | replay | the attempt ID of the request that ran, else its correlation ID |
//! | `idempotency-first-seen` | replay, `409`, `410` | when the original request arrived (HTTP-date); not on a `409` for a request held by another's open transaction (PostgreSQL's transactional mode), whose arrival the store cannot see |
//! | `idempotency-request-count` | replay, `409`, `410` | requests seen with this key, this one included; not on a `409` for a request held by another's open transaction, as for `idempotency-first-seen` |
//! | `idempotency-expires` | a stored answer, first and replayed, on a route with [`expiry_header(true)`](IdempotencyLayer::expiry_header) (off by default) | when the stored answer expires and the key runs again (HTTP-date) |
//! | `Retry-After` | `409`, `503` | seconds to wait before retrying |
//!
//! # Status codes
//!
//! All are `application/problem+json` (RFC 9457) with a stable `code`, and two
//! extension members naming the request: `correlation_id` (this attempt's, as in the
//! `x-correlation-id` response header) and `idempotency_key` (when the request sent a
//! valid one):
//!
//! ```json
//! {"type":"https://docs.rs/tower-ids/latest/tower_ids/idempotency/index.html#idempotency.in_flight",
//!  "title":"Request in progress",
//!  "status":409,"detail":"…","code":"idempotency.in_flight",
//!  "correlation_id":"attempt-2","idempotency_key":"order-17"}
//! ```
//!
//! Every `code` is a [`Code`], the same on the gRPC layer and the message layer.
//!
//! | Status | `code` | When |
//! |---|---|---|
//! | `400` | <a id="idempotency.key_missing"></a>`idempotency.key_missing` | `require_key` and no key |
//! | `400` | <a id="idempotency.key_invalid"></a>`idempotency.key_invalid` | empty, too long, not visible ASCII, malformed quoted string |
//! | `400` | <a id="idempotency.keys_disagree"></a>`idempotency.keys_disagree` | `Idempotency-Key` and `X-Idempotency-Key` differ |
//! | `400` | <a id="idempotency.key_repeated"></a>`idempotency.key_repeated` | one key header sent twice with different values |
//! | `400` | <a id="idempotency.attempt_id_invalid"></a>`idempotency.attempt_id_invalid` | `attempt-id` repeated or not 1 to 128 visible ASCII |
//! | `400` | <a id="idempotency.client_invalid"></a>`idempotency.client_invalid` | the [`IdentifyClient`](extract::IdentifyClient) refused the request: a client header (`x-api-key`, `Authorization`) sent twice with different values, or its own reason ([`ClientRejection`](extract::ClientRejection)) |
//! | `400` | <a id="idempotency.body_unreadable"></a>`idempotency.body_unreadable` | the request body failed mid-read |
//! | `400` | <a id="idempotency.body_not_json"></a>`idempotency.body_not_json` | the key is read from the JSON body ([`KeyFromJson`]) and the body is not JSON |
//! | `401` | <a id="idempotency.client_missing"></a>`idempotency.client_missing` | with [`require_client`](IdempotencyLayer::require_client): a key but no client; no `WWW-Authenticate` (the authentication in front knows the scheme, this layer does not) |
//! | `409` | <a id="idempotency.in_flight"></a>`idempotency.in_flight` | a request with this key is running |
//! | `409` | <a id="idempotency.original_failed"></a>`idempotency.original_failed` | the request waited on failed; retry |
//! | `410` | <a id="idempotency.not_replayable"></a>`idempotency.not_replayable` | the request ran but its response was too large to keep |
//! | `413` | <a id="idempotency.body_too_large"></a>`idempotency.body_too_large` | request body over the limit |
//! | `400` | <a id="idempotency.epoch_invalid"></a>`idempotency.epoch_invalid` | with [`epoch`](IdempotencyLayer::epoch): the epoch header is not one decimal number |
//! | `422` | <a id="idempotency.fingerprint_mismatch"></a>`idempotency.fingerprint_mismatch` | the key was used with another request |
//! | `422` | <a id="idempotency.epoch_mismatch"></a>`idempotency.epoch_mismatch` | with [`epoch`](IdempotencyLayer::epoch): the key was first seen in another epoch |
//! | `500` | <a id="idempotency.response_failed"></a>`idempotency.response_failed` | the handler's response body failed mid-read |
//! | `500` | <a id="idempotency.transaction_missing"></a>`idempotency.transaction_missing` | a handler takes the request's `Transaction` (feature `postgres`, axum extractor) on a route with no idempotency layer over a `PostgresStore` in transactional mode: a server misconfiguration |
//! | `503` | <a id="idempotency.overloaded"></a>`idempotency.overloaded` | the request bodies in flight fill the byte budget ([`max_buffered_bytes`](IdempotencyLayer::max_buffered_bytes)); `Retry-After: 1`, nothing ran |
//! | `503` | <a id="idempotency.store_unavailable"></a>`idempotency.store_unavailable` | the store failed (fail closed); nothing ran, and the refused claim never lands later |
//! | `503` | <a id="idempotency.pool_exhausted"></a>`idempotency.pool_exhausted` | the store's pool had no free connection in time (PostgreSQL in transactional mode holds one per running request): nothing ran; retry after `Retry-After` |
//! | `503` | <a id="idempotency.not_committed"></a>`idempotency.not_committed` | transactional mode: the handler's transaction did not commit; nothing it wrote stands; retry |
//! | `503` | <a id="idempotency.outcome_unknown"></a>`idempotency.outcome_unknown` | transactional mode: the commit got no answer and the store could not be read back in time; retry with the same key (replays if it committed) |
//! | `503` | <a id="idempotency.handler_unavailable"></a>`idempotency.handler_unavailable` | the handler failed (its service's error, not a response) on a passing fault: its database unreachable or restarting, a serialization failure or deadlock, its pool timed out ([`store::is_transient`], and the layer's `transient_if`); nothing is kept, the key is free; retry with the same key |
//!
//! Why `410` for a response too large to keep: the request ran, so running it again
//! would break the one-execution promise, and a truncated replay would be a lie; `410
//! Gone` says "done, and the answer is not here any more", and no retry policy retries
//! it. Raise [`max_response_bytes`](IdempotencyLayer::max_response_bytes) for routes
//! with large answers.
//!
//! # Conformance
//!
//! Against draft-ietf-httpapi-idempotency-key-header-07 (the latest revision, October
//! 2025) and RFC 8941 for the field. Each requirement a server can meet has a test
//! named by its section in `tests/idempotency/conformance.rs`.
//!
//! | Section | Requirement | Our default | The option that changes it |
//! |---|---|---|---|
//! | 2.1, RFC 8941 3.3.3 | the field is an Item whose value is a String | a quoted key is parsed as an Item (the `sfv` crate); **departure**: a bare token (`abc-123`) is accepted too, as many clients send it, and names the same key as `"abc-123"` | none: a bare key is never ambiguous |
//! | RFC 8941 3.1.2 | unknown parameters are ignored | `"abc";p=1` is the key `abc` | none |
//! | 2.1, RFC 8941 4.2 | one field per request; a field that is not an Item is not used | a key header on two lines is `400 idempotency.key_repeated`, even with one key (`rfc8941_4_2_a_key_header_sent_twice_is_refused_even_with_one_key`) | none |
//! | 2.3 | keys expire after a published time | 24 hours, then the key runs again (`draft_2_3_a_key_runs_again_after_it_expires`) | [`ttl`](Policy::ttl) |
//! | 2.4 | a fingerprint may tell a reused key from a retry | method, path, `Content-Type` and body (see [`Fingerprint::new`]) | [`scope_query`](IdempotencyLayer::scope_query) adds the query |
//! | 2.6 | a retry after completion gets the previous result, success or error | successes and server errors are stored and replayed (`draft_2_6_a_retry_after_an_error_gets_the_error_and_nothing_runs_again`); **departure**: a handler's 4xx and `503` are not stored, so a corrected request under the same key runs ([`StorageRule`] says why; `draft_2_6_departure_a_refusal_is_not_stored_and_the_corrected_request_runs`) | [`Policy::storage`]`(StorageRule::AllButRetryable)` stores 4xx too (all but `408`, `429`, `503`); `StorageRule::SuccessesOnly` releases 5xx too, for handlers whose errors never follow a side effect; a handler that took the PostgreSQL store's `Transaction` (feature `postgres`) has its 5xx rolled back and released whatever the rule |
//! | 2.6 | a duplicate while the first runs gets `409` | `409 idempotency.in_flight` with `Retry-After` (`draft_2_6_a_duplicate_while_the_first_runs_gets_409_with_retry_after`) | [`in_flight`](Policy::in_flight)`(InFlight::Wait { .. })` waits and replays instead |
//! | 2.6, 2.7 | a key reused with another payload gets `422` | `422 idempotency.fingerprint_mismatch` (`draft_2_6_a_key_reused_with_another_payload_gets_422`) | none |
//! | 2.6, 2.7 | a missing key where one is required gets `400` | `400 idempotency.key_missing` with [`require_key`](IdempotencyLayer::require_key); without it the request passes through (`draft_2_7_a_missing_key_where_required_gets_400_with_a_link`) | `require_key(false)`, the default |
//! | 2.7 | error answers link to documentation | every problem's `type` is the URL of its row below (an anchor per code) and the response has `Link: <type>; rel="describedby"` (`draft_2_7_problems_link_to_their_documentation`) | [`problem_docs`](IdempotencyLayer::problem_docs) points both at your pages |
//! | 2.5 | the server publishes its idempotency policy | this page: the key format, expiry, fingerprint and answers | none |
//!
//! # Events
//!
//! The layer writes no line of its own for a request that goes well: it records what
//! it did on the request's span (the span current when it runs), so that the one
//! access line of [`CorrelationLayer::access_log`](crate::correlation::CorrelationLayer::access_log)
//! carries it, as do the handler's events and every span exporter (OpenTelemetry
//! attributes). The fields, listed in [`field`]:
//!
//! | Field | What |
//! |---|---|
//! | `idempotency_outcome` | `executed`, `replayed`, `in_flight`, `conflict`, `not_replayable`, `original_failed`, `rejected`, `store_unavailable`, `pool_exhausted` or `fail_open`, as the `outcome` label of [`metrics::REQUESTS`] |
//! | `idempotency_key` | the key as sent, already checked to be 1 to 255 visible ASCII characters, so safe in a log line, and what a log search for a user action needs |
//! | `idempotency_scope`, `idempotency_client` | short hex prefixes of hashes of the scope and of the client: the client's credential never reaches a log line |
//! | `idempotency_request_count` | requests the store has seen with this key, on a replay or a request in flight |
//! | `idempotency_store_ms` | milliseconds spent in store calls on the request's path (claim or lookup, any wait, completion) |
//!
//! [`AccessSpan`](crate::correlation::AccessSpan) and the correlation layer's default
//! span declare these fields; a span of your own
//! ([`make_span`](crate::correlation::CorrelationLayer::make_span), tower-http's
//! `TraceLayer`) gets them by declaring them `Empty`, and ignores those it does not
//! declare. A sample line is in the [observability guide](crate::guide::observability).
//!
//! The layer's events, by `event` code, carry those fields through the span too. The
//! steps of a request that goes well are DEBUG: the access line says what happened,
//! and `RUST_LOG=info,tower_ids::idempotency=debug` brings the steps back where a
//! request needs following step by step. Everything that needs an operator is WARN.
//! `idempotency.rejected` refuses a request before it is scoped, so it has no key on
//! its span (nor do, on a route whose key is in the body, the refusals of the body,
//! `idempotency.body_too_large`, `idempotency.overloaded` and
//! `idempotency.body_unreadable`, which come before its key is known).
//!
//! - DEBUG: `idempotency.accepted`, `idempotency.replayed`, `idempotency.stored`,
//!   `idempotency.released`,
//!   `idempotency.in_flight`, `idempotency.not_replayable`,
//!   `idempotency.original_failed`, `idempotency.expired_removed` (a PostgreSQL
//!   store's sweep, with `rows`), `idempotency.unanswered_claim_released` (a claim
//!   whose answer never came was given back; its request ran nothing).
//! - INFO: `idempotency.commit_confirmed` (a commit whose answer was lost had landed:
//!   its record was found once the transaction could no longer commit);
//!   `idempotency.lineage_untold` (once per PostgreSQL store: the database refuses the
//!   functions that tell a server's system identifier and timeline, so a lost commit
//!   is settled by its backend alone); `idempotency.detached` (the client went away before the
//!   answer, and the work it claimed ran to its end in a task of its own, with
//!   `finished_after_ms`: the request's own line, as no access line is written for an
//!   answer no one took); `idempotency.drained` (a [`Drain`] saw everything settle).
//! - WARN, once per layer: `idempotency.uncorrelated`, a request ran with no correlation
//!   ID in scope (see [Layer order](#layer-order)).
//! - WARN, once per PostgreSQL store, at its start: `idempotency.store_not_durable`
//!   (with `synchronous_commit` and `fsync`), the database answers a COMMIT before it
//!   is on disk, so a crash of the server can lose keys and outcomes already answered
//!   for (the [guarantees](crate::guide::guarantees) page has the measured figure).
//! - WARN: `idempotency.rejected` (the `400`s and the `401` on the key, the client or
//!   the headers, with `reason`,
//!   `detail` in the layer's own words, and `status`, or `grpc_code` for a gRPC call:
//!   `INVALID_ARGUMENT`), `idempotency.conflict` (`422`),
//!   `idempotency.epoch_mismatch`, `idempotency.body_too_large`,
//!   `idempotency.body_unreadable`, `idempotency.overloaded` (with `budget_bytes` and
//!   `requested_bytes`), `idempotency.response_too_large`, `idempotency.lease_lost`,
//!   `idempotency.store_failed` (with `phase`: `begin`, `renew`, `complete`,
//!   `release`, `wait`, and the `error` with its cause; of renewals failing in a row,
//!   retried every 50 ms, only the first is WARN, the rest DEBUG with `attempts`),
//!   `idempotency.pool_exhausted`
//!   (no connection of the store's pool was free in time), `idempotency.claim_restored`
//!   (the store had lost a running request's claim), `idempotency.claim_lapsed` (a
//!   completion met another request's claim; the outcome is kept until it settles),
//!   `idempotency.drain_unsettled` (with `owed`), `idempotency.kept_over_budget`,
//!   `idempotency.commit_failed` (the handler's transaction did not commit),
//!   `idempotency.transaction_broke` (the handler's transaction broke under it: its
//!   connection lost, its backend terminated; answered as not committed, never as the
//!   handler's failure), `idempotency.transient_failure` (the handler failed on a
//!   passing fault, with the `error` it recognised: answered `handler_unavailable`,
//!   a message requeued uncounted),
//!   `idempotency.outcome_unknown` (whether it committed is not known),
//!   `idempotency.outcome_unserialisable` (an outcome that does not encode: not kept,
//!   its duplicates refused as not replayable), `idempotency.outcome_undecodable` (a
//!   message's stored outcome does not decode into the consumer's outcome type);
//!   `idempotency.stored` is WARN with `claim=missing` when the store had lost the
//!   claim.
//! - TRACE: `idempotency.lease_renewed`.
//!
//! # Memory
//!
//! What the layer holds is bounded in three parts:
//!
//! - **Request bodies**, read to fingerprint them and handed on: each at most
//!   [`max_request_bytes`](IdempotencyLayer::max_request_bytes) (1 MiB), and all those
//!   of the requests in flight through one layer and its clones at most
//!   [`max_buffered_bytes`](IdempotencyLayer::max_buffered_bytes)
//!   (64 MiB). A body takes its bytes from that budget
//!   as it is read (its declared `Content-Length` up front) and gives them back when
//!   the request's work ends; a request the budget cannot take now is `503
//!   idempotency.overloaded` with `Retry-After`, before the handler or the store sees
//!   it. `tests/budget.rs` sends 3,000 requests with 1 MiB bodies at once through a
//!   real server with a 64 MiB budget: 64 run, the rest are refused, and the process
//!   peaks 140 to 162 MiB above its baseline (both ends of 3,000 connections
//!   included), where without a budget they held 2.6 GiB.
//! - **Responses** being read to store them: each at most
//!   [`max_response_bytes`](IdempotencyLayer::max_response_bytes) (1 MiB; a larger
//!   one is streamed on, not kept), one per request running its handler. The budget
//!   does not count them (a request with an empty body holds none of it), so this part
//!   is bounded by how many requests run at once: put a concurrency limit in front
//!   (tower's `ConcurrencyLimitLayer`, or the server's connection limit) when
//!   responses are large. Replays share the stored bytes; they copy no body.
//! - **Outcomes waiting for the store** (it failed when their request ended): their
//!   responses at most [`max_kept_bytes`](Policy::max_kept_bytes) per layer
//!   (64 MiB); past it an outcome is kept without its
//!   response.
//! - **Stored records**: the store's bound, [`MokaStore`]'s
//!   [`max_bytes`](store::MokaStoreBuilder::max_bytes) (64 MiB by default; see its
//!   Memory section), plus 480 bytes per request in flight until it settles.
//!
//! With the defaults and N requests running at once, that is at most 64 MiB of
//! request bodies, N x 1 MiB of responses and 64 MiB of records, plus N x 500 bytes.
//! A store shared by several layers counts once; each separately built layer has its
//! own budget.
//!
//! # Metrics
//!
//! With the `metrics` feature, on the [`metrics`](https://docs.rs/metrics) facade
//! (install any recorder: Prometheus, StatsD, OpenTelemetry); without it nothing is
//! recorded and nothing is compiled in. Call [`metrics::describe`] once for help texts.
//!
//! | Name | Kind | Labels | What |
//! |---|---|---|---|
//! | `tower_ids_idempotency_requests_total` | counter | `outcome` | protected requests answered: `executed` (claimed, the handler ran), `replayed`, `in_flight` (`409`), `conflict` (`422`), `not_replayable` (`410`), `original_failed`, `rejected` (the `400`s, `401`, `413` and `503 overloaded`, before the store), `store_unavailable` (`503`), `pool_exhausted` (`503`), `fail_open` |
//! | `tower_ids_idempotency_requests_in_flight` | gauge | | protected requests inside the layer now |
//! | `tower_ids_idempotency_store_call_duration_seconds` | histogram | `operation` | each store call: `begin`, `renew`, `complete`, `release`, `wait` |
//! | `tower_ids_idempotency_store_failures_total` | counter | `operation` | store calls that failed |
//! | `tower_ids_idempotency_released_total` | counter | `reason` | keys given up so a retry runs again: `handler_error`, `not_stored`, `response_failed`, `handler_panicked`, `abandoned`, `rolled_back`, `commit_failed`, `transaction_broke`, `transient`, `outcome_unknown` |
//!
//! Every counter series whose label values are listed here, and the gauge, is
//! exported at 0 as soon as a layer is built (install the recorder first), so `rate()`
//! and dashboards have them before their first increment. The names are also
//! constants, in [`metrics`]. Requests that pass through
//! (a method not covered, or no key on a route that does not require one) are not
//! counted.
//!
//! # Layer order
//!
//! Put [`CorrelationLayer`](crate::correlation::CorrelationLayer) outside (it gives
//! every attempt, replays included, its own ID and span); put the idempotency layer on
//! the routes it protects, after authentication if the client comes from an auth
//! layer's extension. `GET` routes need no idempotency layer.
//!
//! The other order leaves every replay and refusal without a correlation ID: the first
//! request a layer sees with no ID in scope logs a WARN, `idempotency.uncorrelated`,
//! once per layer (and its clones).

// A link to an item of a feature that is off points at this module instead.
#![cfg_attr(
    not(feature = "metrics"),
    doc = "",
    doc = "[`metrics::describe`]: crate::idempotency::metrics"
)]

// With the `client` feature alone, only the key, its header names and the attempt ID
// are compiled: what the retry layer sends. Everything else is the layers'.
//
// The core (keys, scope, codes, policy, the store trait and the engine) is the
// `tower-ids-core` crate, re-exported here. The imports run one way, up this list:
// what every transport reads a call with (`extract`, `collect`, `response`), the
// contract a transport keeps (`transport`), the transports (`http`, `grpc`), and the
// adapter (`adapter`: the layer and service, generic over a transport, with each
// transport's constructors). The public modules (this one, `extract`, `grpc`, `store`)
// only gather names. The message layer is its own crate, on the core.
#[cfg(feature = "idempotency")]
pub(crate) mod adapter;
#[cfg(feature = "idempotency")]
mod collect;
#[cfg(feature = "idempotency")]
pub(crate) use tower_ids_core::engine as core;
#[cfg(feature = "grpc")]
pub mod grpc;
pub use tower_ids_core::header;
#[cfg(feature = "idempotency")]
pub(crate) mod http;
#[cfg(feature = "idempotency")]
#[doc(inline)]
pub use tower_ids_message as message;
#[cfg(feature = "idempotency")]
pub mod extract;
#[cfg(feature = "idempotency")]
mod response;
#[cfg(feature = "idempotency")]
pub mod store;
#[cfg(feature = "idempotency")]
mod transport;

#[cfg(all(feature = "postgres", feature = "axum"))]
pub use self::http::TransactionRejection;
#[cfg(feature = "idempotency")]
pub use self::{
    adapter::{Idempotency, IdempotencyLayer},
    extract::{
        client::{ClientFromAuthorization, ClientFromExtension, ClientFromHeader},
        epoch::{EpochFromExtension, EpochFromHeader},
        key::{KeyFromHeader, KeyFromJson},
    },
    http::{Http, JsonReplayMarker, OnReplay},
    response::ResponseFuture,
    store::{IdempotencyStore, MokaStore},
};
#[cfg(feature = "idempotency")]
pub use tower_ids_core::field;
pub use tower_ids_core::{AttemptId, IdempotencyKey};
#[cfg(feature = "idempotency")]
pub use tower_ids_core::{
    ClientId, Code, Drain, Drained, InFlight, Policy, PolicyError, ReplayInfo, Stopped,
    StorageRule, StoreFailure,
};
// The defaults, for the examples and benches: users read them in the setters' docs.
#[cfg(feature = "idempotency")]
#[doc(hidden)]
pub use tower_ids_core::{DEFAULT_LEASE, DEFAULT_TTL};
// For the crate's own modules: the names every part of the layers uses, at one path.
#[cfg(feature = "idempotency")]
pub use tower_ids_core::metrics;
#[cfg(feature = "idempotency")]
pub(crate) use tower_ids_core::{
    header::{
        ATTEMPT_ID, IDEMPOTENCY_EXPIRES, IDEMPOTENCY_FIRST_SEEN, IDEMPOTENCY_KEY,
        IDEMPOTENCY_REQUEST_COUNT, IDEMPOTENT_REPLAYED, ORIGINAL_ATTEMPT_ID, X_IDEMPOTENCY_KEY,
    },
    store::{Fingerprint, ScopeKey},
    KeyRejection,
};
