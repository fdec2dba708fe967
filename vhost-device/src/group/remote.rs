//! One group across several hosts: the inter-host stage of the engine.
//!
//! Each host's daemon runs a [`Group`](super::Group) of its `L` local
//! members. In that mode ([`GroupConfig::remote`](super::GroupConfig)) a
//! slot that fills is not run by the arriving thread: it is handed, under
//! the state lock (so in the order slots fill), to one dedicated thread that
//! runs [`serve`] over an [`Exchange`] (MPI between the daemons, or an
//! in-process fake in tests). That thread makes every call of the exchange,
//! so an MPI library that grants only `MPI_THREAD_FUNNELED` is enough.
//!
//! Every collective is one *step* of the exchange, numbered alike on every
//! host because each host hands its steps over in the order its slots
//! fill (one request queue per member, see `config.rs`):
//!
//! 1. Every host contributes an entry ([`ENTRY_BYTES`]): its local rank 0's
//!    header and its local mismatch (mask and first global rank against
//!    local rank 0), or a failure it had instead (a lost member, a local
//!    timeout). The entries are all-gathered.
//! 2. Every host decides the same from the same entries: a failure fails the
//!    collective everywhere (PEER_LOST or TIMEOUT naming the global rank);
//!    a header that differs anywhere gives MISMATCH with the mask and the
//!    first global rank that a single device of all `H * L` members would
//!    give; an opcode outside [`supported`] gives UNSUPPORTED.
//! 3. The data stage: the local members' inputs are reduced (in local rank
//!    order, with the data path's kernels) or gathered from guest memory
//!    into one host buffer, the `H` host buffers are all-gathered (or the
//!    root host's broadcast), the `H` partials are reduced in host order on
//!    every host (so every host computes the same bits), and the result is
//!    written into the local members' outputs, each under its gate.
//!
//! A lost member: its host fails its own collectives at once and takes a
//! "lost" step, announcing it to every other host first
//! ([`Exchange::announce`]). A host whose stage has no step to run polls for
//! such news ([`Exchange::poll_news`], every [`NEWS_POLL`]) and, for a loss
//! that no step has settled yet, fails its pending collectives with
//! PEER_LOST and joins that step: no host waits for its members to submit
//! before it learns of a loss.
//!
//! Bounds: every exchange call has a deadline (the collective's deadline
//! plus one default timeout, so that a host whose members are late fails
//! its own slot first and contributes that failure). A call that misses it
//! leaves the exchange unusable (an MPI collective cannot be cancelled): the
//! daemon then fails everything pending on its members and ends the job
//! ([`Exchange::abort`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Weak};
use std::time::{Duration, Instant};

use virtio_dmlc::{unsupported, Dtype, Opcode, ReduceOp, Status, VirtioDmlcReq, NO_PEER};
use zerocopy::{FromBytes, IntoBytes};

use super::{header_mismatch, lock, Arrival, Cause, Outcome, Running, Shared, Waiting};
use crate::chain::Code;
use crate::datapath::{self, HostSeg, SegRef};

/// Bytes of one host's entry in a step: kind, peer, mismatch mask,
/// mismatch peer (4 x u32), then the header of its local rank 0.
pub const ENTRY_BYTES: usize = 16 + virtio_dmlc::REQ_HEADER_SIZE;

const KIND_COLLECTIVE: u32 = 1;
const KIND_LOST: u32 = 2;
const KIND_TIMEOUT: u32 = 3;
/// A host that learnt of another host's loss from its news, while it had
/// no step of its own to take: it joins the losing host's step with this
/// entry (the peer it was told), so that the loss never waits for this
/// host's members to submit.
const KIND_LOST_ELSEWHERE: u32 = 4;

fn is_lost(kind: u32) -> bool {
    kind == KIND_LOST || kind == KIND_LOST_ELSEWHERE
}

