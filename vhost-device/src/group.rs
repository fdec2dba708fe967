//! The group engine: matching, ordering, generations, timeouts, and running
//! collectives.
//!
//! Every member's vring thread calls [`Group::submit`] with the chains it
//! pops. A chain is parsed and checked at once ([`crate::chain`]); a bad one
//! is completed with its status. A good one takes the member's next sequence
//! number `k` on its queue `q` and is filed in the collective slot `(q, k)`.
//! The member whose arrival fills the slot runs the collective: small ones
//! on its own thread, big ones split into byte ranges over the reduction
//! threads, with the arriving thread taking ranges too. Whichever thread
//! finishes the last range writes every member's response and calls its
//! [`Completion`].
//!
//! Members: a member is active from [`Group::member_ready`] until
//! [`Group::member_lost`]; chains of an inactive member are dropped. A loss
//! (or [`Group::reset`]) starts a new generation: pending collectives fail
//! on the other members, and every sequence counter restarts at 0 (a loss
//! spares the communicators that do not contain the lost member: their
//! requests and counters are kept, spec 5.X.6.13.3).
//!
//! Locks: one mutex guards the matching state and is never held while data
//! moves or a completion runs. Each member also has a gate (a read-write
//! lock): completions take it for reading, [`Group::member_lost`] for
//! writing, so that once `member_lost` returns no completion for a request
//! the member submitted before is made (its rings are gone).
//!
//! Generations: a change (a loss or a reset) takes effect at once under
//! the state lock (new sequence numbers, new slots, responses carry the
//! new generation), but config space shows the new generation only once
//! every completion decided before the change has been delivered: the
//! requests the change failed, and the collectives that were running or
//! failing then (see [`Outgoing`](job::Outgoing)). A driver that sees the
//! new generation in config space therefore finds every request of the old
//! generation that will ever complete in its used ring already.
//!
//! Panics: a panic while a collective moves data (on the arriving thread
//! or a reduction thread) is caught; the collective then fails on every
//! member with `RESET`, as the whole group is reset (its state can no
//! longer be trusted), and the threads keep serving.
//!
//! Running collectives: every collective is counted in `State::running`
//! from the moment its slot fills (under the state lock) until its last
//! byte has moved. `member_lost` waits, after failing the others' waiting
//! collectives, until every collective that started before the loss has
//! moved its last byte, so that once it returns the daemon no longer reads
//! or writes the lost member's buffers (the driver may reuse them after a
//! reset), whichever thread runs the collective.
//!
//! Files (in `group/`):
//! - this one: [`Group`], [`GroupConfig`], [`Completion`], starting and
//!   stopping the group's threads, config space, members, reset;
//! - `submit.rs`: requests in (`submit`, `refuse_earlier`), filing them in
//!   their slots, running or failing on purpose a filled collective;
//! - `state.rs`: the matching state under the state lock (`State`, slots,
//!   arrivals, outcomes);
//! - `comms.rs`: communicators other than 0 (spec 5.X.6.13.3): ids,
//!   members, their sequence numbers, revocation by a loss;
//! - `p2p.rs`: sends and receives waiting for their other end, and what a
//!   matched pair does;
//! - `blocks.rs`: all-to-all, gather and scatter: their tables' agreement
//!   and their copies;
//! - `comm_ops.rs`: filing a send or receive and running its pair;
//!   completing comm_split, comm_create and comm_free;
//! - `shared.rs`: what every thread shares (`Shared`), delivering
//!   completions, generation changes (`Shared::bump`);
//! - `job.rs`: a running collective (`Job`), the reduction threads,
//!   `Running` and `Outgoing`;
//! - `pieces.rs`: piece planning (`plan`, `split`);
//! - `matching.rs`: header comparison (`mismatch_mask`);
//! - `timed.rs`: timed delivery (`Schedule`, `schedule`, `FailLater`, `Due`)
//!   and flight-recorder records;
//! - `timers.rs`: the `dmlc-delay` and `dmlc-timer` threads and the `Later`
//!   heap;
//! - `freeze.rs`: holding a collective before its data moves (`dmlc-ctl
//!   freeze`, `thaw`, `inspect`, `snapshot`); `inspect.rs`: a member's input
//!   summarised; `snapshot.rs`: a member's part of the group in a snapshot;
//! - [`remote`]: the inter-host stage.

