//! The Command Service: tower-ids' demo of correlation IDs across an HTTP request and
//! the queue message it sends, and of idempotency keys on its `POST` routes; in memory,
//! or with `--database-url` in PostgreSQL (see [DB mode](#db-mode)).
//!
//! A client asks for a command to be sent to a device; the service stores it as
//! `queued`, answers `201`, and puts a message on a queue (in memory, an in-process tokio
//! channel standing in for the broker; in DB mode, the library's outbox,
//! [`tower_ids::outbox`]). A background
//! publisher takes each message, waits until `--publish-delay-ms` after it was queued,
//! and marks the command `sent` unless it was cancelled meanwhile.
//!
//! Every line logged while handling a request carries that request's `correlation_id`
//! (from `x-correlation-id`, else `x-request-id`, else a fresh UUIDv7); every line the
//! publisher logs for a delivery carries that ID extended for the delivery
//! (`<id>.Aq9`, see [`CorrelationId::extend_redelivery`]), so one search finds the
//! request and everything it caused.
//!
//! The two `POST` routes carry an [`IdempotencyLayer`] each, sharing one [`MokaStore`]
//! (or, with `--redis-url`, one `RedisStore`, and in DB mode one `PostgresStore`, so
//! that several replicas share records):
//! `POST /commands` requires an `Idempotency-Key`, `POST /commands/{id}/cancel` takes
//! one if sent. Keys are scoped by the `x-api-key` header (the client), so two clients
//! may use the same key; a request with a key but without `x-api-key` is refused with
//! `401` (`require_client`), so no two anonymous callers can share a scope. A retry
//! with the same key and the same request gets the first response back
//! (`idempotent-replayed: true`) and creates nothing; the `GET` routes have no
//! idempotency layer. See [`tower_ids::idempotency`] for the whole contract.
//!
//! # Run
//!
//! ```sh
//! cargo run --release --all-features --example commands
//! cargo run --release --all-features --example commands -- \
//!     --addr 127.0.0.1:0 --log-format json --publish-delay-ms 1000
//! cargo run --release --all-features --example commands -- --handler-delay-ms 2000
//!
//! # Each event also to RabbitMQ: exchange `commands`, routing key `command.created`.
//! cargo run --release --all-features --example commands -- \
//!     --amqp-url amqp://guest:guest@127.0.0.1:5672/%2f --amqp-exchange commands
//! RUST_LOG=debug cargo run --release --all-features --example commands
//!
//! # Two replicas sharing one Redis: a retry on either replays the first answer.
//! redis-server --port 6379 --save '' --appendonly no &
//! cargo run --release --all-features --example commands -- \
//!     --addr 127.0.0.1:3000 --redis-url redis://127.0.0.1:6379
//! cargo run --release --all-features --example commands -- \
//!     --addr 127.0.0.1:3001 --redis-url redis://127.0.0.1:6379
//!
//! # DB mode: two replicas on one PostgreSQL database, which keeps everything.
//! createdb -h 127.0.0.1 -U postgres commands
//! cargo run --release --all-features --example commands -- \
//!     --addr 127.0.0.1:3000 --database-url postgres://postgres@127.0.0.1:5432/commands
//! cargo run --release --all-features --example commands -- \
//!     --addr 127.0.0.1:3001 --database-url postgres://postgres@127.0.0.1:5432/commands
//!
//! # Observability: GET /metrics in Prometheus text, and an incoming traceparent
//! # continued (its trace_id on every line of the request).
//! cargo run --release --all-features --example commands
//! curl -s localhost:3000/metrics | grep tower_ids_idempotency_requests_total
//! curl -s localhost:3000/commands \
//!     -H 'traceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'
//! ```
//!
//! # Logs, metrics, traces
//!
//! - Every request logs one line at INFO, its access line, when its answer leaves
//!   (`http.access`, with `status` and `latency_ms`), whoever answered it: a handler, a
//!   replay, the idempotency layer, the request limits. It is inside the request's span,
//!   `request{method, path, correlation_id}`, as every other line of the request
//!   ([`CorrelationLayer::access_log`]), where the idempotency layer records what it did
//!   (`idempotency_outcome`, `idempotency_key`, ...: see [`tower_ids::idempotency`]). Lines go to stdout through a writer thread of
//!   their own (`tracing-appender`), so no request waits on the terminal or a pipe.
//! - With `--features metrics`, `GET /metrics` serves the idempotency layer's metrics
//!   in Prometheus text (`metrics-exporter-prometheus`):
//!   `tower_ids_idempotency_requests_total{outcome="replayed"}` counts the replays.
//! - With `--features opentelemetry`, the spans go to OpenTelemetry (exported nowhere;
//!   add an exporter in `init_tracing`): a request with a W3C `traceparent` continues
//!   that trace, and its lines carry the `trace_id`.
//!
//! | Flag | Default | Meaning |
//! |---|---|---|
//! | `--addr` | `127.0.0.1:3000` | address to bind; port `0` picks a free one |
//! | `--log-format` | `pretty` | `pretty` (human, one line per event) or `json` (one object per line, with the current span's fields as `span`) |
//! | `--log-sync` | off | write each log line before going on, instead of through the writer thread (lines still queued die with a killed process; the crash test reads the log as its record) |
//! | `--publish-delay-ms` | `200` | time from queueing to publishing, so a client can see `queued` turn into `sent` |
//! | `--handler-delay-ms` | `0` | time the two `POST` handlers sleep before doing anything, so a retry can overlap the first request (keep `--publish-delay-ms` above it to cancel a command before it is sent) |
//! | `--commit-delay-ms` | `0` | time the two `POST` handlers wait after their writes, before answering; in DB mode the layer commits once the handler has answered, so this is the time between the writes and the commit (in which a crash leaves nothing) |
//! | `--fail-after-write-percent` | `0` | the share of the two `POST` handlers that fail with `500` `commands.failed_after_write` after their writes (and `--commit-delay-ms`), each drawn at random; `100` fails every one. In memory or on Redis the writes stand and the `500` is replayed to a retry; in DB mode they are rolled back and the retry runs again (a cancel sent without a key commits its own writes first) |
//! | `--idempotency-ttl-secs` | `86400` | how long an idempotency key's outcome is replayed |
//! | `--store-timeout-ms` | the store's (250 ms Redis, 1 s PostgreSQL) | the longest one idempotency store call may take; on Redis a quarter of the lease must cover it and about 100 ms more, or the demo refuses to start |
//! | `--idempotency-lease-ms` | `10000` | on Redis, the longest store outage a running request's claim outlives (the library's default lease); a request that stopped renewing its claim (its process died) keeps its key for at most one and a half leases: retries get `409` until then. DB mode has no lease: the request's transaction holds its key |
//! | `--header-read-timeout-ms` | `10000` | how long a connection may take to send a request's head, and may stay idle between requests; then the server closes it |
//! | `--body-timeout-ms` | `10000` | how long a request body may go without sending a byte; then `408` and the connection is closed |
//! | `--request-timeout-ms` | `30000` | how long a request may take from its head to its answer; then `408` and the connection is closed |
//! | `--max-body-bytes` | `65536` | largest request body; a larger one gets `413` |
//! | `--max-concurrent-requests` | `512` | requests handled at once; more are shed at once with `503` and `Retry-After: 1` |
//! | `--max-commands` | `1000` | commands the in-memory list keeps; creating one more drops the oldest. In DB mode, which keeps every command, how many of the newest `GET /commands` answers |
//! | `--load-routes` | off | also serve `POST /load/bare` (no layer), `POST /load/noop` (a layer that does nothing), `POST /load/tower-http` (tower-http's request-ID pair), `POST /load/correlated` (correlation layer), `POST /load/idempotent` (both layers, key required) and `GET /load/executions` (handler runs so far), one trivial handler behind each, for `benches/load.sh` |
//! | `--cors-origin` | none | let a page on this origin (`http://127.0.0.1:8080`) call the service from a browser: preflights allow the layers' headers, `x-api-key` and `Content-Type`, and responses expose `idempotent-replayed`, the correlation ID and the rest of `tower_ids::cors::EXPOSE_HEADERS` |
//! | `--redis-url` | none (in memory) | with `--features redis`: keep idempotency records in this Redis (or Valkey), shared by every replica started with the same URL; if it cannot be reached at start the service exits, if it goes away later the `POST` routes answer `503` until it is back |
//! | `--redis-cluster-url` | none | with `--features redis`, instead of `--redis-url`: a seed node of a Redis Cluster that keeps the idempotency records (repeat it for more seeds) |
//! | `--redis-wait-replicas` | `0` | with Redis: a claim and a completion count only once this many replicas acknowledged them (`WAIT`, within 500 ms); not acknowledged, the request is answered `503` without running, or its outcome is kept and stored again |
//! | `--amqp-url` | none (log only) | also publish each event to RabbitMQ (`amqp://USER:PASS@HOST:PORT/VHOST`), see [AMQP](#amqp); if the broker cannot be reached at start, the service logs a WARN and publishes by log only |
//! | `--amqp-exchange` | `commands` | the topic exchange `--amqp-url` publishes to, declared durable at start |
//! | `--drain-timeout-ms` | `10000` | at a graceful stop, once every connection is done: how long to wait for what the idempotency layer still owes its store (see below) |
//! | `--database-url` | none (in memory) | with `--features postgres`: DB mode, with the commands, their outbox and the idempotency records in this PostgreSQL database (`postgres://USER@HOST:PORT/DATABASE`), shared by every replica started with the same URL; the tables are created at start if missing; if the database cannot be reached at start the service exits. Not with `--redis-url` |
//!
//! Once bound, the service logs `listening on http://ADDR` with the real address, so a
//! script can start it on port `0` and grep the log for the URL. `RUST_LOG` sets the
//! filter (default `info`). Ctrl-C (or SIGTERM) stops it gracefully: it stops accepting,
//! closes idle connections, lets in-flight requests finish (each within the timeouts
//! below), then waits up to `--drain-timeout-ms` for what the idempotency layer still
//! owes its store (an outcome kept while Redis was away, a handler whose client hung up:
//! [`Drain`]), and drains the queue (in DB mode, the relay finishes its round, leaving a
//! command still in its `--publish-delay-ms` pending, and what is pending waits in the
//! outbox). It exits 0 either way; a WARN
//! `idempotency.drain_unsettled` per key left says which keys stay claimed until their
//! lease runs out.
//!
//! # Limits
//!
//! The demo runs as a service facing slow or greedy clients should, and every bound is a
//! flag above. The connection-level bounds cover every route; the request-level bounds
//! cover the service's routes (the `/load/*` routes of `--load-routes` stay as bare as
//! `benches/load.sh` measures them).
//!
//! - **HTTP/1.1 only**, served by hyper's own connection builder with a timer, so that
//!   hyper's header-read timeout (`--header-read-timeout-ms`) covers a connection that
//!   sends nothing, one that sends part of a request head, and one kept alive and idle
//!   after a response (hyper starts the timer again whenever a connection goes idle). The
//!   server closes such a connection without an answer. (hyper-util's auto builder, which
//!   axum's `serve` uses, first waits without any timeout for the bytes that tell HTTP/1
//!   from HTTP/2.)
//! - At start the service raises its open-files limit (soft `RLIMIT_NOFILE`) to the hard
//!   limit, since each connection is a file descriptor, and logs it (`commands.limits`).
//! - Per request, outermost first, all tower and tower-http layers:
//!   1. tower's `LoadShedLayer` over a `GlobalConcurrencyLimitLayer`
//!      (`--max-concurrent-requests`): a request over the limit is answered `503`
//!      `server.overloaded` with `Retry-After: 1` at once, never queued (axum's
//!      `HandleErrorLayer` turns the shed error into the answer);
//!   2. tower-http's `RequestBodyLimitLayer` (`--max-body-bytes`): a declared
//!      `Content-Length` over it gets `413` before the body is read; a body that grows past
//!      it, `413` when it does (the idempotency layer's own limit is set to the same);
//!   3. tower-http's `TimeoutLayer` (`--request-timeout-ms`): `408` `request.timeout`;
//!      bounds how long a request holds its concurrency slot, even when its client sends
//!      the body a byte at a time, each just before `--body-timeout-ms`;
//!   4. under them all, the body-read timeout every example server shares
//!      (`examples/support/http1.rs`, tower-http's `TimeoutBody`, `--body-timeout-ms`): a
//!      body that stalls gets `408` `request.body_timeout`, whatever the route made of
//!      the failed read.
//!
//!   The `408` and `413` answers carry `Connection: close`: the server closes the
//!   connection after them, as the rest of the body may still be on its way.
//! - The command list keeps the latest `--max-commands` commands: creating one more drops
//!   the oldest (`commands.evicted`), which then answers `404`; if it was still queued,
//!   the publisher skips it. With bodies of at most `--max-body-bytes`, the list holds at
//!   most `--max-commands` × `--max-body-bytes` of payload (64 MiB with the defaults).
//! - A command's `payload` may nest arrays and objects at most
//!   [`MAX_PAYLOAD_DEPTH`](routes::MAX_PAYLOAD_DEPTH) (32) deep; a deeper one is `422`
//!   `body.too_deep` in every mode (PostgreSQL's `json` input gives up between 10,000
//!   and 20,000 levels, which in memory were accepted).
//! - Every refusal the service makes is RFC 9457 problem details
//!   (`application/problem+json`) with a stable `code`, `404` for an unknown path and
//!   `405` (with `Allow`) for a known path with another method included. What hyper
//!   refuses while it reads a request head, before any layer runs, is not: a malformed
//!   head (a control byte in a header value, two `Content-Length`s) is `400`, more than
//!   100 header lines or a head over hyper's read buffer (about 400 KiB) `431`, a path
//!   over 65,534 bytes `414`, each with an empty body and `Connection: close` (and a
//!   DEBUG `http.connection_closed`); hyper has no hook to answer those otherwise.
//!
//! # Try it
//!
//! ```sh
//! BODY='{"device_id":"thermostat-42","name":"set_temperature","payload":{"celsius":21.5}}'
//!
//! # Create a command; the response echoes the correlation ID (and the optional
//! # attempt-id). -> 201, idempotent-replayed: false, attempt-id: a1,
//! #    {"id": ID, "status": "queued", ...}
//! curl -si localhost:3000/commands \
//!     -H 'content-type: application/json' -H 'x-correlation-id: demo-1' \
//!     -H 'x-api-key: client-a' -H 'idempotency-key: create-1' -H 'attempt-id: a1' \
//!     -d "$BODY"
//!
//! # The client did not see the answer and retries: same key, same body, new attempt.
//! # -> 201, idempotent-replayed: true, the same body (same ID), attempt-id: a2,
//! #    original-attempt-id: a1, idempotency-first-seen: <HTTP-date>,
//! #    idempotency-request-count: 2; no second command is created.
//! curl -si localhost:3000/commands \
//!     -H 'content-type: application/json' -H 'x-correlation-id: demo-2' \
//!     -H 'x-api-key: client-a' -H 'idempotency-key: create-1' -H 'attempt-id: a2' \
//!     -d "$BODY"
//!
//! # Another client may use the same key: a new command.
//! curl -si localhost:3000/commands -H 'content-type: application/json' \
//!     -H 'x-api-key: client-b' -H 'idempotency-key: create-1' -d "$BODY"
//!
//! # The same key with another body: 422 idempotency.fingerprint_mismatch, nothing runs.
//! curl -si localhost:3000/commands -H 'content-type: application/json' \
//!     -H 'x-api-key: client-a' -H 'idempotency-key: create-1' \
//!     -d '{"device_id":"thermostat-42","name":"reboot","payload":{}}'
//!
//! # No key: 400 idempotency.key_missing.
//! curl -si localhost:3000/commands -H 'content-type: application/json' \
//!     -H 'x-api-key: client-a' -d "$BODY"
//!
//! # With --handler-delay-ms 2000, a retry while the first is still running:
//! # the first answers 201 after 2 s, the overlapping one 409 idempotency.in_flight
//! # with Retry-After: 1; retried after that, it is a replay.
//! curl -si localhost:3000/commands -H 'content-type: application/json' \
//!     -H 'x-api-key: client-a' -H 'idempotency-key: create-2' -d "$BODY" &
//! sleep 0.5
//! curl -si localhost:3000/commands -H 'content-type: application/json' \
//!     -H 'x-api-key: client-a' -H 'idempotency-key: create-2' -d "$BODY"
//!
//! # List all commands (oldest first), fetch one: no idempotency headers on GET.
//! curl -s localhost:3000/commands
//! curl -s localhost:3000/commands/$ID
//!
//! # Cancel one, with a key (a retry replays the answer) or without (runs each time;
//! # cancelling twice is not an error).
//! curl -si -X POST localhost:3000/commands/$ID/cancel \
//!     -H 'x-api-key: client-a' -H 'idempotency-key: cancel-1'
//! curl -si -X POST localhost:3000/commands/$ID/cancel
//!
//! # Errors are RFC 9457 problem details.
//! curl -si localhost:3000/commands -H 'content-type: application/json' \
//!     -H 'x-api-key: client-a' -H 'idempotency-key: bad-json-1' -d '{"device_id":'
//! # A key without a client: 401 idempotency.client_missing, nothing runs.
//! curl -si localhost:3000/commands -H 'content-type: application/json' \
//!     -H 'idempotency-key: anonymous-1' -d "$BODY"
//! curl -si localhost:3000/commands/0190b6c4-0000-7000-8000-000000000000
//! ```
//!
//! # DB mode
//!
//! With `--database-url`, the commands, their outbox and the idempotency records live in
//! one PostgreSQL database (tables `commands`, `tower_ids_outbox` and
//! `tower_ids_idempotency`, created at start if missing), and every replica started with
//! the same URL serves the same commands:
//!
//! - `POST /commands` inserts the command and enqueues its `command.created` event in
//!   the library's outbox ([`Outbox::enqueue`], the device as partition key; the
//!   outbox keeps the request's correlation ID and trace context with it) on the
//!   request's `Transaction`, which the idempotency layer commits with the response's
//!   record after the handler has answered: the command, the outbox message and the
//!   record commit together or not at all. The transaction holds the key too: a process
//!   killed before the commit leaves nothing, and a retry runs at once; killed after it,
//!   a retry gets the first answer back. `POST /commands/{id}/cancel` writes on the
//!   request's transaction too (a cancel without a key, on one of its own).
//! - `GET /commands/{id}` reads the database, so any replica finds any command;
//!   `GET /commands` answers the newest `--max-commands` commands (default 1,000), oldest
//!   first. Nothing is dropped: the database keeps every command.
//! - Every replica runs the library's outbox relay ([`Relay`]) with the demo's sink
//!   (`relay.rs`): the replicas share the messages, each device's taken by one relay at
//!   a time, in commit order. For each message the sink waits until `--publish-delay-ms`
//!   after the command was created, locks the command's row and, if it is still
//!   `queued`, publishes it (with `--amqp-url`, once the broker confirmed the event; one
//!   it did not stays pending, and the relay tries again), logs `commands.published` in
//!   the relay's span under the request's correlation ID extended for the publication,
//!   sets the command `sent` and commits; the relay then marks the message published.
//!   A command cancelled first is skipped. A relay killed before it marks leaves its
//!   messages pending, and they are taken again: a command already `sent` is not
//!   published again, one killed between the broker's confirm and the command's commit
//!   is (at least once, as from any outbox).
//! - The demo's pool has 32 connections; a request that finds none free within 1 s, or
//!   whose database call fails, is answered `503` `commands.database_unavailable`, and
//!   nothing it wrote stands.
//!
//! `tests/examples/commands_crash.rs` kills the demo in DB mode with SIGKILL at random moments
//! while clients create commands, restarts it on the same database, retries every key,
//! and counts what the database holds.
//!
//! # AMQP
//!
//! With `--amqp-url`, each event the publisher publishes also goes to RabbitMQ (lapin,
//! the crate's `amqp` feature): the topic exchange `--amqp-exchange` gets a persistent
//! JSON body `{"type", "command_id", "device_id", "name", "payload"}` under the routing
//! key of its type (`command.created`), and the publisher waits for the broker's confirm
//! before the command counts as published. The headers carry `x-correlation-id`, this
//! delivery's extension of the request's ID (the ID of its `commands.published` line),
//! and `idempotency-key`: in memory the key of the request that created the command,
//! kept with the queued message ([`MessageCorrelation::inject_current`],
//! [`IdempotencyKey::inject`]); in DB mode the outbox message's own key (a UUIDv7 stored
//! with it, the same on every publication, so a consumer's inbox absorbs a
//! re-publication; a request's key is only unique per client), written by the relay with
//! `traceparent` (see [`tower_ids::outbox`]). The event is not published `mandatory`: one
//! no queue is bound for is dropped by the exchange and counts as published.
//!
//! Publishing is "if available". A broker unreachable at start leaves the service
//! publishing by log only. A publish that fails later (no confirm within 5 s, a nack, a
//! closed channel) drops the connection, and the next publish opens another: in DB mode
//! the message stays pending and the relay tries it again (backing off up to 5 s while
//! the broker fails); in memory, which keeps nothing to retry from, the command stays
//! `sent` and the failure is a WARN. `tests/examples/commands_amqp.rs` consumes the event from an
//! exchange of its own, in memory and in DB mode.
//!
//! # Routes
//!
//! | Route | Idempotency key | Success | Errors (`application/problem+json`, `code`) |
//! |---|---|---|---|
//! | `POST /commands` | required | `201` the new command, `status: "queued"`; a replay of the first answer | `400` `body.invalid_json`, `415` `body.not_json`, `422` `body.invalid_fields` (also for a `device_id` or `name` with U+0000, which PostgreSQL text cannot hold: refused in every mode), `422` `body.too_deep` (a `payload` nested more than 32 deep), `500` `commands.failed_after_write` (only with `--fail-after-write-percent`), `503` `commands.publisher_stopped` (in memory) or `commands.database_unavailable` (DB mode, with `Retry-After: 1`; nothing was written); idempotency (see [`tower_ids::idempotency`]): `400` `idempotency.key_missing` / `idempotency.key_invalid` / `idempotency.key_repeated` / `idempotency.keys_disagree` / `idempotency.attempt_id_invalid` / `idempotency.client_invalid` / `idempotency.body_unreadable`, `401` `idempotency.client_missing`, `409` `idempotency.in_flight` (with `Retry-After`), `410` `idempotency.not_replayable` (an answer over 1 MiB: only with `--max-body-bytes` near that), `422` `idempotency.fingerprint_mismatch`, `503` `idempotency.store_unavailable` (with Redis or in DB mode), `503` `idempotency.not_committed` / `idempotency.outcome_unknown` (DB mode), `503` `idempotency.overloaded` (only when `--max-concurrent-requests` × `--max-body-bytes` is over 64 MiB) |
//! | `GET /metrics` | none | with `--features metrics`: `200`, every metric in Prometheus text | |
//! | `GET /commands` | none | `200` every command, oldest first (in DB mode, the newest `--max-commands`, oldest first) | DB mode: `503` `commands.database_unavailable` |
//! | `GET /commands/{id}` | none | `200` the command | `404` `commands.not_found`; DB mode: `503` `commands.database_unavailable` |
//! | `POST /commands/{id}/cancel` | optional | `200` the command, `status: "cancelled"`; a replay of the first answer | `404` `commands.not_found`, `409` `commands.already_sent`, `500` `commands.failed_after_write` (only with `--fail-after-write-percent`); DB mode: `503` `commands.database_unavailable`; idempotency: as `POST /commands`, less `key_missing` |
//! | any other path | | | `404` `route.not_found` |
//! | any other method on these paths | | | `405` `route.method_not_allowed`, with `Allow` |
//!
//! Any route may also answer `503` `server.overloaded` (with `Retry-After: 1`), `408`
//! `request.timeout` or `request.body_timeout`, and `413` `request.body_too_large` (see
//! [Limits](#limits)).
//!
//! Every response of a `POST` route carries `idempotent-replayed` (`true` on a replay,
//! else `false`), and echoes `attempt-id` when the client sent one; a replay, a `409`
//! and a `410` also carry `idempotency-first-seen` and `idempotency-request-count`, and
//! a replay `original-attempt-id` (the first attempt's `attempt-id`, else its
//! correlation ID). A replay
//! is the first response byte for byte (status, headers, body) except for the
//! per-attempt headers (`x-correlation-id`, `attempt-id`, `date`). Which answers are
//! kept is the layer's default rule, [`StorageRule::Default`]: successes and server errors
//! are kept and replayed; a refusal of the handler's own (every `4xx`, such as `422`
//! `body.invalid_fields`) and a `503` are not, so a corrected command under the same
//! key runs. In DB mode a `5xx` is rolled back with the request's writes and not kept
//! either: its retry runs again (`--fail-after-write-percent` shows both). A cancel sent
//! without a key runs every time.
//!
//! A command is `{"id", "device_id", "name", "payload", "status", "created_at"}`: `id` is
//! the command's own UUID (not the correlation ID, which names one attempt), `status` is
//! `queued`, `sent` or `cancelled`, and `created_at` is RFC 3339 in UTC.
//!
//! # Events
//!
//! | `event` | Level | When |
//! |---|---|---|
//! | `http.access` | INFO | a request was answered: `status`, `latency_ms`, in the span `request{method, path, correlation_id, idempotency_outcome, idempotency_key, ...}` (and `trace_id` with `--features opentelemetry`) |
//! | `commands.limits` | INFO | at start: every limit and timeout in force, and the open-files limit |
//! | `commands.listening` | INFO | the listener is bound |
//! | `commands.store` | INFO | where idempotency records are kept: `store` = `memory`, `redis` or `postgres` |
//! | `commands.schema_ready` | INFO | DB mode, at start: the tables exist |
//! | `commands.created` | DEBUG | a command was stored and queued (in DB mode: written in the request's transaction, which commits after the handler answers); DEBUG, as the access line says it (`idempotency_outcome="executed"`, `status=201`) |
//! | `commands.cancelled` | INFO | a command was cancelled |
//! | `commands.published` | INFO | the publisher sent a command (`command_id`, `device_id`, `amqp` = whether it also went to the broker), in its span `publish{correlation_id}` (DB mode: the relay's `outbox.publish{correlation_id, message_id, destination}`): the creating request's ID extended for the delivery, and with `--features opentelemetry` the request's `trace_id` |
//! | `commands.amqp_connected` | INFO | `--amqp-url`, at start: the exchange is declared, events go to it |
//! | `commands.amqp_unavailable` | WARN | `--amqp-url`, at start: the broker could not be reached; events are published by log only |
//! | `commands.amqp_publish_failed` | WARN | `--amqp-url`: the broker did not confirm an event (`error`); in DB mode its message stays pending and is retried, in memory it is published by log only |
//! | `commands.publish_skipped` | INFO | the publisher found the command cancelled (`reason` = `cancelled`) or dropped from the list (`evicted`); in DB mode, already sent (`already_sent`: its message taken again after a relay died) or gone (`missing`) |
//! | `commands.database_failed` | WARN | DB mode: a database call of a request failed or timed out (`doing`, `error`); the request is answered `503` |
//! | `commands.publish_failed` | WARN | DB mode: the relay's sink could not read or mark a command; its message stays pending and the relay tries again |
//! | `commands.transaction_missing`, `commands.transaction_over` | ERROR | DB mode: a create found no request transaction, or one already committed (neither is expected); answered `500` |
//! | `commands.failing_on_purpose` | WARN | at start, with `--fail-after-write-percent` above 0: `percent` of the `POST` handlers will fail after their writes |
//! | `commands.failed_after_write` | WARN | `--fail-after-write-percent`: a `POST` handler failed on purpose after its writes, answering `500` |
//! | `commands.evicted` | INFO | the list was full: its oldest command was dropped |
//! | `commands.bad_request` | WARN | a create request's body was refused (the body is never logged) |
//! | `commands.body_refused` | INFO | a request body stalled (`reason` = `timeout`) or grew past the limit (`too_large`) |
//! | `commands.not_found` | INFO | an unknown command ID was asked for |
//! | `commands.overloaded` | DEBUG | a request was shed (DEBUG: under overload, a line per request would add to it) |
//! | `http.connection_closed` | DEBUG | a connection ended in an error: the client hung up, or sent no request head within `--header-read-timeout-ms` |
//! | `commands.open_files_limit_failed` | WARN | the open-files limit could not be raised |
//! | `commands.internal_error` | ERROR | an error reached the limits' error handler that was not a shed request (none is expected) |
//! | `http.accept_failed` | WARN | accepting a connection failed (for example out of file descriptors); the loop pauses 100 ms |
//! | `commands.shutting_down` | INFO | Ctrl-C or SIGTERM (`signal`): the listener is closed, the requests in flight finish |
//! | `shutdown.drained` | INFO | every connection is done and the idempotency layer owes its store nothing (`waited_ms`; `pending`: what it owed when the wait began) |
//! | `shutdown.drain_incomplete` | WARN | `--drain-timeout-ms` passed with work still owed (`unsettled`); each piece was named in an `idempotency.drain_unsettled` WARN in its request's span |
//! | `commands.stopped` | INFO | the queue is drained; the process exits 0 |
//!
//! The idempotency layer adds its own events: its steps (`idempotency.replayed`,
//! `idempotency.stored`, ...) at DEBUG (`RUST_LOG=info,tower_ids::idempotency=debug`
//! shows them), its warnings (`idempotency.conflict`, `idempotency.store_failed`, ...)
//! at WARN, inside the request's span; see [`tower_ids::idempotency`]. In DB mode the
//! relay adds its own (`outbox.sink_unavailable`, `outbox.round_failed`, ...; see
//! [`tower_ids::outbox`]).
//!
//! [`CorrelationId::extend_redelivery`]: tower_ids::correlation::CorrelationId::extend_redelivery
//! [`IdempotencyLayer`]: tower_ids::idempotency::IdempotencyLayer
//! [`Drain`]: tower_ids::idempotency::Drain
//! [`StorageRule::Default`]: tower_ids::idempotency::StorageRule::Default
//! [`CorrelationLayer::access_log`]: tower_ids::correlation::CorrelationLayer::access_log
//! [`MokaStore`]: tower_ids::idempotency::MokaStore
//! [`MessageCorrelation::inject_current`]: tower_ids::correlation::MessageCorrelation::inject_current
//! [`IdempotencyKey::inject`]: tower_ids::idempotency::IdempotencyKey::inject
//! [`Outbox::enqueue`]: tower_ids::outbox::Outbox::enqueue
//! [`Relay`]: tower_ids::outbox::Relay

