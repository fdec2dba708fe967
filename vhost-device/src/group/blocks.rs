//! All-to-all, gather and scatter (spec 5.X.6.13.5, feature bit 3): the
//! tables' agreement and the copies each one makes. Every block moves once,
//! from the giver's buffers into the taker's.

use virtio_dmlc::comm::{self, CommOpcode};

use super::pieces::{BufAt, Piece};
use super::state::Arrival;

/// The copies of block collective `op` over `arrivals` (all of them, in
/// communicator rank order, headers agreeing), or the index of the lowest
/// member whose table or count disagrees (`MISMATCH` / `TABLE`).
pub(super) fn plan(arrivals: &[Arrival], op: CommOpcode) -> Result<Vec<Piece>, usize> {
    let reference = &arrivals[0].req;
    let es = reference.elem_size();
    let n = arrivals.len();
    let root = reference.root as usize;
    let table = |i: usize| -> Vec<u64> {
        arrivals[i]
            .req
            .comm
            .as_ref()
            .map_or_else(Vec::new, |c| comm::counts(&c.table).collect())
    };
    let count = |i: usize| arrivals[i].req.count as usize;
    // Byte offsets of the blocks laid one after the other, by counts.
    let offsets = |counts: &[u64]| -> Vec<usize> {
        let mut at = 0;
        counts
            .iter()
            .map(|&c| {
                let o = at;
                at += c as usize * es;
                o
            })
            .collect()
    };
    let input = |i: usize, base: usize| BufAt {
        member: i,
        output: false,
        base,
    };
    let output = |i: usize, base: usize| BufAt {
        member: i,
        output: true,
        base,
    };
    let copy = |src: BufAt, dst: BufAt, len: usize| Piece::Copy {
        src,
        dsts: vec![dst],
        len,
    };
    let root_in_place = arrivals[root].req.in_place_offset.is_some();
    let mut pieces = Vec::new();
    match op {
        CommOpcode::Alltoall => {
            let b = count(0) * es;
            for i in 0..n {
                for j in 0..n {
                    pieces.push(copy(input(i, j * b), output(j, i * b), b));
                }
            }
        }
        CommOpcode::Alltoallv => {
            let tables: Vec<Vec<u64>> = (0..n).map(table).collect();
            if let Some(bad) = comm::alltoallv_disagreement(&tables) {
                return Err(bad as usize);
            }
            let send_at: Vec<Vec<usize>> = tables.iter().map(|t| offsets(&t[..n])).collect();
            let recv_at: Vec<Vec<usize>> = tables.iter().map(|t| offsets(&t[n..])).collect();
            for i in 0..n {
                for j in 0..n {
                    let len = tables[i][j] as usize * es;
                    pieces.push(copy(input(i, send_at[i][j]), output(j, recv_at[j][i]), len));
                }
            }
        }
        CommOpcode::Gather | CommOpcode::Gatherv => {
            let at = if op == CommOpcode::Gather {
                (0..n).map(|i| i * count(0) * es).collect()
            } else {
                let counts: Vec<u64> = (0..n).map(|i| count(i) as u64).collect();
                let t = table(root);
                if let Some(bad) = comm::rooted_disagreement(&t, &counts) {
                    return Err(bad as usize);
                }
                offsets(&t)
            };
            for (i, &to) in at.iter().enumerate() {
                // In place, the root's block is its input already.
                if i == root && root_in_place {
                    continue;
                }
                pieces.push(copy(input(i, 0), output(root, to), count(i) * es));
            }
        }
        CommOpcode::Scatter | CommOpcode::Scatterv => {
            let at = if op == CommOpcode::Scatter {
                (0..n).map(|j| j * count(0) * es).collect()
            } else {
                let counts: Vec<u64> = (0..n).map(|j| count(j) as u64).collect();
                let t = table(root);
                if let Some(bad) = comm::rooted_disagreement(&t, &counts) {
                    return Err(bad as usize);
                }
                offsets(&t)
            };
            for (j, &from) in at.iter().enumerate() {
                // In place, the root's buffer holds every block and its own
                // stays where it is.
                if j == root && root_in_place {
                    continue;
                }
                let src = BufAt {
                    member: root,
                    output: root_in_place,
                    base: from,
                };
                pieces.push(copy(src, output(j, 0), count(j) * es));
            }
        }
        CommOpcode::Send
        | CommOpcode::Recv
        | CommOpcode::CommSplit
        | CommOpcode::CommCreate
        | CommOpcode::CommFree => {}
    }
    pieces.retain(|p| p.len() > 0);
    Ok(pieces)
}
