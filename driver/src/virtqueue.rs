//! Split virtqueue, driver side (virtio 1.x section 2.7).
//!
//! Many chains may be in flight and the device may complete them in any
//! order. Free descriptors form a list threaded through a shadow copy of the
//! `next` fields, so a chain taken from the head of the free list is already
//! linked; nothing the device can write is trusted for bookkeeping.
//!
//! Notification suppression works both ways. Driver to device: after
//! publishing, [`SplitQueue::needs_notify`] consults `avail_event` (with
//! `VIRTIO_F_EVENT_IDX`) or `VRING_USED_F_NO_NOTIFY`. Device to driver: in poll
//! mode `used_event` trails the last seen used index (or
//! `VRING_AVAIL_F_NO_INTERRUPT` is set without event index), so the device never
//! signals; in interrupt mode `used_event` asks for a signal at the next used
//! entry, and [`SplitQueue::arm_interrupt`] re-checks the ring after arming so
//! no completion is slept through.

use std::ptr;
use std::sync::atomic::{fence, AtomicU16, Ordering};
use std::sync::Arc;

use crate::dma::{DmaAlloc, DmaError, DmaMemory, PAGE_SIZE};
use crate::transport::{QueueAddrs, RingAddr};

/// This descriptor continues via `next`.
pub const VRING_DESC_F_NEXT: u16 = 1;
/// The device writes this descriptor's buffer.
pub const VRING_DESC_F_WRITE: u16 = 2;
/// The descriptor's buffer is a table of descriptors (`VIRTIO_RING_F_INDIRECT_DESC`).
pub const VRING_DESC_F_INDIRECT: u16 = 4;
/// Driver to device: no used-buffer notifications please (without event index).
pub const VRING_AVAIL_F_NO_INTERRUPT: u16 = 1;
/// Device to driver: no available-buffer notifications please (without event index).
pub const VRING_USED_F_NO_NOTIFY: u16 = 1;
/// Largest split queue size.
pub const MAX_QUEUE_SIZE: u16 = 32768;

/// Size of one descriptor, in the ring and in an indirect table.
pub const DESC_SIZE: usize = 16;
const USED_ELEM_SIZE: usize = 8;

/// Errors of the virtqueue.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    /// The size is not a power of two in `1..=32768`.
    #[error("queue size {0} is not a power of two up to 32768")]
    BadSize(u16),
    /// Not enough free descriptors at the moment.
    #[error("chain of {needed} descriptors does not fit, {free} free")]
    Full { needed: usize, free: u16 },
    /// The chain could never fit.
    #[error("chain of {len} descriptors is longer than the queue ({size})")]
    TooLong { len: usize, size: u16 },
    /// A chain must have at least one descriptor.
    #[error("empty descriptor chain")]
    Empty,
    /// An indirect table's memory is too small or not contiguous for the
    /// device.
    #[error("indirect table of {len} bytes cannot hold {entries} descriptors in one device-contiguous piece")]
    BadTable { entries: usize, len: usize },
    /// The device put an entry in the used ring for a chain not in flight.
    #[error("device returned descriptor {id}, which is not in flight")]
    BadUsedId { id: u32 },
    /// The rings could not be allocated.
    #[error("cannot allocate the rings")]
    Dma(#[from] DmaError),
}

/// One buffer of a chain, by device address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub addr: u64,
    pub len: u32,
    /// The device writes (rather than reads) this buffer.
    pub writable: bool,
}

/// A completed chain: its head descriptor and the bytes the device wrote.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Used {
    pub id: u16,
    pub len: u32,
}

/// The driver's half of one split virtqueue.
pub struct SplitQueue {
    size: u16,
    desc: DmaAlloc,
    avail: DmaAlloc,
    used: DmaAlloc,
    event_idx: bool,
    interrupts: bool,
    free_head: u16,
    num_free: u16,
    in_flight: u16,
    /// Shadow of every descriptor's `next`: the free list and the chains.
    next: Box<[u16]>,
    /// Descriptors in the chain headed by each index; 0 if not a live head.
    chain_len: Box<[u16]>,
    /// Next avail index to publish (shadow of `avail.idx`).
    avail_idx: u16,
    /// `avail_idx` when [`Self::needs_notify`] last ran.
    notified_idx: u16,
    /// Next used index to consume.
    last_used: u16,
}

impl SplitQueue {
    /// Allocates and initialises the rings of a queue of `size` descriptors.
    /// The queue starts in poll mode (no used-buffer notifications).
    pub fn new(mem: &Arc<dyn DmaMemory>, size: u16, event_idx: bool) -> Result<Self, QueueError> {
        if size == 0 || !size.is_power_of_two() || size > MAX_QUEUE_SIZE {
            return Err(QueueError::BadSize(size));
        }
        let n = usize::from(size);
        let desc = DmaAlloc::new(mem, DESC_SIZE * n, PAGE_SIZE)?;
        let avail = DmaAlloc::new(mem, 6 + 2 * n, PAGE_SIZE)?;
        let used = DmaAlloc::new(mem, 6 + USED_ELEM_SIZE * n, PAGE_SIZE)?;
        let next = (0..size).map(|i| (i + 1) & (size - 1)).collect();
        let mut q = SplitQueue {
            size,
            desc,
            avail,
            used,
            event_idx,
            interrupts: true,
            free_head: 0,
            num_free: size,
            in_flight: 0,
            next,
            chain_len: vec![0; n].into_boxed_slice(),
            avail_idx: 0,
            notified_idx: 0,
            last_used: 0,
        };
        q.set_interrupts(false);
        Ok(q)
    }

