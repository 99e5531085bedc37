\set k random(1, 1000000000)
\set tok random(1, 1000000000)
SELECT completed, record FROM t WHERE scope = sha256(:k::text::bytea) AND completed AND expires_at > now();
BEGIN;
SELECT pg_try_advisory_xact_lock(('x' || encode(substring(sha256(:k::text::bytea) from 1 for 8), 'hex'))::bit(64)::bigint);
SELECT completed, record FROM t WHERE scope = sha256(:k::text::bytea);
INSERT INTO t (scope, token, completed, fingerprint, first_seen_ms, epoch, request_count, status, record, expires_at) VALUES (sha256(:k::text::bytea), decode(md5(:tok::text), 'hex'), true, sha256((:k::text || 'fp')::bytea), (extract(epoch from clock_timestamp()) * 1000)::bigint, 1, 1, 201, decode(repeat('ab', 200), 'hex'), now() + interval '1 day') ON CONFLICT (scope) DO UPDATE SET token = EXCLUDED.token, completed = true, fingerprint = EXCLUDED.fingerprint, first_seen_ms = EXCLUDED.first_seen_ms, epoch = EXCLUDED.epoch, request_count = 1, status = EXCLUDED.status, record = EXCLUDED.record, expires_at = EXCLUDED.expires_at WHERE t.expires_at <= now() RETURNING pg_current_xact_id()::text;
COMMIT;
