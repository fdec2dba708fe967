//! The queue engine, under each queue's lock: the header and response slot
//! of every request, the record of the requests in flight (`QueueState`,
//! `Queue`, `Posted`, `InFlight`), posting one chain (`post_locked`),
//! collecting completions from the used ring (`QueueState::harvest`) and
//! turning one into a result (`completion_result`); the public [`RawDesc`],
//! [`Handle`] and [`Done`]: a chain's elements, a posted request, a success.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use virtio_dmlc::comm::{VirtioDmlcReqComm, VirtioDmlcRespComm, RESP_COMM_SIZE};
use virtio_dmlc::{Status, VirtioDmlcReq, VirtioDmlcResp, RESP_SIZE};
use zerocopy::{FromBytes, IntoBytes};

use crate::dma::{DmaAlloc, DmaMemory};
use crate::error::{Error, Result};
use crate::virtqueue::{QueueError, Segment, SplitQueue, DESC_SIZE};

use super::buffer::Lease;
use super::BufSlice;

/// One element of a chain posted by [`Device::submit_raw`](super::Device::submit_raw).
#[derive(Clone, Debug)]
pub enum RawDesc {
    /// The request's header (device-readable): 32 bytes, or with feature
    /// bit 1 (spec 5.X.6.13.1) 48 bytes and the request's table.
    Header,
    /// The request's response slot (device-writable): 16 bytes, or 40
    /// with feature bit 1.
    Response,
    /// A device-readable buffer.
    Read(BufSlice),
    /// A device-writable buffer.
    Write(BufSlice),
}

/// A posted request, to pass to [`Device::wait`](super::Device::wait).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Handle {
    pub(super) queue: u16,
    pub(super) head: u16,
    pub(super) serial: u64,
}

impl Handle {
    /// The queue the request was posted on.
    pub fn queue(&self) -> u16 {
        self.queue
    }

    /// A collective the kernel driver knows by `id`.
    pub(crate) fn kernel(queue: u16, id: u64) -> Handle {
        Handle {
            queue,
            head: 0,
            serial: id,
        }
    }

    pub(crate) fn serial(&self) -> u64 {
        self.serial
    }
}

/// A successfully completed request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Done {
    /// Group generation in which the device completed it.
    pub generation: u32,
    /// Bytes the device wrote into the chain (outputs plus the response).
    pub written: u32,
    /// What a response of feature bit 1 adds (all 0 without it).
    pub reply: Reply,
}

/// The fields a response of feature bit 1 adds (spec 5.X.6.13.1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reply {
    /// Send and receive: the message's size in bytes.
    pub length: u64,
    /// comm_split and comm_create: the new communicator (0: none), this
    /// member's rank in it and its size.
    pub comm: u32,
    pub comm_rank: u32,
    pub comm_size: u32,
    /// A receive: the sender's rank in the communicator.
    pub peer: u32,
    /// `peer` as a rank of the group.
    pub peer_world: u32,
}

/// The header a chain starts with.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Header<'a> {
    /// 32 bytes (spec 5.X.6.1).
    Base(VirtioDmlcReq),
    /// With feature bit 1: 48 bytes and the table, in one descriptor.
    Comm(VirtioDmlcReqComm, &'a [u8]),
}

impl Header<'_> {
    /// The 32-byte part, which every layout starts with.
    pub(crate) fn base(&self) -> &VirtioDmlcReq {
        match self {
            Header::Base(h) => h,
            Header::Comm(h, _) => &h.base,
        }
    }
}

/// Per-request slot in device memory: header at 0 (32 or 48 bytes; a
/// header with a table gets its own allocation), response at 64 (16 or 40
/// bytes).
pub(super) const SLOT_SIZE: usize = 128;
const RESP_OFFSET: usize = 64;
/// Written into the response before posting; no device status has it.
const NO_STATUS: u32 = u32::MAX;
/// Longest single descriptor: a multiple of every element size.
const MAX_DESC_LEN: usize = 1 << 31;

/// Longest indirect descriptor table the device accepts (spec 5.X.6.2).
const MAX_INDIRECT: usize = 65535;

/// What a request was posted under: the group generation and group id the
/// driver knew. `confirmed` once a config read after posting showed them,
/// so that the request is known to have been made available in that
/// generation (a value cached before posting may be stale).
#[derive(Clone, Copy, Debug)]
pub(super) struct Posted {
    pub(super) generation: u32,
    pub(super) group: u64,
    pub(super) confirmed: bool,
}

