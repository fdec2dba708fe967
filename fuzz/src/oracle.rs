//! What the spec says the device must do with a chain, written from
//! docs/spec.md (5.X.6.4 buffer sizes, 5.X.6.7 statuses, the walk of a
//! chain and the order of the local checks, and with feature bit 1 the
//! rules of 5.X.6.13, see [`crate::oracle_comm`]) without looking at how
//! the backend does it, so that the fuzz targets can compare the two. The
//! walk ([`walk`]) reads the descriptor tables from guest memory itself,
//! not through virtio-queue's iterator, which the backend uses.
//!
//! ## Orders
//!
//! 5.X.6.7.3 orders the checks, and places those of bit 1 (`BAD_COMM`,
//! `BAD_PEER`, `BAD_TABLE`, `BAD_IN_PLACE_OPCODE`): after step 4 `COMM`
//! then `TABLE` for a table larger than 16 times the group's size; `PEER`
//! after `ROOT`; in step 6 `TABLE` before `OVERFLOW`, then
//! `IN_PLACE_OPCODE`; in step 2 the header's whole range among the
//! addresses, and "after `ADDRESS`, `HEADER` again" for a header that is
//! not exactly `0x30 + table_bytes` long. Where that leaves a choice, the
//! model takes the backend's order (vhost-device/src/chain.rs,
//! `parse_in`):
//!
//! - the exact length comes after the header's own `ADDRESS` and before
//!   the data descriptors' (the spec's "after `ADDRESS`" could mean after
//!   all of them);
//! - within `COMM`: an unknown id or one the member is not in before
//!   comm_free of 0 (the same code either way).
//!
//! ## Readings where the spec is silent
//!
//! - comm_split, comm_create and comm_free have no buffers (5.X.6.13.2):
//!   like barrier and nop they ignore `dtype` and get `BARRIER_DATA` for a
//!   non-zero `count` or a data segment (5.X.6.1 and 5.X.6.7.2 name only
//!   barrier and nop; the backend treats all five alike).
//! - where 5.X.6.13.2 says the in-place flag "has no effect" (a gather's
//!   or scatter's non-root), the request is checked as without it, so an
//!   input segment is not `IN_PLACE_INPUT` (5.X.6.7.2 words that code on
//!   the flag alone; the backend follows 5.X.6.13.2). The opcodes of
//!   5.X.6.1 keep the flag-alone reading (a broadcast's non-root), as the
//!   backend does.
//! - `world_size` in `OVERFLOW` (`count * world_size`) and `ROOT` is the
//!   communicator's size, as 5.X.6.13.1 says for 5.X.6.4 and 5.X.6.6.
//!
//! ## Deviations the backend had (all fixed)
//!
//! [`Model`] can add these to the spec; a test in `comm_header` checks
//! each is gone (the backend now gives the spec's answer). With
//! `DMLC_FUZZ_LENIENT` set, the harness accepts an answer explained by
//! some of them (the fewest that do), to triage a run that finds one
//! again; by default none is accepted:
//!
//! - D1: without bit 1, a header descriptor longer than 32 bytes gets
//!   `ORDER` (with a readable descriptor after a writable one) or
//!   `ADDRESS` (when its range leaves guest memory) where 5.X.6.7.3 step 2
//!   says `HEADER` first: the backend checks the exact length the way bit
//!   1 needs it, after `ORDER` and the header's `ADDRESS`, for every
//!   request (before bit 1 it checked it first).
//! - D2: the in-place flag on a request of bits 2 or 3 whose buffers are
//!   all empty (count 0, or an alltoallv whose counts are all 0) is taken
//!   as clear: no `BAD_IN_PLACE_OPCODE` on send, recv, alltoall and
//!   alltoallv, which 5.X.6.13.2 says are "not allowed" in place, and no
//!   `IN_PLACE_INPUT` on a gather's or scatter's root.
//! - D3: comm_create does not check that `count * N` fits in 64 bits
//!   (5.X.6.7.2 `OVERFLOW`); every other opcode does, barrier and
//!   comm_split included.
//! - D4: a table of alltoallv, gatherv or scatterv whose size is not a
//!   multiple of 8 is read as `table_bytes / 8 + 1` counts of 0, so one of
//!   `8 * k - 7` to `8 * k - 1` bytes passes for the `8 * k` the opcode
//!   needs (an alltoallv of 2 members with a 25-byte table is valid, with
//!   empty buffers); 5.X.6.13.5 says `BAD_TABLE`.

