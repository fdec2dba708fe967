//! Freezing the group at a consistent cut (spec 5.X.6.15, `dmlc-ctl
//! freeze`): a trigger names a collective (a sequence number on a queue of
//! communicator 0, or a tag), or any collective about to fail
//! (`--on-error`). Once every member of that collective has arrived, and
//! before any of its data moves, its slot is held: it stays filed,
//! complete, and nothing runs it. While a collective is held no deadline
//! passes (the timer thread sleeps), and when it is released every
//! deadline moves on by the time it was held, so frozen time never counts
//! towards a timeout.
//!
//! The launcher follows the freeze over the control socket: it sees a
//! held collective (`frozen`), stops every VM and says so (`stopped ID`);
//! `thaw` then asks it to resume them (`thawing`), and once it has
//! (`resumed ID`) the collective is released and runs (or fails, if it was
//! held on an error). Without a launcher (`thaw` while nobody said the VMs
//! are stopped) `thaw` releases at once.
//!
//! Every trigger fires once; a new `freeze` arms the next.

use std::fmt;
use std::sync::MutexGuard;
use std::time::{Duration, Instant};

use virtio_dmlc::comm::COMM_WORLD;

use super::inspect::summarise;
use super::job::{wants_check, Outgoing};
use super::matching::mismatch_mask;
use super::state::{lock, Arrival, Outcome, Slot, SlotKey, State, Waiting};
use super::Group;

/// What a `freeze` request arms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trigger {
    /// Collective `seq` on `queue` of communicator 0 (in any generation).
    At { queue: u16, seq: u64 },
    /// The first collective whose requests carry this tag.
    Tag(u64),
}

impl fmt::Display for Trigger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Trigger::At { queue, seq } => write!(f, "collective {seq} on queue {queue}"),
            Trigger::Tag(t) => write!(f, "the first collective tagged {t}"),
        }
    }
}

/// Why a collective is held.
#[derive(Clone, Debug)]
enum Why {
    Trigger(Trigger),
    /// It would complete with MISMATCH: these fields, first differing rank.
    Mismatch {
        mask: u32,
        peer: u32,
    },
    /// Its deadline passed with these group ranks missing.
    Timeout {
        missing: Vec<u32>,
    },
    /// A checked input is non-finite: the lowest such rank and element.
    NonFinite {
        rank: u32,
        index: u64,
    },
    /// A member (group rank) was lost while the others waited.
    PeerLost {
        rank: u32,
    },
}

impl fmt::Display for Why {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Why::Trigger(t) => write!(f, "freeze at {t}"),
            Why::Mismatch { mask, peer } => {
                write!(
                    f,
                    "on error: MISMATCH (fields {mask:#x}, rank {peer} differs)"
                )
            }
            Why::Timeout { missing } => write!(f, "on error: TIMEOUT (missing ranks {missing:?})"),
            Why::NonFinite { rank, index } => {
                write!(f, "on error: NONFINITE (rank {rank}, element {index})")
            }
            Why::PeerLost { rank } => write!(f, "on error: PEER_LOST (rank {rank} was lost)"),
        }
    }
}

/// Where a hold stands with the launcher.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    /// Held; nobody said the VMs are stopped.
    Held,
    /// The launcher stopped every VM (`stopped ID`).
    Frozen,
    /// `thaw` asked; the launcher resumes the VMs, then says `resumed ID`.
    Thawing,
}

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Phase::Held => "held",
            Phase::Frozen => "frozen",
            Phase::Thawing => "thawing",
        }
    }
}

pub(super) struct Held {
    id: u64,
    key: SlotKey,
    why: Why,
    since: Instant,
    pub(super) phase: Phase,
    /// `snapshot DIR`: the launcher saves every VM into DIR.
    snapshot: Option<Snapshot>,
    /// Held on a loss: the remaining members' requests, taken out of their
    /// slot, and the failure they get when thawed.
    parked: Option<Parked>,
}

impl Held {
    /// Held on a loss.
    pub(super) fn lost(&self) -> bool {
        self.parked.is_some()
    }
}

/// The requests of a collective held on a loss (a new generation began:
/// their slot is gone), and how they complete once thawed.
pub(super) struct Parked {
    arrivals: Vec<Arrival>,
    out: Outcome,
    generation: u32,
    /// Keeps config space at the old generation until they are delivered.
    batch: Outgoing,
}

/// A snapshot of a frozen job, asked for with `snapshot DIR`.
struct Snapshot {
    dir: String,
    /// `None` while the launcher saves; then its verdict.
    done: Option<Result<(), String>>,
}

/// The freeze state, under the state lock.
#[derive(Default)]
pub(super) struct Freeze {
    trigger: Option<Trigger>,
    on_error: bool,
    pub(super) held: Option<Held>,
    holds: u64,
}

