//! The matching state under the group's state lock: members, collective
//! slots and the arrivals filed in them, the outcome a request completes
//! with, and the lock helpers every part of the engine uses.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant};

use virtio_dmlc::{Status, NO_PEER};

use super::shared::Gate;
use super::Completion;
use crate::chain::Request;
use crate::metrics::Held;
use crate::timing::Timing;
use crate::GuestMem;

pub(super) struct Member {
    pub(super) gate: Gate,
    pub(super) connected: bool,
    pub(super) req_timeout: bool,
    /// Next sequence number per queue.
    pub(super) seqs: Vec<u64>,
    /// Collectives that started before this one (see `State::next_run`)
    /// may hold buffers the member offered before its last loss.
    pub(super) lost_before: u64,
    /// With `timing`, per queue: arrivals so far (never reset), and each
    /// delay rule's previous draw.
    pub(super) draws: Vec<(u64, Vec<f64>)>,
}

pub(super) struct State {
    /// Generation changes since start: the current generation is
    /// `generation_of(era)`.
    pub(super) era: u64,
    /// The era whose generation config space shows: the latest one such
    /// that no completion decided in an earlier era is still undelivered.
    pub(super) published: u64,
    /// Completions decided in an era (the key) and not yet delivered, by
    /// number of batches ([`Outgoing`](super::job::Outgoing)).
    pub(super) outgoing: BTreeMap<u64, usize>,
    pub(super) members: Vec<Member>,
    pub(super) slots: HashMap<(u16, u64), Slot>,
    /// The deadline the timer thread sleeps until, if any.
    pub(super) timer_target: Option<Instant>,
    /// Number of the next collective to run; they run in this order.
    pub(super) next_run: u64,
    /// Collectives (by number) that may still read or write guest memory.
    pub(super) running: BTreeSet<u64>,
    /// Threads in [`Group::wait_untouched`](super::Group::wait_untouched): a
    /// collective that ends wakes them only if there are any.
    pub(super) quiet_waiters: u32,
    pub(super) shutdown: bool,
    /// With `timing`, per queue: when the last modelled collective ends,
    /// and collectives started so far (never reset).
    pub(super) modelled: Vec<(Instant, u64)>,
    /// The timing configuration in force (`Shared::timing` at start; may be
    /// replaced with [`Group::set_timing`](super::Group::set_timing)).
    pub(super) timing: Option<Arc<Timing>>,
}

pub(super) enum Slot {
    Waiting(Waiting),
    /// The collective timed out; members in `missing` that arrive late
    /// fail with TIMEOUT too.
    TimedOut(TimedOut),
}

pub(super) struct Waiting {
    /// Indexed by rank.
    pub(super) arrivals: Vec<Option<Arrival>>,
    pub(super) present: u32,
    pub(super) first: Instant,
    pub(super) deadline: Instant,
}

pub(super) struct TimedOut {
    pub(super) missing: Vec<bool>,
    pub(super) left: u32,
    pub(super) peer: u32,
}

/// One member's request, filed in a collective slot.
pub(super) struct Arrival {
    pub(super) rank: u32,
    pub(super) queue: u16,
    pub(super) epoch: u64,
    pub(super) req: Request,
    /// Keeps the member's mapping alive until the request completes.
    pub(super) mem: Arc<GuestMem>,
    pub(super) done: Arc<dyn Completion>,
    pub(super) at: Instant,
    /// Injected before the arrival counts: it counts at `at + delay`.
    pub(super) delay: Duration,
    /// Counts the request in `dmlc_requests_pending` while it lives.
    pub(super) _held: Held,
}

#[derive(Clone, Copy, Debug)]
pub(super) struct Outcome {
    pub(super) status: Status,
    pub(super) detail: u32,
    pub(super) peer: u32,
    /// The daemon failed it on purpose (`--timing` `[[fail]]`): counted in
    /// the injected errors as well, before the completion is visible.
    pub(super) injected: bool,
}

impl Outcome {
    pub(super) const OK: Outcome = Outcome {
        status: Status::Ok,
        detail: 0,
        peer: NO_PEER,
        injected: false,
    };

    pub(super) fn fail(status: Status, detail: u32, peer: u32) -> Self {
        Outcome {
            status,
            detail,
            peer,
            injected: false,
        }
    }

    pub(super) fn injected(self) -> Self {
        Outcome {
            injected: true,
            ..self
        }
    }
}

/// The generation of era `era`: 1 at start, +1 per change, wrapping from
/// `u32::MAX` to 1 (never 0).
pub(super) fn generation_of(era: u64) -> u32 {
    (era % u64::from(u32::MAX)) as u32 + 1
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

pub(super) fn read<T>(m: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(PoisonError::into_inner)
}
