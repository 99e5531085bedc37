BEGIN;
SET LOCAL lock_timeout = '50ms';
DO $$ BEGIN INSERT INTO t (scope, token, completed, fingerprint, first_seen_ms, epoch, request_count, status, record, expires_at) VALUES (sha256('42'::bytea), decode(md5('7'), 'hex'), false, sha256('42fp'::bytea), (extract(epoch from clock_timestamp()) * 1000)::bigint, 1, 1, NULL, NULL, now() + interval '1 day') ON CONFLICT (scope) DO UPDATE SET request_count = t.request_count + 1 WHERE t.expires_at <= now() OR t.completed; EXCEPTION WHEN lock_not_available THEN NULL; END $$;
ROLLBACK;
