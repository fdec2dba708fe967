//! The matching state under the group's state lock: members, collective
//! slots and the arrivals filed in them, the outcome a request completes
//! with, and the lock helpers every part of the engine uses.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant};

use virtio_dmlc::{Status, NO_PEER};

use super::comms::Comms;
use super::freeze::Freeze;
use super::p2p::P2p;
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
    pub(super) slots: HashMap<SlotKey, Slot>,
    /// Communicators other than 0.
    pub(super) comms: Comms,
    /// Sends and receives waiting for their other end.
    pub(super) p2p: P2p,
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
    /// `dmlc-ctl freeze`: the armed triggers and the held collective.
    pub(super) freeze: Freeze,
}

/// Where the requests of one collective meet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum SlotKey {
    /// Collective `seq` of communicator `comm` on `queue` (5.X.6.6, per
    /// communicator as 5.X.6.13.3 says).
    Coll { comm: u32, queue: u16, seq: u64 },
    /// The `order`-th comm_create of each listed member with this parent
    /// communicator and tag.
    Create { parent: u32, tag: u64, order: u64 },
}

impl SlotKey {
    /// Queue and sequence number, as records and the timing model name a
    /// collective (a comm_create: queue 0 and its order).
    pub(super) fn short(self) -> (u16, u64) {
        match self {
            SlotKey::Coll { queue, seq, .. } => (queue, seq),
            SlotKey::Create { order, .. } => (0, order),
        }
    }

    /// The communicator whose members' requests meet here.
    pub(super) fn comm(self) -> u32 {
        match self {
            SlotKey::Coll { comm, .. } => comm,
            SlotKey::Create { parent, .. } => parent,
        }
    }
}

pub(super) enum Slot {
    Waiting(Waiting),
    /// The collective timed out; members in `missing` that arrive late
    /// fail with TIMEOUT too.
    TimedOut(TimedOut),
}

pub(super) struct Waiting {
    /// Indexed by rank in the communicator (a comm_create: in its parent).
    pub(super) arrivals: Vec<Option<Arrival>>,
    pub(super) present: u32,
    /// Group ranks of the communicator's members, by their rank in it
    /// (`None`: communicator 0).
    pub(super) members: Option<Arc<[u32]>>,
    /// A comm_create: the ranks (in the parent) its first caller listed,
    /// in the new communicator's order; it is complete once they are all
    /// present.
    pub(super) listed: Option<Vec<u32>>,
    pub(super) first: Instant,
    pub(super) deadline: Instant,
}

impl Waiting {
    /// An empty slot for a communicator of `size` whose members are
    /// `members` (`None`: communicator 0).
    pub(super) fn new(size: u32, members: Option<Arc<[u32]>>, now: Instant) -> Self {
        Waiting {
            arrivals: (0..size).map(|_| None).collect(),
            present: 0,
            members,
            listed: None,
            first: now,
            deadline: now,
        }
    }

    /// Every member it waits for has arrived.
    pub(super) fn complete(&self) -> bool {
        match &self.listed {
            Some(l) => l.iter().all(|&r| self.arrivals[r as usize].is_some()),
            None => self.present as usize == self.arrivals.len(),
        }
    }

    /// By rank in the communicator: who it still waits for.
    pub(super) fn missing(&self) -> Vec<bool> {
        self.arrivals
            .iter()
            .enumerate()
            .map(|(i, a)| {
                a.is_none() && self.listed.as_ref().is_none_or(|l| l.contains(&(i as u32)))
            })
            .collect()
    }

    /// The group rank of its rank `r`.
    pub(super) fn world_rank(&self, r: usize) -> u32 {
        self.members.as_ref().map_or(r as u32, |m| m[r])
    }
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
    /// A group rank (or `NO_PEER`); a response of feature bit 1 carries
    /// it as a rank of the request's communicator and as `peer_world`.
    pub(super) peer: u32,
    /// Feature bit 1: the response's `length` (send and receive).
    pub(super) length: u64,
    /// Feature bit 1: the new communicator's id, the member's rank in it
    /// and its size (comm_split, comm_create).
    pub(super) made: Option<(u32, u32, u32)>,
    /// The daemon failed it on purpose (`--timing` `[[fail]]`): counted in
    /// the injected errors as well, before the completion is visible.
    pub(super) injected: bool,
}

impl Outcome {
    pub(super) const OK: Outcome = Outcome {
        status: Status::Ok,
        detail: 0,
        peer: NO_PEER,
        length: 0,
        made: None,
        injected: false,
    };

    pub(super) fn fail(status: Status, detail: u32, peer: u32) -> Self {
        Outcome {
            status,
            detail,
            peer,
            length: 0,
            made: None,
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
