//! What a consumer process uses. Memory is read from `/proc/<pid>/status` while it runs:
//! `VmRSS` now and `VmHWM` (the kernel's own peak), sampled with the progress of the drain
//! so the curve shows whether memory grows with the backlog. CPU time comes from the
//! kernel's account of reaped children, which is steadier than wall-clock rates on a busy
//! machine. For the embedded broker, each sample also takes the size of its files.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const EVERY: Duration = Duration::from_millis(50);

/// One reading: messages handled so far, resident set and its peak, in KiB; when it was
/// taken; and the bytes of the embedded broker's files and of its write-ahead log alone, if
/// sampled.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    pub handled: u64,
    pub rss_kib: u64,
    pub hwm_kib: u64,
    pub at: Instant,
    pub disk_bytes: Option<(u64, u64)>,
}

/// Samples a process on a thread of its own until stopped or the process is gone.
pub struct Sampler {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Vec<Sample>>,
}

impl Sampler {
    /// Samples `pid`, with `progress` and, if given, the size of the embedded broker whose
    /// database is `disk`.
    pub fn start(pid: u32, progress: impl Fn() -> u64 + Send + 'static, disk: Option<PathBuf>) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut samples = Vec::new();
            while !stopped.load(Ordering::Relaxed) {
                let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else { break };
                let (Some(rss_kib), Some(hwm_kib)) = (field(&status, "VmRSS:"), field(&status, "VmHWM:")) else {
                    break; // a zombie has no memory lines
                };
                let disk_bytes = disk.as_deref().map(|db| (crate::place::disk_bytes(db), crate::place::wal_bytes(db)));
                samples.push(Sample { handled: progress(), rss_kib, hwm_kib, at: Instant::now(), disk_bytes });
                std::thread::sleep(EVERY);
            }
            samples
        });
        Sampler { stop, thread }
    }

    pub fn finish(self) -> Vec<Sample> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

fn field(status: &str, name: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with(name))?;
    line[name.len()..].trim().trim_end_matches("kB").trim().parse().ok()
}

/// The highest peak seen, in MiB.
pub fn peak_mib(samples: &[Sample]) -> f64 {
    samples.iter().map(|s| s.hwm_kib).max().unwrap_or(0) as f64 / 1024.0
}

/// Resident set (MiB) at the first sample with at least `fraction` of `total` handled.
pub fn rss_at(samples: &[Sample], total: u64, fraction: f64) -> Option<f64> {
    let at = (total as f64 * fraction) as u64;
    samples.iter().find(|s| s.handled >= at).map(|s| s.rss_kib as f64 / 1024.0)
}

/// CPU time (user + system) of every child this process has reaped so far; the difference
/// across one consumer's life is that consumer's CPU time.
pub fn reaped_children_cpu() -> Duration {
    // SAFETY: getrusage only writes the struct we pass; a zeroed rusage is a valid value.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage);
        usage
    };
    let time = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    time(usage.ru_utime) + time(usage.ru_stime)
}
