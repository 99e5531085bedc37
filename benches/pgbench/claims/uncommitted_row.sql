\set k random(1, 1000000000)
\set tok random(1, 1000000000)
BEGIN;
SET LOCAL lock_timeout = '50ms';
INSERT INTO t (scope, token, completed, fingerprint, first_seen_ms, epoch, request_count, status, record, expires_at) VALUES (sha256(:k::text::bytea), decode(md5(:tok::text), 'hex'), false, sha256((:k::text || 'fp')::bytea), (extract(epoch from clock_timestamp()) * 1000)::bigint, 1, 1, NULL, NULL, now() + interval '1 day') ON CONFLICT (scope) DO UPDATE SET request_count = t.request_count + 1 WHERE t.expires_at <= now() OR t.completed RETURNING token, completed, record;
UPDATE t SET completed = true, status = 201, record = decode(repeat('ab', 200), 'hex'), expires_at = now() + interval '1 day' WHERE scope = sha256(:k::text::bytea) RETURNING pg_current_xact_id()::text;
COMMIT;