impl Freeze {
    /// A collective is held: no deadline passes.
    pub(super) fn holding(&self) -> bool {
        self.held.is_some()
    }

    fn hold(&mut self, key: SlotKey, why: Why) {
        match why {
            Why::Trigger(_) => self.trigger = None,
            _ => self.on_error = false,
        }
        self.holds += 1;
        log::warn!(
            "freeze {}: {why}: collective {:?} held before any data moves",
            self.holds,
            key.short()
        );
        self.held = Some(Held {
            id: self.holds,
            key,
            why,
            since: Instant::now(),
            phase: Phase::Held,
            snapshot: None,
            parked: None,
        });
    }

    /// Whether freeze-on-error is armed and nothing is held.
    pub(super) fn on_error_armed(&self) -> bool {
        self.on_error && self.held.is_none()
    }

    /// Holds collective `key` of the remaining members `arrivals` after
    /// member `rank` (group rank) was lost: they complete with `out`, in
    /// `generation`, once thawed.
    pub(super) fn hold_lost(
        &mut self,
        key: SlotKey,
        rank: u32,
        arrivals: Vec<Arrival>,
        out: Outcome,
        generation: u32,
        batch: Outgoing,
    ) {
        self.hold(key, Why::PeerLost { rank });
        if let Some(h) = &mut self.held {
            h.parked = Some(Parked {
                arrivals,
                out,
                generation,
                batch,
            });
        }
    }

    /// Holds `key`, whose deadline passed with `missing` (group ranks)
    /// absent, if freeze-on-error is armed.
    pub(super) fn hold_timeout(&mut self, key: SlotKey, missing: Vec<u32>) {
        self.hold(key, Why::Timeout { missing });
    }

    /// Why the complete collective `key` must be held, if it must.
    fn reason(&self, key: SlotKey, w: &Waiting) -> Option<Why> {
        if self.held.is_some() {
            return None;
        }
        let SlotKey::Coll { comm, queue, seq } = key else {
            return None;
        };
        let arrivals: Vec<_> = w.arrivals.iter().flatten().collect();
        let reference = &arrivals.first()?.req;
        match self.trigger {
            Some(t @ Trigger::At { queue: q, seq: s })
                if comm == COMM_WORLD && (q, s) == (queue, seq) =>
            {
                return Some(Why::Trigger(t));
            }
            Some(t @ Trigger::Tag(tag)) if reference.header.tag.get() == tag => {
                return Some(Why::Trigger(t));
            }
            _ => {}
        }
        if !self.on_error {
            return None;
        }
        for a in &arrivals[1..] {
            let mask = mismatch_mask(reference, &a.req);
            if mask != 0 {
                return Some(Why::Mismatch { mask, peer: a.rank });
            }
        }
        let reduce = reference.dtype.zip(reference.op);
        if !wants_check(arrivals.iter().copied(), reduce) {
            return None;
        }
        // The scan before any data moves that freeze-on-error allows
        // (5.X.6.15): the inputs stay as the members offered them.
        for a in arrivals {
            // SAFETY: the arrival keeps its guest memory mapped, and this
            // collective has not started (its slot is complete but not run).
            let s = unsafe { summarise(&a.req) };
            if let Some(index) = s.and_then(|s| s.first_bad) {
                return Some(Why::NonFinite {
                    rank: a.rank,
                    index,
                });
            }
        }
        None
    }
}

impl Group {
    /// Holds the complete collective `w` of slot `key` if a trigger names
    /// it (then it stays filed and `None` is returned), else gives it back.
    pub(super) fn hold_if_frozen(
        &self,
        st: &mut State,
        key: SlotKey,
        w: Waiting,
    ) -> Option<Waiting> {
        if self.shared.cfg.remote.is_some() {
            return Some(w);
        }
        let Some(why) = st.freeze.reason(key, &w) else {
            return Some(w);
        };
        st.freeze.hold(key, why);
        st.slots.insert(key, Slot::Waiting(w));
        None
    }

    /// `freeze`: arms `trigger` (if any) and freeze-on-error (if
    /// `on_error`); with neither, disarms both.
    pub fn freeze(&self, trigger: Option<Trigger>, on_error: bool) -> Result<String, String> {
        if self.shared.cfg.remote.is_some() {
            return Err("freezing is not supported in a group across hosts (--mpi)".into());
        }
        let mut st = lock(&self.shared.state);
        let f = &mut st.freeze;
        if trigger.is_none() && !on_error {
            f.trigger = None;
            f.on_error = false;
            return Ok("disarmed\n".into());
        }
        if trigger.is_some() {
            f.trigger = trigger;
        }
        f.on_error |= on_error;
        let mut armed: Vec<String> = f.trigger.iter().map(|t| format!("at {t}")).collect();
        if f.on_error {
            armed.push("on error (MISMATCH, TIMEOUT, NONFINITE, PEER_LOST)".into());
        }
        Ok(format!("armed: freeze {}\n", armed.join(", and ")))
    }

