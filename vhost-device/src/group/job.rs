//! The job workers: a collective being run ([`Job`]) over the arriving
//! thread and the reduction threads ([`worker_loop`]), and the counts that
//! order it with losses and generation changes ([`Running`], [`Outgoing`]).

use std::collections::btree_map;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Instant;

use virtio_dmlc::{Dtype, ReduceOp, Status, FLAG_CHECK_FINITE, NO_PEER};

use super::pieces::{BufAt, Piece};
use super::shared::{Cause, Shared};
use super::state::{lock, Arrival, Outcome, State};
use super::timed::{completed_at, record_of, Due, Schedule};
use crate::chain::Code;
use crate::datapath::{self, SegRef};

pub(super) fn worker_loop(rx: &Mutex<mpsc::Receiver<Arc<Job>>>) {
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

/// The text of a panic's payload.
fn panic_text(payload: &(dyn std::any::Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

/// A collective being run: its members' requests and its steps.
pub(super) struct Job {
    pub(super) shared: Arc<Shared>,
    /// Its slot: queue and sequence number.
    pub(super) key: (u16, u64),
    pub(super) opcode: Code,
    pub(super) reduce: Option<(Dtype, ReduceOp)>,
    /// In rank order, all members.
    pub(super) arrivals: Vec<Arrival>,
    pub(super) pieces: Vec<Piece>,
    /// By arrival, the outcome of a completion without failure (send and
    /// receive: lengths and sender); empty: `Outcome::OK` for every one.
    pub(super) ok: Vec<Outcome>,
    /// Byte ranges when split; empty when run inline.
    pub(super) parts: Vec<(usize, usize, usize)>,
    pub(super) next: AtomicUsize,
    pub(super) left: AtomicUsize,
    /// Some part panicked: the collective fails, and the parts not yet
    /// started are skipped.
    pub(super) failed: AtomicBool,
    /// The part (split) or piece (inline) that panics on purpose (test
    /// fault).
    pub(super) panic_at: Option<usize>,
    /// The member whose outputs are not written (test fault).
    pub(super) skip_write: Option<u32>,
    /// Ended once the last byte has moved (or when the job is dropped).
    pub(super) running: Running,
    /// When the data movement started (with a timing model or a recorder).
    pub(super) moved_from: Option<Instant>,
    /// With a timing model: when it completes.
    pub(super) sched: Option<Schedule>,
    /// With a timing model, by member: once its completion is made (or
    /// withheld), when (None: dropped or withheld).
    pub(super) done_at: Mutex<Vec<Option<Option<Instant>>>>,
    /// Some member asked for the check of spec 5.X.6.14 (a float
    /// reduction): the reductions use the checked kernels.
    pub(super) check: bool,
    /// With `check`: the lowest non-finite input found by any range, as
    /// (member, element of its input), members in rank order; every range
    /// reports its own lowest and this keeps the lexicographic minimum, so
    /// the split over threads does not change it.
    pub(super) non_finite: Mutex<Option<(usize, u64)>>,
}

/// Whether a collective of `arrivals` reducing `reduce` is checked for
/// non-finite inputs (spec 5.X.6.14): a float reduction and some member's
/// request with `FLAG_CHECK_FINITE` (the flag passed the local checks, so
/// that member negotiated feature bit 4).
pub(super) fn wants_check<'a>(
    arrivals: impl IntoIterator<Item = &'a Arrival>,
    reduce: Option<(Dtype, ReduceOp)>,
) -> bool {
    reduce.is_some_and(|(dtype, _)| dtype.is_float()) && arrivals.into_iter().any(asks_check)
}

/// The member's request carries `FLAG_CHECK_FINITE`.
fn asks_check(a: &Arrival) -> bool {
    a.req.header.flags.get() & FLAG_CHECK_FINITE != 0
}

/// A collective counted in `State::running` until [`Running::end`] (or
/// drop): while counted, it may read or write its members' guest memory.
/// Its completions count in `State::outgoing` until
/// [`Running::delivered`] (or drop).
pub(super) struct Running {
    shared: Arc<Shared>,
    id: u64,
    ended: AtomicBool,
    batch: Mutex<Option<Outgoing>>,
}

impl Running {
    /// Counts a new collective; `st` is the locked state of `shared`.
    pub(super) fn start(shared: &Arc<Shared>, st: &mut State) -> Running {
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
    pub(super) fn end(&self) {
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
    pub(super) fn delivered(&self) {
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
pub(super) struct Outgoing {
    shared: Arc<Shared>,
    era: u64,
}

impl Outgoing {
    /// Counts a batch; `st` is the locked state of `shared`.
    pub(super) fn register(shared: &Arc<Shared>, st: &mut State, era: u64) -> Outgoing {
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
    pub(super) fn work(self: &Arc<Self>) {
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
    pub(super) fn run_unit(&self, unit: usize, piece: usize, start: usize, len: usize) {
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
    pub(super) fn guarded(&self, f: impl FnOnce()) {
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
                    if !self.check {
                        datapath::reduce_range_tuned(
                            dtype,
                            op,
                            self.shared.world,
                            &ins,
                            &outs,
                            len,
                            tuning,
                        );
                    } else if let Some((k, elem)) = datapath::reduce_range_checked(
                        dtype,
                        op,
                        self.shared.world,
                        &ins,
                        &outs,
                        len,
                        tuning,
                    ) {
                        self.found_non_finite(inputs[k], start, elem, dtype.size());
                    }
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

    /// Records a non-finite input found in a range that starts `start`
    /// bytes into `at`: element `elem` of the range, counted in the
    /// member's input (5.X.6.4: in place, from where its input starts in
    /// the buffer); keeps the lowest (member, element).
    fn found_non_finite(&self, at: BufAt, start: usize, elem: usize, size: usize) {
        let req = &self.arrivals[at.member].req;
        let input_start = if at.output {
            req.in_place_offset.unwrap_or(0)
        } else {
            0
        };
        let index = ((at.base - input_start + start) / size + elem) as u64;
        let mut found = lock(&self.non_finite);
        let new = (at.member, index);
        if found.is_none_or(|f| new < f) {
            *found = Some(new);
        }
    }

    /// The outcome of member `i`'s request once the data has moved without
    /// failure: OK (or the outcome kept in `ok`), or, for a member that
    /// asked for the check when an input was non-finite, NONFINITE naming
    /// the lowest such rank (`peer`) and element (`length`).
    fn outcome(&self, i: usize) -> Outcome {
        let ok = self.ok.get(i).copied().unwrap_or(Outcome::OK);
        if !self.check || !asks_check(&self.arrivals[i]) {
            return ok;
        }
        match *lock(&self.non_finite) {
            Some((member, index)) => Outcome {
                length: index,
                ..Outcome::fail(Status::NonFinite, 0, self.arrivals[member].rank)
            },
            None => ok,
        }
    }

    /// Writes every member's response and completes its chain: OK, or,
    /// if the data movement panicked, RESET for every member as the whole
    /// group is reset. With a timing model, an OK completion comes no
    /// earlier than its modelled time: if that is still to come, the job
    /// (`me`, its own handle) is held until then.
    pub(super) fn finish(&self, me: Option<&Arc<Job>>) {
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
        let done_at = sh.deliver_together(&self.arrivals, |i| self.outcome(i));
        self.running.delivered();
        self.record(&done_at, moved_to, late);
    }

    /// With a timing model: completes with OK the members whose modelled
    /// completion has come (every one if `all`), except a withheld one, and
    /// holds the job until the next member's; once every completion is
    /// made, records the collective.
    pub(super) fn deliver_due(self: &Arc<Self>, moved_to: Option<Instant>, late: bool, all: bool) {
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
            let delivered = sh.deliver(a, self.outcome(i));
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
