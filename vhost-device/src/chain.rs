//! Parsing and checking one descriptor chain into a request.
//!
//! The chain of one request is
//! `[header (R)] [input segments (R)*] [output segments (W)*] [response (W)]`.
//! [`parse`] walks it once, resolves every data segment to host memory
//! (checking that each range lies inside guest memory), reads the header,
//! and applies the checks in the order the spec gives: chain structure,
//! opcode/dtype/op known, op valid for dtype, flags and root, size overflow,
//! size limits, and finally the buffer lengths. A request that fails is
//! returned as a [`Rejected`] that still knows where its response goes, if
//! that could be found.

use std::ptr::NonNull;

use std::sync::Arc;

use virtio_dmlc::comm::{
    self, CommOpcode, VirtioDmlcReqComm, ANY_SOURCE, REQ_COMM_HEADER_SIZE, RESP_COMM_SIZE,
    VIRTIO_DMLC_F_COMM,
};
use virtio_dmlc::{
    bad, buffer_elems, too_big, unsupported, Dtype, Opcode, ReduceOp, Status, VirtioDmlcReq,
    FLAGS_KNOWN, FLAG_CHECK_FINITE, FLAG_IN_PLACE, REQ_HEADER_SIZE, RESP_SIZE,
    VIRTIO_DMLC_F_NONFINITE,
};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::DescriptorChain;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use zerocopy::FromBytes;

use crate::datapath::HostSeg;
use crate::GuestMem;

/// Limits and group facts that the checks need.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub world_size: u32,
    /// This member's rank.
    pub rank: u32,
    pub max_segments: u32,
    pub max_bytes: u64,
    /// Device feature bits the member's driver negotiated. With
    /// `VIRTIO_DMLC_F_COMM` its headers and responses have the sizes of
    /// spec 5.X.6.13.1, and the opcodes of the other bits it negotiated
    /// (and the device offers, [`SERVED_COMM_FEATURES`]) are known.
    pub features: u64,
}

/// The feature bits of spec 5.X.6.13 that this backend serves: bit 1
/// (communicators), bit 2 (send and receive) and bit 3 (all-to-all,
/// gather and scatter).
pub const SERVED_COMM_FEATURES: u64 = 1 << VIRTIO_DMLC_F_COMM
    | 1 << virtio_dmlc::comm::VIRTIO_DMLC_F_P2P
    | 1 << virtio_dmlc::comm::VIRTIO_DMLC_F_BLOCKS;

/// The device-specific feature bits beyond bit 0 that this backend serves
/// on one host: those of [`SERVED_COMM_FEATURES`] and bit 4 (non-finite
/// origin, spec 5.X.6.14, which needs bit 1).
pub const SERVED_FEATURES: u64 = SERVED_COMM_FEATURES | 1 << VIRTIO_DMLC_F_NONFINITE;

/// What a request does: an opcode of 5.X.6.1, or one of feature bits 1
/// to 3 (5.X.6.13.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Code {
    Base(Opcode),
    Comm(CommOpcode),
}

impl Code {
    /// The opcode of 5.X.6.1, if it is one.
    pub fn base(self) -> Option<Opcode> {
        match self {
            Code::Base(o) => Some(o),
            Code::Comm(_) => None,
        }
    }

    /// The wire value.
    pub fn raw(self) -> u16 {
        match self {
            Code::Base(o) => o.raw(),
            Code::Comm(o) => o.raw(),
        }
    }

    /// The opcode's name, as in the spec.
    pub fn name(self) -> &'static str {
        match self {
            Code::Base(o) => o.name(),
            Code::Comm(o) => o.name(),
        }
    }

    /// True if its buffers hold elements of a dtype.
    pub fn moves_data(self) -> bool {
        match self {
            Code::Base(o) => o.moves_data(),
            Code::Comm(o) => !matches!(
                o,
                CommOpcode::CommSplit | CommOpcode::CommCreate | CommOpcode::CommFree
            ),
        }
    }
}

impl From<Opcode> for Code {
    fn from(o: Opcode) -> Self {
        Code::Base(o)
    }
}

impl std::fmt::Display for Code {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A communicator as the checks see it (spec 5.X.6.13.3).
#[derive(Clone, Debug)]
pub struct CommView {
    pub id: u32,
    /// The member's rank in it.
    pub rank: u32,
    pub size: u32,
    /// Its members' ranks in the group, in its rank order; `None` for
    /// communicator 0 (the group itself).
    pub members: Option<Arc<[u32]>>,
}

impl CommView {
    /// Communicator 0 as member `rank` of a group of `size` sees it.
    pub fn world(rank: u32, size: u32) -> Self {
        CommView {
            id: comm::COMM_WORLD,
            rank,
            size,
            members: None,
        }
    }

    /// The group rank of its rank `r`.
    pub fn world_rank(&self, r: u32) -> u32 {
        match &self.members {
            Some(m) => m[r as usize],
            None => r,
        }
    }

    /// Its rank of group rank `w`, if `w` is a member.
    pub fn rank_of(&self, w: u32) -> Option<u32> {
        match &self.members {
            Some(m) => m.iter().position(|&x| x == w).map(|p| p as u32),
            None => (w < self.size).then_some(w),
        }
    }
}

/// The fields of a request with feature bit 1 beyond those of 5.X.6.1.
#[derive(Clone, Debug)]
pub struct CommFields {
    /// The communicator the request names.
    pub view: CommView,
    /// Send: destination; receive: source or `ANY_SOURCE`; comm_split: color.
    pub peer: u32,
    /// comm_split: the key.
    pub key: u32,
    /// The table (5.X.6.13.5), as read from the header descriptor.
    pub table: Vec<u8>,
}

/// Why a chain was rejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    /// No writable response descriptor of the right size ends the chain,
    /// so no status can be reported.
    #[error("chain has no response descriptor")]
    NoResponse,
    /// `STATUS_BAD_REQUEST` with a `bad::*` reason.
    #[error("malformed request: {}", bad::describe(*.0))]
    BadRequest(u32),
    /// `STATUS_UNSUPPORTED` with an `unsupported::*` reason.
    #[error("unsupported request (reason {0})")]
    Unsupported(u32),
    /// `STATUS_TOO_BIG` with a `too_big::*` reason.
    #[error("request too big (reason {0})")]
    TooBig(u32),
}

impl ChainError {
    /// The status and detail to report, or `None` when none can be.
    pub fn status_detail(self) -> Option<(Status, u32)> {
        match self {
            ChainError::NoResponse => None,
            ChainError::BadRequest(d) => Some((Status::BadRequest, d)),
            ChainError::Unsupported(d) => Some((Status::Unsupported, d)),
            ChainError::TooBig(d) => Some((Status::TooBig, d)),
        }
    }
}

/// A chain that failed its checks.
#[derive(Clone, Copy, Debug, thiserror::Error)]
#[error("request {head} rejected")]
pub struct Rejected {
    /// Head descriptor index, for the used ring.
    pub head: u16,
    /// Where the response goes, if the chain has a usable response descriptor.
    pub response: Option<GuestAddress>,
    /// Total length of the chain's device-writable descriptors: the used
    /// length when a response is written.
    pub writable_len: u32,
    /// The opcode, if the header could be read and the opcode is known.
    pub code: Option<Code>,
    /// The response has the 40-byte layout of feature bit 1.
    pub comm_response: bool,
    #[source]
    pub error: ChainError,
}

