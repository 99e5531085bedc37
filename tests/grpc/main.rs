//! `GrpcIdempotencyLayer` through a real tonic server and a real tonic client on
//! loopback: a unary call retried runs once and replays with its metadata; concurrent
//! duplicates run once; a key reused with another message, a bad key, streaming calls
//! and a store that stops answering get the statuses the module's table promises, and
//! the handler's executions are counted each time.

#[allow(clippy::all, clippy::pedantic, missing_docs, unreachable_pub)]
mod ledger {
    include!("ledger.v1.rs");
}

use tower_ids_test_support as support;
use tower_ids_test_support::postgres as database;
use tower_ids_test_support::redis as server;

use std::{
    net::SocketAddr,
    pin::Pin,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use ledger::{
    ledger_client::LedgerClient,
    ledger_server::{Ledger, LedgerServer},
    TransferReply, TransferRequest,
};
use tokio::net::TcpListener;
use tonic::{
    codegen::tokio_stream::{self, Stream},
    metadata::MetadataMap,
    transport::{Channel, Server},
    Code, Request, Response, Status,
};
use tonic_types::StatusExt as _;
use tower_ids::{
    correlation::{CorrelationId, CorrelationLayer},
    idempotency::{
        grpc::{GrpcIdempotencyLayer, ERROR_DOMAIN},
        store::{PostgresMode, PostgresStore, RedisStore, Transaction},
        IdempotencyLayer, IdempotencyStore,
    },
};

/// A ledger that counts the transfers it made and answers each with a fresh ID.
#[derive(Clone, Default)]
struct CountingLedger {
    runs: Arc<AtomicUsize>,
    /// How long each transfer takes.
    delay: Duration,
    /// The status a transfer answers after its side effect, if any.
    fail_with: Option<Code>,
    /// The correlation IDs the transfers ran under.
    seen: Arc<std::sync::Mutex<Vec<String>>>,
}

#[tonic::async_trait]
impl Ledger for CountingLedger {
    async fn transfer(
        &self,
        request: Request<TransferRequest>,
    ) -> Result<Response<TransferReply>, Status> {
        let run = self.runs.fetch_add(1, Ordering::SeqCst) + 1;
        if let Some(id) = CorrelationId::current() {
            self.seen.lock().unwrap().push(id.as_str().to_owned());
        }
        tokio::time::sleep(self.delay).await;
        if let Some(code) = self.fail_with {
            return Err(Status::new(code, format!("transfer {run} failed")));
        }
        let message = request.into_inner();
        let mut response = Response::new(TransferReply {
            transfer_id: format!("t-{run}-{}", uuid::Uuid::now_v7()),
            cents: message.cents,
        });
        response
            .metadata_mut()
            .insert("x-ledger-run", run.to_string().parse().unwrap());
        Ok(response)
    }

    async fn transfer_many(
        &self,
        request: Request<tonic::Streaming<TransferRequest>>,
    ) -> Result<Response<TransferReply>, Status> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        let mut stream = request.into_inner();
        let mut cents = 0;
        while let Some(message) = stream.message().await? {
            cents += message.cents;
        }
        Ok(Response::new(TransferReply {
            transfer_id: "many".into(),
            cents,
        }))
    }

    type WatchStream = Pin<Box<dyn Stream<Item = Result<TransferReply, Status>> + Send>>;

    async fn watch(
        &self,
        request: Request<TransferRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let run = self.runs.fetch_add(1, Ordering::SeqCst) + 1;
        let cents = request.into_inner().cents;
        let replies = (0..3).map(move |i| {
            Ok(TransferReply {
                transfer_id: format!("watch-{run}-{i}"),
                cents,
            })
        });
        Ok(Response::new(Box::pin(tokio_stream::iter(replies))))
    }
}

