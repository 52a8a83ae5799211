//! What the console shows of each queue's recent work, kept in memory: the last N attempts
//! (a ring buffer per queue) and, per 10-second bucket over the last 15 minutes, how many
//! messages were handled, skipped as duplicates, retried and dead-lettered and how long the
//! handler took (a coarse histogram, for p50 and p99); and what the runtime is doing with it
//! now ([`Live`]: in flight, breaker, concurrency limit), as values the admin port reads
//! without rendering and parsing the runner's own `/metrics`.
//!
//! Recorded where a delivery's outcome is emitted (`runtime::events`), read by the admin port.
//! A record is one short lock of the queue's own log (no IO, no allocation beyond the attempt
//! itself); reads copy out under the same lock. Nothing here is persisted: a restart starts
//! empty, and another runner has its own.
//!
//! What an attempt keeps comes from outside (ids, keys, receivers' answers), so it is bounded:
//! texts longer than [`ID_BYTES`] or [`TEXT_BYTES`] are cut and say so, and a queue's attempts
//! take at most [`RING_BYTES`] as the API serves them, the oldest let go first.

use std::collections::{HashMap, VecDeque};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::Serialize;

use super::clock::now_ms;

/// Attempts kept per queue unless `--admin-attempts` says otherwise.
pub const DEFAULT_CAPACITY: usize = 200;

/// The most bytes of a message id, an idempotency key or a trace id an attempt keeps.
pub const ID_BYTES: usize = 256;

/// The most bytes of an error or of an excerpt (invalid UTF-8 of a response replaced, which
/// can triple its [`Observed::BYTES`](crate::handler::Observed::BYTES)) an attempt keeps.
pub const TEXT_BYTES: usize = 4096;

/// The most bytes a queue's attempts take as JSON (what `/attempts` answers, and more than they
/// hold in memory): the oldest are let go first, even while fewer than the capacity are kept.
pub const RING_BYTES: usize = 2 << 20;

/// The width of one bucket of the series.
pub const BUCKET: Duration = Duration::from_secs(10);

/// Buckets kept: 15 minutes.
pub const BUCKETS: usize = 90;

/// Latency classes of the histogram: class `i` holds latencies up to `0.5 ms × √2^(i+1)`; the
/// last one everything longer (about 9 minutes and up).
const CLASSES: usize = 40;

/// One handler attempt (or a delivery settled without one: a duplicate, a malformed message).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Attempt {
    /// The order attempts of this queue were recorded in, from 1.
    pub seq: u64,
    /// When it was settled, in milliseconds since the epoch.
    pub at_ms: u64,
    pub message_id: Option<String>,
    pub idempotency_key: Option<String>,
    pub attempt: u32,
    /// success, duplicate, retry, wait, dead_lettered.
    pub outcome: &'static str,
    /// Why it was dead-lettered.
    pub reason: Option<&'static str>,
    pub http_status: Option<u16>,
    pub exit_code: Option<i32>,
    /// How long the handler ran; None when it did not run.
    pub latency_ms: Option<f64>,
    pub error: Option<String>,
    /// The first [`Observed::BYTES`](crate::handler::Observed::BYTES) of the response body or
    /// of stderr, as text (invalid UTF-8 replaced).
    pub excerpt: Option<String>,
    pub trace_id: Option<String>,
}

/// One bucket of the series.
#[derive(Debug, Clone)]
struct Bucket {
    /// Its start, in seconds since the epoch (a multiple of [`BUCKET`]).
    start: u64,
    handled: u32,
    /// Acked without calling the handler: their key was done already.
    duplicates: u32,
    retried: u32,
    dead_lettered: u32,
    latencies: [u32; CLASSES],
}

impl Bucket {
    fn new(start: u64) -> Bucket {
        Bucket { start, handled: 0, duplicates: 0, retried: 0, dead_lettered: 0, latencies: [0; CLASSES] }
    }
}

/// The latency class of `ms`.
fn class(ms: f64) -> usize {
    if ms <= 0.5 {
        return 0;
    }
    // Truncating a positive float: the class below the one `ms` reaches into.
    let class = (2.0 * (ms / 0.5).log2()).ceil() as usize;
    class.saturating_sub(1).min(CLASSES - 1)
}

