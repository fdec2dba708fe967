//! Target `descriptor_chain`: free descriptor tables, indirect tables,
//! addresses, lengths and flags, head index, queue size and memory layout.
//!
//! Input layout (little-endian; missing bytes read as 0):
//!
//! | bytes | field |
//! |---|---|
//! | 0 | memory layout ([`Layout::from_byte`]) |
//! | 1 | queue: bits 0-3 give size `1 << (b % 9)`; bit 4 set: indirect descriptors negotiated (else the harness clears every INDIRECT flag) |
//! | 2..4 | head index (u16): bit 15 set: `h & 0x7fff` as is, else `h % size` |
//! | 4 | world size `1 + b % 8` |
//! | 5 | rank `b % world` |
//! | 6 | `max_segments` |
//! | 7..11 | `max_bytes` (u32) |
//! | 11 | how many specs fill the descriptor table (at most the queue size); the rest fill the indirect area |
//! | 12..44 | the 32 bytes at the header slot |
//! | 44.. | descriptor specs, 8 bytes each: flags byte, next (u8), offset (u16), len (u32) |
//!
//! Flags byte of a spec: bits 0-2 address mode, bit 3 NEXT, bit 4 WRITE,
//! bit 5 INDIRECT, bit 6 adds 256 to next. Address modes, with `off` the
//! offset: 0 header slot + off, 1 response slot + off, 2 data area + off,
//! 3 indirect area + off, 4 end of region A - off, 5 start of region B
//! (or of the hole after A) + off, 6 end of the highest region - off,
//! 7 `u64::MAX - off`.

use vhost_device_dmlc::chain::Limits;
use virtio_dmlc::{bad, Dtype, Opcode, ReduceOp, Status, FLAG_IN_PLACE};
use vm_memory::{Bytes, GuestAddress};

use crate::check::{check_in, Outcome};
use crate::guest::{
    self, Hole, Layout, A_SIZE, DATA, DESC_TABLE, F_INDIRECT, HDR, INDIRECT, INDIRECT_ENTRIES, RESP,
};
use crate::oracle::Model;
use crate::oracle_comm::Comms;
use crate::request_header::header;
use crate::{Input, Seed};

/// One descriptor as the input gives it.
#[derive(Clone, Copy, Debug, Default)]
pub struct Spec {
    pub flags: u8,
    pub next: u8,
    pub off: u16,
    pub len: u32,
}

impl Spec {
    pub const NEXT: u8 = 8;
    pub const WRITE: u8 = 0x10;
    pub const INDIRECT: u8 = 0x20;

    /// A descriptor at address `mode`/`off` with `flags` (NEXT, WRITE,
    /// INDIRECT bits of the spec) and `next`.
    pub fn new(mode: u8, off: u16, len: u32, flags: u8, next: u8) -> Self {
        Spec {
            flags: mode | flags,
            next,
            off,
            len,
        }
    }

    fn addr(self, layout: Layout) -> u64 {
        let off = u64::from(self.off);
        match self.flags & 7 {
            0 => HDR + off,
            1 => RESP + off,
            2 => DATA + off,
            3 => INDIRECT + off,
            4 => A_SIZE - off,
            5 => layout
                .b_start()
                .unwrap_or(A_SIZE + 0x1000)
                .wrapping_add(off),
            6 => layout.end() - off,
            _ => u64::MAX - off,
        }
    }

    /// The virtio flags and next index.
    fn raw(self, indirect_ok: bool) -> (u16, u16) {
        let mut f = u16::from(self.flags >> 3) & 7;
        if !indirect_ok {
            f &= !F_INDIRECT;
        }
        let next = u16::from(self.next) + if self.flags & 0x40 != 0 { 256 } else { 0 };
        (f, next)
    }
}

/// The decoded input.
#[derive(Clone, Debug, Default)]
pub struct Case {
    pub layout: u8,
    pub queue: u8,
    pub head: u16,
    pub world: u8,
    pub rank: u8,
    pub max_segments: u8,
    pub max_bytes: u32,
    pub direct: u8,
    pub header: [u8; 32],
    pub specs: Vec<Spec>,
}