    /// Number of descriptors.
    pub fn size(&self) -> u16 {
        self.size
    }

    /// Free descriptors.
    pub fn num_free(&self) -> u16 {
        self.num_free
    }

    /// Chains posted and not yet returned by [`Self::pop_used`].
    pub fn in_flight(&self) -> u16 {
        self.in_flight
    }

    /// The head descriptor the next [`Self::add`] will use, if it fits; lets
    /// the caller key per-request state (header slots) by head before posting.
    pub fn next_head(&self) -> u16 {
        self.free_head
    }

    /// True if `VIRTIO_F_EVENT_IDX` is in use.
    pub fn event_idx(&self) -> bool {
        self.event_idx
    }

    /// Ring addresses for [`crate::transport::Transport::setup_queue`].
    pub fn addrs(&self) -> QueueAddrs {
        let ring = |a: &DmaAlloc| RingAddr {
            vaddr: a.as_ptr() as u64,
            paddr: a.paddr(),
        };
        QueueAddrs {
            size: self.size,
            desc: ring(&self.desc),
            avail: ring(&self.avail),
            used: ring(&self.used),
        }
    }

    // Ring field accessors. Offsets follow the virtio split ring layout;
    // every allocation is page aligned and sized for `size` entries.

    fn avail_ptr(&self, offset: usize) -> *mut u16 {
        debug_assert!(offset + 2 <= 6 + 2 * usize::from(self.size));
        // SAFETY: the offset is inside the avail allocation (see above).
        unsafe { self.avail.as_ptr().add(offset).cast() }
    }

    fn used_ptr(&self, offset: usize) -> *mut u8 {
        debug_assert!(offset < 6 + USED_ELEM_SIZE * usize::from(self.size));
        // SAFETY: the offset is inside the used allocation (see above).
        unsafe { self.used.as_ptr().add(offset) }
    }

    fn avail_idx_atomic(&self) -> &AtomicU16 {
        // SAFETY: `avail.idx` is a 2-aligned u16 inside our allocation that
        // lives as long as `self`; the device only reads it.
        unsafe { AtomicU16::from_ptr(self.avail_ptr(2)) }
    }

    fn used_idx_atomic(&self) -> &AtomicU16 {
        // SAFETY: `used.idx` is a 2-aligned u16 inside our allocation that
        // lives as long as `self`; the device writes it atomically.
        unsafe { AtomicU16::from_ptr(self.used_ptr(2).cast()) }
    }

    fn write_used_event(&self, value: u16) {
        let p = self.avail_ptr(4 + 2 * usize::from(self.size));
        // SAFETY: `used_event` lies inside the avail allocation, aligned.
        unsafe { ptr::write_volatile(p, value.to_le()) };
    }

    fn read_avail_event(&self) -> u16 {
        let p = self.used_ptr(4 + USED_ELEM_SIZE * usize::from(self.size));
        // SAFETY: `avail_event` lies inside the used allocation, aligned.
        u16::from_le(unsafe { ptr::read_volatile(p.cast::<u16>()) })
    }

    fn read_used_flags(&self) -> u16 {
        // SAFETY: `used.flags` is the first field of the used allocation.
        u16::from_le(unsafe { ptr::read_volatile(self.used_ptr(0).cast::<u16>()) })
    }

    fn write_desc(&self, index: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let base = usize::from(index) * DESC_SIZE;
        // SAFETY: `index < size`, so the 16 bytes at `base` are one
        // descriptor of the table, 8-aligned.
        unsafe {
            let p = self.desc.as_ptr().add(base);
            ptr::write_volatile(p.cast::<u64>(), addr.to_le());
            ptr::write_volatile(p.add(8).cast::<u32>(), len.to_le());
            ptr::write_volatile(p.add(12).cast::<u16>(), flags.to_le());
            ptr::write_volatile(p.add(14).cast::<u16>(), next.to_le());
        }
    }

