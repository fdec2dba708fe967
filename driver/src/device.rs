//! The collective API: one [`Device`] per member, requests posted as
//! descriptor chains `[header (R)] [inputs (R)*] [outputs (W)*] [response (W)]`.
//!
//! Buffers live in device-visible memory ([`DmaBuf`]) so the device reads and
//! writes them in place (zero copy); the `*_slice` conveniences copy through a
//! bounce buffer instead. [`Device::submit`] checks a request against the
//! buffer rules (`virtio_dmlc::buffer_elems`) and the device's limits before
//! posting, so obvious mistakes fail locally with the same error the device
//! would give; [`Device::submit_raw`] posts any chain unchecked, to exercise
//! the device's own checks.
//!
//! Concurrency: every queue has its own lock; `Device` is `Send + Sync`.
//! [`Device::submit`] never blocks: on a full queue it returns
//! [`Error::QueueFull`]. The blocking conveniences wait for room instead.
//! Every handle must be passed to [`Device::wait`] once; until then its
//! result is kept (a few bytes), its buffers are released at completion.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use virtio_dmlc::{
    bad, too_big, unsupported, BufferElems, Status, VirtioDmlcConfig, VirtioDmlcReq,
    VirtioDmlcResp, CONFIG_SIZE, FLAG_IN_PLACE, REQ_HEADER_SIZE, RESP_SIZE,
    VIRTIO_DMLC_F_REQ_TIMEOUT, VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX,
    VIRTIO_RING_F_INDIRECT_DESC,
};
pub use virtio_dmlc::{Dtype, Opcode, ReduceOp};
use zerocopy::{FromBytes, IntoBytes};

use crate::bounce::Bounce;
use crate::dma::{DmaAlloc, DmaMemory, DMA_ALIGN};
use crate::error::{Error, Result};
use crate::kernel::KernelFile;
use crate::transport::Transport;
use crate::virtqueue::{QueueError, Segment, SplitQueue, DESC_SIZE, MAX_QUEUE_SIZE};

/// How to open a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenOptions {
    /// Busy-poll the used ring (true), or sleep until the device signals a
    /// completion (false, the default, after the spin of `spin_cap`).
    pub poll: bool,
    /// Descriptors per queue (a power of two; default 256).
    pub queue_size: u16,
    /// Negotiate `VIRTIO_F_EVENT_IDX` if offered (default true).
    pub event_idx: bool,
    /// Device-visible memory to set aside for buffers and rings (default 256 MiB).
    pub dma_bytes: usize,
    /// Set up at most this many queues; 0 (the default) = all the device has.
    pub max_queues: u16,
    /// With `poll` false: busy-poll for a while before sleeping (the hybrid
    /// wait), at most this long: the whole bound while most recent waits
    /// ended within it, a twentieth of it while most did not. Zero: sleep
    /// at once. The default, [`HYBRID_SPIN_CAP`], makes the hybrid wait the
    /// default wait; on a transport that cannot sleep on an interrupt
    /// ([`Transport::can_sleep`]) the hybrid wait polls.
    pub spin_cap: Duration,
    /// How long past a request's own timeout a wait gives up on an
    /// unanswered request ([`WAIT_MARGIN`] by default; tests of that bound
    /// shorten it).
    pub wait_margin: Duration,
}

/// The hybrid wait's bound that `--hybrid` (and `DMLC_POLL=hybrid`) use:
/// several times a TCG round trip (about 30 us), and little next to a wait
/// for a late peer (milliseconds).
pub const HYBRID_SPIN_CAP: Duration = Duration::from_micros(200);

/// All of the recent waits, in the hybrid wait's share of waits that ended
/// within its bound (fixed point).
const HIT_ONE: u64 = 1 << 10;

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            poll: false,
            queue_size: 256,
            event_idx: true,
            dma_bytes: 256 << 20,
            max_queues: 0,
            spin_cap: HYBRID_SPIN_CAP,
            wait_margin: WAIT_MARGIN,
        }
    }
}

/// How a wait for a completion spends its time, as the CLI, the C ABI and
/// `DMLC_POLL` name it; [`OpenOptions::wait`] sets `poll` and `spin_cap`
/// for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    /// Busy-poll the used ring.
    Poll,
    /// Sleep on the interrupt at once.
    Interrupt,
    /// Spin up to [`HYBRID_SPIN_CAP`], then sleep (the default).
    Hybrid,
}

impl OpenOptions {
    /// These options with `wait`'s way of waiting.
    pub fn wait(self, wait: Wait) -> OpenOptions {
        let (poll, spin_cap) = match wait {
            Wait::Poll => (true, Duration::ZERO),
            Wait::Interrupt => (false, Duration::ZERO),
            Wait::Hybrid => (false, HYBRID_SPIN_CAP),
        };
        OpenOptions {
            poll,
            spin_cap,
            ..self
        }
    }

    /// The way of waiting these options ask for.
    pub fn wait_kind(&self) -> Wait {
        match (self.poll, self.spin_cap.is_zero()) {
            (true, _) => Wait::Poll,
            (false, true) => Wait::Interrupt,
            (false, false) => Wait::Hybrid,
        }
    }
}

/// One collective request (the header fields, in Rust types).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    pub opcode: Opcode,
    pub dtype: Dtype,
    /// Used by allreduce, reduce and reduce-scatter; ignored otherwise.
    pub op: ReduceOp,
    /// Root of broadcast and reduce; 0 otherwise.
    pub root: u32,
    /// Elements per member block (see `Opcode` for buffer sizes).
    pub count: u64,
    /// Caller's tag; must be equal on every member.
    pub tag: u64,
    /// No input segments; the output holds this member's input.
    pub in_place: bool,
    /// Collective timeout in ms, 0 = device default (honoured if the device
    /// offers `VIRTIO_DMLC_F_REQ_TIMEOUT`).
    pub timeout_ms: u32,
}

impl Request {
    /// A request with root 0, tag 0, out of place, default timeout.
    pub fn new(opcode: Opcode, dtype: Dtype, op: ReduceOp, count: u64) -> Self {
        Request {
            opcode,
            dtype,
            op,
            root: 0,
            count,
            tag: 0,
            in_place: false,
            timeout_ms: 0,
        }
    }

    /// The wire header.
    pub fn header(&self) -> VirtioDmlcReq {
        VirtioDmlcReq {
            opcode: self.opcode.raw().into(),
            dtype: self.dtype.raw(),
            op: self.op.raw(),
            root: self.root.into(),
            count: self.count.into(),
            tag: self.tag.into(),
            flags: if self.in_place { FLAG_IN_PLACE } else { 0 }.into(),
            timeout_ms: self.timeout_ms.into(),
        }
    }
}

mod sealed {
    pub trait Sealed {}
}

/// Element types of the device; `DTYPE` is the wire dtype.
pub trait Element: Copy + Send + Sync + 'static + sealed::Sealed {
    const DTYPE: Dtype;
}

macro_rules! elements {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t { const DTYPE: Dtype = Dtype::$d; }
    )*};
}

elements! {
    f32 => F32, f64 => F64, half::f16 => F16, half::bf16 => Bf16, i8 => I8, u8 => U8,
    i32 => I32, u32 => U32, i64 => I64, u64 => U64,
}

fn bytes_of<T: Element>(data: &[T]) -> &[u8] {
    // SAFETY: every `Element` is a plain number type without padding, so its
    // bytes may be read as `u8`; the length is the slice's size in bytes.
    unsafe { std::slice::from_raw_parts(data.as_ptr().cast(), std::mem::size_of_val(data)) }
}

fn bytes_of_mut<T: Element>(data: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `bytes_of`; moreover every bit pattern is a valid value
    // of every `Element` type, so writing arbitrary bytes is sound.
    unsafe { std::slice::from_raw_parts_mut(data.as_mut_ptr().cast(), std::mem::size_of_val(data)) }
}

/// The memory of one [`DmaBuf`], shared with its [`BufSlice`]s and with the
/// requests in flight that use it, and the record of who may touch it.
struct BufMem {
    alloc: DmaAlloc,
    /// Bit 0 [`LENT_MUT`], bit 1 [`LENT_SHARED`], bits 2..32 the number of
    /// requests in flight that only read the buffer, bits 32..64 the number
    /// that write it.
    state: AtomicU64,
}

/// A `&mut` borrow handed out by [`DmaBuf::as_mut_slice`] may be alive.
const LENT_MUT: u64 = 1;
/// A `&` borrow handed out by [`DmaBuf::as_slice`] may be alive.
const LENT_SHARED: u64 = 2;
const READER: u64 = 1 << 2;
const READERS: u64 = ((1 << 30) - 1) << 2;
const WRITER: u64 = 1 << 32;

impl BufMem {
    fn readers(state: u64) -> u64 {
        (state & READERS) >> 2
    }

    fn writers(state: u64) -> u64 {
        state >> 32
    }

    /// Applies `f` to the state atomically; `f` refuses with a reason.
    fn update(&self, f: impl Fn(u64) -> std::result::Result<u64, &'static str>) -> Result<()> {
        let mut cur = self.state.load(Ordering::Acquire);
        loop {
            let new = f(cur).map_err(|reason| Error::BufferBusy { reason })?;
            match self
                .state
                .compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Ok(()),
                Err(now) => cur = now,
            }
        }
    }

    /// Before a shared CPU borrow: no request may be writing the buffer.
    /// The borrow cannot be tracked past the reference, so the buffer stays
    /// closed to device writes until `&mut` access shows it has ended.
    fn lend_shared(&self) -> Result<()> {
        self.update(|s| {
            if Self::writers(s) > 0 {
                return Err(
                    "the buffer is in flight: a posted request may be writing it; \
                            wait for the request before reading the buffer",
                );
            }
            Ok((s & !LENT_MUT) | LENT_SHARED)
        })
    }

    /// Before an exclusive CPU borrow (the caller holds `&mut DmaBuf`, so no
    /// shared borrow is alive): no request may be using the buffer at all.
    fn lend_mut(&self) -> Result<()> {
        self.update(|s| {
            if Self::writers(s) + Self::readers(s) > 0 {
                return Err(
                    "the buffer is in flight: a posted request may be reading or \
                            writing it; wait for the request before writing the buffer",
                );
            }
            Ok((s & !LENT_SHARED) | LENT_MUT)
        })
    }

    /// Forgets the CPU borrows that `proof` shows have ended.
    fn end_lent(&self, bits: u64) {
        self.state.fetch_and(!bits, Ordering::AcqRel);
    }

    /// Takes the buffer for a request: refused while a CPU borrow that would
    /// conflict may be alive.
    fn lease(self: &Arc<Self>, write: bool) -> Result<Lease> {
        self.update(|s| {
            if s & LENT_MUT != 0 {
                return Err(
                    "the buffer may still be borrowed through DmaBuf::as_mut_slice; \
                            use the DmaBuf (slice(), all()) to build the request",
                );
            }
            if write && s & LENT_SHARED != 0 {
                return Err("the buffer may still be borrowed through DmaBuf::as_slice \
                            or as_elems, and the device would write it; take it back with \
                            &mut access (DmaBuf::reclaim or as_mut_slice) first");
            }
            if write {
                s.checked_add(WRITER)
                    .ok_or("too many requests on one buffer")
            } else if Self::readers(s) < READERS >> 2 {
                Ok(s + READER)
            } else {
                Err("too many requests on one buffer")
            }
        })?;
        Ok(Lease {
            mem: Arc::clone(self),
            write,
        })
    }
}

/// A request's hold on one buffer, from posting until its completion has
/// been taken from the used ring (or the device is gone).
pub(crate) struct Lease {
    mem: Arc<BufMem>,
    write: bool,
}

impl Drop for Lease {
    fn drop(&mut self) {
        let unit = if self.write { WRITER } else { READER };
        self.mem.state.fetch_sub(unit, Ordering::AcqRel);
    }
}

/// A buffer in device-visible memory. The device reads and writes it in
/// place; the memory itself stays valid until every request using it has
/// completed, even if the `DmaBuf` is dropped.
///
/// # Access while requests are in flight
///
/// The device writes a buffer behind the compiler's back, so a Rust
/// reference into it must never be alive while the device may write (or,
/// for `&mut`, read) it. The buffer keeps count of the requests in flight
/// that use it (taken when a request is posted, given back when its
/// completion is taken from the used ring), and of the CPU borrows it
/// handed out:
///
/// - [`Self::as_slice`] and [`Self::as_elems`] panic while a request in
///   flight may write the buffer; [`Self::as_mut_slice`] and
///   [`Self::as_elems_mut`] while any request in flight uses it. The
///   `try_` variants return [`Error::BufferBusy`] instead.
/// - A reference carries no trace of when it ends, so a borrow counts as
///   possibly alive until the borrow checker proves it over: an exclusive
///   borrow until the `DmaBuf` is used again through `&self` (for example
///   [`Self::slice`] or [`Self::all`], which every way of posting it goes
///   through), a shared one until it is used through `&mut self`
///   ([`Self::reclaim`], [`Self::as_mut_slice`]) or dropped. Posting a
///   request that would write a buffer whose shared borrow may be alive, or
///   use one whose exclusive borrow may be alive (a [`BufSlice`] made
///   earlier and posted from another thread), fails with
///   [`Error::BufferBusy`].
///
/// Why counts checked at run time rather than borrows tied to a request's
/// lifetime: [`BufSlice`] and [`Handle`] are plain values that callers keep
/// in collections, send to other threads and hand through the C ABI;
/// lifetimes on them would change the type of every caller. The cost is one
/// atomic operation per buffer per request, and the rule that a buffer
/// read through `&self` must be taken back with `&mut` access before the
/// device may write it again.
///
/// Several requests in flight on disjoint parts of one buffer are fine;
/// the buffer is then in flight as a whole, so use separate buffers for
/// requests whose results are read while others still run.
pub struct DmaBuf {
    mem: Arc<BufMem>,
    len: usize,
}

impl DmaBuf {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True if the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// True while a posted request uses the buffer (until its completion
    /// has been taken from the used ring).
    pub fn is_in_flight(&self) -> bool {
        let s = self.mem.state.load(Ordering::Acquire);
        BufMem::readers(s) + BufMem::writers(s) > 0
    }

