//! Counters of the group engine and their Prometheus text form.
//!
//! Every counter is an atomic incremented at the point where its event
//! happens (in [`crate::chain`] and [`crate::group`]); [`Metrics::render`]
//! reads them without stopping the data path. Each metric is described by
//! its `# HELP` line in the rendered text.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use virtio_dmlc::comm::CommOpcode;
use virtio_dmlc::{Opcode, Status};

use crate::chain::Code;

/// Upper bounds (seconds) of the straggler skew histogram buckets.
pub const SKEW_BUCKETS: [f64; 16] = [
    1e-6, 5e-6, 10e-6, 50e-6, 100e-6, 500e-6, 1e-3, 5e-3, 10e-3, 50e-3, 0.1, 0.5, 1.0, 5.0, 10.0,
    60.0,
];

/// The opcodes of 5.X.6.1 (0 to 6) and of feature bits 1 to 3 (7 to 17).
const OPCODES: usize = Opcode::ALL.len() + CommOpcode::ALL.len();
const STATUSES: usize = Status::ALL.len();

/// Every opcode the counters know, by wire value.
fn codes() -> impl Iterator<Item = Code> {
    Opcode::ALL
        .iter()
        .map(|&o| Code::Base(o))
        .chain(CommOpcode::ALL.iter().map(|&o| Code::Comm(o)))
}

/// Counters of one group.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Requests taken from the rings, per opcode (only those whose header
    /// could be read and whose opcode is known).
    requests: [AtomicU64; OPCODES],
    /// Collectives completed with status OK, per opcode.
    collectives: [AtomicU64; OPCODES],
    /// Bytes of reduction result produced (one copy, not per member).
    reduced_bytes: AtomicU64,
    /// Bytes copied by broadcast and allgather (counted once per source).
    copied_bytes: AtomicU64,
    /// Collectives big enough to be split over the reduction threads.
    split_collectives: AtomicU64,
    /// Requests completed with a status other than OK, per status.
    errors: [AtomicU64; STATUSES],
    /// Chains returned with written length 0 (no response descriptor).
    no_status: AtomicU64,
    /// Requests dropped because their member was lost or not active.
    dropped: AtomicU64,
    /// Straggler skew (from effective arrivals: injected delays count).
    skew: Histogram,
    /// Per member of communicator 0, by rank: how often it arrived last
    /// at a collective, and its summed time behind the first arrival.
    members: Box<[MemberArrivals]>,
    /// Modelled collectives: how much later than the modelled time their
    /// completions were made.
    model_error: Histogram,
    /// Modelled collectives whose data movement ended after their modelled
    /// completion time (the host was too slow to honour the model).
    model_late: AtomicU64,
    /// Arrivals held back by an injected delay, and the delays' sum.
    injected_delays: AtomicU64,
    injected_delay_ns: AtomicU64,
    /// Requests completed with an injected failure, per status.
    injected_errors: [AtomicU64; STATUSES],
    /// Collectives slowed by an injected bandwidth factor.
    injected_bandwidth: AtomicU64,
    /// Completions withheld on purpose (never made).
    injected_withheld: AtomicU64,
    generation: AtomicU64,
    members_connected: AtomicU64,
    /// Valid requests the engine holds (waiting for their collective, or in
    /// one that runs); shared with every [`Held`] token.
    pending: Arc<AtomicU64>,
    /// Queues stopped because their driver had more requests in flight
    /// than the queue size.
    queue_overruns: AtomicU64,
}

/// A histogram over [`SKEW_BUCKETS`]: non-cumulative bucket counts, then
/// the overflow bucket.
#[derive(Debug, Default)]
struct Histogram {
    buckets: [AtomicU64; SKEW_BUCKETS.len() + 1],
    sum_ns: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let bucket = SKEW_BUCKETS
            .iter()
            .position(|&le| secs <= le)
            .unwrap_or(SKEW_BUCKETS.len());
        self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        header(out, name, help, "histogram");
        let mut cumulative = 0u64;
        for (i, le) in SKEW_BUCKETS.iter().enumerate() {
            cumulative += load(&self.buckets[i]);
            let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {cumulative}");
        }
        cumulative += load(&self.buckets[SKEW_BUCKETS.len()]);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {cumulative}");
        let sum = load(&self.sum_ns) as f64 / 1e9;
        let _ = writeln!(out, "{name}_sum {sum}");
        let _ = writeln!(out, "{name}_count {}", load(&self.count));
    }
}

