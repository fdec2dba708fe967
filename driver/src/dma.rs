//! Device-visible (DMA) memory.
//!
//! [`DmaMemory`] is what the virtqueue and the collective API need from a
//! transport: memory that the device can read and write, with a host pointer
//! for the driver and a device address for descriptors. It says nothing about
//! where the memory comes from. The host transport shares one memfd with the
//! vhost-user backend ([`MemfdMemory`]); the device address is then the
//! guest-physical address of the region as announced in the memory table.
//! A PCI transport would take hugepages and translate through pagemap; that is
//! why a buffer's device addresses are asked for range by range
//! ([`DmaMemory::device_ranges`]) rather than assumed contiguous.
//!
//! [`RegionAllocator`] is the allocator over one contiguous region: a first-fit
//! free list with coalescing, every block a multiple of [`DMA_ALIGN`].

use std::collections::BTreeMap;
use std::ffi::CStr;
use std::fmt;
use std::num::NonZeroUsize;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use nix::sys::memfd::{memfd_create, MemFdCreateFlag};
use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};

/// Smallest alignment and size granule of every allocation (a cache line,
/// so that two buffers never share a line the device writes).
pub const DMA_ALIGN: usize = 64;
/// Alignment of the virtqueue rings.
pub const PAGE_SIZE: usize = 4096;

/// Errors of the DMA memory layer.
#[derive(Debug, thiserror::Error)]
pub enum DmaError {
    /// No free block is large enough.
    #[error("out of device-visible memory: {requested} bytes requested, largest free block {largest_free}")]
    OutOfMemory {
        requested: usize,
        largest_free: usize,
    },
    /// The alignment is zero or not a power of two.
    #[error("alignment {0} is not a power of two")]
    BadAlign(usize),
    /// A region of zero bytes was asked for.
    #[error("empty memory region")]
    Empty,
    /// memfd_create failed.
    #[error("cannot create the memfd")]
    Memfd(#[source] nix::Error),
    /// ftruncate on the memfd failed.
    #[error("cannot size the memfd to {bytes} bytes")]
    Truncate {
        bytes: usize,
        #[source]
        source: nix::Error,
    },
    /// This memory only wraps what its caller owns ([`CallerMemory`]).
    #[error("this memory allocates nothing: it only wraps the caller's own")]
    NotAnAllocator,
    /// mmap failed.
    #[error("cannot map {bytes} bytes of the memfd")]
    Map {
        bytes: usize,
        #[source]
        source: nix::Error,
    },
}

/// One allocation as returned by [`DmaMemory::alloc`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmaRegion {
    /// Host pointer to the first byte.
    pub vaddr: NonNull<u8>,
    /// Device address of the first byte.
    pub paddr: u64,
    /// Length in bytes (at least what was asked for).
    pub len: usize,
}

/// A source of device-visible memory.
///
/// # Safety
///
/// Implementors promise that a region returned by `alloc` is valid for reads
/// and writes of `len` bytes at `vaddr` until it is passed to `dealloc`, that
/// no two live regions overlap, and that `device_ranges` reports addresses
/// at which the device sees exactly those bytes.
pub unsafe trait DmaMemory: Send + Sync + fmt::Debug {
    /// Allocates `len` bytes aligned to `align` (a power of two, at least
    /// [`DMA_ALIGN`] is used) in host and device address space alike.
    fn alloc(&self, len: usize, align: usize) -> Result<DmaRegion, DmaError>;

    /// Returns a region to the free pool.
    ///
    /// # Safety
    ///
    /// `region` must come from `alloc` of this object, must not have been
    /// freed before, and neither the driver nor the device may use it after.
    unsafe fn dealloc(&self, region: &DmaRegion);

    /// Calls `f(device_address, length)` for each device-contiguous piece of
    /// `len` bytes at `offset` inside `region`, in order. The default fits
    /// memory that is contiguous in device address space.
    fn device_ranges(
        &self,
        region: &DmaRegion,
        offset: usize,
        len: usize,
        f: &mut dyn FnMut(u64, usize),
    ) {
        debug_assert!(offset.checked_add(len).is_some_and(|end| end <= region.len));
        f(region.paddr + offset as u64, len);
    }
}

