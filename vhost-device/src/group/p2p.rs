//! Send and receive (spec 5.X.6.13.4) under the state lock: the sends and
//! receives that wait for their other end, matched per communicator, per
//! ordered pair of ranks and per tag, in the order they arrived; and what a
//! matched pair does (copy, MISMATCH or TRUNCATE).

use std::time::Instant;

use virtio_dmlc::comm::ANY_SOURCE;
use virtio_dmlc::{mismatch, Status, NO_PEER};

use super::state::{Arrival, Outcome};

/// A send or a receive waiting for its other end.
pub(super) struct P2pWait {
    pub(super) send: bool,
    pub(super) comm: u32,
    /// The member's rank in the communicator.
    pub(super) me: u32,
    /// Send: the destination; receive: the source or `ANY_SOURCE`.
    pub(super) peer: u32,
    /// `peer` as a group rank (`NO_PEER` for `ANY_SOURCE`).
    pub(super) peer_world: u32,
    pub(super) tag: u64,
    pub(super) deadline: Instant,
    pub(super) arrival: Arrival,
}

impl P2pWait {
    /// True if `self` (waiting) and `new` (arriving) are the two ends of
    /// one message.
    fn pairs_with(&self, new: &P2pWait) -> bool {
        if self.send == new.send || self.comm != new.comm || self.tag != new.tag {
            return false;
        }
        let (s, r) = if self.send { (self, new) } else { (new, self) };
        s.peer == r.me && (r.peer == ANY_SOURCE || r.peer == s.me)
    }
}

/// Every send and receive that waits, in arrival order.
#[derive(Default)]
pub(super) struct P2p {
    waits: Vec<P2pWait>,
}

impl P2p {
    /// Removes and returns the earliest-arrived waiting end that pairs with
    /// `new`, or files `new` and returns `None`.
    pub(super) fn arrive(&mut self, new: P2pWait) -> Result<(P2pWait, P2pWait), ()> {
        match self.waits.iter().position(|w| w.pairs_with(&new)) {
            Some(i) => {
                let old = self.waits.remove(i);
                Ok(if new.send { (new, old) } else { (old, new) })
            }
            None => {
                self.waits.push(new);
                Err(())
            }
        }
    }

    /// Moves every deadline on by `d` (the time a freeze held the group).
    pub(super) fn postpone(&mut self, d: std::time::Duration) {
        for w in &mut self.waits {
            w.deadline = w.deadline.checked_add(d).unwrap_or(w.deadline);
        }
    }

    /// The earliest deadline of those that wait.
    pub(super) fn next_deadline(&self) -> Option<Instant> {
        self.waits.iter().map(|w| w.deadline).min()
    }

    /// Removes and returns every wait for which `take` is true, in order.
    pub(super) fn take_if(&mut self, mut take: impl FnMut(&P2pWait) -> bool) -> Vec<P2pWait> {
        let mut taken = Vec::new();
        let mut kept = Vec::with_capacity(self.waits.len());
        for w in self.waits.drain(..) {
            if take(&w) {
                taken.push(w);
            } else {
                kept.push(w);
            }
        }
        self.waits = kept;
        taken
    }

    /// Waits (for the control socket).
    pub(super) fn len(&self) -> usize {
        self.waits.len()
    }
}

/// What a matched send and receive do.
pub(super) enum Pair {
    /// Copy the send's `bytes` into the start of the receive's output;
    /// then these outcomes (send's, receive's).
    Copy {
        bytes: usize,
        send: Outcome,
        recv: Outcome,
    },
    /// Complete both at once with these outcomes (send's, receive's).
    Fail { send: Outcome, recv: Outcome },
}

/// Decides a matched pair (`send`, `recv`).
pub(super) fn decide(send: &Arrival, recv: &Arrival) -> Pair {
    let (s, r) = (&send.req, &recv.req);
    if s.dtype != r.dtype {
        let fail = |peer| Outcome::fail(Status::Mismatch, mismatch::DTYPE, peer);
        return Pair::Fail {
            send: fail(recv.rank),
            recv: fail(send.rank),
        };
    }
    let (message, room) = (s.count_bytes(), r.count_bytes());
    if message > room {
        return Pair::Fail {
            send: Outcome {
                length: room as u64,
                ..Outcome::fail(Status::Truncate, 0, recv.rank)
            },
            recv: Outcome {
                length: message as u64,
                ..Outcome::fail(Status::Truncate, 0, send.rank)
            },
        };
    }
    Pair::Copy {
        bytes: message,
        send: Outcome {
            length: message as u64,
            ..Outcome::OK
        },
        recv: Outcome {
            length: message as u64,
            peer: send.rank,
            ..Outcome::OK
        },
    }
}

/// The outcome of a wait that timed out: the other end, or `NO_PEER` for
/// a receive from any source.
pub(super) fn timed_out(w: &P2pWait) -> Outcome {
    let peer = if w.peer == ANY_SOURCE {
        NO_PEER
    } else {
        w.peer_world
    };
    Outcome::fail(Status::Timeout, 0, peer)
}
