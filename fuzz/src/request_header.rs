//! Target `request_header`: a free 32-byte header and free limits, in a
//! well-formed chain whose buffer lengths follow the header.
//!
//! Input layout (little-endian; missing bytes read as 0):
//!
//! | bytes | field |
//! |---|---|
//! | 0..32 | request header (`VirtioDmlcReq`) |
//! | 32 | world size: bit 7 set: `u32::MAX - (b & 0x7f)`, else `1 + b % 16` |
//! | 33 | rank: bit 7 set: `world - 1 - (b & 0x7f) % world`, else `b % world` |
//! | 34..36 | `max_segments` (u16) |
//! | 36..44 | `max_bytes` (u64) |
//! | 44 | build: bits 0-1 extra input cuts, bits 2-3 extra output cuts, bit 4 indirect table, bit 5 a zero-length readable descriptor, bit 6 a zero-length writable one, bit 7 explicit lengths |
//! | 45..53 | explicit: input and output length (u32 each); else input and output adjustment in bytes (i32 each), added to the lengths the header asks for |
//! | 53.. | cut lengths (u16 each), used by the extra cuts in order |
//!
//! Data descriptors all point into the data area (they may alias: the
//! parser does not care). A request's buffers longer than what fits in
//! [`MAX_PIECES`] descriptors are cut down, so their length is wrong.

use vhost_device_dmlc::chain::Limits;
use virtio_dmlc::{
    buffer_elems, Dtype, Opcode, ReduceOp, VirtioDmlcReq, FLAG_IN_PLACE, REQ_HEADER_SIZE, RESP_SIZE,
};
use zerocopy::IntoBytes;

use crate::check::{check, Outcome};
use crate::guest::{
    self, Layout, DATA, DATA_SIZE, DESC_TABLE, F_INDIRECT, F_NEXT, F_WRITE, HDR, INDIRECT, RESP,
};
use crate::{Input, Seed};

/// Most descriptors one direction may take.
pub const MAX_PIECES: u64 = 32;
/// An address outside guest memory, for zero-length descriptors.
const NOWHERE: u64 = 0xdead_0000_0000;

/// The decoded input.
#[derive(Clone, Debug, Default)]
pub struct Case {
    pub header: [u8; REQ_HEADER_SIZE],
    pub world: u8,
    pub rank: u8,
    pub max_segments: u16,
    pub max_bytes: u64,
    pub build: u8,
    pub in_len: u32,
    pub out_len: u32,
    pub cuts: Vec<u16>,
}

impl Case {
    pub fn decode(data: &[u8]) -> Self {
        let mut i = Input::new(data);
        let mut c = Case {
            header: i.bytes(),
            world: i.u8(),
            rank: i.u8(),
            max_segments: i.u16(),
            max_bytes: i.u64(),
            build: i.u8(),
            in_len: i.u32(),
            out_len: i.u32(),
            cuts: Vec::new(),
        };
        while !i.is_empty() && c.cuts.len() < 6 {
            c.cuts.push(i.u16());
        }
        c
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut v = self.header.to_vec();
        v.extend([self.world, self.rank]);
        v.extend(self.max_segments.to_le_bytes());
        v.extend(self.max_bytes.to_le_bytes());
        v.push(self.build);
        v.extend(self.in_len.to_le_bytes());
        v.extend(self.out_len.to_le_bytes());
        for c in &self.cuts {
            v.extend(c.to_le_bytes());
        }
        v
    }

    pub fn limits(&self) -> Limits {
        let world = if self.world & 0x80 != 0 {
            u32::MAX - u32::from(self.world & 0x7f)
        } else {
            1 + u32::from(self.world) % 16
        };
        let rank = if self.rank & 0x80 != 0 {
            world - 1 - u32::from(self.rank & 0x7f) % world
        } else {
            u32::from(self.rank) % world
        };
        Limits {
            world_size: world,
            rank,
            max_segments: u32::from(self.max_segments),
            max_bytes: self.max_bytes,
            // Without feature bit 1: the target `comm_header` covers it.
            features: 0,
        }
    }

