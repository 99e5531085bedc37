//! The RabbitMQ side: a vhost of the run's own (or unique queues in the URL's vhost),
//! removed after the run; the arguments that point the relays and one consumer per queue
//! at it; and the fault, every connection of the vhost closed by the broker.

use crate::{
    chaos::{Fault, Fleet},
    database::TestDatabase,
    rabbitmq::{self, rabbitmqctl},
    Trial, QUEUES,
};

/// A vhost of the run's own, deleted on drop.
struct Vhost(String);

impl Vhost {
    /// Creates one with `user` allowed everything, or says why it could not.
    fn create(user: &str) -> Result<Self, String> {
        let name = format!("tower-ids-outbox-proof-{}", uuid::Uuid::now_v7());
        rabbitmqctl(&["add_vhost", &name])?;
        let vhost = Self(name);
        rabbitmqctl(&["set_permissions", "-p", &vhost.0, user, ".*", ".*", ".*"])?;
        Ok(vhost)
    }
}

impl Drop for Vhost {
    fn drop(&mut self) {
        if let Err(error) = rabbitmqctl(&["delete_vhost", &self.0]) {
            eprintln!("could not delete the vhost {}: {error}", self.0);
        }
    }
}

/// Deletes the run's queues on drop, when it has no vhost of its own.
struct Queues(Vec<String>);

impl Drop for Queues {
    fn drop(&mut self) {
        if self.0.is_empty() {
            return;
        }
        let names = std::mem::take(&mut self.0);
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                if let Some(connection) = rabbitmq::connect().await {
                    if let Ok(channel) = connection.create_channel().await {
                        for name in names {
                            let _ = channel
                                .queue_delete(name.as_str().into(), Default::default())
                                .await;
                        }
                    }
                    let _ = connection.close(200, "done".into()).await;
                }
            });
        })
        .join();
    }
}

/// What a RabbitMQ trial owns on the broker until it ends, removed on drop (the vhost
/// first).
pub(crate) struct Cleanup {
    _vhost: Option<Vhost>,
    _queues: Queues,
}

/// The RabbitMQ trial: two databases, a vhost (or queue names) of its own, [`QUEUES`]
/// queues each with one consumer at a prefetch of 1, and the connections closed as its
/// fault. `None` without RabbitMQ or PostgreSQL (said loudly; under CI they fail).
pub(crate) async fn trial() -> Option<(Trial, Cleanup)> {
    let connection = rabbitmq::connect().await?;
    let _ = connection.close(200, "found".into()).await;
    let (Some(sender), Some(consumer)) =
        (TestDatabase::create().await, TestDatabase::create().await)
    else {
        return None;
    };
    let base = rabbitmq::url();
    let user = base
        .split_once("://")
        .and_then(|(_, rest)| rest.split([':', '@']).next())
        .unwrap_or("guest")
        .to_owned();
    // A vhost of the run's own; else unique queues in the URL's vhost.
    let (vhost, url, fault) = match Vhost::create(&user) {
        Ok(vhost) => {
            let (server, _) = base.rsplit_once('/').unwrap();
            let url = format!("{server}/{}", vhost.0);
            let fault = Fault::CloseConnections {
                vhost: Some(vhost.0.clone()),
            };
            (Some(vhost), url, fault)
        }
        Err(why) => {
            let fault = if rabbitmqctl(&["status"]).is_ok() {
                Fault::CloseConnections { vhost: None }
            } else {
                assert!(
                    std::env::var_os("CI").is_none(),
                    "no rabbitmqctl ({why}), and CI is set: the connections must be closed"
                );
                eprintln!("SKIPPED (in part): no rabbitmqctl ({why}); the run's connections will not be closed");
                Fault::None
            };
            (None, base.clone(), fault)
        }
    };
    let prefix = format!("outbox-proof.{}", uuid::Uuid::now_v7());
    let queues: Vec<String> = (0..QUEUES).map(|n| format!("{prefix}.{n}")).collect();
    let own_queues = Queues(if vhost.is_some() {
        Vec::new()
    } else {
        queues.clone()
    });
    let outbox: Vec<String> = [
        "--broker",
        "amqp",
        "--amqp-url",
        &url,
        "--queue-prefix",
        &prefix,
        "--queues",
        &QUEUES.to_string(),
    ]
    .map(str::to_owned)
    .into();
    let mut relay = outbox.clone();
    relay.extend(
        [
            "--log-format",
            "json",
            "--database-url",
            sender.url(),
            "relay",
        ]
        .map(str::to_owned),
    );
    let consumers = queues
        .iter()
        .map(|queue| {
            [
                "--broker",
                "amqp",
                "--amqp-url",
                &url,
                "--queue",
                queue,
                "--prefetch",
                "1",
                "--log-format",
                "json",
                "consume",
                "--database-url",
                consumer.url(),
                "--in-flight-retry-ms",
                "100",
            ]
            .map(str::to_owned)
            .into()
        })
        .collect();
    let trial = Trial {
        broker: "RabbitMQ",
        outbox,
        fleet: Fleet {
            relay,
            consumers,
            fault,
        },
        sender,
        consumer,
    };
    let cleanup = Cleanup {
        _vhost: vhost,
        _queues: own_queues,
    };
    Some((trial, cleanup))
}

/// Closes every connection of `vhost` (of the broker without one) with
/// `rabbitmqctl close_all_connections`; says how many it closed.
pub(crate) fn close_connections(vhost: Option<&str>) -> String {
    let mut args = vec!["close_all_connections"];
    if let Some(vhost) = vhost {
        args.extend(["-p", vhost]);
    }
    args.push("tower-ids outbox proof: connections closed on purpose");
    let output = rabbitmqctl(&args).expect("rabbitmqctl close_all_connections");
    // "Closed 6 connections"
    let closed = output
        .lines()
        .find_map(|line| line.strip_prefix("Closed "))
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or("?")
        .to_owned();
    format!("RabbitMQ closed {closed} connections of the run (rabbitmqctl close_all_connections)")
}
