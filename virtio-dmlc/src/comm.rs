//! Communicators, send and receive, all-to-all, gather and scatter: the ABI
//! of spec 5.X.6.13 (feature bits 1 to 3).
//!
//! Their opcodes live in [`CommOpcode`], apart from [`crate::Opcode`],
//! whose `ALL` every self-test, fuzz model and benchmark of the
//! collectives of 5.X.6.1 walks: a request of one of them has another
//! header and response, and exists only where the bits were negotiated.

use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use crate::{BufferElems, VirtioDmlcConfig, VirtioDmlcReq, VirtioDmlcResp};

/// Feature bit: communicators, the 48-byte header with a table and the
/// 40-byte response (comm_split, comm_create, comm_free).
pub const VIRTIO_DMLC_F_COMM: u32 = 1;
/// Feature bit: send and receive. Needs [`VIRTIO_DMLC_F_COMM`].
pub const VIRTIO_DMLC_F_P2P: u32 = 2;
/// Feature bit: all-to-all, gather and scatter, with equal blocks and with
/// counts per rank. Needs [`VIRTIO_DMLC_F_COMM`].
pub const VIRTIO_DMLC_F_BLOCKS: u32 = 3;

/// The communicator of the whole group, in rank order.
pub const COMM_WORLD: u32 = 0;
/// `peer` of a receive from whichever rank sends first.
pub const ANY_SOURCE: u32 = u32::MAX;
/// Color of a comm_split member that joins no new communicator.
pub const UNDEFINED: u32 = u32::MAX;

/// Configuration space with [`VIRTIO_DMLC_F_COMM`], 56 bytes.
#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct VirtioDmlcConfigComm {
    /// The configuration of 5.X.4.
    pub base: VirtioDmlcConfig,
    /// Most communicators live at once, communicator 0 included; at least 2.
    pub max_comms: U32,
    /// Reads as 0.
    pub reserved: U32,
}

/// The fixed part of the request header with [`VIRTIO_DMLC_F_COMM`],
/// 48 bytes; `table_bytes` of table follow it in the same descriptor.
#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct VirtioDmlcReqComm {
    /// The header of 5.X.6.1; `root` is a rank of `comm`.
    pub base: VirtioDmlcReq,
    /// The communicator: [`COMM_WORLD`] or an id the device gave.
    pub comm: U32,
    /// Send: the destination; receive: the source or [`ANY_SOURCE`];
    /// comm_split: the color or [`UNDEFINED`]; otherwise 0.
    pub peer: U32,
    /// comm_split: the key that orders the new communicator; otherwise 0.
    pub key: U32,
    /// Bytes of the table that follows (see [`table_bytes`]).
    pub table_bytes: U32,
}

/// Size of [`VirtioDmlcReqComm`], the header without its table.
pub const REQ_COMM_HEADER_SIZE: usize = core::mem::size_of::<VirtioDmlcReqComm>();

/// Response with [`VIRTIO_DMLC_F_COMM`], 40 bytes.
#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct VirtioDmlcRespComm {
    /// The response of 5.X.6.1; `peer` is a rank of the request's
    /// communicator (for a received message: its sender).
    pub base: VirtioDmlcResp,
    /// Send and receive: the message's size in bytes, or with
    /// [`crate::Status::Truncate`] the other end's size; otherwise 0.
    pub length: U64,
    /// comm_split and comm_create: the new communicator, 0 if none.
    pub comm: U32,
    /// This member's rank in the new communicator.
    pub comm_rank: U32,
    /// The new communicator's number of members.
    pub comm_size: U32,
    /// `base.peer` as a rank of communicator 0, or `NO_PEER`.
    pub peer_world: U32,
}

/// Size of [`VirtioDmlcRespComm`] in bytes.
pub const RESP_COMM_SIZE: usize = core::mem::size_of::<VirtioDmlcRespComm>();

