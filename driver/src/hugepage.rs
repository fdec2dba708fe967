//! Device-visible memory from 2 MiB hugepages, for the PCI transport.
//!
//! A userspace driver in a guest without an IOMMU gives the device guest
//! physical addresses. Hugepages are the one kind of memory whose physical
//! address a process can learn and rely on: they are never swapped out, and
//! `/proc/self/pagemap` (root only) tells where each one is. A mapping of
//! several hugepages is contiguous in the process but not in physical
//! memory, so [`HugepageMemory`] translates page by page:
//! [`DmaMemory::device_ranges`] splits a buffer at every hugepage boundary
//! where the next page does not follow physically.
//!
//! Every allocation of up to one hugepage stays inside one hugepage, so a
//! ring, a header slot table or a small buffer is physically contiguous and
//! its [`DmaRegion::paddr`] alone describes it. Larger allocations start on a
//! hugepage boundary.
//!
//! The mapping is `MAP_SHARED | MAP_ANONYMOUS | MAP_HUGETLB` with
//! `MAP_POPULATE` (every page is faulted in before its address is read),
//! `mlock`ed, and `MADV_DONTFORK`, so that a child process neither shares
//! the pages nor makes the parent's copy-on-write.

use std::fmt;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::Mutex;

use crate::dma::{DmaError, DmaMemory, DmaRegion, RegionAllocator, DMA_ALIGN};

/// Size of one hugepage.
pub const HUGEPAGE_SIZE: usize = 2 << 20;

/// `MAP_HUGE_2MB` (log2 of the page size shifted by `MAP_HUGE_SHIFT`): asks
/// for 2 MiB pages whatever the system's default hugepage size.
const MAP_HUGE_2MB: libc::c_int = 21 << 26;

/// Where the kernel describes the 2 MiB hugepage pool.
const POOL_DIR: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB";

/// Errors of the hugepage memory.
#[derive(Debug, thiserror::Error)]
pub enum HugepageError {
    /// Physical addresses are only visible to root.
    #[error("physical addresses need root (running as uid {uid})")]
    NotRoot { uid: u32 },
    /// The pool has too few free pages.
    #[error(
        "not enough free 2 MiB hugepages: {needed} needed for {bytes} bytes of DMA memory, \
         {free} free of {total}; reserve more with hugepages=N on the kernel command line \
         or `echo N > /proc/sys/vm/nr_hugepages`, or ask for less DMA memory"
    )]
    NoHugepages {
        bytes: usize,
        needed: usize,
        free: usize,
        total: usize,
    },
    /// A zero-byte region was asked for.
    #[error("empty hugepage region")]
    Empty,
    /// mmap failed for another reason than a short pool.
    #[error("cannot map {pages} hugepages")]
    Map {
        pages: usize,
        #[source]
        source: io::Error,
    },
    /// A file in /proc or /sys could not be read.
    #[error("cannot read {path}")]
    Read {
        path: String,
        #[source]
        source: io::Error,
    },
    /// The kernel reports the page as not present although it was populated.
    #[error("page at {vaddr:#x} is not present in /proc/self/pagemap")]
    NotPresent { vaddr: u64 },
    /// pagemap reports page frame 0: the kernel hides frame numbers from
    /// processes without CAP_SYS_ADMIN.
    #[error("/proc/self/pagemap hides physical addresses (CAP_SYS_ADMIN needed)")]
    Hidden,
    /// A hugepage whose physical address is not 2 MiB aligned is not one.
    #[error("page at {vaddr:#x} has physical address {paddr:#x}, not 2 MiB aligned")]
    Misaligned { vaddr: u64, paddr: u64 },
}

/// The state of the 2 MiB hugepage pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HugepagePool {
    /// Pages in the pool (`nr_hugepages`).
    pub total: usize,
    /// Pages free and not promised to a mapping (`free_hugepages - resv_hugepages`).
    pub free: usize,
}

impl HugepagePool {
    /// Reads the pool from sysfs. A kernel without hugetlbfs has no pool:
    /// that reads as zero pages.
    pub fn read() -> Result<HugepagePool, HugepageError> {
        Self::read_from(Path::new(POOL_DIR))
    }

