//! Device ABI of the virtio-dmlc allreduce device.
//!
//! This crate is the single definition of every number and layout that the
//! driver and the device share: the device ID, feature bits, config space,
//! request header, response, opcodes, dtypes, reduce ops and statuses. It has
//! no I/O. `docs/spec.md` is the normative text; the doc comments here are
//! a summary of it.
//!
//! All multi-byte fields are little-endian. The structs use zerocopy's
//! little-endian integer types so that they can be read from and written to
//! guest memory byte for byte on any host.
//!
//! # Descriptor chain of one request
//!
//! ```text
//! [header: VirtioDmlcReq (R)] [input segments (R)*] [output segments (W)*] [response: VirtioDmlcResp (W)]
//! ```
//!
//! The header is the first descriptor and is exactly [`REQ_HEADER_SIZE`]
//! bytes. Every other readable descriptor is an input segment, every writable
//! descriptor but the last is an output segment, and the last writable
//! descriptor is the response, exactly [`RESP_SIZE`] bytes. Readable
//! descriptors never follow writable ones. Each data segment's length is a
//! multiple of the dtype's element size.
#![no_std]

use zerocopy::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// Virtio device ID (provisional: 51..=63 look unclaimed in virtio 1.4).
pub const VIRTIO_ID_DMLC: u32 = 63;
/// PCI vendor ID of every virtio device.
pub const PCI_VENDOR_ID_VIRTIO: u16 = 0x1af4;
/// Modern virtio-pci device ID: 0x1040 + device ID.
pub const PCI_DEVICE_ID_DMLC: u16 = 0x1040 + VIRTIO_ID_DMLC as u16;

/// Feature bit: the device honours `VirtioDmlcReq::timeout_ms`.
/// Without it the device uses its own collective timeout for every request.
pub const VIRTIO_DMLC_F_REQ_TIMEOUT: u32 = 0;

/// Feature bit: non-finite origin (spec 5.X.6.14). A request with
/// [`FLAG_CHECK_FINITE`] on a floating-point reduction completes with
/// [`Status::NonFinite`], naming the lowest rank whose input held a NaN or
/// an infinity and the lowest such element in it. Needs
/// [`comm::VIRTIO_DMLC_F_COMM`], whose 40-byte response carries the index.
pub const VIRTIO_DMLC_F_NONFINITE: u32 = 4;

/// Transport feature bits this device offers (from the virtio spec).
pub const VIRTIO_RING_F_INDIRECT_DESC: u32 = 28;
pub const VIRTIO_RING_F_EVENT_IDX: u32 = 29;
pub const VIRTIO_F_VERSION_1: u32 = 32;

/// Largest number of request queues a device may have.
pub const MAX_QUEUES: u32 = 64;

/// Device configuration space (read-only for the driver), 48 bytes.
#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct VirtioDmlcConfig {
    /// This member's rank in the group, `0..world_size`.
    pub rank: U32,
    /// Number of members in the group.
    pub world_size: U32,
    /// Number of request queues (virtqueues `0..num_queues`).
    pub num_queues: U32,
    /// Largest number of data segments (inputs plus outputs) in one request.
    pub max_segments: U32,
    /// Largest total size in bytes of a request's input or of its output.
    pub max_bytes: U64,
    /// Bitmask of supported dtypes: bit `d` set if dtype `d` is supported.
    pub dtypes: U32,
    /// Bitmask of supported reduce ops: bit `o` set if op `o` is supported.
    pub ops: U32,
    /// Bitmask of supported opcodes: bit `c` set if opcode `c` is supported.
    pub opcodes: U32,
    /// Changes every time the group is reset (a member lost or re-initialised).
    pub generation: U32,
    /// Identifies the group; the same for every member of one group.
    pub group_id: U64,
}

/// Size of [`VirtioDmlcConfig`] in bytes.
pub const CONFIG_SIZE: usize = core::mem::size_of::<VirtioDmlcConfig>();

/// Request header, the first (device-readable) descriptor of a chain, 32 bytes.
#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct VirtioDmlcReq {
    /// One of the `OPCODE_*` values.
    pub opcode: U16,
    /// One of the `DTYPE_*` values (ignored by barrier).
    pub dtype: u8,
    /// One of the `OP_*` values (used by allreduce, reduce, reduce-scatter).
    pub op: u8,
    /// Root rank of broadcast and reduce; must be 0 for other opcodes.
    pub root: U32,
    /// Elements per member block (see the opcodes for buffer sizes).
    pub count: U64,
    /// Caller's tag. Must be equal on every member; returned untouched.
    pub tag: U64,
    /// `FLAG_*` bits.
    pub flags: U32,
    /// Timeout of this collective in milliseconds, 0 = device default.
    /// Honoured only if `VIRTIO_DMLC_F_REQ_TIMEOUT` was negotiated.
    pub timeout_ms: U32,
}