// glibc's malloc makes a thread that frees memory another thread allocated wait on that
// thread's arena lock; on tokio's work-stealing runtime a request is often dropped by
// the worker that did not read it. Under `benches/load.sh` that was 0.36 futex calls
// per replay and 0.28 per first execution (0.05 on the correlated route); mimalloc
// frees without that lock, and took both to 0.04.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod api;
mod broker;
#[path = "../support/http1.rs"]
mod http1;
mod load;
mod memory;
#[cfg(feature = "metrics")]
mod metrics;
#[cfg(feature = "postgres")]
mod postgres;
mod publisher;
#[cfg(feature = "postgres")]
mod relay;
mod routes;
mod server;
#[path = "../support/shutdown.rs"]
mod shutdown;

use std::{
    net::SocketAddr,
    num::{NonZeroU64, NonZeroUsize},
    sync::Arc,
    time::Duration,
};

use axum::Router;
use clap::{Parser, ValueEnum};
use http::{header, HeaderName, HeaderValue, Method};
use tokio::{net::TcpListener, sync::mpsc, task::JoinHandle};
use tower_http::cors::CorsLayer;
use tower_ids::cors;
use tower_ids::idempotency::{IdempotencyStore, MokaStore};
use tracing_subscriber::{
    filter::LevelFilter, fmt::writer::BoxMakeWriter, layer::SubscriberExt as _,
    util::SubscriberInitExt as _, EnvFilter, Layer as _,
};

