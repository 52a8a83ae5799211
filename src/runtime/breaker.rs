//! One queue's circuit breaker as a pure state machine: handler calls and their verdicts go
//! in with the time they ended, states come out. It owns no clock and does no IO; the
//! [`gate`](super::gate) drives it and turns its states into consuming or not.
//!
//! Closed: calls run; when, over the window, at least `min_calls` ran and `failure_rate` of
//! them said the receiver is unwell, it opens. Open: nothing runs until `open_for` has passed,
//! then half-open: one probe at a time. A probe the receiver answers closes it; a probe that
//! finds it still unwell opens it again for twice as long, at most [`MAX_OPEN_FACTOR`] times
//! `open_for`.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

use crate::config::CircuitBreaker;

/// The longest opening, as a multiple of the configured `open_for`.
pub const MAX_OPEN_FACTOR: u32 = 10;

/// An opening longer than the clock can add up to lasts this long instead.
const LONGEST_OPENING: Duration = Duration::from_secs(100 * 365 * 86_400);

/// The window is kept as this many buckets: memory stays constant however many calls run.
const BUCKETS: u32 = 10;

/// Where the breaker stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Closed,
    /// Nothing runs before `until`.
    Open {
        until: Instant,
    },
    /// One probe at a time decides.
    HalfOpen,
}

impl State {
    /// The value of `sluice_circuit_state` (0 closed, 1 half-open, 2 open).
    pub fn gauge(self) -> f64 {
        match self {
            State::Closed => 0.0,
            State::HalfOpen => 1.0,
            State::Open { .. } => 2.0,
        }
    }

    /// As `sluice status` and the logs name it.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Closed => "closed",
            State::HalfOpen => "half-open",
            State::Open { .. } => "open",
        }
    }
}

/// What a call's result says of the receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// It answered (success, or a failure of this message alone).
    Answered,
    /// No connection, a timeout, 429, 502, 503, 504.
    Unwell,
}

/// Whether a call may run now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Run it; `probe` when it is the half-open state's one probe.
    Run { probe: bool },
    /// Half-open and a probe is out: wait for its verdict.
    Wait,
    /// Open until then: hand the message back.
    Refuse { until: Instant },
}

/// Calls and unwell verdicts over the last `window`, in buckets.
#[derive(Debug)]
struct Window {
    width: Duration,
    span: Duration,
    /// (bucket start, calls, unwell), oldest first.
    buckets: VecDeque<(Instant, u32, u32)>,
}

impl Window {
    fn new(span: Duration) -> Window {
        let width = (span / BUCKETS).max(Duration::from_millis(1));
        Window { width, span, buckets: VecDeque::new() }
    }

    fn record(&mut self, now: Instant, unwell: bool) {
        while self.buckets.front().is_some_and(|(start, _, _)| now.saturating_duration_since(*start) >= self.span) {
            self.buckets.pop_front();
        }
        match self.buckets.back_mut() {
            Some((start, calls, bad)) if now.saturating_duration_since(*start) < self.width => {
                *calls += 1;
                *bad += u32::from(unwell);
            }
            _ => self.buckets.push_back((now, 1, u32::from(unwell))),
        }
    }

    /// (calls, unwell) in the window.
    fn totals(&self) -> (u32, u32) {
        self.buckets.iter().fold((0, 0), |(c, b), (_, calls, bad)| (c + calls, b + bad))
    }

    fn clear(&mut self) {
        self.buckets.clear();
    }
}

/// One queue's breaker.
#[derive(Debug)]
pub struct Breaker {
    settings: CircuitBreaker,
    state: State,
    window: Window,
    /// How long the next opening lasts.
    next_open: Duration,
    /// Half-open with a probe out.
    probing: bool,
}

impl Breaker {
    /// A closed breaker.
    pub fn new(settings: CircuitBreaker) -> Breaker {
        Breaker {
            settings,
            state: State::Closed,
            window: Window::new(settings.window),
            next_open: settings.open_for,
            probing: false,
        }
    }

    pub fn state(&self) -> State {
        self.state
    }