/// Why an exchange call failed. The exchange cannot be used after it.
#[derive(Debug, thiserror::Error)]
pub enum ExchangeError {
    #[error("the other daemons did not take part within {0:?}")]
    Deadline(Duration),
    #[error("{0}")]
    Failed(String),
    /// The group was reset (the daemon is shutting down) while the call
    /// waited ([`RemoteLink::abandon`]).
    #[error("the group was reset while the other daemons were awaited")]
    Abandoned,
}

/// Collective calls between the daemons of one job, made from one thread.
/// Every host makes the same calls in the same order with equal lengths.
/// Not `Send`: it lives on the thread that made it (MPI's funneled level).
pub trait Exchange {
    /// This host's index, `0..hosts()`.
    fn host(&self) -> u32;
    /// Number of hosts (daemons).
    fn hosts(&self) -> u32;
    /// Every host's `mine` into `all` (`hosts() * mine.len()` bytes), in
    /// host order, by `deadline`.
    fn allgather(
        &mut self,
        mine: &[u8],
        all: &mut [u8],
        deadline: Instant,
    ) -> Result<(), ExchangeError>;
    /// All-gathers `len` bytes per host, piece by piece, by `deadline`:
    /// this host's bytes come from [`Pieces::produce`], every host's go to
    /// [`Pieces::consume`], both in order from the start, in stretches
    /// that begin on 64-byte boundaries. An exchange may produce the next
    /// piece and consume the last while one is on the network.
    fn allgather_pieces(
        &mut self,
        len: usize,
        pieces: &mut dyn Pieces,
        deadline: Instant,
    ) -> Result<(), ExchangeError>;
    /// Host `root`'s `buf` into every host's `buf`, by `deadline`.
    fn broadcast(
        &mut self,
        buf: &mut [u8],
        root: u32,
        deadline: Instant,
    ) -> Result<(), ExchangeError>;
    /// Sends `news` to every other host, outside the steps: it must not
    /// wait for them (best effort; a send that cannot complete is left).
    fn announce(&mut self, news: &[u8; NEWS_BYTES]) -> Result<(), ExchangeError>;
    /// News another host announced, if some arrived (without waiting).
    fn poll_news(&mut self) -> Result<Option<[u8; NEWS_BYTES]>, ExchangeError>;
    /// Ends the whole job after an exchange failed (MPI_Abort). A fake may
    /// return.
    fn abort(&mut self, why: &str);
}

/// Both ends of a pipelined all-gather ([`Exchange::allgather_pieces`]).
pub trait Pieces {
    /// Writes this host's bytes `at .. at + mine.len()` into `mine`.
    fn produce(&mut self, at: usize, mine: &mut [u8]);
    /// Every host's bytes `at .. at + parts[h].len()`, in host order.
    fn consume(&mut self, at: usize, parts: &[&[u8]]);
}

/// Bytes of one piece of news ([`Exchange::announce`]): the announcing
/// host, its loss number (1, 2, .. since start), the lost global rank and
/// a spare word (4 x u32).
pub const NEWS_BYTES: usize = 16;

/// How often an idle inter-host stage looks for news of a loss elsewhere.
const NEWS_POLL: Duration = Duration::from_millis(1);

/// Where a group's filled slots go, and who this host is.
#[derive(Clone)]
pub struct RemoteLink {
    /// This host's index.
    pub host: u32,
    /// Number of hosts.
    pub hosts: u32,
    /// To the thread that runs [`serve`].
    pub tx: mpsc::Sender<Work>,
    /// Set by a reset of the group (the daemon shutting down): the
    /// exchange gives up the call it waits in ([`ExchangeError::Abandoned`]),
    /// so that its collective completes with RESET before the daemon exits.
    pub abandon: Arc<AtomicBool>,
}

impl RemoteLink {
    /// Asks [`serve`] to return once it has dealt with the steps sent
    /// before (a waiting one gives up when the group is reset first).
    pub fn stop(&self) {
        let _ = self.tx.send(Work(Step::Stop));
    }
}

impl std::fmt::Debug for RemoteLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteLink")
            .field("host", &self.host)
            .field("hosts", &self.hosts)
            .finish_non_exhaustive()
    }
}