use std::collections::{BTreeMap, BTreeSet, HashMap};
#[cfg(test)]
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, PoisonError, RwLock};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use virtio_dmlc::comm::{CommOpcode, VirtioDmlcConfigComm};
use virtio_dmlc::{Dtype, Opcode, ReduceOp, VirtioDmlcConfig, VIRTIO_DMLC_F_REQ_TIMEOUT};

use crate::chain::SERVED_FEATURES;
use crate::fault::{FaultState, Faults};
use crate::metrics::Metrics;
use crate::timing::Timing;
use crate::trace::Recorder;

mod blocks;
mod comm_ops;
mod comms;
pub mod freeze;
mod inspect;
mod job;
mod matching;
mod p2p;
mod pieces;
mod shared;
pub mod snapshot;
mod state;
mod submit;
mod test_fault;
mod timed;
mod timers;

use job::{worker_loop, Job};
use shared::{Cause, Gate, Shared};
use state::{generation_of, lock, Member, Slot, State};
use timers::{delay_loop, timer_loop, Later};
// Named `super::X` by the inter-host stage ([`remote`]).
use job::Running;
use matching::header_mismatch;
use state::{Arrival, Outcome, Waiting};

/// Collectives that move at least this many bytes are split over the
/// reduction threads; smaller ones run on the arriving thread.
pub const SPLIT_THRESHOLD: usize = 1 << 20;

/// Settings of one group, fixed for the daemon's life.
#[derive(Clone, Debug)]
pub struct GroupConfig {
    /// Number of members (at least 1).
    pub world_size: u32,
    /// Request queues per member (at least 1).
    pub num_queues: u16,
    pub max_segments: u32,
    /// Largest input or output of one request; must fit in `usize`.
    pub max_bytes: u64,
    /// Default collective timeout.
    pub timeout: Duration,
    /// Reduction worker threads; 0 runs every collective on the arriving thread.
    pub reduce_threads: usize,
    pub group_id: u64,
    /// Faults to inject, for tests only (default: none). The daemon fills
    /// it from `DMLC_TEST_FAULTS` ([`crate::fault::faults_from_env`]).
    pub faults: Faults,
    /// Timing model and impairments (`--timing`, [`crate::timing`]); `None`
    /// (or a file that models and injects nothing): every collective
    /// completes as soon as its data has moved, at no extra cost.
    pub timing: Option<Arc<Timing>>,
    /// Collectives the flight recorder keeps ([`crate::trace`]); 0: no
    /// recorder.
    pub trace_capacity: usize,
    /// The timing configuration may change while the group runs
    /// ([`Group::set_timing`], the control socket): the timing machinery
    /// runs even without a model.
    pub live_control: bool,
    /// Most live communicators, 0 included (spec 5.X.6.13.1, `max_comms`).
    pub max_comms: u32,
    /// One group across several hosts ([`remote`]): `world_size` members
    /// here, host-major global ranks, filled slots run by the inter-host
    /// stage. `None`: the group is this host's members alone.
    pub remote: Option<remote::RemoteLink>,
}

/// How the engine hands a finished request back to its member's virtqueue.
///
/// A collective's completions are made in two steps, [`Completion::put`]
/// for every member and then [`Completion::notify`] for each that asked:
/// no notification (a system call that may hand the CPU to the woken
/// frontend) comes between two members' used elements, so a daemon killed
/// while it completes a collective has almost always completed all of its
/// members or none of them.
pub trait Completion: Send + Sync {
    /// Puts `head` with `written` bytes in the used ring of `queue`; true
    /// if the driver asked to be notified.
    fn put(&self, queue: u16, head: u16, written: u32) -> bool;
    /// Notifies the driver of `queue` that its used ring changed.
    fn notify(&self, queue: u16);
    /// [`Completion::put`], then [`Completion::notify`] if asked.
    fn complete(&self, queue: u16, head: u16, written: u32) {
        if self.put(queue, head, written) {
            self.notify(queue);
        }
    }
}

/// How long [`Group::reset`] waits for the inter-host stage to complete
/// the collective it was running (with RESET).
const REMOTE_RESET_WAIT: Duration = Duration::from_millis(500);

/// The collective state shared by every member of the group.
pub struct Group {
    shared: Arc<Shared>,
    pool: Option<mpsc::Sender<Arc<Job>>>,
    workers: Vec<JoinHandle<()>>,
    timer: Option<JoinHandle<()>>,
    /// Delivers held completions at their modelled time (with `timing`).
    delayer: Option<JoinHandle<()>>,
}

