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
//! on the other members, and every sequence counter restarts at 0.
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
//! failing then (see [`Outgoing`]). A driver that sees the new generation
//! in config space therefore finds every request of the old generation
//! that will ever complete in its used ring already.
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

use std::collections::{btree_map, BTreeMap, BTreeSet, BinaryHeap, HashMap};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use virtio_dmlc::{
    mismatch, Dtype, Opcode, ReduceOp, Status, VirtioDmlcConfig, VirtioDmlcReq, VirtioDmlcResp,
    NO_PEER, VIRTIO_DMLC_F_REQ_TIMEOUT,
};
use virtio_queue::DescriptorChain;
use vm_memory::{Bytes, GuestAddress};
use zerocopy::IntoBytes;

use crate::chain::{self, Limits, Request};
use crate::datapath::{self, SegRef};
use crate::fault::{FaultState, Faults};
use crate::metrics::{Held, Metrics};
use crate::timing::{FailRule, Timing};
use crate::trace::{MemberRecord, Record, Recorder};
use crate::GuestMem;

/// Collectives that move at least this many bytes are split over the
/// reduction threads; smaller ones run on the arriving thread.
pub const SPLIT_THRESHOLD: usize = 1 << 20;
/// Smallest byte range handed to one reduction thread.
const MIN_PART: usize = 256 << 10;
/// Byte ranges start on page (and so cache-line and element) boundaries
/// of the buffers: no two threads write one line, and a range's chunks
/// start on lines.
const PART_ALIGN: usize = 4096;
/// Ranges per thread taking part: threads take ranges as they come free,
/// so a thread that waits for a CPU (a busy machine) leaves its share to
/// the others instead of holding up the collective.
const PARTS_PER_THREAD: usize = 4;

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
    /// One group across several hosts ([`remote`]): `world_size` members
    /// here, host-major global ranks, filled slots run by the inter-host
    /// stage. `None`: the group is this host's members alone.
    pub remote: Option<remote::RemoteLink>,
}

/// How the engine hands a finished request back to its member's virtqueue.
pub trait Completion: Send + Sync {
    /// Puts `head` with `written` bytes in the used ring of `queue` and
    /// notifies the driver if it asked to be notified.
    fn complete(&self, queue: u16, head: u16, written: u32);
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

/// Whether a member's requests may be completed: `epoch` changes every
/// time the member is lost, and `accepting` is false from a loss until the
/// member is ready again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Gate {
    epoch: u64,
    accepting: bool,
}

struct Shared {
    world: u32,
    num_queues: u16,
    cfg: GroupConfig,
    metrics: Metrics,
    state: Mutex<State>,
    /// Wakes the timer thread (new earlier deadline, or shutdown).
    timer_cv: Condvar,
    /// Wakes [`Group::wait_untouched`] when a collective ends.
    quiet_cv: Condvar,
    /// Per member; see [`Gate`]. Mirrored in `State::members` for checks
    /// made under the state lock.
    gates: Vec<RwLock<Gate>>,
    /// The generation config space shows (`State::published`), for
    /// lock-free reads.
    generation: AtomicU32,
    /// The generation responses carry: the current one (`State::era`).
    resp_generation: AtomicU32,
    /// The test fault plan being carried out.
    faults: FaultState,
    /// The timing configuration at start, if the timing machinery runs
    /// (then also `later`, and `State::timing` holds the current one).
    timing: Option<Arc<Timing>>,
    /// Completions held until their modelled time (with `timing`).
    later: Option<Later>,
    /// The flight recorder, if any.
    recorder: Option<Recorder>,
    /// A collective that outlasted its model was logged.
    late_warned: AtomicBool,
    /// Panics caught on reduction threads (for tests).
    #[cfg(test)]
    worker_panics: AtomicUsize,
}

/// Why the generation changes ([`Shared::bump`]).
#[derive(Clone, Copy, Debug)]
enum Cause {
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

struct Member {
    gate: Gate,
    connected: bool,
    req_timeout: bool,
    /// Next sequence number per queue.
    seqs: Vec<u64>,
    /// Collectives that started before this one (see `State::next_run`)
    /// may hold buffers the member offered before its last loss.
    lost_before: u64,
    /// With `timing`, per queue: arrivals so far (never reset), and each
    /// delay rule's previous draw.
    draws: Vec<(u64, Vec<f64>)>,
}

struct State {
    /// Generation changes since start: the current generation is
    /// `generation_of(era)`.
    era: u64,
    /// The era whose generation config space shows: the latest one such
    /// that no completion decided in an earlier era is still undelivered.
    published: u64,
    /// Completions decided in an era (the key) and not yet delivered, by
    /// number of batches ([`Outgoing`]).
    outgoing: BTreeMap<u64, usize>,
    members: Vec<Member>,
    slots: HashMap<(u16, u64), Slot>,
    /// The deadline the timer thread sleeps until, if any.
    timer_target: Option<Instant>,
    /// Number of the next collective to run; they run in this order.
    next_run: u64,
    /// Collectives (by number) that may still read or write guest memory.
    running: BTreeSet<u64>,
    /// Threads in [`Group::wait_untouched`]: a collective that ends wakes
    /// them only if there are any.
    quiet_waiters: u32,
    shutdown: bool,
    /// With `timing`, per queue: when the last modelled collective ends,
    /// and collectives started so far (never reset).
    modelled: Vec<(Instant, u64)>,
    /// The timing configuration in force (`Shared::timing` at start; may be
    /// replaced with [`Group::set_timing`]).
    timing: Option<Arc<Timing>>,
}

enum Slot {
    Waiting(Waiting),
    /// The collective timed out; members in `missing` that arrive late
    /// fail with TIMEOUT too.
    TimedOut(TimedOut),
}

struct Waiting {
    /// Indexed by rank.
    arrivals: Vec<Option<Arrival>>,
    present: u32,
    first: Instant,
    deadline: Instant,
}

struct TimedOut {
    missing: Vec<bool>,
    left: u32,
    peer: u32,
}

/// One member's request, filed in a collective slot.
struct Arrival {
    rank: u32,
    queue: u16,
    epoch: u64,
    req: Request,
    /// Keeps the member's mapping alive until the request completes.
    mem: Arc<GuestMem>,
    done: Arc<dyn Completion>,
    at: Instant,
    /// Injected before the arrival counts: it counts at `at + delay`.
    delay: Duration,
    /// Counts the request in `dmlc_requests_pending` while it lives.
    _held: Held,
}

#[derive(Clone, Copy, Debug)]
struct Outcome {
    status: Status,
    detail: u32,
    peer: u32,
    /// The daemon failed it on purpose (`--timing` `[[fail]]`): counted in
    /// the injected errors as well, before the completion is visible.
    injected: bool,
}

impl Outcome {
    const OK: Outcome = Outcome {
        status: Status::Ok,
        detail: 0,
        peer: NO_PEER,
        injected: false,
    };

    fn fail(status: Status, detail: u32, peer: u32) -> Self {
        Outcome {
            status,
            detail,
            peer,
            injected: false,
        }
    }

