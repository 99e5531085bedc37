//! The demo service when clients misbehave: stalled and trickled bodies, more requests
//! than it takes at once, more commands than it keeps, wrong paths and methods, and a
//! shutdown with requests in flight. Each test runs the `commands` example binary on a
//! free port of 127.0.0.1 with small limits, and checks what a client sees: status,
//! headers, body, and whether the server closed the connection.
//! (20,000 half-open connections: `tests/examples/commands_half_open.rs`.)

#[path = "demo.rs"]
mod demo;
use tower_ids_test_support as support;

use std::time::{Duration, Instant};

use demo::Demo;
use http::StatusCode;
use serde_json::Value;
use support::{client, send, Reply};
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

const COMMAND: &str =
    r#"{"device_id":"thermostat-42","name":"set_temperature","payload":{"celsius":21.5}}"#;

/// One response read from a raw connection.
struct RawReply {
    status: u16,
    /// Lowercase names.
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// From the start of the read to the end of the response.
    elapsed: Duration,
}

impl RawReply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }
}

/// Reads one response (head, then `content-length` bytes of body) from `stream`, for
/// at most `limit`.
async fn read_response(stream: &mut (impl AsyncRead + Unpin), limit: Duration) -> RawReply {
    let started = Instant::now();
    let deadline = tokio::time::Instant::from(started + limit);
    let mut bytes = Vec::new();
    let mut byte = [0u8; 1];
    // Byte by byte, so that nothing after the response is consumed.
    let head_end = loop {
        if let Some(end) = bytes.windows(4).position(|w| w == b"\r\n\r\n") {
            break end;
        }
        match tokio::time::timeout_at(deadline, stream.read(&mut byte)).await {
            Err(_) => panic!(
                "no response within {limit:?}; read so far: {:?}",
                String::from_utf8_lossy(&bytes)
            ),
            Ok(Ok(0)) => panic!(
                "closed before a response: {:?}",
                String::from_utf8_lossy(&bytes)
            ),
            Ok(Ok(_)) => bytes.push(byte[0]),
            Ok(Err(error)) => panic!("read failed before a response: {error}"),
        }
    };
    let head = String::from_utf8(bytes[..head_end].to_vec()).unwrap();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap();
    let status = status_line
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("not a status line: {status_line:?}"));
    let headers: Vec<(String, String)> = lines
        .map(|line| {
            let (name, value) = line.split_once(':').unwrap();
            (name.to_ascii_lowercase(), value.trim().to_owned())
        })
        .collect();
    let length: usize = headers
        .iter()
        .find(|(name, _)| name == "content-length")
        .map_or(0, |(_, value)| value.parse().unwrap());
    let mut body = vec![0u8; length];
    tokio::time::timeout_at(deadline, stream.read_exact(&mut body))
        .await
        .expect("the whole body in time")
        .unwrap();
    RawReply {
        status,
        headers,
        body,
        elapsed: started.elapsed(),
    }
}

/// How a connection ended.
#[derive(Debug, PartialEq)]
enum End {
    /// The server closed it: a read returned EOF.
    Eof,
    /// More bytes came.
    Data(Vec<u8>),
    Error(std::io::ErrorKind),
}

/// Waits up to `limit` for the server to close `stream`, and says how long it took; panics
/// if it is still open then.
async fn closed_within(stream: &mut (impl AsyncRead + Unpin), limit: Duration) -> (End, Duration) {
    let started = Instant::now();
    let mut chunk = [0u8; 1024];
    let end = match tokio::time::timeout(limit, stream.read(&mut chunk)).await {
        Err(_) => panic!("the server did not close the connection within {limit:?}"),
        Ok(Ok(0)) => End::Eof,
        Ok(Ok(n)) => End::Data(chunk[..n].to_vec()),
        Ok(Err(error)) => End::Error(error.kind()),
    };
    (end, started.elapsed())
}