/// One member's arrival counters (see [`Metrics::arrival`]).
#[derive(Debug, Default)]
struct MemberArrivals {
    last: AtomicU64,
    lag_ns: AtomicU64,
}

/// One request counted in `dmlc_requests_pending` until it is dropped.
#[derive(Debug)]
pub struct Held(Arc<AtomicU64>);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Metrics {
    /// A set of counters, all zero, for a group of `world` members.
    pub fn new(world: u32) -> Self {
        Self {
            members: (0..world).map(|_| MemberArrivals::default()).collect(),
            ..Self::default()
        }
    }

    /// A valid-looking request of `opcode` was taken from a ring.
    pub fn request(&self, opcode: impl Into<Code>) {
        self.requests[usize::from(opcode.into().raw())].fetch_add(1, Ordering::Relaxed);
    }

    /// A collective of `opcode` completed with status OK.
    pub fn collective_done(&self, opcode: impl Into<Code>) {
        self.collectives[usize::from(opcode.into().raw())].fetch_add(1, Ordering::Relaxed);
    }

    /// `bytes` of reduction result were produced.
    pub fn reduced(&self, bytes: u64) {
        self.reduced_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// `bytes` were copied from a source buffer to its destinations.
    pub fn copied(&self, bytes: u64) {
        self.copied_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// A collective was split over the reduction threads.
    pub fn split(&self) {
        self.split_collectives.fetch_add(1, Ordering::Relaxed);
    }

    /// A request was completed with `status` (not OK).
    pub fn error(&self, status: Status) {
        self.errors[status.raw() as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// A chain without a usable response descriptor was returned with length 0.
    pub fn no_status(&self) {
        self.no_status.fetch_add(1, Ordering::Relaxed);
    }

    /// A request of a lost or inactive member was dropped.
    pub fn dropped(&self) {
        self.dropped.fetch_add(1, Ordering::Relaxed);
    }

    /// Time from a collective's first arrival to its last.
    pub fn skew(&self, skew: Duration) {
        self.skew.observe(skew);
    }

    /// Member `rank` arrived at a collective `lag` after its first member,
    /// and was its last if `last` (per-rank straggler counters).
    pub fn arrival(&self, rank: u32, lag: Duration, last: bool) {
        let Some(m) = self.members.get(rank as usize) else {
            return;
        };
        let ns = u64::try_from(lag.as_nanos()).unwrap_or(u64::MAX);
        m.lag_ns.fetch_add(ns, Ordering::Relaxed);
        if last {
            m.last.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A modelled collective's completions were made `error` after its
    /// modelled completion time.
    pub fn model_error(&self, error: Duration) {
        self.model_error.observe(error);
    }

    /// A modelled collective's data movement ended after its modelled
    /// completion time.
    pub fn model_late(&self) {
        self.model_late.fetch_add(1, Ordering::Relaxed);
    }

    /// An arrival was held back by an injected delay.
    pub fn injected_delay(&self, delay: Duration) {
        self.injected_delays.fetch_add(1, Ordering::Relaxed);
        let ns = u64::try_from(delay.as_nanos()).unwrap_or(u64::MAX);
        self.injected_delay_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// A request was completed with an injected failure `status` (counted
    /// in `dmlc_errors_total` as well).
    pub fn injected_error(&self, status: Status) {
        self.injected_errors[status.raw() as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// A collective's modelled time was computed with an injected
    /// bandwidth factor.
    pub fn injected_bandwidth(&self) {
        self.injected_bandwidth.fetch_add(1, Ordering::Relaxed);
    }

    /// A member's completion was withheld on purpose.
    pub fn injected_withheld(&self) {
        self.injected_withheld.fetch_add(1, Ordering::Relaxed);
    }

    /// Collectives slowed by an injected bandwidth factor.
    pub fn injected_bandwidth_count(&self) -> u64 {
        self.injected_bandwidth.load(Ordering::Relaxed)
    }

    /// Completions withheld on purpose.
    pub fn injected_withheld_count(&self) -> u64 {
        self.injected_withheld.load(Ordering::Relaxed)
    }

    /// Modelled collectives whose data movement outlasted the model.
    pub fn model_late_count(&self) -> u64 {
        self.model_late.load(Ordering::Relaxed)
    }

    /// Requests completed with an injected failure `status`.
    pub fn injected_errors(&self, status: Status) -> u64 {
        self.injected_errors[status.raw() as usize].load(Ordering::Relaxed)
    }

    /// Arrivals held back by an injected delay.
    pub fn injected_delays(&self) -> u64 {
        self.injected_delays.load(Ordering::Relaxed)
    }

    /// The group's generation is now `generation`.
    pub fn set_generation(&self, generation: u32) {
        self.generation
            .store(u64::from(generation), Ordering::Relaxed);
    }

    /// `members` members are connected.
    pub fn set_members_connected(&self, members: u32) {
        self.members_connected
            .store(u64::from(members), Ordering::Relaxed);
    }

    /// A valid request entered the engine; it counts as pending until the
    /// returned token is dropped.
    pub fn hold(&self) -> Held {
        self.pending.fetch_add(1, Ordering::Relaxed);
        Held(self.pending.clone())
    }

    /// A queue was stopped: its driver had more requests in flight than
    /// the queue size.
    pub fn queue_overrun(&self) {
        self.queue_overruns.fetch_add(1, Ordering::Relaxed);
    }

    /// Valid requests the engine holds now.
    pub fn pending(&self) -> u64 {
        self.pending.load(Ordering::Relaxed)
    }

    /// Queues stopped for having more requests in flight than their size.
    pub fn queue_overruns(&self) -> u64 {
        self.queue_overruns.load(Ordering::Relaxed)
    }

    /// Collectives completed with status OK for `opcode`.
    pub fn collectives_completed(&self, opcode: Opcode) -> u64 {
        self.collectives[usize::from(opcode.raw())].load(Ordering::Relaxed)
    }

    /// Requests completed with `status`.
    pub fn errors(&self, status: Status) -> u64 {
        self.errors[status.raw() as usize].load(Ordering::Relaxed)
    }

    /// Chains returned without a status.
    pub fn no_status_count(&self) -> u64 {
        self.no_status.load(Ordering::Relaxed)
    }

    /// Pending or arriving requests dropped because their member was lost
    /// or not active.
    pub fn dropped_count(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Collectives split over the reduction threads.
    pub fn split_count(&self) -> u64 {
        self.split_collectives.load(Ordering::Relaxed)
    }

    /// Number of skew observations.
    pub fn skew_count(&self) -> u64 {
        self.skew.count.load(Ordering::Relaxed)
    }

    /// Prometheus text exposition of every counter.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(4096);
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);

        header(
            &mut out,
            "dmlc_requests_total",
            "Requests taken from the virtqueues, by opcode.",
            "counter",
        );
        for op in codes() {
            let v = load(&self.requests[usize::from(op.raw())]);
            let _ = writeln!(out, "dmlc_requests_total{{opcode=\"{op}\"}} {v}");
        }

        header(
            &mut out,
            "dmlc_collectives_total",
            "Collectives completed with status ok, by opcode.",
            "counter",
        );
        for op in codes() {
            let v = load(&self.collectives[usize::from(op.raw())]);
            let _ = writeln!(out, "dmlc_collectives_total{{opcode=\"{op}\"}} {v}");
        }

        simple(
            &mut out,
            "dmlc_reduced_bytes_total",
            "Bytes of reduction result produced (once per collective, not per member).",
            "counter",
            load(&self.reduced_bytes),
        );
        simple(
            &mut out,
            "dmlc_copied_bytes_total",
            "Bytes copied by broadcast and allgather (once per source buffer).",
            "counter",
            load(&self.copied_bytes),
        );
        simple(
            &mut out,
            "dmlc_split_collectives_total",
            "Collectives split over the reduction threads.",
            "counter",
            load(&self.split_collectives),
        );

        header(
            &mut out,
            "dmlc_errors_total",
            "Requests completed with a status other than ok, by status.",
            "counter",
        );
        for st in Status::ALL.iter().filter(|s| **s != Status::Ok) {
            let v = load(&self.errors[st.raw() as usize]);
            let _ = writeln!(out, "dmlc_errors_total{{status=\"{st}\"}} {v}");
        }

        simple(
            &mut out,
            "dmlc_malformed_no_status_total",
            "Chains returned with written length 0 because no response descriptor was found.",
            "counter",
            load(&self.no_status),
        );
        simple(
            &mut out,
            "dmlc_dropped_requests_total",
            "Requests dropped without completion because their member was lost or not active.",
            "counter",
            load(&self.dropped),
        );

        self.skew.render(
            &mut out,
            "dmlc_straggler_skew_seconds",
            "Time from the first member's arrival to the last member's arrival, per collective \
             (an injected delay counts as part of its member's arrival).",
        );
        header(
            &mut out,
            "dmlc_member_last_arrivals_total",
            "Collectives at which this member arrived last (of those with more than one member), \
             by rank in communicator 0.",
            "counter",
        );
        for (rank, m) in self.members.iter().enumerate() {
            let v = load(&m.last);
            let _ = writeln!(
                out,
                "dmlc_member_last_arrivals_total{{rank=\"{rank}\"}} {v}"
            );
        }
        header(
            &mut out,
            "dmlc_member_arrival_lag_seconds_total",
            "Summed time from each collective's first arrival to this member's arrival, by rank \
             in communicator 0 (an injected delay counts as part of its member's arrival).",
            "counter",
        );
        for (rank, m) in self.members.iter().enumerate() {
            let v = load(&m.lag_ns) as f64 / 1e9;
            let _ = writeln!(
                out,
                "dmlc_member_arrival_lag_seconds_total{{rank=\"{rank}\"}} {v}"
            );
        }
        self.model_error.render(
            &mut out,
            "dmlc_model_error_seconds",
            "With a timing model: time from a collective's modelled completion to its completions \
             being made.",
        );
        simple(
            &mut out,
            "dmlc_model_late_total",
            "With a timing model: collectives whose data movement ended after their modelled \
             completion time (the host was too slow to honour the model).",
            "counter",
            load(&self.model_late),
        );
        simple(
            &mut out,
            "dmlc_injected_delays_total",
            "Arrivals held back by an injected delay (--timing), not a real straggler.",
            "counter",
            load(&self.injected_delays),
        );
        let _ = writeln!(
            out,
            "# HELP dmlc_injected_delay_seconds_total Sum of the injected delays.\n\
             # TYPE dmlc_injected_delay_seconds_total counter\n\
             dmlc_injected_delay_seconds_total {}",
            load(&self.injected_delay_ns) as f64 / 1e9
        );
        header(
            &mut out,
            "dmlc_injected_errors_total",
            "Requests completed with an injected failure (--timing), by status; also counted in \
             dmlc_errors_total.",
            "counter",
        );
        for st in [Status::PeerLost, Status::Timeout, Status::Reset] {
            let v = load(&self.injected_errors[st.raw() as usize]);
            let _ = writeln!(out, "dmlc_injected_errors_total{{status=\"{st}\"}} {v}");
        }
        simple(
            &mut out,
            "dmlc_injected_bandwidth_total",
            "Collectives whose modelled time used an injected bandwidth factor (--timing \
             [[bandwidth]]), not a real slow link.",
            "counter",
            load(&self.injected_bandwidth),
        );
        simple(
            &mut out,
            "dmlc_injected_withheld_total",
            "Completions withheld on purpose (--timing [[fail]] status = \"withheld\"): never \
             made, so that member's driver waits until its own bound.",
            "counter",
            load(&self.injected_withheld),
        );

        simple(
            &mut out,
            "dmlc_generation",
            "Current generation of the group.",
            "gauge",
            load(&self.generation),
        );
        simple(
            &mut out,
            "dmlc_members_connected",
            "Members whose queues are ready.",
            "gauge",
            load(&self.members_connected),
        );
        simple(
            &mut out,
            "dmlc_requests_pending",
            "Valid requests held by the engine: waiting for their collective, or in one that runs.",
            "gauge",
            load(&self.pending),
        );
        simple(
            &mut out,
            "dmlc_queue_overruns_total",
            "Queues stopped until device reset because their driver had more requests in flight than the queue size.",
            "counter",
            load(&self.queue_overruns),
        );
        out
    }
}

fn header(out: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

fn simple(out: &mut String, name: &str, help: &str, kind: &str, value: u64) {
    header(out, name, help, kind);
    let _ = writeln!(out, "{name} {value}");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(text: &str, series: &str) -> String {
        text.lines()
            .find_map(|l| l.strip_prefix(series).and_then(|r| r.strip_prefix(' ')))
            .unwrap_or_else(|| panic!("{series} missing in\n{text}"))
            .to_string()
    }

    #[test]
    fn render_counts_events() {
        let m = Metrics::new(3);
        m.request(Opcode::Allreduce);
        m.collective_done(Opcode::Allreduce);
        m.collective_done(Opcode::Allreduce);
        m.collective_done(Opcode::Barrier);
        m.reduced(4096);
        m.error(Status::Mismatch);
        m.no_status();
        m.set_generation(3);
        m.set_members_connected(2);
        let held = [m.hold(), m.hold()];
        m.queue_overrun();
        let t = m.render();
        assert_eq!(value(&t, "dmlc_requests_pending"), "2");
        assert_eq!(value(&t, "dmlc_queue_overruns_total"), "1");
        drop(held);
        assert_eq!(m.pending(), 0);
        assert_eq!(value(&t, "dmlc_requests_total{opcode=\"allreduce\"}"), "1");
        assert_eq!(
            value(&t, "dmlc_collectives_total{opcode=\"allreduce\"}"),
            "2"
        );
        assert_eq!(value(&t, "dmlc_collectives_total{opcode=\"barrier\"}"), "1");
        assert_eq!(
            value(&t, "dmlc_collectives_total{opcode=\"broadcast\"}"),
            "0"
        );
        assert_eq!(value(&t, "dmlc_reduced_bytes_total"), "4096");
        assert_eq!(value(&t, "dmlc_errors_total{status=\"mismatch\"}"), "1");
        assert_eq!(value(&t, "dmlc_errors_total{status=\"timeout\"}"), "0");
        assert!(!t.contains("status=\"ok\""));
        assert_eq!(value(&t, "dmlc_malformed_no_status_total"), "1");
        assert_eq!(value(&t, "dmlc_generation"), "3");
        assert_eq!(value(&t, "dmlc_members_connected"), "2");
        // Every metric family has HELP and TYPE lines.
        for name in ["dmlc_requests_total", "dmlc_straggler_skew_seconds"] {
            assert!(t.contains(&format!("# HELP {name} ")));
            assert!(t.contains(&format!("# TYPE {name} ")));
        }
    }

    #[test]
    fn per_member_arrivals_count_the_last_and_sum_the_lag() {
        let m = Metrics::new(3);
        // Rank 2 last twice, rank 0 once; a rank beyond the group is ignored.
        m.arrival(0, Duration::ZERO, false);
        m.arrival(2, Duration::from_millis(3), true);
        m.arrival(2, Duration::from_millis(1), true);
        m.arrival(0, Duration::from_millis(5), true);
        m.arrival(7, Duration::from_secs(1), true);
        let t = m.render();
        assert_eq!(
            value(&t, "dmlc_member_last_arrivals_total{rank=\"0\"}"),
            "1"
        );
        assert_eq!(
            value(&t, "dmlc_member_last_arrivals_total{rank=\"1\"}"),
            "0"
        );
        assert_eq!(
            value(&t, "dmlc_member_last_arrivals_total{rank=\"2\"}"),
            "2"
        );
        assert_eq!(
            value(&t, "dmlc_member_arrival_lag_seconds_total{rank=\"2\"}"),
            "0.004"
        );
        assert_eq!(
            value(&t, "dmlc_member_arrival_lag_seconds_total{rank=\"0\"}"),
            "0.005"
        );
        assert!(!t.contains("rank=\"3\""));
        for name in [
            "dmlc_member_last_arrivals_total",
            "dmlc_member_arrival_lag_seconds_total",
        ] {
            assert!(t.contains(&format!("# HELP {name} ")));
            assert!(t.contains(&format!("# TYPE {name} counter")));
        }
    }

    #[test]
    fn skew_histogram_is_cumulative() {
        let m = Metrics::new(3);
        m.skew(Duration::from_micros(3));
        m.skew(Duration::from_millis(2));
        m.skew(Duration::from_secs(100));
        let t = m.render();
        assert_eq!(
            value(&t, "dmlc_straggler_skew_seconds_bucket{le=\"0.000001\"}"),
            "0"
        );
        assert_eq!(
            value(&t, "dmlc_straggler_skew_seconds_bucket{le=\"0.000005\"}"),
            "1"
        );
        assert_eq!(
            value(&t, "dmlc_straggler_skew_seconds_bucket{le=\"0.005\"}"),
            "2"
        );
        assert_eq!(
            value(&t, "dmlc_straggler_skew_seconds_bucket{le=\"60\"}"),
            "2"
        );
        assert_eq!(
            value(&t, "dmlc_straggler_skew_seconds_bucket{le=\"+Inf\"}"),
            "3"
        );
        assert_eq!(value(&t, "dmlc_straggler_skew_seconds_count"), "3");
        let sum: f64 = value(&t, "dmlc_straggler_skew_seconds_sum")
            .parse()
            .unwrap();
        assert!((sum - 100.002003).abs() < 1e-9);
    }
}
