//! One rank: a thread that plays a VM, runs its share of the collectives
//! and checks every completion.

use std::collections::VecDeque;
use std::fmt::Display;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use dmlc_driver::transport::TransportError;
use dmlc_driver::{
    BufSlice, CommInfo, CommRequest, Device, DmaBuf, Done, Dtype, Error, Handle, OpenOptions,
    ReduceOp, Request,
};
use serde::Serialize;
use virtio_dmlc::comm::{CommOpcode, VIRTIO_DMLC_F_BLOCKS, VIRTIO_DMLC_F_COMM, VIRTIO_DMLC_F_P2P};
use virtio_dmlc::Opcode;

use crate::daemon::{self, Usage};
use crate::pattern::{comm_seq, Kind, Pattern, Step, POISON};

/// How long one `Device::wait` call blocks before the rank looks at the
/// stop flags.
const WAIT_SLICE: Duration = Duration::from_millis(250);
/// After group B's rank is closed or its daemon killed, how long its ranks
/// wait for an outcome before they give a request up.
pub const AFTER_KILL_GRACE: Duration = Duration::from_secs(2);
/// --kill-one: how long the victim waits, with nothing in flight, for the
/// daemon to take its peers' next requests before it closes (generous for
/// a loaded 2-core machine; the daemon takes a request in microseconds).
const VICTIM_PAUSE: Duration = Duration::from_millis(500);
/// Error messages kept per rank.
const MAX_MESSAGES: usize = 5;

/// Set by SIGINT/SIGTERM.
pub static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// What --kill-one and --kill-daemon stop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KillWhat {
    /// One rank closes its device (a VM goes away).
    Rank,
    /// The group's daemon gets SIGKILL.
    Daemon,
}

/// The kill: right after rank `rank` of group `group` posts small
/// collective `seq`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kill {
    pub what: KillWhat,
    pub group: usize,
    pub rank: u32,
    pub seq: u64,
}

/// What every rank runs (the same for all).
#[derive(Clone, Debug)]
pub struct Plan {
    pub groups: u32,
    pub ranks: u32,
    pub small: u64,
    pub small_elems: usize,
    pub window: usize,
    pub large: u64,
    pub large_elems: usize,
    /// Cycles of the communicator part per round (--comm-ops); their
    /// messages and blocks are `small_elems` long.
    pub comm_ops: u64,
    pub rounds: u32,
    pub poll: bool,
    /// --kill-one or --kill-daemon.
    pub kill: Option<Kill>,
    /// A request not completed after this long is lost.
    pub wait_limit: Duration,
    pub dma_bytes: usize,
    pub queue_size: u16,
}

impl Plan {
    /// Sequence numbers of `kind` in round `round`.
    pub fn range(&self, kind: Kind, round: u32) -> std::ops::Range<u64> {
        let total = match kind {
            Kind::Small => self.small,
            Kind::Large => self.large,
            // Cycles: exactly `comm_ops` in every round.
            Kind::Comm => self.comm_ops * u64::from(self.rounds),
        };
        // Rounded up, so the warm-up round has some of each kind whenever
        // there is any.
        let rounds = u128::from(self.rounds);
        let at = |k: u32| ((u128::from(total) * u128::from(k)).div_ceil(rounds)) as u64;
        at(round)..at(round + 1)
    }
}

/// Elements of each of the two buffers of the communicator part with
/// `ranks` ranks and messages of `elems`: the largest all-to-all (on half
/// the ranks, rounded up) or receive (with room for one more element).
pub fn comm_buf_elems(ranks: u32, elems: usize) -> usize {
    (ranks.div_ceil(2) as usize * elems).max(elems + 1)
}

/// Communicators alive at once during a cycle, communicator 0 included:
/// the two halves of the split and the pairs.
pub fn comms_needed(ranks: u32) -> u32 {
    1 + ranks.min(2) + ranks.div_ceil(2)
}

/// Group ranks of this rank's half after the split by parity with the key
/// `ranks - 1 - rank`: its parity, in decreasing order.
fn half_members(ranks: u32, rank: u32) -> Vec<u32> {
    (0..ranks).rev().filter(|r| r % 2 == rank % 2).collect()
}

/// The list this rank's pair is created with: `2k + 1, 2k` (reversed, so
/// that ranks in it differ from the group's), or the last rank alone.
fn pair_members(ranks: u32, rank: u32) -> Vec<u32> {
    let first = rank / 2 * 2;
    if first + 1 < ranks {
        vec![first + 1, first]
    } else {
        vec![first]
    }
}

/// A daemon sample after a round.
#[derive(Clone, Copy, Debug)]
pub struct Sample {
    /// Rounds finished when it was taken.
    pub rounds_done: u32,
    pub usage: Usage,
}

/// Rank 0's timing of one round.
#[derive(Clone, Copy, Debug, Default)]
pub struct RoundTime {
    pub small: Duration,
    pub large: Duration,
    pub comm: Duration,
}

/// State a group's ranks share.
pub struct GroupShared {
    pub index: usize,
    pub name: String,
    pub daemon_pid: u32,
    pub small_done: AtomicU64,
    pub large_done: AtomicU64,
    pub comm_done: AtomicU64,
    /// A rank of this group failed, or its daemon exited: the group stops,
    /// the others go on.
    pub abort: AtomicBool,
    /// Set when --kill-one closed a rank of this group or --kill-daemon
    /// killed its daemon.
    pub killed_at: Mutex<Option<Instant>>,
    /// The daemon was reaped (its pid may be reused: never signal it
    /// then). Held while reaping and while killing.
    pub reaped: Mutex<bool>,
    pub samples: Mutex<Vec<Sample>>,
    pub rounds: Mutex<Vec<RoundTime>>,
    /// Members that reached the end of the run.
    end: Gate,
    /// Rank 0 took its final sample.
    sampled: Gate,
}