/// An owned allocation of device-visible memory, zeroed at allocation and
/// returned to its [`DmaMemory`] on drop.
pub struct DmaAlloc {
    mem: Arc<dyn DmaMemory>,
    region: DmaRegion,
}

// SAFETY: the region is plain memory owned by this value; the raw pointer is
// only an address, and all accesses through it are explicit (volatile or
// through slices whose borrows follow `&self`/`&mut self` of the owner).
unsafe impl Send for DmaAlloc {}
// SAFETY: as above; shared access only hands out `&[u8]` or raw pointers.
unsafe impl Sync for DmaAlloc {}

impl DmaAlloc {
    /// Allocates and zeroes `len` bytes (a zero `len` allocates one granule).
    pub fn new(mem: &Arc<dyn DmaMemory>, len: usize, align: usize) -> Result<Self, DmaError> {
        let region = mem.alloc(len.max(1), align)?;
        // SAFETY: `alloc` returned a region valid for writes of `region.len`
        // bytes that nothing else uses yet.
        unsafe { std::ptr::write_bytes(region.vaddr.as_ptr(), 0, region.len) };
        Ok(DmaAlloc {
            mem: Arc::clone(mem),
            region,
        })
    }

    /// The caller's own `len` bytes at `ptr` (not zeroed), device address
    /// the virtual address: for [`CallerMemory`], whose `dealloc` leaves
    /// them to their owner.
    ///
    /// # Safety
    ///
    /// `mem` does not allocate (its `dealloc` is a no-op). `ptr` is valid
    /// for reads and writes of `len` bytes until this value is dropped and
    /// every request that used it has completed, and nothing else accesses
    /// those bytes while a request that writes them is in flight.
    pub unsafe fn borrowed(mem: &Arc<dyn DmaMemory>, ptr: NonNull<u8>, len: usize) -> Self {
        DmaAlloc {
            mem: Arc::clone(mem),
            region: DmaRegion {
                vaddr: ptr,
                paddr: ptr.as_ptr() as u64,
                len,
            },
        }
    }

    /// Host pointer to the first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.region.vaddr.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.region.len
    }

    /// True if the allocation has no bytes (never, see [`Self::new`]).
    pub fn is_empty(&self) -> bool {
        self.region.len == 0
    }

    /// Device address of the first byte.
    pub fn paddr(&self) -> u64 {
        self.region.paddr
    }

    /// The memory this allocation comes from.
    pub fn memory(&self) -> &Arc<dyn DmaMemory> {
        &self.mem
    }

    /// Device-contiguous pieces of `len` bytes at `offset` (see
    /// [`DmaMemory::device_ranges`]).
    pub fn device_ranges(&self, offset: usize, len: usize, f: &mut dyn FnMut(u64, usize)) {
        assert!(
            offset
                .checked_add(len)
                .is_some_and(|end| end <= self.region.len),
            "range {offset}+{len} outside a DMA allocation of {} bytes",
            self.region.len
        );
        self.mem.device_ranges(&self.region, offset, len, f);
    }
}

impl fmt::Debug for DmaAlloc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DmaAlloc")
            .field("paddr", &format_args!("{:#x}", self.region.paddr))
            .field("len", &self.region.len)
            .finish()
    }
}

impl Drop for DmaAlloc {
    fn drop(&mut self) {
        // SAFETY: the region came from `self.mem.alloc`, is freed only here,
        // and whoever could still use it (a posted request) holds this value.
        unsafe { self.mem.dealloc(&self.region) };
    }
}

/// Memory a caller already owns, seen by the device at its virtual
/// addresses: the kernel transport, whose module pins the pages of each
/// request itself. It allocates nothing; [`DmaAlloc::borrowed`] wraps the
/// caller's bytes, and dropping them gives nothing back.
#[derive(Debug, Default)]
pub struct CallerMemory;

