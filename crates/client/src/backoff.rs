//! Exponential backoff with full jitter, and the server's `Retry-After`.

use std::time::{Duration, SystemTime};

use http::{header, HeaderMap};

/// The largest delay before the `retry`-th retry (1 for the first): `base * 2^(retry - 1)`,
/// at most `cap`. Saturates instead of overflowing.
pub(crate) fn ceiling(base: Duration, cap: Duration, retry: u32) -> Duration {
    let doubled = match 1u32.checked_shl(retry.saturating_sub(1)) {
        Some(factor) => base.checked_mul(factor).unwrap_or(Duration::MAX),
        None if base.is_zero() => Duration::ZERO,
        None => Duration::MAX,
    };
    doubled.min(cap)
}

/// "Full jitter": a delay drawn uniformly from `[0, ceiling]`, so clients that failed
/// together do not retry together. `random` is any `u128`; the pick is
/// `random mod (ceiling + 1)` in nanoseconds (the bias of the modulo is below 2^-30 for
/// any ceiling under a century).
pub(crate) fn full_jitter(ceiling: Duration, random: u128) -> Duration {
    let nanos = ceiling.as_nanos();
    let pick = match nanos.checked_add(1) {
        Some(span) => random % span,
        None => random,
    };
    let secs = u64::try_from(pick / 1_000_000_000).unwrap_or(u64::MAX);
    // The remainder is below 10^9 and fits.
    let subsec = (pick % 1_000_000_000) as u32;
    Duration::new(secs, subsec).min(ceiling)
}

/// The delay a `Retry-After` header asks for, in either form of RFC 9110 § 10.2.3:
/// delta-seconds (`120`) or an HTTP-date (`Wed, 21 Oct 2015 07:28:00 GMT`), measured
/// from `now`. A date in the past is zero; a value in neither form is ignored (`None`).
pub(crate) fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let value = headers.get(header::RETRY_AFTER)?.to_str().ok()?.trim();
    if value.is_empty() {
        return None;
    }
    if value.bytes().all(|b| b.is_ascii_digit()) {
        // All digits: only an overflow fails, and an absurd wait saturates.
        return Some(Duration::from_secs(value.parse().unwrap_or(u64::MAX)));
    }
    let date = httpdate::parse_http_date(value).ok()?;
    Some(date.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use proptest::prelude::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn the_ceiling_doubles_up_to_the_cap() {
        let (base, cap) = (250 * MS, 4000 * MS);
        let ceilings: Vec<_> = (1..=7).map(|n| ceiling(base, cap, n)).collect();
        assert_eq!(
            ceilings,
            [250, 500, 1000, 2000, 4000, 4000, 4000].map(|ms| ms * MS)
        );
        assert_eq!(ceiling(base, cap, 0), base, "retry 0 is read as the first");
        assert_eq!(
            ceiling(base, Duration::MAX, 200),
            Duration::MAX,
            "saturates"
        );
    }

    #[test]
    fn jitter_spreads_over_the_whole_range() {
        let ceiling = Duration::from_secs(1);
        let draws: Vec<_> = (0..2000)
            .map(|_| full_jitter(ceiling, rand::random()))
            .collect();
        let min = draws.iter().min().unwrap();
        let max = draws.iter().max().unwrap();
        let mean = draws.iter().sum::<Duration>() / 2000;
        // Uniform on [0, 1 s]: each bound fails with probability about e^-200.
        assert!(*min < 100 * MS, "{min:?}");
        assert!(*max > 900 * MS, "{max:?}");
        assert!(mean > 400 * MS && mean < 600 * MS, "{mean:?}");
    }

    #[test]
    fn jitter_reaches_both_ends() {
        let ceiling = 3 * MS;
        assert_eq!(full_jitter(ceiling, 0), Duration::ZERO);
        assert_eq!(full_jitter(ceiling, ceiling.as_nanos()), ceiling);
        assert_eq!(full_jitter(ceiling, ceiling.as_nanos() + 1), Duration::ZERO);
        let max = Duration::MAX;
        assert_eq!(full_jitter(max, max.as_nanos()), max);
        assert!(full_jitter(max, u128::MAX) <= max);
        assert_eq!(full_jitter(Duration::ZERO, u128::MAX), Duration::ZERO);
    }

    proptest! {
        #[test]
        fn every_delay_is_within_its_ceiling(
            base_ms in 0u64..10_000,
            cap_ms in 0u64..100_000,
            retry in 0u32..100,
            random in any::<u128>(),
        ) {
            let (base, cap) = (Duration::from_millis(base_ms), Duration::from_millis(cap_ms));
            let top = ceiling(base, cap, retry);
            prop_assert!(top <= cap);
            let n = retry.max(1);
            if n < 30 {
                prop_assert_eq!(top, (base * (1 << (n - 1))).min(cap));
            } else {
                let expected = if base.is_zero() { Duration::ZERO } else { cap };
                prop_assert_eq!(top, expected);
            }
            let delay = full_jitter(top, random);
            prop_assert!(delay <= top);
        }
    }

    fn headers(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::RETRY_AFTER, HeaderValue::from_str(value).unwrap());
        headers
    }

    #[test]
    fn retry_after_in_both_forms() {
        let now = httpdate::parse_http_date("Wed, 21 Oct 2015 07:28:00 GMT").unwrap();
        let cases = [
            ("3", Some(Duration::from_secs(3))),
            ("0", Some(Duration::ZERO)),
            (" 7 ", Some(Duration::from_secs(7))),
            (
                "99999999999999999999999",
                Some(Duration::from_secs(u64::MAX)),
            ),
            (
                "Wed, 21 Oct 2015 07:28:42 GMT",
                Some(Duration::from_secs(42)),
            ),
            ("Wed, 21 Oct 2015 07:27:00 GMT", Some(Duration::ZERO)),
            (
                "Wednesday, 21-Oct-15 07:29:00 GMT",
                Some(Duration::from_secs(60)),
            ),
            ("-1", None),
            ("1.5", None),
            ("soon", None),
            ("", None),
        ];
        for (value, expected) in cases {
            assert_eq!(retry_after(&headers(value), now), expected, "{value:?}");
        }
        assert_eq!(retry_after(&HeaderMap::new(), now), None);
    }
}
