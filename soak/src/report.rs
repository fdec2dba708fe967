//! Figures per group, the pass/fail checks, the table and the JSON.

use std::fmt::Write as _;
use std::time::Duration;

use serde::Serialize;

use crate::daemon::Usage;
use crate::rank::{CommOps, Plan, RankReport, RoundTime, Sample, AFTER_KILL_GRACE};

/// The limits a group is checked against.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_rss_growth: u64,
    pub max_stall: Duration,
}

/// Everything one group produced.
pub struct GroupResult {
    pub name: String,
    pub group_id: u64,
    pub daemon_pid: u32,
    pub ranks: Vec<RankReport>,
    pub samples: Vec<Sample>,
    pub rounds: Vec<RoundTime>,
    /// Set if the daemon exited during the run.
    pub daemon_exit: Option<String>,
    /// This group had a rank closed by --kill-one.
    pub victim: bool,
    /// This group's daemon was killed by --kill-daemon.
    pub daemon_kill: Option<DaemonKill>,
}

/// When --kill-daemon killed a group's daemon, and how it ended.
#[derive(Clone, Debug)]
pub struct DaemonKill {
    pub round: u32,
    /// The small collective after whose posting it was killed.
    pub seq: u64,
    /// The exit status as text and its signal, if it exited.
    pub exit: Option<(String, Option<i32>)>,
}

impl GroupResult {
    /// Stopped on purpose half way (--kill-one or --kill-daemon).
    pub fn stopped(&self) -> bool {
        self.victim || self.daemon_kill.is_some()
    }
}

/// The figures of one group, derived from its ranks.
#[derive(Clone, Debug, Default)]
pub struct Figures {
    pub small: u64,
    pub large: u64,
    /// Cycles of the communicator part rank 0 finished.
    pub comm_cycles: u64,
    /// Requests of the communicator part checked right, all ranks.
    pub comm: CommOps,
    pub bytes: u64,
    /// Requests posted, all ranks.
    pub submitted: u64,
    /// Completions whose result passed the check, all ranks.
    pub checked: u64,
    pub lost: u64,
    pub duplicated: u64,
    pub wrong: u64,
    pub failed: u64,
    pub generation_changes: u64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    pub small_rate: f64,
    pub large_gbps: f64,
    pub large_traffic_gbps: f64,
    pub large_max_ms: f64,
    /// The slowest request of the communicator part.
    pub comm_max_ms: f64,
    pub warm: Option<Usage>,
    pub end: Option<Usage>,
    pub max_rss_anon_kib: u64,
    pub after_kill: AfterKill,
    /// After --kill-daemon, per rank: ms from the kill to its first
    /// transport error (None: it never saw one).
    pub noticed_ms: Vec<Option<f64>>,
    pub failures: Vec<String>,
}

/// Outcomes in the group that had a rank closed, after the close.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct AfterKill {
    pub ok: u64,
    pub peer_lost: u64,
    pub other: u64,
    pub abandoned: u64,
    /// Ended with the transport error (the daemon was killed).
    pub disconnected: u64,
}

impl Figures {
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }
}

fn percentile(sorted: &[u32], p: usize) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = (sorted.len() * p / 100).min(sorted.len() - 1);
    f64::from(sorted[i]) / 1e3
}

