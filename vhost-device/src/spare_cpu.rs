//! Whether the machine has a CPU to spare for the backend's busy-polling
//! (`--poll-us`). Polling saves the wake-up after a kick only if the
//! polling thread does not take the CPU from the ranks (or vCPUs) that
//! would post the next request; on a machine with every CPU busy it made
//! each round trip as long as the poll time.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// How long one look at the run queue is trusted.
const SAMPLE_EVERY_NS: u64 = 10_000_000;

static EPOCH: OnceLock<Instant> = OnceLock::new();
/// When the last look was taken, nanoseconds after `EPOCH` plus one (0:
/// never).
static SAMPLED_AT: AtomicU64 = AtomicU64::new(0);
static SPARE: AtomicBool = AtomicBool::new(false);

/// True if, at the last look (at most 10 ms ago), no more threads were
/// runnable than there are CPUs for this process, the caller included.
pub fn spare_cpu() -> bool {
    let epoch = *EPOCH.get_or_init(Instant::now);
    let now = u64::try_from(epoch.elapsed().as_nanos())
        .unwrap_or(u64::MAX - 1)
        .saturating_add(1);
    let at = SAMPLED_AT.load(Ordering::Relaxed);
    // One thread looks; the others use the last answer meanwhile.
    if stale(at, now)
        && SAMPLED_AT
            .compare_exchange(at, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        SPARE.store(look(), Ordering::Relaxed);
    }
    SPARE.load(Ordering::Relaxed)
}

/// Whether a look taken at `at` (0: none yet) is too old at `now`.
fn stale(at: u64, now: u64) -> bool {
    at == 0 || now.saturating_sub(at) >= SAMPLE_EVERY_NS
}

fn look() -> bool {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    // Without the figure, poll as configured.
    runnable(&stat).is_none_or(|r| r <= cpus)
}

/// `procs_running` of /proc/stat: threads running or ready to run.
fn runnable(stat: &str) -> Option<usize> {
    stat.lines()
        .find_map(|l| l.strip_prefix("procs_running ")?.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_procs_running() {
        let stat = "cpu  1 2 3\nctxt 99\nprocs_running 3\nprocs_blocked 0\n";
        assert_eq!(runnable(stat), Some(3));
        assert_eq!(runnable("cpu 1 2 3\n"), None);
        // The real file has the line.
        let real = std::fs::read_to_string("/proc/stat").unwrap();
        assert!(runnable(&real).is_some_and(|r| r >= 1));
    }

    #[test]
    fn a_look_is_trusted_for_10_ms() {
        assert!(stale(0, 5));
        assert!(!stale(1, 1 + SAMPLE_EVERY_NS - 1));
        assert!(stale(1, 1 + SAMPLE_EVERY_NS));
        // A clock read before the look (another thread) is no reason to look.
        assert!(!stale(100, 50));
        spare_cpu();
        assert_ne!(SAMPLED_AT.load(Ordering::Relaxed), 0);
    }
}