    /// The bytes.
    ///
    /// # Panics
    ///
    /// While a request in flight may write the buffer (see the type's
    /// documentation); [`Self::try_as_slice`] returns an error instead.
    pub fn as_slice(&self) -> &[u8] {
        self.try_as_slice()
            .unwrap_or_else(|e| panic!("DmaBuf::as_slice: {e}"))
    }

    /// The bytes, or [`Error::BufferBusy`] while a request in flight may
    /// write them.
    pub fn try_as_slice(&self) -> Result<&[u8]> {
        self.mem.lend_shared()?;
        // SAFETY: the allocation holds at least `len` initialised (zeroed at
        // allocation) bytes and lives as long as `self.mem`. No request in
        // flight writes them, and none can be posted to write them while
        // the borrow may be alive (`LENT_SHARED` refuses the lease until
        // `&mut self` access or drop proves the borrow over).
        Ok(unsafe { std::slice::from_raw_parts(self.mem.alloc.as_ptr(), self.len) })
    }

    /// The bytes, writable.
    ///
    /// # Panics
    ///
    /// While a request in flight uses the buffer; [`Self::try_as_mut_slice`]
    /// returns an error instead.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.try_as_mut_slice()
            .unwrap_or_else(|e| panic!("DmaBuf::as_mut_slice: {e}"))
    }

    /// The bytes, writable, or [`Error::BufferBusy`] while a request in
    /// flight uses them.
    pub fn try_as_mut_slice(&mut self) -> Result<&mut [u8]> {
        self.mem.lend_mut()?;
        // SAFETY: as in `try_as_slice`; no request in flight uses the
        // bytes, `&mut self` excludes other borrows made through this
        // handle, and `LENT_MUT` refuses leases (a `BufSlice` made earlier)
        // until the handle is used again through `&self`.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.mem.alloc.as_ptr(), self.len) })
    }

    /// The buffer as elements (`len / size_of::<T>()` of them; the start is
    /// 64-byte aligned). Panics as [`Self::as_slice`] does.
    pub fn as_elems<T: Element>(&self) -> &[T] {
        let bytes = self.as_slice();
        let n = bytes.len() / std::mem::size_of::<T>();
        // SAFETY: the start is DMA_ALIGN-aligned (enough for any Element),
        // `n` elements fit in the borrowed bytes, every bit pattern is valid,
        // and the borrow keeps the guarantees of `as_slice`.
        unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast(), n) }
    }

    /// The buffer as writable elements. Panics as [`Self::as_mut_slice`] does.
    pub fn as_elems_mut<T: Element>(&mut self) -> &mut [T] {
        let bytes = self.as_mut_slice();
        let n = bytes.len() / std::mem::size_of::<T>();
        // SAFETY: as in `as_elems`, with the exclusive borrow of
        // `as_mut_slice`.
        unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast(), n) }
    }

    /// Declares, by `&mut self`, that no borrow made by [`Self::as_slice`]
    /// or [`Self::as_mut_slice`] is alive any more, so that requests may
    /// write the buffer again. Needed only for a buffer that was read
    /// through `&self` and is posted next without being written first.
    pub fn reclaim(&mut self) {
        self.mem.end_lent(LENT_MUT | LENT_SHARED);
    }

    /// `len` bytes at `offset`, for building requests.
    ///
    /// # Panics
    ///
    /// If the range is not inside the buffer.
    pub fn slice(&self, offset: usize, len: usize) -> BufSlice {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len),
            "slice {offset}+{len} out of a buffer of {} bytes",
            self.len
        );
        // `&self` here proves that no `&mut` borrow of `as_mut_slice` is alive.
        self.mem.end_lent(LENT_MUT);
        BufSlice {
            mem: Arc::clone(&self.mem),
            offset,
            len,
        }
    }

    /// The whole buffer as a slice.
    pub fn all(&self) -> BufSlice {
        self.slice(0, self.len)
    }

    /// Device address of the first byte (for diagnostics).
    pub fn device_addr(&self) -> u64 {
        self.mem.alloc.paddr()
    }

    /// Host address of the first byte, for handing the buffer to code that
    /// accesses it through raw pointers (the C ABI), which then keeps the
    /// rules of the type's documentation itself.
    pub fn as_ptr(&self) -> *mut u8 {
        self.mem.alloc.as_ptr()
    }
}

impl Drop for DmaBuf {
    fn drop(&mut self) {
        // No borrow of this handle outlives it; slices of it may be posted.
        self.mem.end_lent(LENT_MUT | LENT_SHARED);
    }
}

impl fmt::Debug for DmaBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DmaBuf")
            .field("addr", &format_args!("{:#x}", self.mem.alloc.paddr()))
            .field("len", &self.len)
            .finish()
    }
}

/// A byte range of a [`DmaBuf`]: one or more descriptors of a chain. It
/// keeps the memory alive.
#[derive(Clone)]
pub struct BufSlice {
    mem: Arc<BufMem>,
    offset: usize,
    len: usize,
}

impl BufSlice {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True if the range is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device-contiguous pieces of this slice (device address, length).
    pub(crate) fn device_ranges(&self, f: &mut dyn FnMut(u64, usize)) {
        self.mem.alloc.device_ranges(self.offset, self.len, f);
    }

    /// Offset in the buffer.
    pub fn offset(&self) -> usize {
        self.offset
    }
}

impl fmt::Debug for BufSlice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BufSlice")
            .field("addr", &format_args!("{:#x}", self.mem.alloc.paddr()))
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

/// One element of a chain posted by [`Device::submit_raw`].
#[derive(Clone, Debug)]
pub enum RawDesc {
    /// The request's header slot (32 bytes, device-readable).
    Header,
    /// The request's response slot (16 bytes, device-writable).
    Response,
    /// A device-readable buffer.
    Read(BufSlice),
    /// A device-writable buffer.
    Write(BufSlice),
}

/// A posted request, to pass to [`Device::wait`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Handle {
    queue: u16,
    head: u16,
    serial: u64,
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
}

/// Per-request slot in device memory: header at 0, response at 32.
const SLOT_SIZE: usize = 64;
const RESP_OFFSET: usize = 32;
/// Written into the response before posting; no device status has it.
const NO_STATUS: u32 = u32::MAX;
/// Longest single descriptor: a multiple of every element size.
const MAX_DESC_LEN: usize = 1 << 31;
/// How often a polling waiter checks that the device is still there.
const ALIVE_CHECK: Duration = Duration::from_millis(10);
/// A wait that has lasted this long starts watching the config space for a
/// changed generation or group id ...
const WATCH_AFTER: Duration = Duration::from_millis(1);
/// ... and looks again after this long, then after twice as long each time
/// up to [`WATCH_EVERY_MAX`]. A look is a config read: a GET_CONFIG round
/// trip to the backend on both transports (on PCI, through QEMU), which in
/// a TCG guest costs the vCPU a few hundred microseconds. With a look
/// every 5 ms, a TCG rank sleeping on interrupts for a peer 50 ms late was
/// on its vCPU 10.4% of the wait, with the back-off 7.8% (medians,
/// docs/benchmarks.md). A restarted backend (the one thing the look finds)
/// is rare, and is still found within this bound.
const WATCH_EVERY: Duration = Duration::from_millis(5);
/// The longest time between two looks at the config space in one wait.
const WATCH_EVERY_MAX: Duration = Duration::from_millis(80);
/// The longest collective timeout the driver assumes for a request that
/// leaves it to the device's default (`timeout_ms == 0`, or the timeout
/// feature not negotiated): the default is a device setting the driver
/// cannot read.
pub const ASSUMED_DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);
/// Added to a request's timeout to bound every wait for it: a collective
/// whose members all arrived runs to completion, moving its data, after the
/// timeout no longer applies.
pub const WAIT_MARGIN: Duration = Duration::from_secs(60);
/// Longest indirect descriptor table the device accepts (spec 5.X.6.2).
const MAX_INDIRECT: usize = 65535;
/// Offset of `generation` (followed by `group_id`) in the config space.
const GENERATION_OFFSET: usize = std::mem::offset_of!(VirtioDmlcConfig, generation);

/// What a request was posted under: the group generation and group id the
/// driver knew. `confirmed` once a config read after posting showed them,
/// so that the request is known to have been made available in that
/// generation (a value cached before posting may be stale).
#[derive(Clone, Copy, Debug)]
struct Posted {
    generation: u32,
    group: u64,
    confirmed: bool,
}

struct InFlight {
    serial: u64,
    /// The request's holds on its buffers, released at completion.
    _leases: Vec<Lease>,
    /// The indirect descriptor table, if the chain needed one.
    _table: Option<DmaAlloc>,
    has_resp: bool,
    posted: Posted,
    /// A wait for this request gives up at this moment, `after` (its
    /// timeout plus [`WAIT_MARGIN`]) after posting: nothing waits forever
    /// for a device that never answers.
    bound: Instant,
    after: Duration,
}

/// A look at the device a long wait takes now and then (see `wait_until`).
type WatchFn<'a> = &'a mut dyn FnMut(&Queue) -> Result<()>;

/// What [`post_locked`] needs besides the queue.
struct PostCtx<'a> {
    mem: &'a Arc<dyn DmaMemory>,
    /// `VIRTIO_RING_F_INDIRECT_DESC` was negotiated.
    indirect: bool,
    posted: Posted,
    after: Duration,
}

/// The in-flight record of `h`, if it is still in flight.
fn in_flight_of(st: &mut QueueState, h: Handle) -> Option<&mut InFlight> {
    st.in_flight[usize::from(h.head)]
        .as_mut()
        .filter(|r| r.serial == h.serial)
}

pub(crate) struct Completion {
    pub(crate) len: u32,
    pub(crate) resp: VirtioDmlcResp,
    pub(crate) has_resp: bool,
}

struct QueueState {
    vq: SplitQueue,
    /// One header+response slot per descriptor index (keyed by chain head).
    slots: DmaAlloc,
    in_flight: Vec<Option<InFlight>>,
    done: HashMap<u64, Completion>,
    next_serial: u64,
    /// A thread sleeps on the transport's interrupt for this queue (others
    /// may wait on the condvar for it).
    sleeping: bool,
    /// Completions were collected while `sleeping`: condvar waiters may
    /// find theirs (see [`Queue::release`]).
    wake: bool,
    scratch: Vec<Segment>,
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
    fn harvest(&mut self) -> Result<()> {
        while let Some(used) = self.vq.pop_used()? {
            self.wake |= self.sleeping;
            let Some(req) = self.in_flight[usize::from(used.id)].take() else {
                return Err(Error::Queue(QueueError::BadUsedId {
                    id: u32::from(used.id),
                }));
            };
            let mut raw = [0u8; RESP_SIZE];
            // SAFETY: the response slot holds RESP_SIZE bytes; the device is
            // done with it (the used entry was published after its writes).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.slot_ptr(used.id, RESP_OFFSET),
                    raw.as_mut_ptr(),
                    RESP_SIZE,
                )
            };
            let resp = VirtioDmlcResp::read_from_bytes(&raw).unwrap_or_default();
            self.done.insert(
                req.serial,
                Completion {
                    len: used.len,
                    resp,
                    has_resp: req.has_resp,
                },
            );
        }
        Ok(())
    }
}

struct Queue {
    index: u16,
    state: Mutex<QueueState>,
    cond: Condvar,
}

impl Queue {
    fn lock(&self) -> MutexGuard<'_, QueueState> {
        // Queue state is updated in single steps that cannot panic halfway,
        // so a poisoned lock still guards consistent state.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Unlocks, then wakes the condvar waiters if completions they may be
    /// waiting for were collected under this lock.
    fn release(&self, mut st: MutexGuard<'_, QueueState>) {
        let wake = std::mem::take(&mut st.wake);
        drop(st);
        if wake {
            self.cond.notify_all();
        }
    }
}

/// One member's handle on the device.
pub struct Device {
    // Declared first so it is dropped first: the device stops using the
    // rings before their memory is freed.
    transport: Box<dyn Transport>,
    queues: Box<[Queue]>,
    mem: Arc<dyn DmaMemory>,
    config: VirtioDmlcConfig,
    features: u64,
    poll: bool,
    /// The hybrid wait's bound (zero: none) and the share of recent waits
    /// that ended within it, in [`HIT_ONE`]ths.
    spin_cap: Duration,
    spin_hits: AtomicU64,
    /// The slice conveniences' bounce buffer, made at first use.
    bounce: Mutex<Option<Bounce>>,
    /// Generation and group id as last read from the config space.
    known_generation: AtomicU32,
    known_group: AtomicU64,
    /// [`WAIT_MARGIN`], shorter in tests.
    wait_margin: Duration,
    /// Opened over the kernel driver (`crate::kernel`): it owns the queues,
    /// and `queues` is empty.
    kernel: Option<KernelFile>,
}

fn bit(b: u32) -> u64 {
    1u64 << b
}

fn uses_op(opcode: Opcode) -> bool {
    matches!(
        opcode,
        Opcode::Allreduce | Opcode::Reduce | Opcode::ReduceScatter
    )
}

fn has_root(opcode: Opcode) -> bool {
    matches!(opcode, Opcode::Broadcast | Opcode::Reduce)
}

fn same_memory(a: &Arc<dyn DmaMemory>, b: &Arc<dyn DmaMemory>) -> bool {
    std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(b))
}