    fn read_from(dir: &Path) -> Result<HugepagePool, HugepageError> {
        if !dir.exists() {
            return Ok(HugepagePool { total: 0, free: 0 });
        }
        let read = |name: &str| -> Result<usize, HugepageError> {
            let path = dir.join(name);
            let text = std::fs::read_to_string(&path).map_err(|source| HugepageError::Read {
                path: path.display().to_string(),
                source,
            })?;
            text.trim().parse().map_err(|_| HugepageError::Read {
                path: path.display().to_string(),
                source: io::Error::new(io::ErrorKind::InvalidData, "not a number"),
            })
        };
        let total = read("nr_hugepages")?;
        let free = read("free_hugepages")?.saturating_sub(read("resv_hugepages")?);
        Ok(HugepagePool { total, free })
    }

    /// Bytes of DMA memory the free pages can hold.
    pub fn free_bytes(&self) -> usize {
        self.free.saturating_mul(HUGEPAGE_SIZE)
    }
}

/// Page frame number of a `/proc/self/pagemap` entry, or why there is none.
///
/// Bit 63: present; bit 62: swapped; bits 0-54: the page frame number
/// (zeroed by the kernel for processes without CAP_SYS_ADMIN).
pub fn pagemap_pfn(entry: u64, vaddr: u64) -> Result<u64, HugepageError> {
    const PRESENT: u64 = 1 << 63;
    const PFN_MASK: u64 = (1 << 55) - 1;
    if entry & PRESENT == 0 {
        return Err(HugepageError::NotPresent { vaddr });
    }
    match entry & PFN_MASK {
        0 => Err(HugepageError::Hidden),
        pfn => Ok(pfn),
    }
}

/// Alignment that keeps an allocation of `len` bytes inside one hugepage
/// when it fits in one, or starts it on a hugepage boundary when it does
/// not. A block of at most `p` bytes aligned to `p` (a power of two up to
/// the hugepage size) never crosses a multiple of `p`, and so never a
/// hugepage boundary.
pub fn placement_align(len: usize, align: usize) -> usize {
    let align = align.max(DMA_ALIGN);
    if len <= HUGEPAGE_SIZE {
        align.max(len.next_power_of_two())
    } else {
        align.max(HUGEPAGE_SIZE)
    }
}

/// Calls `f(physical address, length)` for the physically contiguous runs
/// of `len` bytes at byte `offset` of a mapping whose hugepage `i` is at
/// physical address `pages[i]`. Adjacent pages that follow each other
/// physically form one run.
pub fn physical_runs(pages: &[u64], offset: usize, len: usize, f: &mut dyn FnMut(u64, usize)) {
    let mut pos = offset;
    let end = offset + len;
    let mut run: Option<(u64, usize)> = None;
    while pos < end {
        let page = pos / HUGEPAGE_SIZE;
        let within = pos % HUGEPAGE_SIZE;
        let n = (HUGEPAGE_SIZE - within).min(end - pos);
        let addr = pages[page] + within as u64;
        run = match run {
            Some((start, rlen)) if start + rlen as u64 == addr => Some((start, rlen + n)),
            Some((start, rlen)) => {
                f(start, rlen);
                Some((addr, n))
            }
            None => Some((addr, n)),
        };
        pos += n;
    }
    if let Some((start, rlen)) = run {
        f(start, rlen);
    }
}

/// Device-visible memory in hugepages, with guest-physical device addresses.
pub struct HugepageMemory {
    base: NonNull<u8>,
    len: usize,
    /// Physical address of each hugepage of the mapping.
    pages: Box<[u64]>,
    alloc: Mutex<RegionAllocator>,
}

// SAFETY: the mapping is owned by this value and lives until drop; the
// allocator is behind a mutex, and the memory is only reached through
// regions handed out by `alloc`.
unsafe impl Send for HugepageMemory {}
// SAFETY: as above.
unsafe impl Sync for HugepageMemory {}