/// A step for [`serve`], made by the engine under its state lock.
pub struct Work(pub(super) Step);

pub(super) enum Step {
    /// A slot that filled in era `era`.
    Collective {
        shared: Arc<Shared>,
        era: u64,
        waiting: Waiting,
        running: Running,
    },
    /// A local member was lost (global rank): the next step fails
    /// everywhere with PEER_LOST, and the other hosts reset.
    Lost { shared: Arc<Shared>, peer: u32 },
    /// The group started: news of a loss elsewhere can be acted on before
    /// this host's first step.
    Attach { shared: Arc<Shared> },
    /// A local slot of era `era` timed out, `peer` (global) missing: its
    /// step fails everywhere with TIMEOUT.
    TimedOut {
        shared: Arc<Shared>,
        era: u64,
        peer: u32,
        deadline: Instant,
    },
    /// The daemon is shutting down (after a reset of the group): [`serve`]
    /// returns, so that its thread can drop the exchange (for MPI,
    /// `MPI_Finalize`: every daemon of the job stops at about the same time).
    Stop,
}

/// The opcodes the inter-host stage runs; the others fail with
/// UNSUPPORTED on every host.
pub fn supported(code: Code) -> bool {
    matches!(
        code,
        Code::Base(
            Opcode::Allreduce
                | Opcode::Reduce
                | Opcode::ReduceScatter
                | Opcode::Broadcast
                | Opcode::Allgather
                | Opcode::Barrier
        )
    )
}

/// Runs the steps that arrive on `rx` over `ex` until every sender is gone.
/// Call it on the thread that owns the exchange (the thread that
/// initialised MPI). While no step is waiting it looks for news of a loss
/// on another host every [`NEWS_POLL`] (see [`Step::Lost`]).
pub fn serve(rx: &mpsc::Receiver<Work>, ex: &mut dyn Exchange) {
    let mut sync = Sync {
        era: 0,
        peer: NO_PEER,
        settled: vec![0; ex.hosts() as usize],
        losses: 0,
        shared: Weak::new(),
    };
    loop {
        let step = match rx.recv_timeout(NEWS_POLL) {
            Ok(Work(step)) => step,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if let Err((shared, e)) = news(ex, &mut sync) {
                    give_up(rx, ex, &shared, &e);
                    return;
                }
                continue;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        };
        let result = match step {
            Step::Stop => return,
            Step::Attach { shared } => {
                sync.shared = Arc::downgrade(&shared);
                Ok(())
            }
            Step::Collective {
                shared,
                era,
                waiting,
                running,
            } => {
                if era < sync.era {
                    let arrivals: Vec<Arrival> = waiting.arrivals.into_iter().flatten().collect();
                    fail_all(
                        &shared,
                        &arrivals,
                        Outcome::fail(Status::PeerLost, 0, sync.peer),
                    );
                    drop(running);
                    continue;
                }
                collective(ex, &shared, waiting, running, &mut sync)
            }
            Step::Lost { shared, peer } => {
                let deadline = Instant::now() + 2 * shared.cfg.timeout;
                sync.losses += 1;
                let mut news = [0u8; NEWS_BYTES];
                put(&mut news, 0, ex.host());
                put(&mut news, 1, sync.losses);
                put(&mut news, 2, peer);
                // The other hosts learn of it even if none of their members
                // submits again: they join this step on the news.
                if let Err(e) = ex.announce(&news) {
                    give_up(rx, ex, &shared, &e);
                    return;
                }
                let mut entry = [0u8; ENTRY_BYTES];
                put(&mut entry, 0, KIND_LOST);
                put(&mut entry, 1, peer);
                put(&mut entry, 2, sync.losses);
                match gather(ex, &entry, deadline, &mut sync) {
                    Ok(all) => {
                        if let Some(bad) = first_failure(&all) {
                            settle(ex, &shared, &all, bad, &mut sync);
                        }
                        Ok(())
                    }
                    Err(e) => Err((shared, e)),
                }
            }
            Step::TimedOut {
                shared,
                era,
                peer,
                deadline,
            } => {
                if era < sync.era {
                    continue;
                }
                let mut entry = [0u8; ENTRY_BYTES];
                put(&mut entry, 0, KIND_TIMEOUT);
                put(&mut entry, 1, peer);
                match gather(ex, &entry, deadline + shared.cfg.timeout, &mut sync) {
                    Ok(all) => {
                        if let Some(bad) = first_failure(&all) {
                            settle(ex, &shared, &all, bad, &mut sync);
                        }
                        Ok(())
                    }
                    Err(e) => Err((shared, e)),
                }
            }
        };
        if let Err((shared, e)) = result {
            give_up(rx, ex, &shared, &e);
            return;
        }
    }
}