impl Group {
    /// Creates the group and starts its timer and reduction threads.
    pub fn new(config: GroupConfig) -> Arc<Group> {
        let world = config.world_size.max(1);
        let num_queues = config.num_queues.max(1);
        // A file that models and injects nothing costs nothing, unless the
        // configuration may change later.
        let timing = config
            .timing
            .clone()
            .filter(|t| !t.is_ideal() || config.live_control)
            .or_else(|| config.live_control.then(|| Arc::new(Timing::ideal())));
        let per_queue = |n: usize| if timing.is_some() { n } else { 0 };
        let rules = timing.as_ref().map_or(0, |t| t.state_len());
        // Members are active only once the glue says they are ready.
        let gate = Gate {
            epoch: 0,
            accepting: false,
        };
        let members = (0..world)
            .map(|_| Member {
                gate,
                connected: false,
                req_timeout: false,
                seqs: vec![0; usize::from(num_queues)],
                lost_before: 0,
                draws: vec![(0, vec![0.0; rules]); per_queue(usize::from(num_queues))],
            })
            .collect();
        let shared = Arc::new(Shared {
            world,
            num_queues,
            metrics: Metrics::new(world),
            state: Mutex::new(State {
                era: 0,
                published: 0,
                outgoing: BTreeMap::new(),
                members,
                slots: HashMap::new(),
                comms: comms::Comms::new(config.max_comms),
                p2p: p2p::P2p::default(),
                timer_target: None,
                next_run: 0,
                running: BTreeSet::new(),
                quiet_waiters: 0,
                shutdown: false,
                modelled: vec![(Instant::now(), 0); per_queue(usize::from(num_queues))],
                timing: timing.clone(),
                freeze: freeze::Freeze::default(),
            }),
            timer_cv: Condvar::new(),
            quiet_cv: Condvar::new(),
            gates: (0..world).map(|_| RwLock::new(gate)).collect(),
            features: (0..world).map(|_| AtomicU64::new(0)).collect(),
            generation: AtomicU32::new(1),
            resp_generation: AtomicU32::new(1),
            faults: FaultState::new(config.faults.clone()),
            later: timing.as_ref().map(|_| Later::default()),
            timing,
            recorder: (config.trace_capacity > 0).then(|| Recorder::new(config.trace_capacity)),
            late_warned: AtomicBool::new(false),
            #[cfg(test)]
            worker_panics: AtomicUsize::new(0),
            cfg: config,
        });
        for f in shared.cfg.faults.items() {
            log::warn!("test fault planned: {f}");
            if let crate::fault::Fault::SkipWrite { rank, .. } = *f {
                if rank >= world {
                    log::warn!(
                        "test fault {f} names rank {rank}, but the group has {world} members"
                    );
                }
            }
        }
        shared.metrics.set_generation(1);
        if let Some(link) = &shared.cfg.remote {
            // The inter-host stage acts on news of a loss on another host
            // before this host's first collective too.
            let _ = link.tx.send(remote::Work(remote::Step::Attach {
                shared: shared.clone(),
            }));
        }

        let timer = {
            let shared = shared.clone();
            thread::Builder::new()
                .name("dmlc-timer".into())
                .spawn(move || timer_loop(&shared))
                .map_err(|e| log::error!("cannot start the timer thread: {e}"))
                .ok()
        };

        let delayer = shared.later.as_ref().and_then(|later| {
            let sh = shared.clone();
            thread::Builder::new()
                .name("dmlc-delay".into())
                .spawn(move || delay_loop(&sh))
                .map_err(|e| {
                    log::error!(
                        "cannot start the timing model's thread: {e}; collectives complete \
                         without the model"
                    );
                    // Nothing would deliver held completions: hold none.
                    lock(&later.heap).shutdown = true;
                })
                .ok()
        });

        let mut workers = Vec::new();
        let mut pool = None;
        if shared.cfg.reduce_threads > 0 {
            let (tx, rx) = mpsc::channel::<Arc<Job>>();
            let rx = Arc::new(Mutex::new(rx));
            for i in 0..shared.cfg.reduce_threads {
                let rx = rx.clone();
                match thread::Builder::new()
                    .name(format!("dmlc-reduce-{i}"))
                    .spawn(move || worker_loop(&rx))
                {
                    Ok(h) => workers.push(h),
                    Err(e) => log::error!("cannot start reduction thread {i}: {e}"),
                }
            }
            if !workers.is_empty() {
                pool = Some(tx);
            }
        }

        Arc::new(Group {
            shared,
            pool,
            workers,
            timer,
            delayer,
        })
    }