/// Serves `ledger` behind the correlation layer and `layer` on a free loopback port.
async fn serve<St: IdempotencyStore>(
    ledger: CountingLedger,
    layer: GrpcIdempotencyLayer<St>,
) -> LedgerClient<Channel> {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    tokio::spawn(
        Server::builder()
            .layer(CorrelationLayer::new())
            .layer(layer)
            .add_service(LedgerServer::new(ledger))
            .serve_with_incoming(incoming),
    );
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    LedgerClient::new(channel)
}

fn transfer(key: Option<&str>, cents: i64) -> Request<TransferRequest> {
    let mut request = Request::new(TransferRequest {
        from: "acct-1".into(),
        to: "acct-2".into(),
        cents,
    });
    if let Some(key) = key {
        request
            .metadata_mut()
            .insert("idempotency-key", key.parse().unwrap());
    }
    request
}

fn meta<'a>(metadata: &'a MetadataMap, name: &str) -> Option<&'a str> {
    metadata.get(name).map(|v| v.to_str().unwrap())
}

/// The status's `ErrorInfo` reason, after checking its domain.
fn reason(status: &Status) -> String {
    let info = status
        .get_details_error_info()
        .unwrap_or_else(|| panic!("no ErrorInfo in {status:?}"));
    assert_eq!(info.domain, ERROR_DOMAIN);
    info.reason
}

