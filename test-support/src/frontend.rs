//! A minimal vhost-user frontend that plays a VM for the backend's tests:
//! guest memory in memfds, sent in the memory table as QEMU does; split
//! virtqueues driven from the test ([`Member::submit`], [`Member::wait_used`]);
//! and descriptor writers that put anything in a ring, valid or not
//! ([`Member::raw_desc`], [`Member::write_raw_desc`], [`Member::publish_head`]),
//! for the hostile-guest tests.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

use vhost::vhost_user::message::{VhostUserConfigFlags, VhostUserHeaderFlag};
use vhost::vhost_user::{Frontend, VhostUserFrontend, VhostUserProtocolFeatures};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_dmlc::{VirtioDmlcConfig, VirtioDmlcResp, CONFIG_SIZE};
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use zerocopy::{FromBytes, IntoBytes};

use crate::PATIENCE;

/// Guest memory size of a test member.
pub const MEM_SIZE: usize = 4 << 20;
/// Where the virtqueues live in guest memory: queue q at `q * QUEUE_STRIDE`.
const QUEUE_STRIDE: u64 = 0x2000;
/// Where data buffers start in guest memory.
const DATA_START: u64 = 0x10_0000;

/// One split virtqueue, driven from the test.
pub struct TestQueue {
    size: u16,
    desc: u64,
    avail: u64,
    used: u64,
    next_desc: u16,
    next_avail: u16,
    next_used: u16,
    pub call: EventFd,
    kick: EventFd,
}

/// SET_VRING_ADDR's payload for `queue`, with `host` mapping guest
/// addresses to the frontend's own.
fn ring_addrs(queue: &TestQueue, host: impl Fn(u64) -> u64) -> VringConfigData {
    VringConfigData {
        queue_max_size: queue.size,
        queue_size: queue.size,
        flags: 0,
        desc_table_addr: host(queue.desc),
        used_ring_addr: host(queue.used),
        avail_ring_addr: host(queue.avail),
        log_addr: None,
    }
}

/// A descriptor for [`Member::submit`]: guest address, length, device-writable.
#[derive(Clone, Copy, Debug)]
pub struct Desc {
    pub addr: u64,
    pub len: u32,
    pub write: bool,
}

impl Desc {
    pub fn r(addr: u64, len: usize) -> Desc {
        Desc {
            addr,
            len: u32::try_from(len).unwrap(),
            write: false,
        }
    }
    pub fn w(addr: u64, len: usize) -> Desc {
        Desc {
            addr,
            len: u32::try_from(len).unwrap(),
            write: true,
        }
    }
}

pub const VRING_DESC_F_NEXT: u16 = 1;
pub const VRING_DESC_F_WRITE: u16 = 2;
pub const VRING_DESC_F_INDIRECT: u16 = 4;