// SAFETY: `alloc` hands out no region; every region of this memory comes
// from `DmaAlloc::borrowed`, whose contract makes the caller keep it valid,
// and its device address is its virtual address, as `device_ranges` (the
// default) reports.
unsafe impl DmaMemory for CallerMemory {
    fn alloc(&self, _len: usize, _align: usize) -> Result<DmaRegion, DmaError> {
        Err(DmaError::NotAnAllocator)
    }

    unsafe fn dealloc(&self, _region: &DmaRegion) {}
}

fn align_up(value: usize, align: usize) -> Option<usize> {
    Some(value.checked_add(align - 1)? & !(align - 1))
}

/// First-fit allocator of offsets in a region of `len` bytes. Blocks are
/// multiples of [`DMA_ALIGN`]; freed blocks merge with their neighbours.
#[derive(Debug)]
pub struct RegionAllocator {
    /// Free blocks: offset -> length; no two touch (they would be merged).
    free: BTreeMap<usize, usize>,
    len: usize,
    used: usize,
}

impl RegionAllocator {
    /// An allocator with all of `len` bytes (rounded down to [`DMA_ALIGN`]) free.
    pub fn new(len: usize) -> Self {
        let len = len & !(DMA_ALIGN - 1);
        let mut free = BTreeMap::new();
        if len > 0 {
            free.insert(0, len);
        }
        RegionAllocator { free, len, used: 0 }
    }

    /// Bytes currently allocated.
    pub fn used(&self) -> usize {
        self.used
    }

    /// Size of the region.
    pub fn capacity(&self) -> usize {
        self.len
    }

    /// Allocates `len` bytes at an offset aligned to `align`; returns the
    /// offset and the rounded-up length.
    pub fn alloc(&mut self, len: usize, align: usize) -> Result<(usize, usize), DmaError> {
        if align == 0 || !align.is_power_of_two() {
            return Err(DmaError::BadAlign(align));
        }
        let align = align.max(DMA_ALIGN);
        let out_of_memory = |free: &BTreeMap<usize, usize>| DmaError::OutOfMemory {
            requested: len,
            largest_free: free.values().copied().max().unwrap_or(0),
        };
        let size = align_up(len.max(1), DMA_ALIGN).ok_or_else(|| out_of_memory(&self.free))?;
        let found = self.free.iter().find_map(|(&off, &blen)| {
            let start = align_up(off, align)?;
            let end = start.checked_add(size)?;
            (end <= off + blen).then_some((off, blen, start, end))
        });
        let Some((off, blen, start, end)) = found else {
            return Err(out_of_memory(&self.free));
        };
        self.free.remove(&off);
        if start > off {
            self.free.insert(off, start - off);
        }
        if end < off + blen {
            self.free.insert(end, off + blen - end);
        }
        self.used += size;
        Ok((start, size))
    }

    /// Returns a block given by [`Self::alloc`].
    ///
    /// # Panics
    ///
    /// If the block overlaps a free block or lies outside the region (a
    /// double free or a foreign block): continuing would hand the same
    /// memory out twice.
    pub fn free(&mut self, offset: usize, size: usize) {
        assert!(
            offset + size <= self.len,
            "freeing {offset}+{size} outside region"
        );
        let mut start = offset;
        let mut end = offset + size;
        if let Some((&poff, &plen)) = self.free.range(..=offset).next_back() {
            assert!(poff + plen <= offset, "double free of block at {offset}");
            if poff + plen == offset {
                self.free.remove(&poff);
                start = poff;
            }
        }
        if let Some((&noff, &nlen)) = self.free.range(offset..).next() {
            assert!(noff >= end, "double free of block at {offset}");
            if noff == end {
                self.free.remove(&noff);
                end = noff + nlen;
            }
        }
        self.free.insert(start, end - start);
        self.used -= size;
    }
}

/// Device-visible memory in one shared memfd mapping, for the host transport.
///
/// The device address of offset `o` is `guest_base + o`: the region appears
/// to the backend as guest-physical memory at `guest_base`.
pub struct MemfdMemory {
    fd: OwnedFd,
    base: NonNull<u8>,
    len: usize,
    guest_base: u64,
    alloc: Mutex<RegionAllocator>,
}

