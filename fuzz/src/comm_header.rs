//! Target `comm_header`: requests of a member that may have negotiated
//! feature bit 1 (spec 5.X.6.13): a free 48-byte header and its table, the
//! negotiated feature bits, the communicators the device gave (a fake
//! registry behind `parse_in`'s lookup), the limits, in a well-formed
//! chain whose buffer lengths follow the header (or are given), and whose
//! header and response descriptors have the sizes the spec gives (or are
//! off).
//!
//! Input layout (little-endian; missing bytes read as 0):
//!
//! | bytes | field |
//! |---|---|
//! | 0..48 | request header (`VirtioDmlcReqComm`: the 32-byte base, then `comm`, `peer`, `key`, `table_bytes`) |
//! | 48 | negotiated features: bits 0-3 of the byte are feature bits 0-3 (1 communicators, 2 send/recv, 3 blocks) |
//! | 49 | world size: bit 7 set: `256 - (b & 0x7f)`, else `1 + b % 16` |
//! | 50 | rank: bit 7 set: `world - 1 - (b & 0x7f) % world`, else `b % world` |
//! | 51..90 | 3 communicators of 13 bytes: id (u32), `n`, 8 rank bytes; `n == 0`: none; else the first `min(n, 8)` rank bytes, read as byte 50 is, a repeat dropped, are its members' group ranks in its rank order |
//! | 90..92 | `max_segments` (u16) |
//! | 92..100 | `max_bytes` (u64) |
//! | 100 | build, as in `request_header`: bits 0-1 extra input cuts, bits 2-3 extra output cuts, bit 4 indirect table, bit 5 a zero-length readable descriptor, bit 6 a zero-length writable one, bit 7 explicit lengths |
//! | 101..109 | explicit: input and output length (u32 each); else input and output adjustment in bytes (i32 each), added to the lengths the header asks for |
//! | 109 | shape: bits 0-1 header descriptor length: 0 the spec's (`0x30 + table_bytes` with bit 1, else 32), 1 that plus `adjust`, 2 the other layout's (32 with bit 1, else `0x30 + table_bytes`), 3 `adjust` as an unsigned byte; bit 2 the header ends `place` bytes after the end of region A (else it is at [`HDR_COMM`]); bit 3 the response has the other layout's size; bit 4 a zero-length readable descriptor after the outputs (`ORDER`) |
//! | 110 | `adjust` (i8) |
//! | 111 | `place` (i8) |
//! | 112..124 | 6 cut lengths (u16 each), used by the extra cuts in order |
//! | 124.. | the table: the header descriptor's bytes after the fixed 48, zero-padded to its length |
//!
//! The header and its table are written where the descriptor says, as far
//! as that lies in the data area (below it is the control area, above it
//! the end of guest memory) and as far as a table can be read (16 times
//! the world size); data descriptors all point into the data area and may
//! alias the header (the parser does not read data).

use vhost_device_dmlc::chain::Limits;
use vhost_device_dmlc::GuestMem;
use virtio_dmlc::comm::{CommOpcode, VirtioDmlcReqComm, ANY_SOURCE, UNDEFINED};
use virtio_dmlc::{bad, too_big, unsupported, Dtype, Opcode, ReduceOp, Status, FLAG_IN_PLACE};
use virtio_queue::DescriptorChain;
use vm_memory::{Bytes, GuestAddress};
use zerocopy::{FromBytes, IntoBytes};

use crate::check::{check_in, Outcome};
use crate::guest::{
    self, Layout, A_SIZE, DATA, DESC_TABLE, F_INDIRECT, F_NEXT, F_WRITE, INDIRECT, RESP,
};
use crate::oracle::{self, Model};
use crate::oracle_comm::{self as oc, Comms};
use crate::request_header::{header as base_header, pieces};
use crate::{Input, Seed};

/// Where the header goes unless the input moves it to the end of region A:
/// in the data area, with 128 KiB of room after it, far more than the
/// largest table the parser reads (16 times a world of 256).
pub const HDR_COMM: u64 = 0x2_0000;
/// An address outside guest memory, for zero-length descriptors.
const NOWHERE: u64 = 0xdead_0000_0000;
/// Communicators in the registry.
const COMMS: usize = 3;
/// Members of one communicator, at most.
const MEMBERS: usize = 8;

/// One registry entry as the input gives it.
#[derive(Clone, Copy, Debug, Default)]
pub struct CommSpec {
    pub id: u32,
    pub n: u8,
    pub ranks: [u8; MEMBERS],
}