/// With no step of its own waiting: news of a loss on another host that
/// no step has settled yet. That host is waiting in its step for the loss
/// (it announced it when it took the step, after every earlier one), and
/// so is this host at the same step: its pending collectives fail with
/// PEER_LOST at once, and it joins that step.
fn news(ex: &mut dyn Exchange, sync: &mut Sync) -> StepResult {
    let Some(shared) = sync.shared.upgrade() else {
        // Not attached yet: nothing here to fail; the news is kept.
        return Ok(());
    };
    let msg = match ex.poll_news() {
        Ok(Some(msg)) => msg,
        Ok(None) => return Ok(()),
        Err(e) => return Err((shared, e)),
    };
    let (from, n, peer) = (get(&msg, 0), get(&msg, 1), get(&msg, 2));
    if from == ex.host() || from >= ex.hosts() || sync.settled[from as usize] >= n {
        return Ok(());
    }
    log::warn!(
        "member {peer} on host {from} was lost: this host's pending collectives fail with \
         PEER_LOST"
    );
    shared.bump(Cause::Remote(peer), &[]);
    sync.era = lock(&shared.state).era;
    sync.peer = peer;
    let mut entry = [0u8; ENTRY_BYTES];
    put(&mut entry, 0, KIND_LOST_ELSEWHERE);
    put(&mut entry, 1, peer);
    let deadline = Instant::now() + 2 * shared.cfg.timeout;
    match gather(ex, &entry, deadline, sync) {
        Ok(all) => {
            if let Some(bad) = first_failure(&all) {
                settle(ex, &shared, &all, bad, sync);
            }
            Ok(())
        }
        Err(e) => Err((shared, e)),
    }
}

/// What the steps so far decided.
struct Sync {
    /// The last reset that every host took part in (a lost member): steps
    /// of an era older than this were decided away by it; they fail here,
    /// without a step, with PEER_LOST naming `peer`.
    era: u64,
    peer: u32,
    /// Per host: the number of its losses that a step has settled.
    settled: Vec<u32>,
    /// This host's losses so far.
    losses: u32,
    /// The group, once attached (weak: the group holds the sender whose
    /// end stops [`serve`]).
    shared: Weak<Shared>,
}

fn put(entry: &mut [u8], i: usize, v: u32) {
    entry[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
}

fn get(entry: &[u8], i: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&entry[i * 4..i * 4 + 4]);
    u32::from_le_bytes(b)
}

fn header_of(entry: &[u8]) -> VirtioDmlcReq {
    VirtioDmlcReq::read_from_bytes(&entry[16..ENTRY_BYTES]).unwrap_or_default()
}

fn gather(
    ex: &mut dyn Exchange,
    entry: &[u8; ENTRY_BYTES],
    deadline: Instant,
    sync: &mut Sync,
) -> Result<Vec<u8>, ExchangeError> {
    let mut all = vec![0u8; ENTRY_BYTES * ex.hosts() as usize];
    ex.allgather(entry, &mut all, deadline)?;
    for (h, e) in all.chunks(ENTRY_BYTES).enumerate() {
        if get(e, 0) == KIND_LOST {
            sync.settled[h] = sync.settled[h].max(get(e, 2));
        }
    }
    Ok(all)
}