impl GroupShared {
    pub fn new(index: usize, name: String, daemon_pid: u32) -> GroupShared {
        GroupShared {
            index,
            name,
            daemon_pid,
            small_done: AtomicU64::new(0),
            large_done: AtomicU64::new(0),
            comm_done: AtomicU64::new(0),
            abort: AtomicBool::new(false),
            killed_at: Mutex::new(None),
            reaped: Mutex::new(false),
            samples: Mutex::new(Vec::new()),
            rounds: Mutex::new(Vec::new()),
            end: Gate::default(),
            sampled: Gate::default(),
        }
    }

    pub fn killed_at(&self) -> Option<Instant> {
        *self.killed_at.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A countdown that can be given up on: `arrive` then `wait_for(n)`.
#[derive(Default)]
pub struct Gate {
    count: Mutex<u32>,
    cond: Condvar,
}

impl Gate {
    pub fn arrive(&self) {
        *self.count.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        self.cond.notify_all();
    }

    /// Waits until `n` have arrived; false if `give_up` says so first.
    pub fn wait_for(&self, n: u32, give_up: &dyn Fn() -> bool) -> bool {
        let mut c = self.count.lock().unwrap_or_else(|e| e.into_inner());
        while *c < n {
            if give_up() {
                return false;
            }
            c = self
                .cond
                .wait_timeout(c, Duration::from_millis(50))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }
}

/// State of the whole run.
#[derive(Default)]
pub struct Global {
    /// The run cannot go on (a rank could not open its device).
    pub abort: AtomicBool,
    /// Ranks open and ready (all groups start together).
    pub opened: Gate,
}

impl Global {
    pub fn stopping(&self) -> bool {
        self.abort.load(Ordering::Relaxed) || INTERRUPTED.load(Ordering::Relaxed)
    }
}

/// Requests of the communicator part that completed with a right result,
/// by opcode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CommOps {
    pub comm_split: u64,
    pub comm_create: u64,
    pub send: u64,
    pub recv: u64,
    pub alltoall: u64,
    pub allreduce: u64,
    pub comm_free: u64,
}

impl CommOps {
    pub fn total(&self) -> u64 {
        self.comm_split
            + self.comm_create
            + self.send
            + self.recv
            + self.alltoall
            + self.allreduce
            + self.comm_free
    }

    pub fn add(&mut self, o: &CommOps) {
        self.comm_split += o.comm_split;
        self.comm_create += o.comm_create;
        self.send += o.send;
        self.recv += o.recv;
        self.alltoall += o.alltoall;
        self.allreduce += o.allreduce;
        self.comm_free += o.comm_free;
    }
}

/// What one rank saw.
#[derive(Debug, Default)]
pub struct RankReport {
    pub rank: u32,
    pub opened: bool,
    pub group_id: u64,
    pub generation: u32,
    pub small_submitted: u64,
    pub small_ok: u64,
    pub large_submitted: u64,
    pub large_ok: u64,
    /// Requests of the communicator part posted (or called).
    pub comm_submitted: u64,
    /// Of those, the ones that completed with a right result.
    pub comm: CommOps,
    /// Cycles of the communicator part finished.
    pub comm_cycles: u64,
    /// The slowest request of the communicator part, ns.
    pub comm_max_ns: u64,
    /// Requests that never completed (given up after the wait limit, or
    /// left when the run stopped).
    pub lost: u64,
    /// Results of a collective that had already completed.
    pub duplicated: u64,
    /// Results that match no nearby collective, or a later one.
    pub wrong: u64,
    /// Error statuses from the device.
    pub failed: u64,
    /// Completions or config reads with another generation.
    pub generation_changes: u64,
    /// Group with a closed rank: outcomes after the close.
    pub after_kill_ok: u64,
    pub after_kill_peer_lost: u64,
    pub after_kill_other: u64,
    /// Requests given up (or dropped by the closed rank itself) after the close.
    pub after_kill_abandoned: u64,
    /// Group whose daemon was killed: requests that ended with the
    /// transport error (device backend disconnected).
    pub after_kill_disconnected: u64,
    /// Group whose daemon was killed: from the kill to this rank's first
    /// transport error.
    pub noticed: Option<Duration>,
    /// Small collectives: submit-to-result times, ns (saturating).
    pub small_ns: Vec<u32>,
    pub small_max_ns: u64,
    pub large_ns: u64,
    pub large_max_ns: u64,
    /// This rank was the one --kill-one closed.
    pub victim: bool,
    pub messages: Vec<String>,
}

impl RankReport {
    fn note(&mut self, msg: String) {
        if self.messages.len() < MAX_MESSAGES {
            self.messages.push(msg);
        }
    }
}

/// One in-flight small request.
struct Pending {
    seq: u64,
    handle: Handle,
    slot: usize,
    start: Instant,
}

/// "small collective 5": what a message calls an allreduce, made only when
/// one is written.
struct Coll(Kind, u64);

impl Display for Coll {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} collective {}", self.0, self.1)
    }
}

/// A communicator of a cycle, as this rank expects it.
struct Shape {
    id: u32,
    /// Group ranks, in the communicator's rank order.
    members: Vec<u32>,
    /// This rank's rank in it.
    me: u32,
}

impl Shape {
    fn n(&self) -> u32 {
        self.members.len() as u32
    }

    /// Group rank of its rank `i`.
    fn m(&self, i: u32) -> u32 {
        self.members[i as usize]
    }
}

enum Waited {
    Done(dmlc_driver::Result<Done>),
    /// Given up: the run stops, the group lost a rank, or the wait limit.
    GaveUp,
}

