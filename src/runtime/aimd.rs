//! Adaptive concurrency for one queue, as a pure controller (after Vector's ARC): handler
//! calls' round-trip times and whether they said "overloaded" go in with the time they ended;
//! the in-flight limit comes out. It owns no clock and does no IO; the
//! [`gate`](super::gate) enforces the limit.
//!
//! An interval is about one round trip. The first 429/503/timeout in one cuts the limit at
//! once; [`RISING_INTERVALS`] intervals in a row whose fastest round trip is above
//! [`RTT_TOLERANCE`] times the usual one cut it; an interval that used the whole limit and saw neither raises it. It starts at 1 and doubles (slow
//! start, so a capable receiver is reached in a few round trips, where Vector's ARC creeps
//! up by one) until the first cut; from then on it adds one per interval and cuts by
//! [`DECREASE`]. Never above the queue's `max`, never below 1. A receiver that gets slower
//! for good is cut down to 1, where its new latency becomes the usual one.

use std::time::Duration;

use tokio::time::Instant;

/// A cut after slow start keeps this share of the limit.
pub const DECREASE: f64 = 0.9;

/// A fastest round trip this many times the usual one, [`RISING_INTERVALS`] intervals in a
/// row, says the receiver is queueing.
pub const RTT_TOLERANCE: f64 = 2.0;
pub const RISING_INTERVALS: u32 = 2;

/// How much of a calm interval's fastest round trip goes into the usual one.
const SMOOTHING: f64 = 0.25;

/// Only intervals within this factor of the usual round trip teach it: learning from slower
/// ones would take the latency our own concurrency adds (a few percent per step) for the
/// receiver's, and let the limit creep up past its capacity.
const LEARN_BELOW: f64 = 1.1;

/// Intervals are about one round trip, within these bounds.
const MIN_INTERVAL: Duration = Duration::from_millis(10);
const MAX_INTERVAL: Duration = Duration::from_secs(1);

/// One queue's controller.
#[derive(Debug)]
pub struct Aimd {
    max: f64,
    limit: f64,
    slow_start: bool,
    /// The usual round trip (seconds), smoothed over intervals.
    usual_rtt: Option<f64>,
    interval_start: Instant,
    /// This interval: the fastest round trip of a call the receiver answered (seconds), and
    /// what was seen.
    fastest: Option<f64>,
    overloaded: bool,
    saturated: bool,
    /// Intervals in a row whose fastest round trip was over the tolerance.
    rising: u32,
}

impl Aimd {
    /// A limit of 1 that may grow to `max`.
    pub fn new(max: u16, now: Instant) -> Aimd {
        Aimd {
            max: f64::from(max.max(1)),
            limit: 1.0,
            slow_start: true,
            usual_rtt: None,
            interval_start: now,
            fastest: None,
            overloaded: false,
            saturated: false,
            rising: 0,
        }
    }

    /// How many calls may be in flight.
    pub fn limit(&self) -> usize {
        // 1 <= limit <= max <= u16::MAX: the cast cannot truncate.
        self.limit.floor() as usize
    }

    /// Every slot was taken (or a call had to wait for one): the limit, not the traffic, is
    /// what bounds concurrency, so raising it could help.
    pub fn saturated(&mut self) {
        self.saturated = true;
    }

    /// A call ended at `now` after `rtt`; `overloaded` when it said so (429, 503, a timeout,
    /// no connection). The new limit when this changed it.
    pub fn record(&mut self, now: Instant, rtt: Duration, overloaded: bool) -> Option<usize> {
        let before = self.limit();
        if overloaded {
            // Cut at once, once per interval: a receiver at capacity answers the calls above it
            // at once, so waiting for the interval's end would let those slots churn
            // rejections.
            if !self.overloaded {
                self.cut();
            }
            self.overloaded = true;
        } else {
            let rtt = rtt.as_secs_f64();
            self.fastest = Some(self.fastest.map_or(rtt, |f| f.min(rtt)));
        }
        let fastest = self.fastest;
        let length = self.usual_rtt.or(fastest).map_or(MIN_INTERVAL, |secs| {
            Duration::try_from_secs_f64(secs).unwrap_or(MAX_INTERVAL).clamp(MIN_INTERVAL, MAX_INTERVAL)
        });
        if now.saturating_duration_since(self.interval_start) >= length {
            self.end_interval(now, fastest);
        }
        (self.limit() != before).then(|| self.limit())
    }

    /// Decides on the interval that ends at `now`, whose fastest round trip was `fastest`.
    /// The fastest, not the mean: a receiver that queues slows every call down, while a
    /// runner short of CPU (a busy machine) delays some of them, which must not cut the limit.
    fn end_interval(&mut self, now: Instant, fastest: Option<f64>) {
        // At a limit of 1 there is nothing left to cut: the latency is the receiver's own
        // (it got slower), and becomes the usual one.
        let at_floor = self.limit() == 1;
        let slow = matches!((self.usual_rtt, fastest), (Some(usual), Some(f)) if f > usual * RTT_TOLERANCE);
        self.rising = if slow { self.rising + 1 } else { 0 };
        if self.overloaded {
            // Already cut when it happened.
        } else if self.rising >= RISING_INTERVALS {
            self.rising = 0;
            self.cut();
        } else if slow {
            // One slow interval may be the runner's own hiccup: hold the limit.
        } else if self.saturated {
            self.limit = if self.slow_start { self.limit * 2.0 } else { self.limit + 1.0 }.min(self.max);
        }
        let calm = |usual: f64, f: f64| (!self.overloaded && f <= usual * LEARN_BELOW) || at_floor;
        if let Some(f) = fastest {
            self.usual_rtt = match self.usual_rtt {
                None => Some(f),
                Some(usual) if calm(usual, f) => Some(usual + SMOOTHING * (f - usual)),
                kept => kept,
            };
        }
        self.interval_start = now;
        self.fastest = None;
        self.overloaded = false;
        self.saturated = false;
    }