pub(super) struct InFlight {
    pub(super) serial: u64,
    /// The request's holds on its buffers, released at completion.
    _leases: Vec<Lease>,
    /// The indirect descriptor table, if the chain needed one.
    _table: Option<DmaAlloc>,
    /// A header with a table, which does not fit the slot.
    _header: Option<DmaAlloc>,
    has_resp: bool,
    /// Its response has the layout of feature bit 1.
    comm_resp: bool,
    pub(super) posted: Posted,
    /// A wait for this request gives up at this moment, `after` (its
    /// timeout plus [`WAIT_MARGIN`]) after posting: nothing waits forever
    /// for a device that never answers.
    ///
    /// [`WAIT_MARGIN`]: super::WAIT_MARGIN
    pub(super) bound: Instant,
    pub(super) after: Duration,
}

/// What [`post_locked`] needs besides the queue.
pub(super) struct PostCtx<'a> {
    pub(super) mem: &'a Arc<dyn DmaMemory>,
    /// `VIRTIO_RING_F_INDIRECT_DESC` was negotiated.
    pub(super) indirect: bool,
    /// `VIRTIO_DMLC_F_COMM` was negotiated: 40-byte responses.
    pub(super) comm: bool,
    pub(super) posted: Posted,
    pub(super) after: Duration,
}

/// The in-flight record of `h`, if it is still in flight.
pub(super) fn in_flight_of(st: &mut QueueState, h: Handle) -> Option<&mut InFlight> {
    st.in_flight[usize::from(h.head)]
        .as_mut()
        .filter(|r| r.serial == h.serial)
}

pub(crate) struct Completion {
    pub(crate) len: u32,
    pub(crate) resp: VirtioDmlcResp,
    pub(crate) has_resp: bool,
    /// The rest of a response of feature bit 1.
    pub(crate) reply: Reply,
}

pub(super) struct QueueState {
    pub(super) vq: SplitQueue,
    /// One header+response slot per descriptor index (keyed by chain head).
    pub(super) slots: DmaAlloc,
    pub(super) in_flight: Vec<Option<InFlight>>,
    pub(super) done: HashMap<u64, Completion>,
    pub(super) next_serial: u64,
    /// A thread sleeps on the transport's interrupt for this queue (others
    /// may wait on the condvar for it).
    pub(super) sleeping: bool,
    /// Completions were collected while `sleeping`: condvar waiters may
    /// find theirs (see [`Queue::release`]).
    pub(super) wake: bool,
    pub(super) scratch: Vec<Segment>,
}

impl QueueState {
    fn slot_ptr(&self, head: u16, offset: usize) -> *mut u8 {
        let at = usize::from(head) * SLOT_SIZE + offset;
        debug_assert!(at < self.slots.len());
        // SAFETY: `head < queue size` and `slots` has SLOT_SIZE bytes per
        // descriptor, so the pointer stays inside the allocation.
        unsafe { self.slots.as_ptr().add(at) }
    }

    /// Moves every completed chain from the used ring into `done`.
    pub(super) fn harvest(&mut self) -> Result<()> {
        while let Some(used) = self.vq.pop_used()? {
            self.wake |= self.sleeping;
            let Some(req) = self.in_flight[usize::from(used.id)].take() else {
                return Err(Error::Queue(QueueError::BadUsedId {
                    id: u32::from(used.id),
                }));
            };
            let mut raw = [0u8; RESP_COMM_SIZE];
            // SAFETY: the response slot holds RESP_COMM_SIZE bytes (the
            // slot is SLOT_SIZE long); the device is done with it (the used
            // entry was published after its writes).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.slot_ptr(used.id, RESP_OFFSET),
                    raw.as_mut_ptr(),
                    RESP_COMM_SIZE,
                )
            };
            let resp = VirtioDmlcResp::read_from_bytes(&raw[..RESP_SIZE]).unwrap_or_default();
            let reply = if req.comm_resp {
                let r = VirtioDmlcRespComm::read_from_bytes(&raw).unwrap_or_default();
                Reply {
                    length: r.length.get(),
                    comm: r.comm.get(),
                    comm_rank: r.comm_rank.get(),
                    comm_size: r.comm_size.get(),
                    peer: r.base.peer.get(),
                    peer_world: r.peer_world.get(),
                }
            } else {
                Reply::default()
            };
            self.done.insert(
                req.serial,
                Completion {
                    len: used.len,
                    resp,
                    has_resp: req.has_resp,
                    reply,
                },
            );
        }
        Ok(())
    }
}