    /// The config space that member `rank` reads, with the fields of
    /// feature bit 1 (spec 5.X.6.13.1), which a driver without it does not
    /// read.
    pub fn config_space(&self, rank: u32) -> VirtioDmlcConfigComm {
        let sh = &self.shared;
        let base = VirtioDmlcConfig {
            rank: sh.global(rank).into(),
            world_size: sh.global_world().into(),
            num_queues: u32::from(sh.num_queues).into(),
            max_segments: sh.cfg.max_segments.into(),
            max_bytes: sh.cfg.max_bytes.into(),
            dtypes: Dtype::all_mask().into(),
            ops: ReduceOp::all_mask().into(),
            opcodes: (Opcode::all_mask() | self.comm_opcodes()).into(),
            generation: sh.generation.load(Ordering::Acquire).into(),
            group_id: sh.cfg.group_id.into(),
        };
        VirtioDmlcConfigComm {
            base,
            max_comms: lock(&sh.state).comms.max().into(),
            reserved: 0.into(),
        }
    }

    /// The device-specific feature bits beyond bit 0 the group offers:
    /// those this backend serves ([`SERVED_FEATURES`]: bits 1 to 3 of spec
    /// 5.X.6.13, bit 4 of 5.X.6.14), none across hosts (spec DEV-COMM-8:
    /// the inter-host stage runs only the opcodes of 5.X.6.1, and does
    /// not check its reductions).
    pub fn comm_features(&self) -> u64 {
        if self.shared.cfg.remote.is_some() {
            0
        } else {
            SERVED_FEATURES
        }
    }

    /// The `opcodes` bits of the opcodes those features bring.
    fn comm_opcodes(&self) -> u32 {
        let offered = self.comm_features();
        CommOpcode::ALL
            .iter()
            .filter(|o| offered & (1 << o.feature()) != 0)
            .fold(0, |m, o| m | 1 << o.raw())
    }

    /// Reduction threads still running (for tests).
    #[cfg(test)]
    pub(crate) fn live_workers(&self) -> usize {
        self.workers.iter().filter(|w| !w.is_finished()).count()
    }

    /// Panics caught on reduction threads so far (for tests).
    #[cfg(test)]
    pub(crate) fn worker_panics(&self) -> usize {
        self.shared.worker_panics.load(Ordering::Relaxed)
    }