use crate::{
    broker::Broker,
    memory::{Commands, Memory, MAX_COMMANDS},
    publisher::{publish, QUEUE_CAPACITY},
    routes::{app, AppState, Storage},
    server::{
        listen, raise_open_files_limit, shutdown_signal, Limits, MAX_BODY_BYTES,
        MAX_CONCURRENT_REQUESTS, REQUEST_TIMEOUT_MS,
    },
};

/// Default `--idempotency-lease-ms`: the library's default lease
/// ([`Policy::lease`](tower_ids::idempotency::Policy::lease), 10 s), the longest store
/// outage a running request's claim outlives. The claim is renewed while the request
/// runs; a crashed request's retries get `409` for at most one and a half leases.
const IDEMPOTENCY_LEASE_MS: NonZeroU64 = NonZeroU64::new(10_000).unwrap();

/// How long `--redis-wait-replicas` waits for the replicas' acknowledgement: a replica
/// on the same network answers in a millisecond; half a second rides out a busy one.
#[cfg(feature = "redis")]
const REDIS_WAIT_TIMEOUT: Duration = Duration::from_millis(500);

/// Default `--amqp-exchange`: named after what it carries, as the routing keys
/// (`command.created`) are.
const AMQP_EXCHANGE: &str = "commands";

/// The Command Service: tower-ids' demo of correlation IDs and idempotency keys.
#[derive(Debug, Parser)]
struct Args {
    /// Address to listen on; port 0 picks a free port (the log says which).
    #[arg(long, default_value = "127.0.0.1:3000")]
    addr: SocketAddr,

