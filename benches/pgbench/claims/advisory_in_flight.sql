\set k 42
BEGIN;
SELECT pg_try_advisory_xact_lock(('x' || encode(substring(sha256(:k::text::bytea) from 1 for 8), 'hex'))::bit(64)::bigint);
ROLLBACK;