/// The decoded input.
#[derive(Clone, Debug)]
pub struct Case {
    pub header: [u8; 48],
    pub features: u8,
    pub world: u8,
    pub rank: u8,
    pub comms: [CommSpec; COMMS],
    pub max_segments: u16,
    pub max_bytes: u64,
    pub build: u8,
    pub in_len: u32,
    pub out_len: u32,
    pub shape: u8,
    pub adjust: i8,
    pub place: i8,
    pub cuts: [u16; 6],
    pub table: Vec<u8>,
}

impl Default for Case {
    fn default() -> Self {
        Case {
            header: [0; 48],
            features: 0,
            world: 0,
            rank: 0,
            comms: Default::default(),
            max_segments: 0,
            max_bytes: 0,
            build: 0,
            in_len: 0,
            out_len: 0,
            shape: 0,
            adjust: 0,
            place: 0,
            cuts: [0; 6],
            table: Vec::new(),
        }
    }
}

/// Shape bits (byte 109).
pub const SHAPE_LEN_ADJUST: u8 = 1;
pub const SHAPE_LEN_OTHER: u8 = 2;
pub const SHAPE_LEN_GIVEN: u8 = 3;
pub const SHAPE_AT_END: u8 = 4;
pub const SHAPE_OTHER_RESPONSE: u8 = 8;
pub const SHAPE_MISORDER: u8 = 0x10;

/// Decodes a rank byte for a group of `world`.
fn rank_of(b: u8, world: u32) -> u32 {
    if b & 0x80 != 0 {
        world - 1 - u32::from(b & 0x7f) % world
    } else {
        u32::from(b) % world
    }
}

impl Case {
    pub fn decode(data: &[u8]) -> Self {
        let mut i = Input::new(data);
        let mut c = Case {
            header: i.bytes(),
            features: i.u8(),
            world: i.u8(),
            rank: i.u8(),
            ..Case::default()
        };
        for s in &mut c.comms {
            *s = CommSpec {
                id: i.u32(),
                n: i.u8(),
                ranks: i.bytes(),
            };
        }
        c.max_segments = i.u16();
        c.max_bytes = i.u64();
        c.build = i.u8();
        c.in_len = i.u32();
        c.out_len = i.u32();
        c.shape = i.u8();
        c.adjust = i.u8() as i8;
        c.place = i.u8() as i8;
        for x in &mut c.cuts {
            *x = i.u16();
        }
        while !i.is_empty() {
            c.table.push(i.u8());
        }
        c
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut v = self.header.to_vec();
        v.extend([self.features, self.world, self.rank]);
        for s in &self.comms {
            v.extend(s.id.to_le_bytes());
            v.push(s.n);
            v.extend(s.ranks);
        }
        v.extend(self.max_segments.to_le_bytes());
        v.extend(self.max_bytes.to_le_bytes());
        v.push(self.build);
        v.extend(self.in_len.to_le_bytes());
        v.extend(self.out_len.to_le_bytes());
        v.extend([self.shape, self.adjust as u8, self.place as u8]);
        for x in self.cuts {
            v.extend(x.to_le_bytes());
        }
        v.extend(&self.table);
        v
    }

    fn world_size(&self) -> u32 {
        if self.world & 0x80 != 0 {
            256 - u32::from(self.world & 0x7f)
        } else {
            1 + u32::from(self.world) % 16
        }
    }

    pub fn limits(&self) -> Limits {
        let world = self.world_size();
        Limits {
            world_size: world,
            rank: rank_of(self.rank, world),
            max_segments: u32::from(self.max_segments),
            max_bytes: self.max_bytes,
            features: u64::from(self.features & 0x0f),
        }
    }

    /// The registry: distinct group ranks below the world size.
    pub fn registry(&self) -> Comms {
        let world = self.world_size();
        let list = self
            .comms
            .iter()
            .filter(|s| s.n != 0)
            .map(|s| {
                let mut members = Vec::new();
                for &b in &s.ranks[..usize::from(s.n).min(MEMBERS)] {
                    let r = rank_of(b, world);
                    if !members.contains(&r) {
                        members.push(r);
                    }
                }
                (s.id, members)
            })
            .collect();
        Comms { list }
    }

    fn with_comm(&self) -> bool {
        self.features & (1 << oc::F_COMM) != 0
    }