/// A new memfd of `size` bytes.
pub fn memfd(size: u64) -> File {
    // SAFETY: the name is a valid C string; the result is checked.
    let fd = unsafe { libc::memfd_create(c"dmlc-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: fd is a new descriptor that nothing else owns.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size).unwrap();
    file
}

/// A minimal frontend playing one VM on one socket.
pub struct Member {
    pub fe: Frontend,
    pub features: u64,
    pub protocol: VhostUserProtocolFeatures,
    pub queue_num: u64,
    pub mem: GuestMemoryMmap<()>,
    pub queues: Vec<TestQueue>,
    event_idx: bool,
    next_data: u64,
}

/// Connects to the backend at `path` and negotiates the protocol features:
/// the frontend, the offered virtio features, the protocol features in
/// use, and the number of queues.
fn handshake(path: &Path) -> (Frontend, u64, VhostUserProtocolFeatures, u64) {
    let mut fe = Frontend::connect(path, 64).expect("connect to the backend");
    fe.set_owner().expect("SET_OWNER");
    let features = fe.get_features().expect("GET_FEATURES");
    let offered = fe.get_protocol_features().expect("GET_PROTOCOL_FEATURES");
    let wanted = VhostUserProtocolFeatures::CONFIG
        | VhostUserProtocolFeatures::MQ
        | VhostUserProtocolFeatures::REPLY_ACK
        | VhostUserProtocolFeatures::RESET_DEVICE;
    let protocol = offered & wanted;
    fe.set_protocol_features(protocol)
        .expect("SET_PROTOCOL_FEATURES");
    // Every later message asks for an ack, so a refused one fails here.
    fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    let queue_num = fe.get_queue_num().expect("GET_QUEUE_NUM");
    (fe, features, protocol, queue_num)
}

impl Member {
    /// Connects and negotiates the protocol features (not yet the virtio
    /// features: see [`Member::start`]).
    pub fn connect(path: &Path) -> Member {
        Member::connect_regions(path, &[(0, MEM_SIZE)])
    }

    /// As [`Member::connect`], with guest memory made of `regions`
    /// (guest address, size), each backed by its own memfd so that two
    /// adjacent regions are not adjacent in host memory. The queues and
    /// data buffers live in the first region, which must start at 0 and
    /// be at least `MEM_SIZE` long.
    pub fn connect_regions(path: &Path, regions: &[(u64, usize)]) -> Member {
        assert!(regions[0].0 == 0 && regions[0].1 >= MEM_SIZE);
        let (fe, features, protocol, queue_num) = handshake(path);

        // Guest RAM shared with the backend through memfds, as QEMU does.
        let mem =
            GuestMemoryMmap::<()>::from_ranges_with_files(regions.iter().map(|&(gpa, size)| {
                let file = memfd(size as u64);
                (GuestAddress(gpa), size, Some(FileOffset::new(file, 0)))
            }))
            .expect("map guest memory");
        Member {
            fe,
            features,
            protocol,
            queue_num,
            mem,
            queues: Vec::new(),
            event_idx: false,
            next_data: DATA_START,
        }
    }

    /// One past the highest guest address.
    pub fn mem_end(&self) -> u64 {
        self.mem.last_addr().0 + 1
    }

    /// A second handle on the vhost-user connection, for raw messages.
    pub fn raw_stream(&self) -> UnixStream {
        // SAFETY: dup of a descriptor the frontend owns and keeps open; the
        // result is checked and owned by the stream alone.
        let fd = unsafe { libc::dup(self.fe.as_raw_fd()) };
        assert!(fd >= 0, "dup: {}", std::io::Error::last_os_error());
        // SAFETY: fd is a new descriptor that nothing else owns.
        unsafe { UnixStream::from_raw_fd(fd) }
    }

    /// Reads `size` bytes of config space at `offset`.
    pub fn config_bytes(&mut self, offset: u32, size: u32) -> vhost::Result<Vec<u8>> {
        let buf = vec![0; size as usize];
        self.fe
            .get_config(offset, size, VhostUserConfigFlags::empty(), &buf)
            .map(|(_, payload)| payload)
    }

    /// Reads the whole config space.
    pub fn config(&mut self) -> VirtioDmlcConfig {
        let bytes = self
            .config_bytes(0, CONFIG_SIZE as u32)
            .expect("GET_CONFIG");
        VirtioDmlcConfig::read_from_bytes(&bytes).expect("48 bytes of config")
    }

    /// Acks `features` and sets up `queues` queues of `size` entries, as a
    /// driver setting DRIVER_OK makes QEMU do.
    pub fn start(&mut self, features: u64, queues: u16, size: u16) {
        let regions = self.mem_table();
        self.start_with_table(features, queues, size, &regions);
    }

    /// The memory table that describes this member's guest memory.
    pub fn mem_table(&self) -> Vec<VhostUserMemoryRegionInfo> {
        self.mem
            .iter()
            .map(|r| VhostUserMemoryRegionInfo::from_guest_region(r).unwrap())
            .collect()
    }

    /// As [`Member::start`], sending `regions` as the memory table.
    pub fn start_with_table(
        &mut self,
        features: u64,
        queues: u16,
        size: u16,
        regions: &[VhostUserMemoryRegionInfo],
    ) {
        self.fe.set_features(features).expect("SET_FEATURES");
        self.event_idx = features & (1 << virtio_dmlc::VIRTIO_RING_F_EVENT_IDX) != 0;
        self.fe.set_mem_table(regions).expect("SET_MEM_TABLE");
        self.queues.clear();
        for q in 0..queues {
            let base = u64::from(q) * QUEUE_STRIDE;
            let s = u64::from(size);
            let queue = TestQueue {
                size,
                desc: base,
                avail: base + 16 * s,
                // The used ring must be 4-byte aligned.
                used: (base + 16 * s + 6 + 2 * s + 3) & !3,
                next_desc: 0,
                next_avail: 0,
                next_used: 0,
                call: EventFd::new(EFD_NONBLOCK).unwrap(),
                kick: EventFd::new(EFD_NONBLOCK).unwrap(),
            };
            assert!(queue.used + 6 + 8 * s <= base + QUEUE_STRIDE);
            // Zero the rings: a reused member starts from clean indices.
            self.mem
                .write_slice(&vec![0; QUEUE_STRIDE as usize], GuestAddress(base))
                .unwrap();
            let host = |gpa: u64| self.mem.get_host_address(GuestAddress(gpa)).unwrap() as u64;
            let i = usize::from(q);
            self.fe.set_vring_num(i, size).expect("SET_VRING_NUM");
            self.fe.set_vring_base(i, 0).expect("SET_VRING_BASE");
            self.fe
                .set_vring_addr(i, &ring_addrs(&queue, host))
                .expect("SET_VRING_ADDR");
            self.fe
                .set_vring_kick(i, &queue.kick)
                .expect("SET_VRING_KICK");
            self.fe
                .set_vring_call(i, &queue.call)
                .expect("SET_VRING_CALL");
            if self.protocol_features_acked() {
                self.fe.set_vring_enable(i, true).expect("SET_VRING_ENABLE");
            }
            self.queues.push(queue);
        }
    }

    fn protocol_features_acked(&self) -> bool {
        self.features & vhost::vhost_user::VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0
    }

    /// Stops queue `q` with GET_VRING_BASE alone. QEMU does this when the
    /// VM is paused (after SET_VRING_ENABLE 0, see [`Member::pause_queue`]),
    /// and after RESET_DEVICE when the driver resets the device.
    pub fn stop_queue(&mut self, q: usize) -> u32 {
        self.fe.get_vring_base(q).expect("GET_VRING_BASE")
    }

    /// Stops queue `q` as QEMU does when the VM is paused; returns the
    /// ring base to give [`Member::resume_queue`].
    pub fn pause_queue(&mut self, q: usize) -> u32 {
        if self.protocol_features_acked() {
            self.fe
                .set_vring_enable(q, false)
                .expect("SET_VRING_ENABLE");
        }
        self.stop_queue(q)
    }

    /// Hands this member's rings, as they are, to the backend at `path` on
    /// a new connection, as QEMU does when it reconnects to a restarted
    /// daemon: it could not read the ring base from the dead one, so each
    /// ring starts again at the driver's used index, and chains the old
    /// backend had taken but not completed are available again.
    pub fn hand_over(&mut self, path: &Path, features: u64) {
        let (fe, offered, protocol, queue_num) = handshake(path);
        self.fe = fe;
        self.features = offered;
        self.protocol = protocol;
        self.queue_num = queue_num;
        self.fe.set_features(features).expect("SET_FEATURES");
        self.fe
            .set_mem_table(&self.mem_table())
            .expect("SET_MEM_TABLE");
        for q in 0..self.queues.len() {
            let used: u16 = self
                .mem
                .load(GuestAddress(self.queues[q].used + 2), Ordering::Acquire)
                .map(u16::from_le)
                .unwrap();
            self.resume_queue(q, u32::from(used));
        }
    }

    /// Starts queue `q` again as QEMU does when a paused VM runs: the same
    /// rings, not zeroed, from `base`, in QEMU's order (the call eventfd
    /// comes last).
    pub fn resume_queue(&mut self, q: usize, base: u32) {
        let queue = &self.queues[q];
        let host = |gpa: u64| self.mem.get_host_address(GuestAddress(gpa)).unwrap() as u64;
        self.fe.set_vring_num(q, queue.size).expect("SET_VRING_NUM");
        self.fe
            .set_vring_base(q, base as u16)
            .expect("SET_VRING_BASE");
        self.fe
            .set_vring_addr(q, &ring_addrs(queue, host))
            .expect("SET_VRING_ADDR");
        self.fe
            .set_vring_kick(q, &queue.kick)
            .expect("SET_VRING_KICK");
        if self.protocol_features_acked() {
            self.fe.set_vring_enable(q, true).expect("SET_VRING_ENABLE");
        }
        self.fe
            .set_vring_call(q, &queue.call)
            .expect("SET_VRING_CALL");
    }

    /// A fresh guest buffer of `len` bytes (64-byte aligned).
    pub fn alloc(&mut self, len: usize) -> u64 {
        let addr = self.next_data;
        self.next_data = (addr + len as u64 + 63) & !63;
        assert!(self.next_data <= MEM_SIZE as u64, "test guest memory full");
        addr
    }

    pub fn write<T: IntoBytes + zerocopy::Immutable + ?Sized>(&self, addr: u64, value: &T) {
        self.mem
            .write_slice(value.as_bytes(), GuestAddress(addr))
            .unwrap();
    }

    pub fn read_bytes(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut buf = vec![0; len];
        self.mem.read_slice(&mut buf, GuestAddress(addr)).unwrap();
        buf
    }

    pub fn read_resp(&self, addr: u64) -> VirtioDmlcResp {
        VirtioDmlcResp::read_from_bytes(&self.read_bytes(addr, virtio_dmlc::RESP_SIZE)).unwrap()
    }

    /// Submits a barrier with `tag` on queue `q` (a header and a response
    /// only); returns its head index and the address of its response.
    pub fn barrier(&mut self, q: usize, tag: u64) -> (u16, u64) {
        use virtio_dmlc::{Opcode, VirtioDmlcReq, REQ_HEADER_SIZE, RESP_SIZE};
        let hdr = self.alloc(REQ_HEADER_SIZE);
        let resp = self.alloc(RESP_SIZE);
        self.write(
            hdr,
            &VirtioDmlcReq {
                opcode: Opcode::Barrier.raw().into(),
                tag: tag.into(),
                ..Default::default()
            },
        );
        let head = self.submit(
            q,
            &[Desc::r(hdr, REQ_HEADER_SIZE), Desc::w(resp, RESP_SIZE)],
        );
        (head, resp)
    }

    /// Makes the chain `descs` available on queue `q` and kicks. Returns
    /// the head index.
    pub fn submit(&mut self, q: usize, descs: &[Desc]) -> u16 {
        self.publish(q, descs);
        self.kick(q);
        self.queues[q].next_desc.wrapping_sub(descs.len() as u16) % self.queues[q].size
    }

    /// Makes the chain available without kicking.
    pub fn publish(&mut self, q: usize, descs: &[Desc]) {
        let mem = &self.mem;
        let queue = &mut self.queues[q];
        let n = u16::try_from(descs.len()).unwrap();
        assert!(n > 0 && n <= queue.size);
        if queue.next_desc + n > queue.size {
            queue.next_desc = 0;
        }
        let head = queue.next_desc;
        for (i, d) in descs.iter().enumerate() {
            let idx = head + i as u16;
            let mut flags = if d.write { VRING_DESC_F_WRITE } else { 0 };
            let next = if i + 1 < descs.len() {
                flags |= VRING_DESC_F_NEXT;
                idx + 1
            } else {
                0
            };
            let at = queue.desc + 16 * u64::from(idx);
            mem.write_obj(d.addr.to_le(), GuestAddress(at)).unwrap();
            mem.write_obj(d.len.to_le(), GuestAddress(at + 8)).unwrap();
            mem.write_obj(flags.to_le(), GuestAddress(at + 12)).unwrap();
            mem.write_obj(next.to_le(), GuestAddress(at + 14)).unwrap();
        }
        queue.next_desc = head + n;
        self.publish_head(q, head);
    }

    /// The avail index the driver last published on queue `q`.
    pub fn avail_idx(&self, q: usize) -> u16 {
        self.queues[q].next_avail
    }

    /// Where queue `q`'s area starts, where its used ring (with the
    /// avail_event field) ends, and where the area ends.
    pub fn queue_area(&self, q: usize) -> (u64, u64, u64) {
        let queue = &self.queues[q];
        let base = q as u64 * QUEUE_STRIDE;
        (
            base,
            queue.used + 6 + 8 * u64::from(queue.size),
            base + QUEUE_STRIDE,
        )
    }

    /// Entries of queue `q`.
    pub fn queue_size(&self, q: usize) -> u16 {
        self.queues[q].size
    }

    /// Reserves `n` consecutive descriptor-table entries of queue `q` (from
    /// the allocator [`Member::publish`] uses) and returns the first.
    pub fn take_descs(&mut self, q: usize, n: u16) -> u16 {
        let queue = &mut self.queues[q];
        assert!(n > 0 && n <= queue.size);
        if queue.next_desc + n > queue.size {
            queue.next_desc = 0;
        }
        let first = queue.next_desc;
        queue.next_desc += n;
        first
    }

    /// Writes descriptor `idx` of queue `q` as given, whatever it says.
    pub fn raw_desc(&self, q: usize, idx: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let at = self.queues[q].desc + 16 * u64::from(idx);
        self.write_raw_desc(at, addr, len, flags, next);
    }

    /// Writes one descriptor at guest address `at` (an indirect table entry).
    pub fn write_raw_desc(&self, at: u64, addr: u64, len: u32, flags: u16, next: u16) {
        let mem = &self.mem;
        mem.write_obj(addr.to_le(), GuestAddress(at)).unwrap();
        mem.write_obj(len.to_le(), GuestAddress(at + 8)).unwrap();
        mem.write_obj(flags.to_le(), GuestAddress(at + 12)).unwrap();
        mem.write_obj(next.to_le(), GuestAddress(at + 14)).unwrap();
    }

    /// Makes `head` available on queue `q`, whatever it is, without kicking.
    pub fn publish_head(&mut self, q: usize, head: u16) {
        let mem = &self.mem;
        let queue = &mut self.queues[q];
        let slot = queue.avail + 4 + 2 * u64::from(queue.next_avail % queue.size);
        mem.write_obj(head.to_le(), GuestAddress(slot)).unwrap();
        queue.next_avail = queue.next_avail.wrapping_add(1);
        if self.event_idx {
            // used_event: interrupt as soon as anything is used.
            let used_event = queue.avail + 4 + 2 * u64::from(queue.size);
            mem.write_obj(queue.next_used.to_le(), GuestAddress(used_event))
                .unwrap();
        }
        fence(Ordering::SeqCst);
        mem.store(
            queue.next_avail.to_le(),
            GuestAddress(queue.avail + 2),
            Ordering::Release,
        )
        .unwrap();
    }

    pub fn kick(&self, q: usize) {
        self.queues[q].kick.write(1).unwrap();
    }

    /// Puts a raw value in the avail ring's index (to break the ring).
    pub fn set_avail_idx(&mut self, q: usize, idx: u16) {
        let queue = &mut self.queues[q];
        queue.next_avail = idx;
        self.mem
            .store(
                idx.to_le(),
                GuestAddress(queue.avail + 2),
                Ordering::Release,
            )
            .unwrap();
    }

    /// The next used element of queue `q`, if the device returned one.
    pub fn try_used(&mut self, q: usize) -> Option<(u16, u32)> {
        let queue = &mut self.queues[q];
        let idx: u16 = self
            .mem
            .load(GuestAddress(queue.used + 2), Ordering::Acquire)
            .map(u16::from_le)
            .unwrap();
        if idx == queue.next_used {
            return None;
        }
        let at = queue.used + 4 + 8 * u64::from(queue.next_used % queue.size);
        let id: u32 = self.mem.read_obj(GuestAddress(at)).unwrap();
        let len: u32 = self.mem.read_obj(GuestAddress(at + 4)).unwrap();
        queue.next_used = queue.next_used.wrapping_add(1);
        Some((u16::try_from(u32::from_le(id)).unwrap(), u32::from_le(len)))
    }

    /// Waits for the next used element of queue `q`.
    pub fn wait_used(&mut self, q: usize) -> (u16, u32) {
        self.wait_used_for(q, PATIENCE)
            .unwrap_or_else(|| panic!("queue {q}: no completion within {PATIENCE:?}"))
    }

    pub fn wait_used_for(&mut self, q: usize, patience: Duration) -> Option<(u16, u32)> {
        let deadline = Instant::now() + patience;
        loop {
            if let Some(used) = self.try_used(q) {
                return Some(used);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Whether the device signals queue `q`'s call eventfd (since the last
    /// look) within `patience`. The device signals just after it updates
    /// the used ring, so a driver that polls may see the update first.
    pub fn wait_interrupt(&self, q: usize, patience: Duration) -> bool {
        let deadline = Instant::now() + patience;
        loop {
            if self.queues[q].call.read().is_ok_and(|n| n > 0) {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}