impl Case {
    pub fn decode(data: &[u8]) -> Self {
        let mut i = Input::new(data);
        let mut c = Case {
            layout: i.u8(),
            queue: i.u8(),
            head: i.u16(),
            world: i.u8(),
            rank: i.u8(),
            max_segments: i.u8(),
            max_bytes: i.u32(),
            direct: i.u8(),
            header: i.bytes(),
            specs: Vec::new(),
        };
        while !i.is_empty() && c.specs.len() < usize::from(guest::MAX_QUEUE) + INDIRECT_ENTRIES {
            c.specs.push(Spec {
                flags: i.u8(),
                next: i.u8(),
                off: i.u16(),
                len: i.u32(),
            });
        }
        c
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut v = vec![self.layout, self.queue];
        v.extend(self.head.to_le_bytes());
        v.extend([self.world, self.rank, self.max_segments]);
        v.extend(self.max_bytes.to_le_bytes());
        v.push(self.direct);
        v.extend(self.header);
        for s in &self.specs {
            v.extend([s.flags, s.next]);
            v.extend(s.off.to_le_bytes());
            v.extend(s.len.to_le_bytes());
        }
        v
    }

    fn queue_size(&self) -> u16 {
        1 << ((self.queue & 0x0f) % 9)
    }

    fn limits(&self) -> Limits {
        let world = 1 + u32::from(self.world) % 8;
        Limits {
            world_size: world,
            rank: u32::from(self.rank) % world,
            max_segments: u32::from(self.max_segments),
            max_bytes: u64::from(self.max_bytes),
            // Without feature bit 1: 32-byte headers, 16-byte responses.
            features: 0,
        }
    }
}

/// Runs one input.
pub fn run(data: &[u8]) -> Outcome {
    run_model(data).0
}

/// Runs one input; also says whether the backend's answer was the spec's
/// or one of its known deviations.
pub fn run_model(data: &[u8]) -> (Outcome, Model) {
    let _run = guest::exclusive();
    let case = Case::decode(data);
    let layout = Layout::from_byte(case.layout);
    let mem = guest::memory(layout);
    let size = case.queue_size();
    let indirect_ok = case.queue & 0x10 != 0;
    mem.write_slice(&case.header, GuestAddress(HDR))
        .expect("header slot is in the control area");
    let direct = usize::from(case.direct).min(usize::from(size));
    let (table, rest) = case.specs.split_at(direct.min(case.specs.len()));
    let slots = (0..).map(|i| DESC_TABLE + 16 * i);
    let ind_slots = (0..INDIRECT_ENTRIES as u64).map(|i| INDIRECT + 16 * i);
    for (s, at) in table.iter().zip(slots).chain(rest.iter().zip(ind_slots)) {
        let (flags, next) = s.raw(indirect_ok);
        guest::write_desc(mem, at, s.addr(layout), s.len, flags, next);
    }
    let head = if case.head & 0x8000 != 0 {
        case.head & 0x7fff
    } else {
        case.head % size
    };
    let chain = guest::pop(mem, size, head);
    check_in(mem, chain, size, &case.limits(), &Comms::default())
}