numbered! {
    /// The opcodes of feature bits 1 to 3 (`VirtioDmlcReq::opcode`).
    CommOpcode: u16 {
        /// The input goes to rank `peer`. Input `count`, no output.
        Send = 7, OPCODE_SEND, "send";
        /// One message from `peer` (or any rank). Output: room for `count`.
        Recv = 8, OPCODE_RECV, "recv";
        /// Block j of every input goes to rank j. Input and output `N*count`.
        Alltoall = 9, OPCODE_ALLTOALL, "alltoall";
        /// As alltoall with a count per pair of ranks, from the table.
        Alltoallv = 10, OPCODE_ALLTOALLV, "alltoallv";
        /// The root gets every input in rank order.
        Gather = 11, OPCODE_GATHER, "gather";
        /// As gather, each member with its own count.
        Gatherv = 12, OPCODE_GATHERV, "gatherv";
        /// Rank r gets block r of the root's input.
        Scatter = 13, OPCODE_SCATTER, "scatter";
        /// As scatter, each member with its own count.
        Scatterv = 14, OPCODE_SCATTERV, "scatterv";
        /// New communicators by color and key.
        CommSplit = 15, OPCODE_COMM_SPLIT, "comm_split";
        /// A new communicator of the ranks listed, called by them only.
        CommCreate = 16, OPCODE_COMM_CREATE, "comm_create";
        /// The communicator's id stops being valid.
        CommFree = 17, OPCODE_COMM_FREE, "comm_free";
    }
}

impl CommOpcode {
    /// The feature bit that brings this opcode.
    pub fn feature(self) -> u32 {
        match self {
            CommOpcode::Send | CommOpcode::Recv => VIRTIO_DMLC_F_P2P,
            CommOpcode::CommSplit | CommOpcode::CommCreate | CommOpcode::CommFree => {
                VIRTIO_DMLC_F_COMM
            }
            _ => VIRTIO_DMLC_F_BLOCKS,
        }
    }

    /// True for the opcodes that take their communicator's next sequence
    /// number (send, receive and comm_create are matched otherwise).
    pub fn takes_sequence(self) -> bool {
        !matches!(
            self,
            CommOpcode::Send | CommOpcode::Recv | CommOpcode::CommCreate
        )
    }
}

/// `BAD_REQUEST` detail: unknown, freed or foreign communicator, or
/// freeing communicator 0.
pub const BAD_COMM: u32 = 14;
/// `BAD_REQUEST` detail: a send's or receive's `peer` is the member itself
/// or not a rank of the communicator.
pub const BAD_PEER: u32 = 15;
/// `BAD_REQUEST` detail: `table_bytes` is not what the opcode needs, or a
/// comm_create list is not a valid list of ranks.
pub const BAD_TABLE: u32 = 16;
/// `BAD_REQUEST` detail: the in-place flag on an opcode that has no
/// in-place form.
pub const BAD_IN_PLACE_OPCODE: u32 = 17;
/// `MISMATCH` bit: the members' tables or lists disagree.
pub const MISMATCH_TABLE: u32 = 1 << 6;
/// `TOO_BIG` detail: `max_comms` communicators are live.
pub const TOO_BIG_COMMS: u32 = 3;

/// The table size, in bytes, that `opcode` needs from a member of a
/// communicator of `size`, or `None` for comm_create (a multiple of 4,
/// checked by [`check_create_list`]).
pub fn table_bytes(opcode: CommOpcode, size: u32, is_root: bool) -> Option<u64> {
    let n = u64::from(size);
    Some(match opcode {
        CommOpcode::Alltoallv => 16 * n,
        CommOpcode::Gatherv | CommOpcode::Scatterv if is_root => 8 * n,
        CommOpcode::CommCreate => return None,
        _ => 0,
    })
}

/// Reads a table of `le64` counts (its length is a multiple of 8, as
/// [`table_bytes`] makes it).
pub fn counts(table: &[u8]) -> impl Iterator<Item = u64> + '_ {
    table
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
}

