//! The formulas: how long a collective takes on the modelled cluster
//! ([`Model`]: alpha-beta-gamma costs per algorithm, or NCCL-style over a
//! topology), and when each modelled rank finishes. The formulas are
//! written out in docs/latency-experiments.md.

use std::time::Duration;

use virtio_dmlc::Opcode;

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
pub(super) fn lg(p: u32) -> f64 {
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
pub(super) fn secs(s: f64) -> Duration {
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
