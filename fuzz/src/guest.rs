//! A guest as the backend sees it: guest memory of one or two regions, one
//! split queue in it, and the driver side that writes descriptors and makes
//! a chain available.
//!
//! Region A (at guest address 0) holds the rings, the header and response
//! slots, an indirect-table area and a data area. An optional region B comes
//! after a hole (or right after A, so that buffers can cross from one
//! mapping into the other). Only the control area at the start of A is
//! written between runs, and it is cleared before every run, so one run
//! never sees what another left behind.

use std::sync::{Mutex, MutexGuard};

use vhost_device_dmlc::GuestMem;
use virtio_queue::{DescriptorChain, Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

/// Size of region A.
pub const A_SIZE: u64 = 0x4_0000;
/// Descriptor table of the queue (up to 256 entries).
pub const DESC_TABLE: u64 = 0x0000;
/// Available ring.
pub const AVAIL: u64 = 0x1000;
/// Used ring (never written here; the queue only needs it to exist).
pub const USED: u64 = 0x1400;
/// Where the harness puts the 32-byte request header.
pub const HDR: u64 = 0x2000;
/// A 16-byte response slot.
pub const RESP: u64 = 0x2100;
/// Indirect descriptor tables (256 entries).
pub const INDIRECT: u64 = 0x3000;
/// Entries of the indirect area.
pub const INDIRECT_ENTRIES: usize = 256;
/// Start of the data area; everything below is the control area.
pub const DATA: u64 = 0x4000;
/// Size of the data area.
pub const DATA_SIZE: u64 = A_SIZE - DATA;
/// Largest queue size the harness uses.
pub const MAX_QUEUE: u16 = 256;

/// Split-ring descriptor flags (virtio 1.x, 2.7.5).
pub const F_NEXT: u16 = 1;
pub const F_WRITE: u16 = 2;
pub const F_INDIRECT: u16 = 4;

/// Where region B lies relative to region A.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Hole {
    /// B starts where A ends: two mappings, contiguous guest addresses.
    None,
    /// One page between A and B.
    Page,
    /// A megabyte between A and B.
    Mib,
    /// B ends one page below the top of the 64-bit address space.
    Top,
}

/// The guest memory map.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Layout {
    /// Region B: its size and where it lies; `None` for A alone.
    pub second: Option<(u64, Hole)>,
}

impl Layout {
    /// Region A alone.
    pub const SINGLE: Layout = Layout { second: None };

    /// Decodes one input byte: bit 2 adds region B, bit 3 picks its size,
    /// bits 0-1 the hole before it.
    pub fn from_byte(b: u8) -> Self {
        if b & 4 == 0 {
            return Layout::SINGLE;
        }
        let size = if b & 8 != 0 { 0x1_0000 } else { 0x1000 };
        let hole = match b & 3 {
            0 => Hole::None,
            1 => Hole::Page,
            2 => Hole::Mib,
            _ => Hole::Top,
        };
        Layout {
            second: Some((size, hole)),
        }
    }

    /// The byte that [`Layout::from_byte`] decodes to this layout.
    pub fn to_byte(self) -> u8 {
        match self.second {
            None => 0,
            Some((size, hole)) => {
                let h = match hole {
                    Hole::None => 0,
                    Hole::Page => 1,
                    Hole::Mib => 2,
                    Hole::Top => 3,
                };
                4 | if size > 0x1000 { 8 } else { 0 } | h
            }
        }
    }

    /// Start of region B, if there is one.
    pub fn b_start(self) -> Option<u64> {
        self.second.map(|(size, hole)| match hole {
            Hole::None => A_SIZE,
            Hole::Page => A_SIZE + 0x1000,
            Hole::Mib => A_SIZE + 0x10_0000,
            Hole::Top => u64::MAX - size - 0xfff,
        })
    }

    /// One past the last byte of the highest region.
    pub fn end(self) -> u64 {
        match (self.b_start(), self.second) {
            (Some(start), Some((size, _))) => start + size,
            _ => A_SIZE,
        }
    }

