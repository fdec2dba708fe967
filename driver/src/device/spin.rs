//! How long the hybrid wait spins before it sleeps on the interrupt, learned
//! from the waits that came before.
//!
//! The spin is the whole bound (`cap`) while most recent waits ended within
//! it, which saves the interrupt on nearly every wait, and a twentieth of it
//! while most did not (a late peer: the wait sleeps nearly at once). A wait
//! that slept on the short spin says nothing about the long one: in a TCG
//! guest the interrupt alone can take longer than the bound, so counting
//! such waits as misses kept the short spin forever once it was chosen, and
//! the 4 B latency moved between about 10 and 600 us from boot to boot. So
//! only waits that had the whole bound to spin, or ended within it anyway,
//! are learned from, and every [`PROBE_EVERY`]th wait on the short spin
//! spins the whole bound to find out whether it would pay again.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// All of the recent waits, in the share of waits that ended within the
/// bound (fixed point).
const HIT_ONE: u64 = 1 << 10;
/// The short spin is the bound divided by this.
const SHORT_SPIN_DIVISOR: u32 = 20;
/// While the spin is short, one wait in this many spins the whole bound.
/// After a change from late peers to prompt ones, about six probes (some
/// 50 waits) bring the whole spin back; while peers stay late, the probes
/// cost one bound's worth of CPU per this many waits.
pub(super) const PROBE_EVERY: u32 = 8;

/// The hybrid wait's spin budget and what it has learned. Relaxed atomics:
/// the budget is a hint shared by the threads waiting on one device, and a
/// lost update only shifts it by one wait.
pub(super) struct HybridSpin {
    /// The bound; zero: no hybrid wait (poll, or sleep at once).
    cap: Duration,
    /// The share of learned waits that ended within `cap`, in HIT_ONEths,
    /// weighing the last eight most.
    hits: AtomicU64,
    /// Waits begun on the short spin, to pick the probes.
    short_waits: AtomicU32,
}

impl HybridSpin {
    /// A new device spins the whole bound until it learns otherwise.
    pub(super) fn new(cap: Duration) -> HybridSpin {
        HybridSpin {
            cap,
            hits: AtomicU64::new(HIT_ONE),
            short_waits: AtomicU32::new(0),
        }
    }

    pub(super) fn cap(&self) -> Duration {
        self.cap
    }

    /// True for the hybrid wait, false for polling or sleeping at once.
    pub(super) fn is_hybrid(&self) -> bool {
        !self.cap.is_zero()
    }

    /// The spin a wait would get now: the whole bound or the short spin.
    pub(super) fn level(&self) -> Duration {
        if self.hits.load(Ordering::Relaxed) >= HIT_ONE / 2 {
            self.cap
        } else {
            self.cap / SHORT_SPIN_DIVISOR
        }
    }

    /// The spin for a wait that starts now: [`Self::level`], except that
    /// one short-spin wait in [`PROBE_EVERY`] gets the whole bound.
    pub(super) fn budget_for_next_wait(&self) -> Duration {
        let level = self.level();
        if level == self.cap {
            return level;
        }
        let n = self.short_waits.fetch_add(1, Ordering::Relaxed);
        if n.is_multiple_of(PROBE_EVERY) {
            self.cap
        } else {
            level
        }
    }

    /// Folds in a wait that had `budget` to spin and ended after `took`.
    pub(super) fn learn(&self, budget: Duration, took: Duration) {
        let hit = took <= self.cap;
        if !hit && budget < self.cap {
            // It slept early: whether the whole bound would have been
            // enough is unknown.
            return;
        }
        let old = self.hits.load(Ordering::Relaxed);
        let new = (old * 7 + if hit { HIT_ONE } else { 0 }) / 8;
        self.hits.store(new, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAP: Duration = Duration::from_micros(200);

    /// Mostly long waits (a late peer) bring the spin down to the short
    /// one; mostly short ones bring it back.
    #[test]
    fn late_peers_shorten_the_spin_and_prompt_ones_restore_it() {
        let spin = HybridSpin::new(CAP);
        assert_eq!(spin.level(), CAP);
        for _ in 0..50 {
            let b = spin.budget_for_next_wait();
            spin.learn(b, Duration::from_millis(50));
        }
        assert_eq!(spin.level(), CAP / SHORT_SPIN_DIVISOR);
        for _ in 0..50 {
            let b = spin.budget_for_next_wait();
            spin.learn(b, Duration::from_micros(20));
        }
        assert_eq!(spin.level(), CAP);
    }

    /// The trap this learner avoids: peers answer in 30 us, within the
    /// bound, but a wait that sleeps takes 400 us (a slow interrupt). Once
    /// on the short spin, every wait that sleeps would count as a miss and
    /// keep it there; the probes find the whole spin pays and restore it.
    #[test]
    fn the_short_spin_is_left_when_the_whole_spin_would_pay() {
        let spin = HybridSpin::new(CAP);
        for _ in 0..20 {
            spin.learn(CAP, Duration::from_millis(50));
        }
        assert_eq!(spin.level(), CAP / SHORT_SPIN_DIVISOR);
        let answer = Duration::from_micros(30);
        let mut waits = 0;
        while spin.level() != CAP {
            let b = spin.budget_for_next_wait();
            let took = if answer <= b {
                answer
            } else {
                Duration::from_micros(400)
            };
            spin.learn(b, took);
            waits += 1;
            assert!(waits <= 10 * PROBE_EVERY, "still on the short spin");
        }
    }

    /// While peers stay late, the probes miss and the spin stays short;
    /// only one wait in PROBE_EVERY spins the whole bound.
    #[test]
    fn late_peers_keep_the_short_spin_with_few_probes() {
        let spin = HybridSpin::new(CAP);
        for _ in 0..20 {
            spin.learn(CAP, Duration::from_millis(50));
        }
        let mut whole = 0;
        for _ in 0..(10 * PROBE_EVERY) {
            let b = spin.budget_for_next_wait();
            if b == CAP {
                whole += 1;
            }
            spin.learn(b, Duration::from_millis(50));
            assert_eq!(spin.level(), CAP / SHORT_SPIN_DIVISOR);
        }
        assert_eq!(whole, 10);
    }

    #[test]
    fn no_cap_means_no_hybrid_wait() {
        let spin = HybridSpin::new(Duration::ZERO);
        assert!(!spin.is_hybrid());
        assert_eq!(spin.budget_for_next_wait(), Duration::ZERO);
    }
}
