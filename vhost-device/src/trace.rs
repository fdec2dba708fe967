//! The flight recorder: a bounded ring of the last collectives, and its
//! dump as Chrome trace JSON (the format Perfetto's and chrome://tracing's
//! JSON importers read).
//!
//! The group engine pushes one [`Record`] per collective once every member's
//! completion is made (or dropped): its queue, sequence number, opcode,
//! dtype, op, count and bytes, each member's arrival (and the delay
//! injected before it counted), the data movement's start and end, the
//! modelled completion time, each member's completion and status, and what
//! was injected. Without `--trace-out` there is no recorder and the engine
//! takes no timestamps for it.
//!
//! The dump ([`Recorder::chrome_json`]): one process per member (`pid` =
//! rank + 1, named "rank R") whose slices are that member's collectives,
//! from its effective arrival to its completion, after an "injected delay"
//! slice where one was injected; and one process for the device (`pid`
//! 0) with the data movement and the modelled time of each collective.
//! Slices that overlap in time (requests in flight on several queues, or
//! pipelined on one) go to separate threads of their process, so that
//! every thread's slices nest, as the importers require. Times are in
//! microseconds from the daemon's start.

use std::collections::VecDeque;
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};
use virtio_dmlc::{Dtype, ReduceOp, Status, NO_PEER};

use crate::chain::Code;

/// Records kept when `--trace-capacity` is not given.
pub const DEFAULT_CAPACITY: usize = 65536;

/// One member's part in a collective.
#[derive(Clone, Debug)]
pub struct MemberRecord {
    pub rank: u32,
    /// When its request was taken from the ring (None: it never arrived).
    pub arrived: Option<Instant>,
    /// Delay injected before its arrival counted.
    pub delay: Duration,
    /// When its completion was made (None: dropped, withheld, or never
    /// arrived).
    pub completed: Option<Instant>,
    /// With a timing model: its modelled completion (members may differ,
    /// [`crate::timing::Model::rank_time`]).
    pub modelled: Option<Instant>,
    /// Its completion was withheld on purpose (never made).
    pub withheld: bool,
    pub status: Status,
}

/// One collective.
#[derive(Clone, Debug)]
pub struct Record {
    pub queue: u16,
    pub seq: u64,
    /// The generation its responses carried.
    pub generation: u32,
    /// The communicator (0: the group; spec 5.X.6.13).
    pub comm: u32,
    pub opcode: Code,
    pub dtype: Option<Dtype>,
    pub op: Option<ReduceOp>,
    pub count: u64,
    /// Bytes per member block (`count` times the element size).
    pub bytes: u64,
    /// By rank.
    pub members: Vec<MemberRecord>,
    /// Start and end of the data movement.
    pub moved: Option<(Instant, Instant)>,
    /// Modelled start and completion.
    pub modelled: Option<(Instant, Instant)>,
    /// The data movement ended after the modelled completion.
    pub late: bool,
    pub peer: u32,
    /// What the daemon injected into it (empty: nothing).
    pub injected: Vec<String>,
}

/// The ring of records.
#[derive(Debug)]
pub struct Recorder {
    start: Instant,
    start_wall: SystemTime,
    capacity: usize,
    ring: Mutex<VecDeque<Record>>,
    /// Records pushed out of the ring by newer ones.
    overwritten: AtomicU64,
}

impl Recorder {
    /// A recorder that keeps the last `capacity` records (at least 1).
    pub fn new(capacity: usize) -> Recorder {
        Recorder {
            start: Instant::now(),
            start_wall: SystemTime::now(),
            capacity: capacity.max(1),
            ring: Mutex::new(VecDeque::new()),
            overwritten: AtomicU64::new(0),
        }
    }

    /// Keeps `r`, dropping the oldest record if the ring is full.
    pub fn push(&self, r: Record) {
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        if ring.len() == self.capacity {
            ring.pop_front();
            self.overwritten.fetch_add(1, Ordering::Relaxed);
        }
        ring.push_back(r);
    }