/// The element counts that rank `rank` of a communicator of `size` must
/// supply, its table read with [`counts`] (empty when it has none), or the
/// `BAD_REQUEST` detail that refuses the request.
pub fn block_elems(
    opcode: CommOpcode,
    size: u32,
    rank: u32,
    root: u32,
    count: u64,
    table: &[u64],
    in_place: bool,
) -> Result<BufferElems, u32> {
    const OVERFLOW: u32 = crate::bad::OVERFLOW;
    let is_root = rank == root;
    if opcode != CommOpcode::CommCreate
        && table_bytes(opcode, size, is_root) != Some(8 * table.len() as u64)
    {
        return Err(BAD_TABLE);
    }
    let all = count.checked_mul(u64::from(size)).ok_or(OVERFLOW)?;
    let own_block = u64::from(rank).checked_mul(count).ok_or(OVERFLOW)?;
    let sum = |t: &[u64]| t.iter().try_fold(0u64, |a, &c| a.checked_add(c));
    let before = |t: &[u64], r: u32| sum(&t[..r as usize]);
    // (input, output, offset of the member's own block in an in-place buffer)
    let (input, output, offset) = match opcode {
        CommOpcode::Send => (count, 0, None),
        CommOpcode::Recv => (0, count, None),
        CommOpcode::Alltoall => (all, all, None),
        CommOpcode::Alltoallv => {
            let (send, recv) = table.split_at(table.len() / 2);
            (sum(send).ok_or(OVERFLOW)?, sum(recv).ok_or(OVERFLOW)?, None)
        }
        CommOpcode::Gather if is_root => (count, all, Some(own_block)),
        CommOpcode::Gatherv if is_root => (
            count,
            sum(table).ok_or(OVERFLOW)?,
            Some(before(table, rank).ok_or(OVERFLOW)?),
        ),
        CommOpcode::Gather | CommOpcode::Gatherv => (count, 0, None),
        CommOpcode::Scatter if is_root => (all, count, Some(own_block)),
        CommOpcode::Scatterv if is_root => (
            sum(table).ok_or(OVERFLOW)?,
            count,
            Some(before(table, rank).ok_or(OVERFLOW)?),
        ),
        CommOpcode::Scatter | CommOpcode::Scatterv => (0, count, None),
        CommOpcode::CommSplit | CommOpcode::CommCreate | CommOpcode::CommFree => (0, 0, None),
    };
    if !in_place {
        return Ok(BufferElems {
            input,
            output,
            in_place_input: None,
        });
    }
    // Checked whatever the count (a send of 0 elements in place included).
    match (opcode, offset) {
        (CommOpcode::Send | CommOpcode::Recv | CommOpcode::Alltoall | CommOpcode::Alltoallv, _) => {
            Err(BAD_IN_PLACE_OPCODE)
        }
        // A gather root's buffer is its output, with its own input in its
        // block; a scatter root's is its input, with its own output there.
        (CommOpcode::Gather | CommOpcode::Gatherv, Some(at)) => Ok(BufferElems {
            input: 0,
            output,
            in_place_input: Some((at, input)),
        }),
        (CommOpcode::Scatter | CommOpcode::Scatterv, Some(at)) => Ok(BufferElems {
            input: 0,
            output: input,
            in_place_input: Some((at, output)),
        }),
        // Non-roots: the flag has no effect.
        _ => Ok(BufferElems {
            input,
            output,
            in_place_input: None,
        }),
    }
}

/// The lowest rank of an alltoallv whose counts disagree with a partner's
/// (`send[i][j]` must equal `recv[j][i]`), or `None` when they all agree.
/// `tables[i]` is rank i's table read with [`counts`]: `send[N]`, `recv[N]`;
/// a table of another length disagrees.
pub fn alltoallv_disagreement<T: AsRef<[u64]>>(tables: &[T]) -> Option<u32> {
    let n = tables.len();
    let send = |i: usize, j: usize| tables[i].as_ref().get(j);
    let recv = |i: usize, j: usize| tables[i].as_ref().get(n + j);
    (0..n)
        .find(|&i| {
            tables[i].as_ref().len() != 2 * n
                || (0..n).any(|j| send(i, j) != recv(j, i) || recv(i, j) != send(j, i))
        })
        .map(|i| i as u32)
}

/// The lowest rank whose own `count` differs from the root's table entry
/// for it (gatherv, scatterv), or `None` when they agree.
pub fn rooted_disagreement(root_table: &[u64], member_counts: &[u64]) -> Option<u32> {
    root_table
        .iter()
        .zip(member_counts)
        .position(|(t, c)| t != c)
        .map(|r| r as u32)
}

/// Checks a comm_create list (ranks of a communicator of `size`, in the
/// new communicator's order) made by rank `caller`: not empty, each rank
/// below `size` and listed once, the caller among them. Returns the
/// caller's rank in the new communicator, or [`BAD_TABLE`].
pub fn check_create_list(list: &[u32], size: u32, caller: u32) -> Result<u32, u32> {
    let mut mine = None;
    for (i, &r) in list.iter().enumerate() {
        if r >= size || list[..i].contains(&r) {
            return Err(BAD_TABLE);
        }
        if r == caller {
            mine = Some(i as u32);
        }
    }
    mine.ok_or(BAD_TABLE)
}

