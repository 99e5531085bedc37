//! A real Redis Cluster per test: six `redis-server` processes in cluster mode on free
//! loopback ports (three primaries, each with one replica, a 1 s node timeout), joined
//! by `redis-cli --cluster create`; a primary killed (SIGKILL) so its replica is
//! promoted; every process killed and every directory removed on drop.

use std::{
    net::TcpListener,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant, SystemTime},
};

/// How long a node may stay silent before the others count it as failed: short, so a
/// failover takes a couple of seconds.
const NODE_TIMEOUT_MS: u64 = 1000;

struct ClusterNode {
    port: u16,
    child: Option<Child>,
}

/// Six nodes in one cluster.
pub struct RedisCluster {
    dir: PathBuf,
    nodes: Vec<ClusterNode>,
}

/// One line of `CLUSTER NODES`, as far as the tests need it.
#[derive(Debug, Clone)]
pub struct NodeInfo {
    pub id: String,
    pub port: u16,
    pub primary: bool,
    pub failed: bool,
    /// The slot ranges a primary serves.
    pub slots: Vec<(u16, u16)>,
}

impl RedisCluster {
    /// Starts and joins one, or returns `None` (after saying so loudly) when
    /// `redis-server` or `redis-cli` is not on `PATH` and this is not CI.
    pub fn start() -> Option<Self> {
        let found = ["redis-server", "redis-cli"].iter().all(|program| {
            Command::new(program)
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|status| status.success())
        });
        if !found {
            if std::env::var_os("CI").is_some() {
                panic!("redis-server or redis-cli is not on PATH, and CI is set: the cluster tests must run");
            }
            eprintln!(
                "SKIPPED: redis-server or redis-cli not on PATH; the cluster tests did not run"
            );
            return None;
        }
        let dir = std::env::temp_dir().join(format!(
            "tower-ids-redis-cluster-{}-{}",
            std::process::id(),
            SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let mut cluster = Self {
            dir,
            nodes: Vec::new(),
        };
        for _ in 0..6 {
            let node = cluster.spawn_node();
            cluster.nodes.push(node);
        }
        let addresses: Vec<String> = cluster
            .nodes
            .iter()
            .map(|node| format!("127.0.0.1:{}", node.port))
            .collect();
        let created = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addresses)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("redis-cli runs");
        assert!(created.success(), "redis-cli --cluster create failed");
        cluster.wait_until_ok();
        // Every primary's replica has its first copy: `WAIT` can be answered.
        for node in &cluster.nodes {
            wait_until(Duration::from_secs(30), || {
                cli(node.port, &["INFO", "replication"]).is_some_and(|info| {
                    info.contains("role:slave") && info.contains("master_link_status:up")
                        || info.contains("role:master")
                            && info.contains("connected_slaves:1")
                            && info.contains("state=online")
                })
            })
            .expect("every replica is in sync within 30 s");
        }
        Some(cluster)
    }

    /// One node on a free port, answering `PING`. A port can be taken between the probe
    /// and the bind (tests make clusters side by side): then another port.
    fn spawn_node(&self) -> ClusterNode {
        for _ in 0..10 {
            let port = free_port();
            let node_dir = self.dir.join(port.to_string());
            std::fs::create_dir_all(&node_dir).unwrap();
            let mut child = Command::new("redis-server")
                .arg("--port")
                .arg(port.to_string())
                .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                .args(["--cluster-enabled", "yes"])
                .args(["--cluster-config-file", "nodes.conf"])
                .arg("--cluster-node-timeout")
                .arg(NODE_TIMEOUT_MS.to_string())
                .arg("--dir")
                .arg(&node_dir)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server starts");
            let mut exited = false;
            let up = wait_until(Duration::from_secs(10), || {
                exited = child.try_wait().ok().flatten().is_some();
                exited || cli(port, &["PING"]).is_some_and(|reply| reply.trim() == "PONG")
            });
            if up.is_ok() && !exited {
                return ClusterNode {
                    port,
                    child: Some(child),
                };
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("no cluster node started in 10 tries");
    }

    /// The seed nodes' URLs, `redis://127.0.0.1:PORT`.
    pub fn urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|node| format!("redis://127.0.0.1:{}", node.port))
            .collect()
    }

