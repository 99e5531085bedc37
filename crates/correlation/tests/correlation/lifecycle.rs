//! The lifecycle operations and the log lines that tie their chapters together.

use serde_json::{json, Value};
use tower_ids::correlation::CorrelationId;

use crate::support::Logs;

fn id(text: &str) -> CorrelationId {
    CorrelationId::parse(text).unwrap()
}

/// The `fields` of every replace-pair line, in order.
fn pairs(logs: &Logs) -> Vec<Value> {
    logs.lines()
        .into_iter()
        .filter(|line| {
            let event = &line["fields"]["event"];
            event == "correlation.replacing" || event == "correlation.replaced"
        })
        .map(|line| {
            assert_eq!(
                line["level"], "INFO",
                "the pair must survive an info filter"
            );
            line["fields"].clone()
        })
        .collect()
}

fn pair(old: &str, new: &str, reason: &str) -> [Value; 2] {
    [
        json!({"message": "Replacing correlation id", "event": "correlation.replacing",
               "corr_id": old, "new_corr_id": new, "reason": reason}),
        json!({"message": "Replaced correlation id", "event": "correlation.replaced",
               "corr_id": new, "old_corr_id": old, "reason": reason}),
    ]
}

#[test]
fn replace_emits_the_pair_old_then_new() {
    let (logs, _guard) = Logs::capture();
    let old = id("abcd-efgh");

    let new = old.replace();

    assert_ne!(new, old);
    assert_eq!(
        uuid::Uuid::parse_str(new.as_str())
            .unwrap()
            .get_version_num(),
        7
    );
    assert_eq!(pairs(&logs), pair("abcd-efgh", new.as_str(), "replaced"));
}

#[test]
fn combine_emits_one_pair_per_incoming_id_all_naming_the_same_new_id() {
    let (logs, _guard) = Logs::capture();
    let batch = [id("msg-a"), id("msg-b"), id("msg-c")];

    let combined = CorrelationId::combine(&batch);

    let expected: Vec<Value> = ["msg-a", "msg-b", "msg-c"]
        .into_iter()
        .flat_map(|old| pair(old, combined.as_str(), "combined"))
        .collect();
    assert_eq!(pairs(&logs), expected);
}

#[test]
fn restore_adopts_the_real_id_through_the_pair() {
    let (logs, _guard) = Logs::capture();
    let provisional = CorrelationId::new();

    let real = provisional.restore("envelope-corr-7").unwrap();

    assert_eq!(real, "envelope-corr-7");
    assert_eq!(
        pairs(&logs),
        pair(provisional.as_str(), "envelope-corr-7", "restored")
    );
}

#[test]
fn restore_refuses_an_invalid_id_without_logging_it() {
    let (logs, _guard) = Logs::capture();
    let provisional = CorrelationId::new();

    let refused = provisional
        .restore("<script>alert(1)</script>")
        .unwrap_err();

    assert_eq!(refused.reason(), "invalid_character");
    assert!(pairs(&logs).is_empty());
    let warning = &logs.events("correlation.restore_rejected")[0];
    assert_eq!(warning["level"], "WARN");
    assert_eq!(warning["fields"]["corr_id"], provisional.as_str());
    assert!(!logs.raw().contains("script"));
}

#[test]
fn an_extension_past_the_bound_replaces_instead() {
    let (logs, _guard) = Logs::capture();
    let long = "x".repeat(127);
    let parent = id(&long);

    let child = parent.next_child();

    assert_eq!(child.as_str().len(), 36, "a fresh UUIDv7, not `{long}.1`");
    assert_eq!(pairs(&logs), pair(&long, child.as_str(), "too_long"));
}

#[test]
fn children_are_numbered_per_parent_across_clones() {
    let parent = id("abcd-efgh");
    let clone = parent.clone();

    assert_eq!(parent.next_child(), "abcd-efgh.1");
    assert_eq!(clone.next_child(), "abcd-efgh.2");
    let grandchild = parent.next_child().next_child();
    assert_eq!(grandchild, "abcd-efgh.3.1");
    assert_eq!(
        id("abcd-efgh").next_child(),
        "abcd-efgh.1",
        "another parent, another counter"
    );
}

#[test]
fn random_and_redelivery_extensions_are_short_and_valid() {
    let parent = id("abcd-efgh");
    let mut seen = std::collections::HashSet::new();
    for _ in 0..64 {
        let random = parent.extend_random();
        let suffix = random.as_str().strip_prefix("abcd-efgh.").unwrap();
        assert_eq!(suffix.len(), 4, "24 bits in base64url");
        assert!(CorrelationId::parse(random.as_str()).is_ok());
        seen.insert(suffix.to_owned());

        let redelivery = parent.extend_redelivery();
        let suffix = redelivery.as_str().strip_prefix("abcd-efgh.").unwrap();
        assert_eq!(suffix.len(), 3, "18 bits in base64url");
        assert!(CorrelationId::parse(redelivery.as_str()).is_ok());
    }
    assert!(
        seen.len() > 60,
        "random suffixes repeat too often: {}",
        seen.len()
    );
}

#[test]
fn the_redelivery_suffix_carries_the_tick() {
    use base64::Engine as _;
    let parent = id("msg-1");
    let at = std::time::UNIX_EPOCH + std::time::Duration::from_secs(30 * 0x1a5);
    for _ in 0..32 {
        let child = parent.extend_redelivery_at(at);
        let suffix = child.as_str().strip_prefix("msg-1.").unwrap();
        // Put back the leading `A` (six zero bits) and decode the 18 bits.
        let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(format!("A{suffix}"))
            .unwrap();
        let bits = (u32::from(bytes[0]) << 16) | (u32::from(bytes[1]) << 8) | u32::from(bytes[2]);
        assert_eq!(bits >> 10, 0xa5, "the low 8 bits of the 30-second tick");
    }
}

#[test]
fn an_extension_that_just_fits_is_kept() {
    let parent = id(&"y".repeat(126));
    let child = parent.next_child();
    assert_eq!(child.as_str().len(), 128);
    assert!(child.as_str().ends_with(".1"));
    // The next level would pass the bound: replaced, and the lineage starts again.
    let grandchild = child.next_child();
    assert_eq!(grandchild.as_str().len(), 36);
    assert_eq!(
        grandchild.next_child().as_str().len(),
        38,
        "a replaced ID extends again"
    );
}

#[tokio::test]
async fn scope_carries_the_id_into_a_spawned_task() {
    let (logs, _guard) = Logs::capture();
    let parent = id("job-1");

    let child = parent.next_child();
    let seen = tokio::spawn(child.scope(async {
        tracing::info!(event = "test.child", "child work");
        CorrelationId::current()
    }))
    .await
    .unwrap();

    assert_eq!(seen.unwrap(), "job-1.1");
    assert_eq!(
        logs.events("test.child")[0]["span"]["correlation_id"],
        "job-1.1"
    );
    assert!(
        CorrelationId::current().is_none(),
        "nothing leaks into the caller"
    );
}