/// Runs rank `rank` of group `g` on `socket` to the end; never panics on a
/// device failure, it reports it.
pub fn run(plan: &Plan, g: &GroupShared, global: &Global, rank: u32, socket: &Path) -> RankReport {
    let mut rep = RankReport {
        rank,
        ..Default::default()
    };
    let opts = OpenOptions {
        poll: plan.poll,
        // Not polling means sleeping on interrupts, not the hybrid wait.
        spin_cap: std::time::Duration::ZERO,
        queue_size: plan.queue_size,
        event_idx: true,
        dma_bytes: plan.dma_bytes,
        max_queues: 1,
        ..OpenOptions::default()
    };
    let dev = match open(&opts, plan, socket, rank) {
        Ok(dev) => dev,
        Err(msg) => {
            rep.note(format!("rank {rank}: {msg}"));
            global.abort.store(true, Ordering::SeqCst);
            global.opened.arrive();
            return rep;
        }
    };
    rep.opened = true;
    let cfg = dev.config();
    rep.group_id = cfg.group_id.get();
    global.opened.arrive();
    if !global
        .opened
        .wait_for(plan.ranks * plan.groups, &|| global.stopping())
        || global.stopping()
    {
        return rep;
    }
    // Read after every member is up: opening does not change it, but a
    // member that failed to open would.
    rep.generation = dev.config().generation.get();
    let mut w = Worker {
        plan,
        g,
        global,
        rank,
        pattern: Pattern::new(plan.ranks),
        dev: Some(dev),
        rep,
        victim: plan.kill.filter(|k| k.group == g.index && k.rank == rank),
    };
    w.run();
    w.rep
}

fn open(opts: &OpenOptions, plan: &Plan, socket: &Path, rank: u32) -> Result<Device, String> {
    let dev = dmlc_driver::host::open(socket, opts)
        .map_err(|e| format!("opening {} failed: {e}", socket.display()))?;
    let cfg = dev.config();
    if dev.rank() != rank || dev.world_size() != plan.ranks {
        return Err(format!(
            "socket {} is rank {} of {}, expected rank {rank} of {}",
            socket.display(),
            dev.rank(),
            dev.world_size(),
            plan.ranks
        ));
    }
    let comm_elems = if plan.comm_ops > 0 {
        comm_buf_elems(plan.ranks, plan.small_elems)
    } else {
        0
    };
    let largest = (plan.large_elems.max(plan.small_elems).max(comm_elems) * 8) as u64;
    if cfg.max_bytes.get() < largest {
        return Err(format!(
            "the device takes at most {} bytes per request, the run needs {largest}",
            cfg.max_bytes.get()
        ));
    }
    if plan.comm_ops > 0 {
        let bits = [VIRTIO_DMLC_F_COMM, VIRTIO_DMLC_F_P2P, VIRTIO_DMLC_F_BLOCKS];
        if !bits.iter().all(|&b| dev.has_comm_feature(b)) {
            let msg = "the device does not offer communicators, send/recv and all-to-all \
                       (feature bits 1 to 3): give --comm-ops 0";
            return Err(msg.into());
        }
        let need = comms_needed(plan.ranks);
        let max = dev.max_comms().unwrap_or(0);
        if max < need {
            return Err(format!(
                "the device allows {max} communicators at once (max_comms), a cycle of \
                 --comm-ops needs {need}"
            ));
        }
    }
    Ok(dev)
}

struct Worker<'a> {
    plan: &'a Plan,
    g: &'a GroupShared,
    global: &'a Global,
    rank: u32,
    pattern: Pattern,
    dev: Option<Device>,
    rep: RankReport,
    victim: Option<Kill>,
}