    fn injected(self) -> Self {
        Outcome {
            injected: true,
            ..self
        }
    }
}

/// The generation of era `era`: 1 at start, +1 per change, wrapping from
/// `u32::MAX` to 1 (never 0).
fn generation_of(era: u64) -> u32 {
    (era % u64::from(u32::MAX)) as u32 + 1
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn read<T>(m: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(PoisonError::into_inner)
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
            metrics: Metrics::new(),
            state: Mutex::new(State {
                era: 0,
                published: 0,
                outgoing: BTreeMap::new(),
                members,
                slots: HashMap::new(),
                timer_target: None,
                next_run: 0,
                running: BTreeSet::new(),
                quiet_waiters: 0,
                shutdown: false,
                modelled: vec![(Instant::now(), 0); per_queue(usize::from(num_queues))],
                timing: timing.clone(),
            }),
            timer_cv: Condvar::new(),
            quiet_cv: Condvar::new(),
            gates: (0..world).map(|_| RwLock::new(gate)).collect(),
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

    /// The config space that member `rank` reads.
    pub fn config_space(&self, rank: u32) -> VirtioDmlcConfig {
        let sh = &self.shared;
        VirtioDmlcConfig {
            rank: sh.global(rank).into(),
            world_size: sh.global_world().into(),
            num_queues: u32::from(sh.num_queues).into(),
            max_segments: sh.cfg.max_segments.into(),
            max_bytes: sh.cfg.max_bytes.into(),
            dtypes: Dtype::all_mask().into(),
            ops: ReduceOp::all_mask().into(),
            opcodes: Opcode::all_mask().into(),
            generation: sh.generation.load(Ordering::Acquire).into(),
            group_id: sh.cfg.group_id.into(),
        }
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
            "running_collectives": st.running.len(),
            "requests_pending": sh.metrics.pending(),
            "held_completions": held,
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
    /// `VIRTIO_DMLC_F_REQ_TIMEOUT`, its requests' `timeout_ms` is honoured.
    pub fn set_member_features(&self, rank: u32, acked: u64) {
        if rank >= self.shared.world {
            return;
        }
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

    /// Completes a chain without running it, with `RESET`: a request that
    /// was made available before this connection, which a new group must
    /// not serve (spec 5.X.6.9). A malformed chain gets the status its
    /// fault calls for, as in [`Group::submit`].
    pub fn refuse_earlier(
        &self,
        rank: u32,
        queue: u16,
        mem: &Arc<GuestMem>,
        chain: DescriptorChain<&GuestMem>,
        done: &Arc<dyn Completion>,
    ) {
        let sh = &*self.shared;
        let Some((req, gate)) = self.admit(rank, queue, mem, chain, done) else {
            return;
        };
        sh.metrics.request(req.opcode);
        let reset = Outcome::fail(Status::Reset, 0, NO_PEER);
        sh.answer_now(rank, gate.epoch, queue, mem, &req, done, reset);
    }

    /// What `submit` and `refuse_earlier` share: the member must be known
    /// and accepting, and the chain well formed; otherwise the chain is
    /// answered here (or dropped) and `None` returned.
    fn admit(
        &self,
        rank: u32,
        queue: u16,
        mem: &Arc<GuestMem>,
        chain: DescriptorChain<&GuestMem>,
        done: &Arc<dyn Completion>,
    ) -> Option<(Request, Gate)> {
        let sh = &*self.shared;
        let head = chain.head_index();
        if rank >= sh.world || queue >= sh.num_queues {
            log::error!("request from unknown member {rank} queue {queue}");
            sh.metrics.no_status();
            done.complete(queue, head, 0);
            return None;
        }
        let gate = *read(&sh.gates[rank as usize]);
        if !gate.accepting {
            sh.metrics.dropped();
            return None;
        }
        let limits = Limits {
            world_size: sh.global_world(),
            rank: sh.global(rank),
            max_segments: sh.cfg.max_segments,
            max_bytes: sh.cfg.max_bytes,
        };
        let req = match chain::parse(chain, &limits) {
            Ok(req) => req,
            Err(rej) => {
                if let Some(op) = rej.opcode {
                    sh.metrics.request(op);
                }
                let response = match (rej.error.status_detail(), rej.response) {
                    (Some((status, detail)), Some(addr)) => Some((
                        &**mem,
                        addr,
                        Outcome::fail(status, detail, NO_PEER),
                        sh.resp_generation.load(Ordering::Acquire),
                    )),
                    _ => None,
                };
                sh.finish(
                    rank,
                    gate.epoch,
                    queue,
                    head,
                    done,
                    response,
                    rej.writable_len,
                );
                return None;
            }
        };
        Some((req, gate))
    }

    /// Takes one chain popped from `queue` of member `rank`. Exactly one
    /// `done.complete(queue, head, len)` follows, now or later, from any
    /// thread, unless the member is not active (see [`Group::member_ready`])
    /// or is lost first. `len` is 0 for a chain without a usable response
    /// descriptor, else the total length of its writable descriptors.
    ///
    /// `chain` must come from `mem`. The caller must not hold a lock that a
    /// [`Completion`] of any member takes: the collective may run, and every
    /// member's completion may be called, on this thread.
    pub fn submit(
        &self,
        rank: u32,
        queue: u16,
        mem: &Arc<GuestMem>,
        chain: DescriptorChain<&GuestMem>,
        done: &Arc<dyn Completion>,
    ) {
        let sh = &*self.shared;
        let Some((req, gate)) = self.admit(rank, queue, mem, chain, done) else {
            return;
        };
        sh.metrics.request(req.opcode);
        if req.opcode == Opcode::Nop {
            // Answered at once for this member alone (spec 5.X.6.3): no
            // sequence number, no timeout, no timing model.
            sh.answer_now(rank, gate.epoch, queue, mem, &req, done, Outcome::OK);
            return;
        }

        let now = Instant::now();
        let mut arrival = Arrival {
            rank,
            queue,
            epoch: gate.epoch,
            req,
            mem: mem.clone(),
            done: done.clone(),
            at: now,
            delay: Duration::ZERO,
            _held: sh.metrics.hold(),
        };
        let mut st = lock(&sh.state);
        let m = &mut st.members[rank as usize];
        if m.gate != gate {
            // Lost while parsing: this chain belongs to a ring that is gone.
            drop(st);
            sh.metrics.dropped();
            return;
        }
        let timeout = match arrival.req.header.timeout_ms.get() {
            ms if m.req_timeout && ms != 0 => Duration::from_millis(u64::from(ms)),
            _ => sh.cfg.timeout,
        };
        // A timeout too large for Instant means no timeout in practice.
        let deadline = now
            .checked_add(timeout)
            .or_else(|| now.checked_add(Duration::from_secs(1 << 30)))
            .unwrap_or(now);
        let seq = m.seqs[usize::from(queue)];
        m.seqs[usize::from(queue)] = seq + 1;
        let key = (queue, seq);
        let State {
            timing, members, ..
        } = &mut *st;
        if let Some(t) = timing {
            // Under the state lock, in the member's order of arrivals on
            // this queue: the same requests get the same delays.
            let m = &mut members[rank as usize];
            let (index, last) = &mut m.draws[usize::from(queue)];
            last.resize(t.state_len(), 0.0);
            arrival.delay = t.delay(rank, queue, *index, last);
            *index += 1;
            if !arrival.delay.is_zero() {
                sh.metrics.injected_delay(arrival.delay);
            }
        }

        let mut waiting = match st.slots.remove(&key) {
            Some(Slot::TimedOut(mut t)) => {
                let peer = t.peer;
                if t.missing[rank as usize] {
                    t.missing[rank as usize] = false;
                    t.left -= 1;
                }
                if t.left > 0 {
                    st.slots.insert(key, Slot::TimedOut(t));
                }
                let era = st.era;
                let batch = Outgoing::register(&self.shared, &mut st, era);
                drop(st);
                let out = Outcome::fail(Status::Timeout, 0, peer);
                let delivered = sh.deliver(&arrival, out);
                drop(batch);
                if let Some(rec) = &sh.recorder {
                    let generation = sh.resp_generation.load(Ordering::Acquire);
                    let mut r = record_of(
                        key,
                        generation,
                        std::slice::from_ref(&arrival),
                        sh.world,
                        out,
                    );
                    r.members[rank as usize].completed = delivered.then(Instant::now);
                    rec.push(r);
                }
                return;
            }
            Some(Slot::Waiting(w)) => w,
            None => Waiting {
                arrivals: (0..sh.world).map(|_| None).collect(),
                present: 0,
                first: now,
                deadline,
            },
        };
        waiting.deadline = waiting.deadline.min(deadline);
        if waiting.arrivals[rank as usize].is_none() {
            waiting.present += 1;
        }
        waiting.arrivals[rank as usize] = Some(arrival);
        if waiting.present < sh.world {
            let deadline = waiting.deadline;
            st.slots.insert(key, Slot::Waiting(waiting));
            if st.timer_target.is_none_or(|t| deadline < t) {
                st.timer_target = Some(deadline);
                sh.timer_cv.notify_one();
            }
            return;
        }
        // Counted as running under the state lock, so that a loss after
        // this point waits for it.
        let running = Running::start(&self.shared, &mut st);
        if let Some(link) = &sh.cfg.remote {
            // Handed over under the state lock: the inter-host stage takes
            // this host's collectives in the order their slots filled.
            let era = st.era;
            let step = remote::Step::Collective {
                shared: self.shared.clone(),
                era,
                waiting,
                running,
            };
            if let Err(mpsc::SendError(remote::Work(step))) = link.tx.send(remote::Work(step)) {
                drop(st);
                if let remote::Step::Collective {
                    waiting, running, ..
                } = step
                {
                    log::error!("the inter-host stage is gone: the collective fails with RESET");
                    for a in waiting.arrivals.iter().flatten() {
                        sh.deliver(a, Outcome::fail(Status::Reset, 0, NO_PEER));
                    }
                    drop(running);
                }
            }
            return;
        }
        let sched = st
            .timing
            .clone()
            .map(|t| schedule(&t, &mut st, key, &waiting));
        drop(st);
        self.run(key, waiting, running, sched);
    }

    /// Runs collective `key`, whose members have all arrived.
    fn run(&self, key: (u16, u64), w: Waiting, running: Running, sched: Option<Schedule>) {
        let sh = &self.shared;
        let arrivals: Vec<Arrival> = w.arrivals.into_iter().flatten().collect();
        // Effective arrivals: an injected delay counts as its member's.
        let counted = |a: &Arrival| a.at + a.delay;
        let last = arrivals.iter().map(counted).max().unwrap_or(w.first);
        let first = arrivals.iter().map(counted).min().unwrap_or(w.first);
        sh.metrics.skew(last.saturating_duration_since(first));
        if let Some(what) = sched.as_ref().and_then(|s| s.slowed.as_ref()) {
            sh.metrics.injected_bandwidth();
            log::info!(
                "injected: collective (queue {}, seq {}): {what}",
                key.0,
                key.1
            );
        }
        if let Some(Schedule {
            fail: Some(injected),
            ..
        }) = sched
        {
            self.inject(key, arrivals, running, injected, w.deadline);
            return;
        }

        let reference = &arrivals[0].req;
        let mut mask = 0;
        let mut peer = NO_PEER;
        for a in &arrivals[1..] {
            let m = mismatch_mask(reference, &a.req);
            if m != 0 && peer == NO_PEER {
                peer = a.rank;
            }
            mask |= m;
        }
        if mask != 0 {
            // No data moves.
            running.end();
            let out = Outcome::fail(Status::Mismatch, mask, peer);
            let mut done_at = Vec::new();
            for a in &arrivals {
                let delivered = sh.deliver(a, out);
                if sh.recorder.is_some() {
                    done_at.push(delivered.then(Instant::now));
                }
            }
            running.delivered();
            if let Some(rec) = &sh.recorder {
                let generation = sh.resp_generation.load(Ordering::Acquire);
                let mut r = record_of(key, generation, &arrivals, sh.world, out);
                completed_at(&mut r, &arrivals, &done_at);
                rec.push(r);
            }
            return;
        }

        let mut pieces = plan(&arrivals);
        let fired = if pieces.is_empty() {
            None
        } else {
            sh.faults.next()
        };
        let mut skip_write = None;
        let mut panic_now = false;
        if let Some((nth, f)) = fired {
            if let Some(rank) = f.skip_write {
                log::warn!(
                    "test fault: collective {nth} (queue {}, seq {}) leaves rank {rank}'s \
                     outputs unwritten",
                    key.0,
                    key.1
                );
                skip_write = Some(rank);
                forget_outputs(&mut pieces, rank as usize);
            }
            if f.panic {
                log::warn!(
                    "test fault: collective {nth} (queue {}, seq {}) panics in a part",
                    key.0,
                    key.1
                );
                panic_now = true;
            }
        }
        let total: usize = pieces.iter().map(Piece::len).sum();
        let reduce = reference.dtype.zip(reference.op);
        let opcode = reference.opcode;
        let n_arrivals = arrivals.len();
        let mut job = Job {
            shared: sh.clone(),
            key,
            opcode,
            reduce,
            arrivals,
            pieces,
            parts: Vec::new(),
            next: AtomicUsize::new(0),
            left: AtomicUsize::new(0),
            failed: AtomicBool::new(false),
            panic_at: None,
            skip_write,
            running,
            moved_from: (sched.is_some() || sh.recorder.is_some()).then(Instant::now),
            done_at: Mutex::new(if sched.is_some() {
                vec![None; n_arrivals]
            } else {
                Vec::new()
            }),
            sched,
        };
        // Bounced elements are loaded before any data moves (a panic here
        // fails the collective like one in a part).
        job.guarded(|| {
            for b in job.arrivals.iter().flat_map(|a| &a.req.bounces) {
                // SAFETY: the arrival keeps its guest memory mapped, and no
                // data movement of this collective has started.
                unsafe { b.fill() };
            }
        });
        let threads = self.workers.len();
        match &self.pool {
            Some(pool) if total >= SPLIT_THRESHOLD => {
                job.parts = split(&job.pieces, threads);
                job.left = AtomicUsize::new(job.parts.len());
                job.panic_at = panic_now.then(|| job.parts.len() - 1);
                sh.metrics.split();
                let helpers = threads.min(job.parts.len().saturating_sub(1));
                let job = Arc::new(job);
                for _ in 0..helpers {
                    if pool.send(job.clone()).is_err() {
                        break;
                    }
                }
                job.work();
            }
            _ => {
                job.panic_at = panic_now.then(|| job.pieces.len().saturating_sub(1));
                for (i, p) in job.pieces.iter().enumerate() {
                    job.run_unit(i, i, 0, p.len());
                }
                if job.sched.is_some() {
                    // Its completions may be held until the modelled time.
                    let job = Arc::new(job);
                    job.finish(Some(&job));
                } else {
                    job.finish(None);
                }
            }
        }
    }
}

impl Group {
    /// Fails collective `key` on purpose, as `injected` says, instead of
    /// running it: the members get the statuses a real failure gives.
    fn inject(
        &self,
        key: (u16, u64),
        arrivals: Vec<Arrival>,
        running: Running,
        injected: Injected,
        deadline: Instant,
    ) {
        let sh = &self.shared;
        // No data moves.
        running.end();
        let (status, rank, what, at) = match injected {
            Injected::Rule(FailRule { status, rank, .. }) => (
                status,
                rank,
                format!("{status} of rank {rank} ([[fail]] rule)"),
                deadline,
            ),
            Injected::LateArrival { rank, at } => (
                Status::Timeout,
                rank,
                format!("timeout: rank {rank}'s injected delay ended after the deadline"),
                at.max(deadline),
            ),
        };
        log::info!(
            "injected: collective (queue {}, seq {}) fails with {what}",
            key.0,
            key.1
        );
        if status == Status::PeerLost {
            // As a real loss of `rank` (a new generation; every pending
            // collective fails with PEER_LOST), except that `rank` stays a
            // member: its own requests complete with RESET.
            sh.bump(Cause::Injected(rank), &arrivals);
            running.delivered();
            if let Some(rec) = &sh.recorder {
                let generation = sh.resp_generation.load(Ordering::Acquire);
                let out = Outcome::fail(Status::PeerLost, 0, rank);
                let mut r = record_of(key, generation, &arrivals, sh.world, out);
                let now = Instant::now();
                for m in &mut r.members {
                    m.completed = m.arrived.map(|_| now);
                    if m.rank == rank {
                        m.status = Status::Reset;
                    }
                }
                r.injected.push(what);
                rec.push(r);
            }
            return;
        }
        // TIMEOUT, at the deadline as a real one.
        let f = FailLater {
            shared: sh.clone(),
            key,
            arrivals,
            out: Outcome::fail(Status::Timeout, 0, rank),
            running,
            what,
        };
        match &sh.later {
            Some(later) if at > Instant::now() => later.push(at, Due::Fail(Box::new(f))),
            _ => f.deliver(),
        }
    }
}

/// When a collective completes under the timing model, and whether it
/// fails on purpose.
#[derive(Clone, Debug)]
struct Schedule {
    /// Modelled start: the last effective arrival, or the modelled end of
    /// the previous collective on the same queue if later.
    start: Instant,
    /// Modelled completion (of the latest modelled rank).
    due: Instant,
    /// By rank, each member's modelled completion, where the algorithm
    /// makes them differ ([`crate::timing::Model::rank_time`]); empty:
    /// every member completes at `due`.
    member_due: Vec<Instant>,
    /// The member whose completion is withheld on purpose.
    withheld: Option<u32>,
    /// What an injected bandwidth factor did, for the trace.
    slowed: Option<String>,
    /// A failure to inject instead of running it.
    fail: Option<Injected>,
}

impl Schedule {
    /// Member `i`'s modelled completion.
    fn due_of(&self, i: usize) -> Instant {
        self.member_due.get(i).copied().unwrap_or(self.due)
    }
}

/// A failure the daemon injects.
#[derive(Clone, Copy, Debug)]
enum Injected {
    /// From a `[[fail]]` rule.
    Rule(FailRule),
    /// An injected delay made member `rank` count as arriving at `at`,
    /// after the collective's deadline.
    LateArrival { rank: u32, at: Instant },
}

/// The schedule of collective `key`, whose members have all arrived
/// (`w`); called under the state lock `st`, in the order collectives fill.
fn schedule(t: &Timing, st: &mut State, key: (u16, u64), w: &Waiting) -> Schedule {
    let q = usize::from(key.0);
    let (busy, started) = st.modelled[q];
    st.modelled[q].1 = started + 1;
    let present: Vec<&Arrival> = w.arrivals.iter().flatten().collect();
    let (last_rank, last) = present
        .iter()
        .map(|a| (a.rank, a.at + a.delay))
        .max_by_key(|x| x.1)
        .unwrap_or((0, w.first));
    let at_once = |fail| Schedule {
        start: last,
        due: last,
        member_due: Vec::new(),
        withheld: None,
        slowed: None,
        fail,
    };
    let failing = |fail| at_once(Some(fail));
    if let Some(rule) = t.failure(key.0, started) {
        return failing(Injected::Rule(rule));
    }
    if last > w.deadline {
        return failing(Injected::LateArrival {
            rank: last_rank,
            at: last,
        });
    }
    let reference = &present[0].req;
    if present[1..]
        .iter()
        .any(|a| mismatch_mask(reference, &a.req) != 0)
    {
        // Fails at once with MISMATCH: nothing to model.
        return at_once(None);
    }
    let start = last.max(busy);
    let (opcode, block, root) = (
        reference.opcode,
        reference.count_bytes() as u64,
        reference.root,
    );
    let slowdown = t.slowdown(key.0, started, present.iter().map(|a| a.rank));
    let slowed_model = slowdown
        .as_ref()
        .map(|s| t.model.with_bandwidth_factor(s.factor));
    let model = slowed_model.as_ref().unwrap_or(&t.model);
    // The host's own latency, as the file says, comes off every modelled
    // time.
    let due = start + model.time(opcode, block).saturating_sub(t.overhead);
    st.modelled[q].0 = due;
    let member_due = present
        .iter()
        .map(|a| {
            model
                .rank_time(opcode, block, root, a.rank)
                .map(|d| start + d.saturating_sub(t.overhead))
        })
        .collect::<Option<Vec<Instant>>>()
        .unwrap_or_default();
    let slowed = slowdown.map(|s| {
        let ranks: Vec<String> = s
            .ranks
            .iter()
            .map(|(r, f)| format!("rank {r} at {f}x"))
            .collect();
        format!(
            "bandwidth of {} ([[bandwidth]] rule): the collective ran at {}x",
            ranks.join(", "),
            s.factor
        )
    });
    Schedule {
        start,
        due,
        member_due,
        withheld: t
            .withheld(key.0, started)
            .filter(|r| present.iter().any(|a| a.rank == *r)),
        slowed,
        fail: None,
    }
}

/// What a record of collective `key` starts with: its header (that of the
/// first arrival), every member's arrival, `out` as every member's status.
fn record_of(
    key: (u16, u64),
    generation: u32,
    arrivals: &[Arrival],
    world: u32,
    out: Outcome,
) -> Record {
    let reference = arrivals.first().map(|a| &a.req);
    let mut members: Vec<MemberRecord> = (0..world)
        .map(|rank| MemberRecord {
            rank,
            arrived: None,
            delay: Duration::ZERO,
            completed: None,
            modelled: None,
            withheld: false,
            status: out.status,
        })
        .collect();
    let mut injected = Vec::new();
    for a in arrivals {
        if let Some(m) = members.get_mut(a.rank as usize) {
            m.arrived = Some(a.at);
            m.delay = a.delay;
        }
        if !a.delay.is_zero() {
            injected.push(format!(
                "delay of rank {} by {:.1} us",
                a.rank,
                a.delay.as_nanos() as f64 / 1000.0
            ));
        }
    }
    Record {
        queue: key.0,
        seq: key.1,
        generation,
        opcode: reference.map_or(Opcode::Barrier, |r| r.opcode),
        dtype: reference.and_then(|r| r.dtype),
        op: reference.and_then(|r| r.op),
        count: reference.map_or(0, |r| r.count),
        bytes: reference.map_or(0, |r| r.count_bytes() as u64),
        members,
        moved: None,
        modelled: None,
        late: false,
        peer: out.peer,
        injected,
    }
}

/// Sets each arrival's completion time in `r` (`done_at` in the order of
/// `arrivals`).
fn completed_at(r: &mut Record, arrivals: &[Arrival], done_at: &[Option<Instant>]) {
    for (a, t) in arrivals.iter().zip(done_at) {
        if let Some(m) = r.members.get_mut(a.rank as usize) {
            m.completed = *t;
        }
    }
}

/// An injected TIMEOUT held until the deadline.
struct FailLater {
    shared: Arc<Shared>,
    key: (u16, u64),
    arrivals: Vec<Arrival>,
    out: Outcome,
    running: Running,
    what: String,
}

impl FailLater {
    fn deliver(self) {
        let sh = &self.shared;
        let mut done_at = Vec::new();
        for a in &self.arrivals {
            let delivered = sh.deliver(a, self.out.injected());
            done_at.push(delivered.then(Instant::now));
        }
        self.running.delivered();
        if let Some(rec) = &sh.recorder {
            let generation = sh.resp_generation.load(Ordering::Acquire);
            let mut r = record_of(self.key, generation, &self.arrivals, sh.world, self.out);
            completed_at(&mut r, &self.arrivals, &done_at);
            r.injected.push(self.what);
            rec.push(r);
        }
    }
}

/// A completion held until its time.
enum Due {
    /// A collective whose data has moved (its end, and whether it ended
    /// after the modelled completion).
    Job {
        job: Arc<Job>,
        moved_to: Option<Instant>,
        late: bool,
    },
    Fail(Box<FailLater>),
}

impl Due {
    /// Delivers what is due now (everything if `all`: after shutdown, or
    /// at a generation change).
    fn deliver(self, all: bool) {
        match self {
            Due::Job {
                job,
                moved_to,
                late,
            } => job.deliver_due(moved_to, late, all),
            Due::Fail(f) => f.deliver(),
        }
    }
}

struct LaterEntry {
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
struct LaterHeap {
    entries: BinaryHeap<LaterEntry>,
    next: u64,
    shutdown: bool,
}

/// Completions held until their modelled time, delivered by the
/// `dmlc-delay` thread ([`delay_loop`]). Its lock is a leaf: nothing is
/// delivered while it is held.
#[derive(Default)]
struct Later {
    heap: Mutex<LaterHeap>,
    cv: Condvar,
}

impl Later {
    /// Holds `what` until `due` (delivers it at once after shutdown).
    fn push(&self, due: Instant, what: Due) {
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
    fn flush(&self) {
        let entries = std::mem::take(&mut lock(&self.heap).entries);
        // Ascending in the reversed order: the latest first.
        for e in entries.into_sorted_vec().into_iter().rev() {
            e.what.deliver(true);
        }
    }
}

/// Delivers held completions at their time (`Later`).
fn delay_loop(sh: &Arc<Shared>) {
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

impl Shared {
    /// Completes an arrival with `out`, in the current generation; false if
    /// its member was lost (the completion is dropped).
    fn deliver(&self, a: &Arrival, out: Outcome) -> bool {
        let generation = self.resp_generation.load(Ordering::Acquire);
        self.deliver_in(a, out, generation)
    }

    /// Completes an arrival with `out`; its response carries `generation`.
    fn deliver_in(&self, a: &Arrival, out: Outcome, generation: u32) -> bool {
        self.finish(
            a.rank,
            a.epoch,
            a.queue,
            a.req.head,
            &a.done,
            Some((&a.mem, a.req.response, out, generation)),
            a.req.writable_len,
        )
    }

    /// A generation change, for `cause`. Every waiting collective fails
    /// (a lost member's own requests are dropped), and so do the requests
    /// in `extra` (those of a collective that failed inside the device, or
    /// on purpose); all of them are completed, with the new generation in
    /// their response, before config space shows it. Completions held by
    /// the timing model are then delivered at once.
    fn bump(self: &Arc<Shared>, cause: Cause, extra: &[Arrival]) {
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
            for (_, slot) in st.slots.drain() {
                if let Slot::Waiting(w) = slot {
                    for a in w.arrivals.into_iter().flatten() {
                        if lost.is_some_and(|(rank, _)| a.rank == rank) {
                            sh.metrics.dropped();
                        } else {
                            failed.push(a);
                        }
                    }
                }
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
    fn publish(&self, st: &mut State) {
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
    fn answer_now(
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
        let response = Some((mem, req.response, out, generation));
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
    fn finish(
        &self,
        rank: u32,
        epoch: u64,
        queue: u16,
        head: u16,
        done: &Arc<dyn Completion>,
        response: Option<(&GuestMem, GuestAddress, Outcome, u32)>,
        writable_len: u32,
    ) -> bool {
        let gate = read(&self.gates[rank as usize]);
        if gate.epoch != epoch || !gate.accepting {
            self.metrics.dropped();
            return false;
        }
        self.respond(rank, queue, head, done, response, writable_len);
        drop(gate);
        true
    }

    /// As [`Shared::deliver`], after `write` (which moves the member's
    /// output data), both under the member's gate: nothing is written for
    /// a member lost since its request.
    fn finish_after(
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
        let response = Some((&*a.mem, a.req.response, out, generation));
        self.respond(
            a.rank,
            a.queue,
            a.req.head,
            &a.done,
            response,
            a.req.writable_len,
        );
        drop(gate);
        true
    }

    /// The member's global rank: `host * world + rank` across hosts.
    fn global(&self, rank: u32) -> u32 {
        match &self.cfg.remote {
            Some(link) => link.host * self.world + rank,
            None => rank,
        }
    }

    /// The world size members see: every host's members.
    fn global_world(&self) -> u32 {
        match &self.cfg.remote {
            Some(link) => link.hosts * self.world,
            None => self.world,
        }
    }

    /// Writes the response (if any) and completes the chain; the caller
    /// holds the member's gate, open in the request's epoch.
    fn respond(
        &self,
        rank: u32,
        queue: u16,
        head: u16,
        done: &Arc<dyn Completion>,
        response: Option<(&GuestMem, GuestAddress, Outcome, u32)>,
        writable_len: u32,
    ) {
        let written = match response {
            Some((mem, addr, out, generation)) => {
                let resp = VirtioDmlcResp {
                    status: out.status.raw().into(),
                    detail: out.detail.into(),
                    peer: out.peer.into(),
                    generation: generation.into(),
                };
                if out.status != Status::Ok {
                    self.metrics.error(out.status);
                }
                if out.injected {
                    self.metrics.injected_error(out.status);
                }
                match mem.write_slice(resp.as_bytes(), addr) {
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
        done.complete(queue, head, written);
    }
}

/// Fails the collectives whose deadline passed.
fn timer_loop(sh: &Arc<Shared>) {
    let mut st = lock(&sh.state);
    loop {
        if st.shutdown {
            return;
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
        let mut failed = Vec::new();
        for key in expired {
            let Some(Slot::Waiting(w)) = st.slots.remove(&key) else {
                continue;
            };
            let missing: Vec<bool> = w.arrivals.iter().map(Option::is_none).collect();
            let peer = sh.global(missing.iter().position(|m| *m).unwrap_or(0) as u32);
            let left = sh.world - w.present;
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
        if !failed.is_empty() {
            let era = st.era;
            let batch = Outgoing::register(sh, &mut st, era);
            drop(st);
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
                    let mut r = record_of(*key, generation, arrivals, sh.world, *out);
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

fn worker_loop(rx: &Mutex<mpsc::Receiver<Arc<Job>>>) {
    loop {
        let job = lock(rx).recv();
        match job {
            Ok(job) => {
                // Panics in the data movement are caught inside `work`;
                // this keeps the thread serving whatever else panics.
                if let Err(payload) = catch_unwind(AssertUnwindSafe(|| job.work())) {
                    log::error!(
                        "reduction thread caught a panic outside the data movement: {}",
                        panic_text(&*payload)
                    );
                }
            }
            Err(_) => return,
        }
    }
}

/// Fields in which `b`'s header differs from the reference `a`'s, as a
/// `mismatch::*` mask: the fields that the reference's opcode uses.
fn mismatch_mask(a: &Request, b: &Request) -> u32 {
    header_mismatch(&a.header, &b.header)
}

/// The fields of `hb` that differ from reference `ha` (`mismatch::*`),
/// among those the reference's opcode uses.
fn header_mismatch(ha: &VirtioDmlcReq, hb: &VirtioDmlcReq) -> u32 {
    let opcode = Opcode::from_raw(ha.opcode.get());
    let uses_dtype = opcode != Some(Opcode::Barrier);
    let uses_op = matches!(
        opcode,
        Some(Opcode::Allreduce | Opcode::Reduce | Opcode::ReduceScatter)
    );
    let mut m = 0;
    let mut differs = |field: u32, d: bool| {
        if d {
            m |= field;
        }
    };
    differs(mismatch::OPCODE, ha.opcode != hb.opcode);
    differs(mismatch::DTYPE, uses_dtype && ha.dtype != hb.dtype);
    differs(mismatch::OP, uses_op && ha.op != hb.op);
    differs(mismatch::COUNT, ha.count != hb.count);
    differs(mismatch::ROOT, ha.root != hb.root);
    differs(mismatch::TAG, ha.tag != hb.tag);
    m
}

/// A place in one member's buffers.
#[derive(Clone, Copy, Debug)]
struct BufAt {
    member: usize,
    /// The output segments (else the input segments).
    output: bool,
    base: usize,
}

/// One step of a collective over `len` bytes.
#[derive(Debug)]
enum Piece {
    /// Reduce `inputs` (in rank order) into every output.
    Reduce {
        inputs: Vec<BufAt>,
        outputs: Vec<BufAt>,
        len: usize,
    },
    /// Copy `src` into every destination.
    Copy {
        src: BufAt,
        dsts: Vec<BufAt>,
        len: usize,
    },
}

impl Piece {
    fn len(&self) -> usize {
        match self {
            Piece::Reduce { len, .. } | Piece::Copy { len, .. } => *len,
        }
    }
}

/// Where member `i`'s input is: its input segments, or its output buffer
/// at the in-place offset.
fn input_of(arrivals: &[Arrival], i: usize, extra: usize) -> BufAt {
    match arrivals[i].req.in_place_offset {
        Some(off) => BufAt {
            member: i,
            output: true,
            base: off + extra,
        },
        None => BufAt {
            member: i,
            output: false,
            base: extra,
        },
    }
}

fn output_of(i: usize, base: usize) -> BufAt {
    BufAt {
        member: i,
        output: true,
        base,
    }
}

/// The steps of a collective whose members' headers agree.
fn plan(arrivals: &[Arrival]) -> Vec<Piece> {
    let req = &arrivals[0].req;
    let b = req.count_bytes();
    let n = arrivals.len();
    let root = req.root as usize;
    if b == 0 {
        return Vec::new();
    }
    let inputs = |extra: usize| (0..n).map(|i| input_of(arrivals, i, extra)).collect();
    let all_outputs = |base: usize| (0..n).map(|i| output_of(i, base)).collect();
    match req.opcode {
        Opcode::Allreduce => vec![Piece::Reduce {
            inputs: inputs(0),
            outputs: all_outputs(0),
            len: b,
        }],
        Opcode::Reduce => vec![Piece::Reduce {
            inputs: inputs(0),
            outputs: vec![output_of(root, 0)],
            len: b,
        }],
        // Block r of the reduction goes to member r; in place, into block r
        // of its own buffer.
        Opcode::ReduceScatter => (0..n)
            .map(|r| {
                let base = if arrivals[r].req.in_place_offset.is_some() {
                    r * b
                } else {
                    0
                };
                Piece::Reduce {
                    inputs: inputs(r * b),
                    outputs: vec![output_of(r, base)],
                    len: b,
                }
            })
            .collect(),
        Opcode::Broadcast => vec![Piece::Copy {
            src: input_of(arrivals, root, 0),
            dsts: all_outputs(0),
            len: b,
        }],
        Opcode::Allgather => (0..n)
            .map(|i| Piece::Copy {
                src: input_of(arrivals, i, 0),
                dsts: all_outputs(i * b),
                len: b,
            })
            .collect(),
        // A nop never reaches a collective (`Group::submit` answers it).
        Opcode::Barrier | Opcode::Nop => Vec::new(),
    }
}

/// Cuts the pieces into byte ranges `(piece, start, len)` for the arriving
/// thread and `threads` helpers: [`PARTS_PER_THREAD`] a thread, each of at
/// least [`MIN_PART`] bytes, all but a piece's last a multiple of
/// [`PART_ALIGN`].
fn split(pieces: &[Piece], threads: usize) -> Vec<(usize, usize, usize)> {
    let total: usize = pieces.iter().map(Piece::len).sum();
    let part = total
        .div_ceil(PARTS_PER_THREAD * (threads + 1))
        .next_multiple_of(PART_ALIGN)
        .max(MIN_PART);
    let mut parts = Vec::new();
    for (i, p) in pieces.iter().enumerate() {
        let mut start = 0;
        while start < p.len() {
            let len = part.min(p.len() - start);
            parts.push((i, start, len));
            start += len;
        }
    }
    parts
}

/// Drops member `member`'s outputs from every step (the skip-write test
/// fault): its buffers are read as usual but never written.
fn forget_outputs(pieces: &mut [Piece], member: usize) {
    for p in pieces {
        match p {
            Piece::Reduce { outputs, .. } => outputs.retain(|b| b.member != member),
            Piece::Copy { dsts, .. } => dsts.retain(|b| b.member != member),
        }
    }
}

/// The text of a panic's payload.
fn panic_text(payload: &(dyn std::any::Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

/// A collective being run: its members' requests and its steps.
struct Job {
    shared: Arc<Shared>,
    /// Its slot: queue and sequence number.
    key: (u16, u64),
    opcode: Opcode,
    reduce: Option<(Dtype, ReduceOp)>,
    /// In rank order, all members.
    arrivals: Vec<Arrival>,
    pieces: Vec<Piece>,
    /// Byte ranges when split; empty when run inline.
    parts: Vec<(usize, usize, usize)>,
    next: AtomicUsize,
    left: AtomicUsize,
    /// Some part panicked: the collective fails, and the parts not yet
    /// started are skipped.
    failed: AtomicBool,
    /// The part (split) or piece (inline) that panics on purpose (test
    /// fault).
    panic_at: Option<usize>,
    /// The member whose outputs are not written (test fault).
    skip_write: Option<u32>,
    /// Ended once the last byte has moved (or when the job is dropped).
    running: Running,
    /// When the data movement started (with a timing model or a recorder).
    moved_from: Option<Instant>,
    /// With a timing model: when it completes.
    sched: Option<Schedule>,
    /// With a timing model, by member: once its completion is made (or
    /// withheld), when (None: dropped or withheld).
    done_at: Mutex<Vec<Option<Option<Instant>>>>,
}

/// A collective counted in `State::running` until [`Running::end`] (or
/// drop): while counted, it may read or write its members' guest memory.
/// Its completions count in `State::outgoing` until
/// [`Running::delivered`] (or drop).
struct Running {
    shared: Arc<Shared>,
    id: u64,
    ended: AtomicBool,
    batch: Mutex<Option<Outgoing>>,
}

impl Running {
    /// Counts a new collective; `st` is the locked state of `shared`.
    fn start(shared: &Arc<Shared>, st: &mut State) -> Running {
        let id = st.next_run;
        st.next_run += 1;
        st.running.insert(id);
        let era = st.era;
        Running {
            shared: shared.clone(),
            id,
            ended: AtomicBool::new(false),
            batch: Mutex::new(Some(Outgoing::register(shared, st, era))),
        }
    }

    /// The collective no longer touches guest memory (its responses are
    /// written under the members' gates, which order them with losses).
    fn end(&self) {
        if self.ended.swap(true, Ordering::AcqRel) {
            return;
        }
        let mut st = lock(&self.shared.state);
        st.running.remove(&self.id);
        let waiters = st.quiet_waiters > 0;
        drop(st);
        if waiters {
            self.shared.quiet_cv.notify_all();
        }
    }

    /// Every member's completion of the collective has been made.
    fn delivered(&self) {
        let batch = lock(&self.batch).take();
        drop(batch);
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.end();
        self.delivered();
    }
}

/// A batch of completions decided under the state lock in era `era` and
/// not yet delivered, counted in `State::outgoing` until dropped: while
/// it lives, no later era's generation is shown in config space.
struct Outgoing {
    shared: Arc<Shared>,
    era: u64,
}

impl Outgoing {
    /// Counts a batch; `st` is the locked state of `shared`.
    fn register(shared: &Arc<Shared>, st: &mut State, era: u64) -> Outgoing {
        *st.outgoing.entry(era).or_insert(0) += 1;
        Outgoing {
            shared: shared.clone(),
            era,
        }
    }
}

impl Drop for Outgoing {
    fn drop(&mut self) {
        let mut st = lock(&self.shared.state);
        if let btree_map::Entry::Occupied(mut e) = st.outgoing.entry(self.era) {
            *e.get_mut() -= 1;
            if *e.get() == 0 {
                e.remove();
            }
        }
        self.shared.publish(&mut st);
    }
}

impl Job {
    /// Takes byte ranges until none is left; the thread that finishes the
    /// last one completes the collective.
    fn work(self: &Arc<Self>) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            let Some(&(piece, start, len)) = self.parts.get(i) else {
                return;
            };
            self.run_unit(i, piece, start, len);
            if self.left.fetch_sub(1, Ordering::AcqRel) == 1 {
                self.finish(Some(self));
            }
        }
    }

    /// Runs unit `unit` (a part, or a piece when inline): bytes
    /// `start..start + len` of piece `piece`, unless the collective has
    /// failed already. A panic fails the collective.
    fn run_unit(&self, unit: usize, piece: usize, start: usize, len: usize) {
        if self.failed.load(Ordering::Relaxed) {
            return;
        }
        self.guarded(|| {
            if self.panic_at == Some(unit) {
                panic!("test fault: panic in part {unit} of a collective");
            }
            self.run_part(piece, start, len);
        });
    }

    /// Runs `f`, a step of this collective's data movement; if it panics,
    /// the collective fails (logged once, with its queue and sequence).
    fn guarded(&self, f: impl FnOnce()) {
        let Err(payload) = catch_unwind(AssertUnwindSafe(f)) else {
            return;
        };
        let me = thread::current();
        let name = me.name().unwrap_or("unnamed");
        #[cfg(test)]
        if name.starts_with("dmlc-reduce-") {
            self.shared.worker_panics.fetch_add(1, Ordering::Relaxed);
        }
        if !self.failed.swap(true, Ordering::AcqRel) {
            log::error!(
                "{} collective (queue {}, seq {}) panicked on thread {name}: {}; \
                 it fails with RESET on every member and the group is reset",
                self.opcode,
                self.key.0,
                self.key.1,
                panic_text(&*payload)
            );
        }
    }

    fn seg_ref(&self, at: BufAt, start: usize) -> SegRef<'_> {
        let req = &self.arrivals[at.member].req;
        SegRef {
            segs: if at.output { &req.outputs } else { &req.inputs },
            offset: at.base + start,
        }
    }

    /// Runs bytes `start..start + len` of piece `piece`.
    fn run_part(&self, piece: usize, start: usize, len: usize) {
        match &self.pieces[piece] {
            Piece::Reduce {
                inputs,
                outputs,
                len: whole,
            } => {
                let Some((dtype, op)) = self.reduce else {
                    return;
                };
                // Every range takes the stores of the whole step.
                let tuning = datapath::Tuning::for_output(whole.saturating_mul(outputs.len()));
                let ins: Vec<SegRef<'_>> = inputs.iter().map(|b| self.seg_ref(*b, start)).collect();
                let outs: Vec<SegRef<'_>> =
                    outputs.iter().map(|b| self.seg_ref(*b, start)).collect();
                // SAFETY: every segment was resolved from its member's guest
                // memory, which `arrivals[_].mem` keeps mapped until the job
                // is dropped. Each buffer was checked at parse time to hold
                // exactly what the opcode needs, so base + start + len stays
                // inside it; bases, starts and lengths are multiples of the
                // element size, and every segment length is too (checked at
                // parse time), so crossed boundaries fall between elements.
                // Streaming stores are fenced before `reduce_range_tuned`
                // returns, so before `work` counts the range done.
                unsafe {
                    datapath::reduce_range_tuned(
                        dtype,
                        op,
                        self.shared.world,
                        &ins,
                        &outs,
                        len,
                        tuning,
                    );
                }
            }
            Piece::Copy { src, dsts, .. } => {
                let src = self.seg_ref(*src, start);
                let dsts: Vec<SegRef<'_>> = dsts.iter().map(|b| self.seg_ref(*b, start)).collect();
                // SAFETY: as for the reduction above.
                unsafe {
                    datapath::copy_range(src, &dsts, len);
                }
            }
        }
    }

    /// Writes every member's response and completes its chain: OK, or,
    /// if the data movement panicked, RESET for every member as the whole
    /// group is reset. With a timing model, an OK completion comes no
    /// earlier than its modelled time: if that is still to come, the job
    /// (`me`, its own handle) is held until then.
    fn finish(&self, me: Option<&Arc<Job>>) {
        let sh = &self.shared;
        if !self.failed.load(Ordering::Acquire) {
            self.guarded(|| {
                for (i, a) in self.arrivals.iter().enumerate() {
                    if self.skip_write == Some(i as u32) {
                        continue;
                    }
                    for b in a.req.bounces.iter().filter(|b| b.output) {
                        // SAFETY: the arrival keeps its guest memory
                        // mapped, and all data movement of this collective
                        // has finished.
                        unsafe { b.flush() };
                    }
                }
            });
        }
        // Before any completion: a loss waiting for this collective must
        // not wait for the completions (they may need the lost member's
        // vring, and its responses are dropped anyway).
        self.running.end();
        let moved_to = self.moved_from.map(|_| Instant::now());
        if self.failed.load(Ordering::Acquire) {
            // Every member fails with RESET; the reset delivers them before
            // config space shows the new generation.
            sh.bump(Cause::Reset, &self.arrivals);
            self.running.delivered();
            if let Some(rec) = &sh.recorder {
                let generation = sh.resp_generation.load(Ordering::Acquire);
                let out = Outcome::fail(Status::Reset, 0, NO_PEER);
                let mut r = record_of(self.key, generation, &self.arrivals, sh.world, out);
                r.moved = self.moved_from.zip(moved_to);
                rec.push(r);
            }
            return;
        }
        for p in &self.pieces {
            match p {
                Piece::Reduce { len, .. } => sh.metrics.reduced(*len as u64),
                Piece::Copy { len, .. } => sh.metrics.copied(*len as u64),
            }
        }
        sh.metrics.collective_done(self.opcode);
        let mut late = false;
        if let (Some(s), Some(me), Some(later), Some(now)) = (&self.sched, me, &sh.later, moved_to)
        {
            if let Some(rank) = s.withheld {
                // Counted before any completion of the collective is visible.
                sh.metrics.injected_withheld();
                log::info!(
                    "injected: collective (queue {}, seq {}): rank {rank}'s completion is \
                     withheld ([[fail]] rule)",
                    self.key.0,
                    self.key.1
                );
            }
            let first = s.member_due.iter().copied().min().unwrap_or(s.due);
            if first > now {
                later.push(
                    first,
                    Due::Job {
                        job: me.clone(),
                        moved_to,
                        late: false,
                    },
                );
                return;
            }
            // The host was too slow to honour the model.
            late = now > s.due;
            if late {
                sh.metrics.model_late();
                if !sh.late_warned.swap(true, Ordering::Relaxed) {
                    log::warn!(
                        "{} collective (queue {}, seq {}) moved its data {:.1} us after its \
                         modelled completion: the host is too slow to honour the timing model \
                         (counted in dmlc_model_late_total; warned once)",
                        self.opcode,
                        self.key.0,
                        self.key.1,
                        (now - s.due).as_nanos() as f64 / 1000.0
                    );
                }
            }
        }
        match me {
            Some(me) if self.sched.is_some() => me.deliver_due(moved_to, late, false),
            _ => self.deliver_all(moved_to, late),
        }
    }

    /// Completes every member with OK (and records the collective), without
    /// a timing model.
    fn deliver_all(&self, moved_to: Option<Instant>, late: bool) {
        let sh = &self.shared;
        let mut done_at = Vec::new();
        for a in &self.arrivals {
            let delivered = sh.deliver(a, Outcome::OK);
            if sh.recorder.is_some() {
                done_at.push(delivered.then(Instant::now));
            }
        }
        self.running.delivered();
        self.record(&done_at, moved_to, late);
    }

    /// With a timing model: completes with OK the members whose modelled
    /// completion has come (every one if `all`), except a withheld one, and
    /// holds the job until the next member's; once every completion is
    /// made, records the collective.
    fn deliver_due(self: &Arc<Self>, moved_to: Option<Instant>, late: bool, all: bool) {
        let sh = &self.shared;
        let Some(s) = &self.sched else {
            return self.deliver_all(moved_to, late);
        };
        let mut done = lock(&self.done_at);
        let now = Instant::now();
        let mut next: Option<Instant> = None;
        for (i, a) in self.arrivals.iter().enumerate() {
            if done[i].is_some() {
                continue;
            }
            if s.withheld == Some(a.rank) {
                // Never completed: the member's driver sees no answer.
                done[i] = Some(None);
                continue;
            }
            let due = s.due_of(i);
            if !all && due > now {
                next = Some(next.map_or(due, |n| n.min(due)));
                continue;
            }
            let delivered = sh.deliver(a, Outcome::OK);
            let at = Instant::now();
            sh.metrics.model_error(at.saturating_duration_since(due));
            done[i] = Some(delivered.then_some(at));
        }
        if let (Some(next), Some(later)) = (next, &sh.later) {
            drop(done);
            later.push(
                next,
                Due::Job {
                    job: self.clone(),
                    moved_to,
                    late,
                },
            );
            return;
        }
        let done_at: Vec<Option<Instant>> = done.iter().map(|d| d.flatten()).collect();
        drop(done);
        self.running.delivered();
        self.record(&done_at, moved_to, late);
    }

    /// Records the collective, completed OK at `done_at` (by member; empty
    /// without a recorder).
    fn record(&self, done_at: &[Option<Instant>], moved_to: Option<Instant>, late: bool) {
        let sh = &self.shared;
        let Some(rec) = &sh.recorder else { return };
        let generation = sh.resp_generation.load(Ordering::Acquire);
        let mut r = record_of(self.key, generation, &self.arrivals, sh.world, Outcome::OK);
        completed_at(&mut r, &self.arrivals, done_at);
        r.moved = self.moved_from.zip(moved_to);
        r.late = late;
        if let Some(s) = &self.sched {
            r.modelled = Some((s.start, s.due));
            for (i, a) in self.arrivals.iter().enumerate() {
                if let Some(m) = r.members.get_mut(a.rank as usize) {
                    m.modelled = Some(s.due_of(i));
                    m.withheld = s.withheld == Some(a.rank);
                }
            }
            r.injected.extend(s.slowed.clone());
            if let Some(rank) = s.withheld {
                r.injected.push(format!(
                    "completion of rank {rank} withheld ([[fail]] rule)"
                ));
            }
        }
        rec.push(r);
    }
}

#[cfg(test)]
pub(crate) mod harness;
#[cfg(test)]
mod tests;

pub mod remote;
