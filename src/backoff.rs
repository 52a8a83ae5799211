//! Retry delays: exponential (or fixed) backoff with full, equal or no jitter, or the listed
//! delays of a `schedule` exactly; at least the server's `Retry-After` and never above the
//! policy's maximum (a schedule's longest delay). Also the reconnect backoff, from `broker`.

use std::time::Duration;

use rand::Rng;

use crate::config::{Jitter, RetryPolicy};

/// The delay before attempt `next` (2 = the first retry).
pub fn retry_delay(policy: &RetryPolicy, next: u32, retry_after: Option<Duration>, rng: &mut impl Rng) -> Duration {
    let ceiling = policy.ceiling(next);
    let jittered = match policy.jitter {
        Jitter::None => ceiling,
        Jitter::Full => ceiling.mul_f64(rng.random::<f64>()),
        Jitter::Equal => ceiling / 2 + (ceiling / 2).mul_f64(rng.random::<f64>()),
    };
    match retry_after {
        Some(hint) => jittered.max(hint).min(policy.max),
        None => jittered,
    }
}

// The reconnect backoff lives with the broker's failover, which uses it first; the runtime
// waits by it too.
pub use crate::broker::failover::reconnect_delay;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Backoff;
    use rand::SeedableRng;
    use rand::rngs::StdRng;
    use std::num::NonZeroU32;

    fn policy(jitter: Jitter) -> RetryPolicy {
        RetryPolicy {
            max_attempts: NonZeroU32::new(10).unwrap(),
            backoff: Backoff::Exponential,
            initial: Duration::from_secs(1),
            max: Duration::from_secs(30),
            multiplier: 2.0,
            jitter,
        }
    }

    #[test]
    fn jitter_bounds() {
        let mut rng = StdRng::seed_from_u64(7);
        for next in 2..=10 {
            for _ in 0..200 {
                let ceiling = policy(Jitter::None).ceiling(next);
                assert_eq!(retry_delay(&policy(Jitter::None), next, None, &mut rng), ceiling);
                let full = retry_delay(&policy(Jitter::Full), next, None, &mut rng);
                assert!(full <= ceiling);
                let equal = retry_delay(&policy(Jitter::Equal), next, None, &mut rng);
                assert!(equal >= ceiling / 2 && equal <= ceiling, "{equal:?} {ceiling:?}");
            }
        }
    }

    #[test]
    fn full_jitter_spreads() {
        let mut rng = StdRng::seed_from_u64(1);
        let delays: Vec<Duration> = (0..100).map(|_| retry_delay(&policy(Jitter::Full), 5, None, &mut rng)).collect();
        let below_half = delays.iter().filter(|d| **d < Duration::from_secs(4)).count();
        assert!((25..=75).contains(&below_half), "{below_half}");
    }

    #[test]
    fn retry_after_is_a_floor_capped_at_max() {
        let mut rng = StdRng::seed_from_u64(3);
        let p = policy(Jitter::Full);
        assert!(retry_delay(&p, 2, Some(Duration::from_secs(7)), &mut rng) >= Duration::from_secs(7));
        assert_eq!(retry_delay(&p, 2, Some(Duration::from_secs(3600)), &mut rng), Duration::from_secs(30));
    }

    /// Issue 13: a schedule's delays are used as listed, the last one repeating, with no jitter;
    /// Retry-After is a floor capped at the longest delay.
    #[test]
    fn a_schedule_is_exact_and_caps_retry_after_at_its_longest_delay() {
        let dir = tempfile::tempdir().expect("tempdir");
        let yaml = "version: 1\nqueues:\n  q:\n    handler: {webhook: {url: \"http://127.0.0.1:9/x\"}}\n    retry: {schedule: [1s, 30s, 5s], max_attempts: 6}\n";
        std::fs::write(dir.path().join("p.yaml"), yaml).expect("write");
        let validation = crate::config::load(&[dir.path().to_path_buf()]);
        let config = validation.config.unwrap_or_else(|| panic!("invalid: {:?}", validation.diagnostics));
        let p = &config.queues["q"].retry;
        let mut rng = StdRng::seed_from_u64(11);
        let secs = Duration::from_secs;
        for _ in 0..20 {
            let delays: Vec<Duration> = (2..=6).map(|next| retry_delay(p, next, None, &mut rng)).collect();
            assert_eq!(delays, [secs(1), secs(30), secs(5), secs(5), secs(5)]);
        }
        assert_eq!(retry_delay(p, 2, Some(secs(7)), &mut rng), secs(7));
        assert_eq!(retry_delay(p, 3, Some(secs(7)), &mut rng), secs(30));
        assert_eq!(retry_delay(p, 2, Some(secs(3600)), &mut rng), secs(30));
    }
}