/// The upper bound of class `i`, in milliseconds.
fn upper(i: usize) -> f64 {
    0.5 * 2f64.powf((i + 1) as f64 / 2.0)
}

/// The `q` quantile of a histogram: the upper bound of the class it falls in.
fn quantile(counts: &[u32; CLASSES], q: f64) -> Option<f64> {
    let total: u64 = counts.iter().map(|&c| u64::from(c)).sum();
    if total == 0 {
        return None;
    }
    let rank = (q * total as f64).ceil().max(1.0) as u64;
    let mut seen = 0;
    for (i, &c) in counts.iter().enumerate() {
        seen += u64::from(c);
        if seen >= rank {
            return Some(upper(i));
        }
    }
    None
}

/// A queue's numbers over the last minute, and its series.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    /// Handler calls that succeeded.
    pub handled_per_minute: u32,
    /// Deliveries acked without calling the handler, their key done already.
    pub duplicates_per_minute: u32,
    pub retried_per_minute: u32,
    pub dead_lettered_per_minute: u32,
    /// Over the last minute; None without a handler run in it.
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    /// Oldest first, one per bucket of the last 15 minutes (empty ones included).
    pub series: Vec<Point>,
}

/// One bucket of the series.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Point {
    /// The bucket's start, in seconds since the epoch.
    pub start: u64,
    /// Messages settled in it (handled, skipped as duplicates, retried or dead-lettered).
    pub settled: u32,
    pub p99_ms: Option<f64>,
}

#[derive(Debug, Default)]
struct Inner {
    next_seq: u64,
    /// Each attempt with its size as JSON.
    ring: VecDeque<(Attempt, usize)>,
    /// The sizes in `ring`, summed.
    ring_bytes: usize,
    buckets: VecDeque<Bucket>,
}

/// Cuts `text` to at most `limit` bytes (at a character boundary), ending it with how long it
/// was, and lets go of the rest of its memory.
fn cut(text: &mut String, limit: usize) {
    let len = text.len();
    if len <= limit {
        return;
    }
    text.truncate(text.floor_char_boundary(limit));
    // Writing to a String cannot fail.
    let _ = write!(text, "…(cut from {len} bytes)");
    text.shrink_to_fit();
}

/// Counts what is written to it.
struct Count(usize);

impl std::io::Write for Count {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0 += bytes.len();
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// `attempt` as it is kept: long texts cut; and its size as JSON.
fn bounded(mut attempt: Attempt) -> (Attempt, usize) {
    for (text, limit) in [
        (&mut attempt.message_id, ID_BYTES),
        (&mut attempt.idempotency_key, ID_BYTES),
        (&mut attempt.trace_id, ID_BYTES),
        (&mut attempt.error, TEXT_BYTES),
        (&mut attempt.excerpt, TEXT_BYTES),
    ] {
        if let Some(text) = text {
            cut(text, limit);
        }
    }
    // Measured before the lock is taken, with the widest sequence number (the lock sets it).
    attempt.seq = u64::MAX;
    let mut count = Count(0);
    // An attempt always serializes (serde_json writes a non-finite latency as null).
    let _ = serde_json::to_writer(&mut count, &attempt);
    (attempt, count.0)
}

/// What the runtime is doing with a queue now, set beside the gauges that say the same
/// (`sluice_in_flight`, `sluice_circuit_state`, `sluice_concurrency_limit`), by whichever of
/// its workers (an old one finishing beside its successor) as the gauges are.
#[derive(Debug, Default)]
pub struct Live {
    in_flight: AtomicI64,
    /// The breaker's gauge value (0 closed, 1 half-open, 2 open), as `f64` bits.
    circuit: AtomicU64,
    /// The concurrency limit, as `f64` bits.
    concurrency_limit: AtomicU64,
}

impl Live {
    /// A delivery arrived (`1`) or was settled (`-1`).
    pub fn in_flight_by(&self, delta: i64) {
        self.in_flight.fetch_add(delta, Ordering::Relaxed);
    }

    pub fn set_circuit(&self, gauge: f64) {
        self.circuit.store(gauge.to_bits(), Ordering::Relaxed);
    }

    pub fn set_concurrency_limit(&self, limit: f64) {
        self.concurrency_limit.store(limit.to_bits(), Ordering::Relaxed);
    }