/// Derives the figures of `g` and checks them.
pub fn evaluate(plan: &Plan, limits: &Limits, g: &GroupResult) -> Figures {
    let mut f = Figures::default();
    let r0 = g.ranks.iter().find(|r| r.rank == 0);
    f.small = r0.map_or(0, |r| r.small_ok);
    f.large = r0.map_or(0, |r| r.large_ok);
    f.comm_cycles = r0.map_or(0, |r| r.comm_cycles);
    f.bytes = f.small * (plan.small_elems as u64 * 8) + f.large * (plan.large_elems as u64 * 8);
    let mut lat = Vec::new();
    for r in &g.ranks {
        f.submitted += r.small_submitted + r.large_submitted + r.comm_submitted;
        f.checked += r.small_ok + r.large_ok + r.comm.total();
        f.comm.add(&r.comm);
        f.lost += r.lost;
        f.duplicated += r.duplicated;
        f.wrong += r.wrong;
        f.failed += r.failed;
        f.generation_changes += r.generation_changes;
        f.after_kill.ok += r.after_kill_ok;
        f.after_kill.peer_lost += r.after_kill_peer_lost;
        f.after_kill.other += r.after_kill_other;
        f.after_kill.abandoned += r.after_kill_abandoned;
        f.after_kill.disconnected += r.after_kill_disconnected;
        lat.extend_from_slice(&r.small_ns);
        f.max_us = f.max_us.max(r.small_max_ns as f64 / 1e3);
        f.large_max_ms = f.large_max_ms.max(r.large_max_ns as f64 / 1e6);
        f.comm_max_ms = f.comm_max_ms.max(r.comm_max_ns as f64 / 1e6);
    }
    if g.daemon_kill.is_some() {
        f.noticed_ms = g
            .ranks
            .iter()
            .map(|r| r.noticed.map(|d| d.as_secs_f64() * 1e3))
            .collect();
    }
    lat.sort_unstable();
    f.p50_us = percentile(&lat, 50);
    f.p99_us = percentile(&lat, 99);
    let small_time: Duration = g.rounds.iter().map(|t| t.small).sum();
    if !small_time.is_zero() {
        f.small_rate = f.small as f64 / small_time.as_secs_f64();
    }
    if let Some(r) = r0.filter(|r| r.large_ns > 0) {
        let secs = r.large_ns as f64 / 1e9;
        let bytes = (r.large_ok * plan.large_elems as u64 * 8) as f64;
        f.large_gbps = bytes / secs / 1e9;
        f.large_traffic_gbps = 2.0 * f64::from(plan.ranks) * bytes / secs / 1e9;
    }
    f.warm = g
        .samples
        .iter()
        .find(|s| s.rounds_done == 1)
        .map(|s| s.usage);
    f.end = g
        .samples
        .iter()
        .find(|s| s.rounds_done == plan.rounds)
        .map(|s| s.usage);
    f.max_rss_anon_kib = g
        .samples
        .iter()
        .map(|s| s.usage.rss_anon_kib)
        .max()
        .unwrap_or(0);
    check(plan, limits, g, &mut f);
    f
}

fn check(plan: &Plan, limits: &Limits, g: &GroupResult, f: &mut Figures) {
    let fail = &mut f.failures;
    if let Some(e) = &g.daemon_exit {
        fail.push(format!("the daemon exited during the run ({e})"));
    }
    for (what, n) in [
        ("lost", f.lost),
        ("duplicated", f.duplicated),
        ("wrong", f.wrong),
        ("failed with an error status", f.failed),
    ] {
        if n > 0 {
            fail.push(format!("{n} completions {what}"));
        }
    }
    if g.ranks.iter().any(|r| !r.opened) {
        fail.push("not every rank opened its device".into());
    }
    if let Some(r) = g
        .ranks
        .iter()
        .find(|r| r.group_id != g.group_id && r.opened)
    {
        fail.push(format!(
            "rank {} reads group id {:#x}, its daemon has {:#x}",
            r.rank, r.group_id, g.group_id
        ));
    }
    if g.victim {
        if f.after_kill.other > 0 {
            fail.push(format!(
                "{} requests failed otherwise than PEER_LOST after the close",
                f.after_kill.other
            ));
        }
        // Every survivor must have been told: a survivor that only gave
        // its requests up (or never noticed) was left waiting by the device.
        let victims: Vec<u32> = g
            .ranks
            .iter()
            .filter(|r| r.victim)
            .map(|r| r.rank)
            .collect();
        for r in g.ranks.iter().filter(|r| !r.victim && r.opened) {
            if r.after_kill_peer_lost == 0 {
                fail.push(format!(
                    "rank {} never saw PEER_LOST after rank {} was closed ({} completed right, {} given up after the close)",
                    r.rank,
                    victims
                        .iter()
                        .map(u32::to_string)
                        .collect::<Vec<_>>()
                        .join(", "),
                    r.after_kill_ok,
                    r.after_kill_abandoned
                ));
            }
        }
        return;
    }
    if let Some(k) = &g.daemon_kill {
        check_daemon_kill(g, k, f);
        return;
    }
    if f.submitted != f.checked {
        fail.push(format!(
            "{} requests posted, {} completed with a right result",
            f.submitted, f.checked
        ));
    }
    if f.generation_changes > 0 {
        fail.push(format!(
            "the generation changed ({} times seen): a member was lost",
            f.generation_changes
        ));
    }
    let cycles = plan.comm_ops * u64::from(plan.rounds);
    if let Some(r) = g
        .ranks
        .iter()
        .find(|r| r.small_ok != plan.small || r.large_ok != plan.large)
    {
        fail.push(format!(
            "rank {} completed {} small and {} large collectives of {} and {}",
            r.rank, r.small_ok, r.large_ok, plan.small, plan.large
        ));
    }
    if let Some(r) = g.ranks.iter().find(|r| r.comm_cycles != cycles) {
        fail.push(format!(
            "rank {} finished {} cycles of the communicator part of {cycles}",
            r.rank, r.comm_cycles
        ));
    }
    let stall_ms = limits.max_stall.as_secs_f64() * 1e3;
    let slowest = (f.max_us / 1e3).max(f.large_max_ms).max(f.comm_max_ms);
    if slowest > stall_ms {
        fail.push(format!(
            "a collective took {slowest:.0} ms, over --max-stall-ms {stall_ms:.0}"
        ));
    }
    match (f.warm, f.end) {
        (Some(w), Some(e)) => {
            let growth = e.rss_anon_kib.saturating_sub(w.rss_anon_kib) * 1024;
            if growth > limits.max_rss_growth {
                fail.push(format!(
                    "daemon RssAnon grew by {} KiB after the warm-up, over {} KiB",
                    growth / 1024,
                    limits.max_rss_growth / 1024
                ));
            }
            if e.fds > w.fds {
                fail.push(format!(
                    "daemon fds grew from {} to {} after the warm-up",
                    w.fds, e.fds
                ));
            }
        }
        _ => fail.push("the daemon was not sampled after the warm-up and at the end".into()),
    }
}

