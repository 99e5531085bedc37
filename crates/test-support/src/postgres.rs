//! A database of its own for each test, on the PostgreSQL server the tests are pointed
//! at, dropped when the test ends.

use std::time::{Duration, SystemTime};

use sqlx::{postgres::PgPoolOptions, Connection, PgConnection, PgPool};

/// Where the server is: `TOWER_IDS_POSTGRES_URL`, or the local default.
fn server_url() -> String {
    std::env::var("TOWER_IDS_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

/// A throwaway database, dropped (with its connections) on drop.
pub struct TestDatabase {
    name: String,
    url: String,
}

impl TestDatabase {
    /// Creates one, or returns `None` (after saying so loudly) when no server answers
    /// and this is not CI.
    pub async fn create() -> Option<Self> {
        let server = server_url();
        let mut admin = match tokio::time::timeout(
            Duration::from_secs(5),
            PgConnection::connect(&server),
        )
        .await
        {
            Ok(Ok(connection)) => connection,
            failed => {
                let why = match failed {
                    Ok(Err(error)) => error.to_string(),
                    _ => "timed out".to_owned(),
                };
                if std::env::var_os("CI").is_some() {
                    panic!(
                        "no PostgreSQL at {server} ({why}), and CI is set: these tests must run"
                    );
                }
                eprintln!("SKIPPED: no PostgreSQL at {server} ({why}); set TOWER_IDS_POSTGRES_URL. These tests did not run");
                return None;
            }
        };
        // The clock alone can give two tests of one process the same name: a counter
        // tells them apart.
        static CREATED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let name = format!(
            "tower_ids_test_{}_{}_{}",
            std::process::id(),
            CREATED.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        );
        sqlx::raw_sql(&format!("CREATE DATABASE {name}"))
            .execute(&mut admin)
            .await
            .expect("CREATE DATABASE");
        let url = match server.rsplit_once('/') {
            Some((base, _)) => format!("{base}/{name}"),
            None => format!("{server}/{name}"),
        };
        Some(Self { name, url })
    }

    /// The database's URL, for a process of its own (`tests/examples/commands_crash.rs`).
    #[allow(dead_code)]
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A pool on the database.
    pub async fn pool(&self, connections: u32) -> PgPool {
        PgPoolOptions::new()
            .max_connections(connections)
            .acquire_timeout(Duration::from_secs(5))
            .connect(&self.url)
            .await
            .expect("the test database accepts connections")
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let name = self.name.clone();
        // Dropped inside a runtime that may be shutting down: a thread of its own.
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                if let Ok(mut admin) = PgConnection::connect(&server_url()).await {
                    let _ = sqlx::raw_sql(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                        .execute(&mut admin)
                        .await;
                }
            });
        })
        .join();
    }
}
