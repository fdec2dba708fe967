//! Timing model and impairments: when a collective completes, and what is
//! injected into it on purpose.
//!
//! Without a timing file (`--timing`), none of this runs: collectives
//! complete as soon as their data has moved. With one, the group engine
//! ([`crate::group`]) asks [`Timing`] three things under its state lock:
//!
//! - how long each member's arrival is held back ([`Timing::delay`]):
//!   an injected straggler. The member's arrival counts at `arrival +
//!   delay` (its *effective* arrival); its data is there already, so
//!   nothing waits on the data path;
//! - how long the collective takes on the modelled cluster
//!   ([`Model::time`]). It completes at `max(last effective arrival, end
//!   of the previous collective on the same queue) + modelled time`, but
//!   never before its data has moved (then it is counted as late: the
//!   host was too slow to honour the model);
//! - whether it fails on purpose ([`Timing::failure`]).
//!
//! The formulas of every model, per opcode, are in docs/latency-experiments.md,
//! and the file format in the same place. Random draws are made from a
//! counter-based generator (SplitMix64 over the seed, the rank, the queue,
//! the arrival's number and the rule), so a run with the same seed and the
//! same requests gets the same delays whatever the threads' timing.

use std::path::Path;
use std::time::Duration;

use serde::Deserialize;
use thiserror::Error;
use virtio_dmlc::{Opcode, Status};

/// Why a timing file is refused.
#[derive(Debug, Error)]
pub enum TimingError {
    #[error("cannot read the timing file {path}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("timing file {path}: {message}")]
    Parse { path: String, message: String },
    #[error("timing file: {field} {problem}")]
    Field { field: String, problem: String },
}

fn field(field: impl Into<String>, problem: impl Into<String>) -> TimingError {
    TimingError::Field {
        field: field.into(),
        problem: problem.into(),
    }
}

/// The file as written (TOML, or JSON when the name ends in `.json`).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimingFile {
    /// Seed of every random draw.
    #[serde(default)]
    pub seed: u64,
    /// Spin this long before a modelled completion instead of sleeping
    /// (finer timing, one busy CPU meanwhile); 0 sleeps.
    #[serde(default)]
    pub spin_us: f64,
    /// Taken off every modelled time (never below 0): the host's own
    /// latency that comes on top of the model (a round trip of the
    /// program), measured without a model.
    #[serde(default)]
    pub overhead_us: f64,
    #[serde(default)]
    pub model: ModelSpec,
    #[serde(default)]
    pub delay: Vec<DelaySpec>,
    #[serde(default)]
    pub fail: Vec<FailSpec>,
    #[serde(default)]
    pub bandwidth: Vec<BandwidthSpec>,
}

/// `[model]`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// ideal, ring, halving-doubling, tree, topology.
    #[serde(default)]
    pub kind: Option<String>,
    /// Modelled world size p (alpha-beta models); default: the members.
    pub world: Option<u32>,
    pub alpha_us: Option<f64>,
    pub bandwidth_gbs: Option<f64>,
    pub reduce_gbs: Option<f64>,
    // Topology.
    pub algorithm: Option<String>,
    pub nodes: Option<u32>,
    pub ranks_per_node: Option<u32>,
    pub base_latency_us: Option<f64>,
    pub intra_latency_us: Option<f64>,
    pub inter_latency_us: Option<f64>,
    pub intra_bandwidth_gbs: Option<f64>,
    pub inter_bandwidth_gbs: Option<f64>,
    pub bus_bandwidth_gbs: Option<f64>,
}

/// One `[[delay]]` rule.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DelaySpec {
    /// Ranks it applies to; absent: every rank.
    pub ranks: Option<Vec<u32>>,
    /// constant, uniform, normal, pareto.
    pub dist: String,
    pub us: Option<f64>,
    pub min_us: Option<f64>,
    pub max_us: Option<f64>,
    pub mean_us: Option<f64>,
    pub stddev_us: Option<f64>,
    pub scale_us: Option<f64>,
    pub shape: Option<f64>,
    /// 0..1: each draw is `c * previous + (1 - c) * fresh` (netem's way).
    #[serde(default)]
    pub correlation: f64,
    /// Chance that an arrival is delayed at all (default 1).
    pub probability: Option<f64>,
    /// Bursts (a Gilbert-Elliott straggler): the rule applies only in its
    /// bad state, entered with this chance per arrival...
    pub burst_enter: Option<f64>,
    /// ...and left with this one.
    pub burst_leave: Option<f64>,
    /// Window: only on this queue (default: every queue)...
    pub queue: Option<u16>,
    /// ...from this collective (counted from 0 per queue)...
    pub from_collective: Option<u64>,
    /// ...up to, not including, this one.
    pub until_collective: Option<u64>,
}

/// One `[[bandwidth]]` rule: the members' links run at `factor` times the
/// model's bandwidth.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BandwidthSpec {
    /// Ranks it applies to; absent: every rank.
    pub ranks: Option<Vec<u32>>,
    pub factor: f64,
    /// Chance that a collective is slowed by this rule (default 1).
    pub probability: Option<f64>,
    pub queue: Option<u16>,
    pub from_collective: Option<u64>,
    pub until_collective: Option<u64>,
}

/// One `[[fail]]` rule.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FailSpec {
    /// timeout, peer-lost, or withheld (`rank`'s completion is never made).
    pub status: String,
    /// The rank that seems to be missing (timeout) or lost (peer-lost).
    pub rank: u32,
    /// The queue (default 0).
    #[serde(default)]
    pub queue: u16,
    /// The collective's number on that queue, counted from 0 since the
    /// daemon started (not reset by generation changes).
    pub collective: u64,
}

/// The algorithm an alpha-beta-gamma model assumes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algo {
    Ring,
    HalvingDoubling,
    Tree,
}

/// How long a collective takes on the modelled cluster.
#[derive(Clone, Debug, PartialEq)]
pub enum Model {
    /// No model: completion when the data has moved.
    Ideal,
    /// `alpha` seconds per message, `beta` seconds per byte on a link,
    /// `gamma` seconds per byte reduced; `world` modelled ranks.
    AlphaBeta {
        algo: Algo,
        world: u32,
        alpha: f64,
        beta: f64,
        gamma: f64,
    },
    /// NCCL-style: latency `base + hops`, bytes over an algorithm
    /// bandwidth derived from the bus bandwidth.
    Topology {
        tree: bool,
        nodes: u32,
        ranks_per_node: u32,
        base: f64,
        intra: f64,
        inter: f64,
        /// Bytes per second.
        bus_bw: f64,
        gamma: f64,
    },
}

/// `ceil(log2(p))`, 0 for p <= 1.
fn lg(p: u32) -> f64 {
    if p <= 1 {
        0.0
    } else {
        f64::from(32 - (p - 1).leading_zeros())
    }
}

impl Model {
    /// The modelled world size (1 for ideal).
    pub fn world(&self) -> u32 {
        match self {
            Model::Ideal => 1,
            Model::AlphaBeta { world, .. } => *world,
            Model::Topology {
                nodes,
                ranks_per_node,
                ..
            } => nodes * ranks_per_node,
        }
    }