use vhost_device_dmlc::chain::{Code, Limits};
use vhost_device_dmlc::GuestMem;
use virtio_dmlc::comm::CommOpcode;
use virtio_dmlc::{
    bad, too_big, unsupported, Dtype, Opcode, ReduceOp, Status, VirtioDmlcReq, FLAG_IN_PLACE,
    REQ_HEADER_SIZE, RESP_SIZE,
};
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Bytes, GuestAddress};

use crate::guest::{inside, F_INDIRECT, F_NEXT};
use crate::oracle_comm::{self as oc, Comms, Member};

/// How a chain's walk (5.X.6.7.1) came out.
#[derive(Clone, Debug)]
pub struct Walk {
    /// The descriptors reached, in chain order (a descriptor that refers
    /// to an indirect table is not one: the walk goes on into the table).
    pub descs: Vec<Descriptor>,
    /// Whether the walk reached a descriptor without `NEXT`; `false`: it
    /// stopped early (loop, `next` out of range, unusable indirect table,
    /// 2^32 bytes or more), at the last descriptor of `descs`.
    pub complete: bool,
}

/// Largest indirect table the device accepts, in entries (5.X.6.2).
const MAX_INDIRECT_ENTRIES: u32 = 65535;

/// Walks the chain at `head` of the split queue whose descriptor table of
/// `queue_size` entries is at guest address `table`, as 5.X.6.7.1 says:
/// descriptor by descriptor, into an
/// indirect table when a descriptor refers to one, stopping before the
/// next descriptor when it repeats one already reached (all 16 bytes: a
/// loop, closed by the last descriptor reached), when its index is not
/// below the size of its table, when it refers to an unusable indirect
/// table, when it is an entry of an indirect table that lies outside guest
/// memory, or when the lengths reached, its own included, would add up to
/// 2^32 bytes or more.
pub fn walk(mem: &GuestMem, table: u64, queue_size: u16, head: u16) -> Walk {
    let mut descs = Vec::new();
    let mut reached = std::collections::HashSet::new();
    let mut total = 0u64;
    // The table being walked: address, entries, whether indirect; and
    // how many of its entries the walk has read.
    let (mut base, mut entries, mut indirect) = (table, u32::from(queue_size), false);
    let mut read = 0u32;
    let mut index = head;
    let stop = |descs: Vec<Descriptor>| Walk {
        descs,
        complete: false,
    };
    loop {
        // Each entry at most once: a walk that has read them all and still
        // has NEXT is a loop closed by its last descriptor.
        if u32::from(index) >= entries || read == entries {
            return stop(descs);
        }
        read += 1;
        let at = base.checked_add(16 * u64::from(index));
        let mut raw = [0u8; 16];
        let Some(at) = at.filter(|&at| inside(mem, at, 16)) else {
            // An indirect table's entry outside guest memory (the harness
            // queue lies inside it): the walk stops before it.
            return stop(descs);
        };
        mem.read_slice(&mut raw, GuestAddress(at))
            .expect("the entry is inside guest memory");
        let field = |r: std::ops::Range<usize>| {
            let mut b = [0u8; 8];
            b[..r.len()].copy_from_slice(&raw[r]);
            u64::from_le_bytes(b)
        };
        let (addr, len) = (field(0..8), field(8..12) as u32);
        let (flags, next) = (field(12..14) as u16, field(14..16) as u16);
        if flags & F_INDIRECT != 0 {
            // 5.X.6.2: it ends the chain (its NEXT and next are ignored);
            // the walk goes on at entry 0 of its table, if usable.
            let usable = !indirect && len != 0 && len % 16 == 0 && len / 16 <= MAX_INDIRECT_ENTRIES;
            if !usable {
                return stop(descs);
            }
            (base, entries, indirect) = (addr, len / 16, true);
            (index, read) = (0, 0);
            continue;
        }
        // A loop: the descriptor that closes it is the last one reached.
        if !reached.insert(raw) {
            return stop(descs);
        }
        total += u64::from(len);
        if total >= 1 << 32 {
            return stop(descs);
        }
        descs.push(Descriptor::new(addr, len, flags, next));
        if flags & F_NEXT == 0 {
            return Walk {
                descs,
                complete: true,
            };
        }
        index = next;
    }
}

/// Which answers the model gives: the spec's, or the spec's with some of
/// the backend's known deviations (bit `k - 1` for D`k`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Model(pub u8);