    fn comm_header(&self) -> VirtioDmlcReqComm {
        VirtioDmlcReqComm::read_from_bytes(&self.header[..]).expect("48 bytes make a header")
    }

    /// Length of the header descriptor.
    fn header_len(&self) -> u32 {
        let full = 48u64 + u64::from(self.comm_header().table_bytes.get());
        let (spec, other) = if self.with_comm() {
            (full, 32)
        } else {
            (32, full)
        };
        let len = match self.shape & 3 {
            0 => spec,
            SHAPE_LEN_ADJUST => spec.saturating_add_signed(i64::from(self.adjust)),
            SHAPE_LEN_OTHER => other,
            _ => u64::from(self.adjust as u8),
        };
        len.min(u64::from(u32::MAX)) as u32
    }

    /// Where the header descriptor points.
    fn header_addr(&self) -> u64 {
        if self.shape & SHAPE_AT_END == 0 {
            return HDR_COMM;
        }
        A_SIZE
            .wrapping_sub(u64::from(self.header_len()))
            .wrapping_add_signed(i64::from(self.place))
    }

    /// Input and output lengths in bytes: given, or what the header asks
    /// for (as the model computes it) plus an adjustment.
    fn lengths(&self, limits: &Limits, comms: &Comms) -> (u64, u64) {
        if self.build & 0x80 != 0 {
            return (u64::from(self.in_len), u64::from(self.out_len));
        }
        let h = self.comm_header();
        let b = &h.base;
        let (n, r) = if self.with_comm() {
            comms
                .find(h.comm.get(), limits.rank, limits.world_size)
                .map_or((limits.world_size, limits.rank), |m| (m.size, m.rank))
        } else {
            (limits.world_size, limits.rank)
        };
        let (root, count) = (b.root.get(), b.count.get());
        let flag = b.flags.get() & FLAG_IN_PLACE != 0;
        let elem = Dtype::from_raw(b.dtype).map_or(1, |d| d.size() as u64);
        let raw = b.opcode.get();
        let want = match (Opcode::from_raw(raw), CommOpcode::from_raw(raw)) {
            (Some(o), _) => oracle::elements(o, n, r, root, count, flag).map(|(i, o, _)| (i, o)),
            (None, Some(o)) => {
                let t: Vec<u64> = self
                    .table
                    .chunks_exact(8)
                    .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
                    .collect();
                oc::elements(o, n, r, root, count, &t, flag, false)
                    .ok()
                    .map(|e| (e.input, e.output))
            }
            _ => None,
        };
        let (i, o) = want.unwrap_or((0, 0));
        let bytes = |x: u64| x.checked_mul(elem).unwrap_or(0);
        let adjust = |len: u64, by: u32| len.saturating_add_signed(i64::from(by as i32));
        (
            adjust(bytes(i), self.in_len),
            adjust(bytes(o), self.out_len),
        )
    }

    /// The chain's descriptors: (addr, len, writable).
    fn descriptors(&self, limits: &Limits, comms: &Comms) -> Vec<(u64, u32, bool)> {
        let (inb, outb) = self.lengths(limits, comms);
        let mut cuts = self.cuts.iter().copied();
        let mut d = vec![(self.header_addr(), self.header_len(), false)];
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
        if self.shape & SHAPE_MISORDER != 0 {
            d.push((NOWHERE, 0, false));
        }
        let comm_resp = self.with_comm() != (self.shape & SHAPE_OTHER_RESPONSE != 0);
        let resp = if comm_resp { oc::RESPONSE } else { 16 };
        d.push((RESP, resp as u32, true));
        d
    }

    /// Writes the header and its table (zero-padded to the descriptor's
    /// length) as far as they lie in the data area. A table larger than
    /// 16 times the world size is refused unread, so at most that much of
    /// it is written (the data area is not cleared between runs: what a
    /// run reads, it writes).
    fn write_header(&self, mem: &GuestMem) {
        let addr = self.header_addr();
        let most = 48 + 16 * u64::from(self.world_size());
        let len = u64::from(self.header_len()).min(most);
        let lo = addr.max(DATA);
        let hi = addr.saturating_add(len).min(A_SIZE);
        if lo >= hi {
            return;
        }
        let bytes: Vec<u8> = (lo - addr..hi - addr)
            .map(|k| match k as usize {
                k if k < 48 => self.header[k],
                k => self.table.get(k - 48).copied().unwrap_or(0),
            })
            .collect();
        mem.write_slice(&bytes, GuestAddress(lo))
            .expect("the range is in the data area");
    }
}