    fn live_ports(&self) -> impl Iterator<Item = u16> + '_ {
        self.nodes
            .iter()
            .filter(|node| node.child.is_some())
            .map(|node| node.port)
    }

    /// Waits until every live node says the cluster is ok and every slot is served by a
    /// live primary.
    pub fn wait_until_ok(&self) {
        wait_until(Duration::from_secs(30), || {
            self.live_ports().all(|port| {
                cli(port, &["CLUSTER", "INFO"])
                    .is_some_and(|info| info.contains("cluster_state:ok"))
            }) && self.nodes_info().is_some_and(|nodes| {
                let served: u32 = nodes
                    .iter()
                    .filter(|node| node.primary && !node.failed)
                    .flat_map(|node| &node.slots)
                    .map(|(from, to)| u32::from(to - from) + 1)
                    .sum();
                served == 16384
            })
        })
        .expect("the cluster is ok within 30 s");
    }

    /// `CLUSTER NODES`, as a live node sees it.
    pub fn nodes_info(&self) -> Option<Vec<NodeInfo>> {
        let port = self.live_ports().next()?;
        let text = cli(port, &["CLUSTER", "NODES"])?;
        let mut nodes = Vec::new();
        for line in text.lines().filter(|line| !line.trim().is_empty()) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let address = fields.get(1)?;
            let port = address.split(['@', ':']).nth(1)?.parse().ok()?;
            let flags = fields.get(2)?;
            let slots = fields
                .iter()
                .skip(8)
                .filter(|field| !field.starts_with('['))
                .filter_map(|range| match range.split_once('-') {
                    Some((from, to)) => Some((from.parse().ok()?, to.parse().ok()?)),
                    None => range.parse().ok().map(|slot| (slot, slot)),
                })
                .collect();
            nodes.push(NodeInfo {
                id: fields.first()?.to_string(),
                port,
                primary: flags.contains("master"),
                failed: flags.contains("fail") && !flags.contains("fail?"),
                slots,
            });
        }
        Some(nodes)
    }

    /// The port of the live primary serving `slot`.
    pub fn primary_of(&self, slot: u16) -> Option<u16> {
        self.nodes_info()?
            .into_iter()
            .find(|node| {
                node.primary
                    && !node.failed
                    && node
                        .slots
                        .iter()
                        .any(|(from, to)| (*from..=*to).contains(&slot))
            })
            .map(|node| node.port)
    }

    /// The slot of `key`.
    pub fn slot_of(&self, key: &str) -> u16 {
        let port = self.live_ports().next().expect("a live node");
        cli(port, &["CLUSTER", "KEYSLOT", key])
            .and_then(|slot| slot.trim().parse().ok())
            .expect("CLUSTER KEYSLOT answers")
    }

    /// Every key on the live primaries that matches `pattern`.
    pub fn keys(&self, pattern: &str) -> Vec<String> {
        let primaries: Vec<u16> = self
            .nodes_info()
            .unwrap_or_default()
            .into_iter()
            .filter(|node| node.primary && !node.failed)
            .map(|node| node.port)
            .filter(|port| self.live_ports().any(|live| live == *port))
            .collect();
        primaries
            .into_iter()
            .flat_map(|port| {
                Command::new("redis-cli")
                    .arg("-p")
                    .arg(port.to_string())
                    .args(["--scan", "--pattern", pattern])
                    .output()
                    .ok()
                    .map(|output| String::from_utf8_lossy(&output.stdout).into_owned())
                    .unwrap_or_default()
                    .lines()
                    .map(str::to_owned)
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// Moves every slot of the primary on `from` to the primary on `to`, key by key
    /// (`redis-cli --cluster reshard`), while the cluster serves.
    pub fn move_all_slots(&self, from: u16, to: u16) {
        let nodes = self.nodes_info().expect("CLUSTER NODES answers");
        let node = |port| {
            nodes
                .iter()
                .find(|node| node.port == port)
                .expect("a node of this cluster")
        };
        let (from, to) = (node(from), node(to));
        let slots: u32 = from
            .slots
            .iter()
            .map(|(first, last)| u32::from(last - first) + 1)
            .sum();
        let moved = Command::new("redis-cli")
            .args(["--cluster", "reshard"])
            .arg(format!("127.0.0.1:{}", to.port))
            .args(["--cluster-from", &from.id, "--cluster-to", &to.id])
            .args(["--cluster-slots", &slots.to_string(), "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("redis-cli runs");
        assert!(moved.success(), "redis-cli --cluster reshard failed");
    }

    /// Kills the node on `port` (SIGKILL: its connections just drop).
    pub fn kill(&mut self, port: u16) {
        let node = self
            .nodes
            .iter_mut()
            .find(|node| node.port == port)
            .expect("a node of this cluster");
        if let Some(mut child) = node.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Waits until `slot` is served by a live primary other than `old`, and the cluster
    /// is ok; returns that primary's port and when it was first seen serving the slot.
    pub fn wait_for_failover(&self, slot: u16, old: u16) -> (u16, Instant) {
        let mut new = None;
        wait_until(Duration::from_secs(30), || {
            new = self.primary_of(slot).filter(|port| *port != old);
            new.is_some()
        })
        .expect("a replica is promoted within 30 s");
        let seen = Instant::now();
        self.wait_until_ok();
        (new.unwrap(), seen)
    }

    /// How many replicas the node on `port` has connected and online, as it says.
    pub fn online_replicas(&self, port: u16) -> usize {
        cli(port, &["INFO", "replication"])
            .map(|info| {
                info.lines()
                    .filter(|line| line.starts_with("slave") && line.contains("state=online"))
                    .count()
            })
            .unwrap_or(0)
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(mut child) = node.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `redis-cli -p PORT ARGS...`, its output, or `None` if it failed.
fn cli(port: u16, args: &[&str]) -> Option<String> {
    let output = Command::new("redis-cli")
        .arg("-p")
        .arg(port.to_string())
        .args(args)
        .stderr(Stdio::null())
        .output()
        .ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Polls `check` every 50 ms until it holds or `limit` has passed.
fn wait_until(limit: Duration, mut check: impl FnMut() -> bool) -> Result<(), ()> {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if check() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(())
}

fn free_port() -> u16 {
    // A cluster node also listens on its port + 10000 (the cluster bus).
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if port < 55000 && TcpListener::bind(("127.0.0.1", port + 10000)).is_ok() {
            return port;
        }
    }
}
