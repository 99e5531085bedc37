//! RabbitMQ for the tests that publish or consume over AMQP: its URL and a connection,
//! or a loud `SKIPPED` when none answers (a failure under CI).
#![allow(dead_code, unreachable_pub)]

use std::time::Duration;

use lapin::{Connection, ConnectionProperties};

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