impl Model {
    /// docs/spec.md as written (with the readings above where it is silent).
    pub const SPEC: Model = Model(0);
    pub const D1: Model = Model(1);
    pub const D2: Model = Model(2);
    pub const D3: Model = Model(4);
    pub const D4: Model = Model(8);
    /// Every known deviation at once.
    pub const BACKEND: Model = Model(15);
    /// The models the harness tries when the backend's answer is not the
    /// spec's: every set of deviations, fewest first (so that the one
    /// found is the smallest that explains the answer).
    pub fn known() -> impl Iterator<Item = Model> {
        (1..=4).flat_map(|n| {
            (1..=Model::BACKEND.0)
                .filter(move |m: &u8| m.count_ones() == n)
                .map(Model)
        })
    }

    /// Whether the deviations of `d` are in the model.
    pub fn has(self, d: Model) -> bool {
        self.0 & d.0 == d.0
    }
}

impl std::fmt::Display for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if *self == Model::SPEC {
            return f.write_str("spec");
        }
        let ds: Vec<String> = (0..4)
            .filter(|k| self.0 & 1 << k != 0)
            .map(|k| format!("D{}", k + 1))
            .collect();
        f.write_str(&ds.join("+"))
    }
}

/// Byte sizes a valid request has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sizes {
    pub elem: u64,
    pub input: u64,
    pub output: u64,
    /// In place: byte offset and length of the member's input (or, for a
    /// scatter's root, its own output block) in the one writable buffer.
    pub in_place: Option<(u64, u64)>,
}

/// What a valid request with feature bit 1 carries besides the header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommExpect {
    pub comm: Member,
    pub peer: u32,
    pub key: u32,
    /// The table as guest memory holds it.
    pub table: Vec<u8>,
}

/// The device's answer to one chain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expected {
    /// Valid: takes a sequence number (or is matched, for send and recv).
    Valid {
        header: VirtioDmlcReq,
        code: Code,
        sizes: Sizes,
        /// With feature bit 1.
        comm: Option<CommExpect>,
    },
    /// Completed at once.
    Rejected {
        /// Where the response goes; `None`: used length 0, nothing written.
        response: Option<u64>,
        /// Used length when a response is written.
        writable_len: u32,
        /// The opcode, once the header was read and the opcode is known.
        code: Option<Code>,
        /// Status and detail; `None` when no response can be written.
        status: Option<(Status, u32)>,
    },
}

/// What tells one answer from another at a glance: the status (`Ok` for
/// a valid request; `None` inside for no response) and the opcode known.
pub type Verdict = (Result<(), Option<(Status, u32)>>, Option<Code>);

impl Expected {
    /// The status the device reports and the opcode it knows.
    pub fn verdict(&self) -> Verdict {
        match self {
            Expected::Valid { code, .. } => (Ok(()), Some(*code)),
            Expected::Rejected { status, code, .. } => (Err(*status), *code),
        }
    }
}

/// Elements of (input, output, in-place input as (offset, length)).
pub type Elements = (u64, u64, Option<(u64, u64)>);

/// Buffer sizes in elements from the table of 5.X.6.4, or `None` if
/// `N * c` overflows.
pub fn elements(
    opcode: Opcode,
    n: u32,
    r: u32,
    root: u32,
    c: u64,
    in_place: bool,
) -> Option<Elements> {
    let nc = c.checked_mul(u64::from(n))?;
    let root_member = r == root;
    Some(match (opcode, in_place) {
        (Opcode::Allreduce, false) => (c, c, None),
        (Opcode::Allreduce, true) => (0, c, Some((0, c))),
        (Opcode::Broadcast, false) if root_member => (c, c, None),
        (Opcode::Broadcast, true) if root_member => (0, c, Some((0, c))),
        // Non-root: no input, and the flag has no effect.
        (Opcode::Broadcast, _) => (0, c, None),
        (Opcode::Reduce, false) if root_member => (c, c, None),
        (Opcode::Reduce, false) => (c, 0, None),
        (Opcode::Reduce, true) => (0, c, Some((0, c))),
        (Opcode::Allgather, false) => (c, nc, None),
        // Block r of N blocks of c: r * c <= N * c, which fits.
        (Opcode::Allgather, true) => (0, nc, Some((u64::from(r) * c, c))),
        (Opcode::ReduceScatter, false) => (nc, c, None),
        (Opcode::ReduceScatter, true) => (0, nc, Some((0, nc))),
        (Opcode::Barrier | Opcode::Nop, _) => (0, 0, None),
    })
}