/// The first host entry (in host order) that is a failure: its kind and
/// global peer.
fn first_failure(all: &[u8]) -> Option<(u32, u32)> {
    all.chunks(ENTRY_BYTES)
        .map(|e| (get(e, 0), get(e, 1)))
        .find(|&(kind, _)| kind != KIND_COLLECTIVE)
}

/// After a step that failed because of host entries `bad`: a lost member
/// anywhere resets the hosts that did not lose it, so every host starts a
/// new era (sequence numbers from 0) at the same step.
fn settle(ex: &mut dyn Exchange, sh: &Arc<Shared>, all: &[u8], bad: (u32, u32), sync: &mut Sync) {
    let me = ex.host() as usize;
    // This host lost a member itself, or reset on the news already.
    let lost_here = is_lost(get(&all[me * ENTRY_BYTES..], 0));
    if is_lost(bad.0) {
        if !lost_here {
            log::warn!(
                "member {} on another host was lost: this host's pending collectives fail with \
                 PEER_LOST",
                bad.1
            );
            sh.bump(Cause::Remote(bad.1), &[]);
        }
        sync.era = lock(&sh.state).era;
        sync.peer = bad.1;
    }
}

fn fail_all(sh: &Shared, arrivals: &[Arrival], out: Outcome) {
    for a in arrivals {
        sh.deliver(a, out);
    }
}

/// An exchange call failed: nothing more can be agreed with the other
/// daemons. Every pending request of this host fails (RESET), then the
/// job ends.
fn give_up(rx: &mpsc::Receiver<Work>, ex: &mut dyn Exchange, sh: &Arc<Shared>, e: &ExchangeError) {
    log::error!(
        "inter-host exchange failed ({e}); this host's pending collectives fail with RESET and \
         the job ends"
    );
    sh.bump(Cause::Reset, &[]);
    while let Ok(Work(step)) = rx.try_recv() {
        if let Step::Collective {
            shared,
            waiting,
            running,
            ..
        } = step
        {
            let arrivals: Vec<Arrival> = waiting.arrivals.into_iter().flatten().collect();
            fail_all(&shared, &arrivals, Outcome::fail(Status::Reset, 0, NO_PEER));
            drop(running);
        }
    }
    ex.abort(&e.to_string());
}

type StepResult = Result<(), (Arc<Shared>, ExchangeError)>;

