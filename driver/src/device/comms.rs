//! Communicators, send and receive, all-to-all, gather and scatter (spec
//! 5.X.6.13, feature bits 1 to 3): the communicators this member belongs
//! to ([`Comms`], learnt from the device's answers), [`CommRequest`] and
//! its local check, [`Device::comm_call`], and the blocking conveniences on
//! [`DmaBuf`]s (queue 0), whose send and receive cut a message over
//! `max_bytes` in pieces as spec 5.X.6.13.4 says ([`Device::message_pieces`]).

use std::collections::HashMap;
use std::ops::Range;
use std::time::Duration;

use virtio_dmlc::comm::{
    self, CommOpcode, VirtioDmlcReqComm, ANY_SOURCE, BAD_COMM, BAD_PEER, BAD_TABLE, UNDEFINED,
    VIRTIO_DMLC_F_COMM,
};
use virtio_dmlc::{bad, unsupported, Dtype, FLAG_IN_PLACE};

use crate::error::{Error, Result};

use super::check::Sizes;
use super::collectives::standard_chain;
use super::open::bit;
use super::queue::Header;
use super::{BufSlice, Device, DmaBuf, Done, Handle};

/// A communicator as this member knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommInfo {
    /// Its id (0: the whole group).
    pub id: u32,
    /// This member's rank in it.
    pub rank: u32,
    /// Its number of members.
    pub size: u32,
}

/// The communicators other than 0 this member belongs to.
pub(super) struct Comms {
    max: u32,
    known: HashMap<u32, CommInfo>,
}

impl Comms {
    pub(super) fn new(max: u32) -> Self {
        Comms {
            max,
            known: HashMap::new(),
        }
    }
}

/// A request of feature bits 1 to 3 (spec 5.X.6.13.2), in Rust types.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommRequest {
    pub opcode: CommOpcode,
    /// Used by send, receive and the block collectives.
    pub dtype: Dtype,
    /// The communicator (0: the whole group).
    pub comm: u32,
    /// Send: the destination; receive: the source or
    /// [`ANY_SOURCE`]; comm_split: the color or
    /// [`UNDEFINED`]; otherwise 0.
    pub peer: u32,
    /// comm_split: the key that orders the new communicator.
    pub key: u32,
    /// Root of gather and scatter (a rank of `comm`); 0 otherwise.
    pub root: u32,
    /// Elements: see the spec's table of buffer sizes.
    pub count: u64,
    pub tag: u64,
    pub in_place: bool,
    pub timeout_ms: u32,
    /// The table (5.X.6.13.5): counts as `le64`, or comm_create's ranks as
    /// `le32`.
    pub table: Vec<u8>,
}

impl CommRequest {
    /// A request on communicator `comm` with every other field 0 or empty.
    pub fn new(opcode: CommOpcode, dtype: Dtype, comm: u32, count: u64) -> Self {
        CommRequest {
            opcode,
            dtype,
            comm,
            peer: 0,
            key: 0,
            root: 0,
            count,
            tag: 0,
            in_place: false,
            timeout_ms: 0,
            table: Vec::new(),
        }
    }

    fn header(&self) -> VirtioDmlcReqComm {
        VirtioDmlcReqComm {
            base: virtio_dmlc::VirtioDmlcReq {
                opcode: self.opcode.raw().into(),
                dtype: self.dtype.raw(),
                op: 0,
                root: self.root.into(),
                count: self.count.into(),
                tag: self.tag.into(),
                flags: if self.in_place { FLAG_IN_PLACE } else { 0 }.into(),
                timeout_ms: self.timeout_ms.into(),
            },
            comm: self.comm.into(),
            peer: self.peer.into(),
            key: self.key.into(),
            table_bytes: (self.table.len() as u32).into(),
        }
    }
}

/// A table of `le64` counts.
pub fn counts_table(counts: &[u64]) -> Vec<u8> {
    counts.iter().flat_map(|c| c.to_le_bytes()).collect()
}

/// A received message: its size in bytes and its sender's rank in the
/// communicator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Received {
    pub length: u64,
    pub peer: u32,
}

impl Device {
    /// Most communicators alive at once, the group's own included, if the
    /// device and this driver use communicators (feature bit 1).
    pub fn max_comms(&self) -> Option<u32> {
        self.comms
            .as_ref()
            .map(|c| c.lock().unwrap_or_else(|e| e.into_inner()).max)
    }

    /// True if the device offers, and this device negotiated, feature `bit`
    /// of spec 5.X.6.13 (1: communicators, 2: send and receive, 3:
    /// all-to-all, gather and scatter).
    pub fn has_comm_feature(&self, b: u32) -> bool {
        self.comms.is_some() && self.features & bit(b) != 0
    }

