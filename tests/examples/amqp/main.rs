//! The control plane's signals against a real RabbitMQ: the `control_plane` controller
//! as child processes, killed (SIGKILL) between publishing an outcome and acking its
//! signal, several of them on one queue sharing a Redis store (a `redis-server` of the
//! test's own), a burst of duplicates, and the orchestrator's retries. Each test owns
//! its exchange and queue and removes them; without a broker (and outside CI) the tests
//! say SKIPPED and pass.
#![allow(missing_docs, unreachable_pub)]

mod broker;

#[path = "../demo.rs"]
mod demo;

use tower_ids_test_support::redis as server;

use std::{collections::HashSet, process::Command, time::Duration};

use broker::{span_correlation, Controller, Topology};
use server::RedisServer;

const SWARM: &str = "swarm-42";

/// Both IDs echoed, and the status the controller reached.
fn assert_echoes(outcome: &broker::Outcome, key: &str, correlation: &str, status: &str) {
    assert_eq!(outcome.json["kind"], "outcome");
    assert_eq!(outcome.json["idempotencyKey"], key);
    assert_eq!(outcome.json["correlationId"], correlation);
    assert_eq!(outcome.json["data"]["status"], status);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_killed_before_its_ack_is_redelivered_and_replays_the_same_outcome() {
    let Some(connection) = broker::connect().await else {
        return;
    };
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let topology = Topology::new(&connection, "killed").await;
    let store = ["--redis-url", &redis.url()];
    // It publishes the outcome, then waits a minute before acking: killed meanwhile.
    let mut first = Controller::start(
        &topology,
        "controller-a",
        &[store[0], store[1], "--ack-delay-ms", "60000"],
    );

    topology
        .signal(
            SWARM,
            "swarm-start",
            "a1c3-1111-2222-9f",
            "attempt-001-aaaa-bbbb",
        )
        .await;
    first.wait_event("controller.outcome_published", Duration::from_secs(20));
    first.kill();
    let restarted = Controller::start(&topology, "controller-a", &store);
    let outcomes = topology.wait_outcomes(2, Duration::from_secs(20)).await;

    let replay = restarted.wait_event("idempotency.replayed", Duration::from_secs(5));
    let received = restarted.wait_event("controller.received", Duration::from_secs(5));
    assert_eq!(
        received["fields"]["idempotency_key"], "a1c3-1111-2222-9f",
        "RabbitMQ delivered it again"
    );
    let settled = restarted.wait_event("message.settled", Duration::from_secs(5));
    assert_eq!(
        settled["fields"]["outcome"], "replayed",
        "the driver acknowledged the replay"
    );
    assert_eq!(
        replay["fields"]["original_attempt"]
            .as_str()
            .map(|a| a.starts_with("attempt-001-aaaa-bbbb.")),
        Some(true),
        "the record names the delivery that ran"
    );
    assert_eq!(topology.executions().len(), 1, "the handler ran once");
    assert_eq!(outcomes.len(), 2);
    assert_eq!(
        outcomes[0].body, outcomes[1].body,
        "the redelivery's outcome is the first, byte for byte"
    );
    assert_echoes(
        &outcomes[0],
        "a1c3-1111-2222-9f",
        "attempt-001-aaaa-bbbb",
        "Running",
    );
    // Each outcome's header carries the ID of the delivery that published it.
    let headers: Vec<_> = outcomes
        .iter()
        .map(|outcome| outcome.correlation_header.clone().unwrap())
        .collect();
    assert!(headers
        .iter()
        .all(|h| h.starts_with("attempt-001-aaaa-bbbb.")));
    // Every line of the handling, on both processes, carries the attempt's ID (the
    // process's own lines are outside any delivery).
    for line in first.lines().into_iter().chain(restarted.lines()) {
        let event = line["fields"]["event"].as_str().unwrap_or("");
        if ["controller.ready", "message.consuming"].contains(&event) {
            continue;
        }
        let id = span_correlation(&line).unwrap_or_else(|| panic!("no correlation span: {line}"));
        assert!(id.starts_with("attempt-001-aaaa-bbbb."), "{line}");
    }
    drop((first, restarted));
    topology.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_controllers_on_one_queue_share_redis_and_the_survivor_replays() {
    let Some(connection) = broker::connect().await else {
        return;
    };
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let topology = Topology::new(&connection, "two").await;
    let args = ["--redis-url", &redis.url(), "--ack-delay-ms", "60000"];
    let mut controllers = [
        Controller::start(&topology, "controller-a", &args),
        Controller::start(&topology, "controller-b", &args),
    ];

    topology
        .signal(SWARM, "swarm-start", "two-key-1", "attempt-001-two")
        .await;
    let first = topology.wait_outcomes(1, Duration::from_secs(20)).await;
    let ran = controllers
        .iter()
        .position(|c| !c.events("controller.executed").is_empty())
        .expect("one controller ran it");
    controllers[ran].kill();
    let outcomes = topology.wait_outcomes(2, Duration::from_secs(20)).await;

    let survivor = &controllers[1 - ran];
    let published = survivor.wait_event("controller.outcome_published", Duration::from_secs(5));
    assert_eq!(published["fields"]["replayed"], true);
    assert!(
        survivor.events("controller.executed").is_empty(),
        "the survivor did not run it"
    );
    assert_eq!(topology.executions().len(), 1);
    assert_eq!(
        first[0].body, outcomes[1].body,
        "the same outcome, byte for byte"
    );
    assert_echoes(&outcomes[1], "two-key-1", "attempt-001-two", "Running");
    drop(controllers);
    topology.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_duplicates_on_three_consumers_runs_once_and_all_get_one_outcome() {
    let Some(connection) = broker::connect().await else {
        return;
    };
    let Some(redis) = RedisServer::start() else {
        return;
    };
    let topology = Topology::new(&connection, "burst").await;
    let url = redis.url();
    // Two requeue a duplicate in flight, one waits for the outcome.
    let controllers = [
        Controller::start(
            &topology,
            "controller-a",
            &["--redis-url", &url, "--handler-ms", "500"],
        ),
        Controller::start(
            &topology,
            "controller-b",
            &["--redis-url", &url, "--handler-ms", "500"],
        ),
        Controller::start(
            &topology,
            "controller-c",
            &[
                "--redis-url",
                &url,
                "--handler-ms",
                "500",
                "--in-flight",
                "wait",
            ],
        ),
    ];

    const BURST: usize = 30;
    let sends = (0..BURST).map(|n| {
        let topology = &topology;
        async move {
            let correlation = format!("attempt-{n:03}-burst");
            topology
                .signal(SWARM, "swarm-start", "burst-key-1", &correlation)
                .await;
        }
    });
    futures_util::future::join_all(sends).await;
    let outcomes = topology.wait_outcomes(BURST, Duration::from_secs(60)).await;

    assert_eq!(
        topology.executions().len(),
        1,
        "one execution for the burst"
    );
    let bodies: HashSet<_> = outcomes.iter().map(|o| o.body.clone()).collect();
    assert_eq!(bodies.len(), 1, "every duplicate got the same outcome");
    // Each outcome was published by one delivery of one attempt, under its own ID.
    let attempts: HashSet<_> = outcomes
        .iter()
        .map(|o| {
            o.correlation_header
                .clone()
                .unwrap()
                .split('.')
                .next()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(attempts.len(), BURST, "every attempt answered");
    let requeued: usize = controllers
        .iter()
        .map(|c| {
            c.events("message.settled")
                .iter()
                .filter(|line| line["fields"]["outcome"] == "in_flight")
                .count()
        })
        .sum();
    eprintln!(
        "burst: {BURST} signals on 3 consumers, 1 execution, {requeued} requeued while in flight, {} outcomes identical",
        outcomes.len()
    );
    drop(controllers);
    topology.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swarm_start_and_swarm_stop_with_one_key_are_two_commands() {
    let Some(connection) = broker::connect().await else {
        return;
    };
    let topology = Topology::new(&connection, "start-stop").await;
    // One process: its in-memory store is enough here.
    let controller = Controller::start(&topology, "controller-a", &["--handler-ms", "50"]);

    topology
        .signal(SWARM, "swarm-start", "one-key", "attempt-001-start")
        .await;
    topology.wait_outcomes(1, Duration::from_secs(10)).await;
    topology
        .signal(SWARM, "swarm-stop", "one-key", "attempt-001-stop")
        .await;
    topology.wait_outcomes(2, Duration::from_secs(10)).await;
    topology
        .signal(SWARM, "swarm-start", "one-key", "attempt-002-start")
        .await;
    let outcomes = topology.wait_outcomes(3, Duration::from_secs(10)).await;

    assert_echoes(&outcomes[0], "one-key", "attempt-001-start", "Running");
    assert_echoes(&outcomes[1], "one-key", "attempt-001-stop", "Stopped");
    assert_eq!(
        outcomes[2].body, outcomes[0].body,
        "the retried start replays"
    );
    assert_eq!(
        outcomes[2]
            .correlation_header
            .as_deref()
            .map(|h| h.starts_with("attempt-002-start.")),
        Some(true),
        "published under the retry's own ID"
    );
    assert_eq!(topology.executions().len(), 2);
    drop(controller);
    topology.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_orchestrator_retries_under_new_correlation_ids_with_one_key() {
    let Some(connection) = broker::connect().await else {
        return;
    };
    let topology = Topology::new(&connection, "orchestrator").await;
    // Slower than the orchestrator's patience: its first attempts time out.
    let controller = Controller::start(&topology, "controller-a", &["--handler-ms", "1200"]);

    let run = Command::new(demo::example_path("control_plane"))
        .args([
            "--amqp-url",
            &broker::url(),
            "--exchange",
            &topology.exchange,
        ])
        .args(["--log-format", "json", "orchestrator", "--swarm", SWARM])
        .args([
            "--signal",
            "swarm-start",
            "--timeout-ms",
            "500",
            "--attempts",
            "5",
        ])
        .env("RUST_LOG", "info,lapin=warn")
        .output()
        .expect("the orchestrator runs");
    assert!(
        run.status.success(),
        "an outcome came: {}",
        String::from_utf8_lossy(&run.stderr)
    );

    let outcome: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    let logs: Vec<serde_json::Value> = String::from_utf8_lossy(&run.stderr)
        .lines()
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect();
    let sent: Vec<_> = logs
        .iter()
        .filter(|line| line["fields"]["event"] == "orchestrator.sent")
        .collect();
    let ids: HashSet<_> = sent
        .iter()
        .filter_map(|line| span_correlation(line))
        .collect();
    let keys: HashSet<_> = sent
        .iter()
        .filter_map(|line| {
            line["spans"]
                .as_array()?
                .iter()
                .find_map(|s| s["idempotency_key"].as_str().map(str::to_owned))
        })
        .collect();
    assert!(sent.len() >= 2, "it retried: {} attempts", sent.len());
    assert_eq!(ids.len(), sent.len(), "a new correlation id per attempt");
    assert_eq!(keys.len(), 1, "one idempotency key for the action");
    assert_eq!(outcome["idempotencyKey"], *keys.iter().next().unwrap());
    assert!(
        ids.contains(outcome["correlationId"].as_str().unwrap()),
        "the outcome echoes an attempt"
    );

    // Every attempt reaches the controller; the later ones replay the first outcome.
    let published = topology
        .wait_outcomes(sent.len(), Duration::from_secs(20))
        .await;
    assert!(published.iter().all(|o| o.body == published[0].body));
    assert_eq!(topology.executions().len(), 1, "the retries ran nothing");

    // The action's trace (its attempts are spans of it) goes to the controller on the
    // signal's `traceparent`, and comes back on the outcome's.
    #[cfg(feature = "opentelemetry")]
    {
        let traces: HashSet<&str> = sent
            .iter()
            .map(|line| line["span"]["trace_id"].as_str().expect("a trace id"))
            .collect();
        assert_eq!(traces.len(), 1, "one trace for the user action: {traces:?}");
        let received = controller.events("controller.received");
        assert!(!received.is_empty());
        for line in &received {
            let trace = line["span"]["trace_id"].as_str().expect("a trace id");
            assert!(traces.contains(trace), "{line}");
        }
        let answered = logs
            .iter()
            .find(|line| line["fields"]["event"] == "orchestrator.outcome")
            .expect("the outcome line");
        assert!(
            traces.contains(answered["fields"]["outcome_trace_id"].as_str().unwrap()),
            "{answered}"
        );
    }
    eprintln!(
        "orchestrator: {} attempts under {} correlation ids and 1 key, 1 execution, {} identical outcomes",
        sent.len(),
        ids.len(),
        published.len()
    );
    drop(controller);
    topology.remove().await;
}
