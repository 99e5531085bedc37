//! A throwaway PostgreSQL server of the test's own, to break on purpose: a cluster made
//! with `initdb` in a temporary directory, started on a free loopback port in a process
//! group of its own, so the whole server (postmaster and backends) can be paused
//! (SIGSTOP), resumed (SIGCONT), or killed (SIGKILL) and restarted (crash recovery).
//! A primary for streaming replication, a standby copied from it (`pg_basebackup`),
//! and the standby's promotion, for failovers.

use std::{
    io::Write,
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant, SystemTime},
};

pub struct PostgresServer {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    /// The uid and gid to run as: `postgres` when the tests run as root (PostgreSQL
    /// refuses root), else our own.
    user: Option<(u32, u32)>,
    /// `name=value` settings given with `-c` at every start, beside the defaults.
    settings: Vec<String>,
    child: Option<Child>,
}

impl PostgresServer {
    /// Makes and starts one, or returns `None` (after saying so loudly) when the
    /// PostgreSQL server binaries are not installed and this is not CI.
    pub fn start() -> Option<Self> {
        let mut server = Self::initdb(Vec::new())?;
        server.spawn();
        Some(server)
    }

    /// A primary for streaming replication: WAL for a standby (`wal_level = replica`,
    /// WAL senders) and replication connections from 127.0.0.1 trusted; `synchronous`,
    /// every commit also waits until a standby has flushed it
    /// (`synchronous_standby_names = '*'`, `synchronous_commit = on`). The settings are
    /// given on the command line, not in the configuration files a standby copies: a
    /// standby promoted commits alone. `None` as [`start`](Self::start).
    pub fn primary(synchronous: bool) -> Option<Self> {
        let mut settings = vec!["wal_level=replica", "max_wal_senders=4"];
        if synchronous {
            settings.extend(["synchronous_standby_names=*", "synchronous_commit=on"]);
        }
        let mut server = Self::initdb(settings.into_iter().map(str::to_owned).collect())?;
        let hba = server.data().join("pg_hba.conf");
        let rules = std::fs::read_to_string(&hba).expect("initdb writes pg_hba.conf");
        let replication = "host replication all 127.0.0.1/32 trust";
        if !rules
            .lines()
            .any(|rule| rule.split_whitespace().eq(replication.split(' ')))
        {
            let mut file = std::fs::OpenOptions::new().append(true).open(&hba).unwrap();
            writeln!(file, "{replication}").unwrap();
        }
        server.spawn();
        Some(server)
    }

    /// A hot standby of this server, copied with `pg_basebackup -R` through `link`, a
    /// port that leads to this server (a proxy the test can cut): the copy's
    /// `primary_conninfo` names that port, so it streams through the link. Started on a
    /// port of its own.
    pub fn standby(&self, link: u16) -> Self {
        let mut standby = Self::new(self.bin.clone(), Vec::new());
        let copied = standby
            .command("pg_basebackup")
            .args(["-R", "-X", "stream", "-c", "fast", "--no-sync", "-D"])
            .arg(standby.data())
            .args(["-h", "127.0.0.1", "-U", "postgres", "-p"])
            .arg(link.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("pg_basebackup runs");
        assert!(copied.success(), "pg_basebackup failed");
        standby.spawn();
        standby
    }

    /// Promotes this standby (`pg_ctl promote`), waiting until it has left recovery.
    pub fn promote(&self) {
        let promoted = self
            .command("pg_ctl")
            .args(["promote", "-w", "-t", "30", "-D"])
            .arg(self.data())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("pg_ctl runs");
        assert!(promoted.success(), "pg_ctl promote failed");
    }

    /// The port it listens on, on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A cluster made with `initdb`, not started; `None` as [`start`](Self::start).
    fn initdb(settings: Vec<String>) -> Option<Self> {
        let Some(bin) = binaries() else {
            if std::env::var_os("CI").is_some() {
                panic!("no PostgreSQL server binaries (initdb, postgres), and CI is set");
            }
            eprintln!("SKIPPED: no PostgreSQL server binaries (initdb); these tests did not run");
            return None;
        };
        let server = Self::new(bin, settings);
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
        Some(server)
    }

    /// A server with no data yet: a free port, and an empty temporary directory that
    /// the server's user owns.
    fn new(bin: PathBuf, settings: Vec<String>) -> Self {
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
        if let Some((uid, gid)) = user {
            let owner = format!("{uid}:{gid}");
            let chown = Command::new("chown").arg(&owner).arg(&dir).status();
            assert!(chown.is_ok_and(|s| s.success()), "chown {owner}");
        }
        Self {
            bin,
            dir,
            port,
            user,
            settings,
            child: None,
        }
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
    pub fn url(&self) -> String {
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
            .args(self.settings.iter().flat_map(|setting| ["-c", setting]))
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
        // One kill(1) for them all, microseconds apart: a child that outlived the
        // postmaster by the milliseconds a kill(1) each takes would notice its death
        // and exit in order (a backend aborting its transaction in the WAL), which a
        // crash does not do.
        let processes = self.processes();
        let killed = Command::new("kill")
            .arg(format!("-{signal}"))
            .args(processes.iter().map(u32::to_string))
            .output()
            .expect("kill(1) runs");
        let postmaster = processes[0].to_string();
        let errors = String::from_utf8_lossy(&killed.stderr);
        assert!(
            !errors.lines().any(|line| line.contains(&postmaster)),
            "kill -{signal} of the postmaster failed: {errors}"
        );
    }

    /// Freezes every process of the server: connections stay open, nothing answers.
    pub fn pause(&self) {
        self.signal("STOP");
    }

    /// Lets a paused server go on.
    pub fn resume(&self) {
        self.signal("CONT");
    }

    /// Kills every process of the server, as a crash would.
    pub fn kill(&mut self) {
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
    pub fn restart(&mut self) {
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