    /// Records kept now.
    pub fn len(&self) -> usize {
        self.ring.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// True if no record is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A copy of the records, oldest first.
    pub fn records(&self) -> Vec<Record> {
        let ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        ring.iter().cloned().collect()
    }

    fn us(&self, t: Instant) -> f64 {
        t.saturating_duration_since(self.start).as_nanos() as f64 / 1000.0
    }

    /// The records as a Chrome trace (see the module documentation).
    pub fn chrome_json(&self, world: u32) -> Value {
        let records = self.records();
        let mut lanes = Lanes::default();
        for r in &records {
            let name = r.opcode.to_string();
            let mut args = json!({
                "queue": r.queue,
                "seq": r.seq,
                "generation": r.generation,
                "comm": r.comm,
                "opcode": name,
                "dtype": r.dtype.map(|d| d.to_string()),
                "op": r.op.map(|o| o.to_string()),
                "count": r.count,
                "bytes": r.bytes,
                "late": r.late,
                "injected": r.injected,
            });
            if r.peer != NO_PEER {
                args["peer"] = json!(r.peer);
            }
            if let Some((from, to)) = r.modelled {
                args["modelled_us"] = json!(self.us(to) - self.us(from));
                args["modelled_end_us"] = json!(self.us(to));
            }
            for m in &r.members {
                let Some(arrived) = m.arrived else { continue };
                let counted = arrived + m.delay;
                let end = m.completed.or(m.modelled).unwrap_or(counted).max(counted);
                let pid = m.rank + 1;
                let mut margs = args.clone();
                margs["rank"] = json!(m.rank);
                margs["status"] = json!(m.status.to_string());
                margs["completed"] = json!(m.completed.is_some());
                margs["arrived_us"] = json!(self.us(arrived));
                margs["injected_delay_us"] = json!(m.delay.as_nanos() as f64 / 1000.0);
                if let Some(done) = m.completed {
                    margs["completed_us"] = json!(self.us(done));
                }
                if let Some(due) = m.modelled {
                    margs["modelled_completion_us"] = json!(self.us(due));
                }
                if m.withheld {
                    margs["withheld"] = json!(true);
                }
                let mut events = Vec::new();
                if !m.delay.is_zero() {
                    events.push(self.slice(
                        "injected delay",
                        "injected",
                        arrived,
                        counted,
                        json!({"injected": true, "rank": m.rank, "seq": r.seq, "queue": r.queue}),
                    ));
                }
                events.push(self.slice(&name, "collective", counted, end, margs));
                lanes.place(pid, 0, self.us(arrived), self.us(end), events);
            }
            if let Some((from, to)) = r.moved {
                let ev = self.slice(&name, "data movement", from, to, args.clone());
                lanes.place(0, 0, self.us(from), self.us(to), vec![ev]);
            }
            if let Some((from, to)) = r.modelled {
                let ev = self.slice(&format!("modelled {name}"), "model", from, to, args);
                lanes.place(0, 1, self.us(from), self.us(to), vec![ev]);
            }
        }
        lanes.assign();
        let mut events = Vec::new();
        let meta = |pid: u32, tid: u32, what: &str, name: String| json!({"ph": "M", "pid": pid, "tid": tid, "name": what, "args": {"name": name}});
        events.push(meta(0, 0, "process_name", "device".into()));
        events.push(
            json!({"ph": "M", "pid": 0, "tid": 0, "name": "process_sort_index",
                           "args": {"sort_index": 0}}),
        );
        for rank in 0..world {
            events.push(meta(rank + 1, 0, "process_name", format!("rank {rank}")));
            events.push(json!({"ph": "M", "pid": rank + 1, "tid": 0,
                               "name": "process_sort_index", "args": {"sort_index": rank + 1}}));
        }
        for (pid, group, lane) in lanes.used() {
            let base = match (pid, group) {
                (0, 0) => "data movement",
                (0, _) => "modelled",
                _ => "collectives",
            };
            let name = if lane == 0 {
                base.to_owned()
            } else {
                format!("{base} (overlap {lane})")
            };
            events.push(meta(pid, Lanes::tid(group, lane), "thread_name", name));
        }
        events.extend(lanes.events);
        let since_epoch = self
            .start_wall
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        json!({
            "traceEvents": events,
            "displayTimeUnit": "ns",
            "otherData": {
                "source": "vhost-device-dmlc flight recorder",
                "start_unix_us": since_epoch,
                "world_size": world,
                "records": records.len(),
                "overwritten": self.overwritten.load(Ordering::Relaxed),
            },
        })
    }

    /// A text summary per window of `window` (by each collective's last
    /// arrival): how many collectives, and the slowest member: the one that
    /// arrived last most often, how often, its mean lateness behind the
    /// first arrival, and how much of that was injected.
    pub fn summary(&self, window: Duration) -> String {
        use std::fmt::Write as _;
        let window = window.max(Duration::from_micros(1));
        // Window -> rank -> (times last, lateness sum, injected sum), count.
        let mut windows: std::collections::BTreeMap<u128, (usize, BTreeMapRanks)> =
            std::collections::BTreeMap::new();
        for r in self.records() {
            let counted: Vec<(u32, Instant, Duration)> = r
                .members
                .iter()
                .filter_map(|m| m.arrived.map(|a| (m.rank, a + m.delay, m.delay)))
                .collect();
            let (Some(first), Some(&(rank, last, delay))) = (
                counted.iter().map(|c| c.1).min(),
                counted.iter().max_by_key(|c| c.1),
            ) else {
                continue;
            };
            if counted.len() < 2 {
                continue;
            }
            let w = last.saturating_duration_since(self.start).as_nanos() / window.as_nanos();
            let (n, ranks) = windows.entry(w).or_default();
            *n += 1;
            let e = ranks.entry(rank).or_default();
            e.0 += 1;
            e.1 += last - first;
            e.2 += delay;
        }
        let mut out = format!(
            "# {:>10} {:>11} {:>8} {:>10} {:>14} {:>14}\n",
            "window(s)", "collectives", "slowest", "times last", "lateness(us)", "injected(us)"
        );
        for (w, (n, ranks)) in windows {
            let Some((rank, (times, late, injected))) =
                ranks.into_iter().max_by_key(|(_, v)| (v.0, v.1))
            else {
                continue;
            };
            let start = (w * window.as_nanos()) as f64 / 1e9;
            let _ = writeln!(
                out,
                "  {start:>10.3} {n:>11} {:>8} {times:>10} {:>14.1} {:>14.1}",
                format!("rank {rank}"),
                late.as_nanos() as f64 / 1000.0 / times as f64,
                injected.as_nanos() as f64 / 1000.0 / times as f64,
            );
        }
        out
    }

    fn slice(&self, name: &str, cat: &str, from: Instant, to: Instant, args: Value) -> Value {
        let ts = self.us(from);
        json!({
            "ph": "X",
            "name": name,
            "cat": cat,
            "ts": ts,
            "dur": (self.us(to) - ts).max(0.0),
            "pid": 0,
            "tid": 0,
            "args": args,
        })
    }

    /// Writes [`Recorder::chrome_json`] to `path` (through a temporary file
    /// renamed over it, so a reader never sees half a trace).
    pub fn write_chrome(&self, path: &Path, world: u32) -> std::io::Result<()> {
        let json = self.chrome_json(world);
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = std::path::PathBuf::from(tmp);
        {
            let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
            serde_json::to_writer(&mut f, &json)?;
            f.write_all(b"\n")?;
            f.flush()?;
        }
        std::fs::rename(&tmp, path)
    }
}

/// Per rank: times it arrived last, lateness and injected delay summed.
type BTreeMapRanks = std::collections::BTreeMap<u32, (usize, Duration, Duration)>;

/// Assigns slices to threads so that those of one thread never overlap.
#[derive(Default)]
struct Lanes {
    /// (pid, group) -> end time of each lane's last slice.
    ends: std::collections::BTreeMap<(u32, u32), Vec<f64>>,
    pending: Vec<(u32, u32, f64, f64, Vec<Value>)>,
    events: Vec<Value>,
}

impl Lanes {
    fn tid(group: u32, lane: u32) -> u32 {
        group * 1000 + lane
    }