pub(super) struct Queue {
    pub(super) index: u16,
    pub(super) state: Mutex<QueueState>,
    pub(super) cond: Condvar,
}

impl Queue {
    pub(super) fn lock(&self) -> MutexGuard<'_, QueueState> {
        // Queue state is updated in single steps that cannot panic halfway,
        // so a poisoned lock still guards consistent state.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Unlocks, then wakes the condvar waiters if completions they may be
    /// waiting for were collected under this lock.
    pub(super) fn release(&self, mut st: MutexGuard<'_, QueueState>) {
        let wake = std::mem::take(&mut st.wake);
        drop(st);
        if wake {
            self.cond.notify_all();
        }
    }
}

/// Splits `len` bytes at `offset` of `alloc` into descriptors.
pub(super) fn for_each_piece(
    alloc: &DmaAlloc,
    offset: usize,
    len: usize,
    f: &mut dyn FnMut(u64, u32),
) {
    if len == 0 {
        // Zero-length data descriptors are legal; keep what the caller built.
        f(alloc.paddr() + offset as u64, 0);
        return;
    }
    alloc.device_ranges(offset, len, &mut |mut addr, mut n| {
        while n > 0 {
            let piece = n.min(MAX_DESC_LEN);
            f(addr, piece as u32);
            addr += piece as u64;
            n -= piece;
        }
    });
}