    /// Posts one chain and publishes it in the available ring. Returns the
    /// head descriptor, which [`Self::pop_used`] reports on completion.
    /// Does not notify: call [`Self::needs_notify`] after a batch.
    pub fn add(&mut self, segs: &[Segment]) -> Result<u16, QueueError> {
        let n = segs.len();
        if n == 0 {
            return Err(QueueError::Empty);
        }
        if n > usize::from(self.size) {
            return Err(QueueError::TooLong {
                len: n,
                size: self.size,
            });
        }
        if n > usize::from(self.num_free) {
            return Err(QueueError::Full {
                needed: n,
                free: self.num_free,
            });
        }
        let head = self.free_head;
        let mut idx = head;
        for (i, s) in segs.iter().enumerate() {
            let last = i + 1 == n;
            let mut flags = if s.writable { VRING_DESC_F_WRITE } else { 0 };
            if !last {
                flags |= VRING_DESC_F_NEXT;
            }
            let next = if last { 0 } else { self.next[usize::from(idx)] };
            self.write_desc(idx, s.addr, s.len, flags, next);
            if !last {
                idx = next;
            }
        }
        self.free_head = self.next[usize::from(idx)];
        // `n <= num_free <= size <= 32768`, so these fit.
        self.num_free -= n as u16;
        self.chain_len[usize::from(head)] = n as u16;
        self.in_flight += 1;
        self.publish(head);
        Ok(head)
    }

    /// Posts one chain as an indirect table (virtio 2.7.5.3): `segs` are
    /// written into `table`, and one ring descriptor with
    /// `VRING_DESC_F_INDIRECT` points at it. The caller keeps `table` alive,
    /// unchanged, until [`Self::pop_used`] returns the head. Only for a
    /// device that offered `VIRTIO_RING_F_INDIRECT_DESC`.
    pub fn add_indirect(&mut self, table: &DmaAlloc, segs: &[Segment]) -> Result<u16, QueueError> {
        let n = segs.len();
        if n == 0 {
            return Err(QueueError::Empty);
        }
        let bytes = n
            .checked_mul(DESC_SIZE)
            .filter(|&b| b <= table.len() && u32::try_from(b).is_ok())
            .ok_or(QueueError::BadTable {
                entries: n,
                len: table.len(),
            })?;
        let mut pieces = 0;
        table.device_ranges(0, bytes, &mut |_, _| pieces += 1);
        if pieces != 1 {
            return Err(QueueError::BadTable {
                entries: n,
                len: table.len(),
            });
        }
        if self.num_free == 0 {
            return Err(QueueError::Full { needed: 1, free: 0 });
        }
        for (i, s) in segs.iter().enumerate() {
            let last = i + 1 == n;
            let mut flags = if s.writable { VRING_DESC_F_WRITE } else { 0 };
            if !last {
                flags |= VRING_DESC_F_NEXT;
            }
            let next = if last { 0 } else { (i + 1) as u16 };
            // SAFETY: entry `i < n` lies inside the table (`bytes <= len`),
            // which the device reads only once the head is published below.
            unsafe {
                let p = table.as_ptr().add(i * DESC_SIZE);
                ptr::write_volatile(p.cast::<u64>(), s.addr.to_le());
                ptr::write_volatile(p.add(8).cast::<u32>(), s.len.to_le());
                ptr::write_volatile(p.add(12).cast::<u16>(), flags.to_le());
                ptr::write_volatile(p.add(14).cast::<u16>(), next.to_le());
            }
        }
        let head = self.free_head;
        self.write_desc(head, table.paddr(), bytes as u32, VRING_DESC_F_INDIRECT, 0);
        self.free_head = self.next[usize::from(head)];
        self.num_free -= 1;
        self.chain_len[usize::from(head)] = 1;
        self.in_flight += 1;
        self.publish(head);
        Ok(head)
    }

    /// Makes the chain at `head` available (ring entry, then index).
    fn publish(&mut self, head: u16) {
        let slot = usize::from(self.avail_idx & (self.size - 1));
        // SAFETY: `ring[slot]` is inside the avail allocation, aligned.
        unsafe { ptr::write_volatile(self.avail_ptr(4 + 2 * slot), head.to_le()) };
        self.avail_idx = self.avail_idx.wrapping_add(1);
        // The descriptors and the ring entry must be visible before the index
        // that publishes them (virtio 2.7.13: write barrier before idx).
        fence(Ordering::Release);
        self.avail_idx_atomic()
            .store(self.avail_idx.to_le(), Ordering::Release);
    }

