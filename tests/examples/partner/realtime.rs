//! Realtime calls and confirmations on the planner: a call sent 20 times at once books
//! one movement, bad bodies change nothing, a refused call stays refused while its
//! corrected call runs once, a confirmation replays after a restart, a call in flight
//! when the planner crashes frees its key at once, and an unreachable database stops
//! the start within seconds.

use std::time::Duration;

use http::StatusCode;
use serde_json::{json, Value};

use super::{
    client, counts, demo, executor, get, movement, planner, post, send, try_send, until_settled,
    Demo, HttpClient, TestDatabase, ACME, GLOBEX,
};

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

/// A realtime call in flight when the planner is killed held its key in its own
/// transaction, which dies with the planner's connections: the movement it wrote and the
/// key are gone at once, and the first retry on the restarted planner books the
/// movement, once. The times are printed (`-- --nocapture`).
#[tokio::test]
async fn a_call_in_flight_when_the_planner_crashes_frees_its_key_at_once() {
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
    let restarted = crashed.elapsed();
    let url = format!("{}/wes/v1/realtime", planner.url);
    let booked = post(&http, &url, ACME, &call).await;
    let window = crashed.elapsed();
    println!(
        "a call in flight at the crash: its retry booked {window:?} after it (the planner was back after {restarted:?})"
    );
    assert_eq!(
        booked.status,
        StatusCode::CREATED,
        "the first retry runs, no 409: {}",
        booked.text()
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
