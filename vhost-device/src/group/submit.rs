//! Requests in: admitting a chain ([`Group::submit`],
//! [`Group::refuse_earlier`]), filing it in its collective slot, and running
//! (or failing on purpose) a collective whose members have all arrived.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use virtio_dmlc::comm::{CommOpcode, BAD_COMM, COMM_WORLD, MISMATCH_TABLE};
use virtio_dmlc::{Opcode, Status, NO_PEER};
use virtio_queue::DescriptorChain;

use super::blocks;
use super::comms::Found;
use super::job::{wants_check, Job, Outgoing, Running};
use super::matching::mismatch_mask;
use super::pieces::{plan, split, Piece};
use super::shared::{Cause, Gate, Shape};
use super::state::{lock, read, Arrival, Outcome, Slot, SlotKey, State, Waiting};
use super::test_fault::TestFault;
use super::timed::{completed_at, record_of, schedule, Due, FailLater, Injected, Schedule};
use super::{remote, Completion, Group, SPLIT_THRESHOLD};
use crate::chain::{self, create_list, Code, CommView, Limits, Request};
use crate::timing::FailRule;
use crate::GuestMem;

impl Group {
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
        sh.metrics.request(req.code);
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
            features: sh.features[rank as usize].load(Ordering::Acquire),
        };
        // Communicators other than 0 are looked up under the state lock;
        // the one a request names is checked again when it is filed.
        let comms = |id: u32| lock(&sh.state).comms.view(id, rank);
        let req = match chain::parse_in(chain, &limits, &comms) {
            Ok(req) => req,
            Err(rej) => {
                if let Some(op) = rej.code {
                    sh.metrics.request(op);
                }
                let shape = if rej.comm_response {
                    Shape::Comm(None)
                } else {
                    Shape::Base
                };
                let response = match (rej.error.status_detail(), rej.response) {
                    (Some((status, detail)), Some(addr)) => Some((
                        &**mem,
                        addr,
                        Outcome::fail(status, detail, NO_PEER),
                        sh.resp_generation.load(Ordering::Acquire),
                        shape,
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
        if req.code == Code::Base(Opcode::Nop) {
            // Answered at once for this member alone (spec 5.X.6.3): no
            // sequence number, no timeout, no timing model.
            sh.metrics.request(req.code);
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
        // Counted under the state lock: whoever reads the count and then
        // takes the lock (a loss, a reset) finds the request filed.
        sh.metrics.request(arrival.req.code);
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
        let view = match &arrival.req.comm {
            Some(c) => c.view.clone(),
            None => CommView::world(rank, sh.world),
        };
        if view.id != COMM_WORLD {
            // Freed or revoked since the request was parsed (spec
            // 5.X.6.13.3): answered now, with no sequence number.
            let out = match st.comms.find(view.id, rank) {
                Found::Live => None,
                Found::Unknown => Some(Outcome::fail(Status::BadRequest, BAD_COMM, NO_PEER)),
                Found::Revoked(_) if arrival.req.code == Code::Comm(CommOpcode::CommFree) => {
                    st.comms.free_revoked(view.id, rank);
                    Some(Outcome::OK)
                }
                Found::Revoked(lost) => Some(Outcome::fail(Status::PeerLost, 0, lost)),
            };
            if let Some(out) = out {
                drop(st);
                sh.answer_now(rank, gate.epoch, queue, mem, &arrival.req, done, out);
                return;
            }
        }
        let key = match arrival.req.code {
            Code::Comm(CommOpcode::Send | CommOpcode::Recv) => {
                return self.file_p2p(st, arrival, view, deadline);
            }
            Code::Comm(CommOpcode::CommCreate) => {
                let tag = arrival.req.header.tag.get();
                let order = st.comms.next_create(rank, view.id, tag);
                SlotKey::Create {
                    parent: view.id,
                    tag,
                    order,
                }
            }
            _ => {
                let seq = if view.id == COMM_WORLD {
                    let m = &mut st.members[rank as usize];
                    let seq = m.seqs[usize::from(queue)];
                    m.seqs[usize::from(queue)] = seq + 1;
                    seq
                } else {
                    st.comms.next_seq(view.id, view.rank, queue)
                };
                SlotKey::Coll {
                    comm: view.id,
                    queue,
                    seq,
                }
            }
        };
        let State {
            timing, members, ..
        } = &mut *st;
        if let (Some(t), COMM_WORLD) = (timing, view.id) {
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
                let at = view.rank as usize;
                if t.missing[at] {
                    t.missing[at] = false;
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
                        key.short(),
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
            None => {
                let mut w = Waiting::new(view.size, view.members.clone(), now);
                w.deadline = deadline;
                if let (SlotKey::Create { .. }, Some(c)) = (key, &arrival.req.comm) {
                    // The first caller's list is the reference (its own
                    // was checked at parse time).
                    w.listed = Some(create_list(&c.table).unwrap_or_default());
                }
                w
            }
        };
        waiting.deadline = waiting.deadline.min(deadline);
        let at = view.rank as usize;
        if waiting.arrivals[at].is_none() {
            waiting.present += 1;
        }
        waiting.arrivals[at] = Some(arrival);
        if !waiting.complete() {
            let deadline = waiting.deadline;
            st.slots.insert(key, Slot::Waiting(waiting));
            if st.timer_target.is_none_or(|t| deadline < t) {
                st.timer_target = Some(deadline);
                sh.timer_cv.notify_one();
            }
            return;
        }
        if let Some(waiting) = self.hold_if_frozen(&mut st, key, waiting) {
            self.start_filled(st, key, waiting);
        }
    }

    /// Starts collective `key`, whose members have all arrived (`st` is
    /// the locked state, from which its slot was taken): a comm_create
    /// completes, a collective goes to the inter-host stage or runs.
    pub(super) fn start_filled(
        &self,
        mut st: MutexGuard<'_, State>,
        key: SlotKey,
        waiting: Waiting,
    ) {
        let sh = &*self.shared;
        // Counted as running under the state lock, so that a loss after
        // this point waits for it.
        let running = Running::start(&self.shared, &mut st);
        if let SlotKey::Create { .. } = key {
            return self.finish_create(st, key, waiting, running);
        }
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
        // The timing model prices the group's own collectives only.
        let sched = st
            .timing
            .clone()
            .filter(|_| {
                key.comm() == COMM_WORLD
                    && waiting.arrivals[0]
                        .as_ref()
                        .is_some_and(|a| a.req.code.base().is_some())
            })
            .map(|t| schedule(&t, &mut st, key.short(), &waiting));
        drop(st);
        self.run(key, waiting, running, sched);
    }

    /// Runs collective `key`, whose members have all arrived.
    fn run(&self, slot: SlotKey, w: Waiting, running: Running, sched: Option<Schedule>) {
        let sh = &self.shared;
        let key = slot.short();
        let arrivals: Vec<Arrival> = w.arrivals.into_iter().flatten().collect();
        // Effective arrivals: an injected delay counts as its member's.
        let counted = |a: &Arrival| a.at + a.delay;
        let last = arrivals.iter().map(counted).max().unwrap_or(w.first);
        let first = arrivals.iter().map(counted).min().unwrap_or(w.first);
        sh.metrics.skew(last.saturating_duration_since(first));
        // The last to arrive: the first member with the latest arrival.
        let latest = arrivals.iter().position(|a| counted(a) == last);
        for (i, a) in arrivals.iter().enumerate() {
            let lag = counted(a).saturating_duration_since(first);
            sh.metrics
                .arrival(a.rank, lag, arrivals.len() > 1 && latest == Some(i));
        }
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
            let done_at = sh.deliver_together(&arrivals, |_| out);
            running.delivered();
            if let Some(rec) = &sh.recorder {
                let generation = sh.resp_generation.load(Ordering::Acquire);
                let mut r = record_of(key, generation, &arrivals, sh.world, out);
                completed_at(&mut r, &arrivals, &done_at);
                rec.push(r);
            }
            return;
        }

        if let Code::Comm(op @ (CommOpcode::CommSplit | CommOpcode::CommFree)) = reference.code {
            return self.finish_comm_op(slot, op, arrivals, running, w.members);
        }

        let mut pieces = match reference.code {
            Code::Comm(op) => match blocks::plan(&arrivals, op) {
                Ok(p) => p,
                Err(at) => {
                    // The tables disagree: no data moves.
                    running.end();
                    let out = Outcome::fail(Status::Mismatch, MISMATCH_TABLE, arrivals[at].rank);
                    let done_at = sh.deliver_together(&arrivals, |_| out);
                    running.delivered();
                    if let Some(rec) = &sh.recorder {
                        let generation = sh.resp_generation.load(Ordering::Acquire);
                        let mut r = record_of(key, generation, &arrivals, sh.world, out);
                        completed_at(&mut r, &arrivals, &done_at);
                        rec.push(r);
                    }
                    return;
                }
            },
            Code::Base(_) => plan(&arrivals),
        };
        let TestFault {
            skip_write,
            panic: panic_now,
        } = TestFault::arm(&sh.faults, key, &mut pieces);
        let reduce = reference.dtype.zip(reference.op);
        let opcode = reference.code;
        let n_arrivals = arrivals.len();
        let check = wants_check(&arrivals, reduce);
        let job = Job {
            shared: sh.clone(),
            key,
            opcode,
            reduce,
            arrivals,
            pieces,
            ok: Vec::new(),
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
            check,
            non_finite: Mutex::new(None),
        };
        self.launch(job, panic_now);
    }

    /// Moves a job's data: inline, or split over the reduction threads
    /// when it is large; whichever thread ends last completes it.
    pub(super) fn launch(&self, mut job: Job, panic_now: bool) {
        let sh = &self.shared;
        let total: usize = job.pieces.iter().map(Piece::len).sum();
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
