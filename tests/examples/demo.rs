//! The examples as a user runs them: the binary built first with the test's features
//! ([`example_path`]), started on a free port of 127.0.0.1 as a child process, its JSON
//! log read from stdout.
#![allow(dead_code, unreachable_pub)]

use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    sync::{Arc, Mutex},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use serde_json::Value;

/// The example binary `name`, built first with this test's features (once per test
/// binary), so that `cargo test --test NAME` runs alone: on a clean target directory,
/// with `--target-dir` or `--target`, or with `--release`. (`cargo test` builds the
/// examples itself, and then this finds them up to date.)
pub fn example_path(name: &str) -> PathBuf {
    static BUILT: Mutex<Vec<(String, PathBuf)>> = Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, path)) = built.iter().find(|(built, _)| built == name) {
        return path.clone();
    }
    let path = build_example(name);
    built.push((name.to_owned(), path.clone()));
    path
}

/// `cargo build --example name` with exactly the features this test was built with, so
/// that the library is not built again for another set, into this test's own target
/// directory (and target triple and profile); returns the binary cargo names.
fn build_example(name: &str) -> PathBuf {
    let features: Vec<&str> = [
        ("correlation", cfg!(feature = "correlation")),
        ("idempotency", cfg!(feature = "idempotency")),
        ("client", cfg!(feature = "client")),
        ("redis", cfg!(feature = "redis")),
        ("postgres", cfg!(feature = "postgres")),
        ("outbox", cfg!(feature = "outbox")),
        ("openapi", cfg!(feature = "openapi")),
        ("grpc", cfg!(feature = "grpc")),
        ("kafka", cfg!(feature = "kafka")),
        ("axum", cfg!(feature = "axum")),
        ("amqp", cfg!(feature = "amqp")),
        ("access-log", cfg!(feature = "access-log")),
        ("opentelemetry", cfg!(feature = "opentelemetry")),
        ("metrics", cfg!(feature = "metrics")),
        ("reqwest", cfg!(feature = "reqwest")),
        ("full", cfg!(feature = "full")),
    ]
    .into_iter()
    .filter_map(|(feature, on)| on.then_some(feature))
    .collect();
    // `<target-dir>/tmp`: the target directory this test was built in, which a
    // `--target-dir` on the command line would not tell a nested cargo.
    let target_dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("CARGO_TARGET_TMPDIR is inside the target directory");
    let mut cargo = Command::new(env!("CARGO"));
    cargo
        .args(["build", "--example", name, "--no-default-features"])
        .args(["--features", &features.join(",")])
        .arg("--target-dir")
        .arg(target_dir)
        .args(["--message-format", "json-render-diagnostics"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stderr(Stdio::inherit());
    // This test is `[<triple>/]<profile>/deps/<name>-<hash>` under the target directory.
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(Path::parent).unwrap();
    let platform_dir = profile_dir.parent().unwrap();
    if platform_dir != target_dir {
        cargo.arg("--target").arg(platform_dir.file_name().unwrap());
    }
    if !cfg!(debug_assertions) {
        cargo.arg("--release");
    }
    let output = cargo.output().expect("cargo runs");
    assert!(output.status.success(), "the {name} example builds");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|message| message["reason"] == "compiler-artifact")
        .filter(|message| message["target"]["name"] == name)
        .find_map(|message| message["executable"].as_str().map(PathBuf::from))
        .unwrap_or_else(|| panic!("cargo names the {name} example's binary"))
}

/// Runs the example `name` (built first, as [`Demo::example`] does) with `args` until it
/// exits: its status, how long it ran (the build not counted) and what it wrote to
/// stderr. Panics, after killing it, if it still runs after `limit`.
pub fn run_to_exit(name: &str, args: &[&str], limit: Duration) -> (ExitStatus, Duration, String) {
    use std::io::Read;
    let path = example_path(name);
    let started = Instant::now();
    let mut child = Command::new(path)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("the {name} example runs: {e}"));
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the {name} example still ran after {limit:?}: {args:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let took = started.elapsed();
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    (status, took, stderr)
}

pub struct Demo {
    child: Child,
    /// `http://127.0.0.1:PORT`
    pub url: String,
    /// `127.0.0.1:PORT`
    pub addr: String,
    lines: Arc<Mutex<Vec<Value>>>,
    /// The thread reading the log; it ends when the demo's stdout closes.
    reader: Option<JoinHandle<()>>,
}

impl Drop for Demo {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Demo {
    /// Starts the demo with `args`, by default with JSON logs and a 50 ms publish delay,
    /// and waits until it says where it listens.
    pub fn start(args: &[&str]) -> Demo {
        Self::start_with_env(args, &[])
    }

    /// [`start`](Self::start) with environment variables, such as `RUST_LOG`. With
    /// `--log-format pretty` in `args`, each line is kept as a JSON string.
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Demo {
        // The demo takes each flag once: a default only where `args` has none.
        let defaults: Vec<&str> = [("--log-format", "json"), ("--publish-delay-ms", "50")]
            .into_iter()
            .filter(|(flag, _)| !args.contains(flag))
            .flat_map(|(flag, value)| [flag, value])
            .collect();
        let args: Vec<&str> = defaults.into_iter().chain(args.iter().copied()).collect();
        Self::example("commands", &args, env)
    }

    /// Starts the example `name` with `--addr 127.0.0.1:0` and `args` (`--log-format
    /// json` unless they say `pretty`), and waits until it says where it listens.
    pub fn example(name: &str, args: &[&str], env: &[(&str, &str)]) -> Demo {
        let pretty = args.windows(2).any(|w| w == ["--log-format", "pretty"]);
        let json: &[&str] = if args.contains(&"--log-format") {
            &[]
        } else {
            &["--log-format", "json"]
        };
        let mut child = Command::new(example_path(name))
            .args(["--addr", "127.0.0.1:0"])
            .args(json)
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("the {name} example runs: {e}"));
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let lines = Arc::new(Mutex::new(Vec::new()));
        let (url_tx, url_rx) = std::sync::mpsc::channel();
        let sink = lines.clone();
        let reader = std::thread::spawn(move || {
            for line in stdout.lines() {
                let Ok(line) = line else { return };
                let value: Value = if pretty {
                    Value::String(line)
                } else {
                    serde_json::from_str(&line)
                        .unwrap_or_else(|_| panic!("not one JSON object per line: {line}"))
                };
                let message = match &value {
                    Value::String(line) => Some(line.as_str()),
                    value => value["fields"]["message"].as_str(),
                };
                if let Some((_, url)) = message.and_then(|m| m.split_once("listening on ")) {
                    let url = url.split_whitespace().next().unwrap_or_default();
                    let _ = url_tx.send(url.to_owned());
                }
                sink.lock().unwrap().push(value);
            }
        });
        let url = url_rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the demo says where it listens");
        let addr = url.strip_prefix("http://").unwrap().to_owned();
        Demo {
            child,
            url,
            addr,
            lines,
            reader: Some(reader),
        }
    }

    /// Kills the demo with SIGKILL, as a crash would, and waits until it is gone and
    /// every line it wrote has been read.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(reader) = self.reader.take() {
            reader
                .join()
                .expect("the demo's log is one JSON object per line");
        }
    }

    /// Every line logged so far.
    pub fn lines(&self) -> Vec<Value> {
        self.lines.lock().unwrap().clone()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The lines logged so far with `event` = `code`.
    pub fn logged(&self, code: &str) -> Vec<Value> {
        let lines = self.lines.lock().unwrap();
        lines
            .iter()
            .filter(|l| l["fields"]["event"] == code)
            .cloned()
            .collect()
    }

    /// The access lines whose idempotency outcome is `outcome`, waiting up to 5 s for
    /// `count` of them (the log is read on another thread) and 100 ms more for extras.
    pub async fn outcomes(&self, outcome: &str, count: usize) -> Vec<Value> {
        let found = || {
            self.logged("http.access")
                .into_iter()
                .filter(|line| line["span"]["idempotency_outcome"] == outcome)
                .collect::<Vec<_>>()
        };
        for _ in 0..500 {
            if found().len() >= count {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        found()
    }

    /// The lines with `event` = `code`, waiting up to 5 s for the first: the log is read
    /// on another thread.
    pub async fn events(&self, code: &str) -> Vec<Value> {
        for _ in 0..500 {
            let found = self.logged(code);
            if !found.is_empty() {
                return found;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("no {code} event in the demo's log");
    }

    /// Sends SIGTERM, as a service manager stopping the demo would.
    #[cfg(unix)]
    pub fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("kill(1) runs");
        assert!(status.success(), "kill -TERM failed");
    }

    /// Waits up to `limit` for the demo to exit; `None` if it is still running.
    pub async fn exited_within(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        None
    }
}