    /// `thaw`: asks the launcher to resume the VMs (if it stopped them),
    /// or releases the held collective at once.
    pub fn thaw(&self) -> Result<String, String> {
        let mut st = lock(&self.shared.state);
        let Some(h) = &mut st.freeze.held else {
            return Err("nothing is frozen".into());
        };
        if h.phase == Phase::Frozen {
            h.phase = Phase::Thawing;
            return Ok(format!(
                "thawing freeze {}: the launcher resumes the VMs, then the collective runs\n",
                h.id
            ));
        }
        let id = h.id;
        self.release(st);
        Ok(format!("thawed freeze {id}\n"))
    }

    /// `stopped ID` (from the launcher): every VM is stopped.
    pub fn frozen_stopped(&self, id: u64) -> Result<String, String> {
        let mut st = lock(&self.shared.state);
        match &mut st.freeze.held {
            Some(h) if h.id == id && h.phase == Phase::Held => {
                h.phase = Phase::Frozen;
                Ok(format!("freeze {id}: frozen\n"))
            }
            _ => Err(format!("freeze {id} is not held (thawed already?)")),
        }
    }

    /// `snapshot DIR`: asks the launcher to save every VM of the frozen job
    /// (each with its member's part of the group, [`Group::member_state`])
    /// into DIR, an absolute path.
    pub fn snapshot(&self, dir: &str) -> Result<String, String> {
        if !dir.starts_with('/') {
            return Err(format!("DIR must be an absolute path, not {dir:?}"));
        }
        let mut st = lock(&self.shared.state);
        match &mut st.freeze.held {
            Some(h) if h.phase == Phase::Frozen => {
                if matches!(&h.snapshot, Some(s) if s.done.is_none()) {
                    return Err("a snapshot is being saved".into());
                }
                h.snapshot = Some(Snapshot {
                    dir: dir.to_owned(),
                    done: None,
                });
                Ok(format!(
                    "snapshot of freeze {} requested: the launcher saves every VM into {dir}\n",
                    h.id
                ))
            }
            Some(_) => Err(
                "the VMs are not stopped yet (or thawing): snapshot once the job \
                            is frozen"
                    .into(),
            ),
            None => Err("nothing is frozen: freeze the job first (dmlc-ctl freeze)".into()),
        }
    }

    /// `snapshotted ID ok` or `snapshotted ID error TEXT` (from the
    /// launcher): how the snapshot of freeze `id` ended.
    pub fn snapshotted(&self, id: u64, verdict: Result<(), String>) -> Result<String, String> {
        let mut st = lock(&self.shared.state);
        match &mut st.freeze.held {
            Some(Held {
                id: held,
                snapshot: Some(s),
                ..
            }) if *held == id && s.done.is_none() => {
                s.done = Some(verdict);
                Ok(format!("freeze {id}: snapshot recorded\n"))
            }
            _ => Err(format!("freeze {id} has no snapshot being saved")),
        }
    }

    /// `resumed ID` (from the launcher): every VM runs again; releases.
    pub fn frozen_resumed(&self, id: u64) -> Result<String, String> {
        let st = lock(&self.shared.state);
        match &st.freeze.held {
            Some(h) if h.id == id && h.phase == Phase::Thawing => {
                self.release(st);
                Ok(format!("freeze {id}: released\n"))
            }
            _ => Err(format!("freeze {id} is not thawing")),
        }
    }

    /// Ends the hold: every deadline moves on by the time held, then the
    /// held collective runs (or, held on its timeout, fails now).
    fn release(&self, mut st: MutexGuard<'_, State>) {
        let sh = &self.shared;
        let Some(h) = st.freeze.held.take() else {
            return;
        };
        let held_for = h.since.elapsed();
        let later = |t: Instant| t.checked_add(held_for).unwrap_or(t);
        for slot in st.slots.values_mut() {
            if let Slot::Waiting(w) = slot {
                w.deadline = later(w.deadline);
            }
        }
        st.p2p.postpone(held_for);
        st.timer_target = None;
        sh.timer_cv.notify_one();
        log::warn!(
            "freeze {}: released after {:.3} s ({})",
            h.id,
            held_for.as_secs_f64(),
            h.why
        );
        if let Some(p) = h.parked {
            // Held on a loss: the failure the loss would have made.
            drop(st);
            for a in &p.arrivals {
                sh.deliver_in(a, p.out, p.generation);
            }
            drop(p.batch);
            return;
        }
        match st.slots.remove(&h.key) {
            Some(Slot::Waiting(w)) if w.complete() => self.start_filled(st, h.key, w),
            Some(Slot::Waiting(mut w)) => {
                // Held on its timeout: it fails now.
                w.deadline = Instant::now();
                st.slots.insert(h.key, Slot::Waiting(w));
            }
            Some(other) => {
                st.slots.insert(h.key, other);
            }
            // A loss failed it while it was held.
            None => {}
        }
    }