    /// Input and output lengths in bytes: given, or what the header asks
    /// for (as the spec's buffer rules compute it) plus an adjustment.
    fn lengths(&self, limits: &Limits) -> (u64, u64) {
        if self.build & 0x80 != 0 {
            return (u64::from(self.in_len), u64::from(self.out_len));
        }
        let h = <VirtioDmlcReq as zerocopy::FromBytes>::read_from_bytes(&self.header[..])
            .expect("32 bytes make a header");
        let elem = Dtype::from_raw(h.dtype).map_or(1, |d| d.size() as u64);
        let want = Opcode::from_raw(h.opcode.get())
            .and_then(|op| {
                buffer_elems(
                    op,
                    limits.world_size,
                    limits.rank,
                    h.root.get(),
                    h.count.get(),
                    h.flags.get() & FLAG_IN_PLACE != 0,
                )
            })
            .map(|e| {
                (
                    e.input.checked_mul(elem).unwrap_or(0),
                    e.output.checked_mul(elem).unwrap_or(0),
                )
            })
            .unwrap_or((0, 0));
        let adjust = |len: u64, by: u32| len.saturating_add_signed(i64::from(by as i32));
        (adjust(want.0, self.in_len), adjust(want.1, self.out_len))
    }

    /// The chain's descriptors: (addr, len, writable).
    fn descriptors(&self, limits: &Limits) -> Vec<(u64, u32, bool)> {
        let (inb, outb) = self.lengths(limits);
        let mut cuts = self.cuts.iter().copied();
        let mut d = vec![(HDR, REQ_HEADER_SIZE as u32, false)];
        for len in pieces(inb, usize::from(self.build & 3), &mut cuts) {
            d.push((DATA, len, false));
        }
        if self.build & 0x20 != 0 {
            d.push((NOWHERE, 0, false));
        }
        if self.build & 0x40 != 0 {
            d.push((NOWHERE, 0, true));
        }
        for len in pieces(outb, usize::from((self.build >> 2) & 3), &mut cuts) {
            d.push((DATA, len, true));
        }
        d.push((RESP, RESP_SIZE as u32, true));
        d
    }
}

/// Cuts `len` bytes into descriptor lengths: `extra` given cuts first,
/// then pieces as large as the data area. Lengths beyond what
/// [`MAX_PIECES`] descriptors hold are cut down (and so wrong).
pub(crate) fn pieces(len: u64, extra: usize, cuts: &mut impl Iterator<Item = u16>) -> Vec<u32> {
    let budget = DATA_SIZE * MAX_PIECES;
    let mut left = if len > budget {
        len % (budget + 1)
    } else {
        len
    };
    let mut out = Vec::new();
    for _ in 0..extra {
        let c = u64::from(cuts.next().unwrap_or(0)).min(left);
        out.push(c as u32);
        left -= c;
    }
    while left > 0 {
        let c = left.min(DATA_SIZE);
        out.push(c as u32);
        left -= c;
    }
    out
}

/// Runs one input.
pub fn run(data: &[u8]) -> Outcome {
    let _run = guest::exclusive();
    let case = Case::decode(data);
    let limits = case.limits();
    let mem = guest::memory(Layout::SINGLE);
    mem_write(mem, HDR, &case.header);
    let descs = case.descriptors(&limits);
    let n = descs.len();
    let flags =
        |i: usize, w: bool| (if w { F_WRITE } else { 0 }) | if i + 1 < n { F_NEXT } else { 0 };
    let table = if case.build & 0x10 != 0 {
        guest::write_desc(mem, DESC_TABLE, INDIRECT, 16 * n as u32, F_INDIRECT, 0);
        INDIRECT
    } else {
        DESC_TABLE
    };
    for (i, &(addr, len, w)) in descs.iter().enumerate() {
        let at = table + 16 * i as u64;
        guest::write_desc(mem, at, addr, len, flags(i, w), i as u16 + 1);
    }
    check(
        mem,
        guest::pop(mem, guest::MAX_QUEUE, 0),
        guest::MAX_QUEUE,
        &limits,
    )
}

