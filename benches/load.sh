#!/usr/bin/env bash
# Load test: the `commands` example in release mode on 127.0.0.1, driven by wrk.
#
# Measures requests per second and p50/p99 latency for five workloads on one server,
# each run against the same trivial handler (see `--load-routes` in
# examples/commands/main.rs), so the difference between two rows is the layers around it:
#
#   bare        POST /load/bare          no layer
#   noop        POST /load/noop          a layer that does nothing (tower's MapRequestLayer with
#                                        the identity), applied as any route layer is: what
#                                        wrapping an axum route costs before the layer does anything
#   tower_http  POST /load/tower-http    tower-http's SetRequestId + PropagateRequestId (UUIDv4),
#                                        the peer of the correlation layer
#   correlated  POST /load/correlated    CorrelationLayer (no incoming ID: one generated)
#   first       POST /load/idempotent    both layers, a fresh Idempotency-Key per request
#   replay      POST /load/idempotent    both layers, one key (run once beforehand)
#   logged_get     GET /load/logged      CorrelationLayer with its access line (access_log), as
#                                        the service's own routes: one line per request at INFO
#   logged_first   POST /load/logged     the same, then IdempotencyLayer, a fresh key per request
#   logged_replay  POST /load/logged     the same, one key
#   burst       POST /load/idempotent    BURST_CONNECTIONS connections sending one new key
#                                        at once, the handler sleeping 200 ms: it must run
#                                        exactly once; the others get 409 then replays
#
# The first nine run ROUNDS times, interleaved (bare, noop, tower_http, correlated,
# first, replay, logged_get, logged_first, logged_replay, bare, ...), DURATION seconds each, after a short warm-up; the table gives the median of the
# rounds, and throughput as the median of each round's ratio to that round's bare run.
# wrk is a closed loop (each connection waits for its answer), so latencies are
# per-request service times under that load, not open-loop latencies. "server CPU" is
# the server's user + system CPU time (from /proc) over the run divided by the requests
# answered: the cost of a request, which wrk's share of the cores does not blur.
#
# The notes give the load test's goals: server CPU per replay at most 2 us over the correlated
# route and per first execution at most 6 us over it, and replays at least 0.90 of the
# correlated route's throughput (0.85 with SERVER_LOG=info); with SERVER_LOG=info, where
# each logged route writes its one access line, replays at least 0.90 and first
# executions at least 0.80 of logged_get's throughput. The demo allocates with
# mimalloc (see examples/commands/main.rs), as every route here does.
#
# Usage: benches/load.sh        (about 6 minutes with the defaults)
# Settings (environment):
#   DURATION=10          seconds per run
#   ROUNDS=3             rounds of the six steady workloads
#   THREADS=2            wrk threads
#   CONNECTIONS=32       wrk connections for the steady workloads
#   BURST_CONNECTIONS=256
#   SERVER_LOG=warn      RUST_LOG for the server (its own events stay at info, for
#                        the address it listens on); `info` logs the access line of
#                        every request to the logged routes, as JSON, to a file
#   WORKER_THREADS=      tokio worker threads of the server (default: one per core)
#   PIN=                 1: the server on CPU 0 with one worker thread, wrk on CPU 1
#                        (one thread), so neither takes the other's core: server CPU per
#                        request then moves by a few percent between runs, not tens
#   COMPARE=             "NAME=BINARY NAME=BINARY ...": instead of the table above, compare
#                        builds of the commands example side by side. Each round starts
#                        each binary in turn on a fresh process and runs correlated,
#                        first and replay against it; the table gives each build's
#                        medians and its first execution's server CPU against the
#                        first build's. Nothing is built in this mode.
#   PROFILE=release      the cargo profile the example is built with; `dev` (with every
#                        feature, as `cargo test --all-features` built it) only checks
#                        that the script and its burst check work, as CI does: its
#                        figures are not for reading
#
# wrk: taken from PATH; when missing and this runs as root with apt-get, it is installed
# from the distribution (`apt-get install wrk`); otherwise the script says how to get it
# (Debian/Ubuntu: `sudo apt-get install wrk`; macOS: `brew install wrk`) and stops.
#
# Exit status: 0 when every run answered as expected (no socket errors, no unexpected
# status, the handler run once per fresh key, never on replays, once for the burst);
# 1 otherwise. Missing a throughput goal is reported, not an error.
set -euo pipefail