    /// Modelled seconds for `opcode` with `block` bytes per member block
    /// (the request's `count` times the element size).
    pub fn seconds(&self, opcode: Opcode, block: u64) -> f64 {
        let m = block as f64;
        match *self {
            Model::Ideal => 0.0,
            Model::AlphaBeta {
                algo,
                world,
                alpha: a,
                beta: b,
                gamma: g,
            } => {
                if world <= 1 {
                    return 0.0;
                }
                let p = f64::from(world);
                let l = lg(world);
                let f = (p - 1.0) / p;
                // N: the full vector a member holds at the widest point.
                let n = match opcode {
                    Opcode::Allgather | Opcode::ReduceScatter => p * m,
                    Opcode::Barrier => 0.0,
                    _ => m,
                };
                match (opcode, algo) {
                    (Opcode::Allreduce, Algo::Ring) => {
                        2.0 * (p - 1.0) * a + 2.0 * f * n * b + f * n * g
                    }
                    (Opcode::Allreduce, Algo::HalvingDoubling) => {
                        2.0 * l * a + 2.0 * f * n * b + f * n * g
                    }
                    (Opcode::Allreduce, Algo::Tree) => 2.0 * l * (a + n * b) + l * n * g,
                    (Opcode::ReduceScatter, Algo::Ring) => (p - 1.0) * a + f * n * (b + g),
                    (Opcode::ReduceScatter, Algo::HalvingDoubling) => l * a + f * n * (b + g),
                    (Opcode::ReduceScatter, Algo::Tree) => {
                        l * (a + n * b + n * g) + l * a + f * n * b
                    }
                    (Opcode::Allgather, Algo::Ring) => (p - 1.0) * a + f * n * b,
                    (Opcode::Allgather, Algo::HalvingDoubling) => l * a + f * n * b,
                    (Opcode::Allgather, Algo::Tree) => l * a + f * n * b + l * (a + n * b),
                    (Opcode::Broadcast, Algo::Ring) => (p - 1.0) * a + n * b,
                    (Opcode::Broadcast, Algo::HalvingDoubling) => 2.0 * l * a + 2.0 * f * n * b,
                    (Opcode::Broadcast, Algo::Tree) => l * (a + n * b),
                    (Opcode::Reduce, Algo::Ring) => (p - 1.0) * a + n * (b + g),
                    (Opcode::Reduce, Algo::HalvingDoubling) => {
                        2.0 * l * a + 2.0 * f * n * b + f * n * g
                    }
                    (Opcode::Reduce, Algo::Tree) => l * (a + n * b + n * g),
                    (Opcode::Barrier, Algo::Ring) => 2.0 * (p - 1.0) * a,
                    (Opcode::Barrier, Algo::HalvingDoubling) => l * a,
                    (Opcode::Barrier, Algo::Tree) => 2.0 * l * a,
                    // Not a collective: the device answers it at once.
                    (Opcode::Nop, _) => 0.0,
                }
            }
            Model::Topology {
                tree,
                nodes,
                ranks_per_node,
                base,
                intra,
                inter,
                bus_bw,
                gamma,
            } => {
                let world = nodes * ranks_per_node;
                if world <= 1 {
                    return 0.0;
                }
                let p = f64::from(world);
                let k = f64::from(nodes);
                let f = (p - 1.0) / p;
                // NCCL counts allgather and reduce-scatter bytes over the
                // whole output or input.
                let n = match opcode {
                    Opcode::Allgather | Opcode::ReduceScatter => p * m,
                    Opcode::Barrier => 0.0,
                    _ => m,
                };
                let reduces = matches!(
                    opcode,
                    Opcode::Allreduce | Opcode::ReduceScatter | Opcode::Reduce
                );
                let compute = if reduces { f * n * gamma } else { 0.0 };
                let tree_applies = tree && matches!(opcode, Opcode::Allreduce | Opcode::Barrier);
                if tree_applies {
                    let lat = base
                        + 2.0 * ((f64::from(ranks_per_node) - 1.0) * intra + lg(nodes) * inter);
                    return lat + n / (bus_bw * 0.5) + compute;
                }
                let (steps, inter_steps, ratio) = match opcode {
                    Opcode::Allreduce | Opcode::Barrier => {
                        let s = 2.0 * (p - 1.0);
                        (s, 2.0 * (k - 1.0), p / s)
                    }
                    Opcode::Allgather | Opcode::ReduceScatter => {
                        let s = p - 1.0;
                        (s, k - 1.0, p / s)
                    }
                    // A pipelined chain: every byte crosses each link once.
                    Opcode::Broadcast | Opcode::Reduce => (p - 1.0, k - 1.0, 1.0),
                    Opcode::Nop => return 0.0,
                };
                let lat = base + (steps - inter_steps) * intra + inter_steps * inter;
                lat + n / (bus_bw * ratio) + compute
            }
        }
    }

    /// [`Model::seconds`] as a duration (saturating at an hour).
    pub fn time(&self, opcode: Opcode, block: u64) -> Duration {
        secs(self.seconds(opcode, block))
    }

    /// This model with every link at `factor` times its bandwidth (the
    /// bytes' share of the time divided by `factor`; latencies and the
    /// reduction unchanged).
    pub fn with_bandwidth_factor(&self, factor: f64) -> Model {
        let mut m = self.clone();
        match &mut m {
            Model::Ideal => {}
            Model::AlphaBeta { beta, .. } => *beta /= factor,
            Model::Topology { bus_bw, .. } => *bus_bw *= factor,
        }
        m
    }

    /// Where the algorithm makes ranks finish at different times: the
    /// modelled seconds until modelled rank `rank` has taken its last part
    /// in `opcode` (received its result and sent what it forwards), with
    /// `root` for broadcast and reduce. None where every rank finishes at
    /// [`Model::seconds`]. The latest rank finishes at [`Model::seconds`].
    /// The rules are in docs/latency-experiments.md, section 4.
    pub fn rank_seconds(&self, opcode: Opcode, block: u64, root: u32, rank: u32) -> Option<f64> {
        let Model::AlphaBeta {
            algo,
            world,
            alpha: a,
            beta: b,
            gamma: g,
        } = *self
        else {
            return None;
        };
        // Only broadcast and reduce have a root; others ignore the field.
        let root = match opcode {
            Opcode::Broadcast | Opcode::Reduce => root,
            _ => 0,
        };
        if world <= 1 || rank >= world || root >= world {
            return None;
        }
        let n = if opcode == Opcode::Barrier {
            0.0
        } else {
            block as f64
        };
        let p = world;
        let l = lg(p);
        // Position from the root (broadcast: the chain's or tree's source).
        let v = (rank + p - root) % p;
        let hops = |d: u32| f64::from(d.min(p - 1));
        match (opcode, algo) {
            // A pipelined chain root, root + 1, ...: the member at distance
            // d has the last byte at d * a + N b and has forwarded it one
            // hop later; the chain's end forwards nothing.
            (Opcode::Broadcast, Algo::Ring) => Some(hops(v + 1) * a + n * b),
            // A chain root + 1, root + 2, ..., root: the member at
            // position d has passed its partial sums on at (d + 1) a +
            // N(b + g); the root has the result at (p - 1) a + N(b + g).
            (Opcode::Reduce, Algo::Ring) => {
                let d = (v + p - 1) % p;
                Some(hops(d + 1) * a + n * (b + g))
            }
            // Binomial reduce: in step s (from 1) the ranks whose lowest
            // set bit (relative to the root) is bit s - 1 send their
            // partial sums and are done; the root has them after step L.
            (Opcode::Reduce, Algo::Tree) => {
                let step = if v == 0 {
                    l
                } else {
                    f64::from(v.trailing_zeros() + 1)
                };
                Some(step * (a + n * b + n * g))
            }
            (Opcode::Broadcast, Algo::Tree) => Some(f64::from(tree_bcast_step(v, p)) * (a + n * b)),
            // Reduce to rank 0 (every rank waits for the whole reduce:
            // its result comes back in the broadcast), then broadcast.
            (Opcode::Allreduce | Opcode::Barrier, Algo::Tree) => {
                Some(l * (a + n * b + n * g) + f64::from(tree_bcast_step(rank, p)) * (a + n * b))
            }
            _ => None,
        }
    }

    /// [`Model::rank_seconds`] as a duration.
    pub fn rank_time(&self, opcode: Opcode, block: u64, root: u32, rank: u32) -> Option<Duration> {
        self.rank_seconds(opcode, block, root, rank).map(secs)
    }
}

/// Seconds as a duration, saturating at an hour.
fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s.clamp(0.0, 3600.0))
}

/// The last step (from 1) of a binomial broadcast over `p` ranks in which
/// rank `v` (relative to the root) takes part: in step s every rank below
/// 2^(s-1) that has the data sends it to the rank 2^(s-1) above it, if
/// there is one. Rank v receives in step bitlen(v) and then sends in every
/// later step that has a receiver for it.
fn tree_bcast_step(v: u32, p: u32) -> u32 {
    let l = lg(p) as u32;
    let got = 32 - v.leading_zeros();
    (got + 1..=l)
        .filter(|&s| u64::from(v) + (1u64 << (s - 1)) < u64::from(p))
        .max()
        .unwrap_or(got)
}