impl Device {
    /// Opens a device over any transport whose device sees `mem`.
    pub fn open(
        mut transport: Box<dyn Transport>,
        mem: Arc<dyn DmaMemory>,
        opts: &OpenOptions,
    ) -> Result<Device> {
        let size = opts.queue_size;
        if size == 0 || !size.is_power_of_two() || size > MAX_QUEUE_SIZE {
            return Err(Error::InvalidArgument(format!(
                "queue size {size} is not a power of two up to {MAX_QUEUE_SIZE}"
            )));
        }
        let mut want = bit(VIRTIO_F_VERSION_1)
            | bit(VIRTIO_DMLC_F_REQ_TIMEOUT)
            | bit(VIRTIO_RING_F_INDIRECT_DESC);
        if opts.event_idx {
            want |= bit(VIRTIO_RING_F_EVENT_IDX);
        }
        let features = transport.device_features() & want;
        transport.negotiate(features)?;
        let config = read_config(&*transport)?;
        let (rank, world) = (config.rank.get(), config.world_size.get());
        if world == 0 || rank >= world {
            return Err(Error::BadConfig(format!(
                "rank {rank} of a group of {world}"
            )));
        }
        let mut nq = u32::from(transport.max_queues()).min(config.num_queues.get());
        if opts.max_queues > 0 {
            nq = nq.min(u32::from(opts.max_queues));
        }
        if nq == 0 {
            return Err(Error::BadConfig("no request queues".into()));
        }
        let event_idx = features & bit(VIRTIO_RING_F_EVENT_IDX) != 0;
        let (poll, spin_cap) = if opts.poll {
            (true, Duration::ZERO)
        } else if !opts.spin_cap.is_zero() && !transport.can_sleep() {
            log::info!("the transport has no interrupt to sleep on: the hybrid wait polls instead");
            (true, Duration::ZERO)
        } else {
            (false, opts.spin_cap)
        };
        let mut queues = Vec::new();
        for index in 0..nq as u16 {
            let size = size.min(transport.max_queue_size(index));
            let mut vq = SplitQueue::new(&mem, size, event_idx)?;
            // Off while polling, and while the hybrid wait spins (it arms
            // them only to sleep).
            vq.set_interrupts(!poll && spin_cap.is_zero());
            let slots = DmaAlloc::new(&mem, usize::from(size) * SLOT_SIZE, DMA_ALIGN)?;
            transport.setup_queue(index, &vq.addrs())?;
            queues.push(Queue {
                index,
                state: Mutex::new(QueueState {
                    vq,
                    slots,
                    in_flight: (0..size).map(|_| None).collect(),
                    done: HashMap::new(),
                    next_serial: 0,
                    sleeping: false,
                    wake: false,
                    scratch: Vec::new(),
                }),
                cond: Condvar::new(),
            });
        }
        transport.driver_ok()?;
        Ok(Device {
            transport,
            queues: queues.into_boxed_slice(),
            mem,
            config,
            features,
            poll,
            spin_cap,
            spin_hits: AtomicU64::new(HIT_ONE),
            bounce: Mutex::new(None),
            known_generation: AtomicU32::new(config.generation.get()),
            known_group: AtomicU64::new(config.group_id.get()),
            wait_margin: opts.wait_margin,
            kernel: None,
        })
    }

    /// A device whose queues the kernel driver owns (`crate::kernel::open`).
    pub(crate) fn over_kernel(
        transport: Box<dyn Transport>,
        mem: Arc<dyn DmaMemory>,
        config: VirtioDmlcConfig,
        kernel: KernelFile,
        opts: &OpenOptions,
    ) -> Result<Device> {
        let (rank, world) = (config.rank.get(), config.world_size.get());
        if world == 0 || rank >= world {
            return Err(Error::BadConfig(format!(
                "rank {rank} of a group of {world}"
            )));
        }
        Ok(Device {
            features: transport.device_features(),
            transport,
            queues: Box::new([]),
            mem,
            config,
            poll: opts.poll,
            spin_cap: if opts.poll {
                Duration::ZERO
            } else {
                opts.spin_cap
            },
            spin_hits: AtomicU64::new(HIT_ONE),
            bounce: Mutex::new(None),
            known_generation: AtomicU32::new(config.generation.get()),
            known_group: AtomicU64::new(config.group_id.get()),
            wait_margin: opts.wait_margin,
            kernel: Some(kernel),
        })
    }

    /// This member's rank.
    pub fn rank(&self) -> u32 {
        self.config.rank.get()
    }

    /// Number of members.
    pub fn world_size(&self) -> u32 {
        self.config.world_size.get()
    }

    /// Number of queues set up (at most what the device offers).
    pub fn num_queues(&self) -> u16 {
        match &self.kernel {
            Some(k) => k.num_queues(),
            None => self.queues.len() as u16,
        }
    }

    /// Descriptors per queue (0 over the kernel driver: its own rings).
    pub fn queue_size(&self) -> u16 {
        match self.queues.first() {
            Some(q) => q.lock().vq.size(),
            None => 0,
        }
    }

    /// True if the device was opened over the kernel driver.
    pub fn is_kernel(&self) -> bool {
        self.kernel.is_some()
    }

    /// Negotiated feature bits.
    pub fn features(&self) -> u64 {
        self.features
    }

    /// True in poll mode.
    pub fn is_polling(&self) -> bool {
        self.poll
    }

    /// The device-visible memory buffers come from.
    pub fn dma_memory(&self) -> &Arc<dyn DmaMemory> {
        &self.mem
    }

    /// The config space, read afresh (the generation changes). If the read
    /// fails, logs why and returns the config read at open;
    /// [`Self::try_config`] reports the failure instead.
    pub fn config(&self) -> VirtioDmlcConfig {
        self.try_config().unwrap_or_else(|e| {
            log::warn!("reading the device config failed: {e}");
            self.config
        })
    }

    /// The config space, read afresh.
    pub fn try_config(&self) -> Result<VirtioDmlcConfig> {
        let c = read_config(&*self.transport)?;
        self.note_group(c.generation.get(), c.group_id.get());
        Ok(c)
    }

