//! The checked configuration ([`Timing`]) and its impairments: the delay,
//! bandwidth, failure and withhold rules, and the seeded counter-based
//! draws that decide what each arrival or collective gets.

use std::time::Duration;

use virtio_dmlc::Status;

use super::formulas::Model;

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

impl Timing {
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