// SAFETY: the mapping is owned by this value and lives until drop; the
// allocator state is behind a mutex, and the memory itself is only reached
// through regions handed out by `alloc`.
unsafe impl Send for MemfdMemory {}
// SAFETY: as above.
unsafe impl Sync for MemfdMemory {}

impl MemfdMemory {
    /// Creates a memfd of `len` bytes (rounded up to a page), maps it shared,
    /// and places it at device address `guest_base`.
    pub fn new(len: usize, guest_base: u64) -> Result<Self, DmaError> {
        let len = align_up(len, PAGE_SIZE).ok_or(DmaError::Empty)?;
        let nz_len = NonZeroUsize::new(len).ok_or(DmaError::Empty)?;
        const NAME: &CStr = c"dmlc-guest-dma";
        let fd = memfd_create(NAME, MemFdCreateFlag::MFD_CLOEXEC).map_err(DmaError::Memfd)?;
        let size = libc::off_t::try_from(len).map_err(|_| DmaError::Truncate {
            bytes: len,
            source: nix::Error::EFBIG,
        })?;
        nix::unistd::ftruncate(&fd, size)
            .map_err(|source| DmaError::Truncate { bytes: len, source })?;
        // SAFETY: a fresh shared mapping of a file we own; no existing memory
        // is replaced (no MAP_FIXED).
        let ptr = unsafe {
            mmap(
                None,
                nz_len,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                &fd,
                0,
            )
        }
        .map_err(|source| DmaError::Map { bytes: len, source })?;
        Ok(MemfdMemory {
            fd,
            base: ptr.cast(),
            len,
            guest_base,
            alloc: Mutex::new(RegionAllocator::new(len)),
        })
    }

    /// The memfd (for the vhost-user memory table).
    /// A memfd mapping whose device addresses are its own virtual
    /// addresses: for a device that reaches this process's memory through
    /// its kernel driver (`crate::kernel`), which pins the pages.
    pub fn at_own_addresses(len: usize) -> Result<Self, DmaError> {
        let mut m = MemfdMemory::new(len, 0)?;
        m.guest_base = m.base.as_ptr() as u64;
        Ok(m)
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Host address of the mapping.
    pub fn base(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Size of the mapping.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True if the mapping is empty (never).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Device address of the first byte.
    pub fn guest_base(&self) -> u64 {
        self.guest_base
    }

    /// Bytes allocated at the moment.
    pub fn used(&self) -> usize {
        self.allocator().used()
    }

    fn allocator(&self) -> std::sync::MutexGuard<'_, RegionAllocator> {
        // The allocator's invariants hold between statements, so a panic in
        // another thread leaves it usable.
        self.alloc.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl fmt::Debug for MemfdMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemfdMemory")
            .field("len", &self.len)
            .field("guest_base", &format_args!("{:#x}", self.guest_base))
            .finish()
    }
}

// SAFETY: regions are disjoint blocks of the mapping handed out by the
// allocator; the mapping lives as long as `self`, and every `DmaAlloc` keeps
// its memory object alive through an `Arc`.
unsafe impl DmaMemory for MemfdMemory {
    fn alloc(&self, len: usize, align: usize) -> Result<DmaRegion, DmaError> {
        let (off, size) = self.allocator().alloc(len, align)?;
        // SAFETY: `off < self.len`, so the result stays inside the mapping.
        let vaddr = unsafe { self.base.add(off) };
        Ok(DmaRegion {
            vaddr,
            paddr: self.guest_base + off as u64,
            len: size,
        })
    }

