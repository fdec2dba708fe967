//! Timed delivery: a collective's schedule under the timing model
//! ([`schedule`]), the failures the daemon injects, completions held until
//! their time ([`Due`]), and the flight-recorder record every collective
//! ends with ([`record_of`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use virtio_dmlc::Opcode;

use super::job::{Job, Running};
use super::matching::mismatch_mask;
use super::shared::Shared;
use super::state::{Arrival, Outcome, State, Waiting};
use crate::chain::Code;
use crate::timing::{FailRule, Timing};
use crate::trace::{MemberRecord, Record};

/// When a collective completes under the timing model, and whether it
/// fails on purpose.
#[derive(Clone, Debug)]
pub(super) struct Schedule {
    /// Modelled start: the last effective arrival, or the modelled end of
    /// the previous collective on the same queue if later.
    pub(super) start: Instant,
    /// Modelled completion (of the latest modelled rank).
    pub(super) due: Instant,
    /// By rank, each member's modelled completion, where the algorithm
    /// makes them differ ([`crate::timing::Model::rank_time`]); empty:
    /// every member completes at `due`.
    pub(super) member_due: Vec<Instant>,
    /// The member whose completion is withheld on purpose.
    pub(super) withheld: Option<u32>,
    /// What an injected bandwidth factor did, for the trace.
    pub(super) slowed: Option<String>,
    /// A failure to inject instead of running it.
    pub(super) fail: Option<Injected>,
}

impl Schedule {
    /// Member `i`'s modelled completion.
    pub(super) fn due_of(&self, i: usize) -> Instant {
        self.member_due.get(i).copied().unwrap_or(self.due)
    }
}

/// A failure the daemon injects.
#[derive(Clone, Copy, Debug)]
pub(super) enum Injected {
    /// From a `[[fail]]` rule.
    Rule(FailRule),
    /// An injected delay made member `rank` count as arriving at `at`,
    /// after the collective's deadline.
    LateArrival { rank: u32, at: Instant },
}

/// The schedule of collective `key`, whose members have all arrived
/// (`w`); called under the state lock `st`, in the order collectives fill.
pub(super) fn schedule(t: &Timing, st: &mut State, key: (u16, u64), w: &Waiting) -> Schedule {
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
        reference.code.base().unwrap_or(Opcode::Barrier),
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
pub(super) fn record_of(
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
        comm: reference.map_or(0, |r| r.comm_id()),
        opcode: reference.map_or(Code::Base(Opcode::Barrier), |r| r.code),
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
pub(super) fn completed_at(r: &mut Record, arrivals: &[Arrival], done_at: &[Option<Instant>]) {
    for (a, t) in arrivals.iter().zip(done_at) {
        if let Some(m) = r.members.get_mut(a.rank as usize) {
            m.completed = *t;
        }
    }
}

/// An injected TIMEOUT held until the deadline.
pub(super) struct FailLater {
    pub(super) shared: Arc<Shared>,
    pub(super) key: (u16, u64),
    pub(super) arrivals: Vec<Arrival>,
    pub(super) out: Outcome,
    pub(super) running: Running,
    pub(super) what: String,
}

impl FailLater {
    pub(super) fn deliver(self) {
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
pub(super) enum Due {
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
    pub(super) fn deliver(self, all: bool) {
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
