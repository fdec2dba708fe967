//! Unit tests of the timing model: the formulas, reading and checking
//! timing files, and the impairments' draws.

use std::time::Duration;

use virtio_dmlc::{Opcode, Status};

use super::formulas::lg;
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