    fn ranges(self) -> Vec<(GuestAddress, usize)> {
        let mut r = vec![(GuestAddress(0), A_SIZE as usize)];
        if let (Some(start), Some((size, _))) = (self.b_start(), self.second) {
            r.push((GuestAddress(start), size as usize));
        }
        r
    }
}

/// One guest memory per layout, made once: mapping memory on every run
/// would cost more than the code under test. A global (not a thread-local)
/// keeps them reachable, so the leak checker does not report them.
static MEMORIES: Mutex<Vec<(Layout, &'static GuestMem)>> = Mutex::new(Vec::new());

/// Held for a whole run: the memories are shared, and the unit tests run
/// in parallel threads.
static RUN: Mutex<()> = Mutex::new(());

/// Takes the guest memories for one run (until the guard is dropped).
pub fn exclusive() -> MutexGuard<'static, ()> {
    RUN.lock().unwrap_or_else(|e| e.into_inner())
}

/// The guest memory of `layout`, with its control area cleared (take
/// [`exclusive`] first).
pub fn memory(layout: Layout) -> &'static GuestMem {
    let mut all = MEMORIES.lock().unwrap_or_else(|e| e.into_inner());
    let mem = match all.iter().find(|(l, _)| *l == layout) {
        Some(&(_, mem)) => mem,
        None => {
            let mem = GuestMem::from_ranges(&layout.ranges()).expect("guest memory maps");
            // Lives as long as the fuzzer process; at most one per layout.
            let mem: &'static GuestMem = Box::leak(Box::new(mem));
            all.push((layout, mem));
            mem
        }
    };
    mem.write_slice(&[0u8; DATA as usize], GuestAddress(0))
        .expect("control area is in region A");
    mem
}

/// Whether `[addr, addr + len)` lies inside guest memory, worked out from
/// the region list alone (independently of the backend's own resolver).
pub fn inside(mem: &GuestMem, addr: u64, len: u64) -> bool {
    let Some(end) = addr.checked_add(len) else {
        return false;
    };
    let mut cur = addr;
    while cur < end {
        let Some(region) = mem.iter().find(|r| {
            let start = r.start_addr().0;
            start <= cur && cur - start < r.len()
        }) else {
            return false;
        };
        // Next byte after this region; a region never ends past u64::MAX.
        cur = region.start_addr().0 + region.len();
    }
    true
}

/// Writes one raw split-queue descriptor at `addr` (little-endian, 16 bytes).
pub fn write_desc(mem: &GuestMem, at: u64, addr: u64, len: u32, flags: u16, next: u16) {
    let mut raw = [0u8; 16];
    raw[0..8].copy_from_slice(&addr.to_le_bytes());
    raw[8..12].copy_from_slice(&len.to_le_bytes());
    raw[12..14].copy_from_slice(&flags.to_le_bytes());
    raw[14..16].copy_from_slice(&next.to_le_bytes());
    mem.write_slice(&raw, GuestAddress(at))
        .expect("descriptor slot is in the control area");
}

/// Makes `head` available on a fresh queue of `size` entries (a power of
/// two up to [`MAX_QUEUE`]) and pops it as the backend would.
pub fn pop(mem: &'static GuestMem, size: u16, head: u16) -> DescriptorChain<&'static GuestMem> {
    let mut q = Queue::new(MAX_QUEUE).expect("valid maximum queue size");
    q.set_size(size);
    q.set_desc_table_address(Some(DESC_TABLE as u32), Some(0));
    q.set_avail_ring_address(Some(AVAIL as u32), Some(0));
    q.set_used_ring_address(Some(USED as u32), Some(0));
    q.set_ready(true);
    assert!(q.is_valid(mem), "harness queue of size {size} is valid");
    // avail.flags = 0, avail.idx = 1, avail.ring[0] = head.
    let mut avail = [0u8; 6];
    avail[2..4].copy_from_slice(&1u16.to_le_bytes());
    avail[4..6].copy_from_slice(&head.to_le_bytes());
    mem.write_slice(&avail, GuestAddress(AVAIL))
        .expect("avail ring is in the control area");
    q.pop_descriptor_chain(mem)
        .expect("one chain was made available")
}
