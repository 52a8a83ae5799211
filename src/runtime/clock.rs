//! The runtime's one wall clock, read through tokio's: time since the epoch for what is
//! compared with other processes' clocks (a delivery's lag, a due time in a header, when an
//! attempt ran). Durations and deadlines use [`tokio::time::Instant`] directly. Under paused
//! time (the runtime's tests) both move only as tokio's clock does; in a runner this is the
//! system clock as it reads now.
//!
//! Nothing here sleeps or keeps state.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Now, on the wall clock as tokio's clock moves it: the system clock, shifted by how far
/// tokio's clock stands from the real one (nothing in a runner; paused time's advance less the
/// real time that passed, in tests). Shifted rather than counted from a start: a runner's
/// wall clock follows the system's through a suspend or a clock adjustment.
pub fn now() -> SystemTime {
    let (tokio, real, wall) = (tokio::time::Instant::now().into_std(), Instant::now(), SystemTime::now());
    match tokio.checked_duration_since(real) {
        Some(ahead) => wall + ahead,
        None => wall - real.duration_since(tokio),
    }
}

/// [`now`] in milliseconds since the epoch.
pub fn now_ms() -> u64 {
    now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// [`now`] in seconds since the epoch, with their fraction.
pub fn now_secs() -> f64 {
    now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// Paused time moves the wall clock by its advance, however long the test takes: the real
    /// time that passed does not show (within the few microseconds between the three clocks'
    /// reads, which may fall either side).
    #[tokio::test(start_paused = true)]
    async fn paused_time_moves_the_wall_clock() {
        let before = now();
        tokio::time::advance(Duration::from_secs(3600)).await;
        // Real time passing, which must not show.
        std::thread::sleep(Duration::from_millis(20));
        let moved = now().duration_since(before).expect("forward");
        assert!(moved.abs_diff(Duration::from_secs(3600)) < Duration::from_millis(5), "{moved:?}");
    }

    /// Unpaused, it is the system clock.
    #[tokio::test]
    async fn a_running_clock_is_the_system_clock() {
        let (ours, system) = (now(), SystemTime::now());
        let apart = system.duration_since(ours).unwrap_or_else(|e| e.duration());
        assert!(apart < Duration::from_millis(50), "{apart:?}");
    }
}