/// A delay distribution, in seconds.
#[derive(Clone, Debug, PartialEq)]
pub enum Dist {
    Constant(f64),
    Uniform { min: f64, max: f64 },
    Normal { mean: f64, stddev: f64 },
    Pareto { scale: f64, shape: f64 },
}

/// A checked `[[delay]]` rule.
#[derive(Clone, Debug, PartialEq)]
pub struct DelayRule {
    /// None: every rank.
    pub ranks: Option<Vec<u32>>,
    pub dist: Dist,
    pub correlation: f64,
    pub probability: f64,
    /// Set over the control socket (`delay RANK US`), not from the file.
    pub live: bool,
    /// Gilbert-Elliott bursts: (chance to enter, chance to leave) the bad
    /// state per arrival; the rule applies only in the bad state.
    pub burst: Option<(f64, f64)>,
    /// The arrivals it applies to.
    pub window: Window,
}

/// Which collectives an impairment applies to: those numbered `from..until`
/// (counted from 0 per queue since the daemon started) on `queue` (None:
/// on every queue, each counted on its own).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Window {
    pub queue: Option<u16>,
    pub from: u64,
    pub until: Option<u64>,
}

impl Window {
    /// True if collective `n` of `queue` is in the window.
    pub fn contains(&self, queue: u16, n: u64) -> bool {
        self.queue.is_none_or(|q| q == queue) && n >= self.from && self.until.is_none_or(|u| n < u)
    }
}

/// A checked `[[bandwidth]]` rule.
#[derive(Clone, Debug, PartialEq)]
pub struct BandwidthRule {
    /// None: every rank.
    pub ranks: Option<Vec<u32>>,
    pub factor: f64,
    pub probability: f64,
    pub window: Window,
}

/// A `[[fail]]` rule with `status = "withheld"`: member `rank`'s completion
/// of that collective is never made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WithholdRule {
    pub rank: u32,
    pub queue: u16,
    pub collective: u64,
}

/// The bandwidth factor applied to one collective, and the ranks whose
/// rules gave it.
#[derive(Clone, Debug, PartialEq)]
pub struct Slowdown {
    /// The smallest factor among the rules that apply.
    pub factor: f64,
    /// (rank, factor) of every rank slowed, in rank order.
    pub ranks: Vec<(u32, f64)>,
}

/// A checked `[[fail]]` rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FailRule {
    pub status: Status,
    pub rank: u32,
    pub queue: u16,
    pub collective: u64,
}

/// A checked timing configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct Timing {
    pub seed: u64,
    pub spin: Duration,
    /// Taken off every modelled time (`overhead_us`).
    pub overhead: Duration,
    pub model: Model,
    pub delays: Vec<DelayRule>,
    pub fails: Vec<FailRule>,
    pub withholds: Vec<WithholdRule>,
    pub bandwidth: Vec<BandwidthRule>,
}

fn us(v: f64) -> f64 {
    v * 1e-6
}

/// Checks that `v` (if given) is finite and at least 0.
fn non_negative(name: &str, v: Option<f64>) -> Result<Option<f64>, TimingError> {
    match v {
        Some(x) if !x.is_finite() || x < 0.0 => {
            Err(field(name, format!("must be a number >= 0, not {x}")))
        }
        other => Ok(other),
    }
}

fn positive(name: &str, v: Option<f64>) -> Result<Option<f64>, TimingError> {
    match v {
        Some(x) if !x.is_finite() || x <= 0.0 => {
            Err(field(name, format!("must be a number > 0, not {x}")))
        }
        other => Ok(other),
    }
}

fn required<T>(name: &str, kind: &str, v: Option<T>) -> Result<T, TimingError> {
    v.ok_or_else(|| field(name, format!("is required with kind = \"{kind}\"")))
}