/// Size of [`VirtioDmlcReq`] in bytes.
pub const REQ_HEADER_SIZE: usize = core::mem::size_of::<VirtioDmlcReq>();

/// Response, the last (device-writable) descriptor of a chain, 16 bytes.
#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct VirtioDmlcResp {
    /// One of the `STATUS_*` values.
    pub status: U32,
    /// Status-specific detail: a `BAD_*` reason, a `MISMATCH_*` field mask, ...
    pub detail: U32,
    /// The rank the status is about (the differing or lost member), or
    /// `NO_PEER`.
    pub peer: U32,
    /// The group generation in which the request was handled.
    pub generation: U32,
}

/// Size of [`VirtioDmlcResp`] in bytes.
pub const RESP_SIZE: usize = core::mem::size_of::<VirtioDmlcResp>();

/// `VirtioDmlcResp::peer` when no particular member is concerned.
pub const NO_PEER: u32 = u32::MAX;

/// In-place: the request has no input segments; the output buffer holds
/// this member's input (see each opcode for where).
pub const FLAG_IN_PLACE: u32 = 1 << 0;
/// Check the inputs of a floating-point reduction for NaN and infinity
/// (spec 5.X.6.14). Only with [`VIRTIO_DMLC_F_NONFINITE`] negotiated;
/// otherwise a reserved bit.
pub const FLAG_CHECK_FINITE: u32 = 1 << 1;
/// All flag bits defined without feature bits (a driver that negotiated
/// [`VIRTIO_DMLC_F_NONFINITE`] may also set [`FLAG_CHECK_FINITE`]).
pub const FLAGS_KNOWN: u32 = FLAG_IN_PLACE;