/// One collective step (see the module documentation).
fn collective(
    ex: &mut dyn Exchange,
    sh: &Arc<Shared>,
    w: Waiting,
    running: Running,
    sync: &mut Sync,
) -> StepResult {
    let local = sh.world;
    let host = ex.host();
    let hosts = ex.hosts();
    let global = |r: u32| host * local + r;
    let deadline = w.deadline + sh.cfg.timeout;
    let arrivals: Vec<Arrival> = w.arrivals.into_iter().flatten().collect();
    let reference = arrivals[0].req.header;
    let mut mask = 0;
    let mut mpeer = NO_PEER;
    for a in &arrivals[1..] {
        let m = header_mismatch(&reference, &a.req.header);
        if m != 0 && mpeer == NO_PEER {
            mpeer = global(a.rank);
        }
        mask |= m;
    }
    let mut entry = [0u8; ENTRY_BYTES];
    put(&mut entry, 0, KIND_COLLECTIVE);
    put(&mut entry, 1, NO_PEER);
    put(&mut entry, 2, mask);
    put(&mut entry, 3, mpeer);
    entry[16..].copy_from_slice(reference.as_bytes());
    let filled = Instant::now();
    let all = match gather(ex, &entry, deadline, sync) {
        Ok(all) => all,
        Err(e) => {
            fail_all(sh, &arrivals, Outcome::fail(failed_status(&e), 0, NO_PEER));
            return Err((sh.clone(), e));
        }
    };
    if let Some((kind, peer)) = first_failure(&all) {
        let status = if is_lost(kind) {
            Status::PeerLost
        } else {
            Status::Timeout
        };
        running.end();
        fail_all(sh, &arrivals, Outcome::fail(status, 0, peer));
        drop(running);
        settle(ex, sh, &all, (kind, peer), sync);
        return Ok(());
    }
    // Against global rank 0's header: the same mask and first rank as one
    // device of all members would find (a field differs from rank 0's on
    // some member iff it differs on some host from that host's rank 0, or
    // between that host's rank 0 and rank 0).
    let h0 = header_of(&all);
    let mut gmask = 0;
    let mut gpeer = NO_PEER;
    for (h, e) in all.chunks(ENTRY_BYTES).enumerate() {
        let across = header_mismatch(&h0, &header_of(e));
        let peer = if across != 0 {
            h as u32 * local
        } else {
            get(e, 3)
        };
        if gpeer == NO_PEER && (across != 0 || get(e, 2) != 0) {
            gpeer = peer;
        }
        gmask |= across | get(e, 2);
    }
    if gmask != 0 {
        running.end();
        fail_all(sh, &arrivals, Outcome::fail(Status::Mismatch, gmask, gpeer));
        return Ok(());
    }
    let req = &arrivals[0].req;
    if !supported(req.code) {
        log::warn!(
            "{} is not supported across hosts yet: it fails with UNSUPPORTED",
            req.code
        );
        running.end();
        fail_all(
            sh,
            &arrivals,
            Outcome::fail(Status::Unsupported, unsupported::OPCODE, NO_PEER),
        );
        return Ok(());
    }
    let agreed = Instant::now();
    match data_stage(ex, sh, &arrivals, &running, hosts, deadline) {
        Ok(()) => {
            sh.metrics.collective_done(req.code);
            log::debug!(
                "{} of {} bytes: entries agreed in {:?}, data in {:?}",
                req.code,
                req.count_bytes(),
                agreed - filled,
                agreed.elapsed()
            );
            Ok(())
        }
        Err(e) => {
            running.end();
            fail_all(sh, &arrivals, Outcome::fail(failed_status(&e), 0, NO_PEER));
            Err((sh.clone(), e))
        }
    }
}

/// The status of a collective whose exchange call failed: RESET if the
/// group was reset meanwhile, TIMEOUT otherwise (the other daemons missed
/// the bound, or MPI failed).
fn failed_status(e: &ExchangeError) -> Status {
    match e {
        ExchangeError::Abandoned => Status::Reset,
        _ => Status::Timeout,
    }
}

fn host_seg(buf: &mut [u8]) -> [HostSeg; 1] {
    [HostSeg {
        ptr: buf.as_mut_ptr(),
        len: buf.len(),
    }]
}

/// Where member `a`'s input starts: its input segments, or its output at
/// the in-place offset.
fn input_ref(a: &Arrival, extra: usize) -> SegRef<'_> {
    match a.req.in_place_offset {
        Some(off) => SegRef {
            segs: &a.req.outputs,
            offset: off + extra,
        },
        None => SegRef {
            segs: &a.req.inputs,
            offset: extra,
        },
    }
}

/// A reduction's ends of the pipelined exchange: this host's bytes of a
/// stretch are its members' inputs reduced in local rank order (sum for
/// avg), with the data path's kernels; the `H` partials of a stretch are
/// reduced in host order straight into the outputs of the members that
/// receive those bytes, so every host writes the same bits.
struct Reduction<'a> {
    arrivals: &'a [Arrival],
    /// Global rank of this host's local rank 0.
    first: usize,
    world: u32,
    dtype: Dtype,
    op: ReduceOp,
    /// How the members' outputs are written (by all their bytes together).
    tuning: datapath::Tuning,
}

