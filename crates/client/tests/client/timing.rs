//! Timing, against a scripted `service_fn` client under paused time: `Retry-After` in
//! seconds and as an HTTP-date, past the deadline or with every attempt used; attempts
//! that hang are abandoned, the deadline abandons the attempt in flight; and the
//! backoff's waits are jittered over their whole range.

use std::{
    io,
    time::{Duration, SystemTime},
};

use http::{Method, StatusCode};
use proptest::prelude::*;
use tokio::time::Instant;
use tower::{Layer, ServiceExt};
use tower_ids::client::{RetryError, RetryLayer, StopReason};

use super::{fast, gaps, mock, outcome, request, respond, status, Answer, MS};

#[tokio::test(start_paused = true)]
async fn retry_after_in_seconds_is_honoured() {
    let (inner, log) = mock(|n| match n {
        0 => respond(503, &[("retry-after", "3")]),
        _ => status(200),
    });
    let response = fast()
        .layer(inner)
        .oneshot(request(Method::GET))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let gap = gaps(&log)[0];
    assert!(
        gap >= Duration::from_secs(3) && gap <= Duration::from_secs(3) + 10 * MS,
        "{gap:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn retry_after_as_an_http_date_is_honoured() {
    // An HTTP-date has whole seconds: "now + 5 s" is 4 to 5 s away.
    let (inner, log) = mock(|n| match n {
        0 => {
            let date = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(5));
            respond(429, &[("retry-after", &date)])
        }
        _ => status(200),
    });
    let response = fast()
        .layer(inner)
        .oneshot(request(Method::GET))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let gap = gaps(&log)[0];
    assert!(
        gap >= Duration::from_secs(4) && gap <= Duration::from_secs(5),
        "{gap:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_retry_after_past_the_deadline_returns_the_last_response_at_once() {
    let (inner, log) = mock(|_| respond(503, &[("retry-after", "60")]));
    let layer = fast().deadline(Duration::from_secs(10));
    let started = Instant::now();
    let response = layer
        .layer(inner)
        .oneshot(request(Method::GET))
        .await
        .unwrap();
    assert_eq!(
        started.elapsed(),
        Duration::ZERO,
        "no sleep into the deadline"
    );
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        outcome(&response).stop_reason(),
        StopReason::DeadlineReached
    );
    assert!(outcome(&response).gave_up());
    assert_eq!(log.lock().unwrap().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn every_attempt_used_returns_the_last_response() {
    let (inner, log) = mock(|_| status(502));
    let response = fast()
        .layer(inner)
        .oneshot(request(Method::GET))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::BAD_GATEWAY);
    assert_eq!(outcome(&response).attempts(), 5);
    assert_eq!(
        outcome(&response).stop_reason(),
        StopReason::AttemptsExhausted
    );
    assert_eq!(log.lock().unwrap().len(), 5);
}

#[tokio::test(start_paused = true)]
async fn an_attempt_that_hangs_is_abandoned_and_retried() {
    let (inner, log) = mock(|n| if n == 0 { Answer::Hang } else { status(200) });
    let layer = fast().attempt_timeout(Duration::from_secs(2));
    let response = layer
        .layer(inner)
        .oneshot(request(Method::GET))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(outcome(&response).attempts(), 2);
    let gap = gaps(&log)[0];
    assert!(
        gap >= Duration::from_secs(2) && gap <= Duration::from_secs(2) + MS,
        "{gap:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn the_last_attempt_timing_out_is_an_error() {
    let (inner, _log) = mock(|_| Answer::Hang);
    let layer = fast()
        .max_attempts(2)
        .attempt_timeout(Duration::from_secs(1));
    let error = layer
        .layer(inner)
        .oneshot(request(Method::GET))
        .await
        .unwrap_err();
    assert!(
        matches!(
            error,
            RetryError::TimedOut {
                attempts: 2,
                exhausted: true,
                ..
            }
        ),
        "{error:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn the_deadline_abandons_the_attempt_in_flight() {
    let (inner, log) = mock(|n| if n == 0 { status(503) } else { Answer::Hang });
    let layer = RetryLayer::new()
        .backoff(Duration::ZERO, Duration::ZERO)
        .attempt_timeout(Duration::from_secs(4))
        .deadline(Duration::from_secs(10));
    let started = Instant::now();
    let error = layer
        .layer(inner)
        .oneshot(request(Method::GET))
        .await
        .unwrap_err();
    assert_eq!(
        started.elapsed(),
        Duration::from_secs(10),
        "at the deadline"
    );
    // 503 at 0 s, timeouts at 4 s and 8 s, the fourth attempt cut at 10 s.
    assert_eq!(log.lock().unwrap().len(), 4);
    match error {
        RetryError::DeadlineExceeded {
            attempts,
            deadline,
            last_status,
            source,
            ..
        } => {
            assert_eq!(attempts, 4);
            assert_eq!(deadline, Duration::from_secs(10));
            assert_eq!(last_status, Some(StatusCode::SERVICE_UNAVAILABLE));
            assert!(source.is_none());
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn a_failure_with_no_time_left_is_a_deadline_error_with_the_cause() {
    // A zero deadline: the attempt still runs (the client answers at once, and a
    // timeout polls its future before its timer), then no retry can start in time.
    let (inner, _log) = mock(|_| Answer::Fail);
    let layer = fast().deadline(Duration::ZERO);
    let error = layer
        .layer(inner)
        .oneshot(request(Method::GET))
        .await
        .unwrap_err();
    match &error {
        RetryError::DeadlineExceeded {
            attempts: 1,
            last_status: None,
            source: Some(source),
            ..
        } => assert_eq!(source.kind(), io::ErrorKind::ConnectionRefused),
        other => panic!("{other:?}"),
    }
    assert_eq!(error.code(), "client.deadline_exceeded");
    assert!(!error.is_exhausted());
}

/// The gaps between the attempts of one request that fails `attempts` times.
fn measured_gaps(base: Duration, cap: Duration, attempts: u32) -> Vec<Duration> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    runtime.block_on(async {
        let (inner, log) = mock(|_| status(503));
        let layer = RetryLayer::new()
            .max_attempts(attempts)
            .backoff(base, cap)
            .deadline(Duration::MAX);
        let response = layer
            .layer(inner)
            .oneshot(request(Method::GET))
            .await
            .unwrap();
        assert_eq!(outcome(&response).attempts(), attempts);
        gaps(&log)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn every_wait_is_within_its_backoff_ceiling(
        base_ms in 0u64..2_000,
        cap_ms in 0u64..10_000,
        attempts in 1u32..8,
    ) {
        let (base, cap) = (Duration::from_millis(base_ms), Duration::from_millis(cap_ms));
        let gaps = measured_gaps(base, cap, attempts);
        prop_assert_eq!(gaps.len() as u32, attempts - 1);
        for (i, gap) in gaps.iter().enumerate() {
            let ceiling = (base * (1 << i)).min(cap);
            prop_assert!(*gap <= ceiling, "retry {}: {:?} > {:?}", i + 1, gap, ceiling);
        }
    }
}

#[test]
fn the_waits_are_jittered_over_the_whole_range() {
    // 300 requests, one retry each, ceiling 1 s: full jitter spreads the waits over
    // [0, 1 s]. Each bound below fails with probability under 10^-13.
    let waits: Vec<Duration> = (0..300)
        .map(|_| measured_gaps(Duration::from_secs(1), Duration::from_secs(1), 2)[0])
        .collect();
    assert!(waits.iter().all(|w| *w <= Duration::from_secs(1)));
    assert!(*waits.iter().min().unwrap() < 100 * MS);
    assert!(*waits.iter().max().unwrap() > 900 * MS);
    let mean = waits.iter().sum::<Duration>() / 300;
    assert!(mean > 350 * MS && mean < 650 * MS, "{mean:?}");
}