    /// Whether a call may start now.
    pub fn admit(&mut self) -> Admit {
        match self.state {
            State::Closed => Admit::Run { probe: false },
            State::Open { until } => Admit::Refuse { until },
            State::HalfOpen if self.probing => Admit::Wait,
            State::HalfOpen => {
                self.probing = true;
                Admit::Run { probe: true }
            }
        }
    }

    /// An admitted call did not reach the handler after all (a duplicate, a busy key): a
    /// probe's turn goes to the next message.
    pub fn withdraw(&mut self, probe: bool) {
        if probe {
            self.probing = false;
        }
    }

    /// A call ended at `now`; the new state when this changed it. Calls that started before
    /// the breaker opened and end while it is open or half-open say nothing new.
    pub fn record(&mut self, now: Instant, probe: bool, verdict: Verdict) -> Option<State> {
        match (self.state, probe) {
            (State::Closed, _) => {
                self.window.record(now, verdict == Verdict::Unwell);
                let (calls, unwell) = self.window.totals();
                let tripped = calls >= self.settings.min_calls
                    && f64::from(unwell) >= self.settings.failure_rate * f64::from(calls);
                tripped.then(|| self.open(now))
            }
            (State::HalfOpen, true) => {
                self.probing = false;
                match verdict {
                    Verdict::Unwell => {
                        let cap = self.settings.open_for.saturating_mul(MAX_OPEN_FACTOR);
                        self.next_open = self.next_open.saturating_mul(2).min(cap);
                        Some(self.open(now))
                    }
                    Verdict::Answered => {
                        self.next_open = self.settings.open_for;
                        self.window.clear();
                        self.state = State::Closed;
                        Some(self.state)
                    }
                }
            }
            _ => None,
        }
    }

    /// Moves an opening that is over to half-open; the new state when it did.
    pub fn tick(&mut self, now: Instant) -> Option<State> {
        match self.state {
            State::Open { until } if now >= until => {
                self.state = State::HalfOpen;
                self.probing = false;
                Some(self.state)
            }
            _ => None,
        }
    }