impl<'a> Reduction<'a> {
    fn new(
        arrivals: &'a [Arrival],
        first: usize,
        world: usize,
        dtype: Dtype,
        op: ReduceOp,
    ) -> Self {
        let req = &arrivals[0].req;
        let written = match req.code {
            Code::Base(Opcode::Allreduce) => arrivals.len() * req.count_bytes(),
            _ => req.count_bytes(),
        };
        Reduction {
            arrivals,
            first,
            world: world as u32,
            dtype,
            op,
            tuning: datapath::Tuning::for_output(written),
        }
    }
}

impl Pieces for Reduction<'_> {
    fn produce(&mut self, at: usize, mine: &mut [u8]) {
        let op = if self.op == ReduceOp::Avg {
            ReduceOp::Sum
        } else {
            self.op
        };
        let len = mine.len();
        let segs = host_seg(mine);
        let out = SegRef {
            segs: &segs,
            offset: 0,
        };
        let ins: Vec<SegRef<'_>> = self.arrivals.iter().map(|a| input_ref(a, at)).collect();
        // SAFETY: every input was resolved from its member's guest memory,
        // mapped while the arrival lives, and checked at parse time to hold
        // the whole reduction (whole elements) from its offset, which the
        // exchange's stretches stay within; the output is the exchange's
        // own buffer of `len` bytes.
        unsafe {
            datapath::reduce_range_tuned(
                self.dtype,
                op,
                self.arrivals.len() as u32,
                &ins,
                &[out],
                len,
                datapath::Tuning::for_output(len),
            );
        }
    }

    fn consume(&mut self, at: usize, parts: &[&[u8]]) {
        let n = parts[0].len();
        let segs: Vec<[HostSeg; 1]> = parts
            .iter()
            .map(|p| {
                [HostSeg {
                    ptr: p.as_ptr().cast_mut(),
                    len: p.len(),
                }]
            })
            .collect();
        // The partials from byte `skip` of the stretch, into `outs`, `len`
        // bytes.
        let reduce = |skip: usize, outs: &[SegRef<'_>], len: usize| {
            let ins: Vec<SegRef<'_>> = segs
                .iter()
                .map(|s| SegRef {
                    segs: s,
                    offset: skip,
                })
                .collect();
            // SAFETY: the inputs are the exchange's buffers of `n` bytes,
            // only read, with `skip + len <= n`; every output was resolved
            // from its member's guest memory, mapped while the arrival
            // lives (the collective is still running), and checked at parse
            // time to hold what the opcode writes there.
            unsafe {
                datapath::reduce_range_tuned(
                    self.dtype,
                    self.op,
                    self.world,
                    &ins,
                    outs,
                    len,
                    self.tuning,
                );
            }
        };
        let req = &self.arrivals[0].req;
        match req.code {
            Code::Base(Opcode::ReduceScatter) => {
                // Member g receives bytes g*b .. (g+1)*b of the result.
                let b = req.count_bytes();
                for a in self.arrivals {
                    let g = self.first + a.rank as usize;
                    let (lo, hi) = (at.max(g * b), (at + n).min((g + 1) * b));
                    if lo >= hi {
                        continue;
                    }
                    let base = if a.req.in_place_offset.is_some() {
                        g * b
                    } else {
                        0
                    };
                    let out = SegRef {
                        segs: &a.req.outputs,
                        offset: base + lo - g * b,
                    };
                    reduce(lo - at, &[out], hi - lo);
                }
            }
            Code::Base(Opcode::Reduce) => {
                let root = req.root as usize;
                if let Some(a) = self
                    .arrivals
                    .iter()
                    .find(|a| self.first + a.rank as usize == root)
                {
                    let out = SegRef {
                        segs: &a.req.outputs,
                        offset: at,
                    };
                    reduce(0, &[out], n);
                }
            }
            _ => {
                let outs: Vec<SegRef<'_>> = self
                    .arrivals
                    .iter()
                    .map(|a| SegRef {
                        segs: &a.req.outputs,
                        offset: at,
                    })
                    .collect();
                reduce(0, &outs, n);
            }
        }
    }
}

