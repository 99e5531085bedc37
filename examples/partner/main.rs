//! A warehouse partner contract you can run: a planner that partners (executors) call,
//! and an executor that receives the planner's dispatch. The walkthrough, with commands
//! to paste, is in this directory's `README.md`.
//!
//! | Surface | Key | Retention | A replay |
//! |---|---|---|---|
//! | realtime calls (executor to planner), `POST /wes/v1/realtime` | (partner, `correlation_id`) from the body | 30 days | `200` with `"replay": true`, no second movement |
//! | confirmations (executor to planner), `POST /wes/v1/confirmations` | (partner, `correlation_id`); one confirmation per window key | 30 days | same |
//! | webhook dispatch (planner to executor, one at a time per warehouse), `POST /wes/v1/webhooks/dispatch` on the executor | (`planner_id`, `correlation_id`) | 24 hours | same |
//! | poll-mode acks, `POST /wes/v1/dispatch/ack` | (executor, cursor) | - | an earlier or equal cursor is a no-op: cursors are monotone |
//!
//! `cargo run --all-features --example partner` runs the planner; `cargo run --all-features --example partner --
//! executor --planner-url ...` the executor. Both keep their state in memory, or with
//! `--database-url` in PostgreSQL (tables created at start). Ctrl-C or SIGTERM stops
//! either gracefully (see [`serve`]).

#[path = "../support/database.rs"]
mod database;
mod db;
mod executor;
#[path = "../support/http1.rs"]
mod http1;
#[cfg(feature = "kafka")]
mod kafka;
mod planner;
mod problem;
#[path = "../support/shutdown.rs"]
mod shutdown;
mod webhooks;

use std::{net::SocketAddr, time::Duration};

use clap::{Parser, Subcommand, ValueEnum};
use tokio::{net::TcpListener, sync::watch};

#[derive(Parser, Debug)]
#[command(about = "A planner (by default) or an executor speaking the warehouse partner contract")]
struct Args {
    #[command(subcommand)]
    role: Option<Role>,
    #[command(flatten)]
    common: Common,
    #[command(flatten)]
    planner: planner::Options,
}

#[derive(clap::Args, Debug, Clone)]
struct Common {
    /// Address to bind; port 0 picks a free one.
    #[arg(long, default_value = "127.0.0.1:3000", global = true)]
    addr: SocketAddr,
    /// `pretty` or `json` (one object per line).
    #[arg(long, value_enum, default_value = "pretty", global = true)]
    log_format: LogFormat,
    /// Keep everything in this PostgreSQL database instead of in memory.
    #[arg(long, global = true)]
    database_url: Option<String>,
    #[command(flatten)]
    timeouts: http1::Timeouts,
    #[command(flatten)]
    drain: shutdown::DrainArgs,
}

#[derive(Copy, Clone, Debug, ValueEnum)]
enum LogFormat {
    Pretty,
    Json,
}

#[derive(Subcommand, Debug)]
enum Role {
    /// The executor: webhooks from the planner, and the dispatch feed polled.
    Executor(executor::Options),
}

/// Seconds, for retention flags.
pub(crate) fn seconds(text: &str) -> Result<Duration, String> {
    text.parse::<u64>()
        .map(Duration::from_secs)
        .map_err(|error| format!("{text}: {error}"))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let args = Args::parse();
    init_tracing(args.common.log_format);
    let listener = TcpListener::bind(args.common.addr).await?;
    let url = format!("http://{}", listener.local_addr()?);
    let (stop, stopping) = watch::channel(false);
    tokio::spawn(async move {
        let signal = shutdown::signal().await;
        tracing::info!(event = "partner.shutting_down", signal, "shutting down");
        let _ = stop.send(true);
    });
    let served = match args.role {
        Some(Role::Executor(options)) => {
            executor::run(options, args.common, listener, url, stopping).await
        }
        None => planner::run(args.planner, args.common, listener, url, stopping).await,
    };
    tracing::info!(event = "partner.stopped", "stopped");
    served
}

fn init_tracing(format: LogFormat) {
    use tracing_subscriber::{filter::LevelFilter, EnvFilter};
    let filter = EnvFilter::builder()
        .with_default_directive(LevelFilter::INFO.into())
        .from_env_lossy();
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    match format {
        LogFormat::Pretty => builder.init(),
        LogFormat::Json => builder
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .init(),
    }
}

/// The token of `Authorization: Bearer TOKEN`, if the request sent one.
pub(crate) fn bearer(request: &axum::extract::Request) -> Option<&str> {
    request
        .headers()
        .get(http::header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
}

/// Set once, on Ctrl-C or SIGTERM: every part of the service stops taking work.
pub(crate) type Stopping = watch::Receiver<bool>;

/// Resolves once a stop is asked for.
pub(crate) async fn stop_asked(mut stopping: Stopping) {
    // An error is the sender gone, which only a stop does.
    let _ = stopping.wait_for(|stop| *stop).await;
}

/// Serves `app` on `listener` until a stop is asked for; then stops accepting and lets
/// the requests in flight finish, each bounded by the examples' header- and body-read
/// timeouts ([`http1::serve`]). The caller then waits for its idempotency layers
/// ([`shutdown::drain`]).
pub(crate) async fn serve(
    listener: TcpListener,
    url: &str,
    app: axum::Router,
    timeouts: http1::Timeouts,
    stopping: Stopping,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    tracing::info!("listening on {url}");
    http1::serve(listener, app, timeouts, stop_asked(stopping)).await;
    Ok(())
}
