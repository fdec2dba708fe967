//! Piece planning: the steps ([`Piece`]) a collective's data movement takes
//! over its members' buffers ([`plan`]), and their cut into byte ranges for
//! the reduction threads ([`split`]).

use virtio_dmlc::Opcode;

use super::state::Arrival;

/// Smallest byte range handed to one reduction thread.
pub(super) const MIN_PART: usize = 256 << 10;
/// Byte ranges start on page (and so cache-line and element) boundaries
/// of the buffers: no two threads write one line, and a range's chunks
/// start on lines.
pub(super) const PART_ALIGN: usize = 4096;
/// Ranges per thread taking part: threads take ranges as they come free,
/// so a thread that waits for a CPU (a busy machine) leaves its share to
/// the others instead of holding up the collective.
pub(super) const PARTS_PER_THREAD: usize = 4;

/// A place in one member's buffers.
#[derive(Clone, Copy, Debug)]
pub(super) struct BufAt {
    pub(super) member: usize,
    /// The output segments (else the input segments).
    pub(super) output: bool,
    pub(super) base: usize,
}

/// One step of a collective over `len` bytes.
#[derive(Debug)]
pub(super) enum Piece {
    /// Reduce `inputs` (in rank order) into every output.
    Reduce {
        inputs: Vec<BufAt>,
        outputs: Vec<BufAt>,
        len: usize,
    },
    /// Copy `src` into every destination.
    Copy {
        src: BufAt,
        dsts: Vec<BufAt>,
        len: usize,
    },
}

impl Piece {
    pub(super) fn len(&self) -> usize {
        match self {
            Piece::Reduce { len, .. } | Piece::Copy { len, .. } => *len,
        }
    }
}

/// Where member `i`'s input is: its input segments, or its output buffer
/// at the in-place offset.
fn input_of(arrivals: &[Arrival], i: usize, extra: usize) -> BufAt {
    match arrivals[i].req.in_place_offset {
        Some(off) => BufAt {
            member: i,
            output: true,
            base: off + extra,
        },
        None => BufAt {
            member: i,
            output: false,
            base: extra,
        },
    }
}

fn output_of(i: usize, base: usize) -> BufAt {
    BufAt {
        member: i,
        output: true,
        base,
    }
}

/// The steps of a collective whose members' headers agree.
pub(super) fn plan(arrivals: &[Arrival]) -> Vec<Piece> {
    let req = &arrivals[0].req;
    let b = req.count_bytes();
    let n = arrivals.len();
    let root = req.root as usize;
    if b == 0 {
        return Vec::new();
    }
    let inputs = |extra: usize| (0..n).map(|i| input_of(arrivals, i, extra)).collect();
    let all_outputs = |base: usize| (0..n).map(|i| output_of(i, base)).collect();
    // The opcodes of feature bits 1 to 3 plan their own steps (send and
    // receive: `p2p.rs`) or move no data.
    let Some(opcode) = req.code.base() else {
        return Vec::new();
    };
    match opcode {
        Opcode::Allreduce => vec![Piece::Reduce {
            inputs: inputs(0),
            outputs: all_outputs(0),
            len: b,
        }],
        Opcode::Reduce => vec![Piece::Reduce {
            inputs: inputs(0),
            outputs: vec![output_of(root, 0)],
            len: b,
        }],
        // Block r of the reduction goes to member r; in place, into block r
        // of its own buffer.
        Opcode::ReduceScatter => (0..n)
            .map(|r| {
                let base = if arrivals[r].req.in_place_offset.is_some() {
                    r * b
                } else {
                    0
                };
                Piece::Reduce {
                    inputs: inputs(r * b),
                    outputs: vec![output_of(r, base)],
                    len: b,
                }
            })
            .collect(),
        Opcode::Broadcast => vec![Piece::Copy {
            src: input_of(arrivals, root, 0),
            dsts: all_outputs(0),
            len: b,
        }],
        Opcode::Allgather => (0..n)
            .map(|i| Piece::Copy {
                src: input_of(arrivals, i, 0),
                dsts: all_outputs(i * b),
                len: b,
            })
            .collect(),
        // A nop never reaches a collective (`Group::submit` answers it).
        Opcode::Barrier | Opcode::Nop => Vec::new(),
    }
}

/// Cuts the pieces into byte ranges `(piece, start, len)` for the arriving
/// thread and `threads` helpers: [`PARTS_PER_THREAD`] a thread, each of at
/// least [`MIN_PART`] bytes, all but a piece's last a multiple of
/// [`PART_ALIGN`].
pub(super) fn split(pieces: &[Piece], threads: usize) -> Vec<(usize, usize, usize)> {
    let total: usize = pieces.iter().map(Piece::len).sum();
    let part = total
        .div_ceil(PARTS_PER_THREAD * (threads + 1))
        .next_multiple_of(PART_ALIGN)
        .max(MIN_PART);
    let mut parts = Vec::new();
    for (i, p) in pieces.iter().enumerate() {
        let mut start = 0;
        while start < p.len() {
            let len = part.min(p.len() - start);
            parts.push((i, start, len));
            start += len;
        }
    }
    parts
}