/// Reads, exchanges and writes the data of a collective whose headers
/// agree on every host.
fn data_stage(
    ex: &mut dyn Exchange,
    sh: &Arc<Shared>,
    arrivals: &[Arrival],
    running: &Running,
    hosts: u32,
    deadline: Instant,
) -> Result<(), ExchangeError> {
    let local = sh.world as usize;
    let host = ex.host() as usize;
    let world = hosts as usize * local;
    let req = &arrivals[0].req;
    let b = req.count_bytes();
    for bounce in arrivals.iter().flat_map(|a| &a.req.bounces) {
        // SAFETY: the arrival keeps its guest memory mapped, and no data
        // movement of this collective has started.
        unsafe { bounce.fill() };
    }
    // The bytes every member's outputs take their share from (none once
    // a reduction has written them), and where member `a` (global rank g)
    // finds its share.
    let result: Option<Vec<u8>>;
    match req.code {
        Code::Base(Opcode::Barrier) => {
            result = None;
            running.end();
        }
        Code::Base(Opcode::Broadcast) => {
            let root = req.root as usize;
            let mut buf = vec![0u8; b];
            if root / local == host {
                let a = &arrivals[root % local];
                let segs = host_seg(&mut buf);
                let dst = SegRef {
                    segs: &segs,
                    offset: 0,
                };
                // SAFETY: the input was resolved from the member's guest
                // memory, mapped while the arrival lives, and checked at
                // parse time to hold `b` bytes from this offset; `buf` is
                // ours and `b` long.
                unsafe { datapath::copy_range(input_ref(a, 0), &[dst], b) };
            }
            running.end();
            ex.broadcast(&mut buf, (root / local) as u32, deadline)?;
            result = Some(buf);
        }
        Code::Base(Opcode::Allgather) => {
            let mut mine = vec![0u8; local * b];
            for (l, a) in arrivals.iter().enumerate() {
                let segs = host_seg(&mut mine[l * b..(l + 1) * b]);
                let dst = SegRef {
                    segs: &segs,
                    offset: 0,
                };
                // SAFETY: as for broadcast.
                unsafe { datapath::copy_range(input_ref(a, 0), &[dst], b) };
            }
            running.end();
            let mut all = vec![0u8; world * b];
            ex.allgather(&mine, &mut all, deadline)?;
            result = Some(all);
        }
        _ => {
            // Allreduce, reduce, reduce-scatter: pipelined, the outputs
            // written as each piece's partials arrive.
            let (Some(dtype), Some(op)) = (req.dtype, req.op) else {
                return Ok(());
            };
            let len = if req.code == Code::Base(Opcode::ReduceScatter) {
                world * b
            } else {
                b
            };
            let mut reduction = Reduction::new(arrivals, host * local, world, dtype, op);
            ex.allgather_pieces(len, &mut reduction, deadline)?;
            running.end();
            result = None;
        }
    }
    let generation = sh.resp_generation.load(Ordering::Acquire);
    for a in arrivals {
        let write = || {
            if let Some(bytes) = result.as_deref() {
                if bytes.is_empty() {
                    return;
                }
                let src_segs = [HostSeg {
                    ptr: bytes.as_ptr().cast_mut(),
                    len: bytes.len(),
                }];
                let src = SegRef {
                    segs: &src_segs,
                    offset: 0,
                };
                let dst = SegRef {
                    segs: &a.req.outputs,
                    offset: 0,
                };
                // SAFETY: the output was resolved from the member's guest
                // memory, mapped while the arrival lives, and checked at
                // parse time to hold what the opcode writes there; the
                // source is our own buffer, only read. The member's gate is
                // held with its epoch checked, so it was not lost meanwhile.
                unsafe { datapath::copy_range(src, &[dst], bytes.len()) };
            }
            for bounce in a.req.bounces.iter().filter(|b| b.output) {
                // SAFETY: as above; all data movement into it has finished.
                unsafe { bounce.flush() };
            }
        };
        sh.finish_after(a, Outcome::OK, generation, write);
    }
    running.delivered();
    Ok(())
}
