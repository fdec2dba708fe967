//! The requests of feature bits 1 and 2 once matched (spec 5.X.6.13):
//! filing a send or a receive and running the pair it completes, and
//! completing comm_split, comm_create and comm_free.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use virtio_dmlc::comm::{CommOpcode, ANY_SOURCE, MISMATCH_TABLE, TOO_BIG_COMMS};
use virtio_dmlc::{Status, NO_PEER};

use super::comms::split_groups;
use super::job::{Job, Outgoing, Running};
use super::p2p::{decide, P2pWait, Pair};
use super::pieces::{BufAt, Piece};
use super::state::{lock, Arrival, Outcome, SlotKey, State, Waiting};
use super::timed::{completed_at, record_of};
use super::Group;
use crate::chain::{create_list, Code, CommView};

impl Group {
    /// Files a send or a receive (`arrival`, on communicator `view`) and,
    /// if it completes a pair, runs it: one copy from the sender's input
    /// into the receiver's output. `st` is the locked state.
    pub(super) fn file_p2p(
        &self,
        mut st: MutexGuard<'_, State>,
        arrival: Arrival,
        view: CommView,
        deadline: Instant,
    ) {
        let sh = &self.shared;
        let peer = arrival.req.comm.as_ref().map_or(NO_PEER, |c| c.peer);
        let wait = P2pWait {
            send: arrival.req.code == Code::Comm(CommOpcode::Send),
            comm: view.id,
            me: view.rank,
            peer,
            peer_world: if peer == ANY_SOURCE {
                NO_PEER
            } else {
                view.world_rank(peer)
            },
            tag: arrival.req.header.tag.get(),
            deadline,
            arrival,
        };
        let (send, recv) = match st.p2p.arrive(wait) {
            Ok(pair) => pair,
            Err(()) => {
                if st.timer_target.is_none_or(|t| deadline < t) {
                    st.timer_target = Some(deadline);
                    sh.timer_cv.notify_one();
                }
                return;
            }
        };
        match decide(&send.arrival, &recv.arrival) {
            Pair::Fail { send: so, recv: ro } => {
                let era = st.era;
                let batch = Outgoing::register(sh, &mut st, era);
                drop(st);
                let arrivals = [send.arrival, recv.arrival];
                let done_at: Vec<Option<Instant>> = [so, ro]
                    .iter()
                    .zip(&arrivals)
                    .map(|(&out, a)| sh.deliver(a, out).then(Instant::now))
                    .collect();
                drop(batch);
                if let Some(rec) = &sh.recorder {
                    let generation = sh.resp_generation.load(Ordering::Acquire);
                    let key = (arrivals[0].queue, 0);
                    let mut r = record_of(key, generation, &arrivals, sh.world, so);
                    completed_at(&mut r, &arrivals, &done_at);
                    rec.push(r);
                }
            }
            Pair::Copy {
                bytes,
                send: so,
                recv: ro,
            } => {
                // Counted as running under the state lock, as a collective.
                let running = Running::start(sh, &mut st);
                drop(st);
                let pieces = if bytes == 0 {
                    Vec::new()
                } else {
                    vec![Piece::Copy {
                        src: BufAt {
                            member: 0,
                            output: false,
                            base: 0,
                        },
                        dsts: vec![BufAt {
                            member: 1,
                            output: true,
                            base: 0,
                        }],
                        len: bytes,
                    }]
                };
                let key = (send.arrival.queue, 0);
                let job = Job {
                    shared: sh.clone(),
                    key,
                    opcode: Code::Comm(CommOpcode::Send),
                    reduce: None,
                    arrivals: vec![send.arrival, recv.arrival],
                    pieces,
                    ok: vec![so, ro],
                    parts: Vec::new(),
                    next: AtomicUsize::new(0),
                    left: AtomicUsize::new(0),
                    failed: AtomicBool::new(false),
                    panic_at: None,
                    skip_write: None,
                    running,
                    moved_from: sh.recorder.is_some().then(Instant::now),
                    done_at: Mutex::new(Vec::new()),
                    sched: None,
                    check: false,
                    non_finite: Mutex::new(None),
                };
                self.launch(job, false);
            }
        }
    }