/// Rank `me`'s place after a comm_split of the members' `(color, key)`,
/// indexed by their rank in the parent: `(rank, size)` in its new
/// communicator, ordered by key and then by parent rank, or `None` for
/// [`UNDEFINED`].
pub fn split_place(members: &[(u32, u32)], me: u32) -> Option<(u32, u32)> {
    let (color, key) = members[me as usize];
    if color == UNDEFINED {
        return None;
    }
    let mut rank = 0;
    let mut size = 0;
    for (p, &(c, k)) in members.iter().enumerate() {
        if c == color {
            size += 1;
            if (k, p as u32) < (key, me) {
                rank += 1;
            }
        }
    }
    Some((rank, size))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_have_the_spec_sizes_and_offsets() {
        assert_eq!(REQ_COMM_HEADER_SIZE, 0x30);
        assert_eq!(RESP_COMM_SIZE, 0x28);
        assert_eq!(core::mem::size_of::<VirtioDmlcConfigComm>(), 0x38);
        let req = VirtioDmlcReqComm {
            comm: 0x0102_0304.into(),
            peer: 0x1112_1314.into(),
            key: 0x2122_2324.into(),
            table_bytes: 0x3132_3334.into(),
            ..Default::default()
        };
        let b = req.as_bytes();
        assert_eq!(
            (b[0x20], b[0x24], b[0x28], b[0x2c]),
            (0x04, 0x14, 0x24, 0x34)
        );
        let resp = VirtioDmlcRespComm {
            length: 0x0102_0304_0506_0708.into(),
            comm: 0x11.into(),
            comm_rank: 0x12.into(),
            comm_size: 0x13.into(),
            peer_world: 0x14.into(),
            ..Default::default()
        };
        let b = resp.as_bytes();
        assert_eq!((b[0x10], b[0x17]), (0x08, 0x01));
        assert_eq!(
            (b[0x18], b[0x1c], b[0x20], b[0x24]),
            (0x11, 0x12, 0x13, 0x14)
        );
        let cfg = VirtioDmlcConfigComm {
            max_comms: 0x99.into(),
            ..Default::default()
        };
        assert_eq!(cfg.as_bytes()[0x30], 0x99);
    }

    #[test]
    fn opcodes_follow_the_base_ones_and_name_their_feature() {
        assert_eq!(CommOpcode::ALL.first().map(|o| o.raw()), Some(7));
        assert!(crate::Opcode::from_raw(CommOpcode::Send.raw()).is_none());
        assert_eq!(CommOpcode::all_mask(), 0x3ff80);
        assert_eq!(CommOpcode::Recv.feature(), VIRTIO_DMLC_F_P2P);
        assert_eq!(CommOpcode::Scatterv.feature(), VIRTIO_DMLC_F_BLOCKS);
        assert_eq!(CommOpcode::CommFree.feature(), VIRTIO_DMLC_F_COMM);
        assert!(!CommOpcode::CommCreate.takes_sequence());
        assert!(CommOpcode::CommSplit.takes_sequence());
        assert_eq!(
            CommOpcode::from_name("alltoallv"),
            Some(CommOpcode::Alltoallv)
        );
    }

    fn elems(b: BufferElems) -> (u64, u64, Option<(u64, u64)>) {
        (b.input, b.output, b.in_place_input)
    }

    #[test]
    fn buffer_sizes_follow_the_table_of_5x6132() {
        let e = |op, rank, table: &[u64], in_place| {
            block_elems(op, 4, rank, 1, 10, table, in_place).map(elems)
        };
        use CommOpcode::*;
        assert_eq!(e(Send, 0, &[], false), Ok((10, 0, None)));
        assert_eq!(e(Recv, 0, &[], false), Ok((0, 10, None)));
        assert_eq!(e(Recv, 0, &[], true), Err(BAD_IN_PLACE_OPCODE));
        assert_eq!(e(Alltoall, 0, &[], false), Ok((40, 40, None)));
        assert_eq!(e(Alltoall, 0, &[], true), Err(BAD_IN_PLACE_OPCODE));
        let a2av = [1, 2, 3, 4, 5, 5, 5, 5];
        assert_eq!(e(Alltoallv, 0, &a2av, false), Ok((10, 20, None)));
        assert_eq!(e(Gather, 1, &[], false), Ok((10, 40, None)));
        assert_eq!(e(Gather, 1, &[], true), Ok((0, 40, Some((10, 10)))));
        assert_eq!(e(Gather, 2, &[], true), Ok((10, 0, None)));
        let v = [3, 10, 1, 2];
        assert_eq!(e(Gatherv, 1, &v, false), Ok((10, 16, None)));
        assert_eq!(e(Gatherv, 1, &v, true), Ok((0, 16, Some((3, 10)))));
        assert_eq!(e(Scatter, 1, &[], false), Ok((40, 10, None)));
        assert_eq!(e(Scatter, 1, &[], true), Ok((0, 40, Some((10, 10)))));
        assert_eq!(e(Scatter, 3, &[], true), Ok((0, 10, None)));
        assert_eq!(e(Scatterv, 1, &v, true), Ok((0, 16, Some((3, 10)))));
        assert_eq!(e(CommSplit, 0, &[], true), Ok((0, 0, None)));
        assert_eq!(e(Gatherv, 1, &v[..3], false), Err(BAD_TABLE));
        assert_eq!(e(Gatherv, 2, &v, false), Err(BAD_TABLE));
        assert_eq!(e(Alltoallv, 0, &a2av[..6], false), Err(BAD_TABLE));
        assert_eq!(
            block_elems(Alltoall, 4, 0, 0, u64::MAX / 2, &[], false),
            Err(crate::bad::OVERFLOW)
        );
        assert_eq!(
            block_elems(Gatherv, 2, 0, 0, 1, &[u64::MAX, 1], false),
            Err(crate::bad::OVERFLOW)
        );
    }

    #[test]
    fn tables_have_the_sizes_the_opcode_needs() {
        assert_eq!(table_bytes(CommOpcode::Alltoallv, 4, false), Some(64));
        assert_eq!(table_bytes(CommOpcode::Gatherv, 4, true), Some(32));
        assert_eq!(table_bytes(CommOpcode::Gatherv, 4, false), Some(0));
        assert_eq!(table_bytes(CommOpcode::Send, 4, false), Some(0));
        assert_eq!(table_bytes(CommOpcode::CommCreate, 4, false), None);
        let raw = [1u8, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0];
        let mut c = counts(&raw);
        assert_eq!((c.next(), c.next(), c.next()), (Some(1), Some(256), None));
    }

    #[test]
    fn disagreeing_counts_name_the_lowest_rank_involved() {
        // 3 ranks; rank i sends i+j+1 elements to rank j.
        let mut t: [[u64; 6]; 3] =
            core::array::from_fn(|i| core::array::from_fn(|k| (i + k % 3 + 1) as u64));
        assert_eq!(alltoallv_disagreement(&t), None);
        t[2][3 + 1] += 1; // rank 2 expects one more from rank 1
        assert_eq!(alltoallv_disagreement(&t), Some(1));
        assert_eq!(
            alltoallv_disagreement(&[&t[0][..], &t[1][..5], &t[2][..]]),
            Some(1)
        );
        assert_eq!(rooted_disagreement(&[1, 2, 3], &[1, 2, 3]), None);
        assert_eq!(rooted_disagreement(&[1, 2, 3], &[1, 5, 0]), Some(1));
    }

    #[test]
    fn create_lists_and_split_places() {
        assert_eq!(check_create_list(&[3, 1], 4, 1), Ok(1));
        assert_eq!(check_create_list(&[3, 1], 4, 2), Err(BAD_TABLE));
        assert_eq!(check_create_list(&[3, 3], 4, 3), Err(BAD_TABLE));
        assert_eq!(check_create_list(&[4], 4, 0), Err(BAD_TABLE));
        assert_eq!(check_create_list(&[], 4, 0), Err(BAD_TABLE));
        // Even and odd ranks, keyed in reverse; rank 4 joins nothing.
        let m = [(0, 9), (1, 9), (0, 1), (1, 1), (UNDEFINED, 0), (0, 1)];
        assert_eq!(split_place(&m, 0), Some((2, 3)));
        assert_eq!(split_place(&m, 2), Some((0, 3)));
        assert_eq!(split_place(&m, 5), Some((1, 3)));
        assert_eq!(split_place(&m, 3), Some((0, 2)));
        assert_eq!(split_place(&m, 4), None);
    }
}