/// Builds the guest for `data` and hands the popped chain to `f`.
fn with_chain<R>(
    data: &[u8],
    f: impl FnOnce(&'static GuestMem, DescriptorChain<&'static GuestMem>, &Limits, &Comms) -> R,
) -> R {
    let _run = guest::exclusive();
    let case = Case::decode(data);
    let limits = case.limits();
    let comms = case.registry();
    let mem = guest::memory(Layout::SINGLE);
    case.write_header(mem);
    let descs = case.descriptors(&limits, &comms);
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
    let chain = guest::pop(mem, guest::MAX_QUEUE, 0);
    f(mem, chain, &limits, &comms)
}

/// Runs one input; also says whether the backend's answer was the spec's
/// or one of its known deviations.
pub fn run_model(data: &[u8]) -> (Outcome, Model) {
    with_chain(data, |mem, chain, limits, comms| {
        check_in(mem, chain, guest::MAX_QUEUE, limits, comms)
    })
}

/// Runs one input.
pub fn run(data: &[u8]) -> Outcome {
    run_model(data).0
}

/// The spec model's status for one input, without running the backend.
pub fn spec_status(data: &[u8]) -> Result<(), Option<(Status, u32)>> {
    with_chain(data, |mem, chain, limits, comms| {
        let walked = oracle::walk(mem, DESC_TABLE, guest::MAX_QUEUE, chain.head_index());
        oracle::expect(&walked, mem, limits, comms, Model::SPEC)
            .verdict()
            .0
    })
}

/// A 48-byte header: the base fields, then the communicator, peer, key
/// and `table_bytes`.
#[allow(clippy::too_many_arguments)] // one argument per header field
pub fn header(
    opcode: u16,
    dtype: u8,
    op: u8,
    root: u32,
    count: u64,
    flags: u32,
    comm: u32,
    peer: u32,
    key: u32,
    table_bytes: u32,
) -> [u8; 48] {
    let mut base = VirtioDmlcReqComm::read_from_bytes(&[0u8; 48][..]).expect("48 bytes");
    base.base = virtio_dmlc::VirtioDmlcReq::read_from_bytes(
        &base_header(Opcode::Allreduce, dtype, op, root, count, flags)[..],
    )
    .expect("32 bytes");
    base.base.opcode = opcode.into();
    base.comm = comm.into();
    base.peer = peer.into();
    base.key = key.into();
    base.table_bytes = table_bytes.into();
    let mut out = [0u8; 48];
    out.copy_from_slice(base.as_bytes());
    out
}

/// `le32` ranks of a comm_create list.
pub fn list(ranks: &[u32]) -> Vec<u8> {
    ranks.iter().flat_map(|r| r.to_le_bytes()).collect()
}

