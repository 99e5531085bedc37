//! The checks after a run. The databases: the sender recorded each payment as its `201`
//! said and published every message; the consumer applied each payment exactly once
//! (none lost, none doubled, none unknown), every balance is the sum sent to its account,
//! and each account's payments were applied in the sender's commit order. The logs: no
//! key committed twice, and what the faults did (republications, replays), printed.

use std::{
    collections::{BTreeMap, HashMap},
    time::{Duration, Instant},
};

use sqlx::PgPool;

use crate::{
    chaos::Chaos, processes::Role, requests::Sent, ACCOUNTS, CONCURRENCY, KILLS, MESSAGES,
    PER_REQUEST, REQUESTS,
};

/// Rows of `payments` in the consumer's database, 0 before the table exists.
pub(crate) async fn applied(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(DISTINCT key) FROM payments")
        .fetch_one(pool)
        .await
        .unwrap_or(0)
}

/// The outbox's rows: (pending, published, dead).
pub(crate) async fn outbox_rows(pool: &PgPool) -> (i64, i64, i64) {
    sqlx::query_as(
        "SELECT count(*) FILTER (WHERE published_at IS NULL AND dead_at IS NULL), \
                count(*) FILTER (WHERE published_at IS NOT NULL), \
                count(*) FILTER (WHERE dead_at IS NOT NULL) FROM tower_ids_outbox",
    )
    .fetch_one(pool)
    .await
    .unwrap_or((-1, -1, -1))
}

/// The sender's side: every payment sent once, as the `201`s said, every message
/// published, none dead. Returns each payment's sequence number in its account, by key.
pub(crate) async fn sender_side(sender: &PgPool, sent: &Sent) -> HashMap<String, i64> {
    let recorded: Vec<(String, String, i64, i64)> =
        sqlx::query_as("SELECT key, account, amount, seq FROM sent_payments")
            .fetch_all(sender)
            .await
            .unwrap();
    assert_eq!(
        recorded.len(),
        MESSAGES,
        "one sent_payments row per payment"
    );
    let mut seq_of: HashMap<String, i64> = HashMap::new();
    for (key, account, amount, seq) in &recorded {
        assert_eq!(
            sent.payments.get(key),
            Some(&(account.clone(), *amount)),
            "sent_payments holds what the 201s said"
        );
        seq_of.insert(key.clone(), *seq);
    }
    assert_eq!(
        outbox_rows(sender).await,
        (0, MESSAGES as i64, 0),
        "one message per payment, each published, none dead"
    );
    seq_of
}

/// The consumer's side: each payment once, the balances, the order per account, one
/// inbox record per payment.
pub(crate) async fn consumer_side(consumer: &PgPool, sent: &Sent, seq_of: &HashMap<String, i64>) {
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT key, count(*) FROM payments GROUP BY key")
            .fetch_all(consumer)
            .await
            .unwrap();
    let rows: HashMap<String, i64> = rows.into_iter().collect();
    let doubled: Vec<_> = rows.iter().filter(|(_, n)| **n > 1).collect();
    let lost: Vec<_> = sent
        .payments
        .keys()
        .filter(|key| !rows.contains_key(*key))
        .collect();
    let unknown: Vec<_> = rows
        .keys()
        .filter(|key| !sent.payments.contains_key(*key))
        .collect();
    assert!(doubled.is_empty(), "payments applied twice: {doubled:?}");
    assert!(lost.is_empty(), "payments lost: {} {lost:?}", lost.len());
    assert!(unknown.is_empty(), "payments nobody sent: {unknown:?}");
    let mut expected: BTreeMap<String, i64> = BTreeMap::new();
    for (account, amount) in sent.payments.values() {
        *expected.entry(account.clone()).or_default() += amount;
    }
    let balances: BTreeMap<String, i64> =
        sqlx::query_as::<_, (String, i64)>("SELECT account, balance FROM accounts")
            .fetch_all(consumer)
            .await
            .unwrap()
            .into_iter()
            .collect();
    assert_eq!(
        balances, expected,
        "every balance is the sum sent to its account"
    );
    let order: Vec<(String, String)> =
        sqlx::query_as("SELECT key, account FROM payments ORDER BY id")
            .fetch_all(consumer)
            .await
            .unwrap();
    let mut last: HashMap<&str, i64> = HashMap::new();
    let mut out_of_order = Vec::new();
    for (key, account) in &order {
        let seq = seq_of[key.as_str()];
        if let Some(previous) = last.insert(account, seq) {
            if seq <= previous {
                out_of_order.push(format!("{account}: {seq} after {previous}"));
            }
        }
    }
    assert!(
        out_of_order.is_empty(),
        "payments applied out of their account's commit order ({}): {:?}",
        out_of_order.len(),
        &out_of_order[..out_of_order.len().min(20)]
    );
    let records: i64 =
        sqlx::query_scalar("SELECT count(*) FROM tower_ids_idempotency WHERE completed")
            .fetch_one(consumer)
            .await
            .unwrap();
    assert_eq!(records, MESSAGES as i64, "one inbox record per payment");
}