    /// Communicator `id` as this member knows it (0: the group).
    pub fn comm_info(&self, id: u32) -> Result<CommInfo> {
        if id == comm::COMM_WORLD {
            return Ok(CommInfo {
                id,
                rank: self.rank(),
                size: self.world_size(),
            });
        }
        let known = self.comms.as_ref().and_then(|c| {
            c.lock()
                .unwrap_or_else(|e| e.into_inner())
                .known
                .get(&id)
                .copied()
        });
        known.ok_or_else(|| Error::bad_request(BAD_COMM))
    }

    /// Checks `req` and its buffers the way the device would (the local
    /// checks of spec 5.X.6.13 a driver-built chain can fail).
    pub fn check_comm(
        &self,
        req: &CommRequest,
        input: &[BufSlice],
        output: &[BufSlice],
    ) -> Result<()> {
        let c = &self.config;
        if !self.has_comm_feature(VIRTIO_DMLC_F_COMM)
            || !self.has_comm_feature(req.opcode.feature())
        {
            return Err(Error::Unsupported {
                detail: unsupported::OPCODE,
            });
        }
        let moves_data = !matches!(
            req.opcode,
            CommOpcode::CommSplit | CommOpcode::CommCreate | CommOpcode::CommFree
        );
        if moves_data && c.dtypes.get() & (1 << req.dtype.raw()) == 0 {
            return Err(Error::Unsupported {
                detail: unsupported::DTYPE,
            });
        }
        let info = self.comm_info(req.comm)?;
        if req.comm == comm::COMM_WORLD && req.opcode == CommOpcode::CommFree {
            return Err(Error::bad_request(BAD_COMM));
        }
        let rooted = matches!(
            req.opcode,
            CommOpcode::Gather | CommOpcode::Gatherv | CommOpcode::Scatter | CommOpcode::Scatterv
        );
        if (rooted && req.root >= info.size) || (!rooted && req.root != 0) {
            return Err(Error::bad_request(bad::ROOT));
        }
        if matches!(req.opcode, CommOpcode::Send | CommOpcode::Recv) {
            let any = req.opcode == CommOpcode::Recv && req.peer == ANY_SOURCE;
            if !any && (req.peer == info.rank || req.peer >= info.size) {
                return Err(Error::bad_request(BAD_PEER));
            }
        }
        let elems = if req.opcode == CommOpcode::CommCreate {
            let list = ranks_of(&req.table).ok_or_else(|| Error::bad_request(BAD_TABLE))?;
            comm::check_create_list(&list, info.size, info.rank).map_err(Error::bad_request)?;
            virtio_dmlc::BufferElems {
                input: 0,
                output: 0,
                in_place_input: None,
            }
        } else {
            if !req.table.len().is_multiple_of(8) {
                return Err(Error::bad_request(BAD_TABLE));
            }
            let table: Vec<u64> = comm::counts(&req.table).collect();
            comm::block_elems(
                req.opcode,
                info.size,
                info.rank,
                req.root,
                req.count,
                &table,
                req.in_place,
            )
            .map_err(Error::bad_request)?
        };
        let in_place = elems.in_place_input.is_some();
        self.check_sizes(&Sizes {
            elems,
            elem_size: if moves_data {
                req.dtype.size() as u64
            } else {
                1
            },
            no_data: !moves_data,
            count: req.count,
            in_place,
            input,
            output,
        })
    }

    /// Checks and posts one send, receive or block collective (not a
    /// request that makes or ends a communicator: [`Self::comm_call`]
    /// remembers those); returns at once. Several may be in flight on one
    /// queue, so a member can post a receive and a send and then wait for
    /// both ([`Self::wait`]).
    pub fn submit_comm(
        &self,
        queue: u16,
        req: &CommRequest,
        input: &[BufSlice],
        output: &[BufSlice],
    ) -> Result<Handle> {
        if matches!(
            req.opcode,
            CommOpcode::CommSplit | CommOpcode::CommCreate | CommOpcode::CommFree
        ) {
            return Err(Error::InvalidArgument(format!(
                "{} changes the communicators this member knows: post it with comm_call",
                req.opcode.name()
            )));
        }
        self.check_comm(req, input, output)?;
        let chain = standard_chain(input, output);
        self.post(
            queue,
            &Header::Comm(req.header(), &req.table),
            &chain,
            false,
            None,
        )
    }