    fn open(&mut self, now: Instant) -> State {
        self.window.clear();
        // `open_for` is the file's, unbounded: one past what the clock holds is open until resumed
        // in all but name (a century), never a panic.
        let until = now.checked_add(self.next_open).unwrap_or_else(|| now + LONGEST_OPENING);
        self.state = State::Open { until };
        self.state
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn settings() -> CircuitBreaker {
        CircuitBreaker { failure_rate: 0.5, min_calls: 4, window: 10 * S, open_for: 2 * S }
    }

    /// Issue 13: the breaker's transitions, step by step, with injected time.
    #[test]
    fn opens_on_unwell_share_probes_one_at_a_time_and_grows_the_opening() {
        use Verdict::{Answered as Ok_, Unwell as Bad};
        let t0 = Instant::now();
        let at = |secs: f64| t0 + Duration::from_secs_f64(secs);
        let mut b = Breaker::new(settings());
        // Under min_calls: three unwell calls do not open it.
        for s in [0.0, 0.1, 0.2] {
            assert_eq!(b.record(at(s), false, Bad), None);
        }
        assert_eq!(b.admit(), Admit::Run { probe: false });
        // The fourth call: 4 of 4 unwell.
        assert_eq!(b.record(at(0.3), false, Bad), Some(State::Open { until: at(2.3) }));
        assert_eq!(b.admit(), Admit::Refuse { until: at(2.3) });
        // Calls that were in flight when it opened change nothing.
        assert_eq!(b.record(at(0.4), false, Ok_), None);
        assert_eq!(b.tick(at(2.2)), None);
        assert_eq!(b.tick(at(2.3)), Some(State::HalfOpen));
        // One probe at a time; the rest wait.
        assert_eq!(b.admit(), Admit::Run { probe: true });
        assert_eq!(b.admit(), Admit::Wait);
        // A failed probe reopens for twice as long.
        assert_eq!(b.record(at(2.5), true, Bad), Some(State::Open { until: at(6.5) }));
        assert_eq!(b.tick(at(6.5)), Some(State::HalfOpen));
        // A probe withdrawn (a duplicate, say) hands the turn to the next message.
        assert_eq!(b.admit(), Admit::Run { probe: true });
        b.withdraw(true);
        assert_eq!(b.admit(), Admit::Run { probe: true });
        assert_eq!(b.record(at(7.0), true, Bad), Some(State::Open { until: at(15.0) }));
        // Growing, capped at ten times open_for.
        let mut now = 15.0;
        for expected in [16.0, 20.0, 20.0] {
            assert_eq!(b.tick(at(now)), Some(State::HalfOpen));
            assert_eq!(b.admit(), Admit::Run { probe: true });
            assert_eq!(b.record(at(now), true, Bad), Some(State::Open { until: at(now + expected) }));
            now += expected;
        }
        // A probe the receiver answers closes it, and the next opening is short again.
        assert_eq!(b.tick(at(now)), Some(State::HalfOpen));
        assert_eq!(b.admit(), Admit::Run { probe: true });
        assert_eq!(b.record(at(now), true, Ok_), Some(State::Closed));
        assert_eq!(b.admit(), Admit::Run { probe: false });
        for i in 0..3 {
            assert_eq!(b.record(at(now + 0.1 * f64::from(i)), false, Bad), None, "the window restarted when it closed");
        }
        assert_eq!(b.record(at(now + 0.5), false, Bad), Some(State::Open { until: at(now + 2.5) }));
    }

    /// Issue 31 item 5: an `open_for` past what the clock can add (the file's
    /// `18446744073709551615s`) opens the breaker for a century, where it panicked.
    #[test]
    fn an_opening_past_the_clock_is_a_century() {
        let t0 = Instant::now();
        let mut b = Breaker::new(CircuitBreaker { open_for: Duration::MAX, ..settings() });
        for i in 0..3 {
            assert_eq!(b.record(t0 + i * S, false, Verdict::Unwell), None);
        }
        let opened = b.record(t0 + 3 * S, false, Verdict::Unwell);
        assert_eq!(opened, Some(State::Open { until: t0 + 3 * S + LONGEST_OPENING }));
        assert_eq!(b.tick(t0 + 3 * S + LONGEST_OPENING), Some(State::HalfOpen));
        assert_eq!(b.admit(), Admit::Run { probe: true });
        let reopened = b.record(t0 + 4 * S + LONGEST_OPENING, true, Verdict::Unwell);
        assert!(matches!(reopened, Some(State::Open { .. })), "{reopened:?}");
    }

    #[test]
    fn the_share_counts_only_calls_within_the_window() {
        let t0 = Instant::now();
        let at = |secs: u64| t0 + Duration::from_secs(secs);
        // (second, verdict, opens)
        type Case<'a> = (&'a str, &'a [(u64, Verdict)], bool);
        let cases: &[Case] = &[
            (
                "one bad message among good ones",
                &[
                    (0, Verdict::Answered),
                    (1, Verdict::Unwell),
                    (2, Verdict::Answered),
                    (3, Verdict::Answered),
                    (4, Verdict::Answered),
                ],
                false,
            ),
            (
                "exactly the rate",
                &[(0, Verdict::Answered), (1, Verdict::Unwell), (2, Verdict::Answered), (3, Verdict::Unwell)],
                true,
            ),
            (
                "old successes leave the window",
                &[
                    (0, Verdict::Answered),
                    (1, Verdict::Answered),
                    (2, Verdict::Answered),
                    (13, Verdict::Unwell),
                    (14, Verdict::Unwell),
                    (15, Verdict::Answered),
                    (16, Verdict::Unwell),
                ],
                true,
            ),
            (
                "old failures leave the window",
                &[
                    (0, Verdict::Unwell),
                    (1, Verdict::Unwell),
                    (12, Verdict::Answered),
                    (13, Verdict::Answered),
                    (14, Verdict::Unwell),
                ],
                false,
            ),
        ];
        for (name, calls, opens) in cases {
            let mut b = Breaker::new(settings());
            let opened = calls.iter().any(|(s, v)| b.record(at(*s), false, *v).is_some());
            assert_eq!(opened, *opens, "{name}");
        }
    }

    #[test]
    fn gauge_values_follow_the_design() {
        let t = Instant::now();
        assert_eq!([State::Closed.gauge(), State::HalfOpen.gauge(), State::Open { until: t }.gauge()], [0.0, 1.0, 2.0]);
    }
}
