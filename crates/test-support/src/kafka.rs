//! A real Kafka-protocol broker per test: Tansu (`TANSU_BIN`), memory storage, on a free
//! loopback port, killed on drop. `.ci/run` installs it; without it the tests print
//! `SKIPPED`, except under CI, where they fail.

use std::{
    net::{TcpListener, TcpStream},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

pub struct Broker {
    child: Child,
    /// `127.0.0.1:PORT`, for `bootstrap.servers`.
    pub addr: String,
}

impl Broker {
    /// Starts one, or returns `None` (after saying so loudly) when `TANSU_BIN` is unset
    /// and this is not CI.
    pub fn start() -> Option<Broker> {
        let Some(bin) = std::env::var_os("TANSU_BIN") else {
            if std::env::var_os("CI").is_some() {
                panic!(
                    "TANSU_BIN is not set, and CI is set: the Kafka tests must run (see .ci/run)"
                );
            }
            eprintln!("SKIPPED: TANSU_BIN is not set (a Tansu broker binary); the Kafka tests did not run");
            return None;
        };
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let url = format!("tcp://127.0.0.1:{port}");
        let child = Command::new(bin)
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &url,
            ])
            .args(["--storage-engine", "memory://tansu/"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("TANSU_BIN runs");
        let addr = format!("127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(&addr).is_err() {
            assert!(Instant::now() < deadline, "tansu did not listen on {addr}");
            std::thread::sleep(Duration::from_millis(10));
        }
        Some(Broker { child, addr })
    }

    /// A topic of its own, `{prefix}-{uuid}`, with `partitions` (one replica).
    pub async fn topic(&self, prefix: &str, partitions: i32) -> String {
        use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
        let topic = format!("{prefix}-{}", uuid::Uuid::now_v7().simple());
        let admin: AdminClient<_> = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &self.addr)
            .create()
            .unwrap();
        let new = NewTopic::new(&topic, partitions, TopicReplication::Fixed(1));
        for created in admin
            .create_topics([&new], &AdminOptions::new())
            .await
            .unwrap()
        {
            created.unwrap();
        }
        topic
    }

    /// The broker's process ID, to pause it (SIGSTOP) and resume it.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
