//! The demo service as a user runs it: the `commands` example binary on a free port,
//! driven over HTTP, its JSON log read from stdout.

#[path = "support/mod.rs"]
mod support;

use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    time::Duration,
};

use http::StatusCode;
use serde_json::{json, Value};
use support::{client, send};

/// The example binary `cargo test` built next to this test.
fn example_path() -> std::path::PathBuf {
    let mut path = std::env::current_exe().unwrap();
    path.pop(); // deps/
    path.pop();
    path.push("examples");
    path.push(format!("commands{}", std::env::consts::EXE_SUFFIX));
    path
}

struct Demo {
    child: Child,
    url: String,
    lines: Arc<Mutex<Vec<Value>>>,
}

impl Drop for Demo {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_demo() -> Demo {
    let mut child = Command::new(example_path())
        .args([
            "--addr",
            "127.0.0.1:0",
            "--log-format",
            "json",
            "--publish-delay-ms",
            "50",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("the commands example is built by `cargo test`");
    let stdout = BufReader::new(child.stdout.take().unwrap());
    let lines = Arc::new(Mutex::new(Vec::new()));
    let (url_tx, url_rx) = std::sync::mpsc::channel();
    let sink = lines.clone();
    std::thread::spawn(move || {
        for line in stdout.lines() {
            let line = line.unwrap();
            let value: Value = serde_json::from_str(&line)
                .unwrap_or_else(|_| panic!("not one JSON object per line: {line}"));
            if let Some(url) = value["fields"]["message"]
                .as_str()
                .and_then(|m| m.strip_prefix("listening on "))
            {
                url_tx.send(url.to_owned()).unwrap();
            }
            sink.lock().unwrap().push(value);
        }
    });
    let url = url_rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the demo says where it listens");
    Demo { child, url, lines }
}

impl Demo {
    fn events(&self, code: &str) -> Vec<Value> {
        let lines = self.lines.lock().unwrap();
        lines
            .iter()
            .filter(|l| l["fields"]["event"] == code)
            .cloned()
            .collect()
    }
}

#[tokio::test]
async fn the_demo_tells_one_story_per_correlation_id() {
    let demo = start_demo();
    let client = client();
    let body =
        r#"{"device_id":"thermostat-42","name":"set_temperature","payload":{"celsius":21.5}}"#;

    let created = send(
        &client,
        "POST",
        format!("{}/commands", demo.url),
        &[
            ("content-type", "application/json"),
            ("x-correlation-id", "demo-attempt-1"),
        ],
        body,
    )
    .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.text());
    assert_eq!(created.header("x-correlation-id"), Some("demo-attempt-1"));
    let command = created.json();
    assert_eq!(command["status"], "queued");
    assert_eq!(command["payload"], json!({"celsius": 21.5}));
    let id = command["id"].as_str().unwrap().to_owned();
    assert_ne!(
        id, "demo-attempt-1",
        "the entity ID is not the correlation ID"
    );

    // The publisher moves it to `sent`.
    let mut status = String::new();
    for _ in 0..100 {
        let fetched = send(
            &client,
            "GET",
            format!("{}/commands/{id}", demo.url),
            &[],
            "",
        )
        .await;
        assert_eq!(fetched.status, StatusCode::OK);
        status = fetched.json()["status"].as_str().unwrap().to_owned();
        if status == "sent" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(status, "sent");

    let listed = send(&client, "GET", format!("{}/commands", demo.url), &[], "").await;
    assert_eq!(listed.json().as_array().unwrap().len(), 1);

    let unknown = send(
        &client,
        "GET",
        format!("{}/commands/{}", demo.url, uuid::Uuid::now_v7()),
        &[],
        "",
    )
    .await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
    assert_eq!(
        unknown.header("content-type"),
        Some("application/problem+json")
    );

    let malformed = send(
        &client,
        "POST",
        format!("{}/commands", demo.url),
        &[("content-type", "application/json")],
        r#"{"device_id":"#,
    )
    .await;
    assert!(malformed.status.is_client_error());
    assert_eq!(
        malformed.header("content-type"),
        Some("application/problem+json")
    );

    // The request's lines and the delivery's lines share the ID as a prefix.
    let created_log = &demo.events("commands.created")[0];
    assert_eq!(created_log["span"]["correlation_id"], "demo-attempt-1");
    let published = &demo.events("commands.published")[0];
    let delivery = published["span"]["correlation_id"].as_str().unwrap();
    assert!(delivery.starts_with("demo-attempt-1."), "{delivery}");
    assert_eq!(published["fields"]["command_id"], id.as_str());
}
