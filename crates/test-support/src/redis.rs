//! A real `redis-server` per test: started on a free loopback port in a directory of
//! its own, paused (SIGSTOP), resumed (SIGCONT), killed (SIGKILL) and restarted on the
//! same port, with or without its append-only file.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant, SystemTime},
};

/// A `redis-server` child process on 127.0.0.1, killed (and its directory removed) on
/// drop.
pub struct RedisServer {
    port: u16,
    dir: PathBuf,
    /// Whether it keeps an append-only file (fsync every second, Redis's default), so
    /// that a restart finds what was written before the kill.
    persistent: bool,
    child: Option<Child>,
}

/// How long a starting `redis-server` has to accept connections.
const STARTUP: Duration = Duration::from_secs(10);

impl RedisServer {
    /// Starts one without persistence, or returns `None` (after saying so loudly) when
    /// `redis-server` is not on `PATH` and this is not CI.
    pub fn start() -> Option<Self> {
        Self::start_with(false)
    }

    /// Starts one with its append-only file on: a kill and restart loses nothing it
    /// acknowledged.
    pub fn start_persistent() -> Option<Self> {
        Self::start_with(true)
    }

    fn start_with(persistent: bool) -> Option<Self> {
        let found = Command::new("redis-server")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|status| status.success());
        if !found {
            if std::env::var_os("CI").is_some() {
                panic!("redis-server is not on PATH, and CI is set: the Redis tests must run");
            }
            eprintln!("SKIPPED: redis-server not on PATH; these tests did not run");
            return None;
        }

        // A free port can be taken between our probe and redis binding it: try again
        // with another.
        let mut last_error = String::new();
        for _ in 0..5 {
            let port = free_port();
            let dir = std::env::temp_dir().join(format!(
                "tower-ids-redis-{}-{port}-{}",
                std::process::id(),
                SystemTime::now()
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos()
            ));
            std::fs::create_dir_all(&dir).unwrap();
            let mut server = Self {
                port,
                dir,
                persistent,
                child: None,
            };
            match server.spawn() {
                Ok(()) => return Some(server),
                Err(error) => last_error = error,
            }
        }
        panic!("redis-server did not start: {last_error}");
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Starts the process on `self.port` and waits until it answers `PING`.
    fn spawn(&mut self) -> Result<(), String> {
        assert!(self.child.is_none(), "already running");
        let appendonly = if self.persistent { "yes" } else { "no" };
        let mut child = Command::new("redis-server")
            .arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1", "--save", ""])
            .args(["--appendonly", appendonly, "--appendfsync", "everysec"])
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot spawn redis-server: {e}"))?;
        let deadline = Instant::now() + STARTUP;
        while Instant::now() < deadline {
            if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
                return Err(format!("redis-server exited with {status}"));
            }
            if ping(self.port) {
                self.child = Some(child);
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        let _ = child.wait();
        Err(format!(
            "redis-server did not answer PING within {STARTUP:?}"
        ))
    }

    /// Sends `signal` to the process with `kill(1)`.
    fn signal(&self, signal: &str) {
        let child = self.child.as_ref().expect("running");
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(child.id().to_string())
            .status()
            .expect("kill(1) runs");
        assert!(status.success(), "kill -{signal} failed");
    }

    /// Freezes the process (SIGSTOP): connections stay open, nothing is answered.
    pub fn pause(&self) {
        self.signal("STOP");
    }

    /// Lets a paused process go on (SIGCONT): it answers what queued up meanwhile.
    pub fn resume(&self) {
        self.signal("CONT");
    }

    /// Kills the process (SIGKILL: no shutdown, connections just drop).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port and directory: with its append-only file if
    /// persistent, empty otherwise.
    pub fn restart(&mut self) {
        self.kill();
        // The old socket may linger for a moment; redis binds with SO_REUSEADDR, but
        // give a failed bind a few more tries.
        let mut last_error = String::new();
        for _ in 0..20 {
            match self.spawn() {
                Ok(()) => return,
                Err(error) => last_error = error,
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!(
            "redis-server did not restart on port {}: {last_error}",
            self.port
        );
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // SIGKILL ends a paused process too.
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Whether a Redis on `port` answers `PING` with `+PONG`.
fn ping(port: u16) -> bool {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_millis(100)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    let mut reply = [0; 7];
    stream.write_all(b"PING\r\n").is_ok()
        && stream.read_exact(&mut reply).is_ok()
        && &reply == b"+PONG\r\n"
}
