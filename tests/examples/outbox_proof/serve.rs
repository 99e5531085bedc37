//! `examples/outbox serve` against clients that send part of a request: a body that
//! stops arriving is answered `408` and its connection closed within the body timeout,
//! and SIGTERM stops the server within that and its drain timeout, with such a client
//! still connected.

use std::time::{Duration, Instant};

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::TcpStream,
};

use crate::{database::TestDatabase, demo::Demo};

/// What the server answered on a raw connection, read to its end.
struct Answer {
    head: String,
    body: String,
    after: Duration,
}

/// Opens a connection, sends a payment's head announcing 100 bytes and 20 of them,
/// and returns the connection with the moment the bytes went.
async fn half_sent(addr: &str) -> (TcpStream, Instant) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /payments HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         idempotency-key: half-sent-{}\r\ncontent-length: 100\r\n\r\n",
        uuid::Uuid::now_v7().simple()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(br#"{"account":"acct-1","#).await.unwrap();
    (stream, Instant::now())
}

/// Reads until the server closes the connection, at most `limit`.
async fn read_to_close(stream: &mut TcpStream, sent: Instant, limit: Duration) -> Answer {
    let mut bytes = Vec::new();
    tokio::time::timeout(limit, stream.read_to_end(&mut bytes))
        .await
        .unwrap_or_else(|_| {
            panic!("the connection was neither answered nor closed within {limit:?}")
        })
        .unwrap();
    let after = sent.elapsed();
    let text = String::from_utf8(bytes).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    Answer {
        head: head.to_ascii_lowercase(),
        body: body.to_owned(),
        after,
    }
}

fn assert_body_timeout(answer: &Answer) {
    assert!(
        answer.head.starts_with("http/1.1 408"),
        "answered: {}",
        answer.head
    );
    assert!(answer
        .head
        .contains("content-type: application/problem+json"));
    assert!(answer.head.contains("connection: close"), "{}", answer.head);
    let problem: serde_json::Value = serde_json::from_str(&answer.body).unwrap();
    assert_eq!(problem["status"], 408);
    assert_eq!(problem["code"], "request.body_timeout");
}

#[tokio::test]
async fn a_half_sent_body_is_answered_408_and_a_stop_does_not_wait_for_it() {
    let Some(database) = TestDatabase::create().await else {
        return;
    };
    let mut serve = Demo::example(
        "outbox",
        &[
            "serve",
            "--database-url",
            database.url(),
            "--body-timeout-ms",
            "500",
            "--drain-timeout-ms",
            "1000",
        ],
        &[],
    );

    // Answered and closed once the body has been silent for the timeout.
    let (mut stream, sent) = half_sent(&serve.addr).await;
    let answer = read_to_close(&mut stream, sent, Duration::from_secs(5)).await;
    assert_body_timeout(&answer);
    assert!(
        answer.after >= Duration::from_millis(450),
        "answered after {:?}, before the 500 ms body timeout",
        answer.after
    );
    let warned = &serve.events("http.body_timeout").await[0];
    assert_eq!(warned["level"], "WARN");
    assert_eq!(warned["fields"]["timeout_ms"], 500);

    // A stop with such a client connected: the request is answered at its timeout,
    // and the process exits within that and the drain timeout.
    let (mut stream, sent) = half_sent(&serve.addr).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    serve.terminate();
    let status = serve
        .exited_within(Duration::from_secs(5))
        .await
        .expect("SIGTERM stops the server within the body and drain timeouts");
    assert!(status.success(), "exited with {status}");
    let answer = read_to_close(&mut stream, sent, Duration::from_secs(1)).await;
    assert_body_timeout(&answer);

    // Nothing ran for either: no payment, no outbox message.
    let pool = database.pool(1).await;
    let payments: i64 = sqlx::query_scalar("SELECT count(*) FROM sent_payments")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(payments, 0);
}