/// Chains that exercise the walker: direct, indirect, across a region
/// boundary, around a hole, a loop; with their expected outcomes.
pub fn seeds() -> (Vec<Seed>, Vec<Outcome>) {
    const N: u8 = Spec::NEXT;
    const W: u8 = Spec::WRITE;
    let sum = ReduceOp::Sum.raw();
    let hdr = |next| Spec::new(0, 0, 32, N, next);
    let resp = |mode, off| Spec::new(mode, off, 16, W, 0);
    let two = |layout: Layout, h: [u8; 32], specs: Vec<Spec>| Case {
        layout: layout.to_byte(),
        queue: 4,
        world: 1,
        max_segments: 8,
        max_bytes: 4096,
        direct: specs.len() as u8,
        header: h,
        specs,
        ..Case::default()
    };
    let allreduce = header(Opcode::Allreduce, Dtype::F32.raw(), sum, 0, 4, 0);
    let plain = vec![
        hdr(1),
        Spec::new(2, 0, 16, N, 2),
        Spec::new(2, 0x100, 16, W | N, 3),
        resp(1, 0),
    ];
    let direct = two(Layout::SINGLE, allreduce, plain.clone());

    let mut indirect = two(Layout::SINGLE, allreduce, plain);
    indirect.queue |= 0x10;
    indirect.direct = 1;
    indirect
        .specs
        .insert(0, Spec::new(3, 0, 64, Spec::INDIRECT, 0));

    let adjacent = Layout {
        second: Some((0x1_0000, Hole::None)),
    };
    // f64 elements cut by the A/B boundary, in the input and the output.
    let boundary = two(
        adjacent,
        header(Opcode::Allreduce, Dtype::F64.raw(), sum, 0, 4, 0),
        vec![
            hdr(1),
            Spec::new(4, 13, 32, N, 2),
            Spec::new(4, 20, 32, W | N, 3),
            resp(5, 0x100),
        ],
    );

    // Rank 1 of 2 in an allgather; data on both sides of a hole; a
    // zero-length descriptor at the top of the address space.
    let holed = Layout {
        second: Some((0x1000, Hole::Page)),
    };
    let mut zero = two(
        holed,
        header(Opcode::Allgather, Dtype::I32.raw(), 0, 0, 2, 0),
        vec![
            hdr(1),
            Spec::new(2, 0, 4, N, 2),
            Spec::new(5, 0, 4, N, 3),
            Spec::new(7, 0, 0, N, 4),
            Spec::new(6, 16, 16, W | N, 5),
            resp(2, 0x200),
        ],
    );
    zero.rank = 1;

    // Header and response pointing at each other: a loop.
    let looped = two(
        Layout::SINGLE,
        allreduce,
        vec![hdr(1), Spec::new(1, 0, 16, W | N, 0)],
    );

    // Loops that do not close at the head: the walk stops at the
    // descriptor that closes the loop, whatever the queue size (16 here).
    // Closed by the response: CHAIN in it.
    let closed_by_response = two(
        Layout::SINGLE,
        allreduce,
        vec![
            hdr(1),
            Spec::new(2, 0, 8, W | N, 2),
            Spec::new(1, 0, 16, W | N, 1),
        ],
    );
    // Closed by an 8-byte output: no status, though a 16-byte writable
    // descriptor is in the loop.
    let closed_by_output = two(
        Layout::SINGLE,
        allreduce,
        vec![
            hdr(1),
            Spec::new(1, 0, 16, W | N, 2),
            Spec::new(2, 0, 8, W | N, 3),
            Spec::new(2, 0x100, 8, W | N, 1),
        ],
    );
    // The same loop as "loop-response", inside an indirect table of 8.
    let mut indirect_loop = closed_by_response.clone();
    indirect_loop.queue |= 0x10;
    indirect_loop.direct = 1;
    indirect_loop
        .specs
        .insert(0, Spec::new(3, 0, 128, Spec::INDIRECT, 0));
    // 2^32 bytes: cut before the descriptor that brings the total over,
    // so the early 16-byte output gets CHAIN.
    let four_gib = two(
        Layout::SINGLE,
        allreduce,
        vec![
            hdr(1),
            Spec::new(1, 0x20, 16, W | N, 2),
            Spec::new(2, 0, u32::MAX - 47, W | N, 3),
            resp(1, 0),
        ],
    );

    // A barrier at head 5, its response in the top page of the address space.
    let top = Layout {
        second: Some((0x1_0000, Hole::Top)),
    };
    let mut specs = vec![Spec::default(); 5];
    specs.extend([hdr(6), resp(6, 16)]);
    let mut barrier = two(top, header(Opcode::Barrier, 0, 0, 0, 0, 0), specs);
    barrier.head = 5;

    // An in-place output that runs into the hole after region A.
    let hole = two(
        holed,
        header(
            Opcode::ReduceScatter,
            Dtype::U8.raw(),
            sum,
            0,
            8,
            FLAG_IN_PLACE,
        ),
        vec![hdr(1), Spec::new(4, 8, 16, W | N, 2), resp(1, 0)],
    );

    let valid = Outcome::Valid { bounces: 0 };
    let chain = Outcome::Rejected(Some((Status::BadRequest, bad::CHAIN)));
    let cases = [
        ("direct", direct, valid),
        ("indirect", indirect, valid),
        ("boundary", boundary, Outcome::Valid { bounces: 2 }),
        ("zero-length", zero, valid),
        (
            "loop",
            looped,
            Outcome::Rejected(Some((Status::BadRequest, bad::CHAIN))),
        ),
        ("loop-response", closed_by_response, chain),
        ("loop-output", closed_by_output, Outcome::Rejected(None)),
        ("indirect-loop", indirect_loop, chain),
        ("4gib", four_gib, chain),
        ("barrier-top", barrier, valid),
        (
            "hole",
            hole,
            Outcome::Rejected(Some((Status::BadRequest, bad::ADDRESS))),
        ),
    ];
    let mut seeds = Vec::new();
    let mut want = Vec::new();
    for (name, case, outcome) in cases {
        seeds.push(Seed {
            name,
            bytes: case.encode(),
        });
        want.push(outcome);
    }
    (seeds, want)
}

