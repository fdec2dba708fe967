//! Buffers in device-visible memory: the [`Element`] types, [`DmaBuf`] and
//! its [`BufSlice`]s, the shared `BufMem` that counts the CPU borrows and the
//! requests in flight, and the [`Lease`] a posted request holds on a buffer;
//! the `Device` methods that make buffers and take the leases.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::dma::{DmaAlloc, DmaMemory, DMA_ALIGN};
use crate::error::{Error, Result};

use super::open::Engine;
use super::{Device, Dtype, RawDesc};

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

/// Converts `data` in place between the CPU's byte order and the
/// little-endian order in which the device stores elements (spec
/// 5.X.6.5.1): nothing on a little-endian CPU (every one the project runs
/// on); on a big-endian one, a byte swap of every element, which is its own
/// inverse, so a second call converts back. The typed collectives that
/// reduce call it around the raw ones.
pub fn le_in_place<T: Element>(data: &mut [T]) {
    if cfg!(target_endian = "big") {
        for e in bytes_of_mut(data).chunks_exact_mut(std::mem::size_of::<T>()) {
            e.reverse();
        }
    }
}

pub(super) fn bytes_of<T: Element>(data: &[T]) -> &[u8] {
    // SAFETY: every `Element` is a plain number type without padding, so its
    // bytes may be read as `u8`; the length is the slice's size in bytes.
    unsafe { std::slice::from_raw_parts(data.as_ptr().cast(), std::mem::size_of_val(data)) }
}

pub(super) fn bytes_of_mut<T: Element>(data: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `bytes_of`; moreover every bit pattern is a valid value
    // of every `Element` type, so writing arbitrary bytes is sound.
    unsafe { std::slice::from_raw_parts_mut(data.as_mut_ptr().cast(), std::mem::size_of_val(data)) }
}

/// The memory of one [`DmaBuf`], shared with its [`BufSlice`]s and with the
/// requests in flight that use it, and the record of who may touch it.
pub(super) struct BufMem {
    pub(super) alloc: DmaAlloc,
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
///
/// [`Handle`]: super::Handle
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
    pub(super) mem: Arc<BufMem>,
    pub(super) offset: usize,
    pub(super) len: usize,
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

impl Device {
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
        let Engine::Kernel(k) = &self.engine else {
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

    /// One lease per buffer of `chain`, a writing one if any descriptor
    /// writes it.
    pub(super) fn leases(&self, chain: &[RawDesc]) -> Result<Vec<Lease>> {
        let mut uses: Vec<(&Arc<BufMem>, bool)> = Vec::new();
        for d in chain {
            if let RawDesc::Read(s) | RawDesc::Write(s) = d {
                let m = s.mem.alloc.memory();
                let caller = matches!(&self.engine, Engine::Kernel(k) if same_memory(m, &k.caller));
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
}

fn same_memory(a: &Arc<dyn DmaMemory>, b: &Arc<dyn DmaMemory>) -> bool {
    std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(b))
}
