//! The `partner` example as a partner runs it: the planner and the executor as child
//! processes on free loopback ports, in memory or on a PostgreSQL database of their
//! own, killed and restarted; every row of the contract's table through the servers,
//! counted by what they stored.
//!
//! The Kafka path runs against a real broker (Tansu, `TANSU_BIN`) the test starts.
//!
//! The tests build the example binary first (`tests/support/demo.rs`), so `cargo test
//! --test partner` runs alone.

#[path = "postgres/database.rs"]
mod database;
#[path = "support/demo.rs"]
mod demo;
#[path = "support/kafka.rs"]
mod kafka;
#[path = "support/mod.rs"]
mod support;

use std::time::Duration;

use base64::{engine::general_purpose::URL_SAFE_NO_PAD, Engine as _};
use database::TestDatabase;
use demo::Demo;
use http::StatusCode;
use serde_json::{json, Value};
use support::{client, send, try_send, HttpClient, Reply};

const ACME: &str = "Bearer acme-token";
const GLOBEX: &str = "Bearer globex-token";

/// Starts the planner (off the runtime's threads: it waits for the log line).
async fn planner(args: &[&str]) -> Demo {
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Demo::example("partner", &args, &[])
    })
    .await
    .unwrap()
}

/// Starts an executor with `args` after the `executor` subcommand.
async fn executor(args: &[&str]) -> Demo {
    let mut all = vec!["executor".to_owned()];
    all.extend(args.iter().map(|a| (*a).to_owned()));
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = all.iter().map(String::as_str).collect();
        Demo::example("partner", &args, &[])
    })
    .await
    .unwrap()
}

async fn post(http: &HttpClient, url: &str, auth: &str, body: &Value) -> Reply {
    let headers = [
        ("content-type", "application/json"),
        ("authorization", auth),
    ];
    send(http, "POST", url.to_owned(), &headers, &body.to_string()).await
}

async fn get(http: &HttpClient, url: &str, auth: &str) -> Reply {
    send(http, "GET", url.to_owned(), &[("authorization", auth)], "").await
}

fn movement(partner: &str, correlation_id: &str, warehouse: &str) -> Value {
    json!({
        "partner_id": partner,
        "correlation_id": correlation_id,
        "warehouse_frn": warehouse,
        "sku": "SKU-1",
        "qty": 4,
    })
}

/// Books a realtime movement on `planner`, which must answer `201`.
async fn book(http: &HttpClient, planner: &Demo, auth: &str, call: &Value) {
    let booked = post(
        http,
        &format!("{}/wes/v1/realtime", planner.url),
        auth,
        call,
    )
    .await;
    assert_eq!(booked.status, StatusCode::CREATED, "{}", booked.text());
}

async fn counts(http: &HttpClient, planner: &Demo, auth: &str) -> Value {
    let reply = get(http, &format!("{}/wes/v1/counts", planner.url), auth).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    reply.json()
}

