//! What every thread of the group shares ([`Shared`]): the state lock, the
//! members' gates and generations, and the delivery of completions through
//! them, including a generation change ([`Shared::bump`]).

#[cfg(test)]
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::Instant;

use virtio_dmlc::comm::VirtioDmlcRespComm;
use virtio_dmlc::{Status, VirtioDmlcResp, NO_PEER};
use vm_memory::{Bytes, GuestAddress};
use zerocopy::IntoBytes;

use super::comms::peer_in;
use super::job::Outgoing;
use super::state::{generation_of, lock, read, Arrival, Outcome, Slot, SlotKey, State};
use super::timers::Later;
use super::{remote, Completion, GroupConfig};
use crate::chain::{CommView, Request};
use crate::fault::FaultState;
use crate::metrics::Metrics;
use crate::timing::Timing;
use crate::trace::Recorder;
use crate::GuestMem;

/// The layout of a response: that of 5.X.6.1, or that of feature bit 1
/// with the communicator whose ranks it names (`None`: a request refused
/// before its communicator was known; ranks are the group's).
#[derive(Clone, Copy)]
pub(super) enum Shape<'a> {
    Base,
    Comm(Option<&'a CommView>),
}

impl<'a> Shape<'a> {
    pub(super) fn of(req: &'a Request) -> Self {
        match &req.comm {
            Some(c) => Shape::Comm(Some(&c.view)),
            None => Shape::Base,
        }
    }
}

/// A response to write: where, what, with which generation, in which layout.
pub(super) type Response<'a> = (&'a GuestMem, GuestAddress, Outcome, u32, Shape<'a>);

/// Whether a member's requests may be completed: `epoch` changes every
/// time the member is lost, and `accepting` is false from a loss until the
/// member is ready again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Gate {
    pub(super) epoch: u64,
    pub(super) accepting: bool,
}

pub(super) struct Shared {
    pub(super) world: u32,
    pub(super) num_queues: u16,
    pub(super) cfg: GroupConfig,
    pub(super) metrics: Metrics,
    pub(super) state: Mutex<State>,
    /// Wakes the timer thread (new earlier deadline, or shutdown).
    pub(super) timer_cv: Condvar,
    /// Wakes [`Group::wait_untouched`](super::Group::wait_untouched) when a
    /// collective ends.
    pub(super) quiet_cv: Condvar,
    /// Per member; see [`Gate`]. Mirrored in `State::members` for checks
    /// made under the state lock.
    pub(super) gates: Vec<RwLock<Gate>>,
    /// Per member: the feature bits its driver acknowledged.
    pub(super) features: Vec<AtomicU64>,
    /// The generation config space shows (`State::published`), for
    /// lock-free reads.
    pub(super) generation: AtomicU32,
    /// The generation responses carry: the current one (`State::era`).
    pub(super) resp_generation: AtomicU32,
    /// The test fault plan being carried out.
    pub(super) faults: FaultState,
    /// The timing configuration at start, if the timing machinery runs
    /// (then also `later`, and `State::timing` holds the current one).
    pub(super) timing: Option<Arc<Timing>>,
    /// Completions held until their modelled time (with `timing`).
    pub(super) later: Option<Later>,
    /// The flight recorder, if any.
    pub(super) recorder: Option<Recorder>,
    /// A collective that outlasted its model was logged.
    pub(super) late_warned: AtomicBool,
    /// Panics caught on reduction threads (for tests).
    #[cfg(test)]
    pub(super) worker_panics: AtomicUsize,
}

/// Why the generation changes ([`Shared::bump`]).
#[derive(Clone, Copy, Debug)]
pub(super) enum Cause {
    /// Member lost, with its new gate.
    Lost(u32, Gate),
    /// A reset: shutdown, an operator, a collective that failed inside
    /// the device.
    Reset,
    /// An injected loss of this member ([`crate::timing`]): the others'
    /// requests fail with PEER_LOST, its own with RESET (it is still
    /// there).
    Injected(u32),
    /// A member on another host (global rank) was lost ([`remote`]).
    Remote(u32),
}