    /// Log format, written to stdout.
    #[arg(long, value_enum, default_value_t = LogFormat::Pretty)]
    log_format: LogFormat,

    /// Milliseconds from queueing a command to publishing it.
    #[arg(long, default_value_t = 200)]
    publish_delay_ms: u64,

    /// Milliseconds the POST handlers sleep before doing anything, so that a retry can
    /// overlap the first request (and get 409).
    #[arg(long, default_value_t = 0)]
    handler_delay_ms: u64,

    /// Milliseconds the POST handlers wait after their writes, before answering. In DB
    /// mode the idempotency layer commits the request's transaction once the handler
    /// has answered: this is the time between the writes and the commit.
    #[arg(long, default_value_t = 0)]
    commit_delay_ms: u64,

    /// Percent of the POST handlers that fail with 500 after their writes (and after
    /// --commit-delay-ms), to try what the idempotency layer does with a server error:
    /// in memory the writes stand and the 500 is replayed to a retry; in DB mode they are
    /// rolled back and a retry runs again. 0 (the default) fails none, 100 every one.
    #[arg(long, value_name = "PERCENT", default_value_t = 0)]
    #[arg(value_parser = clap::value_parser!(u8).range(0..=100))]
    fail_after_write_percent: u8,

    /// Seconds an idempotency key's outcome is replayed.
    #[arg(long, default_value_t = 86_400)]
    idempotency_ttl_secs: u64,

