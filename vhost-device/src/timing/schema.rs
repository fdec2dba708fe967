//! The schema: the timing file as written (TOML or JSON, read with
//! serde), how it is read and checked into a [`Timing`], and the errors
//! that name the field refused.

use std::path::Path;
use std::time::Duration;

use serde::Deserialize;
use thiserror::Error;
use virtio_dmlc::Status;

use super::formulas::{secs, Algo, Model};
use super::impairments::{BandwidthRule, DelayRule, Dist, FailRule, Timing, Window, WithholdRule};

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
}

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