    /// Checks, posts and waits for one request of feature bits 1 to 3;
    /// `timeout` bounds the wait. The communicators comm_split, comm_create
    /// and comm_free make or end are remembered (see [`Self::comm_info`]).
    pub fn comm_call(
        &self,
        queue: u16,
        req: &CommRequest,
        input: &[BufSlice],
        output: &[BufSlice],
        timeout: Option<Duration>,
    ) -> Result<Done> {
        self.check_comm(req, input, output)?;
        let chain = standard_chain(input, output);
        let header = Header::Comm(req.header(), &req.table);
        let done = self.call_chain(queue, &header, &chain, timeout)?;
        if let Some(comms) = &self.comms {
            let mut c = comms.lock().unwrap_or_else(|e| e.into_inner());
            let r = done.reply;
            match req.opcode {
                CommOpcode::CommSplit | CommOpcode::CommCreate if r.comm != 0 => {
                    c.known.insert(
                        r.comm,
                        CommInfo {
                            id: r.comm,
                            rank: r.comm_rank,
                            size: r.comm_size,
                        },
                    );
                }
                CommOpcode::CommFree => {
                    c.known.remove(&req.comm);
                }
                _ => {}
            }
        }
        Ok(done)
    }

    /// Bytes of one piece of a message of `dtype` larger than one request
    /// allows (spec 5.X.6.13.4): `P = max_bytes - max_bytes % element
    /// size`, at least one element.
    pub fn message_piece_bytes(&self, dtype: Dtype) -> usize {
        piece_bytes(self.config.max_bytes.get(), dtype.size())
    }

    /// Where a message (or a receive's room) of `bytes` bytes of `dtype`
    /// is cut (spec 5.X.6.13.4): the byte ranges of its pieces in order,
    /// each [`Self::message_piece_bytes`] long but the last, which is
    /// shorter; one empty range for an empty message. Each piece is one
    /// send or receive, with the message's tag, on one queue, in this
    /// order. [`Self::send`] and [`Self::recv`] cut here; a caller that
    /// stages pieces through its own memory (the C library) cuts here too,
    /// and ends a receive with [`Self::message_piece_done`].
    pub fn message_pieces(
        &self,
        dtype: Dtype,
        bytes: usize,
    ) -> impl ExactSizeIterator<Item = Range<usize>> + Clone {
        cut(self.message_piece_bytes(dtype), bytes)
    }

    /// Whether a receive of `room` bytes cut by [`Self::message_pieces`]
    /// is over after `piece`, one of its pieces, received `got` bytes from
    /// rank `from`: `Ok(true)` when the message is whole (the last piece
    /// filled, or the first one short: a message of one request, shorter
    /// than the room, as for any receive), `Ok(false)` when the next piece
    /// follows. A later piece that comes short means a message above
    /// `max_bytes` received with a room larger than its size, which spec
    /// 5.X.6.13.4 forbids (DRV-COMM-2): `Error::InvalidArgument` naming
    /// both sizes. (A room smaller than the message ends on a piece that
    /// completes with `TRUNCATE`, `Error::Truncated`.)
    pub fn message_piece_done(
        &self,
        dtype: Dtype,
        room: usize,
        piece: Range<usize>,
        got: u64,
        from: u32,
    ) -> Result<bool> {
        let got = usize::try_from(got).unwrap_or(usize::MAX).min(piece.len());
        if got == piece.len() {
            return Ok(piece.end >= room);
        }
        if piece.start == 0 {
            return Ok(true);
        }
        Err(Error::InvalidArgument(format!(
            "message of {} bytes from rank {from} into a receive of {room} bytes: a message \
             above max_bytes (sent in pieces of {} bytes) must be received with room equal to \
             its size (spec 5.X.6.13.4, DRV-COMM-2)",
            piece.start + got,
            self.message_piece_bytes(dtype)
        )))
    }

    /// Sends `count` elements of `buf` to rank `peer` of communicator
    /// `comm`, matched by `tag`; returns once the receiver has them. A
    /// message larger than `max_bytes` goes as several, cut by
    /// [`Self::message_pieces`], one after the other on queue 0 (spec
    /// 5.X.6.13.4): its receive must have room for exactly `count`
    /// elements (DRV-COMM-2). A receive smaller than the message fails the
    /// send with `Error::Truncated`, `length` the receive's whole room.
    pub fn send(
        &self,
        comm: u32,
        peer: u32,
        tag: u64,
        dtype: Dtype,
        buf: &DmaBuf,
        count: u64,
    ) -> Result<()> {
        let bytes = bytes_in(buf, count, dtype, "send")?;
        for piece in self.message_pieces(dtype, bytes) {
            let req = CommRequest {
                peer,
                tag,
                ..CommRequest::new(CommOpcode::Send, dtype, comm, elems(dtype, &piece))
            };
            let input = slice_of(buf, &piece);
            self.comm_call(0, &req, &input, &[], None)
                .map_err(|e| after(piece.start, e))?;
        }
        Ok(())
    }