/// A checked request of one member.
#[derive(Debug)]
pub struct Request {
    /// Head descriptor index, for the used ring.
    pub head: u16,
    /// The header as read from guest memory (once).
    pub header: VirtioDmlcReq,
    pub code: Code,
    /// With feature bit 1: the communicator and the fields that come with it.
    pub comm: Option<CommFields>,
    /// `None` for opcodes that move no data (barrier, comm_split, ...).
    pub dtype: Option<Dtype>,
    /// `None` for opcodes without a reduction.
    pub op: Option<ReduceOp>,
    pub root: u32,
    pub count: u64,
    /// Byte offset of this member's input inside the output buffer, when in place.
    pub in_place_offset: Option<usize>,
    /// Input segments (empty when in place), in chain order. Every segment
    /// is a whole number of elements.
    pub inputs: Vec<HostSeg>,
    /// Output segments, in chain order, whole elements as for `inputs`.
    pub outputs: Vec<HostSeg>,
    /// Elements that a memory-region boundary cuts in two; the segment
    /// lists point to their private copies.
    pub bounces: Vec<Bounce>,
    /// Total length of the chain's device-writable descriptors (outputs
    /// and response): the used length whatever the status.
    pub writable_len: u32,
    /// Where the response goes.
    pub response: GuestAddress,
}

impl Request {
    /// The communicator the request names (communicator 0 without feature
    /// bit 1): its members translate the ranks of the response.
    pub fn comm_id(&self) -> u32 {
        self.comm.as_ref().map_or(comm::COMM_WORLD, |c| c.view.id)
    }

    /// Bytes of one element (0 for barrier).
    pub fn elem_size(&self) -> usize {
        self.dtype.map_or(0, Dtype::size)
    }

    /// `count` elements in bytes (saturating: for alltoallv and the roots
    /// of the v forms `count` is not a buffer size, so parsing did not
    /// bound it by `max_bytes`).
    pub fn count_bytes(&self) -> usize {
        usize::try_from(self.count)
            .unwrap_or(usize::MAX)
            .saturating_mul(self.elem_size())
    }
}

/// Largest element size.
const MAX_ELEM: usize = 8;

/// A private copy of one element whose bytes lie in two (or more) guest
/// memory regions, which are not adjacent in this process. The segment
/// list holds the copy in the element's place; [`Bounce::fill`] loads it
/// from the guest before the collective, [`Bounce::flush`] stores it back
/// after.
#[derive(Debug)]
pub struct Bounce {
    /// Owned heap buffer of `MAX_ELEM` bytes, only touched through raw
    /// pointers (the data path writes it through its `HostSeg`).
    buf: NonNull<[u8; MAX_ELEM]>,
    /// The element's bytes in guest memory, in order.
    pieces: Vec<HostSeg>,
    /// Part of the output segments (to be stored back).
    pub output: bool,
}

// SAFETY: the buffer is owned by the Bounce. The group engine fills it
// before a collective's data movement starts, the data path then uses it
// through its HostSeg like any guest segment, and the engine flushes it
// after the movement has finished; those phases are ordered by the
// engine's synchronisation, so sharing the handle between threads is sound.
unsafe impl Send for Bounce {}
// SAFETY: as above.
unsafe impl Sync for Bounce {}

impl Bounce {
    fn new(output: bool) -> Self {
        Bounce {
            buf: NonNull::from(Box::leak(Box::new([0u8; MAX_ELEM]))),
            pieces: Vec::with_capacity(2),
            output,
        }
    }

    fn filled(&self) -> usize {
        self.pieces.iter().map(|p| p.len).sum()
    }

    /// Where the private copy is.
    pub fn ptr(&self) -> *mut u8 {
        self.buf.as_ptr().cast()
    }

    /// Copies the element from guest memory into the private copy.
    ///
    /// # Safety
    /// The guest memory the element was resolved from must still be mapped,
    /// and nothing else may use the private copy meanwhile.
    pub unsafe fn fill(&self) {
        let mut at = 0;
        for p in &self.pieces {
            // SAFETY: the piece lies in mapped guest memory (caller's
            // promise) and the copy has room for the whole element; guest
            // memory never overlaps our heap.
            unsafe { std::ptr::copy_nonoverlapping(p.ptr, self.ptr().add(at), p.len) };
            at += p.len;
        }
    }

    /// Copies the private copy back into guest memory.
    ///
    /// # Safety
    /// As for [`Bounce::fill`].
    pub unsafe fn flush(&self) {
        let mut at = 0;
        for p in &self.pieces {
            // SAFETY: as in `fill`, in the other direction.
            unsafe { std::ptr::copy_nonoverlapping(self.ptr().add(at), p.ptr, p.len) };
            at += p.len;
        }
    }
}

impl Drop for Bounce {
    fn drop(&mut self) {
        // SAFETY: `buf` came from Box::leak in `new` and is freed only here.
        drop(unsafe { Box::from_raw(self.buf.as_ptr()) });
    }
}

/// A data descriptor, resolved.
struct Data {
    writable: bool,
    len: u32,
    segs: std::ops::Range<usize>,
}

/// Parses and checks the chain of member `limits.rank`, which names only
/// communicator 0 (or whose driver did not negotiate feature bit 1).
pub fn parse(chain: DescriptorChain<&GuestMem>, limits: &Limits) -> Result<Request, Rejected> {
    parse_in(chain, limits, &|_| None)
}

