//! The group's two timer threads: `dmlc-delay` ([`delay_loop`]), which
//! delivers completions held on the [`Later`] heap at their modelled time,
//! and `dmlc-timer` ([`timer_loop`]), which fails collectives whose
//! deadline passed.

use std::collections::BinaryHeap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use virtio_dmlc::Status;

use super::job::Outgoing;
use super::p2p::timed_out;
use super::remote;
use super::shared::Shared;
use super::state::{lock, Arrival, Outcome, Slot, TimedOut};
use super::timed::{completed_at, record_of, Due};

pub(super) struct LaterEntry {
    due: Instant,
    id: u64,
    what: Due,
}

impl PartialEq for LaterEntry {
    fn eq(&self, other: &Self) -> bool {
        (self.due, self.id) == (other.due, other.id)
    }
}

impl Eq for LaterEntry {}

impl PartialOrd for LaterEntry {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for LaterEntry {
    /// Reversed, so that the max-heap pops the earliest first (and, at the
    /// same time, the first pushed).
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (other.due, other.id).cmp(&(self.due, self.id))
    }
}

#[derive(Default)]
pub(super) struct LaterHeap {
    pub(super) entries: BinaryHeap<LaterEntry>,
    next: u64,
    pub(super) shutdown: bool,
}

/// Completions held until their modelled time, delivered by the
/// `dmlc-delay` thread ([`delay_loop`]). Its lock is a leaf: nothing is
/// delivered while it is held.
#[derive(Default)]
pub(super) struct Later {
    pub(super) heap: Mutex<LaterHeap>,
    pub(super) cv: Condvar,
}

impl Later {
    /// Holds `what` until `due` (delivers it at once after shutdown).
    pub(super) fn push(&self, due: Instant, what: Due) {
        let mut h = lock(&self.heap);
        if h.shutdown {
            drop(h);
            what.deliver(true);
            return;
        }
        let id = h.next;
        h.next += 1;
        let earliest = h.entries.peek().is_none_or(|e| due < e.due);
        h.entries.push(LaterEntry { due, id, what });
        drop(h);
        if earliest {
            self.cv.notify_one();
        }
    }

    /// Delivers every held completion now, earliest first (a generation
    /// change does not wait for the model).
    pub(super) fn flush(&self) {
        let entries = std::mem::take(&mut lock(&self.heap).entries);
        // Ascending in the reversed order: the latest first.
        for e in entries.into_sorted_vec().into_iter().rev() {
            e.what.deliver(true);
        }
    }
}

/// Delivers held completions at their time (`Later`).
pub(super) fn delay_loop(sh: &Arc<Shared>) {
    let Some(later) = &sh.later else {
        return;
    };
    // SAFETY: prctl(PR_SET_TIMERSLACK) takes an integer and changes only
    // this thread's timer slack (1 ns: wake as close to the deadline as the
    // kernel can); no memory is passed.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong);
    }
    let spin = sh.timing.as_ref().map_or(Duration::ZERO, |t| t.spin);
    let mut h = lock(&later.heap);
    loop {
        let now = Instant::now();
        let next = h.entries.peek().map(|e| e.due);
        match next {
            Some(due) if due <= now || h.shutdown => {
                let Some(e) = h.entries.pop() else { continue };
                let all = h.shutdown;
                drop(h);
                e.what.deliver(all);
                h = lock(&later.heap);
            }
            None if h.shutdown => return,
            Some(due) if due - now <= spin => {
                drop(h);
                while Instant::now() < due {
                    std::hint::spin_loop();
                }
                h = lock(&later.heap);
            }
            Some(due) => {
                h = later
                    .cv
                    .wait_timeout(h, due - now - spin)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
            None => h = later.cv.wait(h).unwrap_or_else(PoisonError::into_inner),
        }
    }
}