    /// Halves the limit at the end of slow start, then takes [`DECREASE`] of it.
    fn cut(&mut self) {
        self.limit = if self.slow_start { self.limit / 2.0 } else { self.limit * DECREASE }.max(1.0);
        self.slow_start = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A receiver simulated in steps of one round trip: `limit` calls per step, every slot
    /// used; it serves `capacity` at once and answers the rest 503 at once; its round trip
    /// is `rtt(in_flight)`. Returns (limit, calls, 503s) per step.
    fn simulate(
        max: u16,
        capacity: usize,
        steps: usize,
        mut rtt: impl FnMut(usize) -> Duration,
    ) -> Vec<(usize, usize, usize)> {
        let mut now = Instant::now();
        let mut aimd = Aimd::new(max, now);
        let mut out = Vec::new();
        for _ in 0..steps {
            let limit = aimd.limit();
            let served = limit.min(capacity);
            let step = rtt(served);
            aimd.saturated();
            now += step;
            for i in 0..limit {
                aimd.record(now, step, i >= capacity);
            }
            out.push((limit, limit, limit - served));
        }
        out
    }

    /// Issue 13: against a receiver serving 20 at once (503 beyond) in 20 ms, the limit
    /// settles near 20 within a few hundred round trips, and afterwards under 5 % of calls
    /// get a 503.
    #[test]
    fn settles_near_the_receivers_capacity_with_few_rejections() {
        let steps = simulate(64, 20, 750, |_| Duration::from_millis(20));
        assert_eq!(steps[0].0, 1, "starts low");
        // Slow start reaches the capacity in a handful of round trips.
        let first_at_capacity = steps.iter().position(|s| s.0 >= 20).expect("reaches 20");
        assert!(first_at_capacity <= 6, "took {first_at_capacity} round trips");
        let settled = &steps[250..];
        let limits: Vec<usize> = settled.iter().map(|s| s.0).collect();
        assert!(limits.iter().all(|l| (17..=22).contains(l)), "{limits:?}");
        let (calls, rejected) = settled.iter().fold((0, 0), |(c, r), s| (c + s.1, r + s.2));
        assert!((rejected as f64) < 0.05 * calls as f64, "{rejected} of {calls} rejected");
        // Throughput: at least 0.9 of what the receiver can serve.
        let served: usize = settled.iter().map(|s| s.1 - s.2).sum();
        assert!(served as f64 >= 0.9 * 20.0 * settled.len() as f64, "{served}");
    }

    #[test]
    fn never_exceeds_max() {
        let steps = simulate(8, 1000, 200, |_| Duration::from_millis(5));
        assert_eq!(steps.iter().map(|s| s.0).max(), Some(8));
        assert_eq!(steps.last().map(|s| s.0), Some(8));
    }

    /// A receiver that queues instead of rejecting: its round trip grows with what it holds
    /// beyond 10. Rising latency alone keeps the limit from running away: it stays where the
    /// round trip is under twice the usual.
    #[test]
    fn rising_latency_cuts_the_limit() {
        let steps = simulate(64, usize::MAX, 600, |n| Duration::from_millis(20) * (n.max(10) as u32) / 10);
        let settled: Vec<usize> = steps[300..].iter().map(|s| s.0).collect();
        assert!(settled.iter().all(|l| (5..=26).contains(l)), "{settled:?}");
    }

    /// A receiver that gets three times slower for good, whatever it holds: the limit is
    /// cut, learns the new latency at 1, and grows back.
    #[test]
    fn a_receiver_slower_for_good_is_relearnt() {
        let mut now = Instant::now();
        let mut aimd = Aimd::new(64, now);
        for step in 0..1500 {
            let rtt = Duration::from_millis(if step < 100 { 20 } else { 60 });
            aimd.saturated();
            now += rtt;
            for _ in 0..aimd.limit() {
                aimd.record(now, rtt, false);
            }
        }
        assert!(aimd.limit() >= 32, "{}", aimd.limit());
    }

    /// A busy runner delays some calls (a third of them three times over here); the
    /// receiver, which has room, is not to blame, and the limit still grows to max.
    #[test]
    fn some_slow_calls_are_noise_not_queueing() {
        let mut now = Instant::now();
        let mut aimd = Aimd::new(64, now);
        for _ in 0..200 {
            aimd.saturated();
            now += Duration::from_millis(20);
            for i in 0..aimd.limit() {
                let rtt = Duration::from_millis(if i % 3 == 2 { 60 } else { 20 });
                aimd.record(now, rtt, false);
            }
        }
        assert_eq!(aimd.limit(), 64);
    }

    /// A whole interval slow now and then (the runner stalled) holds the limit, never cuts it.
    #[test]
    fn a_single_slow_interval_is_a_hiccup() {
        let mut step = 0;
        let steps = simulate(64, usize::MAX, 300, |_| {
            step += 1;
            Duration::from_millis(if step % 10 == 0 { 100 } else { 20 })
        });
        assert_eq!(steps.last().map(|s| s.0), Some(64));
        assert!(steps.windows(2).all(|w| w[1].0 >= w[0].0), "never cut");
    }

    #[test]
    fn an_unsaturated_limit_does_not_grow() {
        let mut now = Instant::now();
        let mut aimd = Aimd::new(64, now);
        for _ in 0..100 {
            now += Duration::from_millis(20);
            assert_eq!(aimd.record(now, Duration::from_millis(20), false), None);
        }
        assert_eq!(aimd.limit(), 1);
    }
}