/// Parses and checks the chain of member `limits.rank`; `comms` finds the
/// communicators other than 0 that the member belongs to (`None`: unknown,
/// freed, or not one of its communicators).
pub fn parse_in(
    chain: DescriptorChain<&GuestMem>,
    limits: &Limits,
    comms: &dyn Fn(u32) -> Option<CommView>,
) -> Result<Request, Rejected> {
    let head = chain.head_index();
    let mem: &GuestMem = chain.memory();
    let with_comm = limits.features & (1 << VIRTIO_DMLC_F_COMM) != 0;
    let resp_size = if with_comm { RESP_COMM_SIZE } else { RESP_SIZE };
    let mut descs: Vec<Descriptor> = Vec::new();
    for d in chain.clone() {
        descs.push(d);
    }
    // The iterator stops silently on a broken chain (bad index, loop, bad
    // indirect table, 2^32 bytes or more in total); the last descriptor
    // then still says it has a next. A repeated descriptor stops the walk
    // too (spec 5.X.6.7.1), even where the iterator went on (a direct
    // descriptor and an identical entry of its indirect table).
    let ended_early = descs.last().is_none_or(Descriptor::has_next);
    let broken = cut_loop(&mut descs) || ended_early;
    // The iterator keeps a chain under 4 GiB in total, so this fits.
    let writable_len: u64 = descs
        .iter()
        .filter(|d| d.is_write_only())
        .map(|d| u64::from(d.len()))
        .sum();

    let mut reject = Rejected {
        head,
        response: None,
        writable_len: u32::try_from(writable_len).unwrap_or(u32::MAX),
        code: None,
        comm_response: with_comm,
        error: ChainError::NoResponse,
    };

    // The response: the last descriptor, writable, exactly the response's
    // size, inside guest memory. Without it there is no way to report
    // anything.
    let Some(last) = descs.last() else {
        return Err(reject);
    };
    if !last.is_write_only()
        || last.len() as usize != resp_size
        || !range_in_memory(mem, last.addr(), resp_size as u64)
    {
        return Err(reject);
    }
    reject.response = Some(last.addr());
    let fail = |mut r: Rejected, e: ChainError| {
        r.error = e;
        Err(r)
    };
    if broken {
        // The descriptors seen may repeat (a loop): count only the response.
        reject.writable_len = resp_size as u32;
        return fail(reject, ChainError::BadRequest(bad::CHAIN));
    }

    // The header: the first descriptor, readable, exactly the header's
    // size (with feature bit 1: the fixed part and its table).
    let first = descs[0];
    let fixed = if with_comm {
        REQ_COMM_HEADER_SIZE
    } else {
        REQ_HEADER_SIZE
    };
    // Without bit 1 the header's size is known now; with it, its table's
    // size is read from the header first (checked below).
    let short = if with_comm {
        (first.len() as usize) < fixed
    } else {
        first.len() as usize != fixed
    };
    if descs.len() < 2 || first.is_write_only() || short {
        return fail(reject, ChainError::BadRequest(bad::HEADER));
    }

    // Data descriptors: readable ones first, then writable ones.
    let middle = &descs[1..descs.len() - 1];
    let mut seen_writable = false;
    for d in middle {
        if d.is_write_only() {
            seen_writable = true;
        } else if seen_writable {
            return fail(reject, ChainError::BadRequest(bad::ORDER));
        }
    }

    // The whole header descriptor (with feature bit 1: the table too) is
    // checked here with the other addresses, before any of its fields is
    // used (spec 5.X.6.7.3, step 2).
    let mut buf = [0u8; REQ_COMM_HEADER_SIZE];
    if !range_in_memory(mem, first.addr(), u64::from(first.len()))
        || mem.read_slice(&mut buf[..fixed], first.addr()).is_err()
    {
        return fail(reject, ChainError::BadRequest(bad::ADDRESS));
    }
    let Ok(header) = VirtioDmlcReq::read_from_bytes(&buf[..REQ_HEADER_SIZE]) else {
        return fail(reject, ChainError::BadRequest(bad::HEADER));
    };
    let comm_header = if with_comm {
        let Ok(h) = VirtioDmlcReqComm::read_from_bytes(&buf[..]) else {
            return fail(reject, ChainError::BadRequest(bad::HEADER));
        };
        Some(h)
    } else {
        None
    };
    let table_bytes = comm_header.map_or(0, |h| h.table_bytes.get() as usize);
    if first.len() as usize != fixed.saturating_add(table_bytes) {
        return fail(reject, ChainError::BadRequest(bad::HEADER));
    }

    let mut segs: Vec<HostSeg> = Vec::with_capacity(middle.len());
    let mut data: Vec<Data> = Vec::with_capacity(middle.len());
    for d in middle.iter().filter(|d| d.len() != 0) {
        let start = segs.len();
        if resolve(mem, d.addr(), u64::from(d.len()), &mut segs).is_err() {
            return fail(reject, ChainError::BadRequest(bad::ADDRESS));
        }
        data.push(Data {
            writable: d.is_write_only(),
            len: d.len(),
            segs: start..segs.len(),
        });
    }

    // Opcode known (those of feature bits 2 and 3 only when negotiated and
    // served), dtype and op known; op defined for dtype.
    let raw = header.opcode.get();
    let code = match (Opcode::from_raw(raw), CommOpcode::from_raw(raw)) {
        (Some(o), _) => Code::Base(o),
        (None, Some(o))
            if with_comm && limits.features & SERVED_COMM_FEATURES & (1 << o.feature()) != 0 =>
        {
            Code::Comm(o)
        }
        _ => return fail(reject, ChainError::Unsupported(unsupported::OPCODE)),
    };
    reject.code = Some(code);
    let uses_dtype = code.moves_data();
    let uses_op = matches!(
        code,
        Code::Base(Opcode::Allreduce | Opcode::Reduce | Opcode::ReduceScatter)
    );
    let dtype = if uses_dtype {
        match Dtype::from_raw(header.dtype) {
            Some(d) => Some(d),
            None => return fail(reject, ChainError::Unsupported(unsupported::DTYPE)),
        }
    } else {
        None
    };
    let op = if uses_op {
        match ReduceOp::from_raw(header.op) {
            Some(o) => Some(o),
            None => return fail(reject, ChainError::Unsupported(unsupported::OP)),
        }
    } else {
        None
    };
    if let (Some(d), Some(o)) = (dtype, op) {
        if !o.supports(d) {
            return fail(reject, ChainError::Unsupported(unsupported::OP_FOR_DTYPE));
        }
    }

    // The communicator: it sizes everything below.
    let comm = match comm_header {
        Some(h) => {
            let id = h.comm.get();
            let view = if id == comm::COMM_WORLD {
                Some(CommView::world(limits.rank, limits.world_size))
            } else {
                comms(id)
            };
            let Some(view) = view else {
                return fail(reject, ChainError::BadRequest(comm::BAD_COMM));
            };
            if id == comm::COMM_WORLD && code == Code::Comm(CommOpcode::CommFree) {
                return fail(reject, ChainError::BadRequest(comm::BAD_COMM));
            }
            // No opcode needs more (alltoallv: 16 bytes a rank): a larger
            // table is refused before anything is allocated for it.
            if table_bytes as u64 > 16 * u64::from(limits.world_size) {
                return fail(reject, ChainError::BadRequest(comm::BAD_TABLE));
            }
            let mut table = vec![0u8; table_bytes];
            let table_at = first.addr().checked_add(fixed as u64);
            if table_at.is_none_or(|at| mem.read_slice(&mut table, at).is_err()) {
                return fail(reject, ChainError::BadRequest(bad::ADDRESS));
            }
            Some(CommFields {
                view,
                peer: h.peer.get(),
                key: h.key.get(),
                table,
            })
        }
        None => None,
    };
    let (size, me) = comm.as_ref().map_or((limits.world_size, limits.rank), |c| {
        (c.view.size, c.view.rank)
    });

    // Flags, root and peer.
    let flags = header.flags.get();
    let known = if limits.features & (1 << VIRTIO_DMLC_F_NONFINITE) != 0 {
        FLAGS_KNOWN | FLAG_CHECK_FINITE
    } else {
        FLAGS_KNOWN
    };
    if flags & !known != 0 {
        return fail(reject, ChainError::BadRequest(bad::FLAGS));
    }
    let in_place = flags & FLAG_IN_PLACE != 0;
    let root = header.root.get();
    let has_root = matches!(
        code,
        Code::Base(Opcode::Broadcast | Opcode::Reduce)
            | Code::Comm(
                CommOpcode::Gather
                    | CommOpcode::Gatherv
                    | CommOpcode::Scatter
                    | CommOpcode::Scatterv
            )
    );
    if (has_root && root >= size) || (!has_root && root != 0) {
        return fail(reject, ChainError::BadRequest(bad::ROOT));
    }
    if let (Code::Comm(o @ (CommOpcode::Send | CommOpcode::Recv)), Some(c)) = (code, &comm) {
        let any = o == CommOpcode::Recv && c.peer == ANY_SOURCE;
        if !any && (c.peer == me || c.peer >= size) {
            return fail(reject, ChainError::BadRequest(comm::BAD_PEER));
        }
    }
    let count = header.count.get();

    // Sizes the header asks for, in bytes, without overflow (a table of
    // the wrong size first: it gives the sizes of the v forms).
    if let (Code::Base(_), Some(c)) = (code, &comm) {
        if !c.table.is_empty() {
            return fail(reject, ChainError::BadRequest(comm::BAD_TABLE));
        }
    }
    let esize = dtype.map_or(1, Dtype::size) as u64;
    let elems = match (code, &comm) {
        (Code::Base(o), _) => buffer_elems(o, size, me, root, count, in_place)
            .ok_or(ChainError::BadRequest(bad::OVERFLOW)),
        (Code::Comm(CommOpcode::CommCreate), Some(c)) => {
            let list = create_list(&c.table);
            match list.and_then(|l| comm::check_create_list(&l, size, me).ok()) {
                None => Err(ChainError::BadRequest(comm::BAD_TABLE)),
                // The size arithmetic of every opcode of bits 1 to 3 (as
                // `block_elems` does for comm_split and comm_free).
                Some(_) if count.checked_mul(u64::from(size)).is_none() => {
                    Err(ChainError::BadRequest(bad::OVERFLOW))
                }
                Some(_) => Ok(virtio_dmlc::BufferElems {
                    input: 0,
                    output: 0,
                    in_place_input: None,
                }),
            }
        }
        (Code::Comm(o), Some(c)) => {
            if c.table.len().is_multiple_of(8) {
                let table: Vec<u64> = comm::counts(&c.table).collect();
                comm::block_elems(o, size, me, root, count, &table, in_place)
                    .map_err(ChainError::BadRequest)
            } else {
                // Not a whole number of counts: no opcode's table.
                Err(ChainError::BadRequest(comm::BAD_TABLE))
            }
        }
        (Code::Comm(_), None) => unreachable!("opcodes of bits 1 to 3 need bit 1"),
    };
    let elems = match elems {
        Ok(e) => e,
        Err(e) => return fail(reject, e),
    };
    let bytes = |n: u64| n.checked_mul(esize);
    let (Some(want_in), Some(want_out)) = (bytes(elems.input), bytes(elems.output)) else {
        return fail(reject, ChainError::BadRequest(bad::OVERFLOW));
    };
    let in_place_input = match elems.in_place_input {
        Some((off, n)) => match (bytes(off), bytes(n)) {
            (Some(o), Some(_)) => Some(o),
            _ => return fail(reject, ChainError::BadRequest(bad::OVERFLOW)),
        },
        None => None,
    };

    // Limits: sizes from the header, then the number of data segments.
    if want_in.max(want_out) > limits.max_bytes {
        return fail(reject, ChainError::TooBig(too_big::BYTES));
    }
    if data.len() as u64 > u64::from(limits.max_segments) {
        return fail(reject, ChainError::TooBig(too_big::SEGMENTS));
    }

    // Lengths.
    if !code.moves_data() && (count != 0 || !data.is_empty()) {
        return fail(reject, ChainError::BadRequest(bad::BARRIER_DATA));
    }
    let have_in: u64 = data
        .iter()
        .filter(|d| !d.writable)
        .map(|d| u64::from(d.len))
        .sum();
    let have_out: u64 = data
        .iter()
        .filter(|d| d.writable)
        .map(|d| u64::from(d.len))
        .sum();
    // Where the flag has no effect (a gather's or scatter's non-root,
    // 5.X.6.13.2), the member's input is where it would be without it.
    let in_place_applies = match code {
        Code::Base(_) => in_place,
        Code::Comm(_) => elems.in_place_input.is_some(),
    };
    if in_place_applies && have_in != 0 {
        return fail(reject, ChainError::BadRequest(bad::IN_PLACE_INPUT));
    }
    if data.iter().any(|d| !u64::from(d.len).is_multiple_of(esize)) {
        return fail(reject, ChainError::BadRequest(bad::SEGMENT_ALIGN));
    }
    if have_in != want_in {
        return fail(reject, ChainError::BadRequest(bad::INPUT_LENGTH));
    }
    if have_out != want_out {
        return fail(reject, ChainError::BadRequest(bad::OUTPUT_LENGTH));
    }

    let mut inputs = Vec::new();
    let mut outputs = Vec::new();
    let mut bounces = Vec::new();
    for d in &data {
        let dst = if d.writable {
            &mut outputs
        } else {
            &mut inputs
        };
        whole_elements(
            &segs[d.segs.clone()],
            esize as usize,
            d.writable,
            dst,
            &mut bounces,
        );
    }
    Ok(Request {
        head,
        header,
        code,
        comm,
        dtype,
        op,
        root,
        count,
        // Below max_bytes, which the config keeps within usize.
        in_place_offset: in_place_input.map(|o| o as usize),
        inputs,
        outputs,
        bounces,
        writable_len: reject.writable_len,
        response: last.addr(),
    })
}