fn mem_write(mem: &vhost_device_dmlc::GuestMem, at: u64, bytes: &[u8]) {
    use vm_memory::Bytes;
    mem.write_slice(bytes, vm_memory::GuestAddress(at))
        .expect("slot is in the control area");
}

/// A header with the given fields (tag and timeout fixed).
pub fn header(opcode: Opcode, dtype: u8, op: u8, root: u32, count: u64, flags: u32) -> [u8; 32] {
    let h = VirtioDmlcReq {
        opcode: opcode.raw().into(),
        dtype,
        op,
        root: root.into(),
        count: count.into(),
        tag: 0x7a6.into(),
        flags: flags.into(),
        timeout_ms: 0.into(),
    };
    let mut out = [0u8; 32];
    out.copy_from_slice(h.as_bytes());
    out
}

/// Valid requests of every opcode for rank 1 of 4, in the shapes a driver
/// sends, and their expected outcomes.
pub fn seeds() -> (Vec<Seed>, Vec<Outcome>) {
    use Dtype::*;
    use Opcode::*;
    let sum = ReduceOp::Sum.raw();
    let base = |h: [u8; 32]| Case {
        header: h,
        world: 3,
        rank: 1,
        max_segments: 8,
        max_bytes: 1 << 20,
        ..Case::default()
    };
    let mut cases = vec![
        (
            "allreduce",
            base(header(Allreduce, F32.raw(), sum, 0, 16, 0)),
        ),
        (
            "broadcast-root",
            base(header(Broadcast, U8.raw(), 0, 1, 100, 0)),
        ),
        ("broadcast", base(header(Broadcast, U8.raw(), 0, 0, 100, 0))),
        (
            "reduce",
            base(header(Reduce, I64.raw(), ReduceOp::Max.raw(), 0, 8, 0)),
        ),
        (
            "reduce-in-place",
            base(header(Reduce, I32.raw(), sum, 0, 8, FLAG_IN_PLACE)),
        ),
        (
            "allgather",
            base(header(Allgather, Bf16.raw(), 0, 0, 10, 0)),
        ),
        (
            "allgather-in-place",
            base(header(Allgather, F64.raw(), 0, 0, 3, FLAG_IN_PLACE)),
        ),
        (
            "reduce-scatter",
            base(header(
                ReduceScatter,
                F16.raw(),
                ReduceOp::Avg.raw(),
                0,
                6,
                0,
            )),
        ),
        (
            "reduce-scatter-in-place",
            base(header(
                ReduceScatter,
                U64.raw(),
                ReduceOp::Bxor.raw(),
                0,
                2,
                FLAG_IN_PLACE,
            )),
        ),
        ("barrier", base(header(Barrier, 0, 0, 0, 0, 0))),
    ];
    // Cut into several descriptors, with zero-length ones; indirect.
    let mut cut = base(header(Allreduce, I32.raw(), sum, 0, 64, 0));
    cut.build = 0x02 | 0x04 | 0x20 | 0x40;
    cut.cuts = vec![4, 60, 128];
    cases.push(("cut", cut));
    let mut ind = base(header(Allgather, U32.raw(), 0, 0, 5, 0));
    ind.build = 0x10 | 0x01;
    ind.cuts = vec![8];
    cases.push(("indirect", ind));
    let want = vec![Outcome::Valid { bounces: 0 }; cases.len()];
    let seeds = cases
        .into_iter()
        .map(|(name, c)| Seed {
            name,
            bytes: c.encode(),
        })
        .collect();
    (seeds, want)
}