/// The group whose daemon was killed: it died of SIGKILL, and every rank
/// saw the transport error, and nothing else, within the grace.
fn check_daemon_kill(g: &GroupResult, k: &DaemonKill, f: &mut Figures) {
    let fail = &mut f.failures;
    match &k.exit {
        Some((_, Some(libc::SIGKILL))) => {}
        Some((st, _)) => fail.push(format!("the killed daemon ended otherwise ({st})")),
        None => fail.push("the daemon did not exit after SIGKILL".into()),
    }
    if f.after_kill.other > 0 {
        fail.push(format!(
            "{} requests failed otherwise than with the transport error after the kill",
            f.after_kill.other
        ));
    }
    for (r, ms) in g.ranks.iter().zip(&f.noticed_ms) {
        let grace_ms = AFTER_KILL_GRACE.as_secs_f64() * 1e3;
        match ms {
            Some(ms) if *ms <= grace_ms => {}
            Some(ms) => fail.push(format!(
                "rank {} saw the transport error {ms:.0} ms after the kill, over {grace_ms:.0} ms",
                r.rank
            )),
            None => fail.push(format!(
                "rank {} never saw the transport error (device backend disconnected)",
                r.rank
            )),
        }
    }
}

/// "4 of 4 ranks saw ... within X ms" for the group whose daemon was killed.
fn daemon_kill_line(g: &GroupResult, k: &DaemonKill, f: &Figures) -> String {
    let seen: Vec<f64> = f.noticed_ms.iter().flatten().copied().collect();
    let worst = seen.iter().copied().fold(0.0, f64::max);
    let per_rank: Vec<String> = f
        .noticed_ms
        .iter()
        .map(|ms| ms.map_or("never".into(), |ms| format!("{ms:.1}")))
        .collect();
    let exit = k.exit.as_ref().map_or("it did not exit", |(st, _)| st);
    format!(
        "{}: daemon killed (SIGKILL) at round {}, after small collective {} was posted: {} of {} \
         ranks saw 'device backend disconnected' within {worst:.1} ms (per rank, ms: {}); \
         after the kill {} completed right, {} ended with the transport error, {} given up or \
         dropped, {} other errors; daemon: {exit}",
        g.name,
        k.round,
        k.seq,
        seen.len(),
        g.ranks.len(),
        per_rank.join(", "),
        f.after_kill.ok,
        f.after_kill.disconnected,
        f.after_kill.abandoned,
        f.after_kill.other
    )
}

fn usage_pair(f: &Figures, get: impl Fn(&Usage) -> u64) -> String {
    match (f.warm, f.end) {
        (Some(w), Some(e)) => format!("{} -> {}", get(&w), get(&e)),
        (Some(w), None) => format!("{} -> ?", get(&w)),
        _ => "-".into(),
    }
}

fn human_bytes(b: u64) -> String {
    let b = b as f64;
    if b >= 1e9 {
        format!("{:.1} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.1} MB", b / 1e6)
    } else {
        format!("{:.1} kB", b / 1e3)
    }
}