    /// Receives one message from rank `peer` (or [`ANY_SOURCE`]) of
    /// communicator `comm` with `tag` into `buf`, which has room for
    /// `count` elements; the message may be shorter. A room larger than
    /// `max_bytes` is cut by [`Self::message_pieces`] into receives
    /// posted one after the other on queue 0, the later ones from the
    /// first one's sender (spec 5.X.6.13.4): the message must then be
    /// exactly `count` elements (DRV-COMM-2), unless it fits one piece.
    /// A larger message fails with `Error::Truncated` (`length` the
    /// message's size as far as known), a smaller one of several pieces
    /// with `Error::InvalidArgument` naming both sizes
    /// ([`Self::message_piece_done`]); one that ends exactly where a piece
    /// of the room ends leaves the next piece's receive waiting, until its
    /// timeout. `Received::length` is the whole message's.
    pub fn recv(
        &self,
        comm: u32,
        peer: u32,
        tag: u64,
        dtype: Dtype,
        buf: &DmaBuf,
        count: u64,
    ) -> Result<Received> {
        let room = bytes_in(buf, count, dtype, "receive")?;
        let mut from = peer;
        for piece in self.message_pieces(dtype, room) {
            let req = CommRequest {
                peer: from,
                tag,
                ..CommRequest::new(CommOpcode::Recv, dtype, comm, elems(dtype, &piece))
            };
            let output = slice_of(buf, &piece);
            let r = self
                .comm_call(0, &req, &[], &output, None)
                .map_err(|e| after(piece.start, e))?
                .reply;
            // The later pieces come from the sender of the first.
            from = r.peer;
            let length = piece.start as u64 + r.length.min(piece.len() as u64);
            if self.message_piece_done(dtype, room, piece, r.length, from)? {
                return Ok(Received { length, peer: from });
            }
        }
        unreachable!("the last piece of a receive ends it")
    }

    /// Splits communicator `comm` by `color` (`None`: join no new one) and
    /// `key`, collectively; returns this member's new communicator.
    pub fn comm_split(&self, comm: u32, color: Option<u32>, key: u32) -> Result<Option<CommInfo>> {
        let req = CommRequest {
            peer: color.unwrap_or(UNDEFINED),
            key,
            ..CommRequest::new(CommOpcode::CommSplit, Dtype::U8, comm, 0)
        };
        let r = self.comm_call(0, &req, &[], &[], None)?.reply;
        Ok((r.comm != 0).then_some(CommInfo {
            id: r.comm,
            rank: r.comm_rank,
            size: r.comm_size,
        }))
    }

    /// Makes a communicator of `ranks` (ranks of `comm`, in the new one's
    /// order), called by those ranks only; `tag` tells apart creations
    /// that run at once.
    pub fn comm_create(&self, comm: u32, ranks: &[u32], tag: u64) -> Result<CommInfo> {
        let req = CommRequest {
            tag,
            table: ranks.iter().flat_map(|r| r.to_le_bytes()).collect(),
            ..CommRequest::new(CommOpcode::CommCreate, Dtype::U8, comm, 0)
        };
        let r = self.comm_call(0, &req, &[], &[], None)?.reply;
        Ok(CommInfo {
            id: r.comm,
            rank: r.comm_rank,
            size: r.comm_size,
        })
    }

    /// Frees communicator `comm`, collectively.
    pub fn comm_free(&self, comm: u32) -> Result<()> {
        let req = CommRequest::new(CommOpcode::CommFree, Dtype::U8, comm, 0);
        self.comm_call(0, &req, &[], &[], None).map(drop)
    }

    /// Runs a block collective (all-to-all, gather, scatter and their `v`
    /// forms) on queue 0, taking the first bytes of each buffer that the
    /// request needs.
    pub fn run_blocks(
        &self,
        req: &CommRequest,
        input: Option<&DmaBuf>,
        output: Option<&DmaBuf>,
    ) -> Result<Done> {
        let info = self.comm_info(req.comm)?;
        let table: Vec<u64> = comm::counts(&req.table).collect();
        let elems = comm::block_elems(
            req.opcode,
            info.size,
            info.rank,
            req.root,
            req.count,
            &table,
            req.in_place,
        )
        .map_err(Error::bad_request)?;
        let slices = |buf: Option<&DmaBuf>, n: u64, what: &str| -> Result<Vec<BufSlice>> {
            match (n, buf) {
                (0, _) => Ok(Vec::new()),
                (n, Some(b)) => take(b, n, req.dtype, what),
                (_, None) => Err(Error::InvalidArgument(format!(
                    "{what} buffer missing, the request needs {n} elements"
                ))),
            }
        };
        let input = slices(input, elems.input, "input")?;
        let output = slices(output, elems.output, "output")?;
        self.comm_call(0, req, &input, &output, None)
    }
}

