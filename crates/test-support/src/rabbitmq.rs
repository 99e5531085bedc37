//! RabbitMQ for the tests that publish or consume over AMQP: its URL and a connection,
//! or a loud `SKIPPED` when none answers (a failure under CI).

use std::time::Duration;

use lapin::{
    options::{BasicConsumeOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions},
    types::FieldTable,
    Channel, Connection, ConnectionProperties, Consumer, ExchangeKind,
};

/// `AMQP_URL`, or the local RabbitMQ as guest.
pub fn url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

/// A connection to the broker, or `None` (said loudly) when none answers and this is
/// not CI.
pub async fn connect() -> Option<Connection> {
    let connected = tokio::time::timeout(
        Duration::from_secs(5),
        Connection::connect(&url(), ConnectionProperties::default()),
    )
    .await;
    match connected {
        Ok(Ok(connection)) => Some(connection),
        failed => {
            let why = match failed {
                Ok(Err(error)) => error.to_string(),
                _ => "timed out".to_owned(),
            };
            assert!(
                std::env::var_os("CI").is_none(),
                "no RabbitMQ at {} ({why}), and CI is set: the AMQP tests must run",
                url()
            );
            eprintln!(
                "SKIPPED: no RabbitMQ at {} ({why}); start one (rabbitmq-server -detached) or set AMQP_URL; this test did not run",
                url()
            );
            None
        }
    }
}

/// A server-named queue that goes with `channel`'s connection (exclusive, deleted when
/// it closes): its name.
pub async fn exclusive_queue(channel: &Channel) -> String {
    let options = QueueDeclareOptions {
        exclusive: true,
        auto_delete: true,
        ..QueueDeclareOptions::default()
    };
    let queue = channel
        .queue_declare("".into(), options, FieldTable::default())
        .await
        .unwrap();
    queue.name().as_str().to_owned()
}

/// A consumer of `queue` that acknowledges nothing (the broker forgets each delivery
/// as it sends it).
pub async fn no_ack_consumer(channel: &Channel, queue: &str) -> Consumer {
    let options = BasicConsumeOptions {
        no_ack: true,
        ..BasicConsumeOptions::default()
    };
    channel
        .basic_consume(queue.into(), "".into(), options, FieldTable::default())
        .await
        .unwrap()
}

/// The durable topic exchange `exchange` (as the examples declare theirs), and a
/// consumer of an exclusive queue bound to it by `binding`: every message it routes
/// there from now on, in the order published.
pub async fn topic_consumer(channel: &Channel, exchange: &str, binding: &str) -> Consumer {
    let options = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    channel
        .exchange_declare(
            exchange.into(),
            ExchangeKind::Topic,
            options,
            FieldTable::default(),
        )
        .await
        .unwrap();
    let queue = exclusive_queue(channel).await;
    channel
        .queue_bind(
            queue.as_str().into(),
            exchange.into(),
            binding.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    no_ack_consumer(channel, &queue).await
}

/// A vhost of the test's own (`rabbitmqctl add_vhost`, the URL's user allowed
/// everything), deleted on drop.
pub struct Vhost {
    pub name: String,
    /// The URL of the vhost.
    pub url: String,
}

impl Vhost {
    /// Makes one, or `None` (said loudly; a failure under CI) when no RabbitMQ answers
    /// or `rabbitmqctl` cannot make it.
    pub async fn create(prefix: &str) -> Option<Self> {
        let connection = connect().await?;
        let _ = connection.close(200, "found".into()).await;
        let base = url();
        let user = base
            .split_once("://")
            .and_then(|(_, rest)| rest.split([':', '@']).next())
            .unwrap_or("guest")
            .to_owned();
        let name = format!("tower-ids-{prefix}-{}", uuid::Uuid::now_v7());
        let made = rabbitmqctl(&["add_vhost", &name])
            .and_then(|_| rabbitmqctl(&["set_permissions", "-p", &name, &user, ".*", ".*", ".*"]));
        if let Err(error) = made {
            assert!(
                std::env::var_os("CI").is_none(),
                "rabbitmqctl could not make a vhost ({error}), and CI is set"
            );
            eprintln!(
                "SKIPPED: rabbitmqctl could not make a vhost ({error}); this test did not run"
            );
            return None;
        }
        let (server, _) = base.rsplit_once('/').expect("an AMQP URL with a vhost");
        Some(Self {
            url: format!("{server}/{name}"),
            name,
        })
    }

    /// Closes every connection to the vhost, as a broker restart or a network cut does.
    pub fn close_all_connections(&self) {
        rabbitmqctl(&[
            "close_all_connections",
            "-p",
            &self.name,
            "closed by the test",
        ])
        .expect("rabbitmqctl close_all_connections");
    }
}

impl Drop for Vhost {
    fn drop(&mut self) {
        if let Err(error) = rabbitmqctl(&["delete_vhost", &self.name]) {
            eprintln!("could not delete the vhost {}: {error}", self.name);
        }
    }
}

/// Runs `rabbitmqctl ARGS` on this machine: its stdout, or why it failed (no
/// `rabbitmqctl`, or the arguments and everything it printed). The one place the tests
/// start `rabbitmqctl`.
pub fn rabbitmqctl(args: &[&str]) -> Result<String, String> {
    let output = std::process::Command::new("rabbitmqctl")
        .args(args)
        .output()
        .map_err(|e| format!("rabbitmqctl: {e}"))?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(format!(
            "rabbitmqctl {args:?}: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}