fn is_bitwise(op: ReduceOp) -> bool {
    matches!(op, ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor)
}

fn is_float(d: Dtype) -> bool {
    matches!(d, Dtype::F32 | Dtype::F64 | Dtype::F16 | Dtype::Bf16)
}

/// The spec's verdict on the chain that `walk` gives, for a member with
/// `limits` (its negotiated features among them) and, with feature bit 1,
/// the communicators `comms`; `model` picks the spec or the backend's
/// known deviations from it.
pub fn expect(
    walk: &Walk,
    mem: &GuestMem,
    limits: &Limits,
    comms: &Comms,
    model: Model,
) -> Expected {
    let descs = &walk.descs[..];
    let reject = |response, writable_len, code, status| Expected::Rejected {
        response,
        writable_len,
        code,
        status,
    };
    // 5.X.6.13.1: with bit 1 every request has the 48-byte header (and
    // its table) and the 40-byte response; 5.X.6.2 applies with them.
    let with_comm = limits.features & (1 << oc::F_COMM) != 0;
    let (fixed, resp_size) = if with_comm {
        (oc::HEADER_FIXED, oc::RESPONSE)
    } else {
        (REQ_HEADER_SIZE, RESP_SIZE)
    };

    // Step 1: a usable response descriptor ends the chain.
    let Some(last) = descs.last() else {
        return reject(None, 0, None, None);
    };
    let writable: u64 = descs
        .iter()
        .filter(|d| d.is_write_only())
        .map(|d| u64::from(d.len()))
        .sum();
    let writable = u32::try_from(writable).unwrap_or(u32::MAX);
    if !last.is_write_only()
        || last.len() as usize != resp_size
        || !inside(mem, last.addr().0, resp_size as u64)
    {
        return reject(None, writable, None, None);
    }
    let resp = Some(last.addr().0);
    let bad_req = |detail| Some((Status::BadRequest, detail));

    // Step 2: structure. A chain whose walk stopped early gets CHAIN, and
    // only its response counts in the used length.
    if !walk.complete {
        return reject(resp, resp_size as u32, None, bad_req(bad::CHAIN));
    }
    let first = descs[0];
    if descs.len() < 2 || first.is_write_only() || (first.len() as usize) < fixed {
        return reject(resp, writable, None, bad_req(bad::HEADER));
    }
    // Without bit 1 the header is exactly 32 bytes, known without reading
    // it. D1: the backend checks it as bit 1's exact length, below.
    if !model.has(Model::D1) && !with_comm && first.len() as usize != REQ_HEADER_SIZE {
        return reject(resp, writable, None, bad_req(bad::HEADER));
    }
    let data = &descs[1..descs.len() - 1];
    if data
        .windows(2)
        .any(|w| w[0].is_write_only() && !w[1].is_write_only())
    {
        return reject(resp, writable, None, bad_req(bad::ORDER));
    }
    // The header descriptor's whole range (with bit 1 its table too) is
    // one of the addresses ADDRESS checks, and the first: it comes before
    // the exact length (5.X.6.7.3 with bit 1), which comes before the data
    // descriptors' addresses (the backend's order: the spec says "after
    // ADDRESS, HEADER again", which could also mean after them).
    let in_mem = |d: &Descriptor| inside(mem, d.addr().0, u64::from(d.len()));
    if !in_mem(&first) {
        return reject(resp, writable, None, bad_req(bad::ADDRESS));
    }
    let mut raw = [0u8; oc::HEADER_FIXED];
    mem.read_slice(&mut raw[..fixed], GuestAddress(first.addr().0))
        .expect("the header is inside guest memory");
    let field = |at: usize| u32::from_le_bytes([raw[at], raw[at + 1], raw[at + 2], raw[at + 3]]);
    // With bit 1, the descriptor is exactly 0x30 + table_bytes long.
    let table_bytes = if with_comm {
        field(oc::AT_TABLE_BYTES)
    } else {
        0
    };
    if u64::from(first.len()) != fixed as u64 + u64::from(table_bytes) {
        return reject(resp, writable, None, bad_req(bad::HEADER));
    }
    // Zero-length data descriptors are ignored, wherever they point.
    let data: Vec<Descriptor> = data.iter().copied().filter(|d| d.len() != 0).collect();
    if !data.iter().all(in_mem) {
        return reject(resp, writable, None, bad_req(bad::ADDRESS));
    }
    let header = <VirtioDmlcReq as zerocopy::FromBytes>::read_from_bytes(&raw[..REQ_HEADER_SIZE])
        .expect("32 bytes make a header");

    // Steps 3 and 4: known opcode, dtype and op; op defined for dtype.
    let unsupported = |detail| Some((Status::Unsupported, detail));
    let raw_op = header.opcode.get();
    let code = match (Opcode::from_raw(raw_op), CommOpcode::from_raw(raw_op)) {
        (Some(o), _) => Code::Base(o),
        // 5.X.6.13.6: without bit 1, opcode 7 and above is unsupported.
        (None, Some(o)) if with_comm && oc::known(o, limits.features) => Code::Comm(o),
        _ => return reject(resp, writable, None, unsupported(unsupported::OPCODE)),
    };
    let op_known = Some(code);
    let uses_dtype = match code {
        Code::Base(o) => !matches!(o, Opcode::Barrier | Opcode::Nop),
        Code::Comm(o) => oc::uses_dtype(o),
    };
    let dtype = if uses_dtype {
        match Dtype::from_raw(header.dtype) {
            Some(d) => Some(d),
            None => return reject(resp, writable, op_known, unsupported(unsupported::DTYPE)),
        }
    } else {
        None
    };
    let op = match code {
        Code::Base(Opcode::Allreduce | Opcode::Reduce | Opcode::ReduceScatter) => {
            match ReduceOp::from_raw(header.op) {
                Some(o) => Some(o),
                None => return reject(resp, writable, op_known, unsupported(unsupported::OP)),
            }
        }
        _ => None,
    };
    if let (Some(d), Some(o)) = (dtype, op) {
        if is_bitwise(o) && is_float(d) {
            return reject(
                resp,
                writable,
                op_known,
                unsupported(unsupported::OP_FOR_DTYPE),
            );
        }
    }

    // The communicator (5.X.6.13.3) and the table (5.X.6.13.5); where in
    // the order: the backend's (see the module's comment).
    let mut comm = None;
    if with_comm {
        let id = field(oc::AT_COMM);
        let Some(member) = comms.find(id, limits.rank, limits.world_size) else {
            return reject(resp, writable, op_known, bad_req(oc::BAD_COMM));
        };
        if id == 0 && code == Code::Comm(CommOpcode::CommFree) {
            return reject(resp, writable, op_known, bad_req(oc::BAD_COMM));
        }
        if u64::from(table_bytes) > 16 * u64::from(limits.world_size) {
            return reject(resp, writable, op_known, bad_req(oc::BAD_TABLE));
        }
        let mut table = vec![0u8; table_bytes as usize];
        mem.read_slice(&mut table, GuestAddress(first.addr().0 + fixed as u64))
            .expect("the header is inside guest memory");
        comm = Some(CommExpect {
            comm: member,
            peer: field(oc::AT_PEER),
            key: field(oc::AT_KEY),
            table,
        });
    }
    // 5.X.6.13.1: `world_size` is read as the communicator's size, and
    // `root` and `peer` are ranks in it.
    let (n, r) = comm.as_ref().map_or((limits.world_size, limits.rank), |c| {
        (c.comm.size, c.comm.rank)
    });

    // Step 5: flags, root, and with bit 2 the peer.
    let flags = header.flags.get();
    if flags & !FLAG_IN_PLACE != 0 {
        return reject(resp, writable, op_known, bad_req(bad::FLAGS));
    }
    let root = header.root.get();
    let rooted = match code {
        Code::Base(o) => matches!(o, Opcode::Broadcast | Opcode::Reduce),
        Code::Comm(o) => oc::has_root(o),
    };
    if (rooted && root >= n) || (!rooted && root != 0) {
        return reject(resp, writable, op_known, bad_req(bad::ROOT));
    }
    if let (Code::Comm(o @ (CommOpcode::Send | CommOpcode::Recv)), Some(c)) = (code, &comm) {
        // 5.X.6.13.4: not the member itself, a rank of the communicator,
        // or any source for a receive.
        let any = o == CommOpcode::Recv && c.peer == oc::ANY_SOURCE;
        if !any && (c.peer == r || c.peer >= n) {
            return reject(resp, writable, op_known, bad_req(oc::BAD_PEER));
        }
    }

    // Step 6: the table's size, then size arithmetic.
    let count = header.count.get();
    let flag = flags & FLAG_IN_PLACE != 0;
    let elem = oc::elem_size(dtype);
    let table = comm.as_ref().map_or(&[][..], |c| &c.table[..]);
    let elems = match code {
        // 5.X.6.13.5 "any other": no table.
        Code::Base(_) if !table.is_empty() => Err(oc::BAD_TABLE),
        Code::Base(o) => match elements(o, n, r, root, count, flag) {
            None => Err(bad::OVERFLOW),
            // An in-place input of no elements (count 0) is no input at all.
            Some((i, o, ip)) => Ok((i, o, ip.filter(|&(_, n)| n > 0), flag)),
        },
        Code::Comm(CommOpcode::CommCreate) => {
            if !oc::create_list_ok(table, n, r) {
                Err(oc::BAD_TABLE)
            } else if !model.has(Model::D3) && count.checked_mul(u64::from(n)).is_none() {
                // D3: the backend does not check this.
                Err(bad::OVERFLOW)
            } else {
                Ok((0, 0, None, false))
            }
        }
        Code::Comm(o) => {
            // (A table of the wrong size is not read: BAD_TABLE below.)
            let t: Vec<u64> = if table.len() % 8 == 0 {
                table
                    .chunks(8)
                    .map(|c| u64::from_le_bytes(c.try_into().expect("8-byte counts")))
                    .collect()
            } else {
                // D4: the backend reads a table that is not a whole number
                // of counts as `len / 8 + 1` zero counts.
                vec![0; table.len() / 8 + 1]
            };
            let len = if !model.has(Model::D4) {
                table.len() as u64
            } else {
                8 * t.len() as u64
            };
            if oc::table_size(o, n, r == root) != Some(len) {
                Err(oc::BAD_TABLE)
            } else {
                oc::elements(o, n, r, root, count, &t, flag, model.has(Model::D2))
                    .map(|e| (e.input, e.output, e.in_place, e.in_place.is_some()))
            }
        }
    };
    // `in_place`: whether the in-place form applies, so that the chain may
    // have no input segment.
    let (input, output, own, in_place) = match elems {
        Ok(e) => e,
        Err(detail) => return reject(resp, writable, op_known, bad_req(detail)),
    };
    let bytes = |n: u64| n.checked_mul(elem);
    let sizes = (|| {
        Some(Sizes {
            elem,
            input: bytes(input)?,
            output: bytes(output)?,
            in_place: match own {
                Some((off, n)) => Some((bytes(off)?, bytes(n)?)),
                None => None,
            },
        })
    })();
    let Some(sizes) = sizes else {
        return reject(resp, writable, op_known, bad_req(bad::OVERFLOW));
    };

    // Step 7: limits.
    if sizes.input > limits.max_bytes || sizes.output > limits.max_bytes {
        return reject(
            resp,
            writable,
            op_known,
            Some((Status::TooBig, too_big::BYTES)),
        );
    }
    if data.len() as u64 > u64::from(limits.max_segments) {
        return reject(
            resp,
            writable,
            op_known,
            Some((Status::TooBig, too_big::SEGMENTS)),
        );
    }

    // Step 8: lengths.
    if !uses_dtype && (count != 0 || !data.is_empty()) {
        return reject(resp, writable, op_known, bad_req(bad::BARRIER_DATA));
    }
    let have_in: u64 = data
        .iter()
        .filter(|d| !d.is_write_only())
        .map(|d| u64::from(d.len()))
        .sum();
    let have_out: u64 = data
        .iter()
        .filter(|d| d.is_write_only())
        .map(|d| u64::from(d.len()))
        .sum();
    if in_place && have_in != 0 {
        return reject(resp, writable, op_known, bad_req(bad::IN_PLACE_INPUT));
    }
    if data.iter().any(|d| u64::from(d.len()) % elem != 0) {
        return reject(resp, writable, op_known, bad_req(bad::SEGMENT_ALIGN));
    }
    if have_in != sizes.input {
        return reject(resp, writable, op_known, bad_req(bad::INPUT_LENGTH));
    }
    if have_out != sizes.output {
        return reject(resp, writable, op_known, bad_req(bad::OUTPUT_LENGTH));
    }
    Expected::Valid {
        header,
        code,
        sizes,
        comm,
    }
}