/// A comm_create table read as its `le32` ranks, or `None` when its length
/// is not a multiple of 4.
pub fn create_list(table: &[u8]) -> Option<Vec<u32>> {
    table.len().is_multiple_of(4).then(|| {
        table
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    })
}

/// Ends the walk of a looped chain at the descriptor that closes the loop.
///
/// The iterator walks a loop until it has read as many descriptors as the
/// table holds, so the descriptor it stops on depends on the loop's length
/// against the table size. Whatever that size, the walk is cut instead
/// just before the first descriptor that is identical (all 16 bytes) to
/// one walked before: the descriptor before it is the last one reached.
/// Within one table that is exactly a loop: a descriptor determines every
/// descriptor after it, so a repeat means the walk would go round forever
/// (and a chain that does not loop never repeats one). Returns whether it
/// cut.
fn cut_loop(descs: &mut Vec<Descriptor>) -> bool {
    let key = |d: &Descriptor| (d.addr().raw_value(), d.len(), d.flags(), d.next());
    // Every chain goes through here: short ones (the usual 4 to 8
    // descriptors) are scanned without allocating.
    let repeat = if descs.len() <= 32 {
        (1..descs.len()).find(|&i| descs[..i].iter().any(|d| key(d) == key(&descs[i])))
    } else {
        let mut seen = std::collections::HashSet::with_capacity(descs.len());
        descs.iter().position(|d| !seen.insert(key(d)))
    };
    match repeat {
        Some(at) => {
            descs.truncate(at);
            true
        }
        None => false,
    }
}

/// Appends the host segments of one descriptor (a whole number of
/// elements) to `dst` so that every segment holds whole elements: an
/// element cut by a memory-region boundary is replaced by a [`Bounce`].
fn whole_elements(
    segs: &[HostSeg],
    esize: usize,
    output: bool,
    dst: &mut Vec<HostSeg>,
    bounces: &mut Vec<Bounce>,
) {
    let mut open: Option<Bounce> = None;
    for s in segs {
        let (mut ptr, mut len) = (s.ptr, s.len);
        if let Some(b) = open.as_mut() {
            let take = (esize - b.filled()).min(len);
            b.pieces.push(HostSeg { ptr, len: take });
            ptr = ptr.wrapping_add(take);
            len -= take;
            if let Some(b) = open.take_if(|b| b.filled() == esize) {
                dst.push(HostSeg {
                    ptr: b.ptr(),
                    len: esize,
                });
                bounces.push(b);
            }
        }
        let whole = len - len % esize;
        if whole > 0 {
            dst.push(HostSeg { ptr, len: whole });
        }
        if whole < len {
            let mut b = Bounce::new(output);
            b.pieces.push(HostSeg {
                ptr: ptr.wrapping_add(whole),
                len: len - whole,
            });
            open = Some(b);
        }
    }
}

/// Whether `[addr, addr + len)` lies inside guest memory.
pub fn range_in_memory(mem: &GuestMem, addr: GuestAddress, len: u64) -> bool {
    let mut scratch = Vec::new();
    resolve(mem, addr, len, &mut scratch).is_ok()
}

/// The address range is not inside guest memory, or it overflows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("address range {addr:#x}+{len:#x} is not inside guest memory")]
pub struct OutOfMemory {
    pub addr: u64,
    pub len: u64,
}