/// Checks a problem-details answer against RFC 9457 and the demo's convention: the
/// media type, `type` (the URN of `code`), `title`, `status`, `detail` and `code`.
fn assert_problem(status: u16, content_type: Option<&str>, body: &Value, code: &str) {
    assert_eq!(content_type, Some("application/problem+json"), "{body}");
    assert_eq!(body["status"], status, "{body}");
    assert_eq!(body["code"], code, "{body}");
    assert_eq!(
        body["type"],
        format!("urn:tower-ids:example:commands:{code}"),
        "{body}"
    );
    assert!(
        body["title"].as_str().is_some_and(|t| !t.is_empty()),
        "{body}"
    );
    assert!(
        body["detail"].as_str().is_some_and(|d| !d.is_empty()),
        "{body}"
    );
}

fn assert_reply_problem(reply: &Reply, status: StatusCode, code: &str) {
    assert_eq!(reply.status, status, "{}", reply.text());
    assert_problem(
        status.as_u16(),
        reply.header("content-type"),
        &reply.json(),
        code,
    );
}

async fn create(url: &str, key: &str) -> Reply {
    send(
        &client(),
        "POST",
        format!("{url}/commands"),
        &[
            ("content-type", "application/json"),
            ("x-api-key", "faults"),
            ("idempotency-key", key),
        ],
        COMMAND,
    )
    .await
}

#[tokio::test]
async fn unknown_paths_and_methods_are_problem_details() {
    let demo = Demo::start(&[]);
    let client = client();

    let unknown = send(&client, "GET", format!("{}/nope", demo.url), &[], "").await;
    assert_reply_problem(&unknown, StatusCode::NOT_FOUND, "route.not_found");
    assert!(
        unknown.header("x-correlation-id").is_some(),
        "inside the correlation layer"
    );

    let delete = send(&client, "DELETE", format!("{}/commands", demo.url), &[], "").await;
    assert_reply_problem(
        &delete,
        StatusCode::METHOD_NOT_ALLOWED,
        "route.method_not_allowed",
    );
    let mut allowed: Vec<&str> = delete.header("allow").unwrap().split(',').collect();
    allowed.sort_unstable();
    assert_eq!(allowed, ["GET", "HEAD", "POST"]);
    assert_eq!(
        delete.header("idempotent-replayed"),
        None,
        "a 405 does not go through the POST route's idempotency layer"
    );

    let put = send(
        &client,
        "PUT",
        format!("{}/commands/{}", demo.url, uuid::Uuid::now_v7()),
        &[],
        "",
    )
    .await;
    assert_reply_problem(
        &put,
        StatusCode::METHOD_NOT_ALLOWED,
        "route.method_not_allowed",
    );
    assert_eq!(put.header("allow"), Some("GET,HEAD"));

    let get_cancel = send(
        &client,
        "GET",
        format!("{}/commands/{}/cancel", demo.url, uuid::Uuid::now_v7()),
        &[],
        "",
    )
    .await;
    assert_reply_problem(
        &get_cancel,
        StatusCode::METHOD_NOT_ALLOWED,
        "route.method_not_allowed",
    );
    assert_eq!(get_cancel.header("allow"), Some("POST"));
}