    /// The group's counters.
    pub fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }

    /// The flight recorder, if the group keeps one.
    pub fn recorder(&self) -> Option<&Recorder> {
        self.shared.recorder.as_ref()
    }

    /// True if the timing machinery runs (a model or an impairment was
    /// configured, or the configuration may change).
    pub fn timed(&self) -> bool {
        self.shared.timing.is_some()
    }

    /// The timing configuration in force, if the timing machinery runs.
    pub fn timing(&self) -> Option<Arc<Timing>> {
        lock(&self.shared.state).timing.clone()
    }

    /// Replaces the timing configuration from the next arrival on
    /// (collectives already scheduled keep theirs). Refused unless the
    /// timing machinery runs (`--timing` with a model, or `--control-socket`).
    pub fn set_timing(&self, t: Timing) -> Result<(), &'static str> {
        if self.shared.later.is_none() {
            return Err(
                "the daemon runs without the timing machinery (start it with a \
                        --timing model or with --control-socket)",
            );
        }
        log::info!(
            "timing changed: model {:?}, {} delay rule(s), {} bandwidth rule(s), {} failure(s) \
             and {} withheld completion(s) planned",
            t.model,
            t.delays.len(),
            t.bandwidth.len(),
            t.fails.len(),
            t.withholds.len()
        );
        lock(&self.shared.state).timing = Some(Arc::new(t));
        Ok(())
    }

    /// The group's state, for the control socket: generation, members,
    /// sequence numbers, waiting collectives, held completions, timing.
    pub fn state_json(&self) -> serde_json::Value {
        let sh = &self.shared;
        let held = sh.later.as_ref().map(|l| lock(&l.heap).entries.len());
        let st = lock(&sh.state);
        let members: Vec<serde_json::Value> = st
            .members
            .iter()
            .enumerate()
            .map(|(rank, m)| {
                serde_json::json!({
                    "rank": rank,
                    "connected": m.connected,
                    "active": m.gate.accepting,
                    "next_seq": m.seqs,
                })
            })
            .collect();
        let waiting = st
            .slots
            .values()
            .filter(|s| matches!(s, Slot::Waiting(_)))
            .count();
        serde_json::json!({
            "group_id": format!("{:#x}", sh.cfg.group_id),
            "world_size": sh.world,
            "queues": sh.num_queues,
            "generation": generation_of(st.era),
            "published_generation": generation_of(st.published),
            "members": members,
            "waiting_collectives": waiting,
            "waiting_sends_and_receives": st.p2p.len(),
            "communicators": st.comms.live_count() + 1,
            "running_collectives": st.running.len(),
            "requests_pending": sh.metrics.pending(),
            "held_completions": held,
            "freeze": freeze::freeze_json(&st),
            "timing": st.timing.as_ref().map(|t| serde_json::json!({
                "model": format!("{:?}", t.model),
                "modelled_world_size": t.model.world(),
                "delay_rules": t.delays.len(),
                "bandwidth_rules": t.bandwidth.len(),
                "failures_planned": t.fails.len(),
                "withholds_planned": t.withholds.len(),
                "seed": t.seed,
            })),
            "trace_records": sh.recorder.as_ref().map(Recorder::len),
        })
    }

    /// The generation config space shows (1 at start, +1 on every member
    /// loss or reset, once the requests the change failed are completed).
    pub fn generation(&self) -> u32 {
        self.shared.generation.load(Ordering::Acquire)
    }

    /// Records the features member `rank`'s driver acknowledged: with
    /// `VIRTIO_DMLC_F_REQ_TIMEOUT`, its requests' `timeout_ms` is honoured;
    /// with `VIRTIO_DMLC_F_COMM`, its requests and responses have the
    /// layout of spec 5.X.6.13.1.
    pub fn set_member_features(&self, rank: u32, acked: u64) {
        if rank >= self.shared.world {
            return;
        }
        // Bits 1 to 4 count only where offered: a driver that acknowledges
        // one it was not offered keeps the layout of 5.X.6.1. Bit 4 counts
        // only with bit 1 (spec DRV-NF-1), whose response carries its index.
        let comm_bits = 0b1111 << virtio_dmlc::comm::VIRTIO_DMLC_F_COMM;
        let mut acked = acked & (!comm_bits | self.comm_features());
        if acked & (1 << virtio_dmlc::comm::VIRTIO_DMLC_F_COMM) == 0 {
            acked &= !(1 << virtio_dmlc::VIRTIO_DMLC_F_NONFINITE);
        }
        self.shared.features[rank as usize].store(acked, Ordering::Release);
        let mut st = lock(&self.shared.state);
        st.members[rank as usize].req_timeout = acked & (1 << VIRTIO_DMLC_F_REQ_TIMEOUT) != 0;
    }

    /// Member `rank` became active (its driver negotiated features, or, with
    /// `defer_activation`, it sent its first request): its requests are
    /// accepted from now on. Chains a
    /// member submits while it is not active (before its first
    /// `member_ready`, or after [`Group::member_lost`] until the next) are
    /// dropped without a completion. Does not change the generation.
    pub fn member_ready(&self, rank: u32) {
        let sh = &self.shared;
        if rank >= sh.world {
            return;
        }
        // State first, gate second (while holding the state lock): a submit
        // that sees the open gate then finds the state agreeing with it.
        let mut st = lock(&sh.state);
        let gate = {
            let mut g = sh.gates[rank as usize]
                .write()
                .unwrap_or_else(PoisonError::into_inner);
            g.accepting = true;
            *g
        };
        let m = &mut st.members[rank as usize];
        m.gate = gate;
        m.connected = true;
        let connected = st.members.iter().filter(|m| m.connected).count();
        sh.metrics.set_members_connected(connected as u32);
    }

    /// Member `rank` disconnected or reset its device: its own pending
    /// requests are dropped, the others' collectives that need it fail with
    /// PEER_LOST, and the generation changes. Once this returns, no
    /// completion is made for any request `rank` submitted before, no
    /// collective reads or writes the buffers of those requests any more,
    /// and its new submissions are dropped until [`Group::member_ready`].
    /// Further calls before `member_ready` are the same loss and change
    /// nothing (they wait as the first did), so the glue may call this from
    /// every place that sees the loss.
    ///
    /// A collective that includes `rank` may be running (on any member's
    /// thread, helped by the reduction threads) when the loss comes: it
    /// runs to its end with its own hold on every member's memory, the
    /// other members get its full result, and `rank`'s completion is
    /// dropped. The others' waiting collectives fail first; then this waits
    /// for every collective that started before the loss to move its last
    /// byte (see [`Group::wait_untouched`]), which takes at most the rest of
    /// their run. A [`Group::submit`] of `rank` under way meanwhile either
    /// has its chain dropped (the gate it read no longer matches under the
    /// state lock) or completed such a collective.
    ///
    /// Waits for completions of `rank` under way and for running
    /// collectives: must not be called from inside a
    /// [`Completion::complete`] or while holding a lock that one takes.
    pub fn member_lost(&self, rank: u32) {
        let sh = &self.shared;
        if rank >= sh.world {
            return;
        }
        let gate = {
            // Waits for completions of this member that are under way.
            let mut g = sh.gates[rank as usize]
                .write()
                .unwrap_or_else(PoisonError::into_inner);
            if g.accepting {
                g.epoch += 1;
                g.accepting = false;
                Some(*g)
            } else {
                // Already lost and not back yet: the same loss.
                None
            }
        };
        if let Some(gate) = gate {
            self.shared.bump(Cause::Lost(rank, gate), &[]);
        }
        self.wait_untouched(rank);
    }

    /// Waits until no collective that started before member `rank`'s last
    /// loss still reads or writes guest memory: once it returns, the
    /// daemon no longer touches a buffer that `rank` offered before that
    /// loss. [`Group::member_lost`] calls it itself; the glue may call it
    /// again where it answers a second notice of the same loss. Returns at
    /// once for a member never lost. Same restrictions as `member_lost`.
    pub fn wait_untouched(&self, rank: u32) {
        let sh = &self.shared;
        if rank >= sh.world {
            return;
        }
        let mut st = lock(&sh.state);
        let before = st.members[rank as usize].lost_before;
        // Collectives end in any order; the oldest one still running is
        // the one to wait for.
        while st.running.first().is_some_and(|&id| id < before) {
            st.quiet_waiters += 1;
            st = sh.quiet_cv.wait(st).unwrap_or_else(PoisonError::into_inner);
            st.quiet_waiters -= 1;
        }
    }

    /// Resets the group for a reason other than a lost member (an orderly
    /// shutdown, an operator's request): the generation changes, every
    /// pending collective fails with RESET on every member, and sequence
    /// numbers restart. Members stay active.
    ///
    /// Across hosts ([`remote`]) the inter-host stage gives up the step it
    /// waits in (an MPI collective cannot be cancelled, so the job then
    /// ends): its collective completes with RESET too, which this waits
    /// for, at most [`REMOTE_RESET_WAIT`].
    pub fn reset(&self) {
        let sh = &self.shared;
        if let Some(link) = &sh.cfg.remote {
            link.abandon.store(true, Ordering::Release);
        }
        sh.bump(Cause::Reset, &[]);
        if sh.cfg.remote.is_some() {
            // Until every completion decided before the reset is delivered
            // (the inter-host stage's collective holds one until it is).
            let until = Instant::now() + REMOTE_RESET_WAIT;
            loop {
                let st = lock(&sh.state);
                let era = st.era;
                if st.outgoing.keys().next().is_none_or(|&e| e >= era) || Instant::now() >= until {
                    break;
                }
                drop(st);
                thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        lock(&self.shared.state).shutdown = true;
        if let Some(later) = &self.shared.later {
            // The thread delivers what is held, then ends.
            lock(&later.heap).shutdown = true;
            later.cv.notify_all();
        }
        if let Some(t) = self.delayer.take() {
            if t.thread().id() != thread::current().id() {
                let _ = t.join();
            }
        }
        self.shared.timer_cv.notify_all();
        let me = thread::current().id();
        if let Some(t) = self.timer.take() {
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
        // Closing the channel ends the workers once they are idle.
        self.pool = None;
        for w in self.workers.drain(..) {
            if w.thread().id() != me {
                let _ = w.join();
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod harness;
#[cfg(test)]
mod tests;

pub mod remote;