macro_rules! numbered {
    ($(#[$m:meta])* $ty:ident : $repr:ty { $($(#[$vm:meta])* $v:ident = $n:expr, $c:ident, $name:literal;)* }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[repr($repr)]
        pub enum $ty { $($(#[$vm])* $v = $n,)* }
        $(pub const $c: $repr = $n;)*
        impl $ty {
            /// Every value, in numeric order.
            pub const ALL: &'static [$ty] = &[$($ty::$v,)*];
            /// Decodes a wire value.
            pub fn from_raw(raw: $repr) -> Option<Self> {
                match raw { $($n => Some($ty::$v),)* _ => None }
            }
            /// The wire value.
            pub fn raw(self) -> $repr { self as $repr }
            /// Short lower-case name, as used on command lines and in messages.
            pub fn name(self) -> &'static str {
                match self { $($ty::$v => $name,)* }
            }
            /// Parses a name as returned by [`Self::name`].
            pub fn from_name(name: &str) -> Option<Self> {
                match name { $($name => Some($ty::$v),)* _ => None }
            }
            /// Bitmask with one bit per value.
            pub const fn all_mask() -> u32 { 0 $(| (1u32 << $n))* }
        }
        impl core::fmt::Display for $ty {
            fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result { f.write_str(self.name()) }
        }
    };
}

numbered! {
    /// Collective operations (`VirtioDmlcReq::opcode`).
    Opcode: u16 {
        /// Every member gets the reduction of all members' inputs.
        /// Input `count`, output `count`.
        Allreduce = 0, OPCODE_ALLREDUCE, "allreduce";
        /// Every member gets the root's input. Root: input `count` (or in
        /// place); every member: output `count`.
        Broadcast = 1, OPCODE_BROADCAST, "broadcast";
        /// The root gets the reduction. Every member: input `count`; root:
        /// output `count`; others: no output.
        Reduce = 2, OPCODE_REDUCE, "reduce";
        /// Every member gets all inputs concatenated in rank order.
        /// Input `count`, output `world_size * count`.
        Allgather = 3, OPCODE_ALLGATHER, "allgather";
        /// Member r gets block r of the reduction. Input `world_size * count`,
        /// output `count`.
        ReduceScatter = 4, OPCODE_REDUCE_SCATTER, "reduce_scatter";
        /// Completes once every member has arrived. No data, `count` 0.
        Barrier = 5, OPCODE_BARRIER, "barrier";
        /// Completes at once for the member that sent it, without waiting
        /// for or counting as a collective: the device's own round trip.
        /// No data, `count` 0.
        Nop = 6, OPCODE_NOP, "nop";
    }
}

numbered! {
    /// Element types (`VirtioDmlcReq::dtype`).
    Dtype: u8 {
        F32 = 0, DTYPE_F32, "f32";
        F64 = 1, DTYPE_F64, "f64";
        /// IEEE 754 binary16; reduced with f32 accumulation.
        F16 = 2, DTYPE_F16, "f16";
        /// bfloat16; reduced with f32 accumulation.
        Bf16 = 3, DTYPE_BF16, "bf16";
        I8 = 4, DTYPE_I8, "i8";
        U8 = 5, DTYPE_U8, "u8";
        I32 = 6, DTYPE_I32, "i32";
        U32 = 7, DTYPE_U32, "u32";
        I64 = 8, DTYPE_I64, "i64";
        U64 = 9, DTYPE_U64, "u64";
    }
}

impl Opcode {
    /// False for the opcodes that take no data and no dtype (barrier, nop).
    pub fn moves_data(self) -> bool {
        !matches!(self, Opcode::Barrier | Opcode::Nop)
    }
}

impl Dtype {
    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            Dtype::I8 | Dtype::U8 => 1,
            Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::F32 | Dtype::I32 | Dtype::U32 => 4,
            Dtype::F64 | Dtype::I64 | Dtype::U64 => 8,
        }
    }

    /// True for the floating-point types.
    pub fn is_float(self) -> bool {
        matches!(self, Dtype::F32 | Dtype::F64 | Dtype::F16 | Dtype::Bf16)
    }
}

numbered! {
    /// Reduce operations (`VirtioDmlcReq::op`).
    ReduceOp: u8 {
        /// Integers wrap around (two's complement).
        Sum = 0, OP_SUM, "sum";
        /// Integers wrap around (two's complement).
        Prod = 1, OP_PROD, "prod";
        /// For floats, a NaN in any input makes the result NaN.
        Min = 2, OP_MIN, "min";
        /// For floats, a NaN in any input makes the result NaN.
        Max = 3, OP_MAX, "max";
        /// The sum divided by `world_size`; integers: wrapping sum, then
        /// division truncating toward zero.
        Avg = 4, OP_AVG, "avg";
        /// Bitwise and; integer dtypes only.
        Band = 5, OP_BAND, "band";
        /// Bitwise or; integer dtypes only.
        Bor = 6, OP_BOR, "bor";
        /// Bitwise xor; integer dtypes only.
        Bxor = 7, OP_BXOR, "bxor";
    }
}

impl ReduceOp {
    /// True if this op is defined for `dtype`.
    pub fn supports(self, dtype: Dtype) -> bool {
        !matches!(self, ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor) || !dtype.is_float()
    }
}

numbered! {
    /// Response statuses (`VirtioDmlcResp::status`).
    Status: u32 {
        /// Completed; the output buffers hold the result.
        Ok = 0, STATUS_OK, "ok";
        /// The chain or header is malformed; `detail` is a `BAD_*` reason.
        BadRequest = 1, STATUS_BAD_REQUEST, "bad_request";
        /// The members' requests for this collective disagree; `detail` is a
        /// mask of `MISMATCH_*` fields, `peer` the first member that differs
        /// from rank 0's request.
        Mismatch = 2, STATUS_MISMATCH, "mismatch";
        /// A member was lost while this collective waited or ran; `peer` is
        /// that member.
        PeerLost = 3, STATUS_PEER_LOST, "peer_lost";
        /// Not every member arrived within the timeout; `peer` is the first
        /// missing member.
        Timeout = 4, STATUS_TIMEOUT, "timeout";
        /// Opcode, dtype, op, or their combination is not supported;
        /// `detail` is an `UNSUPPORTED_*` reason.
        Unsupported = 5, STATUS_UNSUPPORTED, "unsupported";
        /// The request exceeds `max_bytes` or `max_segments`; `detail` is a
        /// `TOO_BIG_*` reason.
        TooBig = 6, STATUS_TOO_BIG, "too_big";
        /// The group was reset (generation changed) before this collective
        /// completed, for a reason other than a lost member.
        Reset = 7, STATUS_RESET, "reset";
        /// A send was larger than the receive it matched (feature bit 2,
        /// spec 5.X.6.13.4); the response's `length` names the other end's
        /// size.
        Truncate = 8, STATUS_TRUNCATE, "truncate";
        /// A request with [`FLAG_CHECK_FINITE`] (feature bit 4, spec
        /// 5.X.6.14): some member's input held a NaN or an infinity;
        /// `peer` is the lowest such rank and the 40-byte response's
        /// `length` the lowest such element index in its input. The
        /// outputs hold the result as without the flag.
        NonFinite = 9, STATUS_NONFINITE, "nonfinite";
    }
}

/// `detail` of `STATUS_BAD_REQUEST`: why the request is malformed.
pub mod bad {
    /// The first descriptor is not a readable header of exactly `REQ_HEADER_SIZE` bytes.
    pub const HEADER: u32 = 1;
    /// The last descriptor is not a writable response of exactly `RESP_SIZE` bytes.
    pub const RESPONSE: u32 = 2;
    /// A readable descriptor follows a writable one.
    pub const ORDER: u32 = 3;
    /// A descriptor's address range is not inside guest memory (or overflows).
    pub const ADDRESS: u32 = 4;
    /// A data segment's length is not a multiple of the element size.
    pub const SEGMENT_ALIGN: u32 = 5;
    /// The input's total length does not match what the opcode and count require.
    pub const INPUT_LENGTH: u32 = 6;
    /// The output's total length does not match what the opcode and count require.
    pub const OUTPUT_LENGTH: u32 = 7;
    /// `root` is not below `world_size`, or is non-zero for an opcode without root.
    pub const ROOT: u32 = 8;
    /// Unknown bits in `flags`.
    pub const FLAGS: u32 = 9;
    /// `count * element size` (times world size where it applies) overflows.
    pub const OVERFLOW: u32 = 10;
    /// The descriptor chain itself is broken (loop, bad index, bad indirect table).
    pub const CHAIN: u32 = 11;
    /// Barrier with a non-zero count or with data segments.
    pub const BARRIER_DATA: u32 = 12;
    /// `FLAG_IN_PLACE` together with input segments.
    pub const IN_PLACE_INPUT: u32 = 13;

    /// Human-readable text for a reason code.
    pub fn describe(detail: u32) -> &'static str {
        match detail {
            HEADER => "header descriptor missing, writable or of the wrong size",
            RESPONSE => "response descriptor missing, readable or of the wrong size",
            ORDER => "readable descriptor after a writable one",
            ADDRESS => "descriptor outside guest memory",
            SEGMENT_ALIGN => "segment length not a multiple of the element size",
            INPUT_LENGTH => "input length does not match count",
            OUTPUT_LENGTH => "output length does not match count",
            ROOT => "root out of range",
            FLAGS => "unknown flag bits",
            OVERFLOW => "count overflows",
            CHAIN => "broken descriptor chain",
            BARRIER_DATA => "barrier with data",
            IN_PLACE_INPUT => "in-place request with input segments",
            crate::comm::BAD_COMM => "unknown, freed or foreign communicator",
            crate::comm::BAD_PEER => "peer is the member itself or not a rank of the communicator",
            crate::comm::BAD_TABLE => "table of the wrong size, or a bad list of ranks",
            crate::comm::BAD_IN_PLACE_OPCODE => "in place on an opcode without an in-place form",
            _ => "unknown reason",
        }
    }
}