/// The table printed at the end.
pub fn table(groups: &[(GroupResult, Figures)]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<5} {:>9} {:>8} {:>6} {:>10} {:>9} {:>4} {:>4} {:>5} {:>6} {:>9} {:>9} {:>9} {:>11} {:>20} {:>9} {:>6}",
        "group",
        "small",
        "large",
        "comm",
        "bytes",
        "checked",
        "lost",
        "dup",
        "wrong",
        "failed",
        "p50 us",
        "p99 us",
        "max us",
        "large GB/s",
        "RssAnon KiB warm>end",
        "fds",
        "result"
    );
    for (g, f) in groups {
        let _ = writeln!(
            s,
            "{:<5} {:>9} {:>8} {:>6} {:>10} {:>9} {:>4} {:>4} {:>5} {:>6} {:>9.1} {:>9.1} {:>9.0} {:>11.2} {:>20} {:>9} {:>6}",
            g.name,
            f.small,
            f.large,
            f.comm_cycles,
            human_bytes(f.bytes),
            f.checked,
            f.lost,
            f.duplicated,
            f.wrong,
            f.failed,
            f.p50_us,
            f.p99_us,
            f.max_us,
            f.large_gbps,
            usage_pair(f, |u| u.rss_anon_kib),
            usage_pair(f, |u| u.fds),
            if !f.passed() {
                "FAIL"
            } else if g.stopped() {
                "KILLED"
            } else {
                "PASS"
            }
        );
    }
    s
}

/// Details under the table: VmRSS, traffic, per-group notes and failures;
/// `kill` is the round of the kill and what it did.
pub fn details(groups: &[(GroupResult, Figures)], kill: Option<(u32, &str)>) -> String {
    let mut s = String::new();
    for (g, f) in groups {
        let _ = writeln!(
            s,
            "group {}: daemon pid {}, group id {:#x}; small {:.0}/s; large {:.2} GB/s algbw, \
             {:.2} GB/s memory traffic (2*N*S/t), slowest {:.1} ms; VmRSS KiB {} (guest pages \
             it touched count too); RssAnon max {} KiB",
            g.name,
            g.daemon_pid,
            g.group_id,
            f.small_rate,
            f.large_gbps,
            f.large_traffic_gbps,
            f.large_max_ms,
            usage_pair(f, |u| u.vm_rss_kib),
            f.max_rss_anon_kib
        );
        if f.comm.total() > 0 {
            let c = &f.comm;
            let _ = writeln!(
                s,
                "  communicator part: {} cycles; requests checked (all ranks): comm_split {}, \
                 comm_create {}, send {}, recv {}, alltoall {}, allreduce {}, comm_free {}; \
                 slowest {:.1} ms",
                f.comm_cycles,
                c.comm_split,
                c.comm_create,
                c.send,
                c.recv,
                c.alltoall,
                c.allreduce,
                c.comm_free,
                f.comm_max_ms
            );
        }
        if g.victim {
            let _ = writeln!(
                s,
                "  rank closed half way: after the close {} completed, {} PEER_LOST, {} other \
                 errors, {} given up or dropped",
                f.after_kill.ok, f.after_kill.peer_lost, f.after_kill.other, f.after_kill.abandoned
            );
        } else if let Some(k) = &g.daemon_kill {
            let _ = writeln!(s, "  {}", daemon_kill_line(g, k, f));
        } else if let Some((round, what)) = kill {
            if let Some(line) = kill_round_rates(g, round, what) {
                let _ = writeln!(s, "  {line}");
            }
        }
        for m in &f.failures {
            let _ = writeln!(s, "  FAIL: {m}");
        }
        for r in &g.ranks {
            for m in &r.messages {
                let _ = writeln!(s, "  note: {m}");
            }
        }
    }
    s
}

/// Small-collective time of the round with the close against the median
/// round: the close must not slow the other groups.
fn kill_round_rates(g: &GroupResult, round: u32, what: &str) -> Option<String> {
    let at = g.rounds.get(round as usize)?;
    let median = |part: fn(&RoundTime) -> Duration| {
        let mut all: Vec<Duration> = g.rounds.iter().map(part).collect();
        all.sort_unstable();
        all[all.len() / 2].as_secs_f64()
    };
    Some(format!(
        "round {round} ({what}): small part {:.2} s, large part {:.2} s, communicator part \
         {:.2} s; median round: {:.2} s, {:.2} s and {:.2} s",
        at.small.as_secs_f64(),
        at.large.as_secs_f64(),
        at.comm.as_secs_f64(),
        median(|t| t.small),
        median(|t| t.large),
        median(|t| t.comm)
    ))
}

/// A figure for the JSON: rounded to 3 decimals, null if not finite.
fn num(x: f64) -> Option<f64> {
    x.is_finite().then(|| (x * 1e3).round() / 1e3)
}

/// The JSON document (`--json FILE`).
#[derive(Serialize)]
struct Doc<'a, C> {
    config: &'a C,
    wall_s: Option<f64>,
    passed: bool,
    groups: Vec<GroupJson<'a>>,
}