impl Timing {
    /// Reads and checks a timing file: TOML, or JSON if `path` ends in
    /// `.json`. `members` is the real world size.
    pub fn load(path: &Path, members: u32) -> Result<Timing, TimingError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| TimingError::Read {
            path: shown.clone(),
            source,
        })?;
        let file: TimingFile = if path.extension().is_some_and(|e| e == "json") {
            serde_json::from_str(&text).map_err(|e| TimingError::Parse {
                path: shown.clone(),
                message: e.to_string(),
            })?
        } else {
            toml::from_str(&text).map_err(|e| TimingError::Parse {
                path: shown.clone(),
                message: e.to_string().trim_end().to_owned(),
            })?
        };
        Timing::check(&file, members)
    }

    /// Parses TOML text (for tests and tools).
    pub fn from_toml(text: &str, members: u32) -> Result<Timing, TimingError> {
        let file: TimingFile = toml::from_str(text).map_err(|e| TimingError::Parse {
            path: "(text)".into(),
            message: e.to_string().trim_end().to_owned(),
        })?;
        Timing::check(&file, members)
    }

    /// Checks a parsed file against `members` real members.
    pub fn check(file: &TimingFile, members: u32) -> Result<Timing, TimingError> {
        let spin = non_negative("spin_us", Some(file.spin_us))?.unwrap_or(0.0);
        let overhead = non_negative("overhead_us", Some(file.overhead_us))?.unwrap_or(0.0);
        if overhead > 0.0 && file.model.kind.as_deref().unwrap_or("ideal") == "ideal" {
            return Err(field(
                "overhead_us",
                "needs a [model] (kind other than \"ideal\"): there is no modelled time to take it off",
            ));
        }
        let model = check_model(&file.model, members)?;
        let mut delays = Vec::new();
        for (i, d) in file.delay.iter().enumerate() {
            delays.push(check_delay(&format!("delay[{i}]"), d, members)?);
        }
        let mut fails = Vec::new();
        let mut withholds = Vec::new();
        for (i, f) in file.fail.iter().enumerate() {
            let at = format!("fail[{i}]");
            if f.rank >= members {
                return Err(field(
                    format!("{at}.rank"),
                    format!("is {}, but the group has {members} members", f.rank),
                ));
            }
            let status = match f.status.as_str() {
                "timeout" => Status::Timeout,
                "peer-lost" | "peer_lost" => Status::PeerLost,
                "withheld" => {
                    withholds.push(WithholdRule {
                        rank: f.rank,
                        queue: f.queue,
                        collective: f.collective,
                    });
                    continue;
                }
                other => {
                    return Err(field(
                        format!("{at}.status"),
                        format!(
                            "must be \"timeout\", \"peer-lost\" or \"withheld\", not {other:?}"
                        ),
                    ))
                }
            };
            fails.push(FailRule {
                status,
                rank: f.rank,
                queue: f.queue,
                collective: f.collective,
            });
        }
        let mut bandwidth = Vec::new();
        for (i, b) in file.bandwidth.iter().enumerate() {
            bandwidth.push(check_bandwidth(
                &format!("bandwidth[{i}]"),
                b,
                &model,
                members,
            )?);
        }
        Ok(Timing {
            seed: file.seed,
            spin: Duration::from_secs_f64(us(spin).min(1.0)),
            overhead: secs(us(overhead)),
            model,
            delays,
            fails,
            withholds,
            bandwidth,
        })
    }

    /// No model, no impairment.
    pub fn ideal() -> Timing {
        Timing {
            seed: 0,
            spin: Duration::ZERO,
            overhead: Duration::ZERO,
            model: Model::Ideal,
            delays: Vec::new(),
            fails: Vec::new(),
            withholds: Vec::new(),
            bandwidth: Vec::new(),
        }
    }

    /// This configuration with `rank`'s live delay set to `delay` (none if
    /// zero), replacing the one set before.
    pub fn with_live_delay(&self, rank: u32, delay: Duration) -> Timing {
        let mut t = self.clone();
        t.delays
            .retain(|d| !(d.live && d.ranks.as_deref() == Some(&[rank])));
        if !delay.is_zero() {
            t.delays.push(DelayRule {
                ranks: Some(vec![rank]),
                dist: Dist::Constant(delay.as_secs_f64()),
                correlation: 0.0,
                probability: 1.0,
                live: true,
                burst: None,
                window: Window::default(),
            });
        }
        t
    }

    /// True if nothing is modelled or injected (completions need no timer).
    pub fn is_ideal(&self) -> bool {
        self.model == Model::Ideal
            && self.delays.is_empty()
            && self.fails.is_empty()
            && self.withholds.is_empty()
            && self.bandwidth.is_empty()
    }

    /// Length of the state [`Timing::delay`] keeps per rank and queue.
    pub fn state_len(&self) -> usize {
        2 * self.delays.len()
    }

    /// The delay injected before arrival `index` (counted per rank and
    /// queue) of `rank` on `queue` counts; `last` ([`Timing::state_len`]
    /// long) holds each rule's previous draw and burst state for this rank
    /// and queue (for correlation and bursts).
    pub fn delay(&self, rank: u32, queue: u16, index: u64, last: &mut [f64]) -> Duration {
        let mut total = 0.0;
        for (i, rule) in self.delays.iter().enumerate() {
            if rule.ranks.as_ref().is_some_and(|r| !r.contains(&rank))
                || !rule.window.contains(queue, index)
            {
                continue;
            }
            let mut draw = Draw::new(self.seed, rank, queue, index, i as u64);
            if let (Some((enter, leave)), Some(bad)) = (rule.burst, last.get_mut(2 * i + 1)) {
                let u = draw.uniform();
                if *bad == 0.0 && u < enter {
                    *bad = 1.0;
                } else if *bad != 0.0 && u < leave {
                    *bad = 0.0;
                }
                if *bad == 0.0 {
                    continue;
                }
            }
            if rule.probability < 1.0 && draw.uniform() >= rule.probability {
                continue;
            }
            let fresh = match rule.dist {
                Dist::Constant(v) => v,
                Dist::Uniform { min, max } => min + (max - min) * draw.uniform(),
                Dist::Normal { mean, stddev } => mean + stddev * draw.normal(),
                // Inverse CDF; 1 - u is in (0, 1].
                Dist::Pareto { scale, shape } => scale / (1.0 - draw.uniform()).powf(1.0 / shape),
            };
            let v = match last.get_mut(2 * i) {
                Some(prev) if rule.correlation > 0.0 => {
                    let v = rule.correlation * *prev + (1.0 - rule.correlation) * fresh;
                    *prev = v;
                    v
                }
                Some(prev) => {
                    *prev = fresh;
                    fresh
                }
                None => fresh,
            };
            total += v.max(0.0);
        }
        Duration::from_secs_f64(total.clamp(0.0, 3600.0))
    }

    /// The failure planned for collective `collective` of `queue`, if any.
    pub fn failure(&self, queue: u16, collective: u64) -> Option<FailRule> {
        self.fails
            .iter()
            .find(|f| f.queue == queue && f.collective == collective)
            .copied()
    }

    /// The member whose completion of collective `collective` of `queue`
    /// is withheld, if any (the first rule that names it).
    pub fn withheld(&self, queue: u16, collective: u64) -> Option<u32> {
        self.withholds
            .iter()
            .find(|w| w.queue == queue && w.collective == collective)
            .map(|w| w.rank)
    }

    /// The bandwidth factor of collective `collective` of `queue` among
    /// `ranks` (its members), if a `[[bandwidth]]` rule applies: per rank,
    /// the product of the factors of its rules that apply (each drawn
    /// with its `probability`, from the seed, the rank, the queue, the
    /// collective and the rule); the collective runs at the smallest.
    pub fn slowdown(
        &self,
        queue: u16,
        collective: u64,
        ranks: impl Iterator<Item = u32>,
    ) -> Option<Slowdown> {
        if self.bandwidth.is_empty() {
            return None;
        }
        let mut slowed = Vec::new();
        for rank in ranks {
            let mut factor = 1.0;
            let mut hit = false;
            for (i, rule) in self.bandwidth.iter().enumerate() {
                if rule.ranks.as_ref().is_some_and(|r| !r.contains(&rank))
                    || !rule.window.contains(queue, collective)
                {
                    continue;
                }
                if rule.probability < 1.0 {
                    let key = BANDWIDTH_RULES + i as u64;
                    let mut draw = Draw::new(self.seed, rank, queue, collective, key);
                    if draw.uniform() >= rule.probability {
                        continue;
                    }
                }
                factor *= rule.factor;
                hit = true;
            }
            if hit {
                slowed.push((rank, factor));
            }
        }
        let factor = slowed.iter().map(|s| s.1).reduce(f64::min)?;
        Some(Slowdown {
            factor,
            ranks: slowed,
        })
    }
}

/// Rule numbers of the `[[bandwidth]]` rules' draws start here, apart from
/// those of the delay rules.
const BANDWIDTH_RULES: u64 = 1 << 32;

/// Checks a window's fields (`queue`, `from_collective`, `until_collective`
/// of rule `at`).
fn check_window(
    at: &str,
    queue: Option<u16>,
    from: Option<u64>,
    until: Option<u64>,
) -> Result<Window, TimingError> {
    let from = from.unwrap_or(0);
    if let Some(u) = until {
        if u <= from {
            return Err(field(
                format!("{at}.until_collective"),
                format!("is {u}, not after from_collective ({from})"),
            ));
        }
    }
    Ok(Window { queue, from, until })
}

/// Checks that every rank named in rule `at` is a member.
fn check_ranks(at: &str, ranks: Option<&Vec<u32>>, members: u32) -> Result<(), TimingError> {
    match ranks.into_iter().flatten().find(|r| **r >= members) {
        Some(bad) => Err(field(
            format!("{at}.ranks"),
            format!("names rank {bad}, but the group has {members} members"),
        )),
        None => Ok(()),
    }
}

fn check_bandwidth(
    at: &str,
    b: &BandwidthSpec,
    model: &Model,
    members: u32,
) -> Result<BandwidthRule, TimingError> {
    if *model == Model::Ideal {
        return Err(field(
            format!("{at}.factor"),
            "needs a [model] with a bandwidth (kind other than \"ideal\")",
        ));
    }
    if !(b.factor.is_finite() && b.factor > 0.0 && b.factor <= 1e6) {
        return Err(field(
            format!("{at}.factor"),
            format!("must be a number in (0, 1e6], not {}", b.factor),
        ));
    }
    let probability = b.probability.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&probability) {
        return Err(field(
            format!("{at}.probability"),
            format!("must be in [0, 1], not {probability}"),
        ));
    }
    check_ranks(at, b.ranks.as_ref(), members)?;
    Ok(BandwidthRule {
        ranks: b.ranks.clone(),
        factor: b.factor,
        probability,
        window: check_window(at, b.queue, b.from_collective, b.until_collective)?,
    })
}