/// Fails the collectives whose deadline passed.
pub(super) fn timer_loop(sh: &Arc<Shared>) {
    let mut st = lock(&sh.state);
    loop {
        if st.shutdown {
            return;
        }
        if st.freeze.holding() {
            // Frozen time never counts towards a timeout: the release
            // moves every deadline on and wakes this thread.
            st = sh.timer_cv.wait(st).unwrap_or_else(PoisonError::into_inner);
            continue;
        }
        let now = Instant::now();
        let mut next: Option<Instant> = None;
        let mut expired = Vec::new();
        for (key, slot) in &st.slots {
            if let Slot::Waiting(w) = slot {
                if w.deadline <= now {
                    expired.push(*key);
                } else if next.is_none_or(|n| w.deadline < n) {
                    next = Some(w.deadline);
                }
            }
        }
        let mut p2p_failed = st.p2p.take_if(|w| w.deadline <= now);
        if let Some(d) = st.p2p.next_deadline() {
            if next.is_none_or(|n| d < n) {
                next = Some(d);
            }
        }
        if let (Some(&key), true, None) =
            (expired.first(), st.freeze.on_error_armed(), &sh.cfg.remote)
        {
            // Freeze-on-error: the first expired collective is held
            // instead of failed (its absent members stay absent).
            if let Some(Slot::Waiting(w)) = st.slots.get(&key) {
                let missing = w.missing();
                let ranks = (0..missing.len())
                    .filter(|&r| missing[r])
                    .map(|r| sh.global(w.world_rank(r)))
                    .collect();
                st.freeze.hold_timeout(key, ranks);
                continue;
            }
        }
        let mut failed = Vec::new();
        for key in expired {
            let Some(Slot::Waiting(w)) = st.slots.remove(&key) else {
                continue;
            };
            let missing = w.missing();
            let first_missing = missing.iter().position(|m| *m).unwrap_or(0);
            let peer = sh.global(w.world_rank(first_missing));
            let left = missing.iter().filter(|m| **m).count() as u32;
            if let Some(link) = &sh.cfg.remote {
                // This host's step for the slot: TIMEOUT on every host.
                let _ = link.tx.send(remote::Work(remote::Step::TimedOut {
                    shared: sh.clone(),
                    era: st.era,
                    peer,
                    deadline: w.deadline,
                }));
            }
            st.slots.insert(
                key,
                Slot::TimedOut(TimedOut {
                    missing,
                    left,
                    peer,
                }),
            );
            let out = Outcome::fail(Status::Timeout, 0, peer);
            let arrivals: Vec<Arrival> = w.arrivals.into_iter().flatten().collect();
            failed.push((key, arrivals, out));
        }
        st.timer_target = next;
        if !failed.is_empty() || !p2p_failed.is_empty() {
            let era = st.era;
            let batch = Outgoing::register(sh, &mut st, era);
            drop(st);
            // A send or receive that times out leaves no trace (spec
            // 5.X.6.13.4).
            for w in p2p_failed.drain(..) {
                sh.deliver(&w.arrival, timed_out(&w));
            }
            for (key, arrivals, out) in &failed {
                let mut done_at = Vec::new();
                for a in arrivals {
                    let delivered = sh.deliver(a, *out);
                    if sh.recorder.is_some() {
                        done_at.push(delivered.then(Instant::now));
                    }
                }
                if let Some(rec) = &sh.recorder {
                    let generation = sh.resp_generation.load(Ordering::Acquire);
                    let mut r = record_of(key.short(), generation, arrivals, sh.world, *out);
                    completed_at(&mut r, arrivals, &done_at);
                    rec.push(r);
                }
            }
            drop(failed);
            drop(batch);
            st = lock(&sh.state);
            continue;
        }
        st = match next {
            Some(t) => {
                sh.timer_cv
                    .wait_timeout(st, t.saturating_duration_since(now))
                    .unwrap_or_else(PoisonError::into_inner)
                    .0
            }
            None => sh.timer_cv.wait(st).unwrap_or_else(PoisonError::into_inner),
        };
    }
}
