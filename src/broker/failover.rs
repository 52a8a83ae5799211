//! Several addresses of one broker (the nodes of a RabbitMQ cluster): which one to try next,
//! and when to pause first. A lost session moves on to the next node at once; the pause
//! (full-jitter backoff) comes only once every node has failed in a row, so a dead node costs
//! one connect attempt and a cluster that is down entirely is not hammered. Once a broker has
//! been seen, the pause between connection attempts stays short ([`SEEN_RECONNECT_CAP`]): a
//! restart is over in seconds, and a runner must come back with the broker, not long after
//! it. Sessions that open and drop at once keep the long cap: each costs the broker a session.
//!
//! [`Rotation`] is pure bookkeeping on injected time and randomness; [`Failover`] connects by
//! it, through a function given the node's index.

use std::future::Future;
use std::time::Duration;

use rand::Rng;
use tokio::time::Instant;
use tracing::{info, warn};

use super::{Broker, BrokerError};

/// The longest pause between two rounds of attempts, before any session opened (a broker
/// that may not be there at all).
pub const RECONNECT_CAP: Duration = Duration::from_secs(30);

/// The longest pause between two rounds of failed connection attempts once a session has
/// opened: the broker exists and is most likely restarting, and an attempt it refuses costs it
/// little. (A pause grown to 23.8 s brought a runner back 10 s after its node.)
pub const SEEN_RECONNECT_CAP: Duration = Duration::from_secs(5);

/// A session that lived this long was a success: its loss starts the count of failures afresh.
pub const STABLE_SESSION: Duration = Duration::from_secs(30);

/// Full-jitter exponential backoff for reconnecting and re-publishing: uniform up to a ceiling
/// of 100ms doubling per failure, at most `cap`. Full jitter spreads many runners that lost the
/// same broker at the same moment, so they do not come back together.
pub fn reconnect_delay(failures: u32, cap: Duration, rng: &mut impl Rng) -> Duration {
    let ceiling = Duration::from_millis(100).saturating_mul(1 << failures.min(16)).min(cap);
    ceiling.mul_f64(rng.random::<f64>())
}

/// Where the next attempt goes, and what failed before it.
#[derive(Debug, Clone)]
pub struct Rotation {
    nodes: usize,
    /// The node the next attempt goes to.
    next: usize,
    /// Attempts and sessions that failed in a row, across nodes.
    misses: u32,
    /// Whole rounds (every node once) that failed in a row: the backoff's exponent.
    rounds: u32,
    /// The node of the live session, and since when.
    session: Option<(usize, Instant)>,
    /// Whether a session ever opened.
    seen: bool,
    /// Whether the last failure was a session that opened and did not last (the broker takes
    /// connections and drops them), rather than an attempt that could not connect.
    dropped: bool,
}

impl Rotation {
    /// A rotation over `nodes` addresses (at least one), starting with the first.
    pub fn new(nodes: usize) -> Rotation {
        Rotation { nodes: nodes.max(1), next: 0, misses: 0, rounds: 0, session: None, seen: false, dropped: false }
    }

    /// The node to try next, and how long to wait before trying it: nothing unless every node
    /// has just failed in a row.
    pub fn next(&self, rng: &mut impl Rng) -> (usize, Duration) {
        let cap = if self.seen && !self.dropped { SEEN_RECONNECT_CAP } else { RECONNECT_CAP };
        let wait = match self.round_failed() {
            true => reconnect_delay(self.rounds, cap, rng),
            false => Duration::ZERO,
        };
        (self.next, wait)
    }

    /// Whether the misses so far close a whole round of failures.
    fn round_failed(&self) -> bool {
        self.misses > 0 && self.misses.is_multiple_of(self.count())
    }

    fn count(&self) -> u32 {
        u32::try_from(self.nodes).unwrap_or(u32::MAX)
    }

    fn missed(&mut self, node: usize) {
        self.misses = self.misses.saturating_add(1);
        if self.round_failed() {
            self.rounds = self.rounds.saturating_add(1);
        }
        self.next = (node + 1) % self.nodes;
    }

    /// The attempt at `node` failed (it could not connect, or the session failed before it
    /// was of use).
    pub fn failed(&mut self, node: usize) {
        self.session = None;
        self.dropped = false;
        self.missed(node);
    }

    /// A session with `node` is up.
    pub fn connected(&mut self, node: usize, now: Instant) {
        self.session = Some((node, now));
        self.seen = true;
    }

    /// The live session ended. One that lived [`STABLE_SESSION`] was a success, so the next
    /// node is tried at once; a short one counts as a failure of its node.
    pub fn lost(&mut self, now: Instant) {
        let Some((node, since)) = self.session.take() else { return };
        if now.saturating_duration_since(since) >= STABLE_SESSION {
            self.misses = 0;
            self.rounds = 0;
            self.dropped = false;
            self.next = (node + 1) % self.nodes;
        } else {
            self.dropped = true;
            self.missed(node);
        }
    }
}