fn check_model(m: &ModelSpec, members: u32) -> Result<Model, TimingError> {
    let kind = m.kind.as_deref().unwrap_or("ideal");
    let alpha_beta = ["world", "alpha_us", "bandwidth_gbs", "reduce_gbs"];
    let topology = [
        "algorithm",
        "nodes",
        "ranks_per_node",
        "base_latency_us",
        "intra_latency_us",
        "inter_latency_us",
        "intra_bandwidth_gbs",
        "inter_bandwidth_gbs",
        "bus_bandwidth_gbs",
    ];
    let given = |name: &str| -> bool {
        match name {
            "world" => m.world.is_some(),
            "alpha_us" => m.alpha_us.is_some(),
            "bandwidth_gbs" => m.bandwidth_gbs.is_some(),
            "reduce_gbs" => m.reduce_gbs.is_some(),
            "algorithm" => m.algorithm.is_some(),
            "nodes" => m.nodes.is_some(),
            "ranks_per_node" => m.ranks_per_node.is_some(),
            "base_latency_us" => m.base_latency_us.is_some(),
            "intra_latency_us" => m.intra_latency_us.is_some(),
            "inter_latency_us" => m.inter_latency_us.is_some(),
            "intra_bandwidth_gbs" => m.intra_bandwidth_gbs.is_some(),
            "inter_bandwidth_gbs" => m.inter_bandwidth_gbs.is_some(),
            _ => m.bus_bandwidth_gbs.is_some(),
        }
    };
    let unused = |names: &[&str]| -> Result<(), TimingError> {
        match names.iter().find(|n| given(n)) {
            Some(n) => Err(field(
                format!("model.{n}"),
                format!("is not used by kind = \"{kind}\""),
            )),
            None => Ok(()),
        }
    };
    let gamma = |g: Option<f64>| -> Result<f64, TimingError> {
        Ok(positive("model.reduce_gbs", g)?.map_or(0.0, |gbs| 1.0 / (gbs * 1e9)))
    };
    let algo = match kind {
        "ideal" => {
            unused(&alpha_beta)?;
            unused(&topology)?;
            return Ok(Model::Ideal);
        }
        "ring" => Algo::Ring,
        "halving-doubling" => Algo::HalvingDoubling,
        "tree" => Algo::Tree,
        "topology" => {
            unused(&alpha_beta[..3])?;
            let nodes = required("model.nodes", kind, m.nodes)?;
            let rpn = required("model.ranks_per_node", kind, m.ranks_per_node)?;
            if nodes == 0 || rpn == 0 {
                return Err(field(
                    if nodes == 0 {
                        "model.nodes"
                    } else {
                        "model.ranks_per_node"
                    },
                    "must be at least 1",
                ));
            }
            let world = nodes.checked_mul(rpn).ok_or_else(|| {
                field(
                    "model.nodes",
                    "times model.ranks_per_node does not fit in 32 bits",
                )
            })?;
            if world < members {
                return Err(field(
                    "model.nodes",
                    format!(
                        "times model.ranks_per_node is {world}, fewer than the {members} members"
                    ),
                ));
            }
            let tree = match m.algorithm.as_deref().unwrap_or("ring") {
                "ring" => false,
                "tree" => true,
                other => {
                    return Err(field(
                        "model.algorithm",
                        format!("must be \"ring\" or \"tree\", not {other:?}"),
                    ))
                }
            };
            let lat = |name: &str, v: Option<f64>| -> Result<f64, TimingError> {
                Ok(us(non_negative(name, v)?.unwrap_or(0.0)))
            };
            let intra_bw = positive("model.intra_bandwidth_gbs", m.intra_bandwidth_gbs)?;
            let inter_bw = positive("model.inter_bandwidth_gbs", m.inter_bandwidth_gbs)?;
            let bus = positive("model.bus_bandwidth_gbs", m.bus_bandwidth_gbs)?;
            let bus_gbs =
                match (bus, intra_bw, inter_bw) {
                    (Some(b), _, _) => b,
                    (None, Some(intra), _) if nodes == 1 => intra,
                    (None, Some(intra), Some(inter)) => intra.min(inter),
                    (None, None, _) => return Err(field(
                        "model.intra_bandwidth_gbs",
                        "is required with kind = \"topology\" (or give model.bus_bandwidth_gbs)",
                    )),
                    (None, Some(_), None) => {
                        return Err(field(
                            "model.inter_bandwidth_gbs",
                            "is required with more than one node (or give model.bus_bandwidth_gbs)",
                        ))
                    }
                };
            return Ok(Model::Topology {
                tree,
                nodes,
                ranks_per_node: rpn,
                base: lat("model.base_latency_us", m.base_latency_us)?,
                intra: lat("model.intra_latency_us", m.intra_latency_us)?,
                inter: lat("model.inter_latency_us", m.inter_latency_us)?,
                bus_bw: bus_gbs * 1e9,
                gamma: gamma(m.reduce_gbs)?,
            });
        }
        other => {
            return Err(field(
                "model.kind",
                format!(
                    "must be one of \"ideal\", \"ring\", \"halving-doubling\", \"tree\", \
                     \"topology\", not {other:?}"
                ),
            ))
        }
    };
    unused(&topology)?;
    let world = m.world.unwrap_or(members);
    if world < members {
        return Err(field(
            "model.world",
            format!("is {world}, fewer than the {members} members"),
        ));
    }
    let alpha = us(required(
        "model.alpha_us",
        kind,
        non_negative("model.alpha_us", m.alpha_us)?,
    )?);
    let bw = required(
        "model.bandwidth_gbs",
        kind,
        positive("model.bandwidth_gbs", m.bandwidth_gbs)?,
    )?;
    Ok(Model::AlphaBeta {
        algo,
        world,
        alpha,
        beta: 1.0 / (bw * 1e9),
        gamma: gamma(m.reduce_gbs)?,
    })
}

fn check_delay(at: &str, d: &DelaySpec, members: u32) -> Result<DelayRule, TimingError> {
    let name = |f: &str| format!("{at}.{f}");
    let need = |f: &str, v: Option<f64>| -> Result<f64, TimingError> {
        let v = non_negative(&name(f), v)?;
        v.map(us)
            .ok_or_else(|| field(name(f), format!("is required with dist = \"{}\"", d.dist)))
    };
    let given: [(&str, bool); 7] = [
        ("us", d.us.is_some()),
        ("min_us", d.min_us.is_some()),
        ("max_us", d.max_us.is_some()),
        ("mean_us", d.mean_us.is_some()),
        ("stddev_us", d.stddev_us.is_some()),
        ("scale_us", d.scale_us.is_some()),
        ("shape", d.shape.is_some()),
    ];
    let only = |allowed: &[&str]| -> Result<(), TimingError> {
        match given.iter().find(|(n, g)| *g && !allowed.contains(n)) {
            Some((n, _)) => Err(field(
                name(n),
                format!("is not used by dist = \"{}\"", d.dist),
            )),
            None => Ok(()),
        }
    };
    let dist = match d.dist.as_str() {
        "constant" => {
            only(&["us"])?;
            Dist::Constant(need("us", d.us)?)
        }
        "uniform" => {
            only(&["min_us", "max_us"])?;
            let (min, max) = (need("min_us", d.min_us)?, need("max_us", d.max_us)?);
            if max < min {
                return Err(field(name("max_us"), "must be at least min_us"));
            }
            Dist::Uniform { min, max }
        }
        "normal" => {
            only(&["mean_us", "stddev_us"])?;
            Dist::Normal {
                mean: need("mean_us", d.mean_us)?,
                stddev: need("stddev_us", d.stddev_us)?,
            }
        }
        "pareto" => {
            only(&["scale_us", "shape"])?;
            let shape = positive(&name("shape"), d.shape)?
                .ok_or_else(|| field(name("shape"), "is required with dist = \"pareto\""))?;
            Dist::Pareto {
                scale: need("scale_us", d.scale_us)?,
                shape,
            }
        }
        other => {
            return Err(field(
                name("dist"),
                format!(
                "must be one of \"constant\", \"uniform\", \"normal\", \"pareto\", not {other:?}"
            ),
            ))
        }
    };
    if !(0.0..1.0).contains(&d.correlation) {
        return Err(field(
            name("correlation"),
            format!("must be in [0, 1), not {}", d.correlation),
        ));
    }
    let probability = d.probability.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&probability) {
        return Err(field(
            name("probability"),
            format!("must be in [0, 1], not {probability}"),
        ));
    }
    check_ranks(at, d.ranks.as_ref(), members)?;
    let burst = match (d.burst_enter, d.burst_leave) {
        (None, None) => None,
        (Some(enter), Some(leave)) => {
            for (f, v) in [("burst_enter", enter), ("burst_leave", leave)] {
                if !(v > 0.0 && v <= 1.0) {
                    return Err(field(name(f), format!("must be in (0, 1], not {v}")));
                }
            }
            Some((enter, leave))
        }
        (Some(_), None) => return Err(field(name("burst_leave"), "is required with burst_enter")),
        (None, Some(_)) => return Err(field(name("burst_enter"), "is required with burst_leave")),
    };
    Ok(DelayRule {
        ranks: d.ranks.clone(),
        dist,
        correlation: d.correlation,
        probability,
        live: false,
        burst,
        window: check_window(at, d.queue, d.from_collective, d.until_collective)?,
    })
}