/// `detail` of `STATUS_MISMATCH`: a mask of the header fields that differ.
pub mod mismatch {
    pub const OPCODE: u32 = 1 << 0;
    pub const DTYPE: u32 = 1 << 1;
    pub const OP: u32 = 1 << 2;
    pub const COUNT: u32 = 1 << 3;
    pub const ROOT: u32 = 1 << 4;
    pub const TAG: u32 = 1 << 5;

    /// Names of the fields set in `mask`, in bit order.
    pub fn fields(mask: u32) -> impl Iterator<Item = &'static str> {
        const NAMES: [&str; 7] = ["opcode", "dtype", "op", "count", "root", "tag", "table"];
        NAMES
            .into_iter()
            .enumerate()
            .filter(move |(bit, _)| mask & (1 << bit) != 0)
            .map(|(_, name)| name)
    }
}

/// `detail` of `STATUS_UNSUPPORTED`.
pub mod unsupported {
    pub const OPCODE: u32 = 1;
    pub const DTYPE: u32 = 2;
    pub const OP: u32 = 3;
    /// The op is not defined for the dtype (bitwise op on a float).
    pub const OP_FOR_DTYPE: u32 = 4;
}

/// `detail` of `STATUS_TOO_BIG`.
pub mod too_big {
    /// Input or output larger than `max_bytes`.
    pub const BYTES: u32 = 1;
    /// More data segments than `max_segments`.
    pub const SEGMENTS: u32 = 2;
}

/// Element counts of one member's data buffers for a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufferElems {
    /// Elements in the input segments (0 when in place).
    pub input: u64,
    /// Elements in the output segments.
    pub output: u64,
    /// When in place: where this member's input starts in the output
    /// buffer, and how many elements it has.
    pub in_place_input: Option<(u64, u64)>,
}

