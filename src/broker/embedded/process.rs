//! Which process holds something in the broker's file (a consumer's leases, an idempotency
//! key's claim), and whether it still runs: what a process that died holds comes back at once
//! instead of when its lease ends.

use std::sync::OnceLock;

/// This process: its pid, its start time (pids are reused) and its pid namespace (processes
/// in two containers that share the directory see different pids).
pub fn process() -> &'static str {
    static PROCESS: OnceLock<String> = OnceLock::new();
    PROCESS.get_or_init(|| {
        let pid = std::process::id();
        format!("{pid}:{}:{}", started(pid).flatten().unwrap_or_default(), pid_namespace())
    })
}

/// A process's start time (clock ticks since boot, `/proc/PID/stat` field 22), where the
/// system says; `Some(None)` for a process that has ended but not been reaped yet (a zombie:
/// its entry stays, with its start time, until its parent waits for it).
fn started(pid: u32) -> Option<Option<u64>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The name (field 2) is in parentheses and may hold spaces: count after its end.
    let mut fields = stat.rsplit_once(')')?.1.split_whitespace();
    if matches!(fields.next()?, "Z" | "X" | "x") {
        return Some(None);
    }
    Some(fields.nth(18)?.parse().ok())
}

/// This process's pid namespace (the inode `/proc/self/ns/pid` names), or 0 where the system
/// does not say; read once, as every holder [`alive`] looks at is compared with it.
fn pid_namespace() -> u64 {
    static NAMESPACE: OnceLock<u64> = OnceLock::new();
    *NAMESPACE.get_or_init(|| {
        let link = std::fs::read_link("/proc/self/ns/pid").unwrap_or_default();
        let digits: String = link.to_string_lossy().chars().filter(char::is_ascii_digit).collect();
        digits.parse().unwrap_or(0)
    })
}

/// Whether the process a holder (`pid:start:namespace`, then anything) names still runs.
/// Where that cannot be known (a holder written without a start time, or by a process of
/// another pid namespace), it counts as alive: what it holds waits for its lease to end.
pub fn alive(holder: &str) -> bool {
    let mut parts = holder.split(':').map(str::parse::<u64>);
    let (Some(Ok(pid)), Some(Ok(start)), Some(Ok(namespace))) = (parts.next(), parts.next(), parts.next()) else {
        return true;
    };
    if namespace != pid_namespace() {
        return true;
    }
    match libc::pid_t::try_from(pid) {
        Ok(pid) if pid > 0 => match started(pid.unsigned_abs()) {
            Some(now) => now == Some(start),
            // Unreadable: gone, unless the pid still answers (a `/proc` mounted to hide other
            // users' processes).
            None => exists(pid),
        },
        _ => false, // no process has such a pid
    }
}

/// Whether process `pid` exists: only "no such process" from signal 0 says it does not.
fn exists(pid: libc::pid_t) -> bool {
    // SAFETY: signal 0 delivers nothing; for a positive pid, kill only checks that the process
    // exists and may be signalled.
    let result = unsafe { libc::kill(pid, 0) };
    result == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive_and_a_made_up_one_is_not() {
        assert!(alive(process()), "{}", process());
        assert!(alive(&format!("{}:7", process())), "a holder of this process");
        let [pid, start, namespace] = process().split(':').collect::<Vec<_>>()[..] else { panic!("{}", process()) };
        let start: u64 = start.parse().expect("start");
        assert!(!alive(&format!("{pid}:{}:{namespace}:7", start + 1)), "a reused pid");
        assert!(!alive(&format!("{}:1:{namespace}", u32::MAX)), "no such pid");
        assert!(alive(&format!("{}:1:{}", u32::MAX, namespace.parse::<u64>().expect("ns") + 1)), "another namespace");
        assert!(alive(&format!("{pid}:{}:7", start + 1)), "a holder of before namespaces were named");
        assert!(alive("not a holder"), "unknown forms hold until the lease ends");
        let mut child = std::process::Command::new("true").spawn().expect("spawn true");
        child.wait().expect("wait");
        assert!(!alive(&format!("{}:1:{namespace}", child.id())), "a process that exited and was reaped");
    }

    /// A runner killed under a parent that has not waited for it yet (a test harness, a shell,
    /// a container's first process) is a zombie: its entry keeps its start time, but it holds
    /// nothing any more.
    #[test]
    fn a_process_that_ended_unreaped_is_not_alive() {
        let mut child = std::process::Command::new("sleep").arg("60").spawn().expect("spawn sleep");
        let pid = child.id();
        let start = started(pid).flatten().expect("a running process has a start time");
        let namespace = pid_namespace();
        let holder = format!("{pid}:{start}:{namespace}");
        assert!(alive(&holder), "running");
        child.kill().expect("kill");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while started(pid) != Some(None) {
            assert!(std::time::Instant::now() < deadline, "the child became a zombie");
            std::thread::yield_now();
        }
        assert!(!alive(&holder), "a zombie is not alive");
        child.wait().expect("reap");
    }
}