/// Random numbers for one draw: SplitMix64 over a key made of the seed,
/// the rank, the queue, the arrival's index and the rule. The same key
/// always gives the same numbers, on any machine and any Rust version.
struct Draw(u64);

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Draw {
    fn new(seed: u64, rank: u32, queue: u16, index: u64, rule: u64) -> Draw {
        let mut k = splitmix(seed);
        for part in [u64::from(rank), u64::from(queue), index, rule] {
            k = splitmix(k ^ part);
        }
        Draw(k)
    }

    /// Uniform in [0, 1).
    fn uniform(&mut self) -> f64 {
        self.0 = splitmix(self.0);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller).
    fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 + 1e-9 * b.abs()
    }

    #[test]
    fn ring_allreduce_follows_the_formula() {
        let t = Timing::from_toml(
            "[model]\nkind = \"ring\"\nworld = 8\nalpha_us = 100\nbandwidth_gbs = 1\n",
            2,
        )
        .unwrap();
        let (a, b) = (100e-6, 1e-9);
        for n in [4u64, 4096, 16 << 20] {
            let want = 2.0 * 7.0 * a + 2.0 * (7.0 / 8.0) * n as f64 * b;
            assert!(
                close(t.model.seconds(Opcode::Allreduce, n), want),
                "{n}: {} vs {want}",
                t.model.seconds(Opcode::Allreduce, n)
            );
        }
        // Ring allreduce = ring reduce-scatter + ring allgather (of blocks
        // of n / p bytes).
        let rs = t.model.seconds(Opcode::ReduceScatter, 1024);
        let ag = t.model.seconds(Opcode::Allgather, 1024);
        assert!(close(rs + ag, t.model.seconds(Opcode::Allreduce, 8 * 1024)));
        assert!(close(t.model.seconds(Opcode::Barrier, 0), 14.0 * a));
        assert_eq!(t.model.world(), 8);
    }

    #[test]
    fn other_algorithms_follow_their_formulas() {
        let mk = |kind: &str| {
            Timing::from_toml(
                &format!(
                    "[model]\nkind = \"{kind}\"\nworld = 6\nalpha_us = 10\n\
                     bandwidth_gbs = 2\nreduce_gbs = 4\n"
                ),
                6,
            )
            .unwrap()
            .model
        };
        let (a, b, g, n) = (10e-6, 0.5e-9, 0.25e-9, 1e6);
        let (p, l, f) = (6.0, 3.0, 5.0 / 6.0);
        let hd = mk("halving-doubling");
        assert!(close(
            hd.seconds(Opcode::Allreduce, 1_000_000),
            2.0 * l * a + 2.0 * f * n * b + f * n * g
        ));
        let tree = mk("tree");
        assert!(close(
            tree.seconds(Opcode::Allreduce, 1_000_000),
            2.0 * l * (a + n * b) + l * n * g
        ));
        assert!(close(
            tree.seconds(Opcode::Broadcast, 1_000_000),
            l * (a + n * b)
        ));
        let ring = mk("ring");
        assert!(close(
            ring.seconds(Opcode::Allgather, 1000),
            (p - 1.0) * a + f * p * 1000.0 * b
        ));
        // One modelled rank: nothing to move.
        let one = Timing::from_toml(
            "[model]\nkind = \"tree\"\nalpha_us = 10\nbandwidth_gbs = 1\n",
            1,
        )
        .unwrap();
        assert_eq!(one.model.seconds(Opcode::Allreduce, 1 << 20), 0.0);
        assert_eq!(lg(1), 0.0);
        assert_eq!(lg(2), 1.0);
        assert_eq!(lg(5), 3.0);
        assert_eq!(lg(8), 3.0);
    }

    #[test]
    fn topology_model_is_nccl_style() {
        let t = Timing::from_toml(
            "[model]\nkind = \"topology\"\nnodes = 8\nranks_per_node = 8\n\
             base_latency_us = 8.4\nintra_latency_us = 0.6\ninter_latency_us = 5\n\
             intra_bandwidth_gbs = 150\ninter_bandwidth_gbs = 50\n",
            2,
        )
        .unwrap();
        assert_eq!(t.model.world(), 64);
        let n = 64.0 * 1024.0 * 1024.0;
        let steps = 2.0 * 63.0;
        let inter = 2.0 * 7.0;
        let lat = 8.4e-6 + (steps - inter) * 0.6e-6 + inter * 5e-6;
        let want = lat + n / (50e9 * 64.0 / steps);
        assert!(close(t.model.seconds(Opcode::Allreduce, n as u64), want));
        let tree = Timing::from_toml(
            "[model]\nkind = \"topology\"\nalgorithm = \"tree\"\nnodes = 4\n\
             ranks_per_node = 2\nintra_latency_us = 1\ninter_latency_us = 4\n\
             bus_bandwidth_gbs = 10\n",
            2,
        )
        .unwrap();
        let want = 2.0 * (1e-6 + 2.0 * 4e-6) + 1000.0 / 5e9;
        assert!(close(tree.model.seconds(Opcode::Allreduce, 1000), want));
    }

    #[test]
    fn per_rank_completions_end_with_the_model_and_follow_the_schedule() {
        let mk = |kind: &str, p: u32| {
            Timing::from_toml(
                &format!(
                    "[model]\nkind = \"{kind}\"\nworld = {p}\nalpha_us = 10\n\
                     bandwidth_gbs = 2\nreduce_gbs = 4\n"
                ),
                1,
            )
            .unwrap()
            .model
        };
        let ops = [
            Opcode::Allreduce,
            Opcode::Broadcast,
            Opcode::Reduce,
            Opcode::Allgather,
            Opcode::ReduceScatter,
            Opcode::Barrier,
        ];
        for kind in ["ring", "halving-doubling", "tree"] {
            for p in 2..=17u32 {
                let m = mk(kind, p);
                for op in ops {
                    for root in [0, p / 2, p - 1] {
                        let total = m.seconds(op, 1000);
                        let per: Option<Vec<f64>> =
                            (0..p).map(|r| m.rank_seconds(op, 1000, root, r)).collect();
                        let Some(per) = per else {
                            continue;
                        };
                        // Nobody after the model; the latest rank at it.
                        let latest = per.iter().copied().fold(0.0, f64::max);
                        assert!(close(latest, total), "{kind} p={p} {op} root={root}");
                        assert!(per.iter().all(|&t| t > 0.0 && t <= total + 1e-15));
                    }
                }
            }
        }
        let (a, b, g, n) = (10e-6, 0.5e-9, 0.25e-9, 1000.0);
        // Ring broadcast, a chain from root 2 over 8 ranks: rank 3 (one
        // hop) has forwarded the data at 2a + Nb, rank 1 (the chain's
        // end) has it at 7a + Nb, the root has sent it at a + Nb.
        let ring = mk("ring", 8);
        let at = |op, root, r| ring.rank_seconds(op, 1000, root, r).unwrap();
        assert!(close(at(Opcode::Broadcast, 2, 2), a + n * b));
        assert!(close(at(Opcode::Broadcast, 2, 3), 2.0 * a + n * b));
        assert!(close(at(Opcode::Broadcast, 2, 1), 7.0 * a + n * b));
        // Ring reduce to root 2: the chain starts at rank 3.
        assert!(close(at(Opcode::Reduce, 2, 3), a + n * (b + g)));
        assert!(close(at(Opcode::Reduce, 2, 2), 7.0 * a + n * (b + g)));
        // A synchronous ring allreduce: every rank in every step.
        assert_eq!(ring.rank_seconds(Opcode::Allreduce, 1000, 0, 3), None);
        // Binomial reduce over 8 ranks: odd ranks send in step 1, ranks 2
        // and 6 in step 2, rank 4 in step 3, the root has it after step 3.
        let tree = mk("tree", 8);
        let step = a + n * (b + g);
        let at = |op, root, r| tree.rank_seconds(op, 1000, root, r).unwrap();
        for (r, s) in [(1, 1.0), (3, 1.0), (2, 2.0), (6, 2.0), (4, 3.0), (0, 3.0)] {
            assert!(close(at(Opcode::Reduce, 0, r), s * step), "rank {r}");
        }
        // Relative to the root: root 5 makes rank 6 the first sender.
        assert!(close(at(Opcode::Reduce, 5, 6), step));
        // Binomial broadcast over 6 ranks: ranks 2 and 3 have nobody to
        // send to in step 3, so they are done after step 2.
        let tree6 = mk("tree", 6);
        let bstep = a + n * b;
        for (r, s) in [(0, 3.0), (1, 3.0), (2, 2.0), (3, 2.0), (4, 3.0), (5, 3.0)] {
            let got = tree6.rank_seconds(Opcode::Broadcast, 1000, 0, r).unwrap();
            assert!(close(got, s * bstep), "rank {r}: {got}");
        }
        // A tree allreduce: the whole reduce, then the rank's broadcast step.
        let got = tree6.rank_seconds(Opcode::Allreduce, 1000, 77, 2).unwrap();
        assert!(close(got, 3.0 * step + 2.0 * bstep), "{got}");
        // Models without a per-rank schedule.
        assert_eq!(Model::Ideal.rank_seconds(Opcode::Broadcast, 8, 0, 1), None);
        assert_eq!(
            mk("halving-doubling", 8).rank_seconds(Opcode::Broadcast, 8, 0, 1),
            None
        );
    }

    #[test]
    fn bandwidth_factors_slow_the_bytes_only_and_repeat_with_the_seed() {
        let text = "seed = 5\n[model]\nkind = \"ring\"\nworld = 4\nalpha_us = 100\n\
                    bandwidth_gbs = 1\n[[bandwidth]]\nranks = [1]\nfactor = 0.25\n\
                    [[bandwidth]]\nranks = [0]\nfactor = 0.5\nprobability = 0.5\n\
                    queue = 1\nfrom_collective = 10\nuntil_collective = 1010\n";
        let t = Timing::from_toml(text, 2).unwrap();
        let s = t.slowdown(0, 0, 0..2).unwrap();
        assert_eq!(s.factor, 0.25);
        assert_eq!(s.ranks, vec![(1, 0.25)]);
        let slow = t.model.with_bandwidth_factor(s.factor);
        let (a, b, m) = (100e-6, 1e-9, 4096.0);
        let want = 6.0 * a + 2.0 * 0.75 * m * b / 0.25;
        assert!(close(slow.seconds(Opcode::Allreduce, 4096), want));
        // Rank 0's rule: only on queue 1, collectives 10 to 1009, half of
        // them, the same ones for the same seed.
        assert_eq!(t.slowdown(1, 9, 0..1), None);
        assert_eq!(t.slowdown(0, 500, 0..1), None);
        let hits: Vec<u64> = (0..1100)
            .filter(|&c| t.slowdown(1, c, 0..1).is_some())
            .collect();
        assert!(hits.iter().all(|&c| (10..1010).contains(&c)));
        assert!((400..600).contains(&hits.len()), "{}", hits.len());
        let again = Timing::from_toml(text, 2).unwrap();
        let hits2: Vec<u64> = (0..1100)
            .filter(|&c| again.slowdown(1, c, 0..1).is_some())
            .collect();
        assert_eq!(hits, hits2);
        // Both ranks slowed: the collective runs at the slower; one rank's
        // rules multiply.
        let s = t.slowdown(1, hits[0], 0..2).unwrap();
        assert_eq!((s.factor, s.ranks), (0.25, vec![(0, 0.5), (1, 0.25)]));
        let t = Timing::from_toml(
            "[model]\nkind = \"topology\"\nnodes = 2\nranks_per_node = 1\n\
             bus_bandwidth_gbs = 10\n[[bandwidth]]\nfactor = 0.5\n[[bandwidth]]\nfactor = 0.5\n",
            2,
        )
        .unwrap();
        let s = t.slowdown(0, 0, 0..2).unwrap();
        assert_eq!(s.factor, 0.25);
        let slow = t.model.with_bandwidth_factor(s.factor);
        assert!(close(
            slow.seconds(Opcode::Broadcast, 1000),
            4.0 * t.model.seconds(Opcode::Broadcast, 1000)
        ));
        assert_eq!(Timing::from_toml("", 2).unwrap().slowdown(0, 0, 0..2), None);
    }

    #[test]
    fn windows_limit_delays_to_a_range_of_collectives() {
        let t = Timing::from_toml(
            "[[delay]]\ndist = \"constant\"\nus = 1000\nfrom_collective = 3\n\
             until_collective = 5\n[[delay]]\ndist = \"constant\"\nus = 10\nqueue = 1\n",
            1,
        )
        .unwrap();
        let d = draws(&t, 0, 8);
        let want: Vec<Duration> = (0..8)
            .map(|i| Duration::from_micros(if (3..5).contains(&i) { 1000 } else { 0 }))
            .collect();
        assert_eq!(d, want);
        let mut last = vec![0.0; t.state_len()];
        assert_eq!(t.delay(0, 1, 0, &mut last), Duration::from_micros(10));
        assert_eq!(t.delay(0, 1, 4, &mut last), Duration::from_micros(1010));
    }

    #[test]
    fn withheld_completions_are_planned_apart_from_failures() {
        let t = Timing::from_toml(
            "[[fail]]\nstatus = \"withheld\"\nrank = 1\nqueue = 2\ncollective = 7\n",
            2,
        )
        .unwrap();
        assert!(!t.is_ideal());
        assert_eq!(t.withheld(2, 7), Some(1));
        assert_eq!(t.withheld(2, 6), None);
        assert_eq!(t.withheld(0, 7), None);
        assert_eq!(t.failure(2, 7), None);
    }

    #[test]
    fn default_is_ideal_and_costs_nothing() {
        let t = Timing::from_toml("", 4).unwrap();
        assert_eq!(t.model, Model::Ideal);
        assert!(t.is_ideal());
        assert_eq!(t.model.time(Opcode::Allreduce, 1 << 30), Duration::ZERO);
    }

    #[test]
    fn bad_files_name_the_field() {
        let cases: &[(&str, &str)] = &[
            ("[model]\nkind = \"ring\"\nbandwidth_gbs = 1\n", "model.alpha_us is required"),
            ("[model]\nkind = \"ring\"\nalpha_us = 1\n", "model.bandwidth_gbs is required"),
            (
                "[model]\nkind = \"ring\"\nalpha_us = -1\nbandwidth_gbs = 1\n",
                "model.alpha_us must be a number >= 0",
            ),
            (
                "[model]\nkind = \"ring\"\nalpha_us = 1\nbandwidth_gbs = 1\nworld = 1\n",
                "model.world is 1, fewer than the 2 members",
            ),
            ("[model]\nkind = \"mesh\"\n", "model.kind must be one of"),
            (
                "[model]\nkind = \"ring\"\nalpha_us = 1\nbandwidth_gbs = 1\nnodes = 2\n",
                "model.nodes is not used by kind = \"ring\"",
            ),
            ("[model]\nkind = \"ring\"\nalpha = 1\n", "unknown field `alpha`"),
            ("[model]\nkind = \"topology\"\nnodes = 2\n", "model.ranks_per_node is required"),
            (
                "[model]\nkind = \"topology\"\nnodes = 2\nranks_per_node = 2\nintra_bandwidth_gbs = 1\n",
                "model.inter_bandwidth_gbs is required",
            ),
            ("[[delay]]\ndist = \"constant\"\n", "delay[0].us is required"),
            (
                "[[delay]]\ndist = \"uniform\"\nmin_us = 5\nmax_us = 1\n",
                "delay[0].max_us must be at least min_us",
            ),
            (
                "[[delay]]\ndist = \"constant\"\nus = 1\nshape = 2\n",
                "delay[0].shape is not used",
            ),
            (
                "[[delay]]\ndist = \"constant\"\nus = 1\nranks = [2]\n",
                "delay[0].ranks names rank 2",
            ),
            (
                "[[delay]]\ndist = \"normal\"\nmean_us = 1\nstddev_us = 1\ncorrelation = 1\n",
                "delay[0].correlation must be in [0, 1)",
            ),
            ("[[delay]]\ndist = \"zipf\"\n", "delay[0].dist must be one of"),
            (
                "[[fail]]\nstatus = \"crash\"\nrank = 0\ncollective = 1\n",
                "fail[0].status must be",
            ),
            (
                "[[fail]]\nstatus = \"timeout\"\nrank = 9\ncollective = 1\n",
                "fail[0].rank is 9",
            ),
            ("spin_us = -3\n", "spin_us must be"),
            ("overhead_us = 50\n", "overhead_us needs a [model]"),
            (
                "overhead_us = -1\n[model]\nkind = \"ring\"\nalpha_us = 1\nbandwidth_gbs = 1\n",
                "overhead_us must be a number >= 0",
            ),
            (
                "[[bandwidth]]\nfactor = 0.5\n",
                "bandwidth[0].factor needs a [model]",
            ),
            (
                "[model]\nkind = \"ring\"\nalpha_us = 1\nbandwidth_gbs = 1\n[[bandwidth]]\nfactor = 0\n",
                "bandwidth[0].factor must be a number in (0, 1e6]",
            ),
            (
                "[model]\nkind = \"ring\"\nalpha_us = 1\nbandwidth_gbs = 1\n[[bandwidth]]\n",
                "missing field `factor`",
            ),
            (
                "[model]\nkind = \"ring\"\nalpha_us = 1\nbandwidth_gbs = 1\n[[bandwidth]]\n\
                 factor = 0.5\nranks = [4]\n",
                "bandwidth[0].ranks names rank 4",
            ),
            (
                "[model]\nkind = \"ring\"\nalpha_us = 1\nbandwidth_gbs = 1\n[[bandwidth]]\n\
                 factor = 0.5\nprobability = 2\n",
                "bandwidth[0].probability must be in [0, 1]",
            ),
            (
                "[model]\nkind = \"ring\"\nalpha_us = 1\nbandwidth_gbs = 1\n[[bandwidth]]\n\
                 factor = 0.5\nlink = [0, 1]\n",
                "unknown field `link`",
            ),
            (
                "[[delay]]\ndist = \"constant\"\nus = 1\nfrom_collective = 5\nuntil_collective = 5\n",
                "delay[0].until_collective is 5, not after from_collective (5)",
            ),
            (
                "[[delay]]\ndist = \"constant\"\nus = 1\nfrom_collective = -1\n",
                "from_collective",
            ),
            (
                "[[fail]]\nstatus = \"withheld\"\nrank = 2\ncollective = 0\n",
                "fail[0].rank is 2",
            ),
            ("sed = 3\n", "unknown field `sed`"),
        ];
        for (text, want) in cases {
            let e = Timing::from_toml(text, 2).expect_err(text).to_string();
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }

    #[test]
    fn json_files_parse_too() {
        let dir = std::env::temp_dir().join(format!("dmlc-timing-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.json");
        std::fs::write(
            &path,
            r#"{"seed": 3, "model": {"kind": "ring", "alpha_us": 5, "bandwidth_gbs": 10},
                "fail": [{"status": "peer-lost", "rank": 1, "collective": 4}]}"#,
        )
        .unwrap();
        let t = Timing::load(&path, 2).unwrap();
        assert_eq!(t.seed, 3);
        assert_eq!(
            t.failure(0, 4),
            Some(FailRule {
                status: Status::PeerLost,
                rank: 1,
                queue: 0,
                collective: 4
            })
        );
        assert_eq!(t.failure(0, 3), None);
        assert_eq!(t.failure(1, 4), None);
        let bad = dir.join("bad.toml");
        std::fs::write(&bad, "[model]\nkind = 3\n").unwrap();
        let e = Timing::load(&bad, 2).unwrap_err().to_string();
        assert!(e.contains("bad.toml") && e.contains("kind"), "{e}");
        let missing = Timing::load(&dir.join("none.toml"), 2).unwrap_err();
        assert!(missing.to_string().contains("cannot read"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn draws(t: &Timing, rank: u32, n: u64) -> Vec<Duration> {
        let mut last = vec![0.0; t.state_len()];
        (0..n).map(|i| t.delay(rank, 0, i, &mut last)).collect()
    }

    #[test]
    fn delays_repeat_with_the_seed_and_follow_their_distribution() {
        let text = |seed: u64| {
            format!(
                "seed = {seed}\n[[delay]]\nranks = [1]\ndist = \"uniform\"\nmin_us = 100\nmax_us = 300\n\
                 [[delay]]\nranks = [1]\ndist = \"normal\"\nmean_us = 50\nstddev_us = 10\n"
            )
        };
        let a = Timing::from_toml(&text(7), 2).unwrap();
        let b = Timing::from_toml(&text(7), 2).unwrap();
        let c = Timing::from_toml(&text(8), 2).unwrap();
        let da = draws(&a, 1, 2000);
        assert_eq!(da, draws(&b, 1, 2000));
        assert_ne!(da, draws(&c, 1, 2000));
        // Rank 0 is not named: never delayed.
        assert!(draws(&a, 0, 100).iter().all(|d| d.is_zero()));
        let secs: Vec<f64> = da.iter().map(Duration::as_secs_f64).collect();
        let mean = secs.iter().sum::<f64>() / secs.len() as f64;
        // Uniform(100, 300) + Normal(50, 10): mean 250 us.
        assert!((mean - 250e-6).abs() < 10e-6, "{mean}");
        assert!(secs.iter().all(|&s| s > 50e-6 && s < 400e-6));
    }

    #[test]
    fn pareto_constant_probability_and_correlation() {
        let t = Timing::from_toml(
            "[[delay]]\ndist = \"pareto\"\nscale_us = 10\nshape = 2\n",
            1,
        )
        .unwrap();
        let d = draws(&t, 0, 4000);
        assert!(d.iter().all(|x| *x >= Duration::from_micros(10)));
        let median = {
            let mut s = d.clone();
            s.sort();
            s[s.len() / 2].as_secs_f64()
        };
        // Median of Pareto(x_m, a) is x_m * 2^(1/a) = 14.1 us.
        assert!((median - 14.14e-6).abs() < 1.5e-6, "{median}");

        let t = Timing::from_toml(
            "[[delay]]\ndist = \"constant\"\nus = 1000\nprobability = 0.25\n",
            1,
        )
        .unwrap();
        let hit = draws(&t, 0, 4000).iter().filter(|d| !d.is_zero()).count();
        assert!((800..1200).contains(&hit), "{hit}");

        // Correlated draws change less from one to the next.
        let step = |corr: f64| {
            let t = Timing::from_toml(
                &format!(
                    "[[delay]]\ndist = \"uniform\"\nmin_us = 0\nmax_us = 1000\ncorrelation = {corr}\n"
                ),
                1,
            )
            .unwrap();
            let d = draws(&t, 0, 2000);
            d.windows(2)
                .map(|w| (w[0].as_secs_f64() - w[1].as_secs_f64()).abs())
                .sum::<f64>()
        };
        assert!(step(0.9) < step(0.0) / 3.0);
    }

    #[test]
    fn bursts_come_in_runs() {
        let t = Timing::from_toml(
            "[[delay]]\ndist = \"constant\"\nus = 1000\nburst_enter = 0.05\nburst_leave = 0.2\n",
            1,
        )
        .unwrap();
        let d: Vec<bool> = draws(&t, 0, 8000).iter().map(|x| !x.is_zero()).collect();
        let bad = d.iter().filter(|b| **b).count() as f64 / d.len() as f64;
        // Stationary share of the bad state: 0.05 / (0.05 + 0.2) = 0.2.
        assert!((0.14..0.26).contains(&bad), "{bad}");
        let runs = d.windows(2).filter(|w| w[1] && !w[0]).count().max(1);
        let mean_run = d.iter().filter(|b| **b).count() as f64 / runs as f64;
        // Mean burst length 1 / 0.2 = 5 arrivals.
        assert!((3.5..6.5).contains(&mean_run), "{mean_run}");
        let e = Timing::from_toml(
            "[[delay]]\ndist = \"constant\"\nus = 1\nburst_enter = 0.5\n",
            1,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("delay[0].burst_leave is required"), "{e}");
    }
}