#[tokio::test]
async fn a_retried_unary_call_runs_once_and_replays_its_message_and_metadata() {
    let ledger = CountingLedger::default();
    let mut client = serve(ledger.clone(), IdempotencyLayer::new_for_grpc()).await;

    let first = client.transfer(transfer(Some("k-1"), 500)).await.unwrap();
    let retry = client.transfer(transfer(Some("k-1"), 500)).await.unwrap();

    assert_eq!(
        ledger.runs.load(Ordering::SeqCst),
        1,
        "the handler ran once"
    );
    assert_eq!(first.get_ref(), retry.get_ref(), "the same message");
    assert_eq!(meta(first.metadata(), "idempotent-replayed"), Some("false"));
    assert_eq!(meta(retry.metadata(), "idempotent-replayed"), Some("true"));
    // The handler's own metadata is replayed; the per-attempt correlation ID is not.
    assert_eq!(meta(retry.metadata(), "x-ledger-run"), Some("1"));
    let first_id = meta(first.metadata(), "x-correlation-id").unwrap();
    let retry_id = meta(retry.metadata(), "x-correlation-id").unwrap();
    assert_ne!(
        first_id, retry_id,
        "each attempt has its own correlation ID"
    );
    assert_eq!(
        meta(retry.metadata(), "original-attempt-id"),
        Some(first_id)
    );
    assert_eq!(
        meta(retry.metadata(), "idempotency-request-count"),
        Some("2")
    );
    assert_eq!(meta(retry.metadata(), "idempotency-key"), Some("k-1"));

    // Another key is another action.
    client.transfer(transfer(Some("k-2"), 500)).await.unwrap();
    assert_eq!(ledger.runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn ten_concurrent_duplicates_run_once() {
    let ledger = CountingLedger {
        delay: Duration::from_millis(300),
        ..CountingLedger::default()
    };
    let client = serve(ledger.clone(), IdempotencyLayer::new_for_grpc()).await;

    let calls: Vec<_> = (0..10)
        .map(|_| {
            let mut client = client.clone();
            tokio::spawn(async move { client.transfer(transfer(Some("k-c"), 700)).await })
        })
        .collect();
    let mut ok = Vec::new();
    for call in calls {
        match call.await.unwrap() {
            Ok(reply) => ok.push(reply.into_inner()),
            Err(status) => {
                assert_eq!(status.code(), Code::Aborted, "{status:?}");
                assert_eq!(reason(&status), "idempotency.in_flight");
                let retry = status.get_details_retry_info().expect("RetryInfo");
                assert!(retry.retry_delay.is_some());
                assert_eq!(
                    meta(status.metadata(), "idempotent-replayed"),
                    Some("false")
                );
                // When the first call came, and how many came: as an HTTP `409` says.
                assert!(meta(status.metadata(), "idempotency-first-seen").is_some());
                assert!(meta(status.metadata(), "idempotency-request-count").is_some());
            }
        }
    }
    assert_eq!(
        ok.len(),
        1,
        "one call ran, the others were told it is in flight"
    );
    assert_eq!(ledger.runs.load(Ordering::SeqCst), 1);

    // Once it completed, a retry replays it.
    let retry = client
        .clone()
        .transfer(transfer(Some("k-c"), 700))
        .await
        .unwrap();
    assert_eq!(retry.get_ref(), &ok[0]);
    assert_eq!(ledger.runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_key_reused_with_another_message_is_failed_precondition() {
    let ledger = CountingLedger::default();
    let mut client = serve(ledger.clone(), IdempotencyLayer::new_for_grpc()).await;

    client.transfer(transfer(Some("k-m"), 100)).await.unwrap();
    let status = client
        .transfer(transfer(Some("k-m"), 999))
        .await
        .unwrap_err();

    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(reason(&status), "idempotency.fingerprint_mismatch");
    assert!(status.get_details_retry_info().is_none(), "no retry helps");
    assert_eq!(ledger.runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_bad_or_missing_key_is_invalid_argument_and_nothing_runs() {
    let ledger = CountingLedger::default();
    let layer = IdempotencyLayer::new_for_grpc().require_key(true);
    // Current-thread runtime: the server's task logs on this thread.
    let (logs, _capture) = support::Logs::capture();
    let mut client = serve(ledger.clone(), layer).await;

    let too_long = "k".repeat(256);
    let status = client
        .transfer(transfer(Some(&too_long), 1))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(reason(&status), "idempotency.key_invalid");

    let mut repeated = transfer(Some("k-r"), 1);
    repeated
        .metadata_mut()
        .append("idempotency-key", "k-r".parse().unwrap());
    let status = client.transfer(repeated).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(reason(&status), "idempotency.key_repeated");

    let status = client.transfer(transfer(None, 1)).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(reason(&status), "idempotency.key_missing");
    assert_eq!(
        meta(status.metadata(), "idempotent-replayed"),
        Some("false")
    );

    // Each refusal's WARN names the gRPC code it answered, not an HTTP status.
    let rejected = logs.events("idempotency.rejected");
    assert_eq!(rejected.len(), 3, "{}", logs.raw());
    for line in &rejected {
        assert_eq!(line["level"], "WARN");
        assert_eq!(line["fields"]["grpc_code"], "INVALID_ARGUMENT", "{line}");
        assert!(line["fields"].get("status").is_none(), "{line}");
    }
    assert_eq!(ledger.runs.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_call_without_a_key_passes_through_every_time() {
    let ledger = CountingLedger::default();
    let mut client = serve(ledger.clone(), IdempotencyLayer::new_for_grpc()).await;
    for _ in 0..2 {
        let reply = client.transfer(transfer(None, 5)).await.unwrap();
        assert_eq!(meta(reply.metadata(), "idempotent-replayed"), Some("false"));
    }
    assert_eq!(ledger.runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn an_error_after_the_side_effect_is_replayed_and_unavailable_releases_the_key() {
    let failing = CountingLedger {
        fail_with: Some(Code::Internal),
        ..CountingLedger::default()
    };
    let mut client = serve(failing.clone(), IdempotencyLayer::new_for_grpc()).await;
    let first = client.transfer(transfer(Some("k-e"), 1)).await.unwrap_err();
    let retry = client.transfer(transfer(Some("k-e"), 1)).await.unwrap_err();
    assert_eq!(retry.code(), Code::Internal);
    assert_eq!(
        retry.message(),
        first.message(),
        "the stored status, replayed"
    );
    assert_eq!(meta(retry.metadata(), "idempotent-replayed"), Some("true"));
    assert_eq!(failing.runs.load(Ordering::SeqCst), 1);

    let unavailable = CountingLedger {
        fail_with: Some(Code::Unavailable),
        ..CountingLedger::default()
    };
    let mut client = serve(unavailable.clone(), IdempotencyLayer::new_for_grpc()).await;
    for _ in 0..2 {
        let status = client.transfer(transfer(Some("k-u"), 1)).await.unwrap_err();
        assert_eq!(status.code(), Code::Unavailable);
        assert_eq!(
            meta(status.metadata(), "idempotent-replayed"),
            Some("false")
        );
    }
    assert_eq!(
        unavailable.runs.load(Ordering::SeqCst),
        2,
        "UNAVAILABLE says nothing was done: the key is released and the retry runs"
    );
}

/// A handler's refusal (`INVALID_ARGUMENT`, `PERMISSION_DENIED`, ...) is not stored, as
/// the HTTP layer's 4xx: the same call is refused again by the handler, never answered
/// from a record, and a corrected call under the same key can run.
#[tokio::test]
async fn a_handlers_refusal_is_not_stored_and_the_retry_runs_again() {
    for code in [
        Code::InvalidArgument,
        Code::PermissionDenied,
        Code::NotFound,
    ] {
        let refusing = CountingLedger {
            fail_with: Some(code),
            ..CountingLedger::default()
        };
        let mut client = serve(refusing.clone(), IdempotencyLayer::new_for_grpc()).await;
        for _ in 0..2 {
            let status = client.transfer(transfer(Some("k-r"), 1)).await.unwrap_err();
            assert_eq!(status.code(), code);
            assert_eq!(
                meta(status.metadata(), "idempotent-replayed"),
                Some("false"),
                "{code:?}"
            );
        }
        assert_eq!(refusing.runs.load(Ordering::SeqCst), 2, "{code:?}");
    }
}

#[tokio::test]
async fn a_call_whose_client_gave_up_completes_and_its_retry_replays() {
    let ledger = CountingLedger {
        delay: Duration::from_millis(400),
        ..CountingLedger::default()
    };
    let mut client = serve(ledger.clone(), IdempotencyLayer::new_for_grpc()).await;

    // The client's deadline passes while the transfer runs: it sees the deadline, and
    // the server drops the call's future.
    let mut hurried = transfer(Some("k-d"), 42);
    hurried.set_timeout(Duration::from_millis(100));
    let status = client.transfer(hurried).await.unwrap_err();
    assert!(
        matches!(status.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{status:?}"
    );

    // Its retry while the transfer still runs is told so; once it ended, the retry
    // gets its reply.
    let status = client
        .transfer(transfer(Some("k-d"), 42))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Aborted, "{status:?}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let retry = client.transfer(transfer(Some("k-d"), 42)).await.unwrap();
    assert_eq!(meta(retry.metadata(), "idempotent-replayed"), Some("true"));
    assert_eq!(retry.get_ref().cents, 42);
    assert_eq!(
        ledger.runs.load(Ordering::SeqCst),
        1,
        "the transfer ran once"
    );
}

#[tokio::test]
async fn a_keyed_stream_of_requests_is_refused_and_an_unkeyed_one_passes() {
    let ledger = CountingLedger::default();
    let mut client = serve(ledger.clone(), IdempotencyLayer::new_for_grpc()).await;
    let messages = || {
        tokio_stream::iter((0..2).map(|i| TransferRequest {
            from: "a".into(),
            to: "b".into(),
            cents: i + 1,
        }))
    };

    let mut keyed = Request::new(messages());
    keyed
        .metadata_mut()
        .insert("idempotency-key", "k-s".parse().unwrap());
    let status = client.transfer_many(keyed).await.unwrap_err();
    assert_eq!(status.code(), Code::Unimplemented);
    assert_eq!(reason(&status), "idempotency.streaming_unsupported");
    assert_eq!(ledger.runs.load(Ordering::SeqCst), 0, "nothing ran");

    let reply = client
        .transfer_many(Request::new(messages()))
        .await
        .unwrap();
    assert_eq!(reply.get_ref().cents, 3);
    assert_eq!(ledger.runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_keyed_server_stream_is_replayed_whole() {
    let ledger = CountingLedger::default();
    let mut client = serve(ledger.clone(), IdempotencyLayer::new_for_grpc()).await;
    let mut replies = Vec::new();
    for _ in 0..2 {
        let mut stream = client
            .watch(transfer(Some("k-w"), 9))
            .await
            .unwrap()
            .into_inner();
        let mut ids = Vec::new();
        while let Some(reply) = stream.message().await.unwrap() {
            ids.push(reply.transfer_id);
        }
        replies.push(ids);
    }
    assert_eq!(replies[0], ["watch-1-0", "watch-1-1", "watch-1-2"]);
    assert_eq!(replies[1], replies[0]);
    assert_eq!(ledger.runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn the_callers_correlation_id_reaches_the_handler_and_comes_back() {
    let ledger = CountingLedger::default();
    let mut client = serve(ledger.clone(), IdempotencyLayer::new_for_grpc()).await;
    let mut request = transfer(Some("k-id"), 1);
    let sent = "0192f0c1-7a5e-7d3c-9b1a-2f4e6d8c0a11";
    request
        .metadata_mut()
        .insert("x-correlation-id", sent.parse().unwrap());
    let reply = client.transfer(request).await.unwrap();
    let echoed = meta(reply.metadata(), "x-correlation-id").unwrap();
    assert!(
        echoed.starts_with(sent),
        "the response names the caller's ID ({echoed})"
    );
    assert_eq!(ledger.seen.lock().unwrap().as_slice(), [echoed]);
}

#[tokio::test]
async fn a_store_outage_is_unavailable_and_nothing_runs() {
    let Some(mut redis) = server::RedisServer::start() else {
        return;
    };
    let store = RedisStore::builder(redis.url())
        .command_timeout(Duration::from_millis(250))
        .build()
        .await
        .unwrap();
    let ledger = CountingLedger::default();
    let mut client = serve(
        ledger.clone(),
        IdempotencyLayer::with_store(store).for_grpc(),
    )
    .await;
    client.transfer(transfer(Some("k-warm"), 1)).await.unwrap();
    assert_eq!(ledger.runs.load(Ordering::SeqCst), 1);

    // Paused: every command times out.
    redis.pause();
    let status = client.transfer(transfer(Some("k-o"), 1)).await.unwrap_err();
    redis.resume();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(reason(&status), "idempotency.store_unavailable");
    assert!(status.get_details_retry_info().is_some());
    assert_eq!(ledger.runs.load(Ordering::SeqCst), 1, "nothing ran");

    // Killed: the connection is refused.
    redis.kill();
    let status = client.transfer(transfer(Some("k-o"), 1)).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(ledger.runs.load(Ordering::SeqCst), 1, "nothing ran");

    // Back: the retry runs once, and its retry replays.
    redis.restart();
    let mut ran = None;
    for _ in 0..50 {
        match client.transfer(transfer(Some("k-o"), 1)).await {
            Ok(reply) => {
                ran = Some(reply.into_inner());
                break;
            }
            Err(status) => {
                assert_eq!(status.code(), Code::Unavailable, "{status:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    let ran = ran.expect("the call ran once Redis was back");
    let replay = client.transfer(transfer(Some("k-o"), 1)).await.unwrap();
    assert_eq!(replay.get_ref(), &ran);
    assert_eq!(ledger.runs.load(Ordering::SeqCst), 2);
}

/// A ledger that writes each transfer in the call's PostgreSQL transaction, and fails
/// with `INTERNAL` after its write when asked for a negative amount.
#[derive(Clone)]
struct PostgresLedger {
    runs: Arc<AtomicUsize>,
}

#[tonic::async_trait]
impl Ledger for PostgresLedger {
    async fn transfer(
        &self,
        request: Request<TransferRequest>,
    ) -> Result<Response<TransferReply>, Status> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        let transaction = request
            .extensions()
            .get::<Transaction>()
            .cloned()
            .ok_or_else(|| Status::internal("no transaction offered"))?;
        let message = request.into_inner();
        let id = uuid::Uuid::now_v7().to_string();
        {
            let mut connection = transaction.lock().await.unwrap();
            sqlx::query("INSERT INTO transfers (id, cents) VALUES ($1, $2)")
                .bind(&id)
                .bind(message.cents)
                .execute(&mut *connection)
                .await
                .unwrap();
        }
        if message.cents < 0 {
            return Err(Status::internal("refused after the write"));
        }
        Ok(Response::new(TransferReply {
            transfer_id: id,
            cents: message.cents,
        }))
    }

    async fn transfer_many(
        &self,
        _: Request<tonic::Streaming<TransferRequest>>,
    ) -> Result<Response<TransferReply>, Status> {
        Err(Status::unimplemented("not in this test"))
    }

    type WatchStream = Pin<Box<dyn Stream<Item = Result<TransferReply, Status>> + Send>>;

    async fn watch(
        &self,
        _: Request<TransferRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        Err(Status::unimplemented("not in this test"))
    }
}

#[tokio::test]
async fn a_transfer_in_the_calls_transaction_commits_with_its_answer_or_not_at_all() {
    let Some(database) = database::TestDatabase::create().await else {
        return;
    };
    let pool = database.pool(5).await;
    sqlx::raw_sql("CREATE TABLE transfers (id text PRIMARY KEY, cents bigint NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let store = PostgresStore::builder(pool.clone())
        .mode(PostgresMode::Transactional)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let ledger = PostgresLedger { runs: runs.clone() };
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        Server::builder()
            .layer(CorrelationLayer::new())
            .layer(IdempotencyLayer::with_store(store).for_grpc())
            .add_service(LedgerServer::new(ledger))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = LedgerClient::new(channel);
    let rows = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM transfers")
            .fetch_one(&pool)
            .await
            .unwrap()
    };

    // Committed with its answer: the retry replays it, one row.
    let first = client.transfer(transfer(Some("k-pg"), 300)).await.unwrap();
    let retry = client.transfer(transfer(Some("k-pg"), 300)).await.unwrap();
    assert_eq!(retry.get_ref(), first.get_ref());
    assert_eq!(meta(retry.metadata(), "idempotent-replayed"), Some("true"));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(rows().await, 1);

    // A server error after the write: rolled back, and the key released, so the retry
    // runs again (and fails again); no row of either stands.
    for _ in 0..2 {
        let status = client
            .transfer(transfer(Some("k-pg-bad"), -1))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Internal);
        assert_eq!(
            meta(status.metadata(), "idempotent-replayed"),
            Some("false")
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 3);
    assert_eq!(rows().await, 1);
}

/// The checked-in code is what `tonic-prost-build` makes of `ledger.proto` now. Run
/// with `UPDATE_GENERATED=1` to rewrite it.
#[test]
fn the_generated_code_is_fresh() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/grpc");
    let out = std::env::temp_dir().join(format!("tower-ids-grpc-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let descriptors = protox::compile(["ledger.proto"], [&dir]).unwrap();
    tonic_prost_build::configure()
        .out_dir(&out)
        .compile_fds(descriptors)
        .unwrap();
    let generated = std::fs::read_to_string(out.join("ledger.v1.rs")).unwrap();
    std::fs::remove_dir_all(&out).unwrap();
    let checked_in = dir.join("ledger.v1.rs");
    if std::env::var_os("UPDATE_GENERATED").is_some() {
        std::fs::write(&checked_in, &generated).unwrap();
    }
    assert!(
        generated == std::fs::read_to_string(&checked_in).unwrap(),
        "tests/grpc/ledger.v1.rs is stale: UPDATE_GENERATED=1 cargo test --test grpc the_generated_code_is_fresh"
    );
}