impl HugepageMemory {
    /// Maps enough 2 MiB hugepages for `bytes` (at least one), locks them
    /// and reads their physical addresses. Needs root.
    pub fn new(bytes: usize) -> Result<Self, HugepageError> {
        if bytes == 0 {
            return Err(HugepageError::Empty);
        }
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        if uid != 0 {
            return Err(HugepageError::NotRoot { uid });
        }
        let pages = bytes.div_ceil(HUGEPAGE_SIZE);
        let len = pages * HUGEPAGE_SIZE;
        let short = |pool: HugepagePool| HugepageError::NoHugepages {
            bytes,
            needed: pages,
            free: pool.free,
            total: pool.total,
        };
        let pool = HugepagePool::read()?;
        // SAFETY: a fresh anonymous mapping; no existing memory is replaced
        // (no MAP_FIXED), and the result is checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED
                    | libc::MAP_ANONYMOUS
                    | libc::MAP_HUGETLB
                    | MAP_HUGE_2MB
                    | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            let source = io::Error::last_os_error();
            // A short pool fails the reservation with ENOMEM (or EINVAL on
            // a kernel without 2 MiB pages at all).
            return Err(match source.raw_os_error() {
                Some(libc::ENOMEM) => short(pool),
                Some(libc::EINVAL) if pool.total == 0 => short(pool),
                _ => HugepageError::Map { pages, source },
            });
        }
        let base = NonNull::new(ptr.cast::<u8>()).ok_or(HugepageError::Map {
            pages,
            source: io::Error::other("mmap returned a null pointer"),
        })?;
        let mut mem = HugepageMemory {
            base,
            len,
            pages: Box::default(),
            alloc: Mutex::new(RegionAllocator::new(len)),
        };
        // SAFETY: the range is exactly our mapping.
        if unsafe { libc::mlock(ptr, len) } != 0 {
            // Hugetlb pages are never swapped; the lock is belt and braces.
            log::debug!(
                "mlock of the hugepages failed: {}",
                io::Error::last_os_error()
            );
        }
        // SAFETY: the range is exactly our mapping.
        if unsafe { libc::madvise(ptr, len, libc::MADV_DONTFORK) } != 0 {
            log::debug!(
                "madvise(MADV_DONTFORK) failed: {}",
                io::Error::last_os_error()
            );
        }
        mem.pages = mem.read_physical()?;
        log::debug!(
            "{pages} hugepages at {:#x}, {} physically contiguous runs",
            base.as_ptr() as usize,
            mem.runs()
        );
        Ok(mem)
    }

    fn read_physical(&self) -> Result<Box<[u64]>, HugepageError> {
        const PAGEMAP: &str = "/proc/self/pagemap";
        let read_error = |source| HugepageError::Read {
            path: PAGEMAP.into(),
            source,
        };
        let file = File::open(PAGEMAP).map_err(read_error)?;
        // SAFETY: sysconf has no preconditions.
        let small = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
            n if n > 0 => n as u64,
            _ => 4096,
        };
        let mut pages = Vec::with_capacity(self.len / HUGEPAGE_SIZE);
        for i in 0..self.len / HUGEPAGE_SIZE {
            let vaddr = self.base.as_ptr() as u64 + (i * HUGEPAGE_SIZE) as u64;
            // The page must be present: MAP_POPULATE faulted it in, but
            // touch it anyway so a kernel that ignored the flag is no problem.
            // SAFETY: the first byte of hugepage `i` of our mapping.
            unsafe {
                std::ptr::write_volatile(self.base.as_ptr().add(i * HUGEPAGE_SIZE), 0);
            }
            let mut entry = [0u8; 8];
            file.read_exact_at(&mut entry, vaddr / small * 8)
                .map_err(read_error)?;
            let pfn = pagemap_pfn(u64::from_le_bytes(entry), vaddr)?;
            let paddr = pfn * small;
            if !paddr.is_multiple_of(HUGEPAGE_SIZE as u64) {
                return Err(HugepageError::Misaligned { vaddr, paddr });
            }
            pages.push(paddr);
        }
        Ok(pages.into_boxed_slice())
    }

    /// Size of the mapping in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True if the mapping is empty (never).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Physical address of each hugepage.
    pub fn physical_pages(&self) -> &[u64] {
        &self.pages
    }

    /// Number of physically contiguous runs the mapping consists of.
    pub fn runs(&self) -> usize {
        let mut n = 0;
        physical_runs(&self.pages, 0, self.len, &mut |_, _| n += 1);
        n
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

    fn offset_of(&self, region: &DmaRegion) -> usize {
        region.vaddr.as_ptr() as usize - self.base.as_ptr() as usize
    }
}

impl fmt::Debug for HugepageMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HugepageMemory")
            .field("len", &self.len)
            .field("runs", &self.runs())
            .finish()
    }
}