impl Worker<'_> {
    fn dev(&self) -> &Device {
        // Only the closed rank drops it, and it stops right after.
        self.dev.as_ref().expect("device is open")
    }

    fn killed(&self) -> bool {
        self.g.killed_at().is_some()
    }

    /// What was killed in this group, once it was.
    fn killed_what(&self) -> Option<KillWhat> {
        self.g
            .killed_at()
            .and(self.plan.kill.filter(|k| k.group == self.g.index))
            .map(|k| k.what)
    }

    /// After --kill-daemon: true if `e` is the transport error a dead
    /// daemon gives, and notes when this rank first saw it.
    fn daemon_gone(&mut self, e: &Error) -> bool {
        let gone = self.killed_what() == Some(KillWhat::Daemon)
            && matches!(e, Error::Transport(TransportError::Disconnected { .. }));
        if gone && self.rep.noticed.is_none() {
            self.rep.noticed = self.g.killed_at().map(|t| t.elapsed());
        }
        gone
    }

    /// This rank's group stops (a failure in it, or the whole run stops).
    fn stopping(&self) -> bool {
        self.global.stopping() || self.g.abort.load(Ordering::Relaxed)
    }

    fn run(&mut self) {
        let small = (self.plan.small > 0)
            .then(|| self.alloc_slots())
            .transpose();
        let large = (self.plan.large > 0)
            .then(|| self.alloc_pair(self.plan.large_elems * 8))
            .transpose();
        let comm = (self.plan.comm_ops > 0)
            .then(|| self.alloc_pair(comm_buf_elems(self.plan.ranks, self.plan.small_elems) * 8))
            .transpose();
        let (mut small, mut large, mut comm) = match (small, large, comm) {
            (Ok(s), Ok(l), Ok(c)) => (s, l, c),
            (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => {
                self.fatal(e);
                return;
            }
        };
        self.rep.small_ns.reserve(self.plan.small as usize);
        let mut finished = true;
        for round in 0..self.plan.rounds {
            let t0 = Instant::now();
            if let Some(slots) = small.as_mut() {
                if !self.small_round(round, slots) {
                    finished = false;
                    break;
                }
            }
            let t1 = Instant::now();
            if let Some(bufs) = large.as_mut() {
                if !self.large_round(round, bufs) {
                    finished = false;
                    break;
                }
            }
            let t2 = Instant::now();
            if let Some(bufs) = comm.as_mut() {
                if !self.comm_round(round, bufs) {
                    finished = false;
                    break;
                }
            }
            let t3 = Instant::now();
            self.check_generation();
            if self.rank == 0 {
                lock(&self.g.rounds).push(RoundTime {
                    small: t1 - t0,
                    large: t2 - t1,
                    comm: t3 - t2,
                });
                if round + 1 < self.plan.rounds {
                    self.sample(round + 1);
                }
            }
        }
        if finished {
            // The last sample is taken with every member still connected:
            // a member closing changes the daemon's fds and generation.
            self.g.end.arrive();
            let give_up = || self.stopping() || self.killed();
            if self.rank == 0 {
                if self.g.end.wait_for(self.plan.ranks, &give_up) {
                    self.sample(self.plan.rounds);
                    self.check_generation();
                }
                self.g.sampled.arrive();
            } else {
                self.g.sampled.wait_for(1, &give_up);
            }
        }
    }

    fn sample(&mut self, rounds_done: u32) {
        match daemon::usage(self.g.daemon_pid) {
            Ok(usage) => lock(&self.g.samples).push(Sample { rounds_done, usage }),
            Err(e) => self
                .rep
                .note(format!("reading the daemon's /proc entries failed: {e}")),
        }
    }

    fn check_generation(&mut self) {
        if self.killed() {
            return;
        }
        match self.dev().try_config() {
            Ok(c) if c.generation.get() == self.rep.generation => {}
            Ok(c) => {
                self.rep.generation_changes += 1;
                let msg = format!(
                    "rank {}: config generation {} (was {})",
                    self.rank,
                    c.generation.get(),
                    self.rep.generation
                );
                self.rep.note(msg);
            }
            // The daemon was killed while this rank read: it noticed.
            Err(e) if self.daemon_gone(&e) => {}
            Err(e) => self.fatal(format!("reading config failed: {e}")),
        }
    }

    fn alloc_pair(&self, bytes: usize) -> Result<(DmaBuf, DmaBuf), String> {
        let a = |what| {
            self.dev()
                .alloc(bytes)
                .map_err(|e| format!("allocating the {what} buffer of {bytes} bytes failed: {e}"))
        };
        Ok((a("input")?, a("output")?))
    }

    fn alloc_slots(&self) -> Result<Vec<(DmaBuf, DmaBuf)>, String> {
        (0..self.plan.window)
            .map(|_| self.alloc_pair(self.plan.small_elems * 8))
            .collect()
    }

    fn request(&self, kind: Kind, seq: u64, elems: usize) -> Request {
        let mut req = Request::new(Opcode::Allreduce, Dtype::U64, ReduceOp::Sum, elems as u64);
        req.tag = kind.tag(seq);
        req
    }

    /// Runs the small collectives of `round`; false: stop the run.
    fn small_round(&mut self, round: u32, slots: &mut [(DmaBuf, DmaBuf)]) -> bool {
        let mut pending: VecDeque<Pending> = VecDeque::with_capacity(slots.len());
        let mut free: Vec<usize> = (0..slots.len()).rev().collect();
        let mut go_on = true;
        for seq in self.plan.range(Kind::Small, round) {
            if self.stopping() {
                go_on = false;
                break;
            }
            if free.is_empty() {
                let Some(p) = pending.pop_front() else { break };
                let slot = p.slot;
                free.push(slot);
                if !self.finish_small(p, &slots[slot].1) {
                    go_on = false;
                    break;
                }
            }
            let slot = free.pop().expect("a slot is free");
            let (input, output) = &mut slots[slot];
            self.pattern
                .fill(Kind::Small, seq, self.rank, input.as_elems_mut::<u64>());
            output.as_elems_mut::<u64>().fill(POISON);
            let req = self.request(Kind::Small, seq, self.plan.small_elems);
            let start = Instant::now();
            match self.dev().submit(0, &req, &[input.all()], &[output.all()]) {
                Ok(handle) => {
                    self.rep.small_submitted += 1;
                    pending.push_back(Pending {
                        seq,
                        handle,
                        slot,
                        start,
                    });
                }
                Err(e) => {
                    self.submit_failed(&Coll(Kind::Small, seq), &e);
                    go_on = false;
                    break;
                }
            }
            match self.victim.filter(|k| k.seq == seq).map(|k| k.what) {
                Some(KillWhat::Rank) => {
                    // Close while the peers wait for this rank: finish what
                    // it posted (the peers then post their next requests,
                    // which the daemon takes and holds for this rank), give
                    // the daemon a moment to take them, then go away. Every
                    // survivor then has requests that the loss must fail
                    // with PEER_LOST; a close between two rounds of
                    // completions would leave them none.
                    while let Some(p) = pending.pop_front() {
                        let slot = p.slot;
                        if !self.finish_small(p, &slots[slot].1) {
                            break;
                        }
                    }
                    std::thread::sleep(VICTIM_PAUSE);
                    self.close_as_victim(pending.len() as u64);
                    return false;
                }
                // Go on: the next wait meets the dead daemon, as the
                // other ranks' do.
                Some(KillWhat::Daemon) => self.kill_daemon(),
                None => {}
            }
        }
        while go_on {
            let Some(p) = pending.pop_front() else { break };
            let slot = p.slot;
            if !self.finish_small(p, &slots[slot].1) {
                go_on = false;
            }
        }
        self.abandon(pending.len() as u64);
        go_on
    }

    /// Waits for one small request and checks it; false: stop the run.
    fn finish_small(&mut self, p: Pending, output: &DmaBuf) -> bool {
        let outcome = self.wait(p.handle);
        let ns = p.start.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64;
        let ok = self.judge(Kind::Small, p.seq, outcome, output);
        if ok {
            self.rep.small_ok += 1;
            self.rep.small_ns.push(ns.min(u64::from(u32::MAX)) as u32);
            self.rep.small_max_ns = self.rep.small_max_ns.max(ns);
            if self.rank == 0 {
                self.g
                    .small_done
                    .store(self.rep.small_ok, Ordering::Relaxed);
            }
        }
        ok || self.continues_after_bad_result()
    }

    /// Runs the large collectives of `round`; false: stop the run.
    fn large_round(&mut self, round: u32, bufs: &mut (DmaBuf, DmaBuf)) -> bool {
        for seq in self.plan.range(Kind::Large, round) {
            if self.stopping() {
                return false;
            }
            let (input, output) = bufs;
            self.pattern
                .fill(Kind::Large, seq, self.rank, input.as_elems_mut::<u64>());
            {
                // Poison both ends: cheap, and a result the device never
                // wrote is caught either way (it would also hold the last
                // collective's sum).
                let out = output.as_elems_mut::<u64>();
                let last = out.len() - 1;
                out[0] = POISON;
                out[last] = POISON;
            }
            let req = self.request(Kind::Large, seq, self.plan.large_elems);
            let start = Instant::now();
            let handle = match self.dev().submit(0, &req, &[input.all()], &[output.all()]) {
                Ok(h) => h,
                Err(e) => {
                    self.submit_failed(&Coll(Kind::Large, seq), &e);
                    return false;
                }
            };
            self.rep.large_submitted += 1;
            let outcome = self.wait(handle);
            let ns = start.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64;
            if self.judge(Kind::Large, seq, outcome, output) {
                self.rep.large_ok += 1;
                self.rep.large_ns += ns;
                self.rep.large_max_ns = self.rep.large_max_ns.max(ns);
                if self.rank == 0 {
                    self.g
                        .large_done
                        .store(self.rep.large_ok, Ordering::Relaxed);
                }
            } else if !self.continues_after_bad_result() {
                return false;
            }
        }
        true
    }

    /// Runs the communicator part of `round`: `--comm-ops` cycles (see
    /// [`Self::comm_cycle`]); false: stop the run.
    fn comm_round(&mut self, round: u32, bufs: &mut (DmaBuf, DmaBuf)) -> bool {
        for cycle in self.plan.range(Kind::Comm, round) {
            if self.stopping() || !self.comm_cycle(cycle, bufs) {
                return false;
            }
            self.rep.comm_cycles += 1;
            if self.rank == 0 {
                self.g
                    .comm_done
                    .store(self.rep.comm_cycles, Ordering::Relaxed);
            }
        }
        true
    }

    /// One cycle, the same steps in the same order on every rank: a
    /// comm_split of communicator 0 into even and odd ranks (each half in
    /// decreasing rank order, by key), a comm_create of pairs `2k + 1, 2k`
    /// by the pair's ranks only (overlapping both halves), a send/recv ring
    /// shift on communicator 0, on the half and on the pair (where they
    /// have two members or more), an all-to-all and an allreduce on the
    /// half, then comm_free of the pair and of the half. Every id, rank,
    /// size, length, peer and byte is checked. False: stop the run.
    fn comm_cycle(&mut self, cycle: u64, bufs: &mut (DmaBuf, DmaBuf)) -> bool {
        let (ranks, rank) = (self.plan.ranks, self.rank);
        let what = format!("comm_split of cycle {cycle}");
        let r = self.comm_blocking(|d| d.comm_split(0, Some(rank % 2), ranks - 1 - rank));
        let members = half_members(ranks, rank);
        let Some(half) = self.made(&what, r, members, &[0], |o| &mut o.comm_split) else {
            return false;
        };
        let what = format!("comm_create of cycle {cycle}");
        let members = pair_members(ranks, rank);
        let tag = Kind::Comm.tag(comm_seq(cycle, Step::Create, rank / 2));
        let r = self.comm_blocking(|d| d.comm_create(0, &members, tag).map(Some));
        let taken = [0, half.id];
        let Some(pair) = self.made(&what, r, members, &taken, |o| &mut o.comm_create) else {
            return false;
        };
        let world = Shape {
            id: 0,
            members: (0..ranks).collect(),
            me: rank,
        };
        for (i, shape) in [&world, &half, &pair].into_iter().enumerate() {
            let seq = comm_seq(cycle, Step::Shift, i as u32);
            if shape.n() > 1 && !self.ring_shift(seq, shape, bufs) {
                return false;
            }
        }
        if !self.comm_alltoall(comm_seq(cycle, Step::Alltoall, 0), &half, bufs)
            || !self.comm_allreduce(comm_seq(cycle, Step::Allreduce, 0), &half, bufs)
        {
            return false;
        }
        for shape in [&pair, &half] {
            let what = format!("comm_free of comm {} (cycle {cycle})", shape.id);
            let r = self.comm_blocking(|d| d.comm_free(shape.id));
            if self.comm_result(&what, r).is_none() {
                return false;
            }
            self.comm_right(|o| &mut o.comm_free);
        }
        true
    }

    /// Calls a blocking request of the communicator part (comm_split,
    /// comm_create, comm_free), counting it and its time; `None` (not
    /// called) once the group stops or has lost a rank or its daemon:
    /// the driver has these requests only as blocking calls, which cannot
    /// be given up, and one on a communicator with a member gone would wait
    /// for the daemon's timeout.
    fn comm_blocking<T>(
        &mut self,
        call: impl FnOnce(&Device) -> dmlc_driver::Result<T>,
    ) -> Option<dmlc_driver::Result<T>> {
        if self.stopping() || self.killed() {
            return None;
        }
        let start = Instant::now();
        self.rep.comm_submitted += 1;
        let r = call(self.dev());
        self.comm_time(start);
        Some(r)
    }

    fn comm_time(&mut self, start: Instant) {
        let ns = start.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64;
        self.rep.comm_max_ns = self.rep.comm_max_ns.max(ns);
    }

    /// The value of a blocking call, or `None` with its error counted as
    /// [`Self::completed`] counts it (or if it was not made).
    fn comm_result<T>(
        &mut self,
        what: &dyn Display,
        r: Option<dmlc_driver::Result<T>>,
    ) -> Option<T> {
        match r? {
            Ok(v) => Some(v),
            Err(e) => {
                self.completed(what, Waited::Done(Err(e)));
                None
            }
        }
    }

    /// A request of the communicator part completed with a right result.
    fn comm_right(&mut self, count: impl FnOnce(&mut CommOps) -> &mut u64) {
        *count(&mut self.rep.comm) += 1;
        if self.killed() {
            self.rep.after_kill_ok += 1;
        }
    }

    /// A request of the communicator part completed with a wrong result;
    /// true if the rank goes on (as after a wrong allreduce).
    fn comm_wrong(&mut self, what: &dyn Display, msg: String) -> bool {
        self.rep.wrong += 1;
        self.rep.note(format!("rank {}: {what}: {msg}", self.rank));
        self.continues_after_bad_result()
    }

    /// Checks the communicator a comm_split or comm_create gave: an id
    /// other than `taken` (0 and the cycle's others), and this rank's rank
    /// and the size of `members`. A wrong one stops the group: the cycle's
    /// next steps would run on it.
    fn made(
        &mut self,
        what: &dyn Display,
        r: Option<dmlc_driver::Result<Option<CommInfo>>>,
        members: Vec<u32>,
        taken: &[u32],
        count: impl FnOnce(&mut CommOps) -> &mut u64,
    ) -> Option<Shape> {
        let got = self.comm_result(what, r)?;
        let me = members
            .iter()
            .position(|&m| m == self.rank)
            .expect("the rank is a member") as u32;
        let size = members.len() as u32;
        match got {
            Some(c) if !taken.contains(&c.id) && (c.rank, c.size) == (me, size) => {
                self.comm_right(count);
                Some(Shape {
                    id: c.id,
                    members,
                    me,
                })
            }
            other => {
                self.rep.wrong += 1;
                self.fatal(format!(
                    "{what}: got {other:?}, expected rank {me} of {size} ({members:?}) with an \
                     id not in {taken:?}"
                ));
                None
            }
        }
    }

    /// Posts one request of the communicator part; `None` (counted as a
    /// failed submit) if it could not be posted.
    fn comm_post(
        &mut self,
        what: &dyn Display,
        post: impl FnOnce(&Device) -> dmlc_driver::Result<Handle>,
    ) -> Option<Handle> {
        match post(self.dev()) {
            Ok(h) => {
                self.rep.comm_submitted += 1;
                Some(h)
            }
            Err(e) => {
                self.submit_failed(what, &e);
                None
            }
        }
    }

    /// Waits for a request of the communicator part posted at `start`; its
    /// completion if it completed with `OK`.
    fn comm_wait(&mut self, what: &dyn Display, h: Handle, start: Instant) -> Option<Done> {
        let outcome = self.wait(h);
        self.comm_time(start);
        self.completed(what, outcome)
    }

    /// One ring shift on `shape`: each member posts a receive from the
    /// previous rank (with room for one element more than the message) and
    /// a send of `small_elems` to the next, both tagged `seq`, then waits
    /// for both. The receive's length, peer and group peer, every byte
    /// (the sender's input for `seq`, which the receiver computes) and the
    /// spare element (untouched) are checked, and the send's length.
    /// False: stop the run.
    fn ring_shift(&mut self, seq: u64, shape: &Shape, bufs: &mut (DmaBuf, DmaBuf)) -> bool {
        let c = self.plan.small_elems;
        let bytes = (c * 8) as u64;
        let n = shape.n();
        let (to, from) = ((shape.me + 1) % n, (shape.me + n - 1) % n);
        let (input, output) = bufs;
        self.pattern
            .fill(Kind::Comm, seq, self.rank, &mut input.as_elems_mut()[..c]);
        output.as_elems_mut::<u64>()[..=c].fill(POISON);
        let tag = Kind::Comm.tag(seq);
        let recv = CommRequest {
            peer: from,
            tag,
            ..CommRequest::new(CommOpcode::Recv, Dtype::U64, shape.id, c as u64 + 1)
        };
        let send = CommRequest {
            peer: to,
            tag,
            ..CommRequest::new(CommOpcode::Send, Dtype::U64, shape.id, c as u64)
        };
        let recv_what = format!("receive {seq} from rank {from} of comm {}", shape.id);
        let send_what = format!("send {seq} to rank {to} of comm {}", shape.id);
        let start = Instant::now();
        let out = [output.slice(0, (c + 1) * 8)];
        let Some(hr) = self.comm_post(&recv_what, |d| d.submit_comm(0, &recv, &[], &out)) else {
            return false;
        };
        let ins = [input.slice(0, c * 8)];
        let Some(hs) = self.comm_post(&send_what, |d| d.submit_comm(0, &send, &ins, &[])) else {
            self.abandon(1);
            return false;
        };
        let Some(done) = self.comm_wait(&recv_what, hr, start) else {
            self.abandon(1);
            return false;
        };
        let r = done.reply;
        let sender = shape.m(from);
        let got = &output.as_elems::<u64>()[..=c];
        let check = if (r.length, r.peer, r.peer_world) != (bytes, from, sender) {
            Err(format!(
                "length {}, peer {} (group rank {}), expected {bytes} from {from} (group rank \
                 {sender})",
                r.length, r.peer, r.peer_world
            ))
        } else if let Err(d) = self
            .pattern
            .check_input(Kind::Comm, seq, sender, 0, &got[..c])
        {
            Err(format!(
                "element {} is {:#x}, expected {:#x}",
                d.index, d.got, d.want
            ))
        } else if got[c] != POISON {
            Err(format!(
                "the element after the message was written ({:#x})",
                got[c]
            ))
        } else {
            Ok(())
        };
        let recv_ok = match check {
            Ok(()) => {
                self.comm_right(|o| &mut o.recv);
                true
            }
            Err(msg) => self.comm_wrong(&recv_what, msg),
        };
        // Waited for even after a wrong receive: it is in flight.
        let Some(done) = self.comm_wait(&send_what, hs, start) else {
            return false;
        };
        let send_ok = if done.reply.length == bytes {
            self.comm_right(|o| &mut o.send);
            true
        } else {
            let msg = format!("length {}, expected {bytes}", done.reply.length);
            self.comm_wrong(&send_what, msg)
        };
        recv_ok && send_ok
    }

    /// Posts `req` (built by `post`) with `input` and `output`, waits, and
    /// returns its completion; `None`: stop the run.
    fn comm_run(
        &mut self,
        what: &dyn Display,
        post: impl FnOnce(&Device, &[BufSlice], &[BufSlice]) -> dmlc_driver::Result<Handle>,
        input: BufSlice,
        output: BufSlice,
    ) -> Option<Done> {
        let start = Instant::now();
        let h = self.comm_post(what, |d| post(d, &[input], &[output]))?;
        self.comm_wait(what, h, start)
    }

    /// An all-to-all of `small_elems` per block on `shape`: this rank's
    /// input is one run of its input for `seq`; block `j` of its output
    /// must be the part of member `j`'s input meant for this rank.
    fn comm_alltoall(&mut self, seq: u64, shape: &Shape, bufs: &mut (DmaBuf, DmaBuf)) -> bool {
        let c = self.plan.small_elems;
        let total = shape.n() as usize * c;
        let (input, output) = bufs;
        self.pattern.fill(
            Kind::Comm,
            seq,
            self.rank,
            &mut input.as_elems_mut()[..total],
        );
        output.as_elems_mut::<u64>()[..total].fill(POISON);
        let req = CommRequest {
            tag: Kind::Comm.tag(seq),
            ..CommRequest::new(CommOpcode::Alltoall, Dtype::U64, shape.id, c as u64)
        };
        let what = format!("alltoall {seq} on comm {}", shape.id);
        let post = |d: &Device, i: &[BufSlice], o: &[BufSlice]| d.submit_comm(0, &req, i, o);
        let (i, o) = (input.slice(0, total * 8), output.slice(0, total * 8));
        if self.comm_run(&what, post, i, o).is_none() {
            return false;
        }
        let got = &output.as_elems::<u64>()[..total];
        let wrong = (0..shape.n()).find_map(|j| {
            let block = &got[j as usize * c..][..c];
            let offset = shape.me as usize * c;
            self.pattern
                .check_input(Kind::Comm, seq, shape.m(j), offset, block)
                .err()
                .map(|d| {
                    format!(
                        "block from rank {j} (group rank {}): element {} is {:#x}, expected {:#x}",
                        shape.m(j),
                        d.index,
                        d.got,
                        d.want
                    )
                })
        });
        match wrong {
            None => {
                self.comm_right(|o| &mut o.alltoall);
                true
            }
            Some(msg) => self.comm_wrong(&what, msg),
        }
    }

    /// A u64 sum of `small_elems` on `shape`: the result must be the sum
    /// of its members' inputs for `seq`, and of no one else's.
    fn comm_allreduce(&mut self, seq: u64, shape: &Shape, bufs: &mut (DmaBuf, DmaBuf)) -> bool {
        let c = self.plan.small_elems;
        let (input, output) = bufs;
        self.pattern
            .fill(Kind::Comm, seq, self.rank, &mut input.as_elems_mut()[..c]);
        output.as_elems_mut::<u64>()[..c].fill(POISON);
        let req = Request {
            comm: shape.id,
            ..self.request(Kind::Comm, seq, c)
        };
        let what = format!("allreduce {seq} on comm {}", shape.id);
        let post = |d: &Device, i: &[BufSlice], o: &[BufSlice]| d.submit(0, &req, i, o);
        let (i, o) = (input.slice(0, c * 8), output.slice(0, c * 8));
        if self.comm_run(&what, post, i, o).is_none() {
            return false;
        }
        let got = &output.as_elems::<u64>()[..c];
        match Pattern::of(shape.members.iter().copied()).check(Kind::Comm, seq, got) {
            Ok(()) => {
                self.comm_right(|o| &mut o.allreduce);
                true
            }
            Err(d) => {
                let msg = format!(
                    "element {} is {:#x}, expected {:#x}",
                    d.index, d.got, d.want
                );
                self.comm_wrong(&what, msg)
            }
        }
    }

    /// After a result that did not pass: keep counting (wrong, duplicated)
    /// unless the run is stopping or the group lost its rank.
    fn continues_after_bad_result(&self) -> bool {
        !self.stopping() && !self.killed()
    }

    /// Waits for `h` in slices, giving up when the run stops, two seconds
    /// after the group lost a rank, or after the wait limit.
    fn wait(&self, h: Handle) -> Waited {
        let start = Instant::now();
        loop {
            match self.dev().wait(h, Some(WAIT_SLICE)) {
                Err(Error::WaitTimeout) => {
                    let after_kill = self
                        .g
                        .killed_at()
                        .is_some_and(|t| t.elapsed() > AFTER_KILL_GRACE);
                    if self.stopping() || after_kill || start.elapsed() > self.plan.wait_limit {
                        return Waited::GaveUp;
                    }
                }
                r => return Waited::Done(r),
            }
        }
    }

    /// Counts one outcome; true if it completed and its result is right.
    fn judge(&mut self, kind: Kind, seq: u64, outcome: Waited, output: &DmaBuf) -> bool {
        let killed = self.killed();
        if self.completed(&Coll(kind, seq), outcome).is_none() {
            return false;
        }
        let out = output.as_elems::<u64>();
        match self.pattern.check(kind, seq, out) {
            Ok(()) => {
                if killed {
                    self.rep.after_kill_ok += 1;
                }
                true
            }
            Err(diff) => {
                let span = self.plan.window as u64 + 2;
                let near = seq.saturating_sub(span)..seq.saturating_add(span + 1);
                let other = self.pattern.identify(kind, out, near.filter(|&s| s != seq));
                let what = match other {
                    Some(s) if s < seq => {
                        self.rep.duplicated += 1;
                        format!("the result of collective {s} again")
                    }
                    Some(s) => {
                        self.rep.wrong += 1;
                        format!("the result of the later collective {s}")
                    }
                    None => {
                        self.rep.wrong += 1;
                        format!(
                            "element {} is {:#x}, expected {:#x}",
                            diff.index, diff.got, diff.want
                        )
                    }
                };
                let msg = format!("rank {}: {kind} collective {seq}: {what}", self.rank);
                self.rep.note(msg);
                false
            }
        }
    }

    /// Counts an outcome that is no completion, or an error status, as the
    /// kill (if any) says; checks a completion's generation. The
    /// completion if the request `what` completed with `OK`.
    fn completed(&mut self, what: &dyn Display, outcome: Waited) -> Option<Done> {
        let killed = self.killed();
        let done = match outcome {
            Waited::GaveUp if killed => {
                self.rep.after_kill_abandoned += 1;
                return None;
            }
            Waited::GaveUp => {
                self.rep.lost += 1;
                if !self.stopping() {
                    self.fatal(format!(
                        "{what}: no completion within {:?}",
                        self.plan.wait_limit
                    ));
                }
                return None;
            }
            Waited::Done(Err(e)) => {
                if killed {
                    if self.daemon_gone(&e) {
                        self.rep.after_kill_disconnected += 1;
                    } else if matches!(e, Error::PeerLost { .. })
                        && self.killed_what() == Some(KillWhat::Rank)
                    {
                        self.rep.after_kill_peer_lost += 1;
                    } else {
                        self.rep.after_kill_other += 1;
                        self.rep
                            .note(format!("rank {} after the close: {what}: {e}", self.rank));
                    }
                } else {
                    self.rep.failed += 1;
                    self.fatal(format!("{what} failed: {e}"));
                }
                return None;
            }
            Waited::Done(Ok(done)) => done,
        };
        if done.generation != self.rep.generation && !killed {
            self.rep.generation_changes += 1;
            let msg = format!(
                "rank {}: {what} completed in generation {} (started in {})",
                self.rank, done.generation, self.rep.generation
            );
            self.rep.note(msg);
        }
        Some(done)
    }

    /// Notes a failure that ends the group's run, and stops its ranks.
    fn fatal(&mut self, msg: String) {
        self.rep.note(format!("rank {}: {msg}", self.rank));
        self.g.abort.store(true, Ordering::SeqCst);
    }

    /// A submit failed: after --kill-daemon the transport error counts
    /// like a completion that has it; otherwise the group stops.
    fn submit_failed(&mut self, what: &dyn Display, e: &Error) {
        if self.daemon_gone(e) {
            self.rep.after_kill_disconnected += 1;
        } else if self.killed() {
            self.rep.after_kill_other += 1;
            let msg = format!(
                "rank {} after the kill: submitting {what} failed: {e}",
                self.rank
            );
            self.rep.note(msg);
        } else {
            self.fatal(format!("submitting {what} failed: {e}"));
        }
    }

    /// --kill-daemon: SIGKILL to this group's daemon, with requests of
    /// every rank in flight.
    fn kill_daemon(&mut self) {
        let reaped = lock(&self.g.reaped);
        if *reaped {
            drop(reaped);
            self.fatal("the daemon had exited before --kill-daemon".into());
            return;
        }
        // Set first, so that a rank that sees the daemon gone knows why.
        *lock(&self.g.killed_at) = Some(Instant::now());
        // SAFETY: kill(2) on our own child, which the lock above keeps
        // from being reaped (so its pid is not reused) until we are done.
        let rc = unsafe { libc::kill(self.g.daemon_pid as libc::pid_t, libc::SIGKILL) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            drop(reaped);
            self.fatal(format!("kill -9 of the daemon failed: {e}"));
        }
    }

    /// Requests left in flight when a rank stops.
    fn abandon(&mut self, n: u64) {
        if self.killed() {
            self.rep.after_kill_abandoned += n;
        } else {
            self.rep.lost += n;
        }
    }

    /// --kill-one: closes this rank's device (with `in_flight` requests
    /// posted, if any), as a VM that goes away would.
    fn close_as_victim(&mut self, in_flight: u64) {
        *lock(&self.g.killed_at) = Some(Instant::now());
        self.rep.victim = true;
        self.rep.after_kill_abandoned += in_flight;
        drop(self.dev.take());
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(small: u64, large: u64, rounds: u32) -> Plan {
        Plan {
            groups: 1,
            ranks: 2,
            small,
            small_elems: 8,
            window: 4,
            large,
            large_elems: 8,
            comm_ops: 0,
            rounds,
            poll: false,
            kill: None,
            wait_limit: Duration::from_secs(1),
            dma_bytes: 1 << 20,
            queue_size: 256,
        }
    }

    #[test]
    fn rounds_cover_every_collective_once() {
        for (total, rounds) in [(1_000_000, 20), (7, 3), (2, 5), (0, 4)] {
            let p = plan(total, total, rounds);
            let mut next = 0;
            for r in 0..rounds {
                let range = p.range(Kind::Small, r);
                assert_eq!(range.start, next);
                next = range.end;
            }
            assert_eq!(next, total);
            if total > 0 {
                assert!(!p.range(Kind::Large, 0).is_empty());
            }
        }
    }

    #[test]
    fn every_round_has_its_cycles() {
        let mut p = plan(10, 0, 4);
        p.comm_ops = 3;
        for r in 0..4 {
            assert_eq!(
                p.range(Kind::Comm, r),
                u64::from(r) * 3..u64::from(r) * 3 + 3
            );
        }
        p.comm_ops = 0;
        assert!(p.range(Kind::Comm, 2).is_empty());
    }

    #[test]
    fn the_cycle_s_communicators_follow_their_formulas() {
        assert_eq!(half_members(5, 2), [4, 2, 0]);
        assert_eq!(half_members(5, 3), [3, 1]);
        assert_eq!(half_members(1, 0), [0]);
        assert_eq!(pair_members(4, 2), [3, 2]);
        assert_eq!(pair_members(4, 3), [3, 2]);
        assert_eq!(pair_members(5, 4), [4]);
        // The split's own rule (by key, then rank) gives the halves.
        let ranks = 5;
        let keys: Vec<(u32, u32)> = (0..ranks).map(|r| (r % 2, ranks - 1 - r)).collect();
        for r in 0..ranks {
            let want = half_members(ranks, r);
            let at = want.iter().position(|&m| m == r).unwrap() as u32;
            assert_eq!(
                virtio_dmlc::comm::split_place(&keys, r),
                Some((at, want.len() as u32))
            );
        }
        // world, two halves, two pairs; world, one half, one pair.
        assert_eq!((comms_needed(4), comms_needed(1)), (5, 3));
        assert_eq!(comms_needed(64), 35);
        // The largest all-to-all (2 of 8) or receive (8 + 1).
        assert_eq!(comm_buf_elems(4, 8), 16);
        assert_eq!(comm_buf_elems(1, 8), 9);
        assert_eq!(comm_buf_elems(5, 8), 24);
    }

    #[test]
    fn a_gate_opens_at_its_count_or_gives_up() {
        let g = Gate::default();
        g.arrive();
        assert!(g.wait_for(1, &|| false));
        assert!(!g.wait_for(2, &|| true));
    }
}