    /// Deliveries received and not yet settled.
    pub fn in_flight(&self) -> u64 {
        u64::try_from(self.in_flight.load(Ordering::Relaxed)).unwrap_or(0)
    }

    pub fn circuit(&self) -> f64 {
        f64::from_bits(self.circuit.load(Ordering::Relaxed))
    }

    pub fn concurrency_limit(&self) -> f64 {
        f64::from_bits(self.concurrency_limit.load(Ordering::Relaxed))
    }
}

/// One queue's log.
#[derive(Debug)]
pub struct QueueLog {
    capacity: usize,
    inner: Mutex<Inner>,
    live: Arc<Live>,
}

impl QueueLog {
    fn new(capacity: usize) -> QueueLog {
        QueueLog { capacity, inner: Mutex::new(Inner::default()), live: Arc::default() }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// What the runtime is doing with the queue now.
    pub fn live(&self) -> &Arc<Live> {
        &self.live
    }

    /// Whether attempts are kept (the admin port serves them): else only the series counts.
    pub fn keeps(&self) -> bool {
        self.capacity > 0
    }

    /// Records `attempt` (its `seq` and `at_ms` are set here) in the ring, its long texts cut,
    /// and in the series.
    pub fn record(&self, mut attempt: Attempt) {
        attempt.at_ms = now_ms();
        let start = attempt.at_ms / 1000 / BUCKET.as_secs() * BUCKET.as_secs();
        let (mut attempt, bytes) = if self.keeps() { bounded(attempt) } else { (attempt, 0) };
        let mut inner = self.lock();
        inner.next_seq += 1;
        attempt.seq = inner.next_seq;
        if inner.buckets.back().is_none_or(|b| b.start < start) {
            if inner.buckets.len() == BUCKETS {
                inner.buckets.pop_front();
            }
            inner.buckets.push_back(Bucket::new(start));
        }
        if let Some(bucket) = inner.buckets.back_mut() {
            match attempt.outcome {
                "success" => bucket.handled += 1,
                "duplicate" => bucket.duplicates += 1,
                "retry" => bucket.retried += 1,
                "dead_lettered" => bucket.dead_lettered += 1,
                _ => {}
            }
            if let Some(ms) = attempt.latency_ms {
                bucket.latencies[class(ms)] += 1;
            }
        }
        if self.capacity == 0 {
            return;
        }
        inner.ring_bytes += bytes;
        inner.ring.push_back((attempt, bytes));
        while inner.ring.len() > self.capacity || inner.ring_bytes > RING_BYTES {
            if let Some((_, bytes)) = inner.ring.pop_front() {
                inner.ring_bytes -= bytes;
            }
        }
    }

    /// The attempts kept, newest first.
    pub fn recent(&self) -> Vec<Attempt> {
        self.lock().ring.iter().rev().map(|(attempt, _)| attempt.clone()).collect()
    }

    /// How many attempts it keeps.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The last minute's numbers and the series, as of now.
    pub fn summary(&self) -> Summary {
        self.summary_at(now_ms() / 1000)
    }

    fn summary_at(&self, now: u64) -> Summary {
        let step = BUCKET.as_secs();
        let current = now / step * step;
        let first = current.saturating_sub(step * (BUCKETS as u64 - 1));
        let minute = current.saturating_sub(step * 5);
        let inner = self.lock();
        let mut summary = Summary {
            handled_per_minute: 0,
            duplicates_per_minute: 0,
            retried_per_minute: 0,
            dead_lettered_per_minute: 0,
            p50_ms: None,
            p99_ms: None,
            series: Vec::with_capacity(BUCKETS),
        };
        let mut last_minute = [0; CLASSES];
        let mut buckets = inner.buckets.iter().filter(|b| b.start >= first).peekable();
        for start in (first..=current).step_by(step as usize) {
            let Some(bucket) = buckets.next_if(|b| b.start == start) else {
                summary.series.push(Point { start, settled: 0, p99_ms: None });
                continue;
            };
            summary.series.push(Point {
                start,
                settled: bucket.handled + bucket.duplicates + bucket.retried + bucket.dead_lettered,
                p99_ms: quantile(&bucket.latencies, 0.99),
            });
            if start >= minute {
                summary.handled_per_minute += bucket.handled;
                summary.duplicates_per_minute += bucket.duplicates;
                summary.retried_per_minute += bucket.retried;
                summary.dead_lettered_per_minute += bucket.dead_lettered;
                for (sum, n) in last_minute.iter_mut().zip(bucket.latencies) {
                    *sum += n;
                }
            }
        }
        summary.p50_ms = quantile(&last_minute, 0.5);
        summary.p99_ms = quantile(&last_minute, 0.99);
        summary
    }
}

/// Every queue's log, by name; kept across reloads (a queue changed by a reload keeps its
/// history), shared by the workers and the admin port.
#[derive(Debug, Clone)]
pub struct Attempts {
    capacity: usize,
    queues: Arc<Mutex<HashMap<String, Arc<QueueLog>>>>,
}

impl Default for Attempts {
    fn default() -> Attempts {
        Attempts::new(DEFAULT_CAPACITY)
    }
}

impl Attempts {
    /// Logs keeping the last `capacity` attempts of each queue.
    pub fn new(capacity: usize) -> Attempts {
        Attempts { capacity, queues: Arc::default() }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Arc<QueueLog>>> {
        self.queues.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The log of `queue`, made on first use (by its worker).
    pub fn of(&self, queue: &str) -> Arc<QueueLog> {
        self.lock().entry(queue.to_string()).or_insert_with(|| Arc::new(QueueLog::new(self.capacity))).clone()
    }

    /// The log of `queue`, if anything made it.
    pub fn get(&self, queue: &str) -> Option<Arc<QueueLog>> {
        self.lock().get(queue).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attempt(outcome: &'static str, latency_ms: Option<f64>) -> Attempt {
        Attempt {
            seq: 0,
            at_ms: 0,
            message_id: None,
            idempotency_key: None,
            attempt: 1,
            outcome,
            reason: None,
            http_status: None,
            exit_code: None,
            latency_ms,
            error: None,
            excerpt: None,
            trace_id: None,
        }
    }

    /// Issue 22: under concurrent records, the ring keeps exactly the last N (the N highest
    /// sequence numbers), newest first, and counts every record.
    #[test]
    fn the_ring_keeps_exactly_the_last_n_under_concurrency() {
        const THREADS: usize = 8;
        const EACH: usize = 1000;
        for capacity in [0, 1, 7, 200, THREADS * EACH, THREADS * EACH + 5] {
            let attempts = Attempts::new(capacity);
            std::thread::scope(|scope| {
                for t in 0..THREADS {
                    let log = attempts.of("work");
                    scope.spawn(move || {
                        for i in 0..EACH {
                            let mut a = attempt("success", Some(1.0));
                            a.message_id = Some(format!("{t}-{i}"));
                            log.record(a);
                        }
                    });
                }
            });
            let log = attempts.get("work").expect("made by the threads");
            let recent = log.recent();
            let total = (THREADS * EACH) as u64;
            let kept = capacity.min(THREADS * EACH);
            let seqs: Vec<u64> = recent.iter().map(|a| a.seq).collect();
            let expected: Vec<u64> = (total - kept as u64 + 1..=total).rev().collect();
            assert_eq!(seqs, expected, "capacity {capacity}");
            // Each thread's own records stay in its order.
            for t in 0..THREADS {
                let own: Vec<usize> = recent
                    .iter()
                    .rev()
                    .filter_map(|a| a.message_id.as_ref()?.strip_prefix(&format!("{t}-"))?.parse().ok())
                    .collect();
                assert!(own.windows(2).all(|w| w[0] < w[1]), "thread {t} out of order: {own:?}");
            }
            assert_eq!(log.summary().handled_per_minute as usize, THREADS * EACH, "capacity {capacity}");
        }
    }

    /// Issue 31 item 20: a duplicate (acked without calling the handler) is not counted as
    /// handled.
    #[test]
    fn duplicates_are_counted_apart_from_handled() {
        let log = QueueLog::new(10);
        for outcome in ["success", "success", "success", "duplicate", "duplicate", "retry"] {
            log.record(attempt(outcome, None));
        }
        let summary = log.summary();
        assert_eq!((summary.handled_per_minute, summary.duplicates_per_minute, summary.retried_per_minute), (3, 2, 1));
        assert_eq!(summary.series.iter().map(|p| p.settled).sum::<u32>(), 6, "each settled once");
    }

    /// Issue 31 item 7: ids and keys were kept whole (250 messages with 256 KiB ids and keys
    /// took 118 MB). Each long text is cut, saying from how long, and lets go of its memory; the
    /// ring's JSON stays within [`RING_BYTES`], the newest attempts kept.
    #[test]
    fn long_texts_are_cut_and_the_ring_stays_within_its_bytes() {
        let huge = |c: char| Some(c.to_string().repeat(256 << 10));
        let log = QueueLog::new(250);
        for _ in 0..250 {
            let mut a = attempt("dead_lettered", Some(1.0));
            (a.message_id, a.idempotency_key, a.trace_id) = (huge('i'), huge('k'), huge('t'));
            (a.error, a.excerpt) = (huge('e'), huge('\u{1}'));
            log.record(a);
        }
        let recent = log.recent();
        let json = serde_json::to_vec(&recent).expect("JSON");
        assert!(json.len() <= RING_BYTES, "{} bytes of attempts served", json.len());
        assert!(!recent.is_empty() && recent.len() < 250, "{} kept: the bytes decide", recent.len());
        assert_eq!(recent[0].seq, 250, "the newest kept");
        let marker = format!("…(cut from {} bytes)", 256 << 10);
        for a in &recent {
            for (text, limit) in [
                (&a.message_id, ID_BYTES),
                (&a.idempotency_key, ID_BYTES),
                (&a.trace_id, ID_BYTES),
                (&a.error, TEXT_BYTES),
                (&a.excerpt, TEXT_BYTES),
            ] {
                let text = text.as_ref().expect("kept");
                assert!(text.ends_with(&marker), "{text:?}");
                assert!(text.capacity() <= limit + marker.len(), "{} bytes held", text.capacity());
            }
        }

        // Short texts are kept whole; many small attempts are bounded by the capacity alone,
        // many more by the bytes.
        let log = QueueLog::new(100_000);
        for i in 0..20_000 {
            let mut a = attempt("success", Some(1.0));
            a.message_id = Some(format!("{i:0200}"));
            log.record(a);
        }
        let recent = log.recent();
        assert_eq!(recent[0].message_id, Some(format!("{:0200}", 19_999)), "kept whole");
        let json = serde_json::to_vec(&recent).expect("JSON");
        assert!(json.len() <= RING_BYTES, "{} bytes of attempts served", json.len());
        assert!(
            recent.len() < 20_000 && json.len() > RING_BYTES * 9 / 10,
            "{} kept, {} bytes",
            recent.len(),
            json.len()
        );
    }

    #[test]
    fn latency_classes_bound_what_they_hold() {
        for ms in [0.1, 0.5, 0.7, 1.0, 3.3, 10.0, 99.0, 1000.0, 65_000.0] {
            let c = class(ms);
            assert!(ms <= upper(c), "{ms} ms is above its class's bound {}", upper(c));
            assert!(c == 0 || ms > upper(c - 1), "{ms} ms belongs in a lower class than {c}");
        }
        assert_eq!(class(1e9), CLASSES - 1);
    }

    #[test]
    fn the_summary_counts_the_last_minute_and_fills_fifteen_minutes() {
        let log = QueueLog::new(10);
        let now = 1_000_000;
        {
            let mut inner = log.lock();
            let mut old = Bucket::new(now - 600);
            old.handled = 50;
            let mut recent = Bucket::new(now - 20);
            recent.handled = 9;
            recent.duplicates = 4;
            recent.retried = 2;
            recent.dead_lettered = 1;
            recent.latencies[class(10.0)] = 98;
            recent.latencies[class(900.0)] = 2;
            inner.buckets.extend([Bucket::new(now - 2000), old, recent]);
        }
        let summary = log.summary_at(now);
        assert_eq!(summary.series.len(), BUCKETS);
        assert_eq!(summary.series.last().map(|p| p.start), Some(now));
        assert_eq!(summary.series.iter().map(|p| p.settled).sum::<u32>(), 66, "the bucket 2000 s ago is out");
        assert_eq!(
            (
                summary.handled_per_minute,
                summary.duplicates_per_minute,
                summary.retried_per_minute,
                summary.dead_lettered_per_minute
            ),
            (9, 4, 2, 1)
        );
        assert_eq!(summary.p50_ms, Some(upper(class(10.0))));
        assert_eq!(summary.p99_ms, Some(upper(class(900.0))));
    }
}