    /// Milliseconds an idempotency key stays claimed by a request that stopped renewing
    /// its claim (its process died): retries of it get 409 until then.
    #[arg(long, default_value_t = IDEMPOTENCY_LEASE_MS)]
    idempotency_lease_ms: NonZeroU64,

    /// Milliseconds one call to the idempotency store (Redis or PostgreSQL) may take;
    /// default the store's own (250 ms for Redis, 1 s for PostgreSQL). A quarter of
    /// `--idempotency-lease-ms` must cover it and about 100 ms more: a shorter lease is
    /// refused at start.
    #[arg(long)]
    store_timeout_ms: Option<NonZeroU64>,

    #[command(flatten)]
    timeouts: http1::Timeouts,

    /// Milliseconds a request may take from its head to its answer before it is answered
    /// 408 and its connection closed.
    #[arg(long, default_value_t = REQUEST_TIMEOUT_MS)]
    request_timeout_ms: NonZeroU64,

    /// Largest request body in bytes; a larger one is answered 413.
    #[arg(long, default_value_t = MAX_BODY_BYTES)]
    max_body_bytes: NonZeroUsize,

    /// Requests handled at once; more are shed at once with 503 and Retry-After.
    #[arg(long, default_value_t = MAX_CONCURRENT_REQUESTS)]
    max_concurrent_requests: NonZeroUsize,