    /// The freeze state, for `frozen` and `state`.
    pub fn freeze_json(&self) -> serde_json::Value {
        let st = lock(&self.shared.state);
        freeze_json(&st)
    }

    /// `inspect`: the held collective, member by member: its header, a
    /// summary of its input, and when it arrived.
    pub fn inspect(&self) -> Result<serde_json::Value, String> {
        let st = lock(&self.shared.state);
        let Some(h) = &st.freeze.held else {
            return Err("nothing is frozen: arm a trigger with `freeze` first".into());
        };
        // By group rank: each member's request, if it arrived.
        let entries: Vec<(u32, Option<&Arrival>)> = match (&h.parked, st.slots.get(&h.key)) {
            (Some(p), _) => {
                let mut e: Vec<_> = p.arrivals.iter().map(|a| (a.rank, Some(a))).collect();
                if let Why::PeerLost { rank } = h.why {
                    e.push((rank, None));
                }
                e.sort_by_key(|x| x.0);
                e
            }
            (None, Some(Slot::Waiting(w))) => w
                .arrivals
                .iter()
                .enumerate()
                .map(|(r, a)| (w.world_rank(r), a.as_ref()))
                .collect(),
            _ => {
                return Err(format!(
                    "freeze {}: its collective failed meanwhile (a member was lost)",
                    h.id
                ))
            }
        };
        let arrived: Vec<&Arrival> = entries.iter().filter_map(|e| e.1).collect();
        let counted = |a: &&Arrival| a.at + a.delay;
        let first = arrived.iter().map(counted).min();
        let last = arrived.iter().map(counted).max();
        let mut members = Vec::new();
        for &(rank, a) in &entries {
            let Some(a) = a else {
                let lost = matches!(h.why, Why::PeerLost { rank: r } if r == rank);
                members.push(serde_json::json!({ "rank": rank, "arrived": false, "lost": lost }));
                continue;
            };
            let hd = &a.req.header;
            // SAFETY: the arrival keeps its guest memory mapped, and the
            // held collective moves no data while the state lock is held
            // (it is released only under it).
            let input = unsafe { summarise(&a.req) };
            let lag = first.map_or(Duration::ZERO, |f| counted(&a).saturating_duration_since(f));
            members.push(serde_json::json!({
                "rank": a.rank,
                "arrived": true,
                "arrived_ms_after_first": lag.as_secs_f64() * 1e3,
                "last": arrived.len() > 1 && Some(counted(&a)) == last,
                "header": {
                    "opcode": a.req.code.name(),
                    "dtype": a.req.dtype.map(|d| d.name()),
                    "op": a.req.op.map(|o| o.name()),
                    "count": a.req.count,
                    "root": a.req.root,
                    "tag": hd.tag.get(),
                    "flags": hd.flags.get(),
                    "timeout_ms": hd.timeout_ms.get(),
                    "comm": a.req.comm_id(),
                    "in_place": a.req.in_place_offset.is_some(),
                },
                "input": input.map(|s| s.json()),
            }));
        }
        let mut j = held_json(h);
        j["members"] = serde_json::Value::Array(members);
        Ok(j)
    }
}

fn held_json(h: &Held) -> serde_json::Value {
    let (queue, seq) = h.key.short();
    let snapshot = h.snapshot.as_ref().map(|s| {
        serde_json::json!({
            "dir": s.dir,
            "state": match &s.done {
                None => "saving",
                Some(Ok(())) => "done",
                Some(Err(_)) => "failed",
            },
            "error": s.done.as_ref().and_then(|d| d.as_ref().err()),
        })
    });
    serde_json::json!({
        "snapshot": snapshot,
        "id": h.id,
        "phase": h.phase.name(),
        "reason": h.why.to_string(),
        "comm": h.key.comm(),
        "queue": queue,
        "seq": seq,
        "held_ms": h.since.elapsed().as_secs_f64() * 1e3,
    })
}

pub(super) fn freeze_json(st: &State) -> serde_json::Value {
    let f = &st.freeze;
    serde_json::json!({
        "armed": f.trigger.map(|t| t.to_string()),
        "on_error": f.on_error,
        "held": f.held.as_ref().map(held_json),
    })
}
