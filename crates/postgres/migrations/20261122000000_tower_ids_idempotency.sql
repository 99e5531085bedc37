-- The idempotency records of tower-ids' PostgresStore (feature `postgres`).
-- `PostgresStore::migrate()` runs this file (with the table name the store was built
-- with); or copy it into your own migrations.
--
-- One row per scope (a SHA-256 digest of client, method, path and key; never the
-- client's credential or the raw key). While the request runs the row is its claim:
-- the fencing token of the worker holding it, and the lease's end in `expires_at`.
-- Once the request has run the row holds its record, and `expires_at` is the TTL's end.
CREATE TABLE IF NOT EXISTS tower_ids_idempotency (
    scope         bytea       PRIMARY KEY,
    token         bytea       NOT NULL,
    completed     boolean     NOT NULL DEFAULT false,
    fingerprint   bytea       NOT NULL,
    first_seen_ms bigint      NOT NULL,
    epoch         bigint,
    request_count bigint      NOT NULL DEFAULT 1,
    -- The stored response's status, for operators; the response itself is in `record`.
    status        smallint,
    record        bytea,
    expires_at    timestamptz NOT NULL
);

-- Expired rows are removed in small batches, oldest first.
CREATE INDEX IF NOT EXISTS tower_ids_idempotency_expires_at
    ON tower_ids_idempotency (expires_at);