    /// Completes a comm_create whose listed members have all arrived: a
    /// new communicator of the reference list, or MISMATCH when a caller's
    /// list differs, or TOO_BIG when no more communicators fit.
    pub(super) fn finish_create(
        &self,
        mut st: MutexGuard<'_, State>,
        key: SlotKey,
        w: Waiting,
        running: Running,
    ) {
        let reference = w.listed.clone().unwrap_or_default();
        let mut differs = None;
        for (r, a) in w.arrivals.iter().enumerate() {
            let Some(a) = a else { continue };
            let list = a.req.comm.as_ref().and_then(|c| create_list(&c.table));
            if differs.is_none() && list.as_ref() != Some(&reference) {
                differs = Some(w.world_rank(r));
            }
        }
        let outs: Vec<Outcome> = if let Some(peer) = differs {
            let out = Outcome::fail(Status::Mismatch, MISMATCH_TABLE, peer);
            w.arrivals.iter().flatten().map(|_| out).collect()
        } else if !st.comms.room_for(1) || st.comms.ids_exhausted() {
            let out = Outcome::fail(Status::TooBig, TOO_BIG_COMMS, NO_PEER);
            w.arrivals.iter().flatten().map(|_| out).collect()
        } else {
            let members: Vec<u32> = reference
                .iter()
                .map(|&r| w.world_rank(r as usize))
                .collect();
            let size = members.len() as u32;
            let id = st.comms.add(members);
            w.arrivals
                .iter()
                .enumerate()
                .filter(|(_, a)| a.is_some())
                .map(|(r, _)| {
                    let at = reference.iter().position(|&x| x as usize == r);
                    Outcome {
                        made: at.map(|p| (id, p as u32, size)),
                        ..Outcome::OK
                    }
                })
                .collect()
        };
        drop(st);
        let arrivals: Vec<Arrival> = w.arrivals.into_iter().flatten().collect();
        self.complete_each(key, arrivals, running, outs);
    }

    /// Completes a comm_split or a comm_free whose members have all
    /// arrived and agree (`members`: the communicator's group ranks, `None`
    /// for communicator 0; `arrivals` in its rank order).
    pub(super) fn finish_comm_op(
        &self,
        key: SlotKey,
        op: CommOpcode,
        arrivals: Vec<Arrival>,
        running: Running,
        members: Option<Arc<[u32]>>,
    ) {
        let sh = &self.shared;
        let parent: Vec<u32> = match &members {
            Some(m) => m.to_vec(),
            None => (0..arrivals.len() as u32).collect(),
        };
        let mut st = lock(&sh.state);
        let outs: Vec<Outcome> = match op {
            CommOpcode::CommFree => {
                st.comms.remove(key.comm());
                arrivals.iter().map(|_| Outcome::OK).collect()
            }
            _ => {
                let given: Vec<(u32, u32)> = arrivals
                    .iter()
                    .map(|a| a.req.comm.as_ref().map_or((0, 0), |c| (c.peer, c.key)))
                    .collect();
                let groups = split_groups(&parent, &given);
                if !st.comms.room_for(groups.len()) || st.comms.ids_exhausted() {
                    let out = Outcome::fail(Status::TooBig, TOO_BIG_COMMS, NO_PEER);
                    arrivals.iter().map(|_| out).collect()
                } else {
                    let mut made = vec![None; arrivals.len()];
                    for (_, g) in groups {
                        let size = g.len() as u32;
                        let places: Vec<usize> = g
                            .iter()
                            .map(|w| parent.iter().position(|p| p == w).unwrap_or(0))
                            .collect();
                        let id = st.comms.add(g);
                        for (rank, p) in places.into_iter().enumerate() {
                            made[p] = Some((id, rank as u32, size));
                        }
                    }
                    made.into_iter()
                        .map(|m| Outcome {
                            made: m,
                            ..Outcome::OK
                        })
                        .collect()
                }
            }
        };
        drop(st);
        self.complete_each(key, arrivals, running, outs);
    }

    /// Completes the arrivals of a request that moved no data, each with
    /// its own outcome, and records it.
    fn complete_each(
        &self,
        key: SlotKey,
        arrivals: Vec<Arrival>,
        running: Running,
        outs: Vec<Outcome>,
    ) {
        let sh = &self.shared;
        running.end();
        let done_at = sh.deliver_together(&arrivals, |i| outs[i]);
        running.delivered();
        if outs.first().is_some_and(|o| o.status == Status::Ok) {
            if let Some(a) = arrivals.first() {
                sh.metrics.collective_done(a.req.code);
            }
        }
        if let (Some(rec), Some(&out)) = (&sh.recorder, outs.first()) {
            let generation = sh.resp_generation.load(Ordering::Acquire);
            let mut r = record_of(key.short(), generation, &arrivals, sh.world, out);
            completed_at(&mut r, &arrivals, &done_at);
            rec.push(r);
        }
    }
}