    /// Commands the in-memory list keeps; creating one more drops the oldest. In DB
    /// mode, which keeps every command: how many of the newest GET /commands answers.
    #[arg(long, default_value_t = MAX_COMMANDS)]
    max_commands: NonZeroUsize,

    /// PostgreSQL URL (`postgres://USER@HOST:PORT/DATABASE`): keep the commands, their
    /// outbox and the idempotency records there, shared by every replica started with
    /// it, and commit each POST's writes with its idempotency record. Without it,
    /// everything is in memory.
    #[cfg(feature = "postgres")]
    #[arg(long, value_name = "URL")]
    #[cfg_attr(
        feature = "redis",
        arg(conflicts_with_all = ["redis_url", "redis_cluster_url"])
    )]
    database_url: Option<String>,

    /// Redis (or Valkey) URL for the idempotency records, shared by every replica
    /// started with it (`redis://HOST:PORT`); without it, records are kept in memory.
    #[cfg(feature = "redis")]
    #[arg(long, value_name = "URL", conflicts_with = "redis_cluster_url")]
    redis_url: Option<String>,

    /// A node of the Redis Cluster that keeps the idempotency records, shared by every
    /// replica started with it (`redis://HOST:PORT`); repeat it for more seed nodes.
    /// The client learns the rest of the cluster from them.
    #[cfg(feature = "redis")]
    #[arg(long, value_name = "URL")]
    redis_cluster_url: Vec<String>,

    /// With Redis: count a claim and a completion only once this many replicas of
    /// the primary acknowledged them (Redis's WAIT, within 500 ms); 0 waits for none.
    #[cfg(feature = "redis")]
    #[arg(long, value_name = "N", default_value_t = 0)]
    redis_wait_replicas: u32,

    /// AMQP URL (`amqp://USER:PASS@HOST:PORT/VHOST`): also publish each event to
    /// RabbitMQ, if it can be reached at start; without it, events are published by
    /// log only.
    #[arg(long, value_name = "URL")]
    amqp_url: Option<String>,

    /// The topic exchange `--amqp-url` publishes to, declared (durable) at start.
    #[arg(long, value_name = "NAME", default_value = AMQP_EXCHANGE)]
    amqp_exchange: String,

    /// Write each log line before going on, instead of through the writer thread: for a
    /// test that kills the service and reads its log as the record of what it did (a
    /// line still queued in the writer thread dies with the process).
    #[arg(long)]
    log_sync: bool,

    /// Also serve the `/load/*` routes that `benches/load.sh` drives: one trivial
    /// handler behind no layer, a layer that does nothing, tower-http's request-ID
    /// pair, the correlation layer, and both layers.
    #[arg(long)]
    load_routes: bool,

    /// Let a web page on this origin call the service from a browser (CORS), with
    /// the layers' headers allowed and exposed (`tower_ids::cors`).
    #[arg(long)]
    cors_origin: Option<HeaderValue>,

    #[command(flatten)]
    drain: shutdown::DrainArgs,
}