impl Shared {
    /// Completes an arrival with `out`, in the current generation; false if
    /// its member was lost (the completion is dropped).
    pub(super) fn deliver(&self, a: &Arrival, out: Outcome) -> bool {
        let generation = self.resp_generation.load(Ordering::Acquire);
        self.deliver_in(a, out, generation)
    }

    /// Completes an arrival with `out`; its response carries `generation`.
    pub(super) fn deliver_in(&self, a: &Arrival, out: Outcome, generation: u32) -> bool {
        self.finish(
            a.rank,
            a.epoch,
            a.queue,
            a.req.head,
            &a.done,
            Some((&a.mem, a.req.response, out, generation, Shape::of(&a.req))),
            a.req.writable_len,
        )
    }

    /// A generation change, for `cause`. Every waiting collective fails
    /// (a lost member's own requests are dropped), and so do the requests
    /// in `extra` (those of a collective that failed inside the device, or
    /// on purpose); all of them are completed, with the new generation in
    /// their response, before config space shows it. Completions held by
    /// the timing model are then delivered at once.
    pub(super) fn bump(self: &Arc<Shared>, cause: Cause, extra: &[Arrival]) {
        let sh = self;
        let lost = match cause {
            Cause::Lost(rank, gate) => Some((rank, gate)),
            Cause::Reset | Cause::Injected(_) | Cause::Remote(_) => None,
        };
        let outcome = |a: &Arrival| match cause {
            Cause::Lost(rank, _) => Outcome::fail(Status::PeerLost, 0, sh.global(rank)),
            Cause::Remote(peer) => Outcome::fail(Status::PeerLost, 0, peer),
            Cause::Reset => Outcome::fail(Status::Reset, 0, NO_PEER),
            // The member said lost is alive: its requests fail as in a reset.
            Cause::Injected(rank) if a.rank == rank => Outcome::fail(Status::Reset, 0, NO_PEER),
            Cause::Injected(rank) => Outcome::fail(Status::PeerLost, 0, rank),
        };
        let mut failed = Vec::new();
        let (generation, batch) = {
            let mut st = lock(&sh.state);
            st.era += 1;
            let generation = generation_of(st.era);
            // New responses carry the new generation from now on; config
            // space shows it once the failures below are delivered.
            sh.resp_generation.store(generation, Ordering::Release);
            for m in &mut st.members {
                m.seqs.iter_mut().for_each(|s| *s = 0);
            }
            // The modelled cluster starts afresh too (held completions are
            // delivered below).
            let now = Instant::now();
            for q in &mut st.modelled {
                q.0 = now;
            }
            let next_run = st.next_run;
            if let Some((rank, gate)) = lost {
                let m = &mut st.members[rank as usize];
                m.gate = gate;
                m.connected = false;
                // A collective that includes this member's old requests
                // started before now: every slot that would have started
                // one later is dropped just below.
                m.lost_before = next_run;
                let connected = st.members.iter().filter(|m| m.connected).count();
                sh.metrics.set_members_connected(connected as u32);
            }
            // A loss fails what is pending on the communicators that
            // contain the lost member (0 among them) and revokes those
            // other than 0; anything else fails everything pending and
            // ends every communicator but 0 (spec 5.X.6.13.3).
            let State {
                comms,
                slots,
                p2p,
                freeze,
                ..
            } = &mut *st;
            let affected = |comm: u32| lost.is_none_or(|(rank, _)| comms.contains(comm, rank));
            let keys: Vec<SlotKey> = slots
                .keys()
                .copied()
                .filter(|k| affected(k.comm()))
                .collect();
            let waits = p2p.take_if(|w| affected(w.comm));
            let mut dropped_or_failed = |a: Arrival| {
                if lost.is_some_and(|(rank, _)| a.rank == rank) {
                    sh.metrics.dropped();
                } else {
                    failed.push(a);
                }
            };
            // Freeze-on-error (spec 5.X.6.15): the first waiting collective
            // of communicator 0 or another with a remaining member in it is
            // held, its PEER_LOST made only when it is thawed.
            let lost_rank = lost.map(|(rank, _)| rank);
            let park = lost_rank
                .filter(|_| sh.cfg.remote.is_none() && freeze.on_error_armed())
                .and_then(|rank| {
                    keys.iter().copied().find(|k| {
                        matches!(k, SlotKey::Coll { .. })
                            && matches!(slots.get(k), Some(Slot::Waiting(w))
                                if w.arrivals.iter().flatten().any(|a| a.rank != rank))
                    })
                });
            let mut parked = Vec::new();
            for k in keys {
                if let Some(Slot::Waiting(w)) = slots.remove(&k) {
                    for a in w.arrivals.into_iter().flatten() {
                        if Some(k) == park && Some(a.rank) != lost_rank {
                            parked.push(a);
                        } else {
                            dropped_or_failed(a);
                        }
                    }
                }
            }
            waits.into_iter().for_each(|w| dropped_or_failed(w.arrival));
            match lost {
                Some((rank, _)) => comms.lose(rank),
                None => comms.reset(),
            }
            if let (Some(link), Some((rank, _))) = (&sh.cfg.remote, lost) {
                // Under the state lock, after every collective of the old
                // era that was handed over: the other hosts learn of the
                // loss at the step this host's next collective would take.
                let _ = link.tx.send(remote::Work(remote::Step::Lost {
                    shared: sh.clone(),
                    peer: sh.global(rank),
                }));
            }
            // These requests belong to the era before the change.
            let era = st.era - 1;
            let batch = (!failed.is_empty() || !extra.is_empty())
                .then(|| Outgoing::register(sh, &mut st, era));
            if let (Some(key), Some(rank)) = (park, lost_rank) {
                // Counted as undelivered: config space keeps the old
                // generation until the held failure is delivered.
                let held_batch = Outgoing::register(sh, &mut st, era);
                let out = Outcome::fail(Status::PeerLost, 0, sh.global(rank));
                st.freeze
                    .hold_lost(key, sh.global(rank), parked, out, generation, held_batch);
            }
            sh.publish(&mut st);
            (generation, batch)
        };
        for a in failed.iter().chain(extra) {
            let out = match cause {
                Cause::Injected(_) => outcome(a).injected(),
                _ => outcome(a),
            };
            sh.deliver_in(a, out, generation);
        }
        drop(batch);
        if let Some(later) = &sh.later {
            later.flush();
        }
    }