#[tokio::test]
async fn the_command_list_keeps_the_latest_commands() {
    let demo = Demo::start(&["--max-commands", "3"]);
    let client = client();
    let mut ids = Vec::new();
    for n in 1..=5 {
        let created = create(&demo.url, &format!("list-{n}")).await;
        assert_eq!(created.status, StatusCode::CREATED, "{}", created.text());
        ids.push(created.json()["id"].as_str().unwrap().to_owned());
    }

    // The latest three, oldest first; the first two were dropped to make room.
    let listed = send(&client, "GET", format!("{}/commands", demo.url), &[], "").await;
    let listed: Vec<String> = listed
        .json()
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(listed, ids[2..]);
    for dropped in &ids[..2] {
        let fetched = send(
            &client,
            "GET",
            format!("{}/commands/{dropped}", demo.url),
            &[],
            "",
        )
        .await;
        assert_reply_problem(&fetched, StatusCode::NOT_FOUND, "commands.not_found");
    }
    let kept = send(
        &client,
        "GET",
        format!("{}/commands/{}", demo.url, ids[2]),
        &[],
        "",
    )
    .await;
    assert_eq!(kept.status, StatusCode::OK);

    let evicted: Vec<String> = demo
        .events("commands.evicted")
        .await
        .iter()
        .map(|e| e["fields"]["command_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(evicted, ids[..2]);

    // The idempotency record outlives the command: a retry of the first create still
    // replays its answer, and creates nothing.
    let retried = create(&demo.url, "list-1").await;
    assert_eq!(retried.status, StatusCode::CREATED);
    assert_eq!(retried.header("idempotent-replayed"), Some("true"));
    assert_eq!(retried.json()["id"], ids[0].as_str());
    let listed = send(&client, "GET", format!("{}/commands", demo.url), &[], "").await;
    assert_eq!(listed.json().as_array().unwrap().len(), 3);
}

#[tokio::test]
async fn a_stalled_body_gets_408_and_its_connection_closed() {
    let demo = Demo::start(&["--body-timeout-ms", "300"]);
    let mut stream = TcpStream::connect(&demo.addr).await.unwrap();
    // The head and the first 20 of 100 bytes announced, then nothing.
    let head = format!(
        "POST /commands HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\n\
         x-api-key: faults\r\nidempotency-key: stalled-1\r\ncontent-length: {}\r\n\r\n",
        demo.addr,
        COMMAND.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(&COMMAND.as_bytes()[..20]).await.unwrap();

    let reply = read_response(&mut stream, Duration::from_secs(10)).await;
    assert_eq!(reply.status, 408);
    assert_problem(
        408,
        reply.header("content-type"),
        &reply.json(),
        "request.body_timeout",
    );
    assert_eq!(reply.header("connection"), Some("close"));
    assert!(
        reply.elapsed >= Duration::from_millis(250) && reply.elapsed < Duration::from_secs(5),
        "answered after {:?}, for a 300 ms body timeout",
        reply.elapsed
    );
    let (end, _) = closed_within(&mut stream, Duration::from_secs(5)).await;
    assert_eq!(end, End::Eof, "the server closed the connection");
    let refused = &demo.events("commands.body_refused").await[0];
    assert_eq!(refused["fields"]["reason"], "timeout");

    // Nothing ran and the key is free: the same create, sent whole, runs once.
    let created = create(&demo.url, "stalled-1").await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.text());
    assert_eq!(created.header("idempotent-replayed"), Some("false"));
    let ran = demo.outcomes("executed", 1).await;
    assert_eq!(ran.len(), 1, "created once: {ran:?}");
}

#[tokio::test]
async fn a_trickled_body_is_cut_off_at_the_request_timeout() {
    // Each byte comes in time for the body timeout; the request as a whole does not.
    let demo = Demo::start(&["--body-timeout-ms", "1000", "--request-timeout-ms", "1200"]);
    let stream = TcpStream::connect(&demo.addr).await.unwrap();
    let (mut reader, mut writer) = stream.into_split();
    let head = format!(
        "POST /commands HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\n\
         x-api-key: faults\r\nidempotency-key: trickled-1\r\ncontent-length: {}\r\n\r\n",
        demo.addr,
        COMMAND.len()
    );
    writer.write_all(head.as_bytes()).await.unwrap();
    let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
    let trickle = tokio::spawn(async move {
        // At most 30 bytes, 200 ms apart (6 s, far past the request timeout), until told
        // to stop; the connection stays open for writing.
        for byte in COMMAND.as_bytes().iter().take(30) {
            if writer.write_all(&[*byte]).await.is_err() {
                break;
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                _ = &mut stopped => break,
            }
        }
        writer
    });

    let reply = read_response(&mut reader, Duration::from_secs(10)).await;
    assert_eq!(reply.status, 408);
    assert_problem(
        408,
        reply.header("content-type"),
        &reply.json(),
        "request.timeout",
    );
    assert_eq!(reply.header("connection"), Some("close"));
    assert!(
        reply.elapsed >= Duration::from_millis(1100) && reply.elapsed < Duration::from_secs(5),
        "answered after {:?}, for a 1200 ms request timeout",
        reply.elapsed
    );

    // The client stops sending. The idempotency layer reads on in a task of its own after
    // the 408 (its dropped response future hands its work on), so the connection closes
    // when that read fails: within the 1 s body timeout.
    let _ = stop.send(());
    let _writer = trickle.await.unwrap();
    let (end, took) = closed_within(&mut reader, Duration::from_secs(5)).await;
    assert_eq!(end, End::Eof);
    assert!(took < Duration::from_secs(3), "closed after {took:?}");
}

#[tokio::test]
async fn over_the_concurrency_limit_requests_are_shed_at_once() {
    let demo = Demo::start(&[
        "--max-concurrent-requests",
        "2",
        "--handler-delay-ms",
        "1500",
    ]);
    // Two slow creates take both slots for 1.5 s.
    let started = Instant::now();
    let holders: Vec<_> = (1..=2)
        .map(|n| {
            let url = demo.url.clone();
            tokio::spawn(async move { create(&url, &format!("slow-{n}")).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;

    // Another route than the two creates': the limit is one for the whole service, not
    // one per route.
    let client = client();
    let asked = Instant::now();
    let shed = send(
        &client,
        "GET",
        format!("{}/commands/{}", demo.url, uuid::Uuid::now_v7()),
        &[],
        "",
    )
    .await;
    let waited = asked.elapsed();
    assert_reply_problem(&shed, StatusCode::SERVICE_UNAVAILABLE, "server.overloaded");
    assert_eq!(shed.header("retry-after"), Some("1"));
    assert!(shed.header("x-correlation-id").is_some());
    assert!(
        waited < Duration::from_secs(1) && started.elapsed() < Duration::from_millis(1500),
        "shed after {waited:?}, not queued until a slot was free"
    );

    for holder in holders {
        let created = holder.await.unwrap();
        assert_eq!(created.status, StatusCode::CREATED, "{}", created.text());
    }
    // The slots are free again.
    let listed = send(&client, "GET", format!("{}/commands", demo.url), &[], "").await;
    assert_eq!(listed.status, StatusCode::OK);
    assert_eq!(listed.json().as_array().unwrap().len(), 2);
}

#[cfg(unix)]
#[tokio::test]
async fn shutdown_finishes_requests_in_flight_and_closes_idle_connections() {
    let mut demo = Demo::start(&["--handler-delay-ms", "800"]);
    // One connection that has sent nothing, one kept alive after a request.
    let mut silent = TcpStream::connect(&demo.addr).await.unwrap();
    let mut kept_alive = TcpStream::connect(&demo.addr).await.unwrap();
    let request = format!("GET /commands HTTP/1.1\r\nhost: {}\r\n\r\n", demo.addr);
    kept_alive.write_all(request.as_bytes()).await.unwrap();
    let mut answer = [0u8; 1024];
    let n = kept_alive.read(&mut answer).await.unwrap();
    assert!(answer[..n].starts_with(b"HTTP/1.1 200 OK"));

    let url = demo.url.clone();
    let in_flight = tokio::spawn(async move { create(&url, "shutdown-1").await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    demo.terminate();

    for stream in [&mut silent, &mut kept_alive] {
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut byte)).await;
        assert!(
            matches!(read, Ok(Ok(0))),
            "an idle connection is closed at shutdown: {read:?}"
        );
    }
    let created = in_flight.await.unwrap();
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.text());
    let status = demo
        .exited_within(Duration::from_secs(10))
        .await
        .expect("the demo stops once the request in flight is answered");
    assert!(status.success(), "{status}");
    demo.events("commands.stopped").await;
}

/// What hyper refuses while it reads a request head, before any layer runs, is not
/// problem details: hyper answers it itself, with an empty body and `Connection:
/// close`, and has no hook to answer otherwise (the README says so). A header with a
/// control byte and a request with two `Content-Length`s are `400`, more than 100
/// header lines or a head over hyper's read buffer (about 400 KiB) `431`, a path over
/// 65,534 bytes `414`.
#[tokio::test]
async fn hyper_refuses_a_malformed_or_oversized_head_with_an_empty_answer() {
    let demo = Demo::start(&[]);
    let lines = |n: usize| (0..n).map(|i| format!("x-h{i}: v\r\n")).collect::<String>();
    let cases: [(&str, Vec<u8>, u16); 5] = [
        (
            "a control byte in a header value",
            b"GET /commands HTTP/1.1\r\nhost: x\r\nx-a: a\x01b\r\n\r\n".to_vec(),
            400,
        ),
        (
            "two Content-Length values",
            b"POST /commands HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n{}"
                .to_vec(),
            400,
        ),
        (
            "105 header lines",
            format!("GET /commands HTTP/1.1\r\nhost: x\r\n{}\r\n", lines(104)).into_bytes(),
            431,
        ),
        (
            "a 1 MB header",
            format!(
                "GET /commands HTTP/1.1\r\nhost: x\r\nx-big: {}\r\n\r\n",
                "a".repeat(1 << 20)
            )
            .into_bytes(),
            431,
        ),
        (
            "a 70,000-byte path",
            format!("GET /{} HTTP/1.1\r\nhost: x\r\n\r\n", "a".repeat(70_000)).into_bytes(),
            414,
        ),
    ];
    for (what, request, status) in cases {
        let (mut reader, mut writer) = TcpStream::connect(&demo.addr).await.unwrap().into_split();
        // hyper answers before it has read all of a 1 MB head: the write may fail then.
        let writing = tokio::spawn(async move {
            let _ = writer.write_all(&request).await;
            writer
        });
        let reply = read_response(&mut reader, Duration::from_secs(5)).await;
        assert_eq!(reply.status, status, "{what}");
        assert_eq!(reply.header("content-length"), Some("0"), "{what}");
        assert_eq!(reply.header("content-type"), None, "{what}");
        assert_eq!(reply.header("connection"), Some("close"), "{what}");
        assert_eq!(
            reply.header("x-correlation-id"),
            None,
            "{what}: no layer ran"
        );
        let (end, _) = closed_within(&mut reader, Duration::from_secs(5)).await;
        assert!(
            matches!(end, End::Eof | End::Error(_)),
            "{what}: the connection is closed: {end:?}"
        );
        // What is left of the write is of no interest.
        writing.abort();
    }

    // Within those bounds the layers answer: 100 header lines are served.
    let mut stream = TcpStream::connect(&demo.addr).await.unwrap();
    let request = format!("GET /commands HTTP/1.1\r\nhost: x\r\n{}\r\n", lines(99));
    stream.write_all(request.as_bytes()).await.unwrap();
    let reply = read_response(&mut stream, Duration::from_secs(5)).await;
    assert_eq!(reply.status, 200);
    assert!(reply.header("x-correlation-id").is_some());
}

/// `--max-body-bytes` above axum's own default limit (2 MB) is the limit: a 2.5 MB
/// command is created (it was `413 body.unreadable`), and as its answer is over the
/// idempotency layer's 1 MiB, a retry gets `410 idempotency.not_replayable`, not a
/// second command.
#[tokio::test]
async fn a_body_limit_above_two_megabytes_is_the_flags() {
    let demo = Demo::start(&["--max-body-bytes", "3000000"]);
    let body = format!(
        r#"{{"device_id":"d-large","name":"firmware","payload":"{}"}}"#,
        "a".repeat(2_500_000)
    );
    let client = client();
    let send_it = || {
        send(
            &client,
            "POST",
            format!("{}/commands", demo.url),
            &[
                ("content-type", "application/json"),
                ("x-api-key", "faults"),
                ("idempotency-key", "large-1"),
            ],
            &body,
        )
    };
    let created = send_it().await;
    assert_eq!(
        created.status,
        StatusCode::CREATED,
        "{:.300}",
        created.text()
    );
    let retried = send_it().await;
    assert_eq!(retried.status, StatusCode::GONE, "{}", retried.text());
    assert_eq!(retried.json()["code"], "idempotency.not_replayable");
    let listed = send(&client, "GET", format!("{}/commands", demo.url), &[], "").await;
    assert_eq!(listed.json().as_array().unwrap().len(), 1);
}