impl From<&Args> for Limits {
    fn from(args: &Args) -> Self {
        Self {
            timeouts: args.timeouts,
            request_timeout: Duration::from_millis(args.request_timeout_ms.get()),
            max_body_bytes: args.max_body_bytes.get(),
            max_concurrent_requests: args.max_concurrent_requests.get(),
        }
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    /// Human-readable, one line per event, prefixed by its spans and their fields.
    Pretty,
    /// One JSON object per line, with the current span's fields.
    Json,
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let args = Args::parse();
    // Held to the end of `main`: dropping it writes out the lines still queued.
    let _log_writer = init_tracing(args.log_format, args.log_sync);
    #[cfg(feature = "metrics")]
    metrics::install();
    let open_files = raise_open_files_limit();
    let limits = Limits::from(&args);
    tracing::info!(
        event = "commands.limits",
        header_read_timeout_ms = args.timeouts.header_read_timeout_ms.get(),
        body_timeout_ms = args.timeouts.body_timeout_ms.get(),
        request_timeout_ms = args.request_timeout_ms.get(),
        max_body_bytes = limits.max_body_bytes,
        max_concurrent_requests = limits.max_concurrent_requests,
        max_commands = args.max_commands.get(),
        open_files_limit = open_files,
        "limits in force"
    );
    if args.fail_after_write_percent > 0 {
        tracing::warn!(
            event = "commands.failing_on_purpose",
            percent = args.fail_after_write_percent,
            "--fail-after-write-percent: POST handlers fail with 500 after their writes"
        );
    }

    let broker = match &args.amqp_url {
        Some(url) => Broker::connect(url, &args.amqp_exchange)
            .await
            .map(Arc::new),
        None => None,
    };

    #[cfg(feature = "postgres")]
    if let Some(url) = &args.database_url {
        return run_on_database(url, &args, limits, broker).await;
    }

    // Connect first: a replica that cannot reach its Redis should not start listening.
    #[cfg(feature = "redis")]
    let redis = {
        use tower_ids::idempotency::store::RedisStore;
        let builder = match &args.redis_url {
            Some(url) => Some(RedisStore::builder(url.as_str())),
            None if !args.redis_cluster_url.is_empty() => {
                Some(RedisStore::cluster(args.redis_cluster_url.iter().cloned()))
            }
            None => None,
        };
        let builder = builder.map(|builder| match args.store_timeout_ms {
            Some(ms) => builder.command_timeout(Duration::from_millis(ms.get())),
            None => builder,
        });
        match builder {
            Some(builder) => Some(
                builder
                    .wait_for_replicas(args.redis_wait_replicas, REDIS_WAIT_TIMEOUT)
                    .build()
                    .await
                    .map_err(std::io::Error::other)?,
            ),
            None => None,
        }
    };

    let commands = Commands::new(args.max_commands);
    let (queue, deliveries) = mpsc::channel(QUEUE_CAPACITY);
    let publisher = tokio::spawn(publish(
        commands.clone(),
        deliveries,
        Duration::from_millis(args.publish_delay_ms),
        broker,
    ));

    let state = app_state(Memory { commands, queue }, &args);
    #[cfg(feature = "redis")]
    let (app, drain) = match redis {
        Some(store) => app_with(state, store, "redis", &args, limits),
        None => app_with(state, MokaStore::new(), "memory", &args, limits),
    };
    #[cfg(not(feature = "redis"))]
    let (app, drain) = app_with(state, MokaStore::new(), "memory", &args, limits);
    let listener = listen_logged(args.addr)?;
    http1::serve(listener, app, limits.timeouts, shutdown_signal()).await;
    // Every connection is done; what the idempotency layer still owes the store (an
    // outcome kept while Redis was away, a handler whose client hung up) is not.
    shutdown::drain(&[drain], args.drain.timeout()).await;

    // The router, and with it every queue sender, is gone: the publisher drains what is
    // left in the queue and returns.
    stopped(publisher).await;
    Ok(())
}

/// DB mode (`--database-url`): the commands, their outbox and the idempotency records
/// in PostgreSQL (see [`postgres`]).
#[cfg(feature = "postgres")]
async fn run_on_database(
    url: &str,
    args: &Args,
    limits: Limits,
    broker: Option<Arc<Broker>>,
) -> std::io::Result<()> {
    // Connect first: a replica that cannot reach its database should not start
    // listening.
    let store_timeout = args
        .store_timeout_ms
        .map(|ms| Duration::from_millis(ms.get()));
    let (database, store) = postgres::Database::connect(url, args.max_commands, store_timeout)
        .await
        .map_err(std::io::Error::other)?;
    let (stop, publisher) = relay::spawn(
        &database,
        broker,
        Duration::from_millis(args.publish_delay_ms),
    );

    let (app, drain) = app_with(app_state(database, args), store, "postgres", args, limits);
    let listener = listen_logged(args.addr)?;
    http1::serve(listener, app, limits.timeouts, shutdown_signal()).await;
    shutdown::drain(&[drain], args.drain.timeout()).await;

    // The requests in flight have finished: the relay ends its round and stops.
    // Messages still pending wait in the outbox for the next start, or another replica.
    let _ = stop.send(true);
    stopped(publisher).await;
    Ok(())
}

/// A listener on `addr`, and the line that says where (`listening on http://ADDR`).
fn listen_logged(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let listener = listen(addr)?;
    let addr = listener.local_addr()?;
    tracing::info!(event = "commands.listening", %addr, "listening on http://{addr}");
    Ok(listener)
}

fn app_state<S: Storage>(storage: S, args: &Args) -> AppState<S> {
    AppState {
        storage,
        handler_delay: Duration::from_millis(args.handler_delay_ms),
        commit_delay: Duration::from_millis(args.commit_delay_ms),
        fail_after_write_percent: args.fail_after_write_percent,
    }
}

/// [`app`] with the flags' idempotency settings, and the [`Drain`] of its idempotency
/// layer.
///
/// [`Drain`]: tower_ids::idempotency::Drain
fn app_with<S: Storage, St: IdempotencyStore>(
    state: AppState<S>,
    store: St,
    kind: &'static str,
    args: &Args,
    limits: Limits,
) -> (Router, tower_ids::idempotency::Drain) {
    let built = app(
        state,
        Duration::from_secs(args.idempotency_ttl_secs),
        Duration::from_millis(args.idempotency_lease_ms.get()),
        store,
        kind,
        args.load_routes,
        limits,
    );
    // Before the listener: a setting the layer refuses is one line, and exit code 2.
    let (app, drain) = match built {
        Ok(built) => built,
        Err(error) => {
            eprintln!("commands: --idempotency-lease-ms: {error}");
            std::process::exit(2);
        }
    };
    let app = match &args.cors_origin {
        // Last, so outermost: it answers preflights before any other layer runs.
        Some(origin) => app.layer(
            CorsLayer::new()
                .allow_origin(origin.clone())
                .allow_methods([Method::GET, Method::POST])
                .allow_headers(
                    cors::ALLOW_HEADERS
                        .into_iter()
                        .chain([
                            header::CONTENT_TYPE,
                            HeaderName::from_static("x-api-key"),
                            HeaderName::from_static("x-request-id"),
                        ])
                        .collect::<Vec<_>>(),
                )
                .expose_headers(cors::EXPOSE_HEADERS),
        ),
        None => app,
    };
    (app, drain)
}

/// Waits for the publisher to return, and says the service stopped.
async fn stopped(publisher: JoinHandle<()>) {
    if let Err(error) = publisher.await {
        tracing::error!(event = "commands.publisher_failed", %error, "publisher task failed");
    }
    tracing::info!(event = "commands.stopped", "stopped");
}

/// Logs to stdout through a writer thread of its own (`tracing-appender`), so a
/// request never waits on the terminal or the pipe; a full queue makes the logging
/// thread wait rather than drop a line. With `sync` (`--log-sync`), each line is
/// written before the code that logged it goes on. With `--features opentelemetry`, the spans also
/// go to OpenTelemetry (exported nowhere: add an exporter to the provider here), so an
/// incoming `traceparent` is continued and every request's lines carry its `trace_id`.
fn init_tracing(
    format: LogFormat,
    sync: bool,
) -> Option<tracing_appender::non_blocking::WorkerGuard> {
    let filter = EnvFilter::builder()
        .with_default_directive(LevelFilter::INFO.into())
        .from_env_lossy();
    // Colours only for a terminal: a log file or a pipe gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let (writer, guard) = if sync {
        (BoxMakeWriter::new(std::io::stdout), None)
    } else {
        let (writer, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
            .lossy(false)
            // The writer thread drains every line queued and then flushes: buffered,
            // a burst of lines is one write, not a write per line.
            .finish(std::io::BufWriter::with_capacity(
                64 * 1024,
                std::io::stdout(),
            ));
        (BoxMakeWriter::new(writer), Some(guard))
    };
    let lines = match format {
        LogFormat::Pretty => tracing_subscriber::fmt::layer()
            .with_ansi(ansi)
            .with_writer(writer)
            .boxed(),
        // json-subscriber writes the lines tracing-subscriber's `json()` does, but keeps
        // each span's fields as JSON once recorded, where `json()` parses them again
        // for every line (see the README's performance section).
        // The current span only, not the list of spans as well: a request's lines are
        // in its one span, which holds every field, and the list would write them twice.
        LogFormat::Json => json_subscriber::fmt::layer()
            .with_writer(writer)
            .with_current_span(true)
            .with_span_list(false)
            .boxed(),
    };
    let subscriber = tracing_subscriber::registry().with(lines);
    #[cfg(feature = "opentelemetry")]
    let subscriber = {
        use opentelemetry::trace::TracerProvider as _;
        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
        subscriber.with(tracing_opentelemetry::layer().with_tracer(provider.tracer("commands")))
    };
    let subscriber = subscriber.with(filter);
    subscriber.init();
    guard
}
