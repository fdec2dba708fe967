//! What feature bits 1 to 3 add to the checks of a chain (docs/spec.md
//! 5.X.6.13), written from the spec text for [`crate::oracle`]: which
//! opcodes are known, which communicators a member may name, the table
//! each opcode needs (5.X.6.13.5), the rules of a comm_create list
//! (5.X.6.13.3) and the buffer sizes of the new opcodes (5.X.6.13.2).
//!
//! The backend's own helpers for these rules (`virtio_dmlc::comm`:
//! `block_elems`, `table_bytes`, `check_create_list`) are deliberately not
//! used here, so that a mistake in them shows up as a disagreement.

use std::sync::Arc;

use vhost_device_dmlc::chain::{CommView, SERVED_COMM_FEATURES};
use virtio_dmlc::comm::CommOpcode;
use virtio_dmlc::{bad, Dtype};

/// Feature bits of 5.X.3.
pub const F_COMM: u32 = 1;
pub const F_P2P: u32 = 2;
pub const F_BLOCKS: u32 = 3;

/// 5.X.6.13.1: the fixed part of the header with bit 1, `0x30` bytes; the
/// table follows it in the same descriptor.
pub const HEADER_FIXED: usize = 0x30;
/// 5.X.6.13.1: the response with bit 1, `0x28` bytes.
pub const RESPONSE: usize = 0x28;
/// 5.X.6.13.1: offsets of the fields after the 32-byte base header.
pub const AT_COMM: usize = 0x20;
pub const AT_PEER: usize = 0x24;
pub const AT_KEY: usize = 0x28;
pub const AT_TABLE_BYTES: usize = 0x2c;
/// 5.X.6.13.1: `peer` of a receive from any rank.
pub const ANY_SOURCE: u32 = 0xffff_ffff;

/// `BAD_REQUEST` details of 5.X.6.13.6.
pub const BAD_COMM: u32 = 14;
pub const BAD_PEER: u32 = 15;
pub const BAD_TABLE: u32 = 16;
pub const BAD_IN_PLACE_OPCODE: u32 = 17;

/// The feature bit that brings an opcode (the "Bit" column of 5.X.6.13.2).
pub fn feature_of(o: CommOpcode) -> u32 {
    use CommOpcode::*;
    match o {
        Send | Recv => F_P2P,
        Alltoall | Alltoallv | Gather | Gatherv | Scatter | Scatterv => F_BLOCKS,
        CommSplit | CommCreate | CommFree => F_COMM,
    }
}

/// Whether a member that negotiated `features` may use opcode `o`: bit 1
/// and the opcode's own bit negotiated (5.X.6.13: "this section applies
/// only when the driver negotiated ...") and offered by the device, which
/// offers what the backend serves (`SERVED_COMM_FEATURES`, read rather
/// than written down here, as it grows).
pub fn known(o: CommOpcode, features: u64) -> bool {
    let usable = features & SERVED_COMM_FEATURES;
    usable & (1 << F_COMM) != 0 && usable & (1 << feature_of(o)) != 0
}

/// Whether the opcode's buffers hold elements of its dtype, so that the
/// dtype is checked. 5.X.6.1 and 5.X.6.7.2 name only barrier and nop as
/// ignoring `dtype`; they were written before bit 1, and comm_split,
/// comm_create and comm_free, which have no buffers (5.X.6.13.2), are
/// taken to ignore it too, as the backend does (chain.rs `moves_data`).
pub fn uses_dtype(o: CommOpcode) -> bool {
    !matches!(
        o,
        CommOpcode::CommSplit | CommOpcode::CommCreate | CommOpcode::CommFree
    )
}

/// The opcodes with a root (5.X.6.13.2: gather, gatherv, scatter, scatterv).
pub fn has_root(o: CommOpcode) -> bool {
    matches!(
        o,
        CommOpcode::Gather | CommOpcode::Gatherv | CommOpcode::Scatter | CommOpcode::Scatterv
    )
}

/// The table size in bytes that the opcode needs (5.X.6.13.5) from a
/// member of a communicator of `n`; `None` for comm_create, whose list may
/// have any number of ranks (checked by [`create_list_ok`]).
pub fn table_size(o: CommOpcode, n: u32, is_root: bool) -> Option<u64> {
    let n = u64::from(n);
    match o {
        CommOpcode::Alltoallv => Some(16 * n),
        CommOpcode::Gatherv | CommOpcode::Scatterv if is_root => Some(8 * n),
        CommOpcode::CommCreate => None,
        _ => Some(0),
    }
}

/// 5.X.6.13.3: a comm_create table is `table_bytes / 4` distinct `le32`
/// ranks of the communicator (of `n` members), which contains the caller
/// (rank `me`). 5.X.6.13.6: a list that repeats a rank, names one outside
/// the communicator or leaves out the caller is `BAD_TABLE`, and so is a
/// table whose size is not what the opcode needs (not a whole number of
/// ranks).
pub fn create_list_ok(table: &[u8], n: u32, me: u32) -> bool {
    if !table.len().is_multiple_of(4) {
        return false;
    }
    let list: Vec<u32> = table
        .chunks(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let mut seen = std::collections::HashSet::new();
    list.iter().all(|&r| r < n && seen.insert(r)) && list.contains(&me)
}

/// Buffer sizes of a request of bits 2 or 3 or a comm_* request, in
/// elements, from the table of 5.X.6.13.2.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommElements {
    pub input: u64,
    pub output: u64,
    /// Where the in-place form applies (the flag set, on a gather's or a
    /// scatter's root): the offset and length of the member's own block
    /// in the one writable buffer; the chain then has no input segments.
    pub in_place: Option<(u64, u64)>,
}