#[cfg(test)]
mod tests {
    use super::{run, seeds, Case, Spec};
    use crate::check::Outcome;
    use crate::request_header::header;
    use virtio_dmlc::{bad, Dtype, Opcode, ReduceOp, Status};

    const N: u8 = Spec::NEXT;
    const W: u8 = Spec::WRITE;

    /// The seeds give their outcomes.
    #[test]
    fn seeds_give_their_outcomes() {
        let (seeds, want) = seeds();
        for (s, w) in seeds.iter().zip(&want) {
            assert_eq!(run(&s.bytes), *w, "seed {}", s.name);
        }
    }

    /// A loop gets the same answer whatever the queue size: CHAIN when the
    /// response closes it, no status when an output does.
    #[test]
    fn loops_end_at_the_closing_descriptor_whatever_the_queue_size() {
        let allreduce = header(
            Opcode::Allreduce,
            Dtype::F32.raw(),
            ReduceOp::Sum.raw(),
            0,
            4,
            0,
        );
        let chain = Outcome::Rejected(Some((Status::BadRequest, bad::CHAIN)));
        for len in 2u8..=6 {
            for back_to in 0..len - 1 {
                for closer in [16u32, 8] {
                    // [header] [8-byte outputs]* [closer -> back_to]
                    let specs: Vec<Spec> = (0..len)
                        .map(|i| match i {
                            0 => Spec::new(0, 0, 32, N, 1),
                            i if i == len - 1 => Spec::new(1, 0, closer, W | N, back_to),
                            i => Spec::new(2, 0x100 * u16::from(i), 8, W | N, i + 1),
                        })
                        .collect();
                    for queue in 3..=8 {
                        let case = Case {
                            queue,
                            world: 0,
                            max_segments: 8,
                            max_bytes: 4096,
                            direct: len,
                            header: allreduce,
                            specs: specs.clone(),
                            ..Case::default()
                        };
                        let want = if closer == 16 {
                            chain
                        } else {
                            Outcome::Rejected(None)
                        };
                        let what = format!("loop of {len} back to {back_to}, queue {queue}");
                        assert_eq!(run(&case.encode()), want, "{what}");
                    }
                }
            }
        }
    }

    /// The "indirect" seed with a table of 0x80040 bytes: it runs past the
    /// end of guest memory (region A ends at 0x4_0000), though the entries
    /// the chain uses lie inside.
    fn table_past_memory() -> Vec<u8> {
        let (seeds, _) = seeds();
        let mut case = Case::decode(&seeds[1].bytes);
        case.specs[0].len = 0x8_0040;
        case.encode()
    }

    /// A descriptor in the direct table repeated, all 16 bytes, by an
    /// entry of the indirect table it leads to, in a chain that ends.
    fn repeat_across_tables() -> Vec<u8> {
        let (seeds, _) = seeds();
        let mut case = Case::decode(&seeds[1].bytes);
        // [header -> 1] [indirect] in the queue; the table is
        // [header -> 1] [input] [output] [response].
        let h = case.specs[1];
        case.specs.insert(0, h);
        case.specs[1].next = 0;
        case.direct = 2;
        case.encode()
    }

    /// 5.X.6.7.1: the walk reads an indirect table entry by entry, so a
    /// table whose declared length runs past guest memory is usable as far
    /// as the entries the chain reaches lie inside it.
    #[test]
    fn an_indirect_table_is_read_as_far_as_the_chain_goes() {
        assert_eq!(run(&table_past_memory()), Outcome::Valid { bounces: 0 });
    }

    /// 5.X.6.7.1: the walk stops before a descriptor identical to one
    /// already reached in this walk, in whichever table (here the header,
    /// readable: no response). The backend once went on here.
    #[test]
    fn a_repeat_across_tables_stops_the_walk() {
        assert_eq!(run(&repeat_across_tables()), Outcome::Rejected(None));
    }
}
