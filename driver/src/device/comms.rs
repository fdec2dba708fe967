//! Communicators, send and receive, all-to-all, gather and scatter (spec
//! 5.X.6.13, feature bits 1 to 3): the communicators this member belongs
//! to ([`Comms`], learnt from the device's answers), [`CommRequest`] and
//! its local check, [`Device::comm_call`], and the blocking conveniences on
//! [`DmaBuf`]s (queue 0).

use std::collections::HashMap;
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

    /// Sends `count` elements of `buf` to rank `peer` of communicator
    /// `comm`, matched by `tag`; returns once the receiver has them.
    pub fn send(
        &self,
        comm: u32,
        peer: u32,
        tag: u64,
        dtype: Dtype,
        buf: &DmaBuf,
        count: u64,
    ) -> Result<()> {
        let req = CommRequest {
            peer,
            tag,
            ..CommRequest::new(CommOpcode::Send, dtype, comm, count)
        };
        let input = take(buf, count, dtype, "send")?;
        self.comm_call(0, &req, &input, &[], None).map(drop)
    }

    /// Receives one message from rank `peer` (or [`ANY_SOURCE`]) of
    /// communicator `comm` with `tag` into `buf`, which has room for
    /// `count` elements.
    pub fn recv(
        &self,
        comm: u32,
        peer: u32,
        tag: u64,
        dtype: Dtype,
        buf: &DmaBuf,
        count: u64,
    ) -> Result<Received> {
        let req = CommRequest {
            peer,
            tag,
            ..CommRequest::new(CommOpcode::Recv, dtype, comm, count)
        };
        let output = take(buf, count, dtype, "receive")?;
        let r = self.comm_call(0, &req, &[], &output, None)?.reply;
        Ok(Received {
            length: r.length,
            peer: r.peer,
        })
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

/// The first `count` elements of `buf`, or an error naming `what`.
fn take(buf: &DmaBuf, count: u64, dtype: Dtype, what: &str) -> Result<Vec<BufSlice>> {
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
    Ok(if bytes == 0 {
        Vec::new()
    } else {
        vec![buf.slice(0, bytes)]
    })
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
