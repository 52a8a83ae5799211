//! When a broker that leases what it delivers renews the leases its consumers hold: every
//! third of the lease (so a lost renewal leaves two more chances before it runs out), and
//! after a failed renewal when the broker says. It owns the schedule only, on tokio's clock;
//! what is renewed and how is the broker's (in each claim, or one request for every consumer
//! of a process), and it must not decide what a lapsed lease means.

use std::time::Duration;

use tokio::time::Instant;

/// The renewal schedule of one lease holder.
#[derive(Debug, Clone)]
pub struct Renewal {
    every: Duration,
    next: Instant,
}

impl Renewal {
    /// A schedule for leases of `lease`, whose first renewal is a third of it from now.
    pub fn new(lease: Duration) -> Renewal {
        let every = lease / 3;
        Renewal { every, next: Instant::now() + every }
    }

    /// The time between two renewals.
    pub fn every(&self) -> Duration {
        self.every
    }

    /// Whether a renewal is due now.
    pub fn is_due(&self) -> bool {
        Instant::now() >= self.next
    }

    /// Waits until a renewal is due.
    pub async fn due(&self) {
        tokio::time::sleep_until(self.next).await;
    }

    /// A renewal succeeded: the next is due a third of the lease from now.
    pub fn renewed(&mut self) {
        self.next = Instant::now() + self.every;
    }

    /// A renewal failed: the next is due `retry` from now.
    pub fn failed(&mut self, retry: Duration) {
        self.next = Instant::now() + retry;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn renews_every_third_of_the_lease_and_sooner_after_a_failure() {
        let start = Instant::now();
        let mut renewal = Renewal::new(Duration::from_secs(30));
        assert_eq!(renewal.every(), Duration::from_secs(10));
        assert!(!renewal.is_due());
        renewal.due().await;
        assert_eq!(start.elapsed(), Duration::from_secs(10));
        assert!(renewal.is_due());
        renewal.failed(Duration::from_millis(50));
        assert!(!renewal.is_due());
        renewal.due().await;
        assert_eq!(start.elapsed(), Duration::from_millis(10_050));
        renewal.renewed();
        tokio::time::advance(Duration::from_millis(9_999)).await;
        assert!(!renewal.is_due());
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(renewal.is_due(), "due a third of the lease after the last renewal");
    }
}