    unsafe fn dealloc(&self, region: &DmaRegion) {
        let off = region.vaddr.as_ptr() as usize - self.base.as_ptr() as usize;
        self.allocator().free(off, region.len);
    }
}

impl Drop for MemfdMemory {
    fn drop(&mut self) {
        // SAFETY: the mapping was made in `new` with this length; every
        // region into it holds an `Arc` to `self`, so none is left.
        if let Err(e) = unsafe { munmap(self.base.cast(), self.len) } {
            log::warn!("munmap of the DMA region failed: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocator_aligns_and_rounds() {
        let mut a = RegionAllocator::new(1 << 20);
        let (o1, s1) = a.alloc(1, 1).unwrap();
        assert_eq!((o1, s1), (0, 64));
        let (o2, s2) = a.alloc(100, 64).unwrap();
        assert_eq!((o2, s2), (64, 128));
        let (o3, _) = a.alloc(10, 4096).unwrap();
        assert_eq!(o3, 4096);
        // The gap before the page-aligned block is still usable.
        let (o4, _) = a.alloc(64, 64).unwrap();
        assert_eq!(o4, 192);
        assert_eq!(a.used(), 64 + 128 + 64 + 64);
        assert!(matches!(a.alloc(10, 3), Err(DmaError::BadAlign(3))));
    }

    #[test]
    fn allocator_coalesces_and_reports_exhaustion() {
        let mut a = RegionAllocator::new(4096);
        let blocks: Vec<_> = (0..4).map(|_| a.alloc(1024, 64).unwrap()).collect();
        match a.alloc(64, 64) {
            Err(DmaError::OutOfMemory {
                requested: 64,
                largest_free: 0,
            }) => {}
            other => panic!("expected out of memory, got {other:?}"),
        }
        // Free 1 and 2, then 0 and 3: all four merge into one block again.
        a.free(blocks[1].0, blocks[1].1);
        a.free(blocks[2].0, blocks[2].1);
        assert_eq!(a.alloc(2048, 64).unwrap(), (1024, 2048));
        a.free(1024, 2048);
        a.free(blocks[0].0, blocks[0].1);
        a.free(blocks[3].0, blocks[3].1);
        assert_eq!(a.used(), 0);
        assert_eq!(a.free.len(), 1);
        assert_eq!(a.alloc(4096, 4096).unwrap(), (0, 4096));
    }

    #[test]
    #[should_panic(expected = "double free")]
    fn allocator_catches_double_free() {
        let mut a = RegionAllocator::new(4096);
        let (o, s) = a.alloc(128, 64).unwrap();
        let _keep = a.alloc(128, 64).unwrap();
        a.free(o, s);
        a.free(o, s);
    }

    #[test]
    fn memfd_memory_allocates_shared_zeroed_blocks() {
        let mem: Arc<dyn DmaMemory> = Arc::new(MemfdMemory::new(1 << 16, 0x4000_0000).unwrap());
        let a = DmaAlloc::new(&mem, 100, 64).unwrap();
        let b = DmaAlloc::new(&mem, 4096, PAGE_SIZE).unwrap();
        assert_eq!(a.paddr(), 0x4000_0000);
        assert_eq!(a.len(), 128);
        assert_eq!(b.paddr() % PAGE_SIZE as u64, 0);
        // SAFETY: `a` owns 128 bytes at `as_ptr`.
        let bytes = unsafe { std::slice::from_raw_parts_mut(a.as_ptr(), a.len()) };
        assert!(bytes.iter().all(|&x| x == 0));
        bytes.fill(0xab);
        let mut ranges = Vec::new();
        a.device_ranges(8, 16, &mut |p, l| ranges.push((p, l)));
        assert_eq!(ranges, [(0x4000_0008, 16)]);
        drop(a);
        // The freed block is handed out again, zeroed.
        let c = DmaAlloc::new(&mem, 64, 64).unwrap();
        assert_eq!(c.paddr(), 0x4000_0000);
        // SAFETY: `c` owns 64 bytes at `as_ptr`.
        let bytes = unsafe { std::slice::from_raw_parts(c.as_ptr(), c.len()) };
        assert!(bytes.iter().all(|&x| x == 0));
        assert!(matches!(
            DmaAlloc::new(&mem, 1 << 20, 64),
            Err(DmaError::OutOfMemory { .. })
        ));
    }
}