    /// Reads `generation` and `group_id` (one config read of 12 bytes).
    fn read_group(&self) -> Result<(u32, u64)> {
        let mut raw = [0u8; 12];
        self.transport.read_config(GENERATION_OFFSET, &mut raw)?;
        let generation = u32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]);
        let mut group = [0u8; 8];
        group.copy_from_slice(&raw[4..]);
        let group = u64::from_le_bytes(group);
        self.note_group(generation, group);
        Ok((generation, group))
    }

    fn note_group(&self, generation: u32, group: u64) {
        self.known_generation.store(generation, Ordering::Relaxed);
        self.known_group.store(group, Ordering::Relaxed);
    }

    /// Allocates a zeroed buffer of `bytes` in device-visible memory.
    pub fn alloc(&self, bytes: usize) -> Result<DmaBuf> {
        let alloc = DmaAlloc::new(&self.mem, bytes, DMA_ALIGN)?;
        Ok(DmaBuf {
            mem: Arc::new(BufMem {
                alloc,
                state: AtomicU64::new(0),
            }),
            len: bytes,
        })
    }

    /// The caller's `len` bytes at `ptr` as a buffer, without a copy. Only
    /// over the kernel transport, whose module pins the caller's pages for
    /// each request (docs/kernel-driver.md); over the others the device sees
    /// only its own memory, so [`Self::alloc`] and copy.
    ///
    /// # Safety
    ///
    /// `ptr` is valid for reads and writes of `len` bytes until the buffer
    /// is dropped and every request that used it has completed. Nothing
    /// else accesses those bytes while a request in flight writes them, and
    /// nothing writes them while a borrow the buffer handed out
    /// ([`DmaBuf::as_slice`], [`DmaBuf::as_mut_slice`]) may be alive.
    pub unsafe fn wrap_caller_memory(&self, ptr: *mut u8, len: usize) -> Result<DmaBuf> {
        let Some(k) = &self.kernel else {
            return Err(Error::InvalidArgument(
                "only the kernel transport reaches the caller's own memory; allocate device \
                 memory and copy"
                    .into(),
            ));
        };
        let Some(ptr) = std::ptr::NonNull::new(ptr) else {
            return Err(Error::InvalidArgument("buffer at NULL".into()));
        };
        if len == 0 {
            return Err(Error::InvalidArgument("buffer of 0 bytes".into()));
        }
        // SAFETY: `k.caller` is a `CallerMemory`, which allocates nothing;
        // the rest is this function's own contract.
        let alloc = unsafe { DmaAlloc::borrowed(&k.caller, ptr, len) };
        Ok(DmaBuf {
            mem: Arc::new(BufMem {
                alloc,
                state: AtomicU64::new(0),
            }),
            len,
        })
    }

    fn queue(&self, queue: u16) -> Result<&Queue> {
        self.queues.get(usize::from(queue)).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "queue {queue} does not exist (device has {})",
                self.queues.len()
            ))
        })
    }

    /// Checks `req` and its buffers the way the device would, without
    /// posting anything: the checks of spec 5.X.6.7.3 that a driver-built
    /// chain can fail, in the same order and with the same codes, so a
    /// request refused here gets the status and detail the device would
    /// give. Segments are counted (`max_segments`) and checked for element
    /// alignment as descriptors, after the buffers are split where device
    /// memory is not contiguous (at hugepage boundaries on PCI): a buffer
    /// that spans such a boundary is two segments.
    pub fn check(&self, req: &Request, input: &[BufSlice], output: &[BufSlice]) -> Result<()> {
        let c = &self.config;
        let unsupported = |detail| Err(Error::Unsupported { detail });
        // Step 3: known and supported opcode, dtype, op.
        if c.opcodes.get() & (1 << req.opcode.raw()) == 0 {
            return unsupported(unsupported::OPCODE);
        }
        let no_data = !req.opcode.moves_data();
        if !no_data && c.dtypes.get() & (1 << req.dtype.raw()) == 0 {
            return unsupported(unsupported::DTYPE);
        }
        if uses_op(req.opcode) {
            if c.ops.get() & (1 << req.op.raw()) == 0 {
                return unsupported(unsupported::OP);
            }
            // Step 4: op valid for dtype.
            if !req.op.supports(req.dtype) {
                return unsupported(unsupported::OP_FOR_DTYPE);
            }
        }
        // Step 5: flags (a `Request` cannot set reserved ones) and root.
        let world = c.world_size.get();
        let root_ok = if has_root(req.opcode) {
            req.root < world
        } else {
            req.root == 0
        };
        if !root_ok {
            return Err(Error::bad_request(bad::ROOT));
        }
        // Step 6: size arithmetic.
        let overflow = || Error::bad_request(bad::OVERFLOW);
        let elems = virtio_dmlc::buffer_elems(
            req.opcode,
            world,
            c.rank.get(),
            req.root,
            req.count,
            req.in_place,
        )
        .ok_or_else(overflow)?;
        let size = if no_data { 1 } else { req.dtype.size() as u64 };
        let in_bytes = elems.input.checked_mul(size).ok_or_else(overflow)?;
        let out_bytes = elems.output.checked_mul(size).ok_or_else(overflow)?;
        // Step 7: limits, bytes from the header, then segments as the
        // device will see them.
        let max = c.max_bytes.get();
        if in_bytes > max || out_bytes > max {
            return Err(Error::TooBig {
                detail: too_big::BYTES,
            });
        }
        let mut segments = 0u64;
        let mut misaligned = false;
        for s in input.iter().chain(output) {
            for_each_piece(&s.mem.alloc, s.offset, s.len, &mut |_, len| {
                if len != 0 {
                    segments += 1;
                    misaligned |= !u64::from(len).is_multiple_of(size);
                }
            });
        }
        if segments > u64::from(c.max_segments.get()) {
            return Err(Error::TooBig {
                detail: too_big::SEGMENTS,
            });
        }
        // Step 8: lengths.
        if no_data && (req.count != 0 || segments != 0) {
            return Err(Error::bad_request(bad::BARRIER_DATA));
        }
        let total = |s: &[BufSlice]| s.iter().map(|s| s.len as u64).sum::<u64>();
        if req.in_place && total(input) != 0 {
            return Err(Error::bad_request(bad::IN_PLACE_INPUT));
        }
        if misaligned {
            return Err(Error::bad_request(bad::SEGMENT_ALIGN));
        }
        if total(input) != in_bytes {
            return Err(Error::bad_request(bad::INPUT_LENGTH));
        }
        if total(output) != out_bytes {
            return Err(Error::bad_request(bad::OUTPUT_LENGTH));
        }
        Ok(())
    }

    /// Element counts this member must supply for `req`.
    pub fn buffer_elems(&self, req: &Request) -> Result<BufferElems> {
        virtio_dmlc::buffer_elems(
            req.opcode,
            self.world_size(),
            self.rank(),
            req.root,
            req.count,
            req.in_place,
        )
        .ok_or_else(|| Error::bad_request(bad::OVERFLOW))
    }

    /// Posts a request after [`Self::check`]ing it; returns at once.
    /// Fails with [`Error::QueueFull`] if the queue has no room now.
    pub fn submit(
        &self,
        queue: u16,
        req: &Request,
        input: &[BufSlice],
        output: &[BufSlice],
    ) -> Result<Handle> {
        self.check(req, input, output)?;
        let chain = standard_chain(input, output);
        self.post(queue, &req.header(), &chain, false, None)
    }

    /// Posts `chain` with `header` in the header slot, unchecked; returns
    /// at once. For exercising the device's checks.
    pub fn submit_raw(
        &self,
        queue: u16,
        header: &VirtioDmlcReq,
        chain: &[RawDesc],
    ) -> Result<Handle> {
        if self.kernel.is_some() {
            return Err(Error::InvalidArgument(
                "submit_raw needs the pci or host transport: the kernel driver builds every \
                 chain itself"
                    .into(),
            ));
        }
        self.post(queue, header, chain, false, None)
    }

    /// Posts, waiting for room if the queue is full, then waits for the
    /// result. `timeout` bounds both.
    pub fn call(
        &self,
        queue: u16,
        req: &Request,
        input: &[BufSlice],
        output: &[BufSlice],
        timeout: Option<Duration>,
    ) -> Result<Done> {
        self.check(req, input, output)?;
        let deadline = timeout.map(|t| Instant::now() + t);
        let chain = standard_chain(input, output);
        if let Some(k) = &self.kernel {
            // One system call: submit and wait, within the wait's bound.
            let header = req.header();
            let bound = Instant::now() + self.wait_bound(&header);
            let limit = deadline.map_or(bound, |d| d.min(bound));
            let leases = self.leases(&chain)?;
            let (_, done) = k.submit(queue, &header, &chain, leases, Some(Some(limit)))?;
            return match done.expect("a waiting submit reports its outcome") {
                Err(Error::WaitTimeout) if deadline.is_none_or(|d| d > bound) => {
                    Err(Error::Unanswered {
                        after: self.wait_bound(&header),
                    })
                }
                r => r,
            };
        }
        let h = self.post(queue, &req.header(), &chain, true, deadline)?;
        self.wait_deadline(h, deadline)
    }

    /// One lease per buffer of `chain`, a writing one if any descriptor
    /// writes it.
    fn leases(&self, chain: &[RawDesc]) -> Result<Vec<Lease>> {
        let mut uses: Vec<(&Arc<BufMem>, bool)> = Vec::new();
        for d in chain {
            if let RawDesc::Read(s) | RawDesc::Write(s) = d {
                let m = s.mem.alloc.memory();
                let caller = self
                    .kernel
                    .as_ref()
                    .is_some_and(|k| same_memory(m, &k.caller));
                if !same_memory(m, &self.mem) && !caller {
                    return Err(Error::InvalidArgument(
                        "buffer from another device's memory".into(),
                    ));
                }
                let write = matches!(d, RawDesc::Write(_));
                match uses.iter_mut().find(|(m, _)| Arc::ptr_eq(m, &s.mem)) {
                    Some((_, w)) => *w |= write,
                    None => uses.push((&s.mem, write)),
                }
            }
        }
        uses.into_iter()
            .map(|(m, write)| m.lease(write))
            .collect::<Result<Vec<_>>>()
    }

    /// The effective timeout of a request with this header, as far as the
    /// driver can know it, plus [`WAIT_MARGIN`].
    fn wait_bound(&self, header: &VirtioDmlcReq) -> Duration {
        let ms = header.timeout_ms.get();
        let timeout = if ms != 0 && self.features & bit(VIRTIO_DMLC_F_REQ_TIMEOUT) != 0 {
            Duration::from_millis(u64::from(ms))
        } else {
            ASSUMED_DEFAULT_TIMEOUT
        };
        timeout + self.wait_margin
    }

    fn post(
        &self,
        queue: u16,
        header: &VirtioDmlcReq,
        chain: &[RawDesc],
        block: bool,
        deadline: Option<Instant>,
    ) -> Result<Handle> {
        if let Some(k) = &self.kernel {
            let leases = self.leases(chain)?;
            return Ok(k.submit(queue, header, chain, leases, None)?.0);
        }
        let q = self.queue(queue)?;
        let leases = self.leases(chain)?;
        let mut keep = Some(leases);
        let after = self.wait_bound(header);
        let ctx = PostCtx {
            mem: &self.mem,
            indirect: self.features & bit(VIRTIO_RING_F_INDIRECT_DESC) != 0,
            posted: Posted {
                generation: self.known_generation.load(Ordering::Relaxed),
                group: self.known_group.load(Ordering::Relaxed),
                confirmed: false,
            },
            after,
        };
        let (handle, notify) = if block {
            // Room appears when a request completes; if none of those in
            // flight completes within its own bound, the device is stuck.
            let mut room_bound: Option<(Instant, Duration)> = None;
            self.wait_until(
                q,
                deadline,
                &mut |st: &mut QueueState| match post_locked(
                    st, q.index, header, chain, &mut keep, &ctx,
                ) {
                    Err(Error::QueueFull) => {
                        let (until, after) = *room_bound.get_or_insert_with(|| {
                            st.in_flight
                                .iter()
                                .flatten()
                                .map(|r| (r.bound, r.after))
                                .max()
                                .unwrap_or((Instant::now() + after, after))
                        });
                        if Instant::now() >= until {
                            return Err(Error::Unanswered { after });
                        }
                        Ok(None)
                    }
                    r => r.map(Some),
                },
                None,
            )?
        } else {
            let mut st = q.lock();
            let posted = post_locked(&mut st, q.index, header, chain, &mut keep, &ctx);
            q.release(st);
            posted?
        };
        if notify {
            self.transport.notify(q.index)?;
        }
        Ok(handle)
    }

    /// Waits for a posted request. `None`: no limit of the caller's; the
    /// wait still ends, with [`Error::Unanswered`], once the request's own
    /// timeout plus [`WAIT_MARGIN`] has passed (the device's default timeout
    /// counts as [`ASSUMED_DEFAULT_TIMEOUT`]), and with
    /// [`Error::RequestDropped`] when the device's group id changes while
    /// the request stays in flight.
    pub fn wait(&self, h: Handle, timeout: Option<Duration>) -> Result<Done> {
        self.wait_deadline(h, timeout.map(|t| Instant::now() + t))
    }

    fn wait_deadline(&self, h: Handle, deadline: Option<Instant>) -> Result<Done> {
        if let Some(k) = &self.kernel {
            // The module keeps no per-request bound: the longest a request
            // can take is its timeout (at most the assumed default) plus
            // the margin, counted from now as the request's posting time
            // is the module's.
            let bound = Instant::now() + ASSUMED_DEFAULT_TIMEOUT + self.wait_margin;
            return match k.wait(h, Some(deadline.map_or(bound, |d| d.min(bound)))) {
                Err(Error::WaitTimeout) if deadline.is_none_or(|d| d > bound) => {
                    Err(Error::Unanswered {
                        after: ASSUMED_DEFAULT_TIMEOUT + self.wait_margin,
                    })
                }
                r => r,
            };
        }
        let q = self.queue(h.queue)?;
        let bound = {
            let st = q.lock();
            match &st.in_flight[usize::from(h.head)] {
                Some(r) if r.serial == h.serial => Some((r.bound, r.after)),
                _ => None, // completed already, or unknown: `ready` tells
            }
        };
        let (limit, unanswered) = match (deadline, bound) {
            (Some(d), Some((b, after))) if b < d => (Some(b), Some(after)),
            (None, Some((b, after))) => (Some(b), Some(after)),
            (d, _) => (d, None),
        };
        let mut watch = |q: &Queue| self.watch(q, h);
        let c = self.wait_until(
            q,
            limit,
            &mut |st: &mut QueueState| {
                if let Some(c) = st.done.remove(&h.serial) {
                    return Ok(Some(c));
                }
                match &st.in_flight[usize::from(h.head)] {
                    Some(r) if r.serial == h.serial => Ok(None),
                    _ => Err(Error::UnknownHandle),
                }
            },
            Some(&mut watch),
        );
        match (c, unanswered) {
            (Err(Error::WaitTimeout), Some(after)) => Err(Error::Unanswered { after }),
            (c, _) => completion_result(&c?),
        }
    }

    /// One look at the config space for a waiter of `h` (spec 5.X.7.4): if
    /// the group id differs from the one the request was posted under, the
    /// device implementation restarted; a request still in flight after
    /// draining the ring once more was dropped and will never complete.
    fn watch(&self, q: &Queue, h: Handle) -> Result<()> {
        let (generation, group) = self.read_group()?;
        let mut st = q.lock();
        let mut verdict = Ok(());
        // Only a new group id: a new generation alone either failed the
        // request (it is in the used ring) or came before the device took
        // it (it completes by matching or by timeout). A member that was
        // itself lost learns it from its transport (device reset, DRIVER_OK
        // cleared, connection closed).
        let changed = match in_flight_of(&mut st, h) {
            Some(r) if r.posted.group == group => {
                r.posted.confirmed = true;
                false
            }
            Some(_) => true,
            None => false,
        };
        if changed {
            verdict = st.harvest();
            if verdict.is_ok() {
                if let Some(r) = in_flight_of(&mut st, h) {
                    let was = r.posted;
                    if was.confirmed {
                        verdict = Err(Error::RequestDropped {
                            generation: (was.generation, generation),
                            group: (was.group, group),
                        });
                    } else {
                        // What the driver knew at posting may have been stale
                        // (the change may predate the request): from now on
                        // the request is known to be in this generation.
                        r.posted = Posted {
                            generation,
                            group,
                            confirmed: true,
                        };
                    }
                }
            }
        }
        q.release(st);
        verdict
    }

    /// True if the request has completed (its result waits in [`Self::wait`]).
    pub fn is_done(&self, h: Handle) -> Result<bool> {
        if let Some(k) = &self.kernel {
            return k.is_done(h);
        }
        let q = self.queue(h.queue)?;
        let mut st = q.lock();
        st.harvest()?;
        let done = st.done.contains_key(&h.serial);
        q.release(st);
        Ok(done)
    }

    /// Runs `ready` under the queue lock, after collecting completions, until
    /// it returns `Some`. Poll mode spins; interrupt mode lets one thread
    /// sleep on the transport while the others wait for it on a condvar.
    /// `watch`, if given, runs without the lock once the wait has lasted
    /// [`WATCH_AFTER`], then after [`WATCH_EVERY`], backing off to
    /// [`WATCH_EVERY_MAX`]; its error ends the wait.
    fn wait_until<R>(
        &self,
        q: &Queue,
        deadline: Option<Instant>,
        ready: &mut dyn FnMut(&mut QueueState) -> Result<Option<R>>,
        mut watch: Option<WatchFn<'_>>,
    ) -> Result<R> {
        let started = Instant::now();
        let mut last_check = started;
        let mut next_watch = started + WATCH_AFTER;
        let mut watch_every = WATCH_EVERY;
        let mut spins = 0u32;
        let hybrid = !self.spin_cap.is_zero();
        let spin_until = started + self.spin_budget();
        loop {
            let mut st = q.lock();
            st.harvest()?;
            if let Some(r) = ready(&mut st)? {
                q.release(st);
                if hybrid {
                    self.learn_wait(started.elapsed());
                }
                return Ok(r);
            }
            let now = Instant::now();
            let mut remaining = match deadline {
                Some(d) if now >= d => {
                    q.release(st);
                    return Err(Error::WaitTimeout);
                }
                Some(d) => Some(d - now),
                None => None,
            };
            if now.duration_since(last_check) >= ALIVE_CHECK {
                last_check = now;
                if let Err(e) = self.transport.check_alive() {
                    q.release(st);
                    return self.last_look(q, ready, e.into());
                }
            }
            if let Some(w) = watch.as_mut() {
                if now >= next_watch {
                    q.release(st);
                    if let Err(e) = w(q) {
                        return self.last_look(q, ready, e);
                    }
                    next_watch = Instant::now() + watch_every;
                    watch_every = (watch_every * 2).min(WATCH_EVERY_MAX);
                    continue;
                }
                // Sleep no longer than until the next look.
                let until = next_watch - now;
                remaining = Some(remaining.map_or(until, |r| r.min(until)));
            }
            if self.poll || (hybrid && now < spin_until) {
                // Interrupts stay off while spinning (the hybrid wait arms
                // them only to sleep, and takes them off again after).
                q.release(st);
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(128) {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            } else if st.sleeping {
                // Another thread sleeps on the interrupt and will wake us
                // when it has collected completions.
                if std::mem::take(&mut st.wake) {
                    q.cond.notify_all();
                }
                let limit = remaining.map_or(ALIVE_CHECK, |r| r.min(ALIVE_CHECK));
                drop(q.cond.wait_timeout(st, limit));
            } else {
                st.sleeping = true;
                let pending = st.vq.arm_interrupt();
                q.release(st);
                let woke = if pending {
                    Ok(true)
                } else {
                    self.transport.wait_interrupt(q.index, remaining)
                };
                {
                    let mut st = q.lock();
                    st.sleeping = false;
                    if hybrid {
                        st.vq.set_interrupts(false);
                    }
                }
                q.cond.notify_all();
                if let Err(e) = woke {
                    return self.last_look(q, ready, e.into());
                }
            }
        }
    }

    /// The wait ends with `err` (the device is gone, or the request was
    /// dropped) unless the used ring already holds the answer: a device
    /// that completed the request and then went away (an orderly stop
    /// resets the group, then closes) answered it.
    fn last_look<R>(
        &self,
        q: &Queue,
        ready: &mut dyn FnMut(&mut QueueState) -> Result<Option<R>>,
        err: Error,
    ) -> Result<R> {
        let mut st = q.lock();
        let found = st.harvest().and_then(|()| ready(&mut st));
        q.release(st);
        match found {
            Ok(Some(r)) => Ok(r),
            _ => Err(err),
        }
    }

    /// How long the hybrid wait spins before it sleeps: the whole bound
    /// while most recent waits ended within it (spinning then saves the
    /// interrupt on nearly every wait, the slow tail of a TCG round trip
    /// included), a twentieth of it while most did not (a late peer: the
    /// wait sleeps nearly at once); zero without the hybrid wait.
    fn spin_budget(&self) -> Duration {
        if self.spin_hits.load(Ordering::Relaxed) >= HIT_ONE / 2 {
            self.spin_cap
        } else {
            self.spin_cap / 20
        }
    }

    /// Folds one wait into the share of waits that ended within the bound:
    /// an average that weighs the last eight waits most.
    fn learn_wait(&self, took: Duration) {
        let hit = if took <= self.spin_cap { HIT_ONE } else { 0 };
        let old = self.spin_hits.load(Ordering::Relaxed);
        self.spin_hits.store((old * 7 + hit) / 8, Ordering::Relaxed);
    }

    // Blocking conveniences on DmaBufs (queue 0). Each takes the first
    // bytes of each buffer that the request needs.

    /// Runs one collective on queue 0 and waits for it.
    pub fn run(
        &self,
        req: &Request,
        input: Option<&DmaBuf>,
        output: Option<&DmaBuf>,
    ) -> Result<Done> {
        let elems = self.buffer_elems(req)?;
        let size = if !req.opcode.moves_data() {
            1
        } else {
            req.dtype.size() as u64
        };
        let take = |buf: Option<&DmaBuf>, n: u64, what: &str| -> Result<Vec<BufSlice>> {
            if n == 0 {
                return Ok(Vec::new());
            }
            let bytes = n
                .checked_mul(size)
                .and_then(|b| usize::try_from(b).ok())
                .ok_or_else(|| Error::bad_request(bad::OVERFLOW))?;
            match buf {
                Some(b) if b.len() >= bytes => Ok(vec![b.slice(0, bytes)]),
                Some(b) => Err(Error::InvalidArgument(format!(
                    "{what} buffer has {} bytes, the request needs {bytes}",
                    b.len()
                ))),
                None => Err(Error::InvalidArgument(format!(
                    "{what} buffer missing, the request needs {bytes} bytes"
                ))),
            }
        };
        let input = take(input, elems.input, "input")?;
        let output = take(output, elems.output, "output")?;
        self.call(0, req, &input, &output, None)
    }

    /// Every member's `output` gets the reduction of all `input`s.
    pub fn allreduce(
        &self,
        dtype: Dtype,
        op: ReduceOp,
        input: &DmaBuf,
        output: &DmaBuf,
        count: u64,
    ) -> Result<()> {
        let req = Request::new(Opcode::Allreduce, dtype, op, count);
        self.run(&req, Some(input), Some(output)).map(drop)
    }

    /// Allreduce with `buf` as input and output.
    pub fn allreduce_in_place(
        &self,
        dtype: Dtype,
        op: ReduceOp,
        buf: &DmaBuf,
        count: u64,
    ) -> Result<()> {
        let req = in_place(Request::new(Opcode::Allreduce, dtype, op, count));
        self.run(&req, None, Some(buf)).map(drop)
    }

    /// Every member's `output` gets the root's `input` (read on the root only).
    pub fn broadcast(
        &self,
        dtype: Dtype,
        root: u32,
        input: &DmaBuf,
        output: &DmaBuf,
        count: u64,
    ) -> Result<()> {
        let req = rooted(
            Request::new(Opcode::Broadcast, dtype, ReduceOp::Sum, count),
            root,
        );
        self.run(&req, Some(input), Some(output)).map(drop)
    }

    /// Broadcast of the root's `buf` into every member's `buf`.
    pub fn broadcast_in_place(
        &self,
        dtype: Dtype,
        root: u32,
        buf: &DmaBuf,
        count: u64,
    ) -> Result<()> {
        let req = in_place(rooted(
            Request::new(Opcode::Broadcast, dtype, ReduceOp::Sum, count),
            root,
        ));
        self.run(&req, None, Some(buf)).map(drop)
    }

    /// The root's `output` gets the reduction (written on the root only).
    pub fn reduce(
        &self,
        dtype: Dtype,
        op: ReduceOp,
        root: u32,
        input: &DmaBuf,
        output: &DmaBuf,
        count: u64,
    ) -> Result<()> {
        let req = rooted(Request::new(Opcode::Reduce, dtype, op, count), root);
        self.run(&req, Some(input), Some(output)).map(drop)
    }

    /// Reduce in place: every member's `buf` is its input, the root's gets
    /// the result, the others' stay unchanged.
    pub fn reduce_in_place(
        &self,
        dtype: Dtype,
        op: ReduceOp,
        root: u32,
        buf: &DmaBuf,
        count: u64,
    ) -> Result<()> {
        let req = in_place(rooted(Request::new(Opcode::Reduce, dtype, op, count), root));
        self.run(&req, None, Some(buf)).map(drop)
    }

    /// `output` (`world_size * count` elements) gets every member's `input`
    /// in rank order.
    pub fn allgather(
        &self,
        dtype: Dtype,
        input: &DmaBuf,
        output: &DmaBuf,
        count: u64,
    ) -> Result<()> {
        let req = Request::new(Opcode::Allgather, dtype, ReduceOp::Sum, count);
        self.run(&req, Some(input), Some(output)).map(drop)
    }

    /// Allgather in place: this member's block of `buf` (at `rank * count`)
    /// is its input.
    pub fn allgather_in_place(&self, dtype: Dtype, buf: &DmaBuf, count: u64) -> Result<()> {
        let req = in_place(Request::new(Opcode::Allgather, dtype, ReduceOp::Sum, count));
        self.run(&req, None, Some(buf)).map(drop)
    }

    /// Member r's `output` (`count` elements) gets block r of the reduction
    /// of all `input`s (`world_size * count` elements each).
    pub fn reduce_scatter(
        &self,
        dtype: Dtype,
        op: ReduceOp,
        input: &DmaBuf,
        output: &DmaBuf,
        count: u64,
    ) -> Result<()> {
        let req = Request::new(Opcode::ReduceScatter, dtype, op, count);
        self.run(&req, Some(input), Some(output)).map(drop)
    }

    /// Reduce-scatter in place on `buf` (`world_size * count` elements);
    /// see `Opcode::ReduceScatter` for where the result lands.
    pub fn reduce_scatter_in_place(
        &self,
        dtype: Dtype,
        op: ReduceOp,
        buf: &DmaBuf,
        count: u64,
    ) -> Result<()> {
        let req = in_place(Request::new(Opcode::ReduceScatter, dtype, op, count));
        self.run(&req, None, Some(buf)).map(drop)
    }

    /// Returns once every member has arrived.
    pub fn barrier(&self) -> Result<()> {
        let req = Request::new(Opcode::Barrier, Dtype::U8, ReduceOp::Sum, 0);
        self.run(&req, None, None).map(drop)
    }

    /// The device's own round trip: a request it answers at once for this
    /// member alone, whatever the other members do.
    pub fn nop(&self) -> Result<()> {
        let req = Request::new(Opcode::Nop, Dtype::U8, ReduceOp::Sum, 0);
        self.run(&req, None, None).map(drop)
    }

    // Conveniences on ordinary slices, through a bounce buffer.

    /// Runs `f` on the device's bounce buffer, or on a fresh one if
    /// another thread is using it.
    fn with_bounce<R>(&self, f: impl FnOnce(&mut Bounce) -> Result<R>) -> Result<R> {
        match self.bounce.try_lock() {
            Ok(mut cached) => f(cached.get_or_insert_with(|| Bounce::new(self))),
            Err(_) => f(&mut Bounce::new(self)),
        }
    }

    /// Allreduce of `data` in place.
    pub fn allreduce_slice<T: Element>(&self, op: ReduceOp, data: &mut [T]) -> Result<()> {
        self.with_bounce(|b| b.allreduce_in_place(self, T::DTYPE, op, bytes_of_mut(data)))
    }

    /// Broadcast of the root's `data` into every member's `data`.
    pub fn broadcast_slice<T: Element>(&self, root: u32, data: &mut [T]) -> Result<()> {
        self.with_bounce(|b| b.broadcast(self, T::DTYPE, root, bytes_of_mut(data)))
    }

    /// `output` (`world_size` times as long as `input`) gets every
    /// member's `input` in rank order.
    pub fn allgather_slice<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        self.with_bounce(|b| b.allgather(self, T::DTYPE, bytes_of(input), bytes_of_mut(output)))
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // Stop the device before the rings are freed (fields drop after).
        if let Err(e) = self.transport.reset() {
            log::debug!("device reset on close failed: {e}");
        }
    }
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .field("queues", &self.queues.len())
            .field("poll", &self.poll)
            .finish()
    }
}

