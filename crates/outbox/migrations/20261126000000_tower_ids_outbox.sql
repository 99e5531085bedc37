-- The outbox of tower-ids (feature `outbox`): messages a request enqueues in its own
-- transaction, published by a relay once that transaction has committed.
-- `Outbox::migrate()` runs this file (with the table name the outbox was built with);
-- or copy it into your own migrations.
--
-- A row is pending until a relay publishes it (`published_at`) or gives up on it after
-- its attempts (`dead_at`: a dead letter, kept until you requeue or delete it).
-- Published rows are trimmed after the relay's retention.
CREATE TABLE IF NOT EXISTS tower_ids_outbox (
    id              bigserial   PRIMARY KEY,
    destination     text        NOT NULL,
    -- Messages with one partition key are published in commit order; NULL: no order.
    partition_key   text,
    -- The message's own idempotency key, sent as its `idempotency-key` header: a
    -- consumer's inbox absorbs a message published again after a relay crash.
    idempotency_key text        NOT NULL,
    -- A JSON object of header names to string values, the application's own.
    headers         jsonb       NOT NULL,
    payload         bytea       NOT NULL,
    -- The enqueuing request's correlation ID and W3C trace context.
    correlation_id  text,
    traceparent     text,
    tracestate      text,
    enqueued_at     timestamptz NOT NULL DEFAULT now(),
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    last_error      text,
    published_at    timestamptz,
    dead_at         timestamptz
);

-- What relays read: the pending rows in commit order, and those of one partition key.
CREATE INDEX IF NOT EXISTS tower_ids_outbox_pending
    ON tower_ids_outbox (id) WHERE published_at IS NULL AND dead_at IS NULL;
CREATE INDEX IF NOT EXISTS tower_ids_outbox_pending_partition
    ON tower_ids_outbox (partition_key, id) WHERE published_at IS NULL AND dead_at IS NULL;
-- What retention trims.
CREATE INDEX IF NOT EXISTS tower_ids_outbox_published
    ON tower_ids_outbox (published_at) WHERE published_at IS NOT NULL;