// SAFETY: regions are disjoint blocks of the mapping handed out by the
// allocator; the mapping lives as long as `self` (every `DmaAlloc` holds an
// `Arc` to it); device addresses come from pagemap for pages that are
// locked and never move (hugetlb pages are not swapped, and the mapping is
// shared, so no copy-on-write replaces them).
unsafe impl DmaMemory for HugepageMemory {
    fn alloc(&self, len: usize, align: usize) -> Result<DmaRegion, DmaError> {
        if align == 0 || !align.is_power_of_two() {
            return Err(DmaError::BadAlign(align));
        }
        let (off, size) = self
            .allocator()
            .alloc(len, placement_align(len.max(1), align))?;
        // SAFETY: `off < self.len`, so the pointer stays inside the mapping.
        let vaddr = unsafe { self.base.add(off) };
        let paddr = self.pages[off / HUGEPAGE_SIZE] + (off % HUGEPAGE_SIZE) as u64;
        Ok(DmaRegion {
            vaddr,
            paddr,
            len: size,
        })
    }

    unsafe fn dealloc(&self, region: &DmaRegion) {
        let off = self.offset_of(region);
        self.allocator().free(off, region.len);
    }

    fn device_ranges(
        &self,
        region: &DmaRegion,
        offset: usize,
        len: usize,
        f: &mut dyn FnMut(u64, usize),
    ) {
        debug_assert!(offset.checked_add(len).is_some_and(|end| end <= region.len));
        physical_runs(&self.pages, self.offset_of(region) + offset, len, f);
    }
}