/// `le64` counts of a table.
pub fn counts(c: &[u64]) -> Vec<u8> {
    c.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The world of the seeds: rank 1 of 4, every feature bit, and three
/// communicators: 5 = group ranks [3, 1] (the member is rank 1 of 2),
/// 7 = [2, 1, 0] (rank 1 of 3), 9 = [0, 2, 3] (not a member).
pub fn base_case() -> Case {
    let comm = |id: u32, ranks: &[u8]| {
        let mut r = [0u8; MEMBERS];
        r[..ranks.len()].copy_from_slice(ranks);
        CommSpec {
            id,
            n: ranks.len() as u8,
            ranks: r,
        }
    };
    Case {
        features: 0x0e,
        world: 3,
        rank: 1,
        comms: [comm(5, &[3, 1]), comm(7, &[2, 1, 0]), comm(9, &[0, 2, 3])],
        max_segments: 8,
        max_bytes: 1 << 20,
        ..Case::default()
    }
}

/// One seed: an opcode on a communicator, with its table.
#[allow(clippy::too_many_arguments)] // one argument per header field
fn case(
    opcode: u16,
    dtype: Dtype,
    root: u32,
    count: u64,
    flags: u32,
    comm: u32,
    peer: u32,
    table: Vec<u8>,
) -> Case {
    let mut c = base_case();
    c.header = header(
        opcode,
        dtype.raw(),
        ReduceOp::Sum.raw(),
        root,
        count,
        flags,
        comm,
        peer,
        0,
        table.len() as u32,
    );
    c.table = table;
    c
}

/// Valid requests of every served opcode of bits 1 to 3, opcodes of
/// 5.X.6.1 on communicators other than 0, requests without bit 1, and
/// each rejection of 5.X.6.13; with their expected outcomes (those of bit
/// 3's opcodes depend on whether the backend serves bit 3).
pub fn seeds() -> (Vec<Seed>, Vec<Outcome>) {
    use CommOpcode::*;
    use Dtype::*;
    let valid = Outcome::Valid { bounces: 0 };
    let bad_req = |d| Outcome::Rejected(Some((Status::BadRequest, d)));
    let no_opcode = Outcome::Rejected(Some((Status::Unsupported, unsupported::OPCODE)));
    let bit3 = vhost_device_dmlc::chain::SERVED_COMM_FEATURES & (1 << oc::F_BLOCKS) != 0;
    // Valid, or unsupported where bit 3 is not served.
    let blocks = |o: Outcome| if bit3 { o } else { no_opcode };
    let base = |o: Opcode| o.raw();
    let ip = FLAG_IN_PLACE;
    let mut cases: Vec<(&'static str, Case, Outcome)> = vec![
        ("send", case(Send.raw(), F32, 0, 16, 0, 5, 0, vec![]), valid),
        ("recv", case(Recv.raw(), F32, 0, 16, 0, 5, 0, vec![]), valid),
        (
            "recv-any-source",
            case(Recv.raw(), U8, 0, 100, 0, 0, ANY_SOURCE, vec![]),
            valid,
        ),
        (
            "send-world",
            case(Send.raw(), I64, 0, 4, 0, 0, 3, vec![]),
            valid,
        ),
        (
            "split",
            case(CommSplit.raw(), U8, 0, 0, 0, 0, 1, vec![]),
            valid,
        ),
        (
            "split-undefined",
            case(CommSplit.raw(), U8, 0, 0, 0, 7, UNDEFINED, vec![]),
            valid,
        ),
        (
            "create",
            case(CommCreate.raw(), U8, 0, 0, 0, 0, 0, list(&[3, 1])),
            valid,
        ),
        (
            "create-in-comm",
            case(CommCreate.raw(), U8, 0, 0, 0, 7, 0, list(&[1, 0])),
            valid,
        ),
        (
            "free",
            case(CommFree.raw(), U8, 0, 0, 0, 5, 0, vec![]),
            valid,
        ),
        (
            "allreduce-comm",
            case(base(Opcode::Allreduce), F32, 0, 8, 0, 5, 0, vec![]),
            valid,
        ),
        (
            "allgather-in-place-comm",
            case(base(Opcode::Allgather), F64, 0, 3, ip, 7, 0, vec![]),
            valid,
        ),
        (
            "broadcast-comm",
            case(base(Opcode::Broadcast), U8, 2, 100, 0, 7, 0, vec![]),
            valid,
        ),
        (
            "reduce-scatter-comm",
            case(base(Opcode::ReduceScatter), I32, 0, 6, 0, 5, 0, vec![]),
            valid,
        ),
        (
            "barrier-comm",
            case(base(Opcode::Barrier), U8, 0, 0, 0, 7, 0, vec![]),
            valid,
        ),
        (
            "nop-comm",
            case(base(Opcode::Nop), U8, 0, 0, 0, 5, 0, vec![]),
            valid,
        ),
        (
            "alltoall",
            case(Alltoall.raw(), F32, 0, 2, 0, 7, 0, vec![]),
            blocks(valid),
        ),
        (
            "alltoallv",
            case(Alltoallv.raw(), I32, 0, 0, 0, 5, 0, counts(&[1, 2, 3, 4])),
            blocks(valid),
        ),
        (
            "gather-root-in-place",
            case(Gather.raw(), F32, 1, 4, ip, 7, 0, vec![]),
            blocks(valid),
        ),
        (
            "gather",
            case(Gather.raw(), U32, 0, 4, 0, 0, 0, vec![]),
            blocks(valid),
        ),
        (
            "gather-in-place-non-root",
            case(Gather.raw(), U32, 0, 4, ip, 0, 0, vec![]),
            blocks(valid),
        ),
        (
            "gatherv-root",
            case(Gatherv.raw(), U8, 1, 3, 0, 5, 0, counts(&[2, 3])),
            blocks(valid),
        ),
        (
            "scatter-root",
            case(Scatter.raw(), Bf16, 1, 2, 0, 0, 0, vec![]),
            blocks(valid),
        ),
        (
            "scatterv",
            case(Scatterv.raw(), U64, 0, 5, 0, 7, 0, vec![]),
            blocks(valid),
        ),
        (
            "scatterv-root-in-place",
            case(Scatterv.raw(), F16, 1, 2, ip, 7, 0, counts(&[1, 2, 3])),
            blocks(valid),
        ),
        // Rejections of 5.X.6.13.
        (
            "reserved-opcode",
            case(18, U8, 0, 0, 0, 0, 0, vec![]),
            no_opcode,
        ),
        (
            "unknown-comm",
            case(base(Opcode::Allreduce), F32, 0, 8, 0, 42, 0, vec![]),
            bad_req(oc::BAD_COMM),
        ),
        (
            "not-a-member",
            case(Send.raw(), F32, 0, 8, 0, 9, 0, vec![]),
            bad_req(oc::BAD_COMM),
        ),
        (
            "free-world",
            case(CommFree.raw(), U8, 0, 0, 0, 0, 0, vec![]),
            bad_req(oc::BAD_COMM),
        ),
        (
            "send-to-self",
            case(Send.raw(), F32, 0, 8, 0, 0, 1, vec![]),
            bad_req(oc::BAD_PEER),
        ),
        (
            "send-outside",
            case(Send.raw(), F32, 0, 8, 0, 5, 2, vec![]),
            bad_req(oc::BAD_PEER),
        ),
        (
            "recv-from-self",
            case(Recv.raw(), F32, 0, 8, 0, 5, 1, vec![]),
            bad_req(oc::BAD_PEER),
        ),
        (
            "table-on-allreduce",
            case(base(Opcode::Allreduce), F32, 0, 8, 0, 0, 0, vec![0; 8]),
            bad_req(oc::BAD_TABLE),
        ),
        (
            "gatherv-table-size",
            case(Gatherv.raw(), U8, 1, 3, 0, 5, 0, counts(&[3])),
            blocks(bad_req(oc::BAD_TABLE)),
        ),
        (
            "table-too-big",
            case(base(Opcode::Barrier), U8, 0, 0, 0, 0, 0, vec![0; 72]),
            bad_req(oc::BAD_TABLE),
        ),
        (
            "create-repeat",
            case(CommCreate.raw(), U8, 0, 0, 0, 0, 0, list(&[1, 1])),
            bad_req(oc::BAD_TABLE),
        ),
        (
            "create-outside",
            case(CommCreate.raw(), U8, 0, 0, 0, 5, 0, list(&[1, 2])),
            bad_req(oc::BAD_TABLE),
        ),
        (
            "create-without-caller",
            case(CommCreate.raw(), U8, 0, 0, 0, 0, 0, list(&[0, 3])),
            bad_req(oc::BAD_TABLE),
        ),
        (
            "create-ragged",
            case(CommCreate.raw(), U8, 0, 0, 0, 0, 0, vec![1, 0, 0, 0, 3, 0]),
            bad_req(oc::BAD_TABLE),
        ),
        (
            "create-empty",
            case(CommCreate.raw(), U8, 0, 0, 0, 0, 0, vec![]),
            bad_req(oc::BAD_TABLE),
        ),
        (
            "send-in-place",
            case(Send.raw(), F32, 0, 16, ip, 0, 0, vec![]),
            bad_req(oc::BAD_IN_PLACE_OPCODE),
        ),
        (
            "alltoall-in-place",
            case(Alltoall.raw(), F32, 0, 2, ip, 7, 0, vec![]),
            blocks(bad_req(oc::BAD_IN_PLACE_OPCODE)),
        ),
        (
            "broadcast-root-outside-comm",
            case(base(Opcode::Broadcast), U8, 2, 100, 0, 5, 0, vec![]),
            bad_req(bad::ROOT),
        ),
        (
            "gather-root-outside-comm",
            case(Gather.raw(), U8, 3, 1, 0, 7, 0, vec![]),
            blocks(bad_req(bad::ROOT)),
        ),
        (
            "split-root",
            case(CommSplit.raw(), U8, 1, 0, 0, 0, 2, vec![]),
            bad_req(bad::ROOT),
        ),
        (
            "split-count",
            case(CommSplit.raw(), U8, 0, 3, 0, 0, 2, vec![]),
            bad_req(bad::BARRIER_DATA),
        ),
        (
            "alltoall-overflow",
            case(Alltoall.raw(), U8, 0, u64::MAX / 2, 0, 7, 0, vec![]),
            blocks(bad_req(bad::OVERFLOW)),
        ),
    ];
    // Lengths, limits and layouts.
    let mut c = case(Send.raw(), F32, 0, 16, 0, 5, 0, vec![]);
    c.max_bytes = 32;
    cases.push((
        "send-too-big",
        c,
        Outcome::Rejected(Some((Status::TooBig, too_big::BYTES))),
    ));
    let mut c = case(Recv.raw(), F32, 0, 16, 0, 7, 0, vec![]);
    c.out_len = (-4i32) as u32;
    cases.push(("recv-short", c, bad_req(bad::OUTPUT_LENGTH)));
    let mut c = case(Recv.raw(), F32, 0, 16, 0, 0, 3, vec![]);
    c.build = 0x02 | 0x04 | 0x20 | 0x40 | 0x10;
    c.cuts = [4, 60, 8, 0, 0, 0];
    cases.push(("recv-cut-indirect", c, valid));
    let mut c = case(CommCreate.raw(), U8, 0, 0, 0, 0, 0, list(&[3, 1]));
    c.shape = SHAPE_LEN_ADJUST;
    c.adjust = 1;
    cases.push(("header-longer-than-table", c, bad_req(bad::HEADER)));
    let mut c = case(Send.raw(), F32, 0, 16, 0, 5, 0, vec![]);
    c.shape = SHAPE_LEN_OTHER;
    cases.push(("header-32-with-bit-1", c, bad_req(bad::HEADER)));
    let mut c = case(Send.raw(), F32, 0, 16, 0, 5, 0, vec![]);
    c.shape = SHAPE_OTHER_RESPONSE;
    cases.push(("response-16-with-bit-1", c, Outcome::Rejected(None)));
    // The table's last 8 bytes lie past the end of guest memory.
    let mut c = case(CommCreate.raw(), U8, 0, 0, 0, 0, 0, list(&[3, 1]));
    c.shape = SHAPE_AT_END;
    c.place = 8;
    cases.push(("table-past-memory", c, bad_req(bad::ADDRESS)));
    // At the very end of guest memory, inside it.
    let mut c = case(CommCreate.raw(), U8, 0, 0, 0, 7, 0, list(&[2, 1]));
    c.shape = SHAPE_AT_END;
    cases.push(("table-at-end", c, valid));
    // Without bit 1: the 32-byte header and 16-byte response of 5.X.6.1.
    let mut c = case(base(Opcode::Allreduce), F32, 0, 8, 0, 0, 0, vec![]);
    c.features = 0;
    cases.push(("no-comm-bit", c, valid));
    let mut c = case(base(Opcode::Allreduce), F32, 0, 8, 0, 0, 0, vec![]);
    c.features = 1;
    cases.push(("timeout-bit-only", c, valid));
    let mut c = case(Send.raw(), F32, 0, 8, 0, 0, 3, vec![]);
    c.features = 1 << oc::F_P2P;
    cases.push(("p2p-without-comm-bit", c, no_opcode));
    let mut c = case(Send.raw(), F32, 0, 8, 0, 0, 3, vec![]);
    c.features = 1 << oc::F_COMM;
    cases.push(("send-without-p2p-bit", c, no_opcode));
    let mut c = case(Gather.raw(), F32, 0, 8, 0, 0, 0, vec![]);
    c.features = 1 << oc::F_COMM | 1 << oc::F_P2P;
    cases.push(("gather-without-blocks-bit", c, no_opcode));
    let mut c = case(base(Opcode::Allreduce), F32, 0, 8, 0, 0, 0, vec![]);
    c.features = 0;
    c.shape = SHAPE_OTHER_RESPONSE;
    cases.push(("response-40-without-bit-1", c, Outcome::Rejected(None)));

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
    //! The backend's known deviations from the spec (D1 to D4 in
    //! `crate::oracle`), each with a minimal input: the harness tolerates
    //! them, and these tests fail once the backend follows the spec, so
    //! that the tolerance goes with the deviation.

    use super::*;

    type Status2 = Result<(), Option<(Status, u32)>>;

    /// The spec's status, and the backend's outcome with the model it matched.
    fn both(c: &Case) -> (Status2, (Outcome, Model)) {
        let data = c.encode();
        (spec_status(&data), run_model(&data))
    }

    fn bad_req(d: u32) -> Status2 {
        Err(Some((Status::BadRequest, d)))
    }

    /// The seeds follow the spec itself, not a known deviation.
    #[test]
    fn seeds_follow_the_spec() {
        let (seeds, want) = seeds();
        for (s, w) in seeds.iter().zip(&want) {
            assert_eq!(run_model(&s.bytes), (*w, Model::SPEC), "seed {}", s.name);
        }
    }

    /// With bit 1, the header's exact length (`0x30 + table_bytes`) comes
    /// after ORDER and the header's ADDRESS (5.X.6.7.3 with bit 1), unlike
    /// the 32 bytes without it (D1).
    #[test]
    fn with_bit_1_the_exact_length_comes_after_order_and_address() {
        let mut c = case(Opcode::Allreduce.raw(), Dtype::F32, 0, 8, 0, 0, 0, vec![]);
        c.shape = SHAPE_LEN_ADJUST | SHAPE_MISORDER;
        c.adjust = 1;
        let order = Outcome::Rejected(Some((Status::BadRequest, bad::ORDER)));
        assert_eq!(run_model(&c.encode()), (order, Model::SPEC));
        c.shape = SHAPE_LEN_ADJUST | SHAPE_AT_END;
        c.place = 1;
        let address = Outcome::Rejected(Some((Status::BadRequest, bad::ADDRESS)));
        assert_eq!(run_model(&c.encode()), (address, Model::SPEC));
    }

    /// D1: without bit 1, a header one byte too long, and a zero-length
    /// readable descriptor after an output (or the header running out of
    /// guest memory): 5.X.6.7.3 step 2 lists HEADER first (the backend said
    /// ORDER or ADDRESS until fixed).
    #[test]
    fn d1_order_and_address_before_header_length() {
        let mut c = case(Opcode::Allreduce.raw(), Dtype::F32, 0, 8, 0, 0, 0, vec![]);
        c.features = 0;
        c.shape = SHAPE_LEN_ADJUST | SHAPE_MISORDER;
        c.adjust = 1;
        let (spec, got) = both(&c);
        assert_eq!(spec, bad_req(bad::HEADER));
        assert_eq!(got, (Outcome::Rejected(spec.unwrap_err()), Model::SPEC));
        c.shape = SHAPE_LEN_ADJUST | SHAPE_AT_END;
        c.place = 1;
        let (spec, got) = both(&c);
        assert_eq!(spec, bad_req(bad::HEADER));
        assert_eq!(got, (Outcome::Rejected(spec.unwrap_err()), Model::SPEC));
    }

    /// D2: a send of 0 elements with the in-place flag: "not allowed" in
    /// place (5.X.6.13.2, 5.X.6.13.6) (the backend accepted it until fixed).
    #[test]
    fn d2_in_place_without_elements() {
        let c = case(
            CommOpcode::Send.raw(),
            Dtype::F32,
            0,
            0,
            FLAG_IN_PLACE,
            0,
            0,
            vec![],
        );
        let (spec, got) = both(&c);
        assert_eq!(spec, bad_req(oc::BAD_IN_PLACE_OPCODE));
        assert_eq!(got, (Outcome::Rejected(spec.unwrap_err()), Model::SPEC));
    }

    /// D3: a comm_create whose count times the communicator's size
    /// overflows: OVERFLOW (5.X.6.7.2) (the backend said BARRIER_DATA until
    /// fixed).
    #[test]
    fn d3_comm_create_count_overflow() {
        let c = case(
            CommOpcode::CommCreate.raw(),
            Dtype::U8,
            0,
            u64::MAX,
            0,
            0,
            0,
            list(&[1]),
        );
        let (spec, got) = both(&c);
        assert_eq!(spec, bad_req(bad::OVERFLOW));
        assert_eq!(got, (Outcome::Rejected(spec.unwrap_err()), Model::SPEC));
    }

    /// D4: an alltoallv of 2 members (communicator 5) with a 25-byte
    /// table, 7 bytes short of the 32 it needs: BAD_TABLE (5.X.6.13.5);
    /// the backend read it as 4 counts of 0 and accepted it until fixed.
    #[test]
    fn d4_ragged_table_read_as_zero_counts() {
        let c = case(
            CommOpcode::Alltoallv.raw(),
            Dtype::F32,
            0,
            0,
            0,
            5,
            0,
            vec![0; 25],
        );
        let (spec, got) = both(&c);
        assert_eq!(spec, bad_req(oc::BAD_TABLE));
        assert_eq!(got, (Outcome::Rejected(spec.unwrap_err()), Model::SPEC));
    }
}
