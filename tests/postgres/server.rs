//! A throwaway PostgreSQL server of the test's own, to break on purpose: a cluster made
//! with `initdb` in a temporary directory, started on a free loopback port in a process
//! group of its own, so the whole server (postmaster and backends) can be paused
//! (SIGSTOP), resumed (SIGCONT), or killed (SIGKILL) and restarted (crash recovery).

use std::{
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant, SystemTime},
};

pub(crate) struct PostgresServer {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    /// The uid and gid to run as: `postgres` when the tests run as root (PostgreSQL
    /// refuses root), else our own.
    user: Option<(u32, u32)>,
    child: Option<Child>,
}

impl PostgresServer {
    /// Makes and starts one, or returns `None` (after saying so loudly) when the
    /// PostgreSQL server binaries are not installed and this is not CI.
    pub(crate) fn start() -> Option<Self> {
        let Some(bin) = binaries() else {
            if std::env::var_os("CI").is_some() {
                panic!("no PostgreSQL server binaries (initdb, postgres), and CI is set");
            }
            eprintln!("SKIPPED: no PostgreSQL server binaries (initdb); these tests did not run");
            return None;
        };
        let user = running_as_root().then(postgres_user).flatten();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = std::env::temp_dir().join(format!(
            "tower-ids-pg-{}-{}",
            std::process::id(),
            SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let mut server = Self {
            bin,
            dir,
            port,
            user,
            child: None,
        };
        if let Some((uid, gid)) = user {
            let owner = format!("{uid}:{gid}");
            let chown = Command::new("chown").arg(&owner).arg(&server.dir).status();
            assert!(chown.is_ok_and(|s| s.success()), "chown {owner}");
        }
        let data = server.data();
        let initdb = server
            .command("initdb")
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-D"])
            .arg(&data)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("initdb runs");
        assert!(initdb.success(), "initdb failed");
        server.spawn();
        Some(server)
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn command(&self, program: &str) -> Command {
        let mut command = Command::new(self.bin.join(program));
        if let Some((uid, gid)) = self.user {
            command.uid(uid).gid(gid);
        }
        command
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    pub(crate) fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    fn spawn(&mut self) {
        assert!(self.child.is_none(), "already running");
        let child = self
            .command("postgres")
            .arg("-D")
            .arg(self.data())
            .arg("-p")
            .arg(self.port.to_string())
            .arg("-k")
            .arg(&self.dir)
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "max_connections=50",
            ])
            // Its own process group: a signal to the group reaches every backend.
            .process_group(0)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("postgres starts");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.ready() {
            assert!(Instant::now() < deadline, "postgres did not come up");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn ready(&self) -> bool {
        self.command("pg_isready")
            .args(["-q", "-h", "127.0.0.1", "-p"])
            .arg(self.port.to_string())
            .status()
            .is_ok_and(|status| status.success())
    }

    /// Every process of the server: the postmaster and its children. A signal to the
    /// postmaster's process group is not enough: PostgreSQL puts each child (every
    /// backend, the checkpointer, the WAL writer) in a session of its own, so only the
    /// postmaster would stop and open connections would go on being answered.
    fn processes(&self) -> Vec<u32> {
        let postmaster = self.child.as_ref().expect("running").id();
        let mut processes = vec![postmaster];
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
                continue;
            };
            if parent(pid) == Some(postmaster) {
                processes.push(pid);
            }
        }
        processes
    }

    /// Sends `signal` to every process of the server: the postmaster first (so it
    /// starts no child meanwhile), then its children, any of which may have exited
    /// since they were listed.
    fn signal(&self, signal: &str) {
        let kill = |pid: u32| {
            Command::new("kill")
                .arg(format!("-{signal}"))
                .arg(pid.to_string())
                .stderr(Stdio::null())
                .status()
                .expect("kill(1) runs")
                .success()
        };
        let processes = self.processes();
        assert!(
            kill(processes[0]),
            "kill -{signal} of the postmaster failed"
        );
        for child in &processes[1..] {
            kill(*child);
        }
    }

    /// Freezes every process of the server: connections stay open, nothing answers.
    pub(crate) fn pause(&self) {
        self.signal("STOP");
    }

    /// Lets a paused server go on.
    pub(crate) fn resume(&self) {
        self.signal("CONT");
    }

    /// Kills every process of the server, as a crash would.
    pub(crate) fn kill(&mut self) {
        if self.child.is_some() {
            self.signal("KILL");
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.wait();
        }
        // Every backend was killed too; give the kernel a moment to reap them.
        std::thread::sleep(Duration::from_millis(100));
    }

    /// Starts it again on its data: crash recovery replays what was committed.
    pub(crate) fn restart(&mut self) {
        self.kill();
        // A killed postmaster leaves its pid file; PostgreSQL checks it is stale.
        self.spawn();
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The directory of `initdb` and `postgres`: `pg_config --bindir`, or the newest under
/// `/usr/lib/postgresql` (Debian's layout).
/// The parent of `pid`, from `/proc/PID/stat` (`pid (comm) state ppid ...`).
fn parent(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, after_comm) = stat.rsplit_once(')')?;
    after_comm.split_whitespace().nth(1)?.parse().ok()
}

fn binaries() -> Option<PathBuf> {
    let from_pg_config = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map(|out| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
    let debian = std::fs::read_dir("/usr/lib/postgresql")
        .ok()
        .and_then(|dirs| {
            let mut versions: Vec<PathBuf> =
                dirs.filter_map(|d| d.ok().map(|d| d.path())).collect();
            versions.sort_by_key(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .and_then(|n| n.parse::<u32>().ok())
                    .unwrap_or(0)
            });
            versions.pop().map(|p| p.join("bin"))
        });
    [from_pg_config, debian]
        .into_iter()
        .flatten()
        .find(|dir| has(dir, "initdb") && has(dir, "postgres"))
}

fn has(dir: &Path, program: &str) -> bool {
    dir.join(program).is_file()
}

fn running_as_root() -> bool {
    id("-u").is_some_and(|uid| uid == 0)
}

fn postgres_user() -> Option<(u32, u32)> {
    Some((id_of("-u")?, id_of("-g")?))
}

fn id_of(flag: &str) -> Option<u32> {
    let out = Command::new("id").args([flag, "postgres"]).output().ok()?;
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

fn id(flag: &str) -> Option<u32> {
    let out = Command::new("id").arg(flag).output().ok()?;
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}