/// Sends `body` until the answer is not `409` (a duplicate in flight), waiting the
/// `Retry-After` it gives.
async fn until_settled(http: &HttpClient, url: &str, auth: &str, body: &Value) -> Reply {
    loop {
        let reply = post(http, url, auth, body).await;
        if reply.status != StatusCode::CONFLICT {
            return reply;
        }
        assert_eq!(reply.json()["code"], "idempotency.in_flight");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_realtime_call_sent_20_times_at_once_books_one_movement() {
    let database = TestDatabase::create().await;
    let mut modes = vec![vec![]];
    if let Some(database) = &database {
        modes.push(vec!["--database-url", database.url()]);
    }
    for args in modes {
        let planner = planner(&args).await;
        let http = client();
        let url = format!("{}/wes/v1/realtime", planner.url);
        let call = movement("acme", "0190f5d8-1111-7000-8000-000000000020", "frn:wh:1");
        let calls: Vec<_> = (0..20)
            .map(|_| {
                let (http, url, call) = (http.clone(), url.clone(), call.clone());
                tokio::spawn(async move { until_settled(&http, &url, ACME, &call).await })
            })
            .collect();
        let mut replies = Vec::new();
        for call in calls {
            replies.push(call.await.unwrap());
        }
        let first: Vec<_> = replies
            .iter()
            .filter(|r| r.status == StatusCode::CREATED)
            .collect();
        assert_eq!(first.len(), 1, "{args:?}: one call booked the movement");
        let booked = first[0].json();
        assert_eq!(booked["replay"], false);
        for reply in replies.iter().filter(|r| r.status != StatusCode::CREATED) {
            assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
            assert_eq!(reply.json()["replay"], true);
            assert_eq!(reply.json()["movement_id"], booked["movement_id"]);
            assert_eq!(reply.header("idempotent-replayed"), Some("true"));
        }
        let counts = counts(&http, &planner, ACME).await;
        assert_eq!(counts["movements"], 1, "{args:?}: no second movement");

        // Another partner's identical call is its own.
        let globex = movement("globex", "0190f5d8-1111-7000-8000-000000000020", "frn:wh:1");
        let reply = post(&http, &url, GLOBEX, &globex).await;
        assert_eq!(reply.status, StatusCode::CREATED);
        // A partner may not speak for another.
        let forged = post(&http, &url, GLOBEX, &call).await;
        assert_eq!(forged.status, StatusCode::FORBIDDEN);
        assert_eq!(forged.json()["code"], "partner.partner_mismatch");
    }
}

#[tokio::test]
async fn bad_bodies_get_problems_and_change_nothing() {
    let planner = planner(&[]).await;
    let http = client();
    let url = format!("{}/wes/v1/realtime", planner.url);
    let headers = [
        ("content-type", "application/json"),
        ("authorization", ACME),
    ];
    for (body, status, code) in [
        ("not json", 400, "idempotency.body_not_json"),
        (r#"{"partner_id":"acme"}"#, 400, "idempotency.key_missing"),
        (
            r#"{"partner_id":"acme","correlation_id":"c-bad-1","qty":"four"}"#,
            400,
            "partner.body_invalid",
        ),
    ] {
        let reply = send(&http, "POST", url.clone(), &headers, body).await;
        assert_eq!(reply.status.as_u16(), status, "{body}: {}", reply.text());
        assert_eq!(
            reply.header("content-type"),
            Some("application/problem+json")
        );
        assert_eq!(reply.json()["code"], code);
    }
    let unauthenticated = send(
        &http,
        "POST",
        url,
        &[("content-type", "application/json")],
        &movement("acme", "c-1", "frn:wh:1").to_string(),
    )
    .await;
    assert_eq!(unauthenticated.status, StatusCode::UNAUTHORIZED);
    assert_eq!(counts(&http, &planner, ACME).await["movements"], 0);
}

/// Sends `refused` twice: the same refusal both times (a handler's refusal is not
/// stored, so the retry runs again and is refused again). Then `corrected`, under the
/// same `correlation_id`, twice: `201`, then its replay. Returns the `201`'s body.
async fn refused_then_corrected(
    http: &HttpClient,
    url: &str,
    auth: &str,
    refused: &Value,
    (status, code): (StatusCode, &str),
    corrected: &Value,
) -> Value {
    for attempt in 1..=2 {
        let reply = post(http, url, auth, refused).await;
        assert_eq!(
            reply.status,
            status,
            "{url}, attempt {attempt}: {}",
            reply.text()
        );
        assert_eq!(reply.json()["code"], code);
        assert_eq!(reply.header("idempotent-replayed"), Some("false"));
    }
    let first = post(http, url, auth, corrected).await;
    assert_eq!(first.status, StatusCode::CREATED, "{url}: {}", first.text());
    assert_eq!(first.json()["replay"], false);
    let replay = post(http, url, auth, corrected).await;
    assert_eq!(replay.status, StatusCode::OK, "{url}: {}", replay.text());
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    let mut replayed = replay.json();
    assert_eq!(replayed["replay"], true);
    replayed["replay"] = json!(false);
    assert_eq!(
        replayed,
        first.json(),
        "{url}: the replay is the first answer"
    );
    first.json()
}

#[tokio::test]
async fn a_refused_call_stays_refused_and_the_corrected_one_runs_once() {
    let database = TestDatabase::create().await;
    let mut modes = vec![vec![]];
    if let Some(database) = &database {
        modes.push(vec!["--database-url", database.url()]);
    }
    for args in modes {
        let planner = planner(&args).await;
        let executor = executor(&args).await;
        let http = client();

        let realtime = format!("{}/wes/v1/realtime", planner.url);
        let call = movement("acme", "c-refused-1", "frn:wh:1");
        let mut malformed = call.clone();
        malformed["qty"] = json!("four");
        let bad_request = (StatusCode::BAD_REQUEST, "partner.body_invalid");
        refused_then_corrected(&http, &realtime, ACME, &malformed, bad_request, &call).await;
        // Acme's token with a body that speaks for globex, then acme's own call.
        let call = movement("acme", "c-refused-2", "frn:wh:1");
        let forged = movement("globex", "c-refused-2", "frn:wh:1");
        let forbidden = (StatusCode::FORBIDDEN, "partner.partner_mismatch");
        refused_then_corrected(&http, &realtime, ACME, &forged, forbidden, &call).await;
        assert_eq!(
            counts(&http, &planner, ACME).await["movements"],
            2,
            "{args:?}: one movement per corrected call, none per refusal"
        );
        assert_eq!(counts(&http, &planner, GLOBEX).await["movements"], 0);
        let feed = get(
            &http,
            &format!("{}/wes/v1/dispatch/pending", planner.url),
            ACME,
        )
        .await;
        assert_eq!(feed.json()["events"].as_array().unwrap().len(), 2);

        let confirmations = format!("{}/wes/v1/confirmations", planner.url);
        let confirmation = |correlation_id: &str, window: &str| {
            json!({
                "partner_id": "acme",
                "correlation_id": correlation_id,
                "window_key": window,
                "warehouse_frn": "frn:wh:1",
            })
        };
        let corrected = confirmation("c-refused-3", "frn:wh:1/10:00");
        let mut incomplete = corrected.clone();
        incomplete.as_object_mut().unwrap().remove("window_key");
        let field_invalid = (StatusCode::BAD_REQUEST, "partner.field_invalid");
        refused_then_corrected(
            &http,
            &confirmations,
            ACME,
            &incomplete,
            field_invalid,
            &corrected,
        )
        .await;
        let corrected = confirmation("c-refused-4", "frn:wh:1/11:00");
        let mut forged = corrected.clone();
        forged["partner_id"] = json!("globex");
        refused_then_corrected(&http, &confirmations, ACME, &forged, forbidden, &corrected).await;
        assert_eq!(
            counts(&http, &planner, ACME).await["confirmations"],
            2,
            "{args:?}: one confirmation per corrected call"
        );

        let webhooks = format!("{}/wes/v1/webhooks/dispatch", executor.url);
        let webhook = json!({
            "planner_id": "planner-1",
            "correlation_id": "c-refused-5",
            "warehouse_frn": "frn:wh:1",
            "movement_id": "mv-1",
        });
        let mut incomplete = webhook.clone();
        incomplete.as_object_mut().unwrap().remove("warehouse_frn");
        let auth = "Bearer planner-token";
        let stored =
            refused_then_corrected(&http, &webhooks, auth, &incomplete, field_invalid, &webhook)
                .await;
        assert_eq!(stored["stored"], true);
        let events = get(&http, &format!("{}/wes/v1/events", executor.url), auth).await;
        assert_eq!(
            events.json()["events"].as_array().unwrap().len(),
            1,
            "{args:?}: the corrected webhook stored once"
        );
    }
}

#[tokio::test]
async fn a_confirmation_repeated_after_a_restart_replays_and_a_window_is_confirmed_once() {
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    let args = ["--database-url", database.url()];
    let mut first_planner = planner(&args).await;
    let http = client();
    let confirmation = |correlation_id: &str| {
        json!({
            "partner_id": "acme",
            "correlation_id": correlation_id,
            "window_key": "frn:wh:1/2026-11-25T10",
            "warehouse_frn": "frn:wh:1",
        })
    };
    let url = |planner: &Demo| format!("{}/wes/v1/confirmations", planner.url);
    let first = post(&http, &url(&first_planner), ACME, &confirmation("conf-1")).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());
    assert_eq!(first.json()["replay"], false);

    // The planner crashes and comes back on the same database.
    tokio::task::spawn_blocking(move || first_planner.kill())
        .await
        .unwrap();
    let planner = planner(&args).await;
    let replay = post(&http, &url(&planner), ACME, &confirmation("conf-1")).await;
    assert_eq!(replay.status, StatusCode::OK);
    assert_eq!(replay.json()["replay"], true);
    assert_eq!(
        replay.json()["confirmation_id"],
        first.json()["confirmation_id"]
    );

    // Another confirmation for the same window: deduplicated by the window.
    let second = post(&http, &url(&planner), ACME, &confirmation("conf-2")).await;
    assert_eq!(second.status, StatusCode::OK);
    assert_eq!(second.json()["window_confirmed_before"], true);
    assert_eq!(
        second.json()["confirmation_id"],
        first.json()["confirmation_id"]
    );

    let pool = database.pool(1).await;
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM partner_confirmations")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 1, "one confirmation row");
}

/// The advisory lock the planner takes to append to its feed (`examples/partner/db.rs`).
const DISPATCH_LOCK: i64 = 0x0070_6172_746e_6572;

/// A realtime call in flight when the planner is killed keeps its key claimed until the
/// claim runs out: the lease (10 s) and half again after its last renewal (every
/// quarter lease), so 12.5 to 15 s after the crash. Until then the retry is `409`; then
/// it books the movement, once. The window is printed (`-- --nocapture`).
#[tokio::test]
async fn a_call_in_flight_when_the_planner_crashes_is_409_until_its_claim_runs_out() {
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    let args = ["--database-url", database.url()];
    let mut crashing = planner(&args).await;
    let pool = database.pool(2).await;
    // Holding the feed's lock keeps the call in its handler, its movement written.
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(DISPATCH_LOCK)
        .execute(&mut *holder)
        .await
        .unwrap();
    let http = client();
    let call = movement("acme", "c-in-flight-crash", "frn:wh:1");
    let url = format!("{}/wes/v1/realtime", crashing.url);
    let in_flight = tokio::spawn({
        let (http, url, body) = (http.clone(), url.clone(), call.to_string());
        let headers = [
            ("content-type", "application/json"),
            ("authorization", ACME),
        ];
        async move { try_send(&http, "POST", url, &headers, &body).await }
    });
    // In the handler once the planner waits for the lock; a duplicate is then `409`.
    let waiting = "SELECT count(*) FROM pg_stat_activity \
                   WHERE datname = current_database() AND wait_event = 'advisory'";
    while sqlx::query_scalar::<_, i64>(waiting)
        .fetch_one(&pool)
        .await
        .unwrap()
        == 0
    {
        assert!(!in_flight.is_finished(), "the call waits for the lock");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let duplicate = post(&http, &url, ACME, &call).await;
    assert_eq!(
        duplicate.status,
        StatusCode::CONFLICT,
        "{}",
        duplicate.text()
    );
    tokio::task::spawn_blocking(move || crashing.kill())
        .await
        .unwrap();
    let crashed = std::time::Instant::now();
    holder.rollback().await.unwrap();
    assert!(
        in_flight.await.unwrap().is_err(),
        "the call in flight got no answer"
    );

    let planner = planner(&args).await;
    let url = format!("{}/wes/v1/realtime", planner.url);
    let mut conflicts = 0;
    let booked = loop {
        let reply = post(&http, &url, ACME, &call).await;
        if reply.status != StatusCode::CONFLICT {
            break reply;
        }
        assert_eq!(reply.json()["code"], "idempotency.in_flight");
        assert!(reply.header("retry-after").is_some());
        conflicts += 1;
        assert!(
            crashed.elapsed() < Duration::from_secs(20),
            "still 409 after 20 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let window = crashed.elapsed();
    println!("a call in flight at the crash: 409 for {window:?} after it ({conflicts} retries)");
    assert_eq!(booked.status, StatusCode::CREATED, "{}", booked.text());
    assert!(
        window >= Duration::from_secs(12) && window <= Duration::from_secs(16),
        "409 for {window:?}: the lease and half again after the last renewal"
    );
    let replay = post(&http, &url, ACME, &call).await;
    assert_eq!(replay.status, StatusCode::OK);
    assert_eq!(replay.json()["movement_id"], booked.json()["movement_id"]);
    let movements: i64 = sqlx::query_scalar("SELECT count(*) FROM partner_movements")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(movements, 1, "the crashed call's movement rolled back");
}

/// `--database-url` to a closed port: either role exits at once, non-zero, naming the
/// host and port (not after sqlx's 30 s acquire timeout with a bare `PoolTimedOut`).
#[tokio::test]
async fn an_unreachable_database_fails_the_start_within_seconds_naming_it() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("postgres://postgres:secret@127.0.0.1:{port}/partner");
    for role in [&[][..], &["executor"][..]] {
        let mut args = vec!["--addr", "127.0.0.1:0"];
        args.extend(role);
        args.extend(["--database-url", &url]);
        let (status, took, stderr) = tokio::task::spawn_blocking({
            let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
            move || {
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                demo::run_to_exit("partner", &args, Duration::from_secs(10))
            }
        })
        .await
        .unwrap();
        println!("{role:?}: exited {status} after {took:?}: {stderr}");
        assert!(!status.success(), "{role:?}");
        assert!(took < Duration::from_secs(5), "{role:?}: {took:?}");
        assert!(
            stderr.contains(&format!("127.0.0.1:{port}")),
            "{role:?}: {stderr}"
        );
        assert!(
            !stderr.contains("secret"),
            "the password stays out: {stderr}"
        );
    }
}

#[tokio::test]
async fn a_webhook_is_replayed_within_its_window_and_runs_again_after_it() {
    let executor = executor(&["--webhook-retention-secs", "1"]).await;
    let http = client();
    let url = format!("{}/wes/v1/webhooks/dispatch", executor.url);
    let webhook = json!({
        "planner_id": "planner-1",
        "correlation_id": "0190f5d8-2222-7000-8000-000000000001",
        "warehouse_frn": "frn:wh:1",
        "movement_id": "mv-1",
    });
    let auth = "Bearer planner-token";
    let first = post(&http, &url, auth, &webhook).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());
    assert_eq!(first.json(), json!({"stored": true, "replay": false}));
    let replay = post(&http, &url, auth, &webhook).await;
    assert_eq!(replay.status, StatusCode::OK);
    assert_eq!(replay.json(), json!({"stored": true, "replay": true}));

    // Past the window the key is forgotten: the handler runs again, and the executor's
    // own table recognises the event.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let late = post(&http, &url, auth, &webhook).await;
    assert_eq!(late.status, StatusCode::CREATED);
    assert_eq!(late.json(), json!({"stored": false, "replay": false}));
    assert_eq!(late.header("idempotent-replayed"), Some("false"));

    let events = get(&http, &format!("{}/wes/v1/events", executor.url), auth).await;
    assert_eq!(events.json()["events"].as_array().unwrap().len(), 1);
    let unauthenticated = post(&http, &url, "Bearer wrong", &webhook).await;
    assert_eq!(unauthenticated.status, StatusCode::UNAUTHORIZED);
}

fn cursor(owner: &str, seq: i64) -> String {
    URL_SAFE_NO_PAD.encode(format!("v1:{owner}:{seq}"))
}

#[tokio::test]
async fn acks_out_of_order_never_move_the_cursor_back() {
    acks_and_pages(&[]).await;
    if let Some(database) = TestDatabase::create().await {
        acks_and_pages(&["--database-url", database.url()]).await;
    }
}

async fn acks_and_pages(args: &[&str]) {
    let planner = planner(args).await;
    let http = client();
    for n in 1..=3 {
        let call = movement("acme", &format!("c-ack-{n}"), "frn:wh:1");
        book(&http, &planner, ACME, &call).await;
    }
    let page = get(
        &http,
        &format!("{}/wes/v1/dispatch/pending?limit=10", planner.url),
        ACME,
    )
    .await;
    let cursors: Vec<String> = page.json()["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|event| event["cursor"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(cursors.len(), 3);
    assert_eq!(page.json()["next_cursor"], cursors[2].as_str());

    let ack_url = format!("{}/wes/v1/dispatch/ack", planner.url);
    let ack = |cursor: String| {
        let (http, url) = (http.clone(), ack_url.clone());
        async move { post(&http, &url, ACME, &json!({ "cursor": cursor })).await }
    };
    let second = ack(cursors[1].clone()).await;
    assert_eq!(
        second.json(),
        json!({"advanced": true, "cursor": cursors[1]})
    );
    for earlier_or_equal in [&cursors[0], &cursors[1]] {
        let noop = ack(earlier_or_equal.clone()).await;
        assert_eq!(noop.status, StatusCode::OK);
        assert_eq!(
            noop.json(),
            json!({"advanced": false, "cursor": cursors[1]})
        );
    }
    assert_eq!(
        counts(&http, &planner, ACME).await["acked"],
        cursors[1].as_str()
    );
    let third = ack(cursors[2].clone()).await;
    assert_eq!(third.json()["advanced"], true);

    // The next page starts after the acked cursor.
    let next = get(
        &http,
        &format!(
            "{}/wes/v1/dispatch/pending?since={}",
            planner.url, cursors[1]
        ),
        ACME,
    )
    .await;
    assert_eq!(next.json()["events"].as_array().unwrap().len(), 1);

    // A cursor the feed never gave is refused alike by the ack and by the feed.
    for (cursor, status, code) in [
        (cursor("acme", 4), 422, "dispatch.cursor_ahead"),
        (cursor("acme", 99), 422, "dispatch.cursor_ahead"),
        (cursor("globex", 1), 403, "dispatch.cursor_foreign"),
        (cursor("acme", 0), 400, "dispatch.cursor_invalid"),
        ("not-a-cursor".to_owned(), 400, "dispatch.cursor_invalid"),
    ] {
        let refused = ack(cursor.clone()).await;
        assert_eq!(
            refused.status.as_u16(),
            status,
            "{args:?}: {}",
            refused.text()
        );
        assert_eq!(refused.json()["code"], code);
        let page = get(
            &http,
            &format!("{}/wes/v1/dispatch/pending?since={cursor}", planner.url),
            ACME,
        )
        .await;
        assert_eq!(page.status.as_u16(), status, "{args:?}: {}", page.text());
        assert_eq!(page.json()["code"], code);
    }
    assert_eq!(
        counts(&http, &planner, ACME).await["acked"],
        cursors[2].as_str()
    );
    // The last cursor is the end of the feed, not past it: an empty page.
    let end = get(
        &http,
        &format!(
            "{}/wes/v1/dispatch/pending?since={}",
            planner.url, cursors[2]
        ),
        ACME,
    )
    .await;
    assert_eq!(end.status, StatusCode::OK, "{}", end.text());
    assert_eq!(end.json(), json!({"events": [], "next_cursor": cursors[2]}));
}

#[tokio::test]
async fn a_crash_between_storing_a_page_and_acking_it_redelivers_the_page_once() {
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    let planner = planner(&[]).await;
    let http = client();
    for n in 1..=3 {
        let call = movement("acme", &format!("c-crash-{n}"), &format!("frn:wh:{n}"));
        book(&http, &planner, ACME, &call).await;
    }
    let planner_url = planner.url.clone();
    let args = [
        "--database-url",
        database.url(),
        "--planner-url",
        &planner_url,
        "--poll-interval-ms",
        "50",
    ];
    let mut crashing = executor(&[&args[..], &["--exit-after-storing-page"]].concat()).await;
    let status = crashing
        .exited_within(Duration::from_secs(20))
        .await
        .expect("the executor exits after storing its first page");
    assert_eq!(status.code(), Some(3));
    let pool = database.pool(1).await;
    let stored = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM executor_events")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    assert_eq!(stored().await, 3, "the page was stored");
    assert_eq!(
        counts(&http, &planner, ACME).await["acked"],
        "",
        "and not acked"
    );

    // Restarted, it gets the same page again, stores nothing new, and acks it.
    let executor = executor(&args).await;
    let acked = executor.events("partner.page_acked").await;
    assert_eq!(acked.len(), 1);
    let stored_lines = executor.logged("partner.page_stored");
    assert_eq!(stored_lines[0]["fields"]["new"], 0, "every event was known");
    assert_eq!(stored().await, 3, "no event stored twice");
    let page = get(
        &http,
        &format!("{}/wes/v1/dispatch/pending", planner.url),
        ACME,
    )
    .await;
    assert_eq!(
        counts(&http, &planner, ACME).await["acked"],
        page.json()["next_cursor"]
    );
}

/// The executor's events, once it has `count` of them (waiting up to 40 s: a Kafka
/// consumer group takes seconds to form).
async fn events_once(http: &HttpClient, executor: &Demo, count: usize) -> Vec<Value> {
    for _ in 0..400 {
        let reply = get(http, &format!("{}/wes/v1/events", executor.url), "").await;
        let events = reply.json()["events"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if events.len() >= count {
            return events;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the executor did not receive {count} events");
}

#[tokio::test]
async fn dispatch_on_kafka_keeps_each_warehouses_order_and_a_duplicate_record_changes_nothing() {
    let Some(broker) = tokio::task::spawn_blocking(kafka::Broker::start)
        .await
        .unwrap()
    else {
        return;
    };
    let topic = format!("dispatch-{}", uuid::Uuid::now_v7());
    let kafka = [
        "--kafka-brokers",
        broker.addr.as_str(),
        "--kafka-topic",
        &topic,
    ];
    let planner = planner(&kafka).await;
    let http = client();
    for n in 1..=6 {
        let call = movement(
            "acme",
            &format!("c-kafka-{n}"),
            &format!("frn:wh:{}", n % 3),
        );
        book(&http, &planner, ACME, &call).await;
    }
    // Another partner's event on the same topic is not acme's executor's.
    let globex = movement("globex", "c-kafka-globex", "frn:wh:1");
    book(&http, &planner, GLOBEX, &globex).await;
    let group = format!("executor-{}", uuid::Uuid::now_v7());
    let executor = executor(&[&kafka[..], &["--kafka-group", &group]].concat()).await;

    let received = events_once(&http, &executor, 6).await;
    assert!(received.iter().all(|event| event["source"] == "kafka"));
    assert!(received
        .iter()
        .all(|event| event["body"]["executor_id"] == "acme"));
    // Each warehouse's events arrive in the planner's order (its feed order).
    let feed = get(
        &http,
        &format!("{}/wes/v1/dispatch/pending", planner.url),
        ACME,
    )
    .await;
    let feed = feed.json()["events"].as_array().unwrap().clone();
    for warehouse in ["frn:wh:0", "frn:wh:1", "frn:wh:2"] {
        let order = |events: &[Value]| -> Vec<String> {
            events
                .iter()
                .filter(|event| event["warehouse_frn"] == warehouse)
                .map(|event| event["correlation_id"].as_str().unwrap().to_owned())
                .collect()
        };
        assert_eq!(order(&received), order(&feed), "{warehouse}");
        assert_eq!(order(&feed).len(), 2);
    }

    // Each first handling's line names its key and its delivery's correlation ID.
    let handled = executor.logged("partner.kafka_handled");
    for line in &handled {
        assert_eq!(line["span"]["idempotency_outcome"], "executed", "{line}");
        assert!(line["span"]["idempotency_key"].is_string(), "{line}");
        assert!(line["fields"]["correlation_id"].is_string(), "{line}");
    }

    // A publisher that re-emits from a stale position sends a record again: the
    // executor's idempotency layer replays it, nothing is stored twice, and the replay
    // has its line too, with the key and this delivery's correlation ID.
    let producer: rdkafka::producer::FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &broker.addr)
        .create()
        .unwrap();
    let produce = |key: &str, warehouse: &str, payload: &Value| {
        let mut headers = rdkafka::message::OwnedHeaders::new();
        tower_ids::idempotency::IdempotencyKey::new(key)
            .unwrap()
            .inject(&mut headers);
        let (producer, topic, warehouse, payload) = (
            producer.clone(),
            topic.clone(),
            warehouse.to_owned(),
            payload.to_string(),
        );
        async move {
            let record = rdkafka::producer::FutureRecord::to(&topic)
                .key(&warehouse)
                .payload(&payload)
                .headers(headers);
            producer
                .send(record, Duration::from_secs(10))
                .await
                .map_err(|(error, _)| error)
                .unwrap();
        }
    };
    let again = &feed[0];
    let payload = json!({
        "executor_id": "acme",
        "planner_id": again["planner_id"],
        "correlation_id": again["correlation_id"],
        "warehouse_frn": again["warehouse_frn"],
        "movement_id": again["movement_id"],
    });
    let key = again["correlation_id"].as_str().unwrap();
    produce(key, again["warehouse_frn"].as_str().unwrap(), &payload).await;
    let duplicate = executor.events("partner.kafka_duplicate").await;
    assert_eq!(duplicate.len(), 1);
    assert_eq!(duplicate[0]["fields"]["idempotency_key"], key);
    assert_eq!(duplicate[0]["fields"]["idempotency_outcome"], "replayed");
    assert_eq!(duplicate[0]["fields"]["idempotency_request_count"], 2);
    assert!(duplicate[0]["span"]["correlation_id"].is_string());
    assert_eq!(handled.len(), 6, "handled once each");
    assert_eq!(executor.logged("partner.kafka_handled").len(), 6);
    assert_eq!(events_once(&http, &executor, 6).await.len(), 6);

    // A record refused for its payload is not stored: the corrected record under the
    // same key is handled (one partition: same record key, so in this order).
    let corrected = json!({
        "executor_id": "acme",
        "planner_id": "planner-1",
        "correlation_id": "c-kafka-corrected",
        "warehouse_frn": "frn:wh:9",
        "movement_id": "mv-9",
    });
    let mut malformed = corrected.clone();
    malformed.as_object_mut().unwrap().remove("warehouse_frn");
    produce("c-kafka-corrected", "frn:wh:9", &malformed).await;
    produce("c-kafka-corrected", "frn:wh:9", &corrected).await;
    let received = events_once(&http, &executor, 7).await;
    assert_eq!(received[6]["correlation_id"], "c-kafka-corrected");
    let handled = executor.logged("partner.kafka_handled");
    assert_eq!(
        handled.len(),
        8,
        "the refused record, then the corrected one"
    );
    assert_eq!(handled[6]["fields"]["stored"], "None");
    assert!(executor.logged("partner.kafka_refused").is_empty());
}

/// A stand-in for an executor's webhook: records each attempt's `correlation_id` per
/// warehouse, and answers `503` to the first `failures` attempts for `failing`.
#[derive(Clone, Default)]
struct WebhookStandIn {
    seen: std::sync::Arc<std::sync::Mutex<Vec<(String, String)>>>,
}

async fn stand_in(failing: &'static str, failures: usize) -> (String, WebhookStandIn) {
    use axum::{extract::State, routing::post, Json, Router};
    let recorded = WebhookStandIn::default();
    let app = Router::new()
        .route(
            "/wes/v1/webhooks/dispatch",
            post(
                move |State(recorded): State<WebhookStandIn>, Json(body): Json<Value>| async move {
                    let warehouse = body["warehouse_frn"].as_str().unwrap().to_owned();
                    let mut seen = recorded.seen.lock().unwrap();
                    let before = seen.iter().filter(|(w, _)| *w == warehouse).count();
                    seen.push((
                        warehouse.clone(),
                        body["correlation_id"].as_str().unwrap().to_owned(),
                    ));
                    if warehouse == failing && before < failures {
                        StatusCode::SERVICE_UNAVAILABLE
                    } else {
                        StatusCode::CREATED
                    }
                },
            ),
        )
        .with_state(recorded.clone());
    (format!("http://{}", support::serve(app).await), recorded)
}

#[tokio::test]
async fn webhooks_go_one_at_a_time_per_warehouse_and_a_dead_letter_lets_the_next_go() {
    serialised_lanes(&[]).await;
    if let Some(database) = TestDatabase::create().await {
        serialised_lanes(&["--database-url", database.url()]).await;
    }
}

async fn serialised_lanes(extra: &[&str]) {
    let (url, recorded) = stand_in("frn:wh:A", 3).await;
    let webhook = format!("acme={url}");
    let mut args = vec![
        "--webhook",
        &webhook,
        "--webhook-attempts",
        "3",
        "--webhook-backoff-ms",
        "50",
    ];
    args.extend(extra);
    let planner = planner(&args).await;
    let http = client();
    for (n, warehouse) in ["frn:wh:A", "frn:wh:B", "frn:wh:A", "frn:wh:B"]
        .iter()
        .enumerate()
    {
        let call = movement("acme", &format!("c-hook-{n}"), warehouse);
        book(&http, &planner, ACME, &call).await;
    }
    let feed = get(
        &http,
        &format!("{}/wes/v1/dispatch/pending", planner.url),
        ACME,
    )
    .await;
    let feed: Vec<(String, String)> = feed.json()["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["warehouse_frn"].as_str().unwrap().to_owned(),
                e["correlation_id"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let in_feed = |warehouse: &str| -> Vec<String> {
        feed.iter()
            .filter(|(w, _)| w == warehouse)
            .map(|(_, c)| c.clone())
            .collect()
    };
    let (a, b) = (in_feed("frn:wh:A"), in_feed("frn:wh:B"));

    // Warehouse A's first event fails three times and is dead-lettered; only then does
    // A's second go. B's go in order, whatever A does.
    for _ in 0..200 {
        if recorded.seen.lock().unwrap().len() >= 6 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let seen = recorded.seen.lock().unwrap().clone();
    let lane = |warehouse: &str| -> Vec<String> {
        seen.iter()
            .filter(|(w, _)| w == warehouse)
            .map(|(_, c)| c.clone())
            .collect()
    };
    assert_eq!(seen.len(), 6, "{extra:?}: {seen:?}");
    assert_eq!(lane("frn:wh:A"), [a[0].as_str(), &a[0], &a[0], &a[1]]);
    assert_eq!(lane("frn:wh:B"), [b[0].as_str(), &b[1]]);
    let dead = get(
        &http,
        &format!("{}/wes/v1/webhooks/dead", planner.url),
        ACME,
    )
    .await;
    let dead = dead.json()["dead"].as_array().unwrap().clone();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0]["correlation_id"], a[0].as_str());
    assert!(dead[0]["error"].as_str().unwrap().contains("503"));
}

#[tokio::test]
async fn the_planner_delivers_webhooks_to_a_real_executor_once_each() {
    let executor = executor(&[]).await;
    let webhook = format!("acme={}", executor.url);
    // On PostgreSQL when there is one: the lanes are read with SQL there.
    let database = TestDatabase::create().await;
    let mut args = vec!["--webhook", webhook.as_str()];
    if let Some(database) = &database {
        args.extend(["--database-url", database.url()]);
    }
    let planner = planner(&args).await;
    let http = client();
    for n in 0..4 {
        let call = movement(
            "acme",
            &format!("c-real-hook-{n}"),
            &format!("frn:wh:{}", n % 2),
        );
        book(&http, &planner, ACME, &call).await;
    }
    let received = events_once(&http, &executor, 4).await;
    assert!(received.iter().all(|event| event["source"] == "webhook"));
    let feed = get(
        &http,
        &format!("{}/wes/v1/dispatch/pending", planner.url),
        ACME,
    )
    .await;
    let feed = feed.json()["events"].as_array().unwrap().clone();
    for warehouse in ["frn:wh:0", "frn:wh:1"] {
        let order = |events: &[Value]| -> Vec<String> {
            events
                .iter()
                .filter(|event| event["warehouse_frn"] == warehouse)
                .map(|event| event["correlation_id"].as_str().unwrap().to_owned())
                .collect()
        };
        assert_eq!(order(&received), order(&feed), "{warehouse}");
    }
    assert_eq!(planner.logged("partner.webhook_delivered").len(), 4);
}