    /// Queues `events` (slices within `from..to`, laid end to end) for
    /// (pid, group).
    fn place(&mut self, pid: u32, group: u32, from: f64, to: f64, events: Vec<Value>) {
        self.pending.push((pid, group, from, to, events));
    }

    /// Puts every queued set of slices, earliest first, on the first lane
    /// of its (pid, group) free at its start.
    fn assign(&mut self) {
        let mut pending = std::mem::take(&mut self.pending);
        pending.sort_by(|a, b| a.2.total_cmp(&b.2));
        for (pid, group, from, to, events) in pending {
            self.assign_one(pid, group, from, to, events);
        }
    }

    fn assign_one(&mut self, pid: u32, group: u32, from: f64, to: f64, events: Vec<Value>) {
        let lanes = self.ends.entry((pid, group)).or_default();
        let lane = match lanes.iter().position(|&end| end <= from) {
            Some(i) => {
                lanes[i] = to;
                i
            }
            None => {
                lanes.push(to);
                lanes.len() - 1
            }
        };
        let tid = Self::tid(group, lane as u32);
        for mut e in events {
            e["pid"] = json!(pid);
            e["tid"] = json!(tid);
            self.events.push(e);
        }
    }

    fn used(&self) -> Vec<(u32, u32, u32)> {
        self.ends
            .iter()
            .flat_map(|(&(pid, group), lanes)| {
                (0..lanes.len() as u32).map(move |l| (pid, group, l))
            })
            .collect()
    }
}