fn in_place(mut req: Request) -> Request {
    req.in_place = true;
    req
}

fn rooted(mut req: Request, root: u32) -> Request {
    req.root = root;
    req
}

fn standard_chain(input: &[BufSlice], output: &[BufSlice]) -> Vec<RawDesc> {
    let mut chain = Vec::with_capacity(input.len() + output.len() + 2);
    chain.push(RawDesc::Header);
    chain.extend(input.iter().cloned().map(RawDesc::Read));
    chain.extend(output.iter().cloned().map(RawDesc::Write));
    chain.push(RawDesc::Response);
    chain
}

fn read_config(transport: &dyn Transport) -> Result<VirtioDmlcConfig> {
    let mut raw = [0u8; CONFIG_SIZE];
    transport.read_config(0, &mut raw)?;
    Ok(VirtioDmlcConfig::read_from_bytes(&raw).unwrap_or_default())
}

/// Splits `len` bytes at `offset` of `alloc` into descriptors.
fn for_each_piece(alloc: &DmaAlloc, offset: usize, len: usize, f: &mut dyn FnMut(u64, u32)) {
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
fn post_locked(
    st: &mut QueueState,
    queue: u16,
    header: &VirtioDmlcReq,
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
    // SAFETY: the slot of a free head is ours: the device only reads it once
    // the chain is published below.
    unsafe {
        std::ptr::copy_nonoverlapping(
            header.as_bytes().as_ptr(),
            st.slot_ptr(head, 0),
            REQ_HEADER_SIZE,
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
                addr: slot_addr,
                len: REQ_HEADER_SIZE as u32,
                writable: false,
            }),
            RawDesc::Response => {
                has_resp = true;
                segs.push(Segment {
                    addr: slot_addr + RESP_OFFSET as u64,
                    len: RESP_SIZE as u32,
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
        has_resp,
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
        }),
        Some(Status::BadRequest) => Err(Error::bad_request(detail)),
        Some(Status::Mismatch) => Err(Error::mismatch(detail, peer)),
        Some(Status::PeerLost) => Err(Error::PeerLost { peer }),
        Some(Status::Timeout) => Err(Error::Timeout { peer }),
        Some(Status::Unsupported) => Err(Error::Unsupported { detail }),
        Some(Status::TooBig) => Err(Error::TooBig { detail }),
        Some(Status::Reset) => Err(Error::Reset),
        None => Err(Error::UnknownStatus {
            status: r.status.get(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;
    use std::sync::atomic::AtomicBool;
    use std::thread::JoinHandle;

    use virtio_dmlc::{mismatch, Status};
    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

    use super::*;
    use crate::dma::MemfdMemory;
    use crate::dma::{DmaError, DmaRegion};
    use crate::transport::poll_fds;
    use crate::transport::{QueueAddrs, TransportError};
    use crate::virtqueue::tests::{Chain, FakeRing, GUEST_BASE};
    use crate::virtqueue::VRING_DESC_F_WRITE;

    type TResult<T> = std::result::Result<T, TransportError>;

    /// Tag that makes the fake device hold a request until released.
    const HOLD: u64 = 0x401d;
    /// Tags `FAIL | status | detail << 8 | peer << 16` make it fail a request.
    const FAIL: u64 = 0xfa11 << 48;

    #[derive(Default)]
    struct Shared {
        /// Overrides the config's generation when not 0.
        generation: AtomicU32,
        /// Overrides the config's group id when not 0.
        group: AtomicU64,
        stop: AtomicBool,
        release: AtomicBool,
        dead: AtomicBool,
        signals: AtomicU64,
        notifies: AtomicU64,
    }

    /// A world-of-one dmlc device: every collective copies the inputs to the
    /// outputs (the reduction of one member is its input). It completes what
    /// it finds in reverse order, so completions are out of order.
    struct FakeTransport {
        config: VirtioDmlcConfig,
        offered: u64,
        acked: u64,
        mem: Arc<MemfdMemory>,
        rings: Vec<FakeRing>,
        calls: Vec<Arc<EventFd>>,
        shared: Arc<Shared>,
        thread: Option<JoinHandle<()>>,
    }

    fn world_of_one() -> VirtioDmlcConfig {
        VirtioDmlcConfig {
            rank: 0.into(),
            world_size: 1.into(),
            num_queues: 2.into(),
            max_segments: 8.into(),
            max_bytes: (1u64 << 20).into(),
            dtypes: Dtype::all_mask().into(),
            ops: ReduceOp::all_mask().into(),
            opcodes: Opcode::all_mask().into(),
            generation: 1.into(),
            group_id: 7.into(),
        }
    }

    fn serve(ring: &mut FakeRing, head: u16, chain: &[(u64, u32, u16)]) -> u32 {
        let writable = |d: &(u64, u32, u16)| d.2 & VRING_DESC_F_WRITE != 0;
        let Some(last) = chain.last().filter(|d| writable(d) && d.1 == 16) else {
            return 0;
        };
        let mut resp = VirtioDmlcResp {
            status: Status::Ok.raw().into(),
            peer: virtio_dmlc::NO_PEER.into(),
            generation: 1.into(),
            ..Default::default()
        };
        let mut written = 16;
        let first = chain[0];
        if writable(&first) || first.1 != 32 {
            resp.status = Status::BadRequest.raw().into();
            resp.detail = bad::HEADER.into();
        } else {
            let mut raw = [0u8; 32];
            // SAFETY: the driver published a 32-byte readable header there.
            unsafe { std::ptr::copy_nonoverlapping(ring.host(first.0), raw.as_mut_ptr(), 32) };
            let hdr = VirtioDmlcReq::read_from_bytes(&raw).unwrap();
            let tag = hdr.tag.get();
            if tag >> 48 == FAIL >> 48 {
                resp.status = ((tag & 0xff) as u32).into();
                resp.detail = ((tag >> 8 & 0xff) as u32).into();
                resp.peer = ((tag >> 16 & 0xffff) as u32).into();
            } else {
                let data = &chain[1..chain.len() - 1];
                let mut input = Vec::new();
                for d in data.iter().filter(|d| !writable(d)) {
                    // SAFETY: a readable buffer the driver posted.
                    let s = unsafe { std::slice::from_raw_parts(ring.host(d.0), d.1 as usize) };
                    input.extend_from_slice(s);
                }
                let outs: Vec<_> = data.iter().filter(|d| writable(d)).collect();
                let out_len: usize = outs.iter().map(|d| d.1 as usize).sum();
                if !input.is_empty() && input.len() != out_len && out_len != 0 {
                    resp.status = Status::BadRequest.raw().into();
                    resp.detail = bad::INPUT_LENGTH.into();
                } else if !input.is_empty() {
                    let mut at = 0;
                    for d in outs {
                        let n = d.1 as usize;
                        // SAFETY: a writable buffer the driver posted.
                        unsafe {
                            std::ptr::copy_nonoverlapping(input[at..].as_ptr(), ring.host(d.0), n)
                        };
                        at += n;
                    }
                    written += out_len as u32;
                } else {
                    written += out_len as u32;
                }
            }
        }
        // SAFETY: the response descriptor is 16 writable bytes.
        unsafe { std::ptr::copy_nonoverlapping(resp.as_bytes().as_ptr(), ring.host(last.0), 16) };
        let _ = head;
        written
    }

    fn header_tag(ring: &FakeRing, chain: &[(u64, u32, u16)]) -> u64 {
        let first = chain[0];
        if first.1 != 32 {
            return 0;
        }
        // SAFETY: the driver published a 32-byte header there.
        unsafe { std::ptr::read_unaligned(ring.host(first.0 + 16).cast::<u64>()) }
    }

    fn device_loop(mut rings: Vec<FakeRing>, calls: Vec<Arc<EventFd>>, shared: Arc<Shared>) {
        let mut held: Vec<(usize, u16, Chain)> = Vec::new();
        while !shared.stop.load(Ordering::Relaxed) {
            let mut busy = false;
            for (q, ring) in rings.iter_mut().enumerate() {
                let mut batch = Vec::new();
                while let Some((head, chain)) = ring.pop_avail() {
                    if header_tag(ring, &chain) == HOLD {
                        held.push((q, head, chain));
                    } else {
                        batch.push((head, chain));
                    }
                }
                busy |= !batch.is_empty();
                for (head, chain) in batch.into_iter().rev() {
                    let len = serve(ring, head, &chain);
                    if ring.push_used(u32::from(head), len) {
                        shared.signals.fetch_add(1, Ordering::Relaxed);
                        calls[q].write(1).unwrap();
                    }
                }
            }
            if shared.release.swap(false, Ordering::AcqRel) {
                for (q, head, chain) in held.drain(..).rev() {
                    let len = serve(&mut rings[q], head, &chain);
                    if rings[q].push_used(u32::from(head), len) {
                        shared.signals.fetch_add(1, Ordering::Relaxed);
                        calls[q].write(1).unwrap();
                    }
                }
            }
            if !busy {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }

    impl FakeTransport {
        fn new(config: VirtioDmlcConfig, mem: Arc<MemfdMemory>) -> Self {
            FakeTransport {
                config,
                offered: bit(VIRTIO_F_VERSION_1)
                    | bit(VIRTIO_RING_F_EVENT_IDX)
                    | bit(VIRTIO_DMLC_F_REQ_TIMEOUT)
                    | bit(VIRTIO_RING_F_INDIRECT_DESC),
                acked: 0,
                mem,
                rings: Vec::new(),
                calls: Vec::new(),
                shared: Arc::new(Shared::default()),
                thread: None,
            }
        }

        fn stop(&mut self) {
            self.shared.stop.store(true, Ordering::Relaxed);
            if let Some(t) = self.thread.take() {
                t.join().unwrap();
            }
        }
    }

    impl Drop for FakeTransport {
        fn drop(&mut self) {
            self.stop();
        }
    }

    impl Transport for FakeTransport {
        fn device_features(&self) -> u64 {
            self.offered
        }
        fn negotiate(&mut self, features: u64) -> TResult<()> {
            self.acked = features;
            Ok(())
        }
        fn max_queues(&self) -> u16 {
            4
        }
        fn max_queue_size(&self, _queue: u16) -> u16 {
            1024
        }
        fn read_config(&self, offset: usize, buf: &mut [u8]) -> TResult<()> {
            let mut config = self.config;
            match self.shared.generation.load(Ordering::Relaxed) {
                0 => {}
                g => config.generation = g.into(),
            }
            match self.shared.group.load(Ordering::Relaxed) {
                0 => {}
                g => config.group_id = g.into(),
            }
            buf.copy_from_slice(&config.as_bytes()[offset..offset + buf.len()]);
            Ok(())
        }
        fn setup_queue(&mut self, queue: u16, addrs: &QueueAddrs) -> TResult<()> {
            assert_eq!(usize::from(queue), self.rings.len());
            let event_idx = self.acked & bit(VIRTIO_RING_F_EVENT_IDX) != 0;
            self.rings.push(FakeRing::new(*addrs, event_idx, &self.mem));
            self.calls
                .push(Arc::new(EventFd::new(EFD_NONBLOCK).unwrap()));
            Ok(())
        }
        fn driver_ok(&mut self) -> TResult<()> {
            let rings = std::mem::take(&mut self.rings);
            let (calls, shared) = (self.calls.clone(), self.shared.clone());
            self.thread = Some(std::thread::spawn(move || {
                device_loop(rings, calls, shared)
            }));
            Ok(())
        }
        fn notify(&self, _queue: u16) -> TResult<()> {
            self.shared.notifies.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
        fn wait_interrupt(&self, queue: u16, timeout: Option<Duration>) -> TResult<bool> {
            let call = &self.calls[usize::from(queue)];
            let ms = timeout.map_or(5, |t| t.as_millis().min(5) as i32 + 1);
            let mut fds = [libc::pollfd {
                fd: call.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            }];
            // Wake up now and then to notice a "dead" device, as the host
            // transport does through its socket.
            let n = poll_fds(&mut fds, ms, "poll")?;
            self.check_alive()?;
            if n == 0 {
                return Ok(false);
            }
            let _ = call.read();
            Ok(true)
        }
        fn check_alive(&self) -> TResult<()> {
            if self.shared.dead.load(Ordering::Relaxed) {
                return Err(TransportError::Disconnected { during: "test" });
            }
            Ok(())
        }
        fn reset(&mut self) -> TResult<()> {
            self.stop();
            Ok(())
        }
    }

    fn open_fake(config: VirtioDmlcConfig, opts: &OpenOptions) -> (Device, Arc<Shared>) {
        open_fake_with(config, opts, None, u64::MAX)
    }

    /// `page`: device memory that is contiguous only within pages of this
    /// size (like hugepages); `features`: mask of what the fake offers.
    fn open_fake_with(
        config: VirtioDmlcConfig,
        opts: &OpenOptions,
        page: Option<u64>,
        features: u64,
    ) -> (Device, Arc<Shared>) {
        let mem = Arc::new(MemfdMemory::new(8 << 20, GUEST_BASE).unwrap());
        let mut t = FakeTransport::new(config, Arc::clone(&mem));
        t.offered &= features;
        let shared = Arc::clone(&t.shared);
        let mem: Arc<dyn DmaMemory> = match page {
            Some(page) => Arc::new(PagedMemory { inner: mem, page }),
            None => mem,
        };
        (Device::open(Box::new(t), mem, opts).unwrap(), shared)
    }

    /// Memfd memory that reports its device ranges split at every `page`
    /// boundary, as hugepage memory does where pages are not physically
    /// adjacent. The addresses are the memfd's, so the fake device still
    /// finds the bytes.
    #[derive(Debug)]
    struct PagedMemory {
        inner: Arc<MemfdMemory>,
        page: u64,
    }

    // SAFETY: every region and address comes from the inner memory, which
    // keeps the promises; the ranges are only cut into pieces.
    unsafe impl DmaMemory for PagedMemory {
        fn alloc(&self, len: usize, align: usize) -> std::result::Result<DmaRegion, DmaError> {
            self.inner.alloc(len, align)
        }

        unsafe fn dealloc(&self, region: &DmaRegion) {
            // SAFETY: forwarded contract; the region came from `inner`.
            unsafe { self.inner.dealloc(region) }
        }

        fn device_ranges(
            &self,
            region: &DmaRegion,
            offset: usize,
            len: usize,
            f: &mut dyn FnMut(u64, usize),
        ) {
            let mut addr = region.paddr + offset as u64;
            let end = addr + len as u64;
            while addr < end {
                let next = ((addr / self.page) + 1) * self.page;
                let n = next.min(end) - addr;
                f(addr, n as usize);
                addr += n;
            }
        }
    }

    /// Polling, or sleeping on interrupts at once.
    fn opts(poll: bool) -> OpenOptions {
        OpenOptions {
            poll,
            spin_cap: Duration::ZERO,
            queue_size: 16,
            dma_bytes: 8 << 20,
            ..Default::default()
        }
    }

    fn filled(dev: &Device, vals: &[f32]) -> DmaBuf {
        let mut b = dev.alloc(vals.len() * 4).unwrap();
        b.as_elems_mut::<f32>().copy_from_slice(vals);
        b
    }

    #[test]
    fn public_types_are_thread_safe() {
        fn check<T: Send + Sync>() {}
        check::<Device>();
        check::<DmaBuf>();
        check::<BufSlice>();
        check::<Handle>();
        check::<Error>();
    }

    #[test]
    fn open_reads_config_and_negotiates() {
        let (dev, _) = open_fake(world_of_one(), &opts(true));
        assert_eq!((dev.rank(), dev.world_size(), dev.num_queues()), (0, 1, 2));
        assert_eq!(dev.queue_size(), 16);
        let want = bit(VIRTIO_F_VERSION_1)
            | bit(VIRTIO_RING_F_EVENT_IDX)
            | bit(VIRTIO_DMLC_F_REQ_TIMEOUT)
            | bit(VIRTIO_RING_F_INDIRECT_DESC);
        assert_eq!(dev.features(), want);
        assert_eq!(dev.config().group_id.get(), 7);
        let no_event = OpenOptions {
            event_idx: false,
            max_queues: 1,
            ..opts(true)
        };
        let (dev, _) = open_fake(world_of_one(), &no_event);
        assert_eq!(dev.features() & bit(VIRTIO_RING_F_EVENT_IDX), 0);
        assert_eq!(dev.num_queues(), 1);
        let mut bad = world_of_one();
        bad.rank = 1.into();
        let mem = Arc::new(MemfdMemory::new(1 << 20, GUEST_BASE).unwrap());
        let t = FakeTransport::new(bad, Arc::clone(&mem));
        let err = Device::open(Box::new(t), mem, &opts(true)).unwrap_err();
        assert!(matches!(err, Error::BadConfig(_)), "{err}");
    }

    fn exercise_conveniences(dev: &Device) {
        let input = filled(dev, &[1.0, 2.0, 3.0, 4.0]);
        let output = dev.alloc(16).unwrap();
        dev.allreduce(Dtype::F32, ReduceOp::Sum, &input, &output, 4)
            .unwrap();
        assert_eq!(output.as_elems::<f32>(), [1.0, 2.0, 3.0, 4.0]);
        let mut buf = filled(dev, &[5.0, 6.0]);
        dev.allreduce_in_place(Dtype::F32, ReduceOp::Max, &buf, 2)
            .unwrap();
        assert_eq!(buf.as_elems::<f32>(), [5.0, 6.0]);
        let out = dev.alloc(8).unwrap();
        dev.broadcast(Dtype::F32, 0, &buf, &out, 2).unwrap();
        assert_eq!(out.as_elems::<f32>(), [5.0, 6.0]);
        let out = dev.alloc(8).unwrap();
        dev.reduce(Dtype::F32, ReduceOp::Sum, 0, &buf, &out, 2)
            .unwrap();
        assert_eq!(out.as_elems::<f32>(), [5.0, 6.0]);
        let out = dev.alloc(8).unwrap();
        dev.allgather(Dtype::F32, &buf, &out, 2).unwrap();
        assert_eq!(out.as_elems::<f32>(), [5.0, 6.0]);
        let out = dev.alloc(8).unwrap();
        dev.reduce_scatter(Dtype::F32, ReduceOp::Sum, &buf, &out, 2)
            .unwrap();
        assert_eq!(out.as_elems::<f32>(), [5.0, 6.0]);
        // `buf` was read through `&self` above: take it back before the
        // device may write it again.
        buf.reclaim();
        dev.broadcast_in_place(Dtype::F32, 0, &buf, 2).unwrap();
        dev.reduce_in_place(Dtype::F32, ReduceOp::Sum, 0, &buf, 2)
            .unwrap();
        dev.allgather_in_place(Dtype::F32, &buf, 2).unwrap();
        dev.reduce_scatter_in_place(Dtype::F32, ReduceOp::Sum, &buf, 2)
            .unwrap();
        dev.barrier().unwrap();
        let mut v: Vec<i32> = (0..1000).collect();
        dev.allreduce_slice(ReduceOp::Sum, &mut v).unwrap();
        assert!(v.iter().copied().eq(0..1000));
        let mut h = [half::f16::from_f32(1.5); 3];
        dev.broadcast_slice(0, &mut h).unwrap();
        assert_eq!(h, [half::f16::from_f32(1.5); 3]);
        let mut g = [0u64; 2];
        dev.allgather_slice(&[9u64, 8], &mut g).unwrap();
        assert_eq!(g, [9, 8]);
        // A buffer larger than needed is fine: its prefix is used.
        let big = dev.alloc(64).unwrap();
        dev.allreduce(Dtype::F32, ReduceOp::Sum, &input, &big, 4)
            .unwrap();
        assert_eq!(&big.as_elems::<f32>()[..4], [1.0, 2.0, 3.0, 4.0]);
        let err = dev
            .allreduce(Dtype::F32, ReduceOp::Sum, &input, &out, 4)
            .unwrap_err();
        assert!(
            err.to_string().contains("output buffer has 8 bytes"),
            "{err}"
        );
    }

    #[test]
    fn conveniences_in_poll_mode_never_take_interrupts() {
        let (dev, shared) = open_fake(world_of_one(), &opts(true));
        exercise_conveniences(&dev);
        assert_eq!(shared.signals.load(Ordering::Relaxed), 0);
        assert!(shared.notifies.load(Ordering::Relaxed) > 0);
    }

    fn hybrid() -> OpenOptions {
        OpenOptions {
            spin_cap: HYBRID_SPIN_CAP,
            ..opts(false)
        }
    }

    /// The hybrid wait: completions that come while it spins need no
    /// interrupt; a wait longer than the spin sleeps on one and still
    /// completes.
    #[test]
    fn the_hybrid_wait_spins_first_then_sleeps() {
        let (dev, shared) = open_fake(world_of_one(), &hybrid());
        assert!(!dev.is_polling());
        // A new device spins up to the whole bound; the fake answers within
        // it, unless the machine is loaded (a debug build), so the budget
        // after these waits is not asserted.
        assert_eq!(dev.spin_budget(), HYBRID_SPIN_CAP);
        for _ in 0..50 {
            dev.barrier().unwrap();
        }
        // A held request, released after 50 ms: longer than any spin.
        let h = dev.submit(0, &held_barrier(), &[], &[]).unwrap();
        let before = shared.signals.load(Ordering::Relaxed);
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(50));
                shared.release.store(true, Ordering::Release);
            });
            dev.wait(h, Some(Duration::from_secs(20))).unwrap();
        });
        assert!(
            shared.signals.load(Ordering::Relaxed) > before,
            "the long wait did not sleep on the interrupt"
        );
        // Mostly long waits (a late peer) bring the spin down to its floor;
        // mostly short ones bring it back.
        for _ in 0..50 {
            dev.learn_wait(Duration::from_millis(50));
        }
        assert_eq!(dev.spin_budget(), HYBRID_SPIN_CAP / 20);
        for _ in 0..50 {
            dev.learn_wait(Duration::from_micros(20));
        }
        assert_eq!(dev.spin_budget(), HYBRID_SPIN_CAP);
    }

    #[test]
    fn conveniences_in_interrupt_mode() {
        let (dev, shared) = open_fake(world_of_one(), &opts(false));
        exercise_conveniences(&dev);
        assert!(shared.signals.load(Ordering::Relaxed) > 0);
    }

    #[test]
    fn local_checks_use_the_device_codes() {
        let mut config = world_of_one();
        config.dtypes = (Dtype::all_mask() & !(1 << Dtype::U64.raw())).into();
        let (dev, _) = open_fake(config, &opts(true));
        let buf = dev.alloc(64).unwrap();
        let ar = |dtype, op, count| Request::new(Opcode::Allreduce, dtype, op, count);
        let code = |r: Result<Handle>| match r {
            Err(Error::BadRequest { detail, .. }) => ("bad", detail),
            Err(Error::Unsupported { detail }) => ("unsupported", detail),
            Err(Error::TooBig { detail }) => ("too_big", detail),
            other => panic!("unexpected {other:?}"),
        };
        let s = |off, len| buf.slice(off, len);
        let f32x4 = ar(Dtype::F32, ReduceOp::Sum, 4);
        assert_eq!(
            code(dev.submit(0, &f32x4, &[s(0, 12)], &[s(16, 16)])),
            ("bad", bad::INPUT_LENGTH)
        );
        assert_eq!(
            code(dev.submit(0, &f32x4, &[s(0, 16)], &[s(16, 8)])),
            ("bad", bad::OUTPUT_LENGTH)
        );
        assert_eq!(
            code(dev.submit(0, &f32x4, &[s(0, 6), s(6, 10)], &[s(16, 16)])),
            ("bad", bad::SEGMENT_ALIGN)
        );
        let mut rooted = f32x4;
        rooted.root = 1;
        assert_eq!(code(dev.submit(0, &rooted, &[], &[])), ("bad", bad::ROOT));
        let bc = Request {
            root: 1,
            ..Request::new(Opcode::Broadcast, Dtype::F32, ReduceOp::Sum, 4)
        };
        assert_eq!(code(dev.submit(0, &bc, &[], &[])), ("bad", bad::ROOT));
        let ip = Request {
            in_place: true,
            ..f32x4
        };
        assert_eq!(
            code(dev.submit(0, &ip, &[s(0, 16)], &[s(16, 16)])),
            ("bad", bad::IN_PLACE_INPUT)
        );
        let barrier = Request::new(Opcode::Barrier, Dtype::U8, ReduceOp::Sum, 1);
        assert_eq!(
            code(dev.submit(0, &barrier, &[], &[])),
            ("bad", bad::BARRIER_DATA)
        );
        assert_eq!(
            code(dev.submit(0, &ar(Dtype::F32, ReduceOp::Bxor, 4), &[], &[])),
            ("unsupported", unsupported::OP_FOR_DTYPE)
        );
        assert_eq!(
            code(dev.submit(0, &ar(Dtype::U64, ReduceOp::Sum, 4), &[], &[])),
            ("unsupported", unsupported::DTYPE)
        );
        assert_eq!(
            code(dev.submit(0, &ar(Dtype::U8, ReduceOp::Sum, (1 << 20) + 1), &[], &[])),
            ("too_big", too_big::BYTES)
        );
        assert_eq!(
            code(dev.submit(0, &ar(Dtype::U8, ReduceOp::Sum, u64::MAX), &[], &[])),
            ("too_big", too_big::BYTES)
        );
        let ag = Request::new(Opcode::Allgather, Dtype::U8, ReduceOp::Sum, u64::MAX);
        let mut wide = world_of_one();
        wide.world_size = 2.into();
        let (dev2, _) = open_fake(wide, &opts(true));
        assert!(matches!(
            dev2.submit(0, &ag, &[], &[]),
            Err(Error::BadRequest {
                detail: bad::OVERFLOW,
                ..
            })
        ));
        let nine: Vec<_> = (0..9).map(|i| s(i, 1)).collect();
        assert_eq!(
            code(dev.submit(0, &ar(Dtype::U8, ReduceOp::Sum, 9), &nine, &[s(32, 9)])),
            ("too_big", too_big::SEGMENTS)
        );
        // Zero-length segments do not count and are passed through.
        let h = dev
            .submit(0, &f32x4, &[s(0, 16), s(16, 0)], &[s(32, 16)])
            .unwrap();
        dev.wait(h, None).unwrap();
        assert!(matches!(
            dev.submit(5, &f32x4, &[s(0, 16)], &[s(16, 16)]),
            Err(Error::InvalidArgument(_))
        ));
        // A buffer of another device's memory is refused.
        let foreign = dev2.alloc(16).unwrap();
        assert!(matches!(
            dev.submit(0, &f32x4, &[foreign.all()], &[s(16, 16)]),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn raw_chains_and_device_statuses() {
        let (dev, _) = open_fake(world_of_one(), &opts(true));
        let hdr = Request::new(Opcode::Barrier, Dtype::U8, ReduceOp::Sum, 0).header();
        // No response descriptor: the device cannot answer.
        let h = dev.submit_raw(0, &hdr, &[RawDesc::Header]).unwrap();
        assert!(matches!(dev.wait(h, None), Err(Error::NoStatus)));
        // A 16-byte header is caught by the device.
        let buf = dev.alloc(64).unwrap();
        let h = dev
            .submit_raw(
                0,
                &hdr,
                &[RawDesc::Read(buf.slice(0, 16)), RawDesc::Response],
            )
            .unwrap();
        assert!(matches!(
            dev.wait(h, None),
            Err(Error::BadRequest {
                detail: bad::HEADER,
                ..
            })
        ));
        let fail = |status: Status, detail: u32, peer: u32| {
            let mut hdr = hdr;
            hdr.tag =
                (FAIL | u64::from(status.raw()) | u64::from(detail) << 8 | u64::from(peer) << 16)
                    .into();
            let h = dev
                .submit_raw(1, &hdr, &[RawDesc::Header, RawDesc::Response])
                .unwrap();
            dev.wait(h, Some(Duration::from_secs(10))).unwrap_err()
        };
        let e = fail(Status::Mismatch, mismatch::COUNT, 1);
        assert_eq!(
            e.to_string(),
            "collective mismatch: count differs on rank 1"
        );
        assert!(matches!(
            fail(Status::PeerLost, 0, 3),
            Error::PeerLost { peer: 3 }
        ));
        assert!(matches!(
            fail(Status::Timeout, 0, 2),
            Error::Timeout { peer: 2 }
        ));
        assert!(matches!(fail(Status::Reset, 0, 0), Error::Reset));
        assert!(matches!(
            fail(Status::TooBig, too_big::SEGMENTS, 0),
            Error::TooBig {
                detail: too_big::SEGMENTS
            }
        ));
        assert!(matches!(
            fail(Status::Unsupported, unsupported::OP, 0),
            Error::Unsupported {
                detail: unsupported::OP
            }
        ));
        let mut hdr99 = hdr;
        hdr99.tag = (FAIL | 99).into();
        let h = dev
            .submit_raw(0, &hdr99, &[RawDesc::Header, RawDesc::Response])
            .unwrap();
        assert!(matches!(
            dev.wait(h, None),
            Err(Error::UnknownStatus { status: 99 })
        ));
    }

    fn held_barrier() -> Request {
        Request {
            tag: HOLD,
            ..Request::new(Opcode::Barrier, Dtype::U8, ReduceOp::Sum, 0)
        }
    }

    #[test]
    fn many_in_flight_queue_full_and_stale_handles() {
        for poll in [true, false] {
            let (dev, shared) = open_fake(world_of_one(), &opts(poll));
            // 16 descriptors, 2 per barrier: 8 fit.
            let handles: Vec<_> = (0..8)
                .map(|_| dev.submit(0, &held_barrier(), &[], &[]).unwrap())
                .collect();
            assert!(matches!(
                dev.submit(0, &held_barrier(), &[], &[]),
                Err(Error::QueueFull)
            ));
            // Queue 1 is independent.
            let other = dev.submit(1, &held_barrier(), &[], &[]).unwrap();
            assert!(!dev.is_done(handles[0]).unwrap());
            shared.release.store(true, Ordering::Release);
            for h in handles.iter().rev() {
                assert_eq!(dev.wait(*h, None).unwrap().generation, 1);
            }
            dev.wait(other, None).unwrap();
            assert!(matches!(
                dev.wait(handles[3], None),
                Err(Error::UnknownHandle)
            ));
            // The queue is empty again.
            let again: Vec<_> = (0..8)
                .map(|_| {
                    dev.submit(
                        0,
                        &Request::new(Opcode::Barrier, Dtype::U8, ReduceOp::Sum, 0),
                        &[],
                        &[],
                    )
                    .unwrap()
                })
                .collect();
            for h in again {
                dev.wait(h, None).unwrap();
            }
        }
    }

    #[test]
    fn wait_times_out_and_the_request_completes_later() {
        for poll in [true, false] {
            let (dev, shared) = open_fake(world_of_one(), &opts(poll));
            let h = dev.submit(0, &held_barrier(), &[], &[]).unwrap();
            let t = Instant::now();
            assert!(matches!(
                dev.wait(h, Some(Duration::from_millis(30))),
                Err(Error::WaitTimeout)
            ));
            assert!(t.elapsed() >= Duration::from_millis(30));
            shared.release.store(true, Ordering::Release);
            dev.wait(h, Some(Duration::from_secs(10))).unwrap();
        }
    }

    #[test]
    fn blocking_call_waits_for_room() {
        let (dev, shared) = open_fake(world_of_one(), &opts(false));
        let held: Vec<_> = (0..8)
            .map(|_| dev.submit(0, &held_barrier(), &[], &[]).unwrap())
            .collect();
        let barrier = Request::new(Opcode::Barrier, Dtype::U8, ReduceOp::Sum, 0);
        assert!(matches!(
            dev.call(0, &barrier, &[], &[], Some(Duration::from_millis(20))),
            Err(Error::WaitTimeout)
        ));
        std::thread::scope(|s| {
            let t = s.spawn(|| dev.call(0, &barrier, &[], &[], Some(Duration::from_secs(10))));
            std::thread::sleep(Duration::from_millis(20));
            shared.release.store(true, Ordering::Release);
            t.join().unwrap().unwrap();
        });
        for h in held {
            dev.wait(h, None).unwrap();
        }
    }

    #[test]
    fn threads_share_one_device() {
        for poll in [true, false] {
            let (dev, _) = open_fake(
                world_of_one(),
                &OpenOptions {
                    queue_size: 64,
                    ..opts(poll)
                },
            );
            std::thread::scope(|s| {
                for t in 0..4i64 {
                    let dev = &dev;
                    s.spawn(move || {
                        for i in 0..200i64 {
                            let mut v = vec![t * 1000 + i; 1 + (i as usize % 17)];
                            let want = v.clone();
                            dev.allreduce_slice(ReduceOp::Sum, &mut v).unwrap();
                            assert_eq!(v, want);
                        }
                    });
                }
                // Non-blocking submits on queue 1, several in flight at once.
                let dev = &dev;
                s.spawn(move || {
                    let bufs: Vec<_> = (0..8).map(|_| dev.alloc(64).unwrap()).collect();
                    for _ in 0..50 {
                        let hs: Vec<_> = bufs
                            .iter()
                            .map(|b| {
                                let r =
                                    Request::new(Opcode::Allreduce, Dtype::U32, ReduceOp::Sum, 8);
                                dev.submit(1, &r, &[b.slice(0, 32)], &[b.slice(32, 32)])
                                    .unwrap()
                            })
                            .collect();
                        for h in hs.into_iter().rev() {
                            dev.wait(h, Some(Duration::from_secs(10))).unwrap();
                        }
                    }
                });
            });
        }
    }

    #[test]
    fn a_vanished_device_ends_the_wait() {
        for poll in [true, false] {
            let (dev, shared) = open_fake(world_of_one(), &opts(poll));
            let h = dev.submit(0, &held_barrier(), &[], &[]).unwrap();
            shared.dead.store(true, Ordering::Release);
            let t = Instant::now();
            let err = dev.wait(h, None).unwrap_err();
            assert!(
                matches!(err, Error::Transport(TransportError::Disconnected { .. })),
                "{err}"
            );
            assert!(t.elapsed() < Duration::from_secs(2));
        }
    }

    #[test]
    fn buffers_stay_alive_while_in_flight() {
        let (dev, shared) = open_fake(world_of_one(), &opts(true));
        let input = filled(&dev, &[7.0; 16]);
        let output = dev.alloc(64).unwrap();
        let addr = output.device_addr();
        let req = Request {
            tag: HOLD,
            ..Request::new(Opcode::Allreduce, Dtype::F32, ReduceOp::Sum, 16)
        };
        let h = dev
            .submit(0, &req, &[input.all()], &[output.all()])
            .unwrap();
        drop(output);
        drop(input);
        // The dropped output's memory is not handed out again yet.
        let other = dev.alloc(64).unwrap();
        assert_ne!(other.device_addr(), addr);
        shared.release.store(true, Ordering::Release);
        dev.wait(h, None).unwrap();
        drop(other);
        // Now it is free.
        let reuse: Vec<_> = (0..4).map(|_| dev.alloc(64).unwrap()).collect();
        assert!(reuse.iter().any(|b| b.device_addr() == addr));
    }
    #[test]
    fn buffers_of_requests_in_flight_refuse_cpu_access() {
        let (dev, shared) = open_fake(world_of_one(), &opts(true));
        let mut input = filled(&dev, &[3.0; 16]);
        let mut output = dev.alloc(64).unwrap();
        let earlier = output.all();
        let req = Request {
            tag: HOLD,
            ..Request::new(Opcode::Allreduce, Dtype::F32, ReduceOp::Sum, 16)
        };
        let h = dev
            .submit(0, &req, &[input.all()], &[output.all()])
            .unwrap();
        assert!(output.is_in_flight() && input.is_in_flight());
        // The device may write the output: no reading, no writing.
        assert!(matches!(
            output.try_as_slice(),
            Err(Error::BufferBusy { .. })
        ));
        assert!(matches!(
            output.try_as_mut_slice(),
            Err(Error::BufferBusy { .. })
        ));
        let read =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| output.as_elems::<f32>()[0]));
        let msg = read.unwrap_err();
        let msg = msg.downcast_ref::<String>().unwrap();
        assert!(
            msg.contains("DmaBuf::as_slice: buffer busy: the buffer is in flight"),
            "{msg}"
        );
        // The device only reads the input: reading it too is fine,
        // writing is not.
        assert_eq!(input.as_elems::<f32>()[0], 3.0);
        assert!(matches!(
            input.try_as_mut_slice(),
            Err(Error::BufferBusy { .. })
        ));
        shared.release.store(true, Ordering::Release);
        dev.wait(h, None).unwrap();
        assert!(!output.is_in_flight());
        assert_eq!(output.as_elems::<f32>(), [3.0; 16]);
        // `output` was just read through `&self`: the device may not write
        // it until `&mut` access shows that borrow over ...
        let r16 = Request::new(Opcode::Allreduce, Dtype::F32, ReduceOp::Sum, 16);
        let err = dev
            .submit(0, &r16, &[input.all()], &[output.all()])
            .unwrap_err();
        assert!(matches!(err, Error::BufferBusy { .. }), "{err}");
        assert!(err.to_string().contains("DmaBuf::reclaim"), "{err}");
        // ... while it may still read it (as an input). `input` was read
        // through `&self` too and is written now: take it back first.
        input.reclaim();
        let h = dev
            .submit(0, &r16, &[output.all()], &[input.all()])
            .unwrap();
        dev.wait(h, None).unwrap();
        output.reclaim();
        let h = dev
            .submit(0, &r16, &[input.all()], &[output.all()])
            .unwrap();
        dev.wait(h, None).unwrap();
        // A slice made before an exclusive borrow cannot be posted while
        // that borrow may be alive; using the buffer through `&self` again
        // shows it has ended.
        output.as_mut_slice().fill(0);
        let err = dev
            .submit(0, &r16, &[input.all()], std::slice::from_ref(&earlier))
            .unwrap_err();
        assert!(err.to_string().contains("as_mut_slice"), "{err}");
        let _ = output.len();
        let fresh = output.all();
        let h = dev
            .submit(0, &r16, &[input.all()], &[fresh, earlier])
            .unwrap_err();
        // (two output slices of 64 bytes: too long, but no longer busy)
        assert!(
            matches!(
                h,
                Error::BadRequest {
                    detail: bad::OUTPUT_LENGTH,
                    ..
                }
            ),
            "{h}"
        );
    }

    #[test]
    fn the_bounce_buffer_cuts_long_data_into_chunks() {
        let (dev, _shared) = open_fake(world_of_one(), &opts(true));
        let mut b = Bounce::new(&dev);
        b.set_chunk_bytes(12); // three u32 per request
        let want: Vec<u8> = (0..40u8).collect(); // ten u32, four requests
        let mut data = want.clone();
        b.allreduce_in_place(&dev, Dtype::U32, ReduceOp::Sum, &mut data)
            .unwrap();
        assert_eq!(data, want);
        let mut out = vec![0u8; 40];
        b.allreduce(&dev, Dtype::U32, ReduceOp::Sum, &want, &mut out)
            .unwrap();
        assert_eq!(out, want);
        let mut data = want.clone();
        b.broadcast(&dev, Dtype::U32, 0, &mut data).unwrap();
        assert_eq!(data, want);
        let mut out = vec![0u8; 40];
        b.allgather(&dev, Dtype::U32, &want, &mut out).unwrap();
        assert_eq!(out, want);
        // Only whole elements, and outputs of the right size.
        let r = b.allreduce_in_place(&dev, Dtype::U32, ReduceOp::Sum, &mut data[..7]);
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
        let r = b.allgather(&dev, Dtype::U32, &want, &mut out[..36]);
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    }

    #[test]
    fn a_stuck_bounce_buffer_is_replaced() {
        let (mut dev, _shared) = open_fake(world_of_one(), &opts(true));
        dev.wait_margin = Duration::from_millis(20);
        let mut v = [1u32, 2, 3];
        dev.allreduce_slice(ReduceOp::Sum, &mut v).unwrap();
        // A held request on the cached bounce buffer, as if its wait had
        // failed: the next convenience call must not panic or wait.
        let bounce = dev
            .bounce
            .lock()
            .unwrap()
            .as_mut()
            .unwrap()
            .cached()
            .slice(0, 12);
        let req = Request {
            tag: HOLD,
            timeout_ms: 10,
            ..Request::new(Opcode::Allreduce, Dtype::U32, ReduceOp::Sum, 3)
        };
        let r = dev.submit(0, &req, &[], std::slice::from_ref(&bounce));
        assert!(matches!(r, Err(Error::BadRequest { .. })), "{r:?}");
        let inp = dev.alloc(12).unwrap();
        // The convenience read the bounce buffer last: take it back.
        dev.bounce
            .lock()
            .unwrap()
            .as_mut()
            .unwrap()
            .cached()
            .reclaim();
        let h = dev.submit(0, &req, &[inp.all()], &[bounce]).unwrap();
        dev.allreduce_slice(ReduceOp::Sum, &mut v).unwrap();
        assert_eq!(v, [1, 2, 3]);
        assert!(matches!(dev.wait(h, None), Err(Error::Unanswered { .. })));
    }

    #[test]
    fn local_check_order_is_the_devices() {
        let mut config = world_of_one();
        config.max_segments = 3.into();
        let (dev, _) = open_fake_with(config, &opts(true), Some(4096), u64::MAX);
        let code = |r: Result<()>| match r {
            Err(Error::BadRequest { detail, .. }) => ("bad", detail),
            Err(Error::Unsupported { detail }) => ("unsupported", detail),
            Err(Error::TooBig { detail }) => ("too_big", detail),
            Ok(()) => ("ok", 0),
            other => panic!("unexpected {other:?}"),
        };
        let buf = dev.alloc(4 * 4096).unwrap();
        // Offsets below count from the first page boundary in `buf`.
        let pad = (4096 - buf.device_addr() as usize % 4096) % 4096;
        let s = |off, len| buf.slice(pad + off, len);
        // Sizes (step 7) come before the in-place input rule (step 8).
        let ip = Request {
            in_place: true,
            ..Request::new(Opcode::Allreduce, Dtype::U8, ReduceOp::Sum, (1 << 20) + 1)
        };
        assert_eq!(
            code(dev.check(&ip, &[s(0, 4)], &[])),
            ("too_big", too_big::BYTES)
        );
        // Segments (step 7) come before barrier data (step 8).
        let barrier = Request::new(Opcode::Barrier, Dtype::U8, ReduceOp::Sum, 0);
        let four: Vec<_> = (0..4).map(|i| s(i, 1)).collect();
        assert_eq!(
            code(dev.check(&barrier, &four, &[])),
            ("too_big", too_big::SEGMENTS)
        );
        assert_eq!(
            code(dev.check(&barrier, &four[..1], &[])),
            ("bad", bad::BARRIER_DATA)
        );
        // Root (step 5) before barrier data; op for dtype (4) before root.
        let rooted = Request { root: 1, ..barrier };
        assert_eq!(
            code(dev.check(&rooted, &four[..1], &[])),
            ("bad", bad::ROOT)
        );
        let bxor = Request {
            root: 1,
            ..Request::new(Opcode::Allreduce, Dtype::F32, ReduceOp::Bxor, 1)
        };
        assert_eq!(
            code(dev.check(&bxor, &[], &[])),
            ("unsupported", unsupported::OP_FOR_DTYPE)
        );
        // An empty input of an in-place request is no input (as the device
        // counts it).
        let ip4 = Request {
            in_place: true,
            ..Request::new(Opcode::Allreduce, Dtype::F32, ReduceOp::Sum, 4)
        };
        assert_eq!(code(dev.check(&ip4, &[s(0, 0)], &[s(16, 16)])), ("ok", 0));
        // Segments are counted after the split at page boundaries: one
        // slice over two pages is two segments ...
        let f32s = |n| Request::new(Opcode::Allreduce, Dtype::F32, ReduceOp::Sum, n);
        assert_eq!(
            code(dev.check(&f32s(1024), &[s(2048, 4096)], &[s(8192, 4096)])),
            ("ok", 0)
        );
        assert_eq!(
            code(dev.check(&f32s(2048), &[s(0, 8192)], &[s(4096, 8192)])),
            ("too_big", too_big::SEGMENTS)
        );
        // ... and a piece that cuts an element is misaligned, although the
        // slice as a whole is a whole number of elements.
        assert_eq!(
            code(dev.check(&f32s(2), &[s(4094, 8)], &[s(0, 8)])),
            ("bad", bad::SEGMENT_ALIGN)
        );
        // The fake device gets what the check let through, split.
        let mut input = dev.alloc(4 * 4096).unwrap();
        let ipad = (4096 - input.device_addr() as usize % 4096) % 4096;
        for (i, x) in input.as_elems_mut::<u32>().iter_mut().enumerate() {
            *x = i as u32;
        }
        let output = dev.alloc(4 * 4096).unwrap();
        let opad = (4096 - output.device_addr() as usize % 4096) % 4096;
        let r = Request::new(Opcode::Allreduce, Dtype::U32, ReduceOp::Sum, 1024);
        let (i, o) = (input.slice(ipad + 2048, 4096), output.slice(opad, 4096));
        dev.check(&r, std::slice::from_ref(&i), std::slice::from_ref(&o))
            .unwrap();
        dev.call(0, &r, &[i], &[o], Some(Duration::from_secs(10)))
            .unwrap();
        let first = (ipad + 2048) as u32 / 4;
        let want: Vec<u32> = (first..first + 1024).collect();
        assert_eq!(&output.as_elems::<u32>()[opad / 4..opad / 4 + 1024], want);
    }

    #[test]
    fn chains_longer_than_the_queue_go_indirect() {
        let mut config = world_of_one();
        config.max_segments = 64.into();
        // 16 descriptors per queue; 2 + 2 x 12 pages = 26 descriptors.
        let n = 12 * 4096;
        let run = |features: u64| {
            let (dev, _) = open_fake_with(config, &opts(true), Some(4096), features);
            let mut input = dev.alloc(n).unwrap();
            for (i, x) in input.as_elems_mut::<u32>().iter_mut().enumerate() {
                *x = (i as u32).wrapping_mul(2_654_435_761);
            }
            let output = dev.alloc(n).unwrap();
            let r = Request::new(Opcode::Allreduce, Dtype::U32, ReduceOp::Sum, n as u64 / 4);
            let got = dev.call(
                0,
                &r,
                &[input.all()],
                &[output.all()],
                Some(Duration::from_secs(10)),
            );
            let same = got.is_ok() && output.as_slice() == input.as_slice();
            (dev.features(), got, same)
        };
        let (features, got, same) = run(u64::MAX);
        assert_ne!(features & bit(VIRTIO_RING_F_INDIRECT_DESC), 0);
        got.unwrap();
        assert!(same, "the output is not the input");
        let (features, got, _) = run(!bit(VIRTIO_RING_F_INDIRECT_DESC));
        assert_eq!(features & bit(VIRTIO_RING_F_INDIRECT_DESC), 0);
        let err = got.unwrap_err();
        assert!(
            err.to_string()
                .contains("does not offer indirect descriptors"),
            "{err}"
        );
    }

    #[test]
    fn a_group_id_change_ends_the_wait_for_a_dropped_request() {
        for poll in [true, false] {
            let (dev, shared) = open_fake(world_of_one(), &opts(poll));
            // A new generation alone: the device may have taken the request
            // after the change, so the wait goes on until it answers.
            let h = dev.submit(0, &held_barrier(), &[], &[]).unwrap();
            std::thread::scope(|s| {
                s.spawn(|| {
                    std::thread::sleep(Duration::from_millis(30));
                    shared.generation.store(2, Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(60));
                    shared.release.store(true, Ordering::Release);
                });
                dev.wait(h, Some(Duration::from_secs(20))).unwrap();
            });
            shared.release.store(false, Ordering::Release);

            let h = dev.submit(0, &held_barrier(), &[], &[]).unwrap();
            let t = Instant::now();
            let err = std::thread::scope(|s| {
                s.spawn(|| {
                    std::thread::sleep(Duration::from_millis(30));
                    shared.group.store(9, Ordering::Relaxed);
                });
                dev.wait(h, Some(Duration::from_secs(20))).unwrap_err()
            });
            assert!(
                matches!(
                    err,
                    Error::RequestDropped {
                        generation: (2, 2),
                        group: (7, 9)
                    }
                ),
                "{err}"
            );
            assert!(err.to_string().contains("group id changed from 0x7 to 0x9"));
            assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
            // A request posted after the change, before the driver read it,
            // is not taken for a dropped one: it completes when the device
            // answers.
            shared.group.store(11, Ordering::Relaxed);
            let h2 = dev.submit(0, &held_barrier(), &[], &[]).unwrap();
            std::thread::scope(|s| {
                s.spawn(|| {
                    std::thread::sleep(Duration::from_millis(40));
                    shared.release.store(true, Ordering::Release);
                });
                dev.wait(h2, Some(Duration::from_secs(20))).unwrap();
            });
        }
    }

    #[test]
    fn a_completion_in_the_ring_wins_over_a_generation_change() {
        let (dev, shared) = open_fake(world_of_one(), &opts(true));
        // The device completes (PEER_LOST) and then shows the new generation.
        let mut hdr = held_barrier().header();
        hdr.tag = (FAIL | u64::from(Status::PeerLost.raw()) | 1 << 16).into();
        let h = dev
            .submit_raw(0, &hdr, &[RawDesc::Header, RawDesc::Response])
            .unwrap();
        shared.generation.store(2, Ordering::Relaxed);
        assert!(matches!(
            dev.wait(h, None),
            Err(Error::PeerLost { peer: 1 })
        ));
    }

    #[test]
    fn every_wait_is_bounded() {
        for poll in [true, false] {
            let (mut dev, _shared) = open_fake(world_of_one(), &opts(poll));
            dev.wait_margin = Duration::from_millis(50);
            let timed = Request {
                timeout_ms: 30,
                ..held_barrier()
            };
            let h = dev.submit(0, &timed, &[], &[]).unwrap();
            let t = Instant::now();
            let err = dev.wait(h, None).unwrap_err();
            assert!(
                matches!(err, Error::Unanswered { after } if after == Duration::from_millis(80)),
                "{err}"
            );
            assert!(t.elapsed() >= Duration::from_millis(70));
            assert!(err
                .to_string()
                .contains("has not completed the request within 80ms"));
            // A caller's shorter timeout is still a plain WaitTimeout.
            let h = dev.submit(0, &timed, &[], &[]).unwrap();
            assert!(matches!(
                dev.wait(h, Some(Duration::from_millis(5))),
                Err(Error::WaitTimeout)
            ));
        }
    }
}
