//! What the spec says the device must do with a chain, written from
//! docs/spec.md (5.X.6.4 buffer sizes, 5.X.6.7 statuses, the walk of a
//! chain and the order of the local checks) without looking at how the
//! backend does it, so that the fuzz targets can compare the two. The walk
//! ([`walk`]) reads the descriptor tables from guest memory itself, not
//! through virtio-queue's iterator, which the backend uses.

use vhost_device_dmlc::chain::Limits;
use vhost_device_dmlc::GuestMem;
use virtio_dmlc::{
    bad, too_big, unsupported, Dtype, Opcode, ReduceOp, Status, VirtioDmlcReq, FLAG_IN_PLACE,
    REQ_HEADER_SIZE, RESP_SIZE,
};
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Bytes, GuestAddress};

use crate::guest::{inside, F_INDIRECT, F_NEXT};

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

/// Byte sizes a valid request has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sizes {
    pub elem: u64,
    pub input: u64,
    pub output: u64,
    /// In place: byte offset and length of the member's input in the output.
    pub in_place: Option<(u64, u64)>,
}

/// The device's answer to one chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expected {
    /// Valid: takes a sequence number.
    Valid {
        header: VirtioDmlcReq,
        opcode: Opcode,
        sizes: Sizes,
    },
    /// Completed at once.
    Rejected {
        /// Where the response goes; `None`: used length 0, nothing written.
        response: Option<u64>,
        /// Used length when a response is written.
        writable_len: u32,
        /// The opcode, once the header was read and the opcode is known.
        opcode: Option<Opcode>,
        /// Status and detail; `None` when no response can be written.
        status: Option<(Status, u32)>,
    },
}

/// Elements of (input, output, in-place input as (offset, length)).
type Elements = (u64, u64, Option<(u64, u64)>);

/// Buffer sizes in elements from the table of 5.X.6.4, or `None` if
/// `N * c` overflows.
fn elements(opcode: Opcode, n: u32, r: u32, root: u32, c: u64, in_place: bool) -> Option<Elements> {
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

/// The spec's verdict on the chain that `walk` gives.
pub fn expect(walk: &Walk, mem: &GuestMem, limits: &Limits) -> Expected {
    let descs = &walk.descs[..];
    let reject = |response, writable_len, opcode, status| Expected::Rejected {
        response,
        writable_len,
        opcode,
        status,
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
        || last.len() as usize != RESP_SIZE
        || !inside(mem, last.addr().0, RESP_SIZE as u64)
    {
        return reject(None, writable, None, None);
    }
    let resp = Some(last.addr().0);
    let bad_req = |detail| Some((Status::BadRequest, detail));

    // Step 2: structure. A chain whose walk stopped early gets CHAIN, and
    // only its response counts in the used length.
    if !walk.complete {
        return reject(resp, RESP_SIZE as u32, None, bad_req(bad::CHAIN));
    }
    let first = descs[0];
    if descs.len() < 2 || first.is_write_only() || first.len() as usize != REQ_HEADER_SIZE {
        return reject(resp, writable, None, bad_req(bad::HEADER));
    }
    let data = &descs[1..descs.len() - 1];
    if data
        .windows(2)
        .any(|w| w[0].is_write_only() && !w[1].is_write_only())
    {
        return reject(resp, writable, None, bad_req(bad::ORDER));
    }
    // Zero-length data descriptors are ignored, wherever they point.
    let data: Vec<Descriptor> = data.iter().copied().filter(|d| d.len() != 0).collect();
    let in_mem = |d: &Descriptor| inside(mem, d.addr().0, u64::from(d.len()));
    if !in_mem(&first) || !data.iter().all(in_mem) {
        return reject(resp, writable, None, bad_req(bad::ADDRESS));
    }
    let mut raw = [0u8; REQ_HEADER_SIZE];
    mem.read_slice(&mut raw, GuestAddress(first.addr().0))
        .expect("header is inside guest memory");
    let header = <VirtioDmlcReq as zerocopy::FromBytes>::read_from_bytes(&raw[..])
        .expect("32 bytes make a header");

    // Steps 3 and 4: known opcode, dtype and op; op defined for dtype.
    let unsupported = |detail| Some((Status::Unsupported, detail));
    let Some(opcode) = Opcode::from_raw(header.opcode.get()) else {
        return reject(resp, writable, None, unsupported(unsupported::OPCODE));
    };
    let op_known = Some(opcode);
    let dtype = match opcode {
        Opcode::Barrier | Opcode::Nop => None,
        _ => match Dtype::from_raw(header.dtype) {
            Some(d) => Some(d),
            None => return reject(resp, writable, op_known, unsupported(unsupported::DTYPE)),
        },
    };
    let op = match opcode {
        Opcode::Allreduce | Opcode::Reduce | Opcode::ReduceScatter => {
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

    // Step 5: flags, root.
    let flags = header.flags.get();
    if flags & !FLAG_IN_PLACE != 0 {
        return reject(resp, writable, op_known, bad_req(bad::FLAGS));
    }
    let root = header.root.get();
    let root_ok = match opcode {
        Opcode::Broadcast | Opcode::Reduce => root < limits.world_size,
        _ => root == 0,
    };
    if !root_ok {
        return reject(resp, writable, op_known, bad_req(bad::ROOT));
    }

    // Step 6: size arithmetic.
    let count = header.count.get();
    let in_place = flags & FLAG_IN_PLACE != 0;
    let elem = dtype.map_or(1, |d| d.size() as u64);
    let sizes = elements(
        opcode,
        limits.world_size,
        limits.rank,
        root,
        count,
        in_place,
    )
    .and_then(|(i, o, ip)| {
        // An in-place input of no elements (count 0) is no input at all.
        let ip = match ip.filter(|&(_, n)| n > 0) {
            Some((off, n)) => Some((off.checked_mul(elem)?, n.checked_mul(elem)?)),
            None => None,
        };
        Some(Sizes {
            elem,
            input: i.checked_mul(elem)?,
            output: o.checked_mul(elem)?,
            in_place: ip,
        })
    });
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
    if matches!(opcode, Opcode::Barrier | Opcode::Nop) && (count != 0 || !data.is_empty()) {
        return reject(resp, writable, op_known, bad_req(bad::BARRIER_DATA));
    }
    let input: u64 = data
        .iter()
        .filter(|d| !d.is_write_only())
        .map(|d| u64::from(d.len()))
        .sum();
    let output: u64 = data
        .iter()
        .filter(|d| d.is_write_only())
        .map(|d| u64::from(d.len()))
        .sum();
    if in_place && input != 0 {
        return reject(resp, writable, op_known, bad_req(bad::IN_PLACE_INPUT));
    }
    if data.iter().any(|d| u64::from(d.len()) % elem != 0) {
        return reject(resp, writable, op_known, bad_req(bad::SEGMENT_ALIGN));
    }
    if input != sizes.input {
        return reject(resp, writable, op_known, bad_req(bad::INPUT_LENGTH));
    }
    if output != sizes.output {
        return reject(resp, writable, op_known, bad_req(bad::OUTPUT_LENGTH));
    }
    Expected::Valid {
        header,
        opcode,
        sizes,
    }
}