/// The sizes 5.X.6.13.2 gives rank `r` of a communicator of `n` with
/// `root` and `count` `c`, its table of counts `t` (the right size, see
/// [`table_size`]), or the `BAD_REQUEST` detail: `OVERFLOW` when `c * n`
/// (5.X.6.7.2, with the communicator's size: 5.X.6.13.1) or a sum of the
/// table does not fit in 64 bits, `BAD_IN_PLACE_OPCODE` for the flag on an
/// opcode whose in-place form is "not allowed".
///
/// OVERFLOW comes before BAD_IN_PLACE_OPCODE (5.X.6.7.3, step 6 with bit
/// 1). `empty_not_in_place` models a known
/// deviation of the backend (D2 in [`crate::oracle`]): the flag on a
/// request with no buffers at all is taken as clear.
#[allow(clippy::too_many_arguments)] // the spec's table has this many inputs
pub fn elements(
    o: CommOpcode,
    n: u32,
    r: u32,
    root: u32,
    c: u64,
    t: &[u64],
    flag: bool,
    empty_not_in_place: bool,
) -> Result<CommElements, u32> {
    use CommOpcode::*;
    let nc = c.checked_mul(u64::from(n)).ok_or(bad::OVERFLOW)?;
    let sum = |t: &[u64]| {
        t.iter()
            .try_fold(0u64, |a, &x| a.checked_add(x))
            .ok_or(bad::OVERFLOW)
    };
    let is_root = r == root;
    // Out of place: (input, output) of the table's rows.
    let (input, output) = match o {
        Send => (c, 0),
        Recv => (0, c),
        Alltoall => (nc, nc),
        // send[N] then recv[N].
        Alltoallv => (sum(&t[..t.len() / 2])?, sum(&t[t.len() / 2..])?),
        Gather if is_root => (c, nc),
        Gatherv if is_root => (c, sum(t)?),
        Gather | Gatherv => (c, 0),
        Scatter if is_root => (nc, c),
        Scatterv if is_root => (sum(t)?, c),
        Scatter | Scatterv => (0, c),
        CommSplit | CommCreate | CommFree => (0, 0),
    };
    let plain = CommElements {
        input,
        output,
        in_place: None,
    };
    if !flag || (empty_not_in_place && input == 0 && output == 0) {
        return Ok(plain);
    }
    // Where the root's own block starts: block r of blocks of `c` (below
    // n * c, which fits), or after the counts of the ranks before it.
    let at = match o {
        Gather | Scatter => u64::from(r) * c,
        _ => sum(&t[..(r as usize).min(t.len())])?,
    };
    Ok(match o {
        Send | Recv | Alltoall | Alltoallv => return Err(BAD_IN_PLACE_OPCODE),
        // The root's one writable buffer is its output (gather) or its
        // input (scatter), its own block of `c` in it.
        Gather | Gatherv if is_root => CommElements {
            input: 0,
            output,
            in_place: Some((at, c)),
        },
        Scatter | Scatterv if is_root => CommElements {
            input: 0,
            output: input,
            in_place: Some((at, c)),
        },
        // Non-roots, and the opcodes without buffers: "the flag has no
        // effect".
        _ => plain,
    })
}

/// The element size a request's buffers use: its dtype's, or 1 when it
/// has none (the unit of `max_bytes` and of segment alignment then does
/// not matter: such requests have no buffers).
pub fn elem_size(dtype: Option<Dtype>) -> u64 {
    dtype.map_or(1, |d| d.size() as u64)
}

/// A communicator as the member that names it sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    pub id: u32,
    /// The member's rank in it.
    pub rank: u32,
    pub size: u32,
    /// Its members' group ranks in its rank order; `None` for
    /// communicator 0.
    pub members: Option<Vec<u32>>,
}

/// The communicators the device gave (a fake registry, chosen by the fuzz
/// input): ids other than 0 with their members' group ranks, in rank
/// order. The first entry with an id is the one that counts.
#[derive(Clone, Debug, Default)]
pub struct Comms {
    pub list: Vec<(u32, Vec<u32>)>,
}

impl Comms {
    /// 5.X.6.13.3: communicator `id` as group rank `me` may name it:
    /// communicator 0 is the whole group; any other must be one the device
    /// gave and `me` must belong to it, or the request is `BAD_COMM`.
    pub fn find(&self, id: u32, me: u32, world: u32) -> Option<Member> {
        if id == 0 {
            return Some(Member {
                id,
                rank: me,
                size: world,
                members: None,
            });
        }
        let (_, m) = self.list.iter().find(|(i, _)| *i == id)?;
        let rank = m.iter().position(|&w| w == me)?;
        Some(Member {
            id,
            rank: rank as u32,
            size: m.len() as u32,
            members: Some(m.clone()),
        })
    }

    /// The backend's lookup (`parse_in`'s `comms`) for communicators other
    /// than 0: what the device's registry answers for group rank `me`.
    pub fn view(&self, id: u32, me: u32) -> Option<CommView> {
        let (_, m) = self.list.iter().find(|(i, _)| *i == id)?;
        let rank = m.iter().position(|&w| w == me)?;
        Some(CommView {
            id,
            rank: rank as u32,
            size: m.len() as u32,
            members: Some(Arc::from(&m[..])),
        })
    }
}