    /// True if the device wants a notification for what was published since
    /// the last call. Call after one or more [`Self::add`]s; if true, notify.
    pub fn needs_notify(&mut self) -> bool {
        let new = self.avail_idx;
        let old = self.notified_idx;
        if new == old {
            return false;
        }
        self.notified_idx = new;
        // The idx store must be visible before we read the device's wish,
        // or we could miss a device that just went to sleep (full barrier).
        fence(Ordering::SeqCst);
        if self.event_idx {
            let event = self.read_avail_event();
            new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old)
        } else {
            self.read_used_flags() & VRING_USED_F_NO_NOTIFY == 0
        }
    }

    /// True if the device has returned chains not yet popped.
    pub fn has_used(&self) -> bool {
        u16::from_le(self.used_idx_atomic().load(Ordering::Acquire)) != self.last_used
    }

    /// Takes the next completed chain from the used ring, if any, and frees
    /// its descriptors.
    pub fn pop_used(&mut self) -> Result<Option<Used>, QueueError> {
        let used_idx = u16::from_le(self.used_idx_atomic().load(Ordering::Acquire));
        if used_idx == self.last_used {
            return Ok(None);
        }
        // The entry must be read after the index that published it.
        fence(Ordering::Acquire);
        let slot = usize::from(self.last_used & (self.size - 1));
        let elem = self.used_ptr(4 + USED_ELEM_SIZE * slot);
        // SAFETY: the element lies inside the used allocation, 4-aligned.
        let (id, len) = unsafe {
            (
                u32::from_le(ptr::read_volatile(elem.cast::<u32>())),
                u32::from_le(ptr::read_volatile(elem.add(4).cast::<u32>())),
            )
        };
        self.last_used = self.last_used.wrapping_add(1);
        self.update_used_event();
        let head = match u16::try_from(id) {
            Ok(h) if h < self.size && self.chain_len[usize::from(h)] != 0 => h,
            _ => return Err(QueueError::BadUsedId { id }),
        };
        self.free_chain(head);
        Ok(Some(Used { id: head, len }))
    }

    fn free_chain(&mut self, head: u16) {
        let n = std::mem::take(&mut self.chain_len[usize::from(head)]);
        let mut last = head;
        for _ in 1..n {
            last = self.next[usize::from(last)];
        }
        if self.num_free > 0 {
            self.next[usize::from(last)] = self.free_head;
        }
        self.free_head = head;
        self.num_free += n;
        self.in_flight -= 1;
    }

    fn update_used_event(&self) {
        if self.event_idx {
            // Interrupt mode: signal at the next entry. Poll mode: stay one
            // behind what we consumed, which the device never crosses.
            let event = if self.interrupts {
                self.last_used
            } else {
                self.last_used.wrapping_sub(1)
            };
            self.write_used_event(event);
        }
    }

    /// Switches between interrupt mode (`true`: the device signals used
    /// buffers) and poll mode (`false`).
    pub fn set_interrupts(&mut self, on: bool) {
        self.interrupts = on;
        if self.event_idx {
            // With event index the flags field must stay 0 (virtio 2.7.10).
            // SAFETY: `avail.flags` is the first field of the avail allocation.
            unsafe { ptr::write_volatile(self.avail_ptr(0), 0) };
            self.update_used_event();
        } else {
            let flags = if on { 0 } else { VRING_AVAIL_F_NO_INTERRUPT };
            // SAFETY: as above.
            unsafe { ptr::write_volatile(self.avail_ptr(0), flags.to_le()) };
        }
    }

    /// Enables interrupts before the driver sleeps. Returns true if chains
    /// were completed meanwhile (the caller must pop them instead of
    /// sleeping, as the device may not signal them).
    pub fn arm_interrupt(&mut self) -> bool {
        self.set_interrupts(true);
        // The device reads used_event after writing used.idx; we read used.idx
        // after writing used_event. A full barrier on both sides means at
        // least one of us sees the other's write.
        fence(Ordering::SeqCst);
        self.has_used()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::dma::MemfdMemory;

    pub(crate) const GUEST_BASE: u64 = 0x1000_0000;

    /// A chain as the fake device sees it: (address, length, flags) each.
    pub(crate) type Chain = Vec<(u64, u32, u16)>;

    pub(crate) fn memory(len: usize) -> (Arc<MemfdMemory>, Arc<dyn DmaMemory>) {
        let m = Arc::new(MemfdMemory::new(len, GUEST_BASE).unwrap());
        let d: Arc<dyn DmaMemory> = m.clone();
        (m, d)
    }

    /// The device's half of a split ring, working on the same memory. It
    /// trusts nothing but reads it all through volatile accesses, as another
    /// process would, every field little-endian (virtio 2.4) whatever the
    /// CPU (tests/cross-endian.sh runs these tests big-endian).
    pub(crate) struct FakeRing {
        pub addrs: QueueAddrs,
        pub event_idx: bool,
        pub next_avail: u16,
        pub next_used: u16,
        /// Host address of device address `GUEST_BASE`.
        pub host_base: usize,
    }

    // SAFETY (for the whole impl): every pointer is computed from the ring
    // addresses the driver published, which stay valid while the queue
    // lives, and the tests keep the queue alive longer than the fake.
    impl FakeRing {
        pub(crate) fn new(addrs: QueueAddrs, event_idx: bool, mem: &MemfdMemory) -> Self {
            FakeRing {
                addrs,
                event_idx,
                next_avail: 0,
                next_used: 0,
                host_base: mem.base() as usize,
            }
        }

        fn n(&self) -> usize {
            usize::from(self.addrs.size)
        }

        fn avail(&self, off: usize) -> *mut u16 {
            (self.addrs.avail.vaddr as usize + off) as *mut u16
        }

        fn used(&self, off: usize) -> *mut u8 {
            (self.addrs.used.vaddr as usize + off) as *mut u8
        }

        /// Host pointer to device address `paddr`.
        pub(crate) fn host(&self, paddr: u64) -> *mut u8 {
            (self.host_base + (paddr - GUEST_BASE) as usize) as *mut u8
        }

        /// Pops the next available chain as (head, [(addr, len, flags)]).
        pub(crate) fn pop_avail(&mut self) -> Option<(u16, Chain)> {
            // SAFETY: see the impl comment.
            let idx =
                u16::from_le(unsafe { AtomicU16::from_ptr(self.avail(2)) }.load(Ordering::Acquire));
            if idx == self.next_avail {
                return None;
            }
            let slot = usize::from(self.next_avail) & (self.n() - 1);
            // SAFETY: see the impl comment.
            let head = u16::from_le(unsafe { ptr::read_volatile(self.avail(4 + 2 * slot)) });
            self.next_avail = self.next_avail.wrapping_add(1);
            let mut chain = Vec::new();
            let mut i = head;
            loop {
                assert!(usize::from(i) < self.n(), "descriptor index out of range");
                assert!(chain.len() < self.n(), "descriptor loop");
                let p = (self.addrs.desc.vaddr as usize + 16 * usize::from(i)) as *const u8;
                // SAFETY: see the impl comment.
                let (addr, len, flags, next) = unsafe {
                    (
                        u64::from_le(ptr::read_volatile(p.cast::<u64>())),
                        u32::from_le(ptr::read_volatile(p.add(8).cast::<u32>())),
                        u16::from_le(ptr::read_volatile(p.add(12).cast::<u16>())),
                        u16::from_le(ptr::read_volatile(p.add(14).cast::<u16>())),
                    )
                };
                if flags & VRING_DESC_F_INDIRECT != 0 {
                    // The table ends the chain (spec 5.X.6.2).
                    let table = self.host(addr);
                    let mut j = 0u16;
                    loop {
                        assert!(
                            usize::from(j) * 16 < len as usize,
                            "indirect index out of range"
                        );
                        let p = table.wrapping_add(16 * usize::from(j)).cast_const();
                        // SAFETY: see the impl comment; the entry is inside
                        // the table the driver published.
                        let (a, l, f, nx) = unsafe {
                            (
                                u64::from_le(ptr::read_volatile(p.cast::<u64>())),
                                u32::from_le(ptr::read_volatile(p.add(8).cast::<u32>())),
                                u16::from_le(ptr::read_volatile(p.add(12).cast::<u16>())),
                                u16::from_le(ptr::read_volatile(p.add(14).cast::<u16>())),
                            )
                        };
                        chain.push((a, l, f));
                        if f & VRING_DESC_F_NEXT == 0 {
                            break;
                        }
                        j = nx;
                    }
                    break;
                }
                chain.push((addr, len, flags));
                if flags & VRING_DESC_F_NEXT == 0 {
                    break;
                }
                i = next;
            }
            if self.event_idx {
                // Ask to be notified of the next chain, like a device that
                // keeps notifications on.
                self.set_avail_event(self.next_avail);
            }
            Some((head, chain))
        }

        pub(crate) fn set_avail_event(&self, value: u16) {
            let p = self.used(4 + 8 * self.n()).cast::<u16>();
            // SAFETY: see the impl comment.
            unsafe { ptr::write_volatile(p, value.to_le()) };
            fence(Ordering::SeqCst);
        }

        pub(crate) fn set_used_flags(&self, flags: u16) {
            // SAFETY: see the impl comment.
            unsafe { ptr::write_volatile(self.used(0).cast::<u16>(), flags.to_le()) };
        }

        /// Publishes a used entry; returns whether the driver asked to be
        /// signalled for it.
        pub(crate) fn push_used(&mut self, id: u32, len: u32) -> bool {
            let slot = usize::from(self.next_used) & (self.n() - 1);
            let e = self.used(4 + 8 * slot);
            // SAFETY: see the impl comment.
            unsafe {
                ptr::write_volatile(e.cast::<u32>(), id.to_le());
                ptr::write_volatile(e.add(4).cast::<u32>(), len.to_le());
            }
            let old = self.next_used;
            self.next_used = self.next_used.wrapping_add(1);
            // SAFETY: see the impl comment.
            unsafe { AtomicU16::from_ptr(self.used(2).cast()) }
                .store(self.next_used.to_le(), Ordering::Release);
            fence(Ordering::SeqCst);
            if self.event_idx {
                let p = self.avail(4 + 2 * self.n());
                // SAFETY: see the impl comment.
                let event = u16::from_le(unsafe { ptr::read_volatile(p) });
                self.next_used.wrapping_sub(event).wrapping_sub(1)
                    < self.next_used.wrapping_sub(old)
            } else {
                // SAFETY: see the impl comment.
                let flags = u16::from_le(unsafe { ptr::read_volatile(self.avail(0)) });
                flags & VRING_AVAIL_F_NO_INTERRUPT == 0
            }
        }
    }

    fn seg(addr: u64, len: u32, writable: bool) -> Segment {
        Segment {
            addr,
            len,
            writable,
        }
    }

    #[test]
    fn rejects_bad_sizes_and_chains() {
        let (_m, mem) = memory(1 << 20);
        for bad in [0, 3, 100, 65535] {
            assert!(matches!(
                SplitQueue::new(&mem, bad, false),
                Err(QueueError::BadSize(_))
            ));
        }
        let mut q = SplitQueue::new(&mem, 4, false).unwrap();
        assert!(matches!(q.add(&[]), Err(QueueError::Empty)));
        let five = [seg(0, 1, false); 5];
        assert!(matches!(
            q.add(&five),
            Err(QueueError::TooLong { len: 5, size: 4 })
        ));
        q.add(&five[..3]).unwrap();
        assert!(matches!(
            q.add(&five[..2]),
            Err(QueueError::Full { needed: 2, free: 1 })
        ));
        assert_eq!(q.num_free(), 1);
        q.add(&five[..1]).unwrap();
        assert_eq!((q.num_free(), q.in_flight()), (0, 2));
    }

    #[test]
    fn chain_layout_and_completion() {
        let (m, mem) = memory(1 << 20);
        let mut q = SplitQueue::new(&mem, 8, true).unwrap();
        let mut dev = FakeRing::new(q.addrs(), true, &m);
        let segs = [
            seg(0x1000_1000, 32, false),
            seg(0x1000_2000, 64, false),
            seg(0x1000_3000, 64, true),
            seg(0x1000_4000, 16, true),
        ];
        let head = q.add(&segs).unwrap();
        assert!(q.needs_notify());
        assert!(!q.needs_notify(), "nothing new since the last check");
        let (h, chain) = dev.pop_avail().unwrap();
        assert_eq!(h, head);
        let got: Vec<_> = chain
            .iter()
            .map(|&(a, l, f)| (a, l, f & VRING_DESC_F_WRITE != 0))
            .collect();
        let want: Vec<_> = segs.iter().map(|s| (s.addr, s.len, s.writable)).collect();
        assert_eq!(got, want);
        assert!(dev.pop_avail().is_none());
        assert_eq!(q.pop_used().unwrap(), None);
        dev.push_used(u32::from(head), 80);
        assert!(q.has_used());
        assert_eq!(q.pop_used().unwrap(), Some(Used { id: head, len: 80 }));
        assert_eq!((q.num_free(), q.in_flight()), (8, 0));
    }

    /// Runs enough requests through a small queue that the ring slots wrap
    /// many times and the 16-bit indices wrap too.
    #[test]
    fn indices_wrap_around() {
        let (m, mem) = memory(1 << 20);
        let mut q = SplitQueue::new(&mem, 4, true).unwrap();
        let mut dev = FakeRing::new(q.addrs(), true, &m);
        let mut completed = 0u32;
        for round in 0..70_000u32 {
            let len = 1 + (round % 2) as usize;
            let segs: Vec<_> = (0..len)
                .map(|i| seg(0x1000_0000 + u64::from(round) * 8 + i as u64, 8, i == 1))
                .collect();
            let head = q.add(&segs).unwrap();
            let (h, chain) = dev.pop_avail().unwrap();
            assert_eq!(h, head);
            assert_eq!(chain.len(), len);
            assert_eq!(chain[0].0, 0x1000_0000 + u64::from(round) * 8);
            dev.push_used(u32::from(h), round);
            assert_eq!(
                q.pop_used().unwrap(),
                Some(Used {
                    id: head,
                    len: round
                })
            );
            completed += 1;
        }
        assert_eq!(completed, 70_000);
        assert_eq!(q.num_free(), 4);
        assert_eq!(dev.next_used, (70_000u32 % 65_536) as u16);
    }

    #[test]
    fn out_of_order_completion_keeps_free_list_sound() {
        let (m, mem) = memory(1 << 20);
        let mut q = SplitQueue::new(&mem, 8, false).unwrap();
        let mut dev = FakeRing::new(q.addrs(), false, &m);
        for round in 0..50u64 {
            // Fill the queue exactly with chains of 1, 2, 3 and 2 descriptors.
            let mut heads = Vec::new();
            for (k, len) in [1usize, 2, 3, 2].into_iter().enumerate() {
                let segs: Vec<_> = (0..len)
                    .map(|i| seg(round << 20 | (k as u64) << 8 | i as u64, 4, false))
                    .collect();
                heads.push(q.add(&segs).unwrap());
            }
            assert_eq!(q.num_free(), 0);
            let mut chains = Vec::new();
            while let Some(c) = dev.pop_avail() {
                chains.push(c);
            }
            assert_eq!(chains.len(), 4);
            // Every descriptor index is used exactly once.
            let mut seen = [false; 8];
            for (k, (h, chain)) in chains.iter().enumerate() {
                assert_eq!(*h, heads[k]);
                for (i, &(addr, _, _)) in chain.iter().enumerate() {
                    assert_eq!(addr, round << 20 | (k as u64) << 8 | i as u64);
                }
            }
            for h in &heads {
                assert!(!seen[usize::from(*h)]);
                seen[usize::from(*h)] = true;
            }
            // Complete in a rotating order that differs from submission.
            let order: Vec<usize> = (0..4).map(|i| (i * 3 + round as usize) % 4).collect();
            for &k in &order {
                dev.push_used(u32::from(heads[k]), k as u32);
            }
            for &k in &order {
                assert_eq!(
                    q.pop_used().unwrap(),
                    Some(Used {
                        id: heads[k],
                        len: k as u32
                    })
                );
            }
            assert_eq!(q.num_free(), 8);
        }
        // After all that shuffling a full-length chain still fits.
        let segs = [seg(0, 1, false); 8];
        let h = q.add(&segs).unwrap();
        let (_, chain) = dev.pop_avail().unwrap();
        assert_eq!(chain.len(), 8);
        dev.push_used(u32::from(h), 0);
        q.pop_used().unwrap().unwrap();
    }

    #[test]
    fn indirect_chains_take_one_ring_descriptor() {
        let (m, mem) = memory(1 << 20);
        let mut q = SplitQueue::new(&mem, 4, true).unwrap();
        let mut dev = FakeRing::new(q.addrs(), true, &m);
        let segs: Vec<_> = (0..10u64)
            .map(|i| seg(GUEST_BASE + 0x1000 * i, 8, i >= 5))
            .collect();
        let small = DmaAlloc::new(&mem, 8 * DESC_SIZE, DESC_SIZE).unwrap();
        assert!(matches!(
            q.add_indirect(&small, &segs),
            Err(QueueError::BadTable { entries: 10, .. })
        ));
        let table = DmaAlloc::new(&mem, 10 * DESC_SIZE, DESC_SIZE).unwrap();
        let head = q.add_indirect(&table, &segs).unwrap();
        assert_eq!((q.num_free(), q.in_flight()), (3, 1));
        let (h, chain) = dev.pop_avail().unwrap();
        assert_eq!(h, head);
        let got: Vec<_> = chain
            .iter()
            .map(|&(a, l, f)| (a, l, f & VRING_DESC_F_WRITE != 0))
            .collect();
        let want: Vec<_> = segs.iter().map(|s| (s.addr, s.len, s.writable)).collect();
        assert_eq!(got, want);
        dev.push_used(u32::from(head), 40);
        assert_eq!(q.pop_used().unwrap(), Some(Used { id: head, len: 40 }));
        assert_eq!(q.num_free(), 4);
    }

    #[test]
    fn bad_used_id_is_reported() {
        let (m, mem) = memory(1 << 20);
        let mut q = SplitQueue::new(&mem, 4, false).unwrap();
        let mut dev = FakeRing::new(q.addrs(), false, &m);
        let h = q.add(&[seg(0, 4, false)]).unwrap();
        dev.pop_avail().unwrap();
        dev.push_used(7, 0);
        assert!(matches!(q.pop_used(), Err(QueueError::BadUsedId { id: 7 })));
        dev.push_used(u32::from(h) + 1, 0);
        assert!(matches!(q.pop_used(), Err(QueueError::BadUsedId { .. })));
        dev.push_used(u32::from(h), 4);
        assert_eq!(q.pop_used().unwrap(), Some(Used { id: h, len: 4 }));
    }

    #[test]
    fn event_idx_suppresses_driver_notifications() {
        let (m, mem) = memory(1 << 20);
        let mut q = SplitQueue::new(&mem, 16, true).unwrap();
        let mut dev = FakeRing::new(q.addrs(), true, &m);
        // avail_event = 0: the first chain needs a kick.
        q.add(&[seg(0, 4, false)]).unwrap();
        assert!(q.needs_notify());
        // The device has not caught up (avail_event still 0): no more kicks.
        q.add(&[seg(0, 4, false)]).unwrap();
        assert!(!q.needs_notify());
        q.add(&[seg(0, 4, false)]).unwrap();
        q.add(&[seg(0, 4, false)]).unwrap();
        assert!(!q.needs_notify());
        // The device consumes everything and asks for the next one (4).
        while dev.pop_avail().is_some() {}
        q.add(&[seg(0, 4, false)]).unwrap();
        assert!(q.needs_notify());
        // A device that wants to hear only after index 10 (busy polling).
        dev.pop_avail().unwrap();
        dev.set_avail_event(10);
        for _ in 0..5 {
            q.add(&[seg(0, 4, false)]).unwrap();
            assert!(!q.needs_notify());
        }
        // Publishing entry 10 crosses the event.
        q.add(&[seg(0, 4, false)]).unwrap();
        assert!(q.needs_notify());
    }

    #[test]
    fn event_idx_suppresses_device_interrupts() {
        let (m, mem) = memory(1 << 20);
        let mut q = SplitQueue::new(&mem, 16, true).unwrap();
        let mut dev = FakeRing::new(q.addrs(), true, &m);
        let post = |q: &mut SplitQueue, dev: &mut FakeRing| {
            q.add(&[seg(0, 4, true)]).unwrap();
            dev.pop_avail().unwrap().0
        };
        // Poll mode: no signal, ever, however many completions.
        for _ in 0..40 {
            let h = post(&mut q, &mut dev);
            assert!(!dev.push_used(u32::from(h), 0));
            q.pop_used().unwrap().unwrap();
        }
        // Interrupt mode: the first completion after arming signals ...
        assert!(!q.arm_interrupt());
        let (a, b) = (post(&mut q, &mut dev), post(&mut q, &mut dev));
        assert!(dev.push_used(u32::from(a), 0));
        // ... and the next does not until the driver has consumed the first.
        assert!(!dev.push_used(u32::from(b), 0));
        q.pop_used().unwrap().unwrap();
        q.pop_used().unwrap().unwrap();
        let c = post(&mut q, &mut dev);
        assert!(dev.push_used(u32::from(c), 0));
        // Arming with completions pending says so, so the driver won't sleep.
        let d = post(&mut q, &mut dev);
        dev.push_used(u32::from(d), 0);
        assert!(q.arm_interrupt());
        q.pop_used().unwrap().unwrap();
        q.pop_used().unwrap().unwrap();
        assert!(!q.arm_interrupt());
        // Back to poll mode: silent again.
        q.set_interrupts(false);
        let e = post(&mut q, &mut dev);
        assert!(!dev.push_used(u32::from(e), 0));
    }

    #[test]
    fn flags_suppress_notifications_without_event_idx() {
        let (m, mem) = memory(1 << 20);
        let mut q = SplitQueue::new(&mem, 8, false).unwrap();
        let mut dev = FakeRing::new(q.addrs(), false, &m);
        q.add(&[seg(0, 4, true)]).unwrap();
        assert!(q.needs_notify());
        dev.set_used_flags(VRING_USED_F_NO_NOTIFY);
        q.add(&[seg(0, 4, true)]).unwrap();
        assert!(!q.needs_notify());
        dev.set_used_flags(0);
        let (a, _) = dev.pop_avail().unwrap();
        let (b, _) = dev.pop_avail().unwrap();
        // Poll mode sets VRING_AVAIL_F_NO_INTERRUPT.
        assert!(!dev.push_used(u32::from(a), 0));
        q.set_interrupts(true);
        assert!(dev.push_used(u32::from(b), 0));
    }

    /// A device thread completes chains concurrently, out of order, while the
    /// driver keeps the queue full; every chain comes back exactly once with
    /// the length the device wrote.
    #[test]
    fn concurrent_device_thread() {
        use std::sync::atomic::AtomicBool;
        let (m, mem) = memory(4 << 20);
        let mut q = SplitQueue::new(&mem, 64, true).unwrap();
        let mut dev = FakeRing::new(q.addrs(), true, &m);
        // One 8-byte writable slot per request; the device writes the
        // request number (read from a readable 8-byte slot) + 1 into it.
        const N: u64 = 20_000;
        let slots = DmaAlloc::new(&mem, 16 * 64, 64).unwrap();
        let slot_paddr = slots.paddr();
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let device = std::thread::spawn(move || {
            let mut held: Vec<(u16, u64)> = Vec::new();
            let mut rng = 0x2545_f491_4f6c_dd1du64;
            let mut done = 0u64;
            while done < N && !stop2.load(Ordering::Relaxed) {
                while let Some((head, chain)) = dev.pop_avail() {
                    assert_eq!(chain.len(), 2);
                    // SAFETY: both addresses are slots of `slots`.
                    let v = unsafe { ptr::read_volatile(dev.host(chain[0].0).cast::<u64>()) };
                    // SAFETY: as above.
                    unsafe { ptr::write_volatile(dev.host(chain[1].0).cast::<u64>(), v + 1) };
                    held.push((head, v));
                }
                // Complete a random held chain (out of order).
                if !held.is_empty() {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    let (head, _) = held.swap_remove(rng as usize % held.len());
                    dev.push_used(u32::from(head), 8);
                    done += 1;
                } else {
                    std::hint::spin_loop();
                }
            }
        });
        let mut by_head: Vec<Option<u64>> = vec![None; 64];
        let mut next = 0u64;
        let mut seen = 0u64;
        let mut sum = 0u64;
        let start = std::time::Instant::now();
        while seen < N {
            assert!(start.elapsed().as_secs() < 60, "stuck at {seen}");
            // Keep up to 32 requests in flight, each using its own pair of
            // slots picked by head index.
            while next < N && q.num_free() >= 2 {
                let head = q.free_head;
                let base = slot_paddr + 16 * u64::from(head);
                // SAFETY: slot `head` is in `slots` and not in flight.
                unsafe {
                    ptr::write_volatile(slots.as_ptr().add(16 * usize::from(head)).cast(), next)
                };
                let h = q
                    .add(&[seg(base, 8, false), seg(base + 8, 8, true)])
                    .unwrap();
                assert_eq!(h, head);
                by_head[usize::from(h)] = Some(next);
                next += 1;
            }
            while let Some(u) = q.pop_used().unwrap() {
                let want = by_head[usize::from(u.id)].take().expect("completed twice");
                // SAFETY: the device finished with this slot.
                let got: u64 = unsafe {
                    ptr::read_volatile(slots.as_ptr().add(16 * usize::from(u.id) + 8).cast())
                };
                assert_eq!((got, u.len), (want + 1, 8));
                sum += want;
                seen += 1;
            }
        }
        stop.store(true, Ordering::Relaxed);
        device.join().unwrap();
        assert_eq!(sum, N * (N - 1) / 2);
        assert_eq!(q.num_free(), 64);
    }
}