/// Appends the host segments that back `[addr, addr + len)`, one per guest
/// memory region the range touches.
pub fn resolve(
    mem: &GuestMem,
    addr: GuestAddress,
    len: u64,
    out: &mut Vec<HostSeg>,
) -> Result<(), OutOfMemory> {
    let err = OutOfMemory {
        addr: addr.raw_value(),
        len,
    };
    if addr.raw_value().checked_add(len).is_none() {
        return Err(err);
    }
    let mut cur = addr;
    let mut left = len;
    while left > 0 {
        let (region, offset) = mem.to_region_addr(cur).ok_or(err)?;
        let avail = region.len() - offset.raw_value();
        let take = avail.min(left);
        let ptr = region.get_host_address(offset).map_err(|_| err)?;
        let take_usize = usize::try_from(take).map_err(|_| err)?;
        out.push(HostSeg {
            ptr,
            len: take_usize,
        });
        left -= take;
        // Cannot overflow: addr + len was checked above.
        cur = GuestAddress(cur.raw_value() + take);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use virtio_bindings::bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use virtio_dmlc::{
        bad, too_big, unsupported, Dtype, Opcode, ReduceOp, Status, VirtioDmlcReq, VirtioDmlcResp,
        FLAG_IN_PLACE, NO_PEER, RESP_SIZE,
    };

    use super::{parse, Limits};
    use crate::group::harness::{config, hdr, Desc, World};

    const F32: u8 = Dtype::F32 as u8;
    const SUM: u8 = ReduceOp::Sum as u8;

    fn allreduce(count: u64) -> VirtioDmlcReq {
        hdr(Opcode::Allreduce.raw(), F32, SUM, 0, count, 0, 0, 0)
    }

    /// A two-member world with small limits.
    fn world() -> World {
        let mut cfg = config(2);
        cfg.max_segments = 8;
        cfg.max_bytes = 4096;
        World::new(cfg)
    }

    /// [header] [input of `inb` bytes] [output of `outb` bytes] [response]
    /// for member 0, with the given header.
    fn chain(w: &mut World, h: &VirtioDmlcReq, inb: usize, outb: usize) -> Vec<Desc> {
        let m = &mut w.members[0];
        let mut d = vec![m.header(h)];
        if inb > 0 {
            d.push(Desc::r(m.alloc(inb), inb as u32));
        }
        if outb > 0 {
            d.push(Desc::w(m.alloc(outb), outb as u32));
        }
        d.push(m.response());
        d
    }

    /// Submits on member 0 and expects an immediate rejection, with the
    /// used length covering every writable descriptor.
    fn rejected(w: &mut World, descs: &[Desc]) -> (Status, u32) {
        let writable: u32 = descs.iter().filter(|d| d.write).map(|d| d.len).sum();
        let p = w.submit(0, 0, descs);
        let (written, r) = w
            .wait_for(&p, std::time::Duration::ZERO)
            .map(|d| {
                let b = w.members[0].read(p.resp, RESP_SIZE);
                (
                    d.written,
                    <VirtioDmlcResp as zerocopy::FromBytes>::read_from_bytes(&b).unwrap(),
                )
            })
            .expect("rejected requests complete at once");
        assert_eq!(written, writable);
        assert_eq!(r.peer.get(), NO_PEER);
        assert_eq!(r.generation.get(), 1);
        (Status::from_raw(r.status.get()).unwrap(), r.detail.get())
    }

    fn bad(detail: u32) -> (Status, u32) {
        (Status::BadRequest, detail)
    }

    /// Submits on member 0 and expects a completion with written length 0
    /// and, if asked, the response buffer (filled with 0xee) untouched.
    fn no_status(w: &mut World, descs: &[Desc], check_untouched: bool) {
        let p = w.submit(0, 0, descs);
        let d = w
            .wait_for(&p, std::time::Duration::ZERO)
            .expect("completes at once");
        assert_eq!(d.written, 0);
        if check_untouched {
            assert!(w.members[0].read(p.resp, 8).iter().all(|&b| b == 0xee));
        }
    }

    #[test]
    fn well_formed_chain_parses() {
        let mut w = world();
        let d = chain(&mut w, &allreduce(4), 16, 16);
        let m = &mut w.members[0];
        let head = 0;
        m.place_at(0, 0, &d);
        let chain = m.pop(0, head);
        let limits = Limits {
            world_size: 2,
            rank: 0,
            max_segments: 8,
            max_bytes: 4096,
            features: 0,
        };
        let req = parse(chain, &limits).unwrap();
        assert_eq!(req.head, 0);
        assert_eq!(req.code, super::Code::Base(Opcode::Allreduce));
        assert_eq!(req.dtype, Some(Dtype::F32));
        assert_eq!(req.op, Some(ReduceOp::Sum));
        assert_eq!((req.inputs.len(), req.outputs.len()), (1, 1));
        assert_eq!((req.inputs[0].len, req.outputs[0].len), (16, 16));
        assert_eq!(req.writable_len as usize, 16 + RESP_SIZE);
        assert_eq!(req.count_bytes(), 16);
        assert_eq!(req.response.0, d[3].addr);
        assert_eq!(req.in_place_offset, None);
    }

    #[test]
    fn segment_across_regions_is_split_in_two() {
        let mut w = world();
        let h = allreduce(4);
        let m = &mut w.members[0];
        let mut d = vec![m.header(&h)];
        let inp = m.alloc_across_regions(8, 16);
        d.push(Desc::r(inp, 16));
        d.push(Desc::w(m.alloc(16), 16));
        d.push(m.response());
        m.place_at(0, 10, &d);
        let limits = Limits {
            world_size: 2,
            rank: 0,
            max_segments: 8,
            max_bytes: 4096,
            features: 0,
        };
        let req = parse(m.pop(0, 10), &limits).unwrap();
        assert_eq!(req.head, 10);
        assert_eq!(req.inputs.len(), 2);
        assert_eq!((req.inputs[0].len, req.inputs[1].len), (8, 8));
        // Two mappings: the halves are not adjacent in host memory.
        assert_ne!(req.inputs[0].ptr.wrapping_add(8), req.inputs[1].ptr);
    }

    #[test]
    fn element_cut_by_region_boundary_gets_a_private_copy() {
        let mut w = world();
        let h = hdr(0, Dtype::F64.raw(), SUM, 0, 4, 0, 0, 0);
        let m = &mut w.members[0];
        let mut d = vec![m.header(&h)];
        d.push(Desc::r(m.alloc_across_regions(13, 32), 32));
        d.push(Desc::w(m.alloc(32), 32));
        d.push(m.response());
        m.place_at(0, 50, &d);
        let limits = Limits {
            world_size: 2,
            rank: 0,
            max_segments: 8,
            max_bytes: 4096,
            features: 0,
        };
        let req = parse(m.pop(0, 50), &limits).unwrap();
        // 13 bytes before the boundary: one whole element, a cut one, two
        // whole ones after.
        let lens: Vec<usize> = req.inputs.iter().map(|s| s.len).collect();
        assert_eq!(lens, [8, 8, 16]);
        assert_eq!(req.bounces.len(), 1);
        assert!(!req.bounces[0].output);
        assert_eq!(req.inputs[1].ptr, req.bounces[0].ptr());
        assert_eq!(req.outputs.len(), 1);
    }

    #[test]
    fn missing_response_gives_written_zero() {
        let mut w = world();
        // Ends with a readable descriptor.
        let mut d = chain(&mut w, &allreduce(4), 16, 16);
        d.pop();
        d.pop();
        no_status(&mut w, &d, false);
        // Response too small, too big.
        for len in [8, 32] {
            let mut d = chain(&mut w, &allreduce(4), 16, 16);
            d.last_mut().unwrap().len = len;
            no_status(&mut w, &d, true);
        }
        // Response readable.
        let mut d = chain(&mut w, &allreduce(4), 16, 16);
        d.last_mut().unwrap().write = false;
        no_status(&mut w, &d, true);
        // Response outside guest memory, or only partly inside.
        let end = 2 * w.members[0].region_size;
        for addr in [end + 64, end - 8, u64::MAX - 7] {
            let mut d = chain(&mut w, &allreduce(4), 16, 16);
            d.last_mut().unwrap().addr = addr;
            no_status(&mut w, &d, false);
        }
        assert_eq!(w.group.metrics().no_status_count(), 7);
    }

    #[test]
    fn bad_header_descriptor() {
        let mut w = world();
        let mut d = chain(&mut w, &allreduce(4), 16, 16);
        d[0].write = true;
        // A writable header also puts writable before readable; HEADER wins.
        assert_eq!(rejected(&mut w, &d), bad(bad::HEADER));
        for len in [16, 33] {
            let mut d = chain(&mut w, &allreduce(4), 16, 16);
            d[0].len = len;
            assert_eq!(rejected(&mut w, &d), bad(bad::HEADER));
        }
        let r = w.members[0].response();
        assert_eq!(rejected(&mut w, &[r]), bad(bad::HEADER));
    }

    #[test]
    fn readable_after_writable() {
        let mut w = world();
        let d = chain(&mut w, &allreduce(4), 16, 16);
        let swapped = vec![d[0], d[2], d[1], d[3]];
        assert_eq!(rejected(&mut w, &swapped), bad(bad::ORDER));
    }

    #[test]
    fn addresses_outside_guest_memory() {
        let mut w = world();
        let end = 2 * w.members[0].region_size;
        for (i, addr, len) in [
            (1, end + 0x1000, 16),
            (2, end - 8, 16),
            (1, u64::MAX - 7, 16),
            (0, end + 64, 32),
            (0, u64::MAX - 15, 32),
        ] {
            let mut d = chain(&mut w, &allreduce(4), 16, 16);
            d[i].addr = addr;
            d[i].len = len;
            assert_eq!(rejected(&mut w, &d), bad(bad::ADDRESS), "{addr:#x}");
        }
    }

    #[test]
    fn unsupported_opcode_dtype_op() {
        let mut w = world();
        let cases = [
            (hdr(7, F32, SUM, 0, 4, 0, 0, 0), unsupported::OPCODE),
            (hdr(0, 10, SUM, 0, 4, 0, 0, 0), unsupported::DTYPE),
            (hdr(0, F32, 8, 0, 4, 0, 0, 0), unsupported::OP),
            (
                hdr(0, F32, ReduceOp::Bxor.raw(), 0, 4, 0, 0, 0),
                unsupported::OP_FOR_DTYPE,
            ),
            (
                hdr(4, Dtype::Bf16.raw(), ReduceOp::Band.raw(), 0, 4, 0, 0, 0),
                unsupported::OP_FOR_DTYPE,
            ),
        ];
        for (h, detail) in cases {
            let d = chain(&mut w, &h, 16, 16);
            assert_eq!(rejected(&mut w, &d), (Status::Unsupported, detail));
        }
        // Barrier ignores dtype and op entirely.
        let d = chain(&mut w, &hdr(5, 200, 200, 0, 0, 0, 0, 0), 0, 0);
        let p = w.submit(0, 0, &d);
        assert!(w.is_pending(&p));
    }

    #[test]
    fn flags_and_root() {
        let mut w = world();
        let cases = [
            (hdr(0, F32, SUM, 0, 4, 0, 1 << 5, 0), bad::FLAGS),
            (hdr(0, F32, SUM, 1, 4, 0, 0, 0), bad::ROOT),
            (hdr(1, F32, SUM, 2, 4, 0, 0, 0), bad::ROOT),
            (hdr(2, F32, SUM, 7, 4, 0, 0, 0), bad::ROOT),
            (hdr(5, 0, 0, 0, 1, 0, 0, 0), bad::BARRIER_DATA),
        ];
        for (h, detail) in cases {
            let d = chain(&mut w, &h, 16, 16);
            assert_eq!(rejected(&mut w, &d), bad(detail), "{h:?}");
        }
    }

    #[test]
    fn count_overflow() {
        let mut w = world();
        let f64_ = Dtype::F64.raw();
        for h in [
            hdr(0, f64_, SUM, 0, 1 << 61, 0, 0, 0),
            hdr(3, f64_, SUM, 0, u64::MAX / 2 + 1, 0, 0, 0),
            hdr(4, Dtype::U8.raw(), SUM, 0, u64::MAX, 0, 0, 0),
        ] {
            let d = chain(&mut w, &h, 16, 16);
            assert_eq!(rejected(&mut w, &d), bad(bad::OVERFLOW), "{h:?}");
        }
    }

    #[test]
    fn too_big() {
        let mut w = world();
        // The header asks for more than max_bytes.
        let d = chain(&mut w, &allreduce(1025), 16, 16);
        assert_eq!(rejected(&mut w, &d), (Status::TooBig, too_big::BYTES));
        // Allgather output is world_size times count.
        let d = chain(&mut w, &hdr(3, F32, SUM, 0, 513, 0, 0, 0), 16, 16);
        assert_eq!(rejected(&mut w, &d), (Status::TooBig, too_big::BYTES));
        // Only the sizes from the header count: a chain that supplies more
        // than max_bytes has the wrong length.
        let d = chain(&mut w, &allreduce(4), 4100, 16);
        assert_eq!(rejected(&mut w, &d), bad(bad::INPUT_LENGTH));
        // Nine data segments, eight allowed; zero-length ones do not count.
        let m = &mut w.members[0];
        let mut d = vec![m.header(&allreduce(5))];
        for _ in 0..5 {
            d.push(Desc::r(m.alloc(4), 4));
        }
        d.push(Desc::r(m.alloc(4), 0));
        for _ in 0..4 {
            d.push(Desc::w(m.alloc(4), 4));
        }
        d.push(Desc::w(m.alloc(4), 0));
        d.push(m.response());
        assert_eq!(rejected(&mut w, &d), (Status::TooBig, too_big::SEGMENTS));
        // One less fits but the output is short.
        d.remove(1);
        assert_eq!(rejected(&mut w, &d), bad(bad::INPUT_LENGTH));
    }

    #[test]
    fn lengths() {
        let mut w = world();
        let d = chain(&mut w, &allreduce(4), 12, 16);
        assert_eq!(rejected(&mut w, &d), bad(bad::INPUT_LENGTH));
        let d = chain(&mut w, &allreduce(4), 16, 20);
        assert_eq!(rejected(&mut w, &d), bad(bad::OUTPUT_LENGTH));
        let d = chain(&mut w, &allreduce(4), 0, 16);
        assert_eq!(rejected(&mut w, &d), bad(bad::INPUT_LENGTH));
        // Non-root reduce has no output.
        let d = chain(&mut w, &hdr(2, F32, SUM, 1, 4, 0, 0, 0), 16, 16);
        assert_eq!(rejected(&mut w, &d), bad(bad::OUTPUT_LENGTH));
        // Segments of 6 and 10 bytes add up to 16 but split elements.
        let m = &mut w.members[0];
        let d = vec![
            m.header(&allreduce(4)),
            Desc::r(m.alloc(6), 6),
            Desc::r(m.alloc(10), 10),
            Desc::w(m.alloc(16), 16),
            m.response(),
        ];
        assert_eq!(rejected(&mut w, &d), bad(bad::SEGMENT_ALIGN));
        // Barrier with data segments.
        let d = chain(&mut w, &hdr(5, 0, 0, 0, 0, 0, 0, 0), 0, 8);
        assert_eq!(rejected(&mut w, &d), bad(bad::BARRIER_DATA));
        // In place with input segments.
        let d = chain(&mut w, &hdr(0, F32, SUM, 0, 4, 0, FLAG_IN_PLACE, 0), 16, 16);
        assert_eq!(rejected(&mut w, &d), bad(bad::IN_PLACE_INPUT));
        // In place, and the output is where the input goes.
        let d = chain(&mut w, &hdr(0, F32, SUM, 0, 4, 0, FLAG_IN_PLACE, 0), 0, 12);
        assert_eq!(rejected(&mut w, &d), bad(bad::OUTPUT_LENGTH));
    }

    #[test]
    fn checks_come_in_spec_order() {
        let mut w = world();
        // Structure before unsupported.
        let d = chain(&mut w, &hdr(9, F32, SUM, 0, 4, 0, 0, 0), 16, 16);
        let swapped = vec![d[0], d[2], d[1], d[3]];
        assert_eq!(rejected(&mut w, &swapped), bad(bad::ORDER));
        let mut d = chain(&mut w, &hdr(9, F32, SUM, 0, 4, 0, 0, 0), 16, 16);
        d[1].addr = u64::MAX - 3;
        assert_eq!(rejected(&mut w, &d), bad(bad::ADDRESS));
        // Opcode before dtype before op.
        let d = chain(&mut w, &hdr(9, 99, 99, 0, 4, 0, 0, 0), 16, 16);
        assert_eq!(
            rejected(&mut w, &d),
            (Status::Unsupported, unsupported::OPCODE)
        );
        let d = chain(&mut w, &hdr(0, 99, 99, 0, 4, 0, 0, 0), 16, 16);
        assert_eq!(
            rejected(&mut w, &d),
            (Status::Unsupported, unsupported::DTYPE)
        );
        // Unsupported before flags and root.
        let d = chain(&mut w, &hdr(0, F32, 99, 5, 4, 0, 1 << 7, 0), 16, 16);
        assert_eq!(rejected(&mut w, &d), (Status::Unsupported, unsupported::OP));
        let d = chain(&mut w, &hdr(0, F32, 7, 5, 4, 0, 1 << 7, 0), 16, 16);
        assert_eq!(
            rejected(&mut w, &d),
            (Status::Unsupported, unsupported::OP_FOR_DTYPE)
        );
        // Flags before root, root before overflow.
        let d = chain(&mut w, &hdr(0, F32, SUM, 5, u64::MAX, 0, 1 << 7, 0), 16, 16);
        assert_eq!(rejected(&mut w, &d), bad(bad::FLAGS));
        let d = chain(&mut w, &hdr(0, F32, SUM, 5, u64::MAX, 0, 0, 0), 16, 16);
        assert_eq!(rejected(&mut w, &d), bad(bad::ROOT));
        // Flags before barrier data; in place before segment alignment.
        let d = chain(&mut w, &hdr(5, 0, 0, 0, 3, 0, 1 << 4, 0), 16, 0);
        assert_eq!(rejected(&mut w, &d), bad(bad::FLAGS));
        let d = chain(&mut w, &hdr(0, F32, SUM, 0, 4, 0, FLAG_IN_PLACE, 0), 3, 16);
        assert_eq!(rejected(&mut w, &d), bad(bad::IN_PLACE_INPUT));
        // Overflow before too big, too big before lengths.
        let d = chain(&mut w, &hdr(0, F32, SUM, 0, u64::MAX, 0, 0, 0), 3, 16);
        assert_eq!(rejected(&mut w, &d), bad(bad::OVERFLOW));
        let d = chain(&mut w, &allreduce(2000), 3, 16);
        assert_eq!(rejected(&mut w, &d), (Status::TooBig, too_big::BYTES));
    }

    #[test]
    fn broken_chains() {
        let mut w = world();
        let d = chain(&mut w, &hdr(5, 0, 0, 0, 0, 0, 0, 0), 0, 0);
        let m = &mut w.members[0];
        let (h, r) = (d[0], d[1]);
        let next = VRING_DESC_F_NEXT as u16;
        let wr = VRING_DESC_F_WRITE as u16;
        // A loop: header -> response -> header -> ...
        m.raw_desc(0, 20, h.addr, h.len, next, 21);
        m.raw_desc(0, 21, r.addr, r.len, wr | next, 20);
        let p = w.submit_head(0, 0, 20, r.addr);
        let (written, resp) = w.wait(&p);
        assert_eq!(written as usize, RESP_SIZE);
        assert_eq!(resp.status.get(), Status::BadRequest.raw());
        assert_eq!(resp.detail.get(), bad::CHAIN);
        // A next index beyond the queue.
        let m = &mut w.members[0];
        m.raw_desc(0, 30, h.addr, h.len, next, 31);
        m.raw_desc(0, 31, r.addr, r.len, wr | next, 999);
        let p = w.submit_head(0, 0, 30, r.addr);
        assert_eq!(w.wait(&p).1.detail.get(), bad::CHAIN);
        // A broken indirect table: nothing to report into.
        let m = &mut w.members[0];
        m.raw_desc(
            0,
            40,
            0x8_0000,
            24,
            virtio_bindings::bindings::virtio_ring::VRING_DESC_F_INDIRECT as u16,
            0,
        );
        let p = w.submit_head(0, 0, 40, 0);
        assert_eq!(
            w.wait_for(&p, std::time::Duration::ZERO).unwrap().written,
            0
        );
    }

    /// Writes `n` raw descriptors `(addr, len, flags, next)` at `at`.
    fn write_table(w: &World, at: u64, entries: &[(u64, u32, u16, u16)]) {
        let mut bytes = Vec::new();
        for &(addr, len, flags, next) in entries {
            bytes.extend(addr.to_le_bytes());
            bytes.extend(len.to_le_bytes());
            bytes.extend(flags.to_le_bytes());
            bytes.extend(next.to_le_bytes());
        }
        w.members[0].write(at, &bytes);
    }

    /// A looped chain gets the same answer whatever the loop's length
    /// against the queue size (256 here: loops of 2 and 4 divide it, 3, 5
    /// and 6 do not): the walk stops at the descriptor that closes the
    /// loop, so a response there gets CHAIN, anything else no status.
    #[test]
    fn loops_of_every_length_end_at_the_closing_descriptor() {
        let mut w = world();
        let next = VRING_DESC_F_NEXT as u16;
        let wr = VRING_DESC_F_WRITE as u16;
        let mut base = 0u16;
        for len in 2u16..=6 {
            for back_to in 0..len - 1 {
                // [header] [outputs of 8 bytes]* [response -> back_to]
                let m = &mut w.members[0];
                let h = m.header(&hdr(5, 0, 0, 0, 0, 0, 0, 0));
                let resp = m.response();
                for i in 0..len {
                    let (addr, l, flags) = match i {
                        0 => (h.addr, h.len, next),
                        i if i == len - 1 => (resp.addr, resp.len, wr | next),
                        _ => (m.alloc(8), 8, wr | next),
                    };
                    let nx = if i == len - 1 { back_to } else { i + 1 };
                    m.raw_desc(0, base + i, addr, l, flags, base + nx);
                }
                let p = w.submit_head(0, 0, base, resp.addr);
                let (written, r) = w.wait(&p);
                assert_eq!(
                    written as usize, RESP_SIZE,
                    "loop of {len} back to {back_to}"
                );
                assert_eq!(
                    (r.status.get(), r.detail.get()),
                    (Status::BadRequest.raw(), bad::CHAIN),
                    "loop of {len} back to {back_to}"
                );
                base += len;
            }
            // The same loop closed by an 8-byte output: no status, and the
            // response-sized descriptor inside the loop is not written.
            let m = &mut w.members[0];
            let h = m.header(&hdr(5, 0, 0, 0, 0, 0, 0, 0));
            let resp = m.response();
            for i in 0..len {
                let (addr, l, flags) = match i {
                    0 => (h.addr, h.len, next),
                    1 => (resp.addr, resp.len, wr | next),
                    _ => (m.alloc(8), 8, wr | next),
                };
                let nx = if i == len - 1 { 0 } else { i + 1 };
                m.raw_desc(0, base + i, addr, l, flags, base + nx);
            }
            if len > 2 {
                no_status_at(&mut w, base, resp.addr);
            }
            base += len;
        }
    }

    /// Submits the chain at `head` of member 0 and expects used length 0
    /// and the 16 bytes at `resp` (filled with 0xee) untouched.
    fn no_status_at(w: &mut World, head: u16, resp: u64) {
        let p = w.submit_head(0, 0, head, resp);
        let d = w
            .wait_for(&p, std::time::Duration::ZERO)
            .expect("completes at once");
        assert_eq!(d.written, 0);
        assert!(w.members[0]
            .read(resp, RESP_SIZE)
            .iter()
            .all(|&b| b == 0xee));
    }

    /// Inside an indirect table the walk reads at most the table's entries
    /// (its length / 16); a loop there ends at its closing descriptor too,
    /// whatever the loop's length against the table's.
    #[test]
    fn a_loop_inside_an_indirect_table_ends_at_the_closing_descriptor() {
        let mut w = world();
        let next = VRING_DESC_F_NEXT as u16;
        let wr = VRING_DESC_F_WRITE as u16;
        let indirect = virtio_bindings::bindings::virtio_ring::VRING_DESC_F_INDIRECT as u16;
        for (head, entries) in [(50u16, 8u32), (51, 9), (52, 3), (53, 4)] {
            let m = &mut w.members[0];
            let h = m.header(&hdr(5, 0, 0, 0, 0, 0, 0, 0));
            let resp = m.response();
            let out = m.alloc(8);
            let table = m.alloc(16 * entries as usize);
            // [header] [output] [response -> 0], then unused entries.
            write_table(
                &w,
                table,
                &[
                    (h.addr, h.len, next, 1),
                    (out, 8, wr | next, 2),
                    (resp.addr, resp.len, wr | next, 0),
                ],
            );
            w.members[0].raw_desc(0, head, table, 16 * entries, indirect, 0);
            let p = w.submit_head(0, 0, head, resp.addr);
            let (written, r) = w.wait(&p);
            assert_eq!(written as usize, RESP_SIZE, "table of {entries}");
            assert_eq!(r.detail.get(), bad::CHAIN, "table of {entries}");
        }
    }

    /// A chain of 2^32 bytes or more is cut before the descriptor that
    /// brings its total to 2^32: the walk stops at the descriptor before,
    /// which gets CHAIN if it is a usable response (no status otherwise).
    /// One byte less is a whole chain, checked further (here: its long
    /// output is outside guest memory).
    #[test]
    fn a_chain_of_4_gib_is_cut_before_the_descriptor_that_reaches_it() {
        let mut w = world();
        let next = VRING_DESC_F_NEXT as u16;
        let wr = VRING_DESC_F_WRITE as u16;
        // [header 32] [early 16] [long] [response 16]: 64 + long in total.
        for (head, long) in [
            (60u16, u32::MAX - 47),
            (64, u32::MAX - 63),
            (68, u32::MAX - 64),
        ] {
            let m = &mut w.members[0];
            let h = m.header(&hdr(0, F32, SUM, 0, 4, 0, 0, 0));
            let early = m.response();
            let resp = m.response();
            m.raw_desc(0, head, h.addr, 32, next, head + 1);
            m.raw_desc(0, head + 1, early.addr, 16, wr | next, head + 2);
            m.raw_desc(0, head + 2, 0x10_0000, long, wr | next, head + 3);
            m.raw_desc(0, head + 3, resp.addr, 16, wr, 0);
            let p = w.submit_head(0, 0, head, resp.addr);
            let done = w
                .wait_for(&p, std::time::Duration::ZERO)
                .expect("rejected at once");
            let m = &w.members[0];
            let read = |a: u64| {
                <VirtioDmlcResp as zerocopy::FromBytes>::read_from_bytes(&m.read(a, RESP_SIZE))
                    .unwrap()
            };
            let untouched = |a: u64| m.read(a, RESP_SIZE).iter().all(|&b| b == 0xee);
            let total = 64 + u64::from(long);
            if total > 1 << 32 {
                // Cut before the long output: the early response gets it.
                assert_eq!(done.written as usize, RESP_SIZE);
                assert_eq!(read(early.addr).detail.get(), bad::CHAIN);
                assert!(untouched(resp.addr));
            } else if total == 1 << 32 {
                // Cut before the response, after the long output.
                assert_eq!(done.written, 0);
                assert!(untouched(resp.addr) && untouched(early.addr));
            } else {
                assert_eq!(u64::from(done.written), total - 32);
                assert_eq!(read(resp.addr).detail.get(), bad::ADDRESS);
            }
        }
    }

    #[test]
    fn indirect_chain_is_accepted() {
        let mut w = world();
        let h = hdr(
            Opcode::Allreduce.raw(),
            Dtype::I32.raw(),
            SUM,
            0,
            2,
            0,
            0,
            0,
        );
        let mut ps = Vec::new();
        let mut outs = Vec::new();
        for r in 0..2u32 {
            let m = &mut w.members[r as usize];
            let inp = m.alloc(8);
            m.write(inp, &[1, 0, 0, 0, 2, 0, 0, 0].map(|x| x * (r as u8 + 1)));
            let out = m.alloc(8);
            let d = vec![m.header(&h), Desc::r(inp, 8), Desc::w(out, 8), m.response()];
            outs.push(out);
            ps.push(if r == 0 {
                w.submit_indirect(r, 0, &d)
            } else {
                w.submit(r, 0, &d)
            });
        }
        for (p, out) in ps.iter().zip(outs) {
            let (written, resp) = w.wait(p);
            assert_eq!(resp.status.get(), Status::Ok.raw());
            assert_eq!(written as usize, RESP_SIZE + 8);
            assert_eq!(
                w.members[p.rank as usize].read(out, 8),
                [3, 0, 0, 0, 6, 0, 0, 0]
            );
        }
    }

    #[test]
    fn rejected_requests_take_no_sequence_number() {
        let mut w = world();
        let barrier = hdr(5, 0, 0, 0, 0, 0, 0, 0);
        let d = chain(&mut w, &hdr(5, 0, 0, 0, 0, 0, 1 << 3, 0), 0, 0);
        assert_eq!(rejected(&mut w, &d), bad(bad::FLAGS));
        let d = chain(&mut w, &barrier, 0, 0);
        let p0 = w.submit(0, 0, &d);
        let m = &mut w.members[1];
        let d = vec![m.header(&barrier), m.response()];
        let p1 = w.submit(1, 0, &d);
        assert_eq!(w.wait(&p0).1.status.get(), Status::Ok.raw());
        assert_eq!(w.wait(&p1).1.status.get(), Status::Ok.raw());
        assert_eq!(w.group.metrics().errors(Status::BadRequest), 1);
    }
}