    /// Makes the latest generation that may be shown visible in config
    /// space: that of the current era, unless completions decided in an
    /// earlier era are still undelivered.
    pub(super) fn publish(&self, st: &mut State) {
        let target = match st.outgoing.keys().next() {
            Some(&oldest) => oldest.min(st.era),
            None => st.era,
        };
        if target > st.published {
            st.published = target;
            let generation = generation_of(target);
            self.generation.store(generation, Ordering::Release);
            self.metrics.set_generation(generation);
        }
    }

    /// Answers a parsed request with `out` at once, without running it,
    /// with the generation of the moment.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn answer_now(
        &self,
        rank: u32,
        epoch: u64,
        queue: u16,
        mem: &GuestMem,
        req: &Request,
        done: &Arc<dyn Completion>,
        out: Outcome,
    ) -> bool {
        let generation = self.resp_generation.load(Ordering::Acquire);
        let response = Some((mem, req.response, out, generation, Shape::of(req)));
        self.finish(
            rank,
            epoch,
            queue,
            req.head,
            done,
            response,
            req.writable_len,
        )
    }

    /// Writes the response (if any) and completes the chain, with used
    /// length `writable_len` (or 0 without a response), unless the member
    /// was lost since `epoch` (then false). The response carries the
    /// generation given with it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn finish(
        &self,
        rank: u32,
        epoch: u64,
        queue: u16,
        head: u16,
        done: &Arc<dyn Completion>,
        response: Option<Response<'_>>,
        writable_len: u32,
    ) -> bool {
        let gate = read(&self.gates[rank as usize]);
        if gate.epoch != epoch || !gate.accepting {
            self.metrics.dropped();
            return false;
        }
        let notify = self.respond(rank, queue, head, done, response, writable_len);
        drop(gate);
        if notify {
            done.notify(queue);
        }
        true
    }

    /// Completes every arrival of one collective with `out`, in the current
    /// generation: every member's response and used element first, then
    /// the notifications ([`Completion`] says why). Per arrival, when it
    /// was completed, or `None` if its member was lost (the completion is
    /// dropped).
    pub(super) fn deliver_together(
        &self,
        arrivals: &[Arrival],
        out: impl Fn(usize) -> Outcome,
    ) -> Vec<Option<Instant>> {
        let generation = self.resp_generation.load(Ordering::Acquire);
        let mut to_notify = Vec::with_capacity(arrivals.len());
        let delivered: Vec<bool> = arrivals
            .iter()
            .enumerate()
            .map(|(i, a)| {
                let gate = read(&self.gates[a.rank as usize]);
                if gate.epoch != a.epoch || !gate.accepting {
                    self.metrics.dropped();
                    return false;
                }
                let response = Some((
                    &*a.mem,
                    a.req.response,
                    out(i),
                    generation,
                    Shape::of(&a.req),
                ));
                if self.respond(
                    a.rank,
                    a.queue,
                    a.req.head,
                    &a.done,
                    response,
                    a.req.writable_len,
                ) {
                    to_notify.push(a);
                }
                true
            })
            .collect();
        for a in to_notify {
            a.done.notify(a.queue);
        }
        let at = Instant::now();
        delivered.into_iter().map(|d| d.then_some(at)).collect()
    }

    /// As [`Shared::deliver`], after `write` (which moves the member's
    /// output data), both under the member's gate: nothing is written for
    /// a member lost since its request.
    pub(super) fn finish_after(
        &self,
        a: &Arrival,
        out: Outcome,
        generation: u32,
        write: impl FnOnce(),
    ) -> bool {
        let gate = read(&self.gates[a.rank as usize]);
        if gate.epoch != a.epoch || !gate.accepting {
            self.metrics.dropped();
            return false;
        }
        write();
        let response = Some((&*a.mem, a.req.response, out, generation, Shape::of(&a.req)));
        let notify = self.respond(
            a.rank,
            a.queue,
            a.req.head,
            &a.done,
            response,
            a.req.writable_len,
        );
        drop(gate);
        if notify {
            a.done.notify(a.queue);
        }
        true
    }

    /// The member's global rank: `host * world + rank` across hosts.
    pub(super) fn global(&self, rank: u32) -> u32 {
        match &self.cfg.remote {
            Some(link) => link.host * self.world + rank,
            None => rank,
        }
    }

    /// The world size members see: every host's members.
    pub(super) fn global_world(&self) -> u32 {
        match &self.cfg.remote {
            Some(link) => link.hosts * self.world,
            None => self.world,
        }
    }

    /// Writes the response (if any) and puts the chain in the used ring;
    /// the caller holds the member's gate, open in the request's epoch, and
    /// notifies the driver afterwards if this returns true.
    fn respond(
        &self,
        rank: u32,
        queue: u16,
        head: u16,
        done: &Arc<dyn Completion>,
        response: Option<Response<'_>>,
        writable_len: u32,
    ) -> bool {
        let written = match response {
            Some((mem, addr, out, generation, shape)) => {
                let view = match shape {
                    Shape::Base => None,
                    Shape::Comm(v) => Some(v),
                };
                let base = VirtioDmlcResp {
                    status: out.status.raw().into(),
                    detail: out.detail.into(),
                    peer: peer_in(view.flatten(), out.peer).into(),
                    generation: generation.into(),
                };
                if out.status != Status::Ok {
                    self.metrics.error(out.status);
                }
                if out.injected {
                    self.metrics.injected_error(out.status);
                }
                let (id, comm_rank, size) = out.made.unwrap_or((0, 0, 0));
                let with_comm = VirtioDmlcRespComm {
                    base,
                    length: out.length.into(),
                    comm: id.into(),
                    comm_rank: comm_rank.into(),
                    comm_size: size.into(),
                    peer_world: out.peer.into(),
                };
                let bytes = match view {
                    None => base.as_bytes(),
                    Some(_) => with_comm.as_bytes(),
                };
                match mem.write_slice(bytes, addr) {
                    Ok(()) => writable_len,
                    Err(e) => {
                        // Checked at parse time; only a changed mapping gets here.
                        log::warn!("member {rank}: cannot write response: {e}");
                        self.metrics.no_status();
                        0
                    }
                }
            }
            None => {
                self.metrics.no_status();
                0
            }
        };
        done.put(queue, head, written)
    }
}
