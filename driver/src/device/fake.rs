//! The tests' fake transport: a world-of-one device on a thread of its
//! own that serves the rings, holds or fails requests on tagged headers,
//! and can change its group or vanish; and device memory split at page
//! boundaries.

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use virtio_dmlc::{
    bad, Status, VirtioDmlcConfig, VirtioDmlcReq, VirtioDmlcResp, VIRTIO_DMLC_F_REQ_TIMEOUT,
    VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC,
};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use zerocopy::{FromBytes, IntoBytes};

use crate::dma::MemfdMemory;
use crate::dma::{DmaError, DmaMemory, DmaRegion};
use crate::transport::poll_fds;
use crate::transport::{QueueAddrs, Transport, TransportError};
use crate::virtqueue::tests::{Chain, FakeRing, GUEST_BASE};
use crate::virtqueue::VRING_DESC_F_WRITE;

use super::open::bit;
use super::{Device, Dtype, Opcode, OpenOptions, ReduceOp};

pub(super) type TResult<T> = std::result::Result<T, TransportError>;

/// Tag that makes the fake device hold a request until released.
pub(super) const HOLD: u64 = 0x401d;
/// Tags `FAIL | status | detail << 8 | peer << 16` make it fail a request.
pub(super) const FAIL: u64 = 0xfa11 << 48;

#[derive(Default)]
pub(super) struct Shared {
    /// Overrides the config's generation when not 0.
    pub(super) generation: AtomicU32,
    /// Overrides the config's group id when not 0.
    pub(super) group: AtomicU64,
    stop: AtomicBool,
    pub(super) release: AtomicBool,
    pub(super) dead: AtomicBool,
    pub(super) signals: AtomicU64,
    pub(super) notifies: AtomicU64,
}

/// A world-of-one dmlc device: every collective copies the inputs to the
/// outputs (the reduction of one member is its input). It completes what
/// it finds in reverse order, so completions are out of order.
pub(super) struct FakeTransport {
    config: VirtioDmlcConfig,
    offered: u64,
    acked: u64,
    mem: Arc<MemfdMemory>,
    rings: Vec<FakeRing>,
    calls: Vec<Arc<EventFd>>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

pub(super) fn world_of_one() -> VirtioDmlcConfig {
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
    // SAFETY: the driver published a 32-byte header there; its `tag` is
    // the le64 at offset 16.
    u64::from_le(unsafe { std::ptr::read_unaligned(ring.host(first.0 + 16).cast::<u64>()) })
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
    /// Offers `bits` besides what it offers anyway.
    pub(super) fn offer(&mut self, bits: u64) {
        self.offered |= bits;
    }

    pub(super) fn new(config: VirtioDmlcConfig, mem: Arc<MemfdMemory>) -> Self {
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

pub(super) fn open_fake(config: VirtioDmlcConfig, opts: &OpenOptions) -> (Device, Arc<Shared>) {
    open_fake_with(config, opts, None, u64::MAX)
}

/// `page`: device memory that is contiguous only within pages of this
/// size (like hugepages); `features`: mask of what the fake offers.
pub(super) fn open_fake_with(
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