DURATION=${DURATION:-10}
ROUNDS=${ROUNDS:-3}
THREADS=${THREADS:-2}
CONNECTIONS=${CONNECTIONS:-32}
BURST_CONNECTIONS=${BURST_CONNECTIONS:-256}
SERVER_LOG=${SERVER_LOG:-warn}
PIN=${PIN:-}
server_cpus=()
load_cpus=()
if [ "$PIN" = 1 ]; then
    server_cpus=(taskset -c 0)
    load_cpus=(taskset -c 1)
    WORKER_THREADS=1
    THREADS=1
fi
BURST_SLEEP_MS=200

cd "$(dirname "$0")/.."

if ! command -v wrk >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "wrk not found: installing it with apt-get" >&2
        apt-get install -y wrk >/dev/null 2>&1 ||
            { apt-get update >/dev/null 2>&1 && apt-get install -y wrk >/dev/null 2>&1; }
    fi
fi
if ! command -v wrk >/dev/null; then
    echo "benches/load.sh needs wrk: 'sudo apt-get install wrk' (Debian, Ubuntu)," \
        "'brew install wrk' (macOS), or build it from https://github.com/wg/wrk" >&2
    exit 1
fi

work=$(mktemp -d)
server_pid=
cleanup() {
    if [ -n "$server_pid" ]; then
        kill "$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

PROFILE=${PROFILE:-release}
if [ -z "${COMPARE:-}" ]; then
    echo "building the commands example ($PROFILE)..." >&2
    target=$(cargo metadata --format-version 1 --no-deps |
        sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
    if [ "$PROFILE" = release ]; then
        cargo build --quiet --release --all-features --example commands
        binary=$target/release/examples/commands
    else
        cargo build --quiet --profile "$PROFILE" --all-features --example commands
        binary=$target/debug/examples/commands
    fi
fi

# Every request carries the same JSON body and client; wrk formats it once, except for
# `fresh.lua`, which sets a new key per request.
cat >"$work/common.lua" <<'EOF'
wrk.method = "POST"
wrk.body = '{"device_id":"thermostat-42","name":"set_temperature","payload":{"celsius":21.5}}'
wrk.headers["content-type"] = "application/json"
wrk.headers["x-api-key"] = "load-client"
local key = os.getenv("LOAD_KEY")
if key and key ~= "" then wrk.headers["idempotency-key"] = key end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "RESULT requests=%d duration_us=%d p50_us=%d p99_us=%d non2xx=%d socket_errors=%d\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.status, e.connect + e.read + e.write + e.timeout))
end
EOF
cat >"$work/get.lua" <<EOF
dofile("$work/common.lua")
wrk.method = "GET"
wrk.body = nil
wrk.headers["content-type"] = nil
EOF
cat >"$work/fresh.lua" <<EOF
dofile("$work/common.lua")
local started = 0
function setup(thread)
  started = started + 1
  thread:set("thread_number", started)
end
local prefix, counter
function init(args)
  prefix = os.getenv("LOAD_NONCE") .. "-" .. thread_number .. "-"
  counter = 0
end
function request()
  counter = counter + 1
  wrk.headers["idempotency-key"] = prefix .. counter
  return wrk.format()
end
EOF

# start_server BINARY: starts it on a free port; sets server_pid and base.
start_server() {
    env RUST_LOG="$SERVER_LOG,commands=info" ${WORKER_THREADS:+TOKIO_WORKER_THREADS="$WORKER_THREADS"} \
        "${server_cpus[@]}" "$1" --addr 127.0.0.1:0 --load-routes --log-format json >"$work/server.log" 2>&1 &
    server_pid=$!
    base=
    for _ in $(seq 100); do
        base=$(grep -o 'http://127\.0\.0\.1:[0-9]*' "$work/server.log" | head -n1 || true)
        [ -n "$base" ] && break
        sleep 0.1
    done
    [ -n "$base" ] || { echo "the server did not start:" >&2; cat "$work/server.log" >&2; exit 1; }
}

stop_server() {
    kill "$server_pid"
    wait "$server_pid" 2>/dev/null || true
    server_pid=
}

failed=0
# The handler's runs so far. A connection wrk closes at its deadline may still have a
# request in the server's socket buffer, which runs after wrk returns: let it land
# first, so that it is counted in the run that sent it.
executions() {
    sleep 0.5
    curl -sf "$base/load/executions"
}

# The server's CPU time so far (user + system), in clock ticks: with the request count,
# its CPU cost per request, which the load generator sharing the cores does not blur.
ticks_per_second=$(getconf CLK_TCK)
server_ticks() { awk '{ print $14 + $15 }' "/proc/$server_pid/stat"; }

# run NAME WRK_ARGS...: one wrk run; appends "NAME requests=... ..." to results.
run() {
    local name=$1
    shift
    local out ticks_before result
    ticks_before=$(server_ticks)
    out=$("${load_cpus[@]}" wrk --latency -t "$THREADS" "$@") || { echo "wrk failed: $out" >&2; exit 1; }
    result=$(grep '^RESULT ' <<<"$out") || { echo "no result from wrk: $out" >&2; exit 1; }
    result="$name ${result#RESULT } server_cpu_us=$((($(server_ticks) - ticks_before) * 1000000 / ticks_per_second))"
    echo "$result" >>"$work/results"
    echo "$result" >&2
}

field() { sed -n "s/.* $1=\([0-9]*\).*/\1/p" <<<"$2"; }

# check NAME LINE [409s-expected]: no socket errors, and only 2xx answers unless told
# (the burst's duplicates get 409 while the first request runs).
check() {
    local errors non2xx
    errors=$(field socket_errors "$2")
    non2xx=$(field non2xx "$2")
    if [ "$errors" != 0 ] || { [ "${3:-}" != 409s-expected ] && [ "$non2xx" != 0 ]; }; then
        echo "FAIL $1: $errors socket errors, $non2xx non-2xx answers" >&2
        failed=1
    fi
}

nonce=$(date +%s%N)
# Runs the replay key's first request. Again before each replay run: the fresh keys of
# the run before may have pushed the record out of the store (64 MiB, oldest first).
prime_replay_key() {
    curl -sf -o /dev/null -X POST "$base/load/$1" -H 'content-type: application/json' \
        -H 'x-api-key: load-client' -H "idempotency-key: replay-$nonce" \
        -d '{"device_id":"thermostat-42","name":"set_temperature","payload":{"celsius":21.5}}'
}

# check_runs NAME LINE RAN: a run of fresh keys ran the handler once per key answered
# (wrk counts the answers it read before the deadline; a connection's last request may
# have run without its answer being counted).
check_runs() {
    local answered
    answered=$(field requests "$2")
    if [ "$3" -lt "$answered" ] || [ "$3" -gt $((answered + CONNECTIONS)) ]; then
        echo "FAIL $1: $answered fresh keys answered, the handler ran $3 times" >&2
        failed=1
    fi
}

steady=(-c "$CONNECTIONS" -d "${DURATION}s")
: >"$work/results"

# warm_up ROUTES...: a second of each route, then two of fresh keys, which fill the store.
warm_up() {
    local route
    for route in "$@"; do
        "${load_cpus[@]}" wrk -t "$THREADS" -c "$CONNECTIONS" -d 1s -s "$work/common.lua" "$base/load/$route" >/dev/null
    done
    LOAD_NONCE="warm-$nonce-$RANDOM" "${load_cpus[@]}" wrk -t "$THREADS" -c "$CONNECTIONS" -d 2s -s "$work/fresh.lua" \
        "$base/load/idempotent" >/dev/null
}

# run_first NAME ROUTE ROUND: fresh keys on /load/ROUTE, each run once.
run_first() {
    local before line
    before=$(executions)
    LOAD_NONCE="$1-$nonce-$3" run "$1" "${steady[@]}" -s "$work/fresh.lua" "$base/load/$2"
    line=$(tail -n1 "$work/results")
    check "$1" "$line"
    check_runs "$1" "$line" $(($(executions) - before))
}

# run_replay NAME ROUTE: one key on /load/ROUTE, run once beforehand and never again.
run_replay() {
    local before ran
    prime_replay_key "$2"
    before=$(executions)
    LOAD_KEY="replay-$nonce" run "$1" "${steady[@]}" -s "$work/common.lua" "$base/load/$2"
    check "$1" "$(tail -n1 "$work/results")"
    ran=$(($(executions) - before))
    if [ "$ran" != 0 ]; then
        echo "FAIL $1: the handler ran $ran times" >&2
        failed=1
    fi
}

if [ -n "${COMPARE:-}" ]; then
    for round in $(seq "$ROUNDS"); do
        for build in $COMPARE; do
            name=${build%%=*}
            echo "round $round of $ROUNDS: $name" >&2
            start_server "${build#*=}"
            warm_up correlated
            run "$name/correlated" "${steady[@]}" -s "$work/common.lua" "$base/load/correlated"
            check "$name/correlated" "$(tail -n1 "$work/results")"
            run_first "$name/first" idempotent "$round"
            run_replay "$name/replay" idempotent
            stop_server
        done
    done
    echo
    echo "wrk: $THREADS threads, $CONNECTIONS connections, ${DURATION} s x $ROUNDS rounds; builds: $COMPARE"
    echo
    awk -v builds="${COMPARE}" '
function median(values, n,    i, j, t) {
    for (i = 2; i <= n; i++)
        for (j = i; j > 1 && values[j - 1] > values[j]; j--) {
            t = values[j]; values[j] = values[j - 1]; values[j - 1] = t
        }
    return n % 2 ? values[(n + 1) / 2] : (values[n / 2] + values[n / 2 + 1]) / 2
}
{
    for (i = 2; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = kv[2] }
    k = ++n[$1]
    rate[$1, k] = f["requests"] / (f["duration_us"] / 1e6)
    cpu[$1, k] = f["server_cpu_us"] / f["requests"]
}
END {
    printf "%-10s %-11s %10s %13s %18s %18s\n", "build", "workload", "req/s", "server CPU", "over correlated", "vs first build"
    count = split(builds, list, " ")
    for (b = 1; b <= count; b++) {
        name = list[b]; sub(/=.*/, "", name)
        split("correlated first replay", workloads, " ")
        for (w = 1; w <= 3; w++) {
            row = name "/" workloads[w]; m = n[row]
            for (i = 1; i <= m; i++) {
                a[i] = rate[row, i]; c[i] = cpu[row, i]
                d[i] = cpu[row, i] - cpu[name "/correlated", i]
            }
            per = median(c, m); over = median(d, m)
            if (b == 1) base_over[w] = over
            printf "%-10s %-11s %10.0f %7.1f us/req %+15.1f us %+15.1f us\n", name, workloads[w], median(a, m), per, \
                w == 1 ? 0 : over, w == 1 ? 0 : over - base_over[w]
        }
    }
}' "$work/results"
    exit "$failed"
fi

start_server "$binary"
echo "warming up..." >&2
warm_up bare noop tower-http correlated
: >"$work/results"

for round in $(seq "$ROUNDS"); do
    echo "round $round of $ROUNDS" >&2
    run bare "${steady[@]}" -s "$work/common.lua" "$base/load/bare"
    check bare "$(tail -n1 "$work/results")"
    run noop "${steady[@]}" -s "$work/common.lua" "$base/load/noop"
    check noop "$(tail -n1 "$work/results")"
    run tower_http "${steady[@]}" -s "$work/common.lua" "$base/load/tower-http"
    check tower_http "$(tail -n1 "$work/results")"
    run correlated "${steady[@]}" -s "$work/common.lua" "$base/load/correlated"
    check correlated "$(tail -n1 "$work/results")"

    run_first first idempotent "$round"
    run_replay replay idempotent

    run logged_get "${steady[@]}" -s "$work/get.lua" "$base/load/logged"
    check logged_get "$(tail -n1 "$work/results")"
    run_first logged_first logged "$round"
    run_replay logged_replay logged
done

echo "burst: $BURST_CONNECTIONS connections, one new key, handler sleeping ${BURST_SLEEP_MS} ms" >&2
before=$(executions)
LOAD_KEY="burst-$nonce" run burst -c "$BURST_CONNECTIONS" -d 3s -s "$work/common.lua" \
    "$base/load/idempotent?sleep_ms=$BURST_SLEEP_MS"
burst_line=$(tail -n1 "$work/results")
check burst "$burst_line" 409s-expected
burst_ran=$(($(executions) - before))
if [ "$burst_ran" != 1 ]; then
    echo "FAIL burst: the handler ran $burst_ran times for one key" >&2
    failed=1
fi

cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo 2>/dev/null | head -n1)
echo
echo "machine: $(nproc) cores${cpu:+, $cpu}, $(uname -sr); $(wrk -v 2>&1 | head -n1 | cut -d' ' -f1-2)"
[ "$PROFILE" = release ] || echo "build: the $PROFILE profile, not release: the figures below only show that every workload answered; they are not for reading"
echo "wrk: $THREADS threads, $CONNECTIONS connections, ${DURATION} s x $ROUNDS rounds;" \
    "server: RUST_LOG=$SERVER_LOG, log to a file"
echo
# The replay's throughput goal, as a share of the correlated route's: 0.90, or 0.85 when
# the server logs each idempotent request at INFO.
share_goal=0.90
[ "$SERVER_LOG" = warn ] || share_goal=0.85
awk -v rounds="$ROUNDS" -v burst_ran="$burst_ran" -v share_goal="$share_goal" '
function median(values, n,    i, j, t) {
    for (i = 2; i <= n; i++)
        for (j = i; j > 1 && values[j - 1] > values[j]; j--) {
            t = values[j]; values[j] = values[j - 1]; values[j - 1] = t
        }
    return n % 2 ? values[(n + 1) / 2] : (values[n / 2] + values[n / 2 + 1]) / 2
}
{
    name = $1
    for (i = 2; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = kv[2] }
    rps = f["requests"] / (f["duration_us"] / 1e6)
    if (name == "bare") round++
    n[name]++
    rate[name, n[name]] = rps
    if (name == "bare") bare_rate[round] = rps
    else ratio[name, n[name]] = rps / bare_rate[round]
    if (name == "noop") noop_rate[round] = rps
    else if (name != "bare") to_noop[name, n[name]] = rps / noop_rate[round]
    p50[name, n[name]] = f["p50_us"]; p99[name, n[name]] = f["p99_us"]
    cpu[name, n[name]] = f["server_cpu_us"] / f["requests"]
    requests[name] = f["requests"]; non2xx[name] = f["non2xx"]
}
END {
    printf "%-13s %10s %8s %8s %9s %9s %13s  %s\n", "workload", "req/s", "vs bare", "vs noop", "p50", "p99", "server CPU", "notes"
    split("bare noop tower_http correlated first replay logged_get logged_first logged_replay burst", order, " ")
    for (k = 1; k <= 10; k++) {
        name = order[k]
        m = n[name]
        for (i = 1; i <= m; i++) {
            a[i] = rate[name, i]; b[i] = p50[name, i]; c[i] = p99[name, i]; d[i] = ratio[name, i]; e[i] = cpu[name, i]
            g[i] = to_noop[name, i]
        }
        r = median(a, m); l50 = median(b, m); l99 = median(c, m); per = median(e, m)
        vs = name == "bare" ? "1.000" : (name == "burst" ? "-" : sprintf("%.3f", median(d, m)))
        vs_noop = name == "bare" || name == "burst" ? "-" : (name == "noop" ? "1.000" : sprintf("%.3f", median(g, m)))
        note = ""
        cpu_of[name] = per
        if (name == "correlated") note = sprintf("CPU %+.1f us over tower_http", per - cpu_of["tower_http"])
        if (name == "first" || name == "replay") {
            for (i = 1; i <= m; i++) h[i] = rate[name, i] / rate["correlated", i]
            share = median(h, m)
            over = per - cpu_of["correlated"]
            cpu_goal = name == "first" ? 6 : 2
            note = sprintf("CPU %+.1f us over correlated (goal <= %d: %s)", over, cpu_goal, over <= cpu_goal ? "met" : "MISSED")
            if (name == "replay")
                note = note sprintf("; %.3f of correlated req/s (goal >= %.2f: %s)", share, share_goal, share >= share_goal ? "met" : "MISSED")
        }
        if (name == "logged_first" || name == "logged_replay") {
            for (i = 1; i <= m; i++) h[i] = rate[name, i] / rate["logged_get", i]
            share = median(h, m)
            logged_goal = name == "logged_first" ? 0.80 : 0.90
            note = sprintf("%.3f of logged_get req/s (goal with SERVER_LOG=info >= %.2f: %s); CPU %+.1f us over logged_get", share, logged_goal, share >= logged_goal ? "met" : "MISSED", per - cpu_of["logged_get"])
        }
        if (name == "burst") note = sprintf("%d answers, %d of them 409; handler ran %d time(s)", requests[name], non2xx[name], burst_ran)
        printf "%-13s %10.0f %8s %8s %6.2f ms %6.2f ms %7.1f us/req  %s\n", name, r, vs, vs_noop, l50 / 1000, l99 / 1000, per, note
    }
}' "$work/results"

if [ "$failed" != 0 ]; then
    echo "some runs did not answer as expected (see FAIL above)" >&2
fi
exit "$failed"