impl Drop for HugepageMemory {
    fn drop(&mut self) {
        // SAFETY: the mapping was made in `new` with this length; every
        // region into it holds an `Arc` to `self`, so none is left.
        if unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) } != 0 {
            log::warn!(
                "munmap of the hugepages failed: {}",
                io::Error::last_os_error()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn pagemap_entries_decode() {
        let present = 1u64 << 63;
        assert_eq!(pagemap_pfn(present | 0x1234, 0).unwrap(), 0x1234);
        // Bits 55-62 (soft-dirty, exclusive, file/shared, swapped) are not
        // part of the frame number.
        let flags = (1u64 << 55) | (1 << 56) | (1 << 61);
        assert_eq!(pagemap_pfn(present | flags | 0x7f, 0).unwrap(), 0x7f);
        let widest = (1u64 << 55) - 1;
        assert_eq!(pagemap_pfn(present | widest, 0).unwrap(), widest);
        assert!(matches!(
            pagemap_pfn(0x1234, 0x5000),
            Err(HugepageError::NotPresent { vaddr: 0x5000 })
        ));
        assert!(matches!(
            pagemap_pfn(present, 0),
            Err(HugepageError::Hidden)
        ));
        // Swapped (bit 62) without present: not usable.
        assert!(matches!(
            pagemap_pfn(1 << 62 | 5, 0),
            Err(HugepageError::NotPresent { .. })
        ));
    }

    fn runs(pages: &[u64], offset: usize, len: usize) -> Vec<(u64, usize)> {
        let mut v = Vec::new();
        physical_runs(pages, offset, len, &mut |a, l| v.push((a, l)));
        v
    }

    #[test]
    fn runs_split_at_physical_discontinuities() {
        let p = |n: u64| n * HUGEPAGE_SIZE as u64;
        // Pages 0 and 1 are adjacent physically; 2 is elsewhere; 3 follows 2.
        let pages = [p(10), p(11), p(40), p(41), p(7)];
        assert_eq!(runs(&pages, 100, 50), [(p(10) + 100, 50)]);
        // Across the adjacent boundary: one run.
        assert_eq!(
            runs(&pages, HUGEPAGE_SIZE - 8, 16),
            [(p(10) + (HUGEPAGE_SIZE - 8) as u64, 16)]
        );
        // Across page 1 -> 2: two runs.
        assert_eq!(
            runs(&pages, 2 * HUGEPAGE_SIZE - 8, 16),
            [(p(11) + (HUGEPAGE_SIZE - 8) as u64, 8), (p(40), 8)]
        );
        // Everything: 10-11, 40-41, 7.
        assert_eq!(
            runs(&pages, 0, 5 * HUGEPAGE_SIZE),
            [
                (p(10), 2 * HUGEPAGE_SIZE),
                (p(40), 2 * HUGEPAGE_SIZE),
                (p(7), HUGEPAGE_SIZE)
            ]
        );
        // A page followed physically by the previous one is not merged.
        assert_eq!(
            runs(&[p(5), p(4)], 0, 2 * HUGEPAGE_SIZE),
            [(p(5), HUGEPAGE_SIZE), (p(4), HUGEPAGE_SIZE)]
        );
        assert!(runs(&pages, 77, 0).is_empty());
        // Ending exactly at the end of the mapping.
        assert_eq!(
            runs(&pages, 5 * HUGEPAGE_SIZE - 1, 1),
            [(p(7) + (HUGEPAGE_SIZE - 1) as u64, 1)]
        );
    }

    /// Allocations placed with `placement_align` never straddle a hugepage
    /// boundary unless they are larger than a hugepage, and those start on
    /// one.
    #[test]
    fn placement_keeps_small_blocks_inside_one_page() {
        let mut a = RegionAllocator::new(16 * HUGEPAGE_SIZE);
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut live: Vec<(usize, usize)> = Vec::new();
        for round in 0..4000 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let len = match rng % 10 {
                0 => 1 + (rng >> 8) as usize % (3 * HUGEPAGE_SIZE),
                1..=3 => 1 + (rng >> 8) as usize % HUGEPAGE_SIZE,
                _ => 1 + (rng >> 8) as usize % (64 << 10),
            };
            let align = 1 << ((rng >> 40) % 13);
            if let Ok((off, size)) = a.alloc(len, placement_align(len, align)) {
                assert_eq!(off % align, 0);
                assert!(size >= len);
                if len <= HUGEPAGE_SIZE {
                    assert_eq!(
                        off / HUGEPAGE_SIZE,
                        (off + len - 1) / HUGEPAGE_SIZE,
                        "round {round}: {len} bytes at {off:#x} cross a hugepage"
                    );
                } else {
                    assert_eq!(off % HUGEPAGE_SIZE, 0);
                }
                live.push((off, size));
            }
            // Free a random block now and then to fragment the region.
            if !live.is_empty() && (rng >> 20).is_multiple_of(3) {
                let (off, size) = live.swap_remove((rng >> 24) as usize % live.len());
                a.free(off, size);
            }
        }
        assert_eq!(placement_align(100, 1), 128);
        assert_eq!(placement_align(10, 1), DMA_ALIGN);
        assert_eq!(placement_align(4096, 4096), 4096);
        assert_eq!(placement_align(16 << 10, 64), 16 << 10);
        assert_eq!(placement_align(HUGEPAGE_SIZE, 64), HUGEPAGE_SIZE);
        assert_eq!(placement_align(HUGEPAGE_SIZE + 1, 64), HUGEPAGE_SIZE);
        assert_eq!(placement_align(MIB + 1, 64), HUGEPAGE_SIZE);
    }

    #[test]
    fn pool_is_read_from_sysfs_files() {
        let dir = std::env::temp_dir().join(format!("dmlc-hugepool-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (name, value) in [
            ("nr_hugepages", "16\n"),
            ("free_hugepages", "12\n"),
            ("resv_hugepages", "2\n"),
        ] {
            std::fs::write(dir.join(name), value).unwrap();
        }
        let pool = HugepagePool::read_from(&dir).unwrap();
        assert_eq!(
            pool,
            HugepagePool {
                total: 16,
                free: 10
            }
        );
        assert_eq!(pool.free_bytes(), 20 * MIB);
        std::fs::write(dir.join("free_hugepages"), "x").unwrap();
        let err = HugepagePool::read_from(&dir).unwrap_err();
        assert!(err.to_string().contains("free_hugepages"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
        let none = HugepagePool::read_from(Path::new("/nonexistent/hugepages-2048kB")).unwrap();
        assert_eq!(none, HugepagePool { total: 0, free: 0 });
    }

    /// Asking for more pages than the pool can give fails with the advice
    /// on how to reserve them (or, unprivileged, with the root error).
    #[test]
    fn short_pool_is_reported_with_advice() {
        let pool = HugepagePool::read().unwrap();
        let overcommit: usize = std::fs::read_to_string("/proc/sys/vm/nr_overcommit_hugepages")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0);
        let pages = pool.free + overcommit + 1;
        let err = HugepageMemory::new(pages * HUGEPAGE_SIZE).unwrap_err();
        match err {
            HugepageError::NoHugepages { needed, .. } => {
                assert_eq!(needed, pages);
                let text = err.to_string();
                assert!(text.contains("hugepages=N"), "{text}");
                assert!(text.contains("/proc/sys/vm/nr_hugepages"), "{text}");
            }
            // SAFETY: geteuid has no preconditions.
            HugepageError::NotRoot { uid } => assert_ne!(unsafe { libc::geteuid() }, 0, "{uid}"),
            other => panic!("unexpected {other:?}"),
        }
        assert!(matches!(HugepageMemory::new(0), Err(HugepageError::Empty)));
    }
}