/// Bytes of one piece of a message cut at `max_bytes` (spec 5.X.6.13.4)
/// with elements of `elem` bytes: whole elements, at least one.
fn piece_bytes(max_bytes: u64, elem: usize) -> usize {
    let max = usize::try_from(max_bytes).unwrap_or(usize::MAX);
    (max - max % elem).max(elem)
}

/// The byte ranges of `bytes` cut in pieces of `piece` bytes, the last one
/// shorter; one empty range when `bytes` is 0.
fn cut(piece: usize, bytes: usize) -> impl ExactSizeIterator<Item = Range<usize>> + Clone {
    (0..bytes.div_ceil(piece).max(1)).map(move |k| {
        let start = k * piece;
        start..start.saturating_add(piece).min(bytes)
    })
}

/// The elements of `dtype` in the bytes of `piece`.
fn elems(dtype: Dtype, piece: &Range<usize>) -> u64 {
    (piece.len() / dtype.size()) as u64
}

/// `piece` of `buf` as a request's segments (none when empty).
fn slice_of(buf: &DmaBuf, piece: &Range<usize>) -> Vec<BufSlice> {
    if piece.is_empty() {
        Vec::new()
    } else {
        vec![buf.slice(piece.start, piece.len())]
    }
}

/// The error of a piece starting `start` bytes into its message: a
/// `TRUNCATE` names the other end's whole size as far as known (the
/// pieces before, and this one's).
fn after(start: usize, e: Error) -> Error {
    match e {
        Error::Truncated { length, peer } => Error::Truncated {
            length: start as u64 + length,
            peer,
        },
        e => e,
    }
}

/// The bytes of `count` elements of `dtype`, if `buf` holds them, or an
/// error naming `what`.
fn bytes_in(buf: &DmaBuf, count: u64, dtype: Dtype, what: &str) -> Result<usize> {
    let bytes = count
        .checked_mul(dtype.size() as u64)
        .and_then(|b| usize::try_from(b).ok())
        .ok_or_else(|| Error::bad_request(bad::OVERFLOW))?;
    if buf.len() < bytes {
        return Err(Error::InvalidArgument(format!(
            "{what} buffer has {} bytes, the request needs {bytes}",
            buf.len()
        )));
    }
    Ok(bytes)
}

/// The first `count` elements of `buf`, or an error naming `what`.
fn take(buf: &DmaBuf, count: u64, dtype: Dtype, what: &str) -> Result<Vec<BufSlice>> {
    Ok(slice_of(buf, &(0..bytes_in(buf, count, dtype, what)?)))
}

/// A comm_create table read as `le32` ranks.
fn ranks_of(table: &[u8]) -> Option<Vec<u32>> {
    table.len().is_multiple_of(4).then(|| {
        table
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::{cut, piece_bytes};

    #[test]
    fn messages_are_cut_in_whole_elements_of_max_bytes() {
        // P = max_bytes - max_bytes % element size, at least one element.
        assert_eq!(piece_bytes(4099, 1), 4099);
        assert_eq!(piece_bytes(4099, 2), 4098);
        assert_eq!(piece_bytes(4099, 4), 4096);
        assert_eq!(piece_bytes(4099, 8), 4096);
        assert_eq!(piece_bytes(3, 8), 8);
        assert_eq!(piece_bytes(u64::MAX, 4), usize::MAX - usize::MAX % 4);
        // (start, end) of each piece.
        let pieces = |p, n| cut(p, n).map(|r| (r.start, r.end)).collect::<Vec<_>>();
        assert_eq!(pieces(4096, 0), [(0, 0)]);
        assert_eq!(pieces(4096, 5), [(0, 5)]);
        assert_eq!(pieces(4096, 8192), [(0, 4096), (4096, 8192)]);
        assert_eq!(
            pieces(4096, 12_300),
            [(0, 4096), (4096, 8192), (8192, 12_288), (12_288, 12_300)]
        );
        assert_eq!(cut(4096, 12_300).len(), 4);
        assert_eq!(pieces(usize::MAX, 10), [(0, 10)]);
    }
}