/// Posts one chain under the queue lock. Returns the handle and whether the
/// device wants a notification. A chain longer than the queue goes into an
/// indirect descriptor table (one ring descriptor) if the device accepts
/// those.
pub(super) fn post_locked(
    st: &mut QueueState,
    queue: u16,
    header: &Header<'_>,
    chain: &[RawDesc],
    keep: &mut Option<Vec<Lease>>,
    ctx: &PostCtx<'_>,
) -> Result<(Handle, bool)> {
    let mut needed = 0usize;
    for d in chain {
        match d {
            RawDesc::Header | RawDesc::Response => needed += 1,
            RawDesc::Read(s) | RawDesc::Write(s) => {
                for_each_piece(&s.mem.alloc, s.offset, s.len, &mut |_, _| needed += 1)
            }
        }
    }
    let size = usize::from(st.vq.size());
    let indirect = needed > size;
    if indirect && !ctx.indirect {
        return Err(Error::InvalidArgument(format!(
            "chain of {needed} descriptors is longer than the queue ({size}), and the device \
             does not offer indirect descriptors"
        )));
    }
    if indirect && needed > MAX_INDIRECT {
        return Err(Error::InvalidArgument(format!(
            "chain of {needed} descriptors is longer than an indirect table may be \
             ({MAX_INDIRECT})"
        )));
    }
    let ring_needed = if indirect { 1 } else { needed };
    if ring_needed > usize::from(st.vq.num_free()) {
        st.harvest()?;
        if ring_needed > usize::from(st.vq.num_free()) {
            return Err(Error::QueueFull);
        }
    }
    let table = if indirect {
        Some(DmaAlloc::new(ctx.mem, needed * DESC_SIZE, DESC_SIZE)?)
    } else {
        None
    };
    let head = st.vq.next_head();
    // A header with a table gets its own allocation: the slot has room for
    // the fixed part only.
    let (header_bytes, header_table): (&[u8], &[u8]) = match header {
        Header::Base(h) => (h.as_bytes(), &[]),
        Header::Comm(h, t) => (h.as_bytes(), t),
    };
    let header_len = header_bytes.len() + header_table.len();
    let own_header = if header_table.is_empty() {
        None
    } else {
        // Aligned to its own size (up to a page), so that it does not
        // cross a boundary where device memory stops being contiguous; a
        // larger one is checked.
        let align = header_len.next_power_of_two().clamp(DESC_SIZE, 4096);
        let a = DmaAlloc::new(ctx.mem, header_len, align)?;
        let mut pieces = 0;
        a.device_ranges(0, header_len, &mut |_, _| pieces += 1);
        if pieces != 1 {
            return Err(Error::InvalidArgument(format!(
                "a header with a table of {} bytes does not fit in contiguous device memory",
                header_table.len()
            )));
        }
        // SAFETY: the allocation is new, `header_len` bytes long, and the
        // device reads it only once the chain is published below.
        unsafe {
            std::ptr::copy_nonoverlapping(header_bytes.as_ptr(), a.as_ptr(), header_bytes.len());
            std::ptr::copy_nonoverlapping(
                header_table.as_ptr(),
                a.as_ptr().add(header_bytes.len()),
                header_table.len(),
            );
        }
        Some(a)
    };
    let resp_len = if ctx.comm { RESP_COMM_SIZE } else { RESP_SIZE };
    debug_assert!(header_bytes.len() <= RESP_OFFSET && RESP_OFFSET + resp_len <= SLOT_SIZE);
    debug_assert!(matches!(header, Header::Comm(..)) == ctx.comm);
    // SAFETY: the slot of a free head is ours: the device only reads it once
    // the chain is published below; header and response fit in it.
    unsafe {
        std::ptr::copy_nonoverlapping(
            header_bytes.as_ptr(),
            st.slot_ptr(head, 0),
            header_bytes.len(),
        );
        let resp = VirtioDmlcResp {
            status: NO_STATUS.into(),
            peer: virtio_dmlc::NO_PEER.into(),
            ..Default::default()
        };
        std::ptr::copy_nonoverlapping(
            resp.as_bytes().as_ptr(),
            st.slot_ptr(head, RESP_OFFSET),
            RESP_SIZE,
        );
    }
    let slot_addr = st.slots.paddr() + (usize::from(head) * SLOT_SIZE) as u64;
    let mut segs = std::mem::take(&mut st.scratch);
    segs.clear();
    let mut has_resp = false;
    for d in chain {
        match d {
            RawDesc::Header => segs.push(Segment {
                addr: own_header.as_ref().map_or(slot_addr, DmaAlloc::paddr),
                // Below SLOT_SIZE, or 48 plus a table of at most 16 bytes a
                // rank (checked by the caller).
                len: header_len as u32,
                writable: false,
            }),
            RawDesc::Response => {
                has_resp = true;
                segs.push(Segment {
                    addr: slot_addr + RESP_OFFSET as u64,
                    len: resp_len as u32,
                    writable: true,
                })
            }
            RawDesc::Read(s) | RawDesc::Write(s) => {
                let writable = matches!(d, RawDesc::Write(_));
                for_each_piece(&s.mem.alloc, s.offset, s.len, &mut |addr, len| {
                    segs.push(Segment {
                        addr,
                        len,
                        writable,
                    })
                });
            }
        }
    }
    let added = match &table {
        Some(t) => st.vq.add_indirect(t, &segs),
        None => st.vq.add(&segs),
    };
    st.scratch = segs;
    let got = added?;
    debug_assert_eq!(got, head);
    st.next_serial += 1;
    let serial = st.next_serial;
    st.in_flight[usize::from(head)] = Some(InFlight {
        serial,
        _leases: keep.take().unwrap_or_default(),
        _table: table,
        _header: own_header,
        has_resp,
        comm_resp: ctx.comm,
        posted: ctx.posted,
        bound: Instant::now() + ctx.after,
        after: ctx.after,
    });
    let notify = st.vq.needs_notify();
    Ok((
        Handle {
            queue,
            head,
            serial,
        },
        notify,
    ))
}

pub(crate) fn completion_result(c: &Completion) -> Result<Done> {
    if c.len == 0 || !c.has_resp {
        return Err(Error::NoStatus);
    }
    let r = &c.resp;
    let (detail, peer) = (r.detail.get(), r.peer.get());
    match Status::from_raw(r.status.get()) {
        Some(Status::Ok) => Ok(Done {
            generation: r.generation.get(),
            written: c.len,
            reply: c.reply,
        }),
        Some(Status::BadRequest) => Err(Error::bad_request(detail)),
        Some(Status::Mismatch) => Err(Error::mismatch(detail, peer)),
        Some(Status::PeerLost) => Err(Error::PeerLost { peer }),
        Some(Status::Timeout) => Err(Error::Timeout { peer }),
        Some(Status::Unsupported) => Err(Error::Unsupported { detail }),
        Some(Status::TooBig) => Err(Error::TooBig { detail }),
        Some(Status::Reset) => Err(Error::Reset),
        Some(Status::Truncate) => Err(Error::Truncated {
            length: c.reply.length,
            peer,
        }),
        Some(Status::NonFinite) => Err(Error::NonFinite {
            rank: peer,
            index: c.reply.length,
        }),
        None => Err(Error::UnknownStatus {
            status: r.status.get(),
        }),
    }
}
