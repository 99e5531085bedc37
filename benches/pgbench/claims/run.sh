#!/usr/bin/env bash
# How the transactional claim was chosen: three ways to mark a first execution in flight,
# run interleaved with pgbench on a throwaway database (see benches/README.md,
# "PostgreSQL: how transactional mode claims a key"). Needs pgbench and a PostgreSQL at
# 127.0.0.1:5432 (user postgres, trust).
set -euo pipefail
cd "$(dirname "$0")"
DB="pgb_claims_$$"
PSQL=(psql -h 127.0.0.1 -U postgres -v ON_ERROR_STOP=1 -Atq)
createdb -h 127.0.0.1 -U postgres "$DB"
trap 'dropdb -h 127.0.0.1 -U postgres --force "$DB"' EXIT
"${PSQL[@]}" -d "$DB" -c "CREATE TABLE t (scope bytea PRIMARY KEY, token bytea NOT NULL,
  completed boolean NOT NULL DEFAULT false, fingerprint bytea NOT NULL,
  first_seen_ms bigint NOT NULL, epoch bigint, request_count bigint NOT NULL DEFAULT 1,
  status smallint, record bytea, expires_at timestamptz NOT NULL);
  CREATE INDEX ON t (expires_at);"
echo "round,script,tps,latency_ms,rows,bytes,dead_tuples"
for round in 1 2 3; do
  for script in advisory uncommitted_row lease; do
    "${PSQL[@]}" -d "$DB" -c "TRUNCATE t; CHECKPOINT;"
    out=$(pgbench -h 127.0.0.1 -U postgres -n -M prepared -c 8 -j 2 -T 20 -f "$script.sql" "$DB" 2>&1)
    sleep 2
    tps=$(grep -oP 'tps = \K[0-9.]+' <<<"$out")
    latency=$(grep -oP 'latency average = \K[0-9.]+' <<<"$out")
    stats=$("${PSQL[@]}" -d "$DB" -F, -c "SELECT (SELECT count(*) FROM t), pg_total_relation_size('t'), n_dead_tup FROM pg_stat_user_tables WHERE relname = 't'")
    echo "$round,$script,$tps,$latency,$stats"
  done
done