/// The element counts that member `rank` of a group of `world` must supply
/// for a request, or `None` if they overflow `u64`.
///
/// This is the one place where the buffer rules of the spec are written down
/// as code; the driver and the device both use it.
pub fn buffer_elems(
    opcode: Opcode,
    world: u32,
    rank: u32,
    root: u32,
    count: u64,
    in_place: bool,
) -> Option<BufferElems> {
    let all = count.checked_mul(u64::from(world))?;
    let is_root = rank == root;
    // (input, output, offset of own input in output when in place)
    let (input, output, offset) = match opcode {
        Opcode::Allreduce => (count, count, 0),
        Opcode::Broadcast if is_root => (count, count, 0),
        Opcode::Broadcast => (0, count, 0),
        // A non-root member of an in-place reduce offers its input in a
        // writable buffer that the device reads and leaves unchanged.
        Opcode::Reduce if is_root || in_place => (count, count, 0),
        Opcode::Reduce => (count, 0, 0),
        Opcode::Allgather => (count, all, u64::from(rank).checked_mul(count)?),
        Opcode::ReduceScatter if in_place => (all, all, 0),
        Opcode::ReduceScatter => (all, count, 0),
        Opcode::Barrier | Opcode::Nop => (0, 0, 0),
    };
    Some(if in_place && input > 0 {
        BufferElems {
            input: 0,
            output,
            in_place_input: Some((offset, input)),
        }
    } else {
        BufferElems {
            input,
            output,
            in_place_input: None,
        }
    })
}

pub mod comm;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_have_spec_sizes() {
        assert_eq!(CONFIG_SIZE, 48);
        assert_eq!(REQ_HEADER_SIZE, 32);
        assert_eq!(RESP_SIZE, 16);
        assert_eq!(PCI_DEVICE_ID_DMLC, 0x107f);
    }

    #[test]
    fn header_field_offsets_match_spec() {
        let req = VirtioDmlcReq {
            opcode: 0x0102.into(),
            dtype: 3,
            op: 4,
            root: 0x0506_0708.into(),
            count: 0x1112_1314_1516_1718.into(),
            tag: 0x2122_2324_2526_2728.into(),
            flags: 0x3132_3334.into(),
            timeout_ms: 0x4142_4344.into(),
        };
        let b = req.as_bytes();
        assert_eq!(&b[0..4], &[0x02, 0x01, 3, 4]);
        assert_eq!(&b[4..8], &[0x08, 0x07, 0x06, 0x05]);
        assert_eq!(b[8], 0x18);
        assert_eq!(b[16], 0x28);
        assert_eq!(b[24], 0x34);
        assert_eq!(b[28], 0x44);
    }

    #[test]
    fn enums_round_trip() {
        for d in Dtype::ALL {
            assert_eq!(Dtype::from_raw(d.raw()), Some(*d));
            assert_eq!(Dtype::from_name(d.name()), Some(*d));
        }
        assert_eq!(Dtype::all_mask(), 0x3ff);
        assert_eq!(Opcode::all_mask(), 0x7f);
        assert_eq!(ReduceOp::all_mask(), 0xff);
        assert!(Opcode::from_raw(7).is_none());
        assert!(!ReduceOp::Bxor.supports(Dtype::F32));
        assert!(ReduceOp::Bxor.supports(Dtype::U8));
    }

    #[test]
    fn buffer_rules() {
        let b = buffer_elems(Opcode::Allgather, 4, 2, 0, 10, false).unwrap();
        assert_eq!((b.input, b.output, b.in_place_input), (10, 40, None));
        let b = buffer_elems(Opcode::Allgather, 4, 2, 0, 10, true).unwrap();
        assert_eq!(
            (b.input, b.output, b.in_place_input),
            (0, 40, Some((20, 10)))
        );
        let b = buffer_elems(Opcode::ReduceScatter, 4, 1, 0, 10, false).unwrap();
        assert_eq!((b.input, b.output), (40, 10));
        let b = buffer_elems(Opcode::Reduce, 4, 1, 0, 10, false).unwrap();
        assert_eq!((b.input, b.output), (10, 0));
        let b = buffer_elems(Opcode::Broadcast, 4, 1, 0, 10, false).unwrap();
        assert_eq!((b.input, b.output), (0, 10));
        assert!(buffer_elems(Opcode::Allgather, 4, 1, 0, u64::MAX / 2, false).is_none());
    }

    #[test]
    fn mismatch_fields_named() {
        let mut names = mismatch::fields(mismatch::DTYPE | mismatch::COUNT);
        assert_eq!(names.next(), Some("dtype"));
        assert_eq!(names.next(), Some("count"));
        assert_eq!(names.next(), None);
    }
}