/// What the logs say the faults did.
pub(crate) struct Logs<'a> {
    /// Publications by the relays less messages: what was published again.
    republished: usize,
    /// `inbox.replayed` lines: copies the relays published again, and deliveries the
    /// broker made again (a consumer killed or cut off before its ack).
    replays: usize,
    /// WARN and ERROR lines, by event code.
    warnings: BTreeMap<&'a str, usize>,
}

/// The logs: publications, deliveries, replays; no key committed twice.
pub(crate) fn logs(chaos: &Chaos) -> Logs<'_> {
    let events = |role: Role| {
        chaos
            .runs
            .iter()
            .filter(move |run| run.role == role)
            .flat_map(|run| run.events.iter())
    };
    let mut publications: HashMap<i64, usize> = HashMap::new();
    for event in events(Role::Relay).filter(|e| e.code == "outbox.published") {
        *publications
            .entry(
                event
                    .message_id
                    .expect("outbox.published in its outbox.publish span"),
            )
            .or_default() += 1;
    }
    let republished: usize = publications.values().map(|n| n - 1).sum();
    let mut handled: HashMap<&str, usize> = HashMap::new();
    for event in events(Role::Consumer).filter(|e| e.code == "inbox.handled") {
        *handled.entry(event.key.as_deref().unwrap()).or_default() += 1;
    }
    let twice: Vec<_> = handled.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        twice.is_empty(),
        "keys committed twice, by the logs: {twice:?}"
    );
    let replays = events(Role::Consumer)
        .filter(|e| e.code == "inbox.replayed")
        .count();
    let warnings: BTreeMap<&str, usize> = chaos
        .runs
        .iter()
        .flat_map(|run| run.events.iter())
        .filter(|e| matches!(e.level.as_str(), "WARN" | "ERROR"))
        .fold(BTreeMap::new(), |mut counts, e| {
            *counts.entry(e.code.as_str()).or_default() += 1;
            counts
        });

    Logs {
        republished,
        replays,
        warnings,
    }
}

/// How long the run's parts took.
pub(crate) struct Times {
    /// The start of the test, before the examples were built.
    pub(crate) began: Instant,
    /// Building the examples.
    pub(crate) build: Duration,
    /// Sending the requests.
    pub(crate) sending: Duration,
    /// From the first request to the last payment applied.
    pub(crate) done: Duration,
}

/// Prints the figures, then fails if the faults fell short: a planned kill that did not
/// happen, or no relay kill inside a round (nothing published again).
pub(crate) fn report(broker: &str, sent: &Sent, chaos: &Chaos, logs: Logs<'_>, times: Times) {
    let Logs {
        republished,
        replays,
        warnings,
    } = logs;
    let Times {
        began,
        build,
        sending,
        done,
    } = times;
    eprintln!(
        "outbox proof over {}: {MESSAGES} messages from {REQUESTS} requests of {PER_REQUEST} \
         payments over {ACCOUNTS} accounts ({CONCURRENCY} at once) in {:.1} s; each request \
         sent again with its key: {} replayed 201s, nothing added; answers other than 201, \
         tried again: {:?}",
        broker,
        sending.as_secs_f64(),
        sent.replayed,
        sent.refused,
    );
    eprintln!(
        "  SIGKILLs (each restarted): {} relays, {} consumers; {}; exits restarted: {:?}",
        chaos.relay_kills,
        chaos.consumer_kills,
        chaos.fault.as_deref().unwrap_or("no fault"),
        chaos.exits,
    );
    eprintln!(
        "  republished by the relays (their logs: publications less messages): {republished}; \
         replays by the inbox (copies published again, deliveries made again): {replays}",
    );
    eprintln!("  warnings logged: {warnings:?}");
    eprintln!(
        "  each of the {MESSAGES} payments applied once, balances as sent, each account in \
         commit order; wall time {:.1} s (requests to the last payment applied {:.1} s, \
         building the examples {:.1} s)",
        began.elapsed().as_secs_f64(),
        done.as_secs_f64(),
        build.as_secs_f64(),
    );
    assert!(
        chaos.relay_kills >= KILLS && chaos.consumer_kills >= KILLS,
        "every planned kill happened"
    );
    assert!(
        republished > 0,
        "no relay kill landed inside a round: nothing was published again, so the inbox \
         absorbed no republication"
    );
}