/// One group of the document.
#[derive(Serialize)]
struct GroupJson<'a> {
    name: &'a str,
    group_id: u64,
    daemon_pid: u32,
    killed_rank: bool,
    killed_daemon: bool,
    passed: bool,
    small_collectives: u64,
    large_collectives: u64,
    comm_cycles: u64,
    comm_ops: CommOps,
    bytes: u64,
    submitted: u64,
    completions_checked: u64,
    lost: u64,
    duplicated: u64,
    wrong: u64,
    failed: u64,
    generation_changes: u64,
    small_latency_us: Latency,
    small_per_s: Option<f64>,
    large_gbps: Option<f64>,
    large_traffic_gbps: Option<f64>,
    large_max_ms: Option<f64>,
    comm_max_ms: Option<f64>,
    warm_up: Option<Usage>,
    end: Option<Usage>,
    max_rss_anon_kib: u64,
    after_kill: AfterKill,
    noticed_ms: Vec<Option<f64>>,
    /// null unless every rank saw the transport error.
    noticed_max_ms: Option<f64>,
    kill_round: Option<u32>,
    daemon_exit: Option<&'a str>,
    samples: Vec<SampleJson>,
    failures: &'a [String],
    notes: Vec<&'a str>,
}

#[derive(Serialize)]
struct Latency {
    p50: Option<f64>,
    p99: Option<f64>,
    max: Option<f64>,
}

#[derive(Serialize)]
struct SampleJson {
    rounds_done: u32,
    #[serde(flatten)]
    usage: Usage,
}

impl<'a> GroupJson<'a> {
    fn new(g: &'a GroupResult, f: &'a Figures) -> Self {
        let noticed_max_ms = f
            .noticed_ms
            .iter()
            .try_fold(None::<f64>, |m, ms| {
                ms.map(|x| Some(m.map_or(x, |m| m.max(x))))
            })
            .flatten()
            .and_then(num);
        let daemon_exit = g.daemon_exit.as_deref().or(g
            .daemon_kill
            .as_ref()
            .and_then(|k| k.exit.as_ref().map(|e| e.0.as_str())));
        GroupJson {
            name: &g.name,
            group_id: g.group_id,
            daemon_pid: g.daemon_pid,
            killed_rank: g.victim,
            killed_daemon: g.daemon_kill.is_some(),
            passed: f.passed(),
            small_collectives: f.small,
            large_collectives: f.large,
            comm_cycles: f.comm_cycles,
            comm_ops: f.comm,
            bytes: f.bytes,
            submitted: f.submitted,
            completions_checked: f.checked,
            lost: f.lost,
            duplicated: f.duplicated,
            wrong: f.wrong,
            failed: f.failed,
            generation_changes: f.generation_changes,
            small_latency_us: Latency {
                p50: num(f.p50_us),
                p99: num(f.p99_us),
                max: num(f.max_us),
            },
            small_per_s: num(f.small_rate),
            large_gbps: num(f.large_gbps),
            large_traffic_gbps: num(f.large_traffic_gbps),
            large_max_ms: num(f.large_max_ms),
            comm_max_ms: num(f.comm_max_ms),
            warm_up: f.warm,
            end: f.end,
            max_rss_anon_kib: f.max_rss_anon_kib,
            after_kill: f.after_kill,
            noticed_ms: f.noticed_ms.iter().map(|ms| ms.and_then(num)).collect(),
            noticed_max_ms,
            kill_round: g.daemon_kill.as_ref().map(|k| k.round),
            daemon_exit,
            samples: g
                .samples
                .iter()
                .map(|x| SampleJson {
                    rounds_done: x.rounds_done,
                    usage: x.usage,
                })
                .collect(),
            failures: &f.failures,
            notes: g
                .ranks
                .iter()
                .flat_map(|r| r.messages.iter().map(String::as_str))
                .collect(),
        }
    }
}

