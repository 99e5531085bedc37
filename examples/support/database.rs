//! An example's PostgreSQL database at start, shared by the examples that take
//! `--database-url` (`commands`, `partner`): connected within [`START_TIMEOUT`], or the
//! process exits saying where it could not connect and why.
//!
//! sqlx's pool alone retries a refused connection until its acquire timeout (30 s by
//! default) and then reports only `PoolTimedOut`, with neither the address nor the
//! cause. So one connection is opened first, on its own, for the cause; then the pool.

use std::{fmt, time::Duration};

use sqlx::{
    postgres::{PgConnectOptions, PgPoolOptions},
    Connection, PgConnection, PgPool,
};

/// How long an example waits for its database at start: 3 s. A database that answers
/// at all opens a connection (TCP, TLS, authentication: a few round trips) within
/// milliseconds on one network and well under a second across regions; 3 s leaves
/// room for a slow name lookup, and a wrong host or port is reported while whoever
/// started the example is still looking at it.
pub(crate) const START_TIMEOUT: Duration = Duration::from_secs(3);

/// Connects a pool with `pool`'s settings to `url`, or fails within [`START_TIMEOUT`]
/// with an error that names the host and port (never the password).
pub(crate) async fn connect(pool: PgPoolOptions, url: &str) -> Result<PgPool, Unreachable> {
    let options: PgConnectOptions = url.parse().map_err(|error| {
        Unreachable(format!("the database URL is not a PostgreSQL URL: {error}"))
    })?;
    let failed = |cause: &dyn fmt::Display| {
        Unreachable(format!(
            "cannot connect to PostgreSQL at {}: {cause}",
            target(&options)
        ))
    };
    let connected = async {
        PgConnection::connect_with(&options).await?.close().await?;
        pool.connect_with(options.clone()).await
    };
    match tokio::time::timeout(START_TIMEOUT, connected).await {
        Ok(Ok(pool)) => Ok(pool),
        Ok(Err(error)) => Err(failed(&error)),
        Err(_) => Err(failed(&format_args!(
            "no answer within {} s",
            START_TIMEOUT.as_secs()
        ))),
    }
}

/// `host:port/database`, or the socket's path for a Unix socket.
fn target(options: &PgConnectOptions) -> String {
    let address = match options.get_socket() {
        Some(socket) => format!("{}", socket.display()),
        None if options.get_host().contains(':') => {
            format!("[{}]:{}", options.get_host(), options.get_port())
        }
        None => format!("{}:{}", options.get_host(), options.get_port()),
    };
    match options.get_database() {
        Some(database) => format!("{address}/{database}"),
        None => address,
    }
}

/// The database could not be reached at start: where, and why. Its `Debug` is its
/// sentence, so that `main`'s `Error: ...` line reads as one.
pub(crate) struct Unreachable(String);

impl fmt::Display for Unreachable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Unreachable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Unreachable {}
