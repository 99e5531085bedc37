//! One relay or consumer process: started from its example and awaited until it logs
//! that it is ready, its JSON log read line by line into [`Event`]s and [`Progress`],
//! killed with SIGKILL (a relay inside its round) or stopped with SIGTERM.

use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, ExitStatus, Stdio},
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use serde_json::Value;

use crate::demo;

/// What the test keeps of a log line.
#[derive(Debug, Clone)]
pub(crate) struct Event {
    pub(crate) code: String,
    pub(crate) level: String,
    pub(crate) key: Option<String>,
    /// `outbox.published`: the outbox row, from its `outbox.publish` span.
    pub(crate) message_id: Option<i64>,
}

/// Events the test reads; other lines are kept only when they warn.
const KEPT: &[&str] = &[
    "outbox.published",
    "inbox.received",
    "inbox.handled",
    "inbox.replayed",
    "message.consuming",
    "relay.ready",
];

fn parse(line: &str) -> Option<Event> {
    let value: Value = match serde_json::from_str(line) {
        Ok(value) => value,
        Err(_) => {
            return Some(Event {
                code: "(not JSON)".to_owned(),
                level: "WARN".to_owned(),
                key: Some(line.to_owned()),
                message_id: None,
            })
        }
    };
    let fields = &value["fields"];
    let level = value["level"].as_str().unwrap_or_default();
    let code = match fields["event"].as_str() {
        Some(code) => code.to_owned(),
        // A library's line: its target and the start of its message.
        None => format!(
            "{}: {:.60}",
            value["target"].as_str().unwrap_or_default(),
            fields["message"].as_str().unwrap_or_default()
        ),
    };
    if !KEPT.contains(&code.as_str()) && !matches!(level, "WARN" | "ERROR") {
        return None;
    }
    Some(Event {
        code,
        level: level.to_owned(),
        key: fields["key"].as_str().map(str::to_owned),
        message_id: value["span"]["message_id"].as_i64(),
    })
}

/// Progress, counted from every process's log as it is read.
#[derive(Default)]
pub(crate) struct Progress {
    /// `outbox.published` lines of the relays.
    pub(crate) published: AtomicUsize,
    /// `inbox.handled` lines of the consumers.
    pub(crate) handled: AtomicUsize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    Relay,
    Consumer,
}

/// One run of a relay or a consumer, its JSON log read line by line.
pub(crate) struct Process {
    name: String,
    child: Child,
    events: Arc<Mutex<Vec<Event>>>,
    /// Its `outbox.published` lines so far.
    published: Arc<AtomicUsize>,
    reader: Option<JoinHandle<()>>,
}

/// A finished run: its role and its events.
pub(crate) struct Run {
    pub(crate) role: Role,
    pub(crate) events: Vec<Event>,
}

impl Process {
    /// Starts the example `example` with `args` as `name`, and waits until it logs that
    /// it is ready; a start whose process exits first (a connection closed under it) is
    /// tried again, up to five times.
    pub(crate) fn start(
        example: &str,
        role: Role,
        name: String,
        args: &[String],
        progress: Arc<Progress>,
    ) -> Self {
        let mut tries = 0;
        loop {
            match Self::try_start(example, role, name.clone(), args, progress.clone()) {
                Ok(process) => return process,
                Err(why) if tries < 5 => {
                    tries += 1;
                    eprintln!("{why}; starting it again");
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(why) => panic!("{why}, five times"),
            }
        }
    }

    fn try_start(
        example: &str,
        role: Role,
        name: String,
        args: &[String],
        progress: Arc<Progress>,
    ) -> Result<Self, String> {
        let ready = match role {
            Role::Relay => "relay.ready",
            Role::Consumer => "message.consuming",
        };
        let mut child = Command::new(demo::example_path(example))
            .args(args)
            .env(
                "RUST_LOG",
                // `outbox.published` is DEBUG.
                "info,lapin=warn,rdkafka=warn,tower_ids::outbox=debug",
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("the {example} example runs: {e}"));
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let events = Arc::new(Mutex::new(Vec::new()));
        let published = Arc::new(AtomicUsize::new(0));
        let (sink, counted) = (events.clone(), published.clone());
        let reader = std::thread::spawn(move || {
            for line in stdout.lines() {
                let Ok(line) = line else { return };
                let Some(event) = parse(&line) else { continue };
                match event.code.as_str() {
                    "outbox.published" => {
                        progress.published.fetch_add(1, Ordering::Relaxed);
                        counted.fetch_add(1, Ordering::Relaxed);
                    }
                    "inbox.handled" => {
                        progress.handled.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => {}
                }
                sink.lock().unwrap().push(event);
            }
        });
        let mut process = Self {
            name,
            child,
            events,
            published,
            reader: Some(reader),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !process
            .events
            .lock()
            .unwrap()
            .iter()
            .any(|e| e.code == ready)
        {
            if let Some(status) = process.child.try_wait().unwrap() {
                return Err(format!(
                    "{} exited with {status} before {ready}",
                    process.name
                ));
            }
            assert!(
                Instant::now() < deadline,
                "{} logged no {ready} within 30 s",
                process.name
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(process)
    }

    /// Whether it exited by itself.
    pub(crate) fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().unwrap()
    }

    /// SIGKILL, aimed at a relay's round: as soon as it logs its next publication
    /// (within 3 s), while the round that published it has not committed, so that
    /// what it published is published again.
    pub(crate) fn kill_mid_round(self) -> Run {
        let before = self.published.load(Ordering::Relaxed);
        let deadline = Instant::now() + Duration::from_secs(3);
        while self.published.load(Ordering::Relaxed) == before && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(200));
        }
        self.kill(Role::Relay)
    }

    /// SIGKILL: no goodbye.
    pub(crate) fn kill(mut self, role: Role) -> Run {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.finish(role)
    }

    /// SIGTERM, as a service manager stops it: it finishes what it holds and exits 0.
    pub(crate) fn terminate(mut self, role: Role) -> Run {
        signal(self.child.id(), "-TERM");
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "{} did not stop within 30 s of SIGTERM",
                self.name
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        assert!(status.success(), "{} stopped with {status}", self.name);
        self.finish(role)
    }

    pub(crate) fn finish(&mut self, role: Role) -> Run {
        if let Some(reader) = self.reader.take() {
            reader.join().expect("the log reader ends with the process");
        }
        Run {
            role,
            events: std::mem::take(&mut *self.events.lock().unwrap()),
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `kill SIGNAL pid`.
pub(crate) fn signal(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .expect("kill(1) runs");
    assert!(status.success(), "kill {signal} {pid} failed");
}