/// The figures as JSON; `config` is the options.
pub fn json(
    config: &impl Serialize,
    wall: Duration,
    passed: bool,
    groups: &[(GroupResult, Figures)],
) -> String {
    let doc = Doc {
        config,
        wall_s: num(wall.as_secs_f64()),
        passed,
        groups: groups.iter().map(|(g, f)| GroupJson::new(g, f)).collect(),
    };
    // Plain structs with string keys: serializing cannot fail.
    let mut text = serde_json::to_string_pretty(&doc).expect("the report serializes");
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> Plan {
        Plan {
            groups: 1,
            ranks: 2,
            small: 10,
            small_elems: 8,
            window: 4,
            large: 2,
            large_elems: 16,
            comm_ops: 0,
            rounds: 2,
            poll: false,
            kill: None,
            wait_limit: Duration::from_secs(1),
            dma_bytes: 1 << 20,
            queue_size: 256,
        }
    }

    fn usage(anon: u64, fds: u64) -> Usage {
        Usage {
            rss_anon_kib: anon,
            vm_rss_kib: anon * 2,
            fds,
        }
    }

    fn group(end_anon: u64, end_fds: u64) -> GroupResult {
        let rank = |r| RankReport {
            rank: r,
            opened: true,
            group_id: 7,
            generation: 1,
            small_submitted: 10,
            small_ok: 10,
            large_submitted: 2,
            large_ok: 2,
            small_ns: vec![1000; 10],
            small_max_ns: 1000,
            large_ns: 2_000_000,
            large_max_ns: 1_000_000,
            ..Default::default()
        };
        GroupResult {
            name: "A".into(),
            group_id: 7,
            daemon_pid: 1,
            ranks: vec![rank(0), rank(1)],
            samples: vec![
                Sample {
                    rounds_done: 1,
                    usage: usage(1000, 20),
                },
                Sample {
                    rounds_done: 2,
                    usage: usage(end_anon, end_fds),
                },
            ],
            rounds: vec![RoundTime::default(); 2],
            daemon_exit: None,
            victim: false,
            daemon_kill: None,
        }
    }

    const LIMITS: Limits = Limits {
        max_rss_growth: 4 << 20,
        max_stall: Duration::from_secs(10),
    };

    #[test]
    fn a_clean_group_passes() {
        let f = evaluate(&plan(), &LIMITS, &group(1000 + 4096, 20));
        assert!(f.passed(), "{:?}", f.failures);
        assert_eq!((f.small, f.large, f.checked), (10, 2, 24));
        assert_eq!(f.bytes, 10 * 64 + 2 * 128);
        assert_eq!(f.p50_us, 1.0);
        let t = table(&[(group(1000, 20), f)]);
        assert!(t.contains("PASS"), "{t}");
    }

    #[test]
    fn growth_loss_and_bad_results_fail() {
        let f = evaluate(&plan(), &LIMITS, &group(1000 + 4097, 20));
        assert!(
            f.failures[0].contains("RssAnon grew by 4097 KiB"),
            "{:?}",
            f.failures
        );
        let f = evaluate(&plan(), &LIMITS, &group(1000, 21));
        assert!(
            f.failures[0].contains("fds grew from 20 to 21"),
            "{:?}",
            f.failures
        );
        let mut g = group(1000, 20);
        g.ranks[1].duplicated = 1;
        g.ranks[1].small_ok = 9;
        let f = evaluate(&plan(), &LIMITS, &g);
        // Duplicated, posted != right, and rank 1 short of its work.
        assert_eq!(f.failures.len(), 3, "{:?}", f.failures);
        assert!(f.failures[1].contains("24 requests posted, 23 completed"));
        let mut g = group(1000, 20);
        g.samples.pop();
        assert!(!evaluate(&plan(), &LIMITS, &g).passed());
    }

    /// Group A with 2 rounds of one cycle of the communicator part: per
    /// rank, 2 splits, 2 creates, 6 sends and receives (3 shifts a cycle),
    /// 2 all-to-alls and allreduces, 4 frees.
    fn comm_group() -> (Plan, GroupResult) {
        let plan = Plan {
            comm_ops: 1,
            ..plan()
        };
        let mut g = group(1000, 20);
        for r in &mut g.ranks {
            r.comm_cycles = 2;
            r.comm_submitted = 24;
            r.comm = CommOps {
                comm_split: 2,
                comm_create: 2,
                send: 6,
                recv: 6,
                alltoall: 2,
                allreduce: 2,
                comm_free: 4,
            };
            r.comm_max_ns = 3_000_000;
        }
        (plan, g)
    }

    #[test]
    fn the_communicator_part_is_counted_and_checked_like_allreduces() {
        let (plan, g) = comm_group();
        let f = evaluate(&plan, &LIMITS, &g);
        assert!(f.passed(), "{:?}", f.failures);
        assert_eq!((f.comm_cycles, f.comm.total(), f.comm.send), (2, 48, 12));
        assert_eq!((f.submitted, f.checked), (72, 72));
        assert_eq!(f.comm_max_ms, 3.0);
        let d = details(&[(comm_group().1, f.clone())], None);
        assert!(
            d.contains("communicator part: 2 cycles; requests checked (all ranks): comm_split 4, comm_create 4, send 12, recv 12, alltoall 4, allreduce 4, comm_free 8"),
            "{d}"
        );
        let j = json(&(), Duration::from_secs(1), true, &[(comm_group().1, f)]);
        let doc: serde_json::Value = serde_json::from_str(&j).expect("valid JSON");
        assert_eq!(doc["groups"][0]["comm_cycles"], 2, "{j}");
        assert_eq!(doc["groups"][0]["comm_ops"]["recv"], 12, "{j}");
        assert_eq!(doc["groups"][0]["comm_max_ms"], 3.0, "{j}");
        // A wrong receive, a rank short of a cycle, a slow comm_split.
        let (plan, mut g) = comm_group();
        g.ranks[0].comm.recv -= 1;
        g.ranks[0].wrong = 1;
        g.ranks[1].comm_cycles = 1;
        g.ranks[1].comm_max_ns = 11_000_000_000;
        let f = evaluate(&plan, &LIMITS, &g);
        assert_eq!(
            f.failures,
            [
                "1 completions wrong",
                "72 requests posted, 71 completed with a right result",
                "rank 1 finished 1 cycles of the communicator part of 2",
                "a collective took 11000 ms, over --max-stall-ms 10000",
            ]
        );
    }

    /// Group B with its daemon killed after half its work, every rank
    /// having seen the transport error.
    fn killed_group() -> GroupResult {
        let mut g = group(1000, 20);
        g.name = "B".into();
        g.samples.pop();
        for (r, ms) in g.ranks.iter_mut().zip([3, 5]) {
            r.small_ok = 5;
            r.small_submitted = 8;
            r.large_ok = 0;
            r.large_submitted = 0;
            r.after_kill_disconnected = 1;
            r.after_kill_abandoned = 2;
            r.noticed = Some(Duration::from_millis(ms));
        }
        g.daemon_kill = Some(DaemonKill {
            round: 1,
            seq: 5,
            exit: Some(("signal: 9 (SIGKILL)".into(), Some(libc::SIGKILL))),
        });
        g
    }

    #[test]
    fn a_killed_daemon_is_reported_not_failed() {
        let g = killed_group();
        let f = evaluate(&plan(), &LIMITS, &g);
        assert!(f.passed(), "{:?}", f.failures);
        assert_eq!(f.noticed_ms, [Some(3.0), Some(5.0)]);
        assert_eq!(f.after_kill.disconnected, 2);
        let d = details(&[(killed_group(), f.clone())], Some((1, "x")));
        assert!(
            d.contains(
                "B: daemon killed (SIGKILL) at round 1, after small collective 5 was posted: \
                 2 of 2 ranks saw 'device backend disconnected' within 5.0 ms"
            ),
            "{d}"
        );
        let t = table(&[(killed_group(), f.clone())]);
        assert!(t.contains("KILLED"), "{t}");
        let j = json(&(), Duration::from_secs(1), true, &[(killed_group(), f)]);
        let doc: serde_json::Value = serde_json::from_str(&j).expect("valid JSON");
        let b = &doc["groups"][0];
        assert_eq!(b["noticed_max_ms"], 5.0, "{j}");
        assert_eq!(b["noticed_ms"], serde_json::json!([3.0, 5.0]), "{j}");
        assert_eq!(b["killed_daemon"], true, "{j}");
        assert_eq!(b["kill_round"], 1, "{j}");
        assert_eq!(b["daemon_exit"], "signal: 9 (SIGKILL)", "{j}");
        assert_eq!(b["after_kill"]["disconnected"], 2, "{j}");
    }

    #[test]
    fn a_killed_daemon_group_fails_if_a_rank_missed_it() {
        let mut g = killed_group();
        g.ranks[1].noticed = None;
        let f = evaluate(&plan(), &LIMITS, &g);
        assert_eq!(
            f.failures,
            ["rank 1 never saw the transport error (device backend disconnected)"]
        );
        assert!(table(&[(g, f)]).contains("FAIL"));
        let mut g = killed_group();
        g.ranks[0].noticed = Some(AFTER_KILL_GRACE + Duration::from_millis(1));
        g.ranks[0].after_kill_other = 1;
        g.daemon_kill.as_mut().unwrap().exit = Some(("exit status: 1".into(), None));
        let f = evaluate(&plan(), &LIMITS, &g);
        assert_eq!(f.failures.len(), 3, "{:?}", f.failures);
        assert!(f.failures[0].contains("ended otherwise (exit status: 1)"));
        assert!(f.failures[1].contains("1 requests failed otherwise"));
        assert!(f.failures[2].contains("rank 0 saw the transport error 2001 ms"));
        let mut g = killed_group();
        g.daemon_kill.as_mut().unwrap().exit = None;
        g.ranks[0].wrong = 1;
        let f = evaluate(&plan(), &LIMITS, &g);
        assert_eq!(f.failures.len(), 2, "{:?}", f.failures);
    }

    /// Group B of --kill-one, 3 ranks, rank 2 closed half way.
    fn closed_rank_group() -> GroupResult {
        let mut g = group(1000, 20);
        g.name = "B".into();
        g.victim = true;
        g.ranks.push(RankReport {
            rank: 2,
            opened: true,
            group_id: 7,
            victim: true,
            after_kill_abandoned: 3,
            ..Default::default()
        });
        for r in &mut g.ranks[..2] {
            r.after_kill_ok = 1;
            r.after_kill_peer_lost = 2;
        }
        g
    }

    #[test]
    fn kill_one_passes_only_if_every_survivor_saw_peer_lost() {
        let f = evaluate(&plan(), &LIMITS, &closed_rank_group());
        assert!(f.passed(), "{:?}", f.failures);
        let mut g = closed_rank_group();
        g.ranks[1].after_kill_peer_lost = 0;
        g.ranks[1].after_kill_abandoned = 4;
        let f = evaluate(&plan(), &LIMITS, &g);
        assert_eq!(
            f.failures,
            ["rank 1 never saw PEER_LOST after rank 2 was closed (1 completed right, 4 given up after the close)"]
        );
        assert!(table(&[(g, f)]).contains("FAIL"));
    }

    /// Every key of the document, with the values of a clean group; a note
    /// that needs escaping survives.
    #[test]
    fn json_has_every_key() {
        let mut g = group(1000, 20);
        g.ranks[0].messages.push("quote \" here\n".into());
        let f = evaluate(&plan(), &LIMITS, &g);
        let config = serde_json::json!({"groups": 1});
        let j = json(&config, Duration::from_millis(1500), true, &[(g, f)]);
        let doc: serde_json::Value = serde_json::from_str(&j).expect("valid JSON");
        let keys = |v: &serde_json::Value| -> Vec<String> {
            let mut k: Vec<String> = v.as_object().expect("object").keys().cloned().collect();
            k.sort();
            k
        };
        assert_eq!(keys(&doc), ["config", "groups", "passed", "wall_s"]);
        assert_eq!(doc["config"], config);
        assert_eq!(
            (doc["wall_s"].as_f64(), doc["passed"].as_bool()),
            (Some(1.5), Some(true))
        );
        let a = &doc["groups"][0];
        let mut want = vec![
            "name",
            "group_id",
            "daemon_pid",
            "killed_rank",
            "killed_daemon",
            "passed",
            "small_collectives",
            "large_collectives",
            "comm_cycles",
            "comm_ops",
            "bytes",
            "submitted",
            "completions_checked",
            "lost",
            "duplicated",
            "wrong",
            "failed",
            "generation_changes",
            "small_latency_us",
            "small_per_s",
            "large_gbps",
            "large_traffic_gbps",
            "large_max_ms",
            "comm_max_ms",
            "warm_up",
            "end",
            "max_rss_anon_kib",
            "after_kill",
            "noticed_ms",
            "noticed_max_ms",
            "kill_round",
            "daemon_exit",
            "samples",
            "failures",
            "notes",
        ];
        // Written in this order.
        let body = &j[j.find("\"name\"").expect("a group")..];
        let at: Vec<usize> = want
            .iter()
            .map(|k| body.find(&format!("\"{k}\"")).expect("key written"))
            .collect();
        assert!(at.windows(2).all(|w| w[0] < w[1]), "{j}");
        want.sort_unstable();
        assert_eq!(keys(a), want);
        assert_eq!(a["name"], "A");
        assert_eq!(a["completions_checked"], 24);
        assert_eq!(keys(&a["small_latency_us"]), ["max", "p50", "p99"]);
        assert_eq!(a["small_latency_us"]["p50"], 1.0);
        assert_eq!(
            keys(&a["after_kill"]),
            ["abandoned", "disconnected", "ok", "other", "peer_lost"]
        );
        let usage = serde_json::json!({"rss_anon_kib": 1000, "vm_rss_kib": 2000, "fds": 20});
        assert_eq!(a["warm_up"], usage);
        assert_eq!(a["samples"][0]["rounds_done"], 1);
        assert_eq!(
            keys(&a["samples"][0]),
            ["fds", "rounds_done", "rss_anon_kib", "vm_rss_kib"]
        );
        for null in ["noticed_max_ms", "kill_round", "daemon_exit"] {
            assert!(a[null].is_null(), "{null}: {j}");
        }
        assert_eq!(a["noticed_ms"], serde_json::json!([]));
        assert_eq!(a["notes"], serde_json::json!(["quote \" here\n"]));
    }
}
