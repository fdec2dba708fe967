//! All-to-all, gather and scatter (spec 5.X.6.13.5, feature bit 3), with
//! equal blocks and with counts per rank, in place and not, on the group
//! and on a communicator made by a split; tables that disagree. Expected
//! outputs are built here from each member's input, element by element.

use virtio_dmlc::comm::{CommOpcode, VirtioDmlcRespComm, MISMATCH_TABLE, VIRTIO_DMLC_F_BLOCKS};
use virtio_dmlc::{mismatch, Status, FLAG_IN_PLACE};

use super::comms::{creq, f32s, post_onto, read_f32s, split, status, FEATURES};
use super::*;

/// `n` members whose drivers negotiated bits 1 to 3.
fn blocks_world(n: u32) -> World {
    let w = World::new(config(n));
    for r in 0..n {
        w.group
            .set_member_features(r, FEATURES | 1 << VIRTIO_DMLC_F_BLOCKS);
    }
    w
}

/// Element `k` of the block that member `i` gives member `j`: every value
/// says where it came from.
fn val(i: usize, j: usize, k: usize) -> f32 {
    (100 * i + 10 * j + k) as f32
}

fn le64s(v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// One member's request.
struct Req {
    rank: u32,
    opcode: CommOpcode,
    count: u64,
    root: u32,
    in_place: bool,
    table: Vec<u8>,
    input: Vec<f32>,
    /// The output buffer before the request (in place: with the input in it).
    output: Vec<f32>,
}

/// Posts every member's request on communicator `comm`, then returns each
/// one's response and output, in the order given.
fn run_all(w: &mut World, comm: u32, reqs: &[Req]) -> Vec<(VirtioDmlcRespComm, Vec<f32>)> {
    let posted: Vec<_> = reqs
        .iter()
        .map(|q| {
            let mut h = creq(q.opcode.raw(), comm, 0, 0, q.count, 0, q.root, &q.table);
            if q.in_place {
                h.base.flags = FLAG_IN_PLACE.into();
            }
            post_onto(
                w,
                q.rank,
                0,
                &h,
                &q.table,
                &f32s(&q.input),
                &f32s(&q.output),
            )
        })
        .collect();
    reqs.iter()
        .zip(&posted)
        .map(|(q, x)| {
            let (_, resp) = w.wait_comm(&x.p);
            let out = x.out.map(|d| read_f32s(w, q.rank, d)).unwrap_or_default();
            (resp, out)
        })
        .collect()
}

#[test]
fn alltoall_and_alltoallv_give_each_block_to_its_rank() {
    let n = 3;
    let mut w = blocks_world(n);
    let c = 2;
    let reqs: Vec<Req> = (0..n as usize)
        .map(|i| Req {
            rank: i as u32,
            opcode: CommOpcode::Alltoall,
            count: c as u64,
            root: 0,
            in_place: false,
            table: Vec::new(),
            input: (0..n as usize)
                .flat_map(|j| (0..c).map(move |k| val(i, j, k)))
                .collect(),
            output: vec![0.0; n as usize * c],
        })
        .collect();
    for (j, (resp, out)) in run_all(&mut w, 0, &reqs).into_iter().enumerate() {
        assert_eq!(status(&resp), (Status::Ok, 0));
        let want: Vec<f32> = (0..n as usize)
            .flat_map(|i| (0..c).map(move |k| val(i, j, k)))
            .collect();
        assert_eq!(out, want, "rank {j}");
    }

    // Counts per pair, some of them 0: send[i][j] elements from i to j.
    let send = |i: usize, j: usize| ((i + 2 * j) % 3) as u64;
    let table = |i: usize, bad: bool| {
        let mut t: Vec<u64> = (0..3).map(|j| send(i, j)).collect();
        t.extend((0..3).map(|j| send(j, i) + u64::from(bad && j == 0)));
        le64s(&t)
    };
    let reqv = |i: usize, bad: bool| Req {
        rank: i as u32,
        opcode: CommOpcode::Alltoallv,
        // Not compared for the v forms.
        count: i as u64,
        root: 0,
        in_place: false,
        table: table(i, bad),
        input: (0..3)
            .flat_map(|j| (0..send(i, j) as usize).map(move |k| val(i, j, k)))
            .collect(),
        output: vec![
            -1.0;
            (0..3)
                .map(|j| send(j, i) + u64::from(bad && j == 0))
                .sum::<u64>() as usize
        ],
    };
    let got = run_all(
        &mut w,
        0,
        &(0..3).map(|i| reqv(i, false)).collect::<Vec<_>>(),
    );
    for (j, (resp, out)) in got.into_iter().enumerate() {
        assert_eq!(status(&resp), (Status::Ok, 0));
        let want: Vec<f32> = (0..3)
            .flat_map(|i| (0..send(i, j) as usize).map(move |k| val(i, j, k)))
            .collect();
        assert_eq!(out, want, "rank {j}");
    }
    // Rank 2 expects one element too many from rank 0: every member gets
    // MISMATCH / TABLE naming the lowest rank of a disagreeing pair, and
    // no output changes.
    let reqs: Vec<Req> = (0..3).map(|i| reqv(i, i == 2)).collect();
    for (resp, out) in run_all(&mut w, 0, &reqs) {
        assert_eq!(status(&resp), (Status::Mismatch, MISMATCH_TABLE));
        assert_eq!(resp.base.peer.get(), 0);
        assert!(out.iter().all(|&x| x == -1.0));
    }
}

#[test]
fn gather_and_scatter_with_equal_blocks_and_counts_per_rank() {
    let n = 3usize;
    let mut w = blocks_world(n as u32);
    let root = 1usize;
    let c = 2usize;
    for in_place in [false, true] {
        // Gather: the root's block root keeps its contents in place.
        let reqs: Vec<Req> = (0..n)
            .map(|i| {
                let input: Vec<f32> = (0..c).map(|k| val(i, root, k)).collect();
                let (inp, output) = match (i == root, in_place) {
                    (true, true) => {
                        let mut b = vec![-1.0; n * c];
                        b[root * c..root * c + c].copy_from_slice(&input);
                        (Vec::new(), b)
                    }
                    (true, false) => (input, vec![-1.0; n * c]),
                    (false, _) => (input, Vec::new()),
                };
                Req {
                    rank: i as u32,
                    opcode: CommOpcode::Gather,
                    count: c as u64,
                    root: root as u32,
                    in_place,
                    table: Vec::new(),
                    input: inp,
                    output,
                }
            })
            .collect();
        let got = run_all(&mut w, 0, &reqs);
        assert!(got.iter().all(|(r, _)| status(r) == (Status::Ok, 0)));
        let want: Vec<f32> = (0..n)
            .flat_map(|i| (0..c).map(move |k| val(i, root, k)))
            .collect();
        assert_eq!(got[root].1, want, "gather, in place {in_place}");

        // Scatter: block j of the root's data to rank j.
        let all: Vec<f32> = (0..n)
            .flat_map(|j| (0..c).map(move |k| val(root, j, k)))
            .collect();
        let reqs: Vec<Req> = (0..n)
            .map(|j| {
                let (input, output) = match (j == root, in_place) {
                    (true, true) => (Vec::new(), all.clone()),
                    (true, false) => (all.clone(), vec![-1.0; c]),
                    (false, _) => (Vec::new(), vec![-1.0; c]),
                };
                Req {
                    rank: j as u32,
                    opcode: CommOpcode::Scatter,
                    count: c as u64,
                    root: root as u32,
                    in_place,
                    table: Vec::new(),
                    input,
                    output,
                }
            })
            .collect();
        let got = run_all(&mut w, 0, &reqs);
        for (j, (r, out)) in got.iter().enumerate() {
            assert_eq!(status(r), (Status::Ok, 0));
            let want: Vec<f32> = (0..c).map(|k| val(root, j, k)).collect();
            if j == root && in_place {
                // The whole buffer, unchanged: its block is its output.
                assert_eq!(*out, all);
            } else {
                assert_eq!(*out, want, "scatter to {j}, in place {in_place}");
            }
        }
    }

    // Counts per rank: 2, 0 and 3 elements.
    let counts = [2usize, 0, 3];
    let total: usize = counts.iter().sum();
    let table = le64s(&counts.map(|x| x as u64));
    let gatherv = |own: [usize; 3]| -> Vec<Req> {
        (0..n)
            .map(|i| Req {
                rank: i as u32,
                opcode: CommOpcode::Gatherv,
                count: own[i] as u64,
                root: root as u32,
                in_place: false,
                table: if i == root { table.clone() } else { Vec::new() },
                input: (0..own[i]).map(|k| val(i, root, k)).collect(),
                output: if i == root {
                    vec![-1.0; total]
                } else {
                    Vec::new()
                },
            })
            .collect()
    };
    let got = run_all(&mut w, 0, &gatherv(counts));
    assert!(got.iter().all(|(r, _)| status(r) == (Status::Ok, 0)));
    let want: Vec<f32> = (0..n)
        .flat_map(|i| (0..counts[i]).map(move |k| val(i, root, k)))
        .collect();
    assert_eq!(got[root].1, want);
    // Rank 2 gives 2 where the root's table says 3.
    for (r, _) in run_all(&mut w, 0, &gatherv([2, 0, 2])) {
        assert_eq!(status(&r), (Status::Mismatch, MISMATCH_TABLE));
        assert_eq!(r.base.peer.get(), 2);
    }
    let all: Vec<f32> = (0..n)
        .flat_map(|j| (0..counts[j]).map(move |k| val(root, j, k)))
        .collect();
    let reqs: Vec<Req> = (0..n)
        .map(|j| Req {
            rank: j as u32,
            opcode: CommOpcode::Scatterv,
            count: counts[j] as u64,
            root: root as u32,
            in_place: false,
            table: if j == root { table.clone() } else { Vec::new() },
            input: if j == root { all.clone() } else { Vec::new() },
            output: vec![-1.0; counts[j]],
        })
        .collect();
    for (j, (r, out)) in run_all(&mut w, 0, &reqs).into_iter().enumerate() {
        assert_eq!(status(&r), (Status::Ok, 0));
        let want: Vec<f32> = (0..counts[j]).map(|k| val(root, j, k)).collect();
        assert_eq!(out, want);
    }
}

#[test]
fn block_collectives_on_a_split_communicator_use_its_ranks() {
    let mut w = blocks_world(4);
    // Odd ranks in reverse: group rank 3 is rank 0, group rank 1 rank 1.
    let resps = split(&mut w, 0, &[0, 1, 2, 3], &[(0, 0), (1, 9), (0, 0), (1, 1)]);
    let odd = resps[1].comm.get();
    assert_eq!(resps[3].comm_rank.get(), 0);
    // Gather to its rank 1 (group rank 1): rank 0's block first.
    let reqs: Vec<Req> = [(3u32, 0usize), (1, 1)]
        .iter()
        .map(|&(g, r)| Req {
            rank: g,
            opcode: CommOpcode::Gather,
            count: 1,
            root: 1,
            in_place: false,
            table: Vec::new(),
            input: vec![val(g as usize, 0, 0)],
            output: if r == 1 { vec![0.0; 2] } else { Vec::new() },
        })
        .collect();
    let got = run_all(&mut w, odd, &reqs);
    assert_eq!(got[1].1, vec![val(3, 0, 0), val(1, 0, 0)]);
    // A root that differs: MISMATCH / ROOT, naming the member in the
    // communicator's ranks.
    // Rank 1 says the root is 0, rank 0 says 1: neither is the root in its
    // own request, so neither offers an output.
    let mut reqs = reqs;
    reqs[1].root = 0;
    reqs[1].output = Vec::new();
    let got = run_all(&mut w, odd, &reqs);
    for (r, _) in &got {
        assert_eq!(status(r).0, Status::Mismatch);
        assert_ne!(r.base.detail.get() & mismatch::ROOT, 0);
    }
}
