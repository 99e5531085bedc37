//! The demo from a browser on another origin: a page served from one port of
//! 127.0.0.1 posts twice with one key to the demo on another with `fetch()`, in
//! headless Chromium, and reads from script what CORS lets it read. Outside CI, with
//! no Chromium on `PATH`, the test says SKIPPED and passes; in CI (`CI` set) it fails.

#[path = "demo.rs"]
mod demo;
use tower_ids_test_support as support;

use std::process::Command;

use axum::{response::Html, routing::get, Router};
use demo::Demo;
use serde_json::Value;

/// The page: two `fetch()` calls with one key, their answers as JSON in `#out` once
/// both are in (or the error).
fn page(demo: &str) -> String {
    format!(
        r#"<!doctype html>
<html><body><pre id="out">pending</pre><script>
async function call(key) {{
  const response = await fetch("{demo}/commands", {{
    method: "POST",
    headers: {{
      "content-type": "application/json",
      "x-api-key": "browser-client",
      "idempotency-key": key,
    }},
    body: JSON.stringify({{device_id: "thermostat-42", name: "reboot", payload: {{}}}}),
  }});
  return {{
    status: response.status,
    replayed: response.headers.get("idempotent-replayed"),
    correlation_id: response.headers.get("x-correlation-id"),
    key: response.headers.get("idempotency-key"),
    body: await response.json(),
  }};
}}
const out = document.getElementById("out");
(async () => {{
  const key = "browser-" + Date.now();
  const first = await call(key);
  const retry = await call(key);
  out.textContent = JSON.stringify({{first, retry}});
}})().catch((error) => {{ out.textContent = "ERROR " + error; }});
</script></body></html>"#
    )
}

fn chromium() -> Option<&'static str> {
    ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|name| {
            Command::new(name)
                .arg("--version")
                .output()
                .is_ok_and(|out| out.status.success())
        })
}

/// Loads `url` in headless Chromium, lets its script run, and returns the DOM.
fn dump_dom(browser: &str, url: &str) -> String {
    let profile = tempfile_dir();
    let output = Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            &format!("--user-data-dir={}", profile.display()),
            // Virtual time waits for the page's network and timers before dumping.
            "--virtual-time-budget=15000",
            "--dump-dom",
            url,
        ])
        .output()
        .expect("chromium runs");
    let _ = std::fs::remove_dir_all(&profile);
    assert!(
        output.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("UTF-8 DOM")
}

fn tempfile_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "tower-ids-chromium-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_on_another_origin_reads_the_replay_and_the_correlation_id() {
    let Some(browser) = chromium() else {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI needs Chromium: apt-get install chromium"
        );
        eprintln!("SKIPPED: no chromium on PATH (apt-get install chromium)");
        return;
    };
    // The page's origin first: the demo is told to allow it.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let origin = format!("http://{}", listener.local_addr().unwrap());
    let demo = Demo::start(&["--cors-origin", &origin]);
    let html = page(&demo.url);
    let pages = Router::new().route("/", get(move || async move { Html(html) }));
    tokio::spawn(async move { axum::serve(listener, pages).await.unwrap() });

    let url = format!("{origin}/");
    let dom = tokio::task::spawn_blocking(move || dump_dom(browser, &url))
        .await
        .unwrap();

    let text = dom
        .split("<pre id=\"out\">")
        .nth(1)
        .and_then(|rest| rest.split("</pre>").next())
        .unwrap_or_else(|| panic!("no #out in the page: {dom}"));
    let text = text.replace("&quot;", "\"").replace("&amp;", "&");
    let seen: Value =
        serde_json::from_str(&text).unwrap_or_else(|_| panic!("the page said: {text}"));
    let (first, retry) = (&seen["first"], &seen["retry"]);
    assert_eq!(first["status"], 201, "{seen}");
    assert_eq!(first["replayed"], "false", "{seen}");
    assert_eq!(retry["status"], 201, "{seen}");
    assert_eq!(
        retry["replayed"], "true",
        "script reads idempotent-replayed: {seen}"
    );
    assert_eq!(retry["body"], first["body"], "the stored answer: {seen}");
    assert_eq!(retry["key"], first["key"]);
    let ids = [&first["correlation_id"], &retry["correlation_id"]];
    assert!(
        ids.iter().all(|id| id.is_string()),
        "script reads the ID: {seen}"
    );
    assert_ne!(ids[0], ids[1], "a correlation ID per attempt");

    // The handler ran once: the service holds one command.
    let list = support::send(
        &support::client(),
        "GET",
        format!("{}/commands", demo.url),
        &[],
        "",
    )
    .await;
    assert_eq!(
        list.json().as_array().map(Vec::len),
        Some(1),
        "{:?}",
        list.json()
    );
}