/// Opens sessions with the nodes of one broker, in the order of a [`Rotation`].
pub struct Failover<C> {
    names: Vec<String>,
    connect: C,
    rotation: Rotation,
    /// Whole rounds of failures after which [`Failover::open`] gives up (None: never).
    give_up_after: Option<u32>,
    /// Whether any session opened: after one has, a refusal is worth retrying (a password
    /// rotated, a virtual host being made again), before it, it is a mistake in the command.
    ever_connected: bool,
}

impl<B, F, C> Failover<C>
where
    B: Broker,
    F: Future<Output = Result<B, BrokerError>>,
    C: Fn(usize) -> F,
{
    /// Sessions with the nodes `names` (for logs: no passwords), opened by `connect(index)`.
    pub fn new(names: Vec<String>, connect: C) -> Failover<C> {
        let rotation = Rotation::new(names.len());
        Failover { names, connect, rotation, give_up_after: None, ever_connected: false }
    }

    /// Gives up once every node has failed `rounds` times in a row, with the last error: for a
    /// command that a person waits on.
    pub fn give_up_after(mut self, rounds: u32) -> Failover<C> {
        self.give_up_after = Some(rounds);
        self
    }

    /// The node names, in the order they are tried.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Opens a session with the next node that answers; pauses only between whole rounds of
    /// failures. Before the first session, a refusal that no other node would change
    /// (credentials, a missing virtual host) returns at once; a damaged store, always.
    pub async fn open(&mut self) -> Result<(B, usize), BrokerError> {
        loop {
            let (node, wait) = self.rotation.next(&mut rand::rng());
            if !wait.is_zero() {
                info!(retry_in = ?wait, "every broker node failed; pausing before the next round");
                tokio::time::sleep(wait).await;
            }
            match (self.connect)(node).await {
                Ok(broker) => {
                    self.rotation.connected(node, Instant::now());
                    self.ever_connected = true;
                    return Ok((broker, node));
                }
                Err(e) if e.is_damaged() || (e.is_fatal() && !self.ever_connected) => return Err(e),
                Err(e) => {
                    warn!(node = %self.names[node], error = %e, "broker node unreachable");
                    self.rotation.failed(node);
                    if self.given_up() {
                        return Err(e);
                    }
                }
            }
        }
    }

    /// The session last opened is gone (`error` says why): the next [`Failover::open`] starts
    /// with the next node, and a session that did not last counts as a failure of its node.
    /// For a command that gives up, the error back once failed attempts and such sessions
    /// have come in a row as many times as it allows.
    pub fn lost(&mut self, error: BrokerError) -> Result<(), BrokerError> {
        self.rotation.lost(Instant::now());
        if self.given_up() { Err(error) } else { Ok(()) }
    }

    /// Whether the failures in a row reach the rounds a command allows.
    fn given_up(&self) -> bool {
        self.give_up_after.is_some_and(|rounds| self.rotation.misses >= rounds.saturating_mul(self.rotation.count()))
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;

    #[test]
    fn reconnect_is_full_jitter_growing_to_the_cap() {
        let mut rng = StdRng::seed_from_u64(5);
        let cap = Duration::from_secs(30);
        for (failures, ceiling) in [(0, 100), (1, 200), (4, 1_600), (8, 25_600), (9, 30_000), (40, 30_000)] {
            let ceiling = Duration::from_millis(ceiling);
            let delays: Vec<Duration> = (0..400).map(|_| reconnect_delay(failures, cap, &mut rng)).collect();
            assert!(delays.iter().all(|d| *d <= ceiling), "{failures}: over {ceiling:?}");
            // Full jitter: the whole range is used, the lowest quarter included.
            let low = delays.iter().filter(|d| **d < ceiling / 4).count();
            let high = delays.iter().filter(|d| **d > ceiling * 3 / 4).count();
            assert!((60..=140).contains(&low) && (60..=140).contains(&high), "{failures}: {low} low, {high} high");
        }
    }

    fn rng() -> StdRng {
        StdRng::seed_from_u64(20)
    }

    /// Issue 20: a lost session goes to the next node at once; a dead node costs one attempt.
    #[test]
    fn a_lost_node_is_followed_by_the_next_at_once() {
        let t0 = Instant::now();
        let mut r = Rotation::new(3);
        assert_eq!(r.next(&mut rng()), (0, Duration::ZERO));
        r.connected(0, t0);
        r.lost(t0 + Duration::from_secs(600));
        assert_eq!(r.next(&mut rng()), (1, Duration::ZERO), "the next node, no pause");
        r.failed(1);
        assert_eq!(r.next(&mut rng()), (2, Duration::ZERO), "one more node left in the round");
        r.connected(2, t0 + Duration::from_secs(601));
        r.lost(t0 + Duration::from_secs(2000));
        assert_eq!(r.next(&mut rng()), (0, Duration::ZERO), "wraps around");
    }

    /// Issue 20: the pause comes only after every node failed in a row, and grows per round.
    #[test]
    fn the_backoff_comes_after_a_whole_round_of_failures() {
        let mut r = Rotation::new(3);
        let mut rng = rng();
        for node in [0, 1] {
            assert_eq!(r.next(&mut rng), (node, Duration::ZERO));
            r.failed(node);
        }
        assert_eq!(r.next(&mut rng).1, Duration::ZERO);
        r.failed(2);
        // Full jitter under a ceiling of 100 ms × 2^rounds: round 1 waits at most 200 ms.
        let (node, wait) = r.next(&mut rng);
        assert_eq!(node, 0);
        assert!(wait > Duration::ZERO && wait <= Duration::from_millis(200), "{wait:?}");
        for node in 0..3 {
            r.failed(node);
        }
        let ceilings: Vec<Duration> = (0..200).map(|_| r.next(&mut rng).1).collect();
        assert!(ceilings.iter().all(|w| *w <= Duration::from_millis(400)));
        assert!(ceilings.iter().any(|w| *w > Duration::from_millis(200)), "round 2's ceiling is higher");
    }

    /// Issue 20: nodes that accept and then drop every session are not hammered: a short
    /// session counts as a failure of its node; a stable one starts the count afresh.
    #[test]
    fn short_sessions_count_as_failures_and_stable_ones_reset() {
        let t0 = Instant::now();
        let mut r = Rotation::new(2);
        let mut rng = rng();
        r.connected(0, t0);
        r.lost(t0 + Duration::from_secs(1));
        assert_eq!(r.next(&mut rng), (1, Duration::ZERO));
        r.connected(1, t0 + Duration::from_secs(1));
        r.lost(t0 + Duration::from_secs(2));
        let (node, wait) = r.next(&mut rng);
        assert_eq!(node, 0);
        assert!(wait > Duration::ZERO, "both nodes dropped their sessions at once: pause");
        r.connected(0, t0 + Duration::from_secs(3));
        r.lost(t0 + Duration::from_secs(3) + STABLE_SESSION);
        assert_eq!(r.next(&mut rng), (1, Duration::ZERO), "a stable session resets the count");
    }

    /// Issue 31: once a broker has been seen, a restart that outlasts many rounds pauses at
    /// most five seconds between connection attempts (full jitter under that ceiling), where
    /// the pause had grown to 23.8 s. Before any session, and while sessions open and drop at
    /// once, the pause grows to thirty.
    #[test]
    fn once_a_broker_was_seen_the_pause_between_attempts_stays_short() {
        let t0 = Instant::now();
        let mut rng = rng();
        // The pause before each of `n` attempts at one node, each failing.
        let failing = |r: &mut Rotation, rng: &mut StdRng, n: usize| -> Vec<Duration> {
            (0..n)
                .map(|_| {
                    r.failed(0);
                    r.next(rng).1
                })
                .collect()
        };
        let mut never = Rotation::new(1);
        let before = failing(&mut never, &mut rng, 40);
        assert!(before.iter().any(|w| *w > SEEN_RECONNECT_CAP), "{before:?}");
        assert!(before.iter().all(|w| *w <= RECONNECT_CAP), "{before:?}");

        let mut flapping = Rotation::new(1);
        let dropped: Vec<Duration> = (0..40u64)
            .map(|i| {
                flapping.connected(0, t0 + Duration::from_secs(i));
                flapping.lost(t0 + Duration::from_secs(i) + Duration::from_millis(10));
                flapping.next(&mut rng).1
            })
            .collect();
        assert!(dropped.iter().any(|w| *w > SEEN_RECONNECT_CAP), "sessions dropped at once: {dropped:?}");

        let mut seen = Rotation::new(1);
        seen.connected(0, t0);
        seen.lost(t0 + STABLE_SESSION);
        let after = failing(&mut seen, &mut rng, 200);
        assert!(after.iter().all(|w| *w <= SEEN_RECONNECT_CAP), "{after:?}");
        let late = &after[10..];
        let low = late.iter().filter(|w| **w < SEEN_RECONNECT_CAP / 4).count();
        let high = late.iter().filter(|w| **w > SEEN_RECONNECT_CAP * 3 / 4).count();
        assert!(low >= 20 && high >= 20, "full jitter under the cap: {low} low, {high} high of {}", late.len());
    }

    /// One address (the usual single node): a stable session lost is retried at once, then
    /// every failure pauses, as before clusters.
    #[test]
    fn one_node_retries_once_at_once_then_backs_off() {
        let t0 = Instant::now();
        let mut r = Rotation::new(1);
        let mut rng = rng();
        r.connected(0, t0);
        r.lost(t0 + STABLE_SESSION);
        assert_eq!(r.next(&mut rng), (0, Duration::ZERO));
        r.failed(0);
        let (node, wait) = r.next(&mut rng);
        assert_eq!(node, 0);
        assert!(wait > Duration::ZERO);
        // Losing a session that was never connected changes nothing.
        let before = r.clone();
        r.lost(t0);
        assert_eq!(format!("{before:?}"), format!("{r:?}"));
    }
}
