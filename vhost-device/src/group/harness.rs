//! Test harness: members with real guest memory and split queues, a
//! driver side that writes descriptor chains, and a completion recorder.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use virtio_bindings::bindings::virtio_ring::{
    VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE,
};
use virtio_dmlc::comm::{
    VirtioDmlcReqComm, VirtioDmlcRespComm, REQ_COMM_HEADER_SIZE, RESP_COMM_SIZE,
};
use virtio_dmlc::{VirtioDmlcReq, VirtioDmlcResp, REQ_HEADER_SIZE, RESP_SIZE};
use virtio_queue::desc::{split::Descriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{DescriptorChain, Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};
use zerocopy::{FromBytes, IntoBytes};

use super::{Completion, Group, GroupConfig};
use crate::GuestMem;

/// Descriptors per queue.
const QSIZE: u16 = 256;
/// Each queue's rings take this much guest memory, from address 0.
const QUEUE_AREA: u64 = 0x1_0000;
/// Indirect descriptor tables live here.
const INDIRECT_AREA: u64 = 0x8_0000;
/// Data buffers are allocated from here.
const DATA_START: u64 = 0x10_0000;

/// One descriptor as the driver writes it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Desc {
    pub addr: u64,
    pub len: u32,
    pub write: bool,
}

impl Desc {
    pub fn r(addr: u64, len: u32) -> Self {
        Desc {
            addr,
            len,
            write: false,
        }
    }
    pub fn w(addr: u64, len: u32) -> Self {
        Desc {
            addr,
            len,
            write: true,
        }
    }
}

/// One finished chain, as the used ring would see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Done {
    pub rank: u32,
    pub queue: u16,
    pub head: u16,
    pub written: u32,
    /// When the completion was made.
    pub at: Instant,
}

/// Collects completions of every member.
#[derive(Default)]
pub(crate) struct Hub {
    done: Mutex<Vec<Done>>,
    cv: Condvar,
}

impl Hub {
    /// The completion of `p`, if it came within `timeout`.
    pub fn wait_for(&self, p: &Pending, timeout: Duration) -> Option<Done> {
        let deadline = Instant::now() + timeout;
        let mut d = self.done.lock().unwrap();
        loop {
            if let Some(i) = d
                .iter()
                .position(|x| x.rank == p.rank && x.queue == p.queue && x.head == p.head)
            {
                return Some(d.remove(i));
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            d = self.cv.wait_timeout(d, deadline - now).unwrap().0;
        }
    }
}

struct Recorder {
    rank: u32,
    hub: Arc<Hub>,
}

impl Completion for Recorder {
    fn put(&self, queue: u16, head: u16, written: u32) -> bool {
        let mut d = self.hub.done.lock().unwrap();
        d.push(Done {
            rank: self.rank,
            queue,
            head,
            written,
            at: Instant::now(),
        });
        self.hub.cv.notify_all();
        false
    }

    fn notify(&self, _queue: u16) {}
}

/// A submitted chain, to wait for.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Pending {
    pub rank: u32,
    pub queue: u16,
    pub head: u16,
    /// Where the response descriptor points (if the chain has one).
    pub resp: u64,
}

/// One member: its guest memory (two adjacent regions, so that buffers can
/// span both), one split queue per queue index, and a bump allocator.
pub(crate) struct Member {
    pub mem: Arc<GuestMem>,
    queues: Vec<Queue>,
    desc_tables: Vec<u64>,
    avail: Vec<u64>,
    next_desc: Vec<u16>,
    next_indirect: u64,
    next_data: u64,
    pub region_size: u64,
}

impl Member {
    fn new(num_queues: u16, region_size: u64) -> Self {
        let mem = Arc::new(
            GuestMem::from_ranges(&[
                (GuestAddress(0), region_size as usize),
                (GuestAddress(region_size), region_size as usize),
            ])
            .unwrap(),
        );
        let mut queues = Vec::new();
        let mut desc_tables = Vec::new();
        let mut avail = Vec::new();
        for q in 0..u64::from(num_queues) {
            let mock = MockSplitQueue::create(&*mem, GuestAddress(q * QUEUE_AREA), QSIZE);
            queues.push(mock.create_queue::<Queue>().unwrap());
            desc_tables.push(mock.desc_table_addr().0);
            avail.push(mock.avail_addr().0);
        }
        Member {
            mem,
            queues,
            desc_tables,
            avail,
            next_desc: vec![0; usize::from(num_queues)],
            next_indirect: INDIRECT_AREA,
            next_data: DATA_START,
            region_size,
        }
    }

    /// Allocates `len` bytes aligned to 64 plus `misalign`.
    pub fn alloc_misaligned(&mut self, len: usize, misalign: u64) -> u64 {
        let addr = self.next_data.next_multiple_of(64) + misalign;
        self.next_data = addr + len as u64 + 64;
        assert!(
            self.next_data <= 2 * self.region_size,
            "test member out of memory"
        );
        addr
    }

    pub fn alloc(&mut self, len: usize) -> u64 {
        self.alloc_misaligned(len, 0)
    }

    /// Allocates `len` bytes that start `before` bytes below the boundary
    /// of the two memory regions.
    pub fn alloc_across_regions(&mut self, before: u64, len: usize) -> u64 {
        let addr = self.region_size - before;
        assert!(self.next_data <= addr, "region boundary already used");
        self.next_data = addr + len as u64 + 64;
        addr
    }

    pub fn write(&self, addr: u64, bytes: &[u8]) {
        self.mem.write_slice(bytes, GuestAddress(addr)).unwrap();
    }

    pub fn read(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.mem.read_slice(&mut v, GuestAddress(addr)).unwrap();
        v
    }

    /// Writes a header into fresh memory and returns its descriptor.
    pub fn header(&mut self, h: &VirtioDmlcReq) -> Desc {
        let a = self.alloc(REQ_HEADER_SIZE);
        self.write(a, h.as_bytes());
        Desc::r(a, REQ_HEADER_SIZE as u32)
    }

    /// Writes a header of feature bit 1 and its table into fresh memory
    /// and returns its descriptor.
    pub fn comm_header(&mut self, h: &VirtioDmlcReqComm, table: &[u8]) -> Desc {
        let len = REQ_COMM_HEADER_SIZE + table.len();
        let a = self.alloc(len);
        self.write(a, h.as_bytes());
        self.write(a + REQ_COMM_HEADER_SIZE as u64, table);
        Desc::r(a, len as u32)
    }

    /// A response descriptor of feature bit 1 (40 bytes), filled with 0xee.
    pub fn comm_response(&mut self) -> Desc {
        let a = self.alloc(RESP_COMM_SIZE);
        self.write(a, &[0xee; RESP_COMM_SIZE]);
        Desc::w(a, RESP_COMM_SIZE as u32)
    }

    /// A response descriptor over fresh memory filled with 0xee.
    pub fn response(&mut self) -> Desc {
        let a = self.alloc(RESP_SIZE);
        self.write(a, &[0xee; RESP_SIZE]);
        Desc::w(a, RESP_SIZE as u32)
    }

    /// Lays `bytes` out as separate segments of `cuts[i]` bytes each (the
    /// last one takes the rest), each at its own address.
    pub fn segments(&mut self, bytes: &[u8], cuts: &[usize], write: bool) -> Vec<Desc> {
        let mut out = Vec::new();
        let mut pos = 0;
        let mut i = 0;
        while pos < bytes.len() {
            let len = match cuts.get(i) {
                Some(&c) if c > 0 => c.min(bytes.len() - pos),
                Some(_) => {
                    // A zero-length descriptor, which the device ignores.
                    let a = self.alloc(8);
                    out.push(Desc {
                        addr: a,
                        len: 0,
                        write,
                    });
                    i += 1;
                    continue;
                }
                None => bytes.len() - pos,
            };
            let a = self.alloc(len);
            self.write(a, &bytes[pos..pos + len]);
            out.push(Desc {
                addr: a,
                len: len as u32,
                write,
            });
            pos += len;
            i += 1;
        }
        out
    }

    /// Reads the bytes behind a list of descriptors, concatenated.
    pub fn gather(&self, descs: &[Desc]) -> Vec<u8> {
        let mut v = Vec::new();
        for d in descs {
            v.extend(self.read(d.addr, d.len as usize));
        }
        v
    }

    /// Places `descs` in queue `q` as one chain (direct) and makes it
    /// available; returns the head index.
    fn place(&mut self, q: u16, descs: &[Desc]) -> u16 {
        let qi = usize::from(q);
        let n = descs.len().max(1) as u16;
        if self.next_desc[qi] + n > QSIZE {
            self.next_desc[qi] = 0;
        }
        let first = self.next_desc[qi];
        self.next_desc[qi] += n;
        self.place_at(q, first, descs);
        first
    }

    /// Writes `descs` as one chain at indices `first..` of queue `q`'s
    /// descriptor table (not made available).
    pub fn place_at(&self, q: u16, first: u16, descs: &[Desc]) {
        for (i, d) in descs.iter().enumerate() {
            let idx = first + i as u16;
            let flags = chain_flags(descs, i);
            self.store_desc(q, idx, Descriptor::new(d.addr, d.len, flags, idx + 1));
        }
    }

    fn store_desc(&self, q: u16, idx: u16, d: Descriptor) {
        let table = self.desc_tables[usize::from(q)];
        self.mem
            .write_obj(
                RawDescriptor::from(d),
                GuestAddress(table + 16 * u64::from(idx)),
            )
            .unwrap();
    }

    /// Writes a raw descriptor (any flags and next) at `idx` of queue `q`.
    pub fn raw_desc(&self, q: u16, idx: u16, addr: u64, len: u32, flags: u16, next: u16) {
        self.store_desc(q, idx, Descriptor::new(addr, len, flags, next));
    }

    /// Makes the chain at `head` available and pops it as the device would.
    pub fn pop(&mut self, q: u16, head: u16) -> DescriptorChain<&GuestMem> {
        let qi = usize::from(q);
        let avail = self.avail[qi];
        let idx: u16 = self.mem.read_obj(GuestAddress(avail + 2)).unwrap();
        let slot = avail + 4 + 2 * u64::from(idx % QSIZE);
        self.mem.write_obj(head, GuestAddress(slot)).unwrap();
        self.mem
            .write_obj(idx.wrapping_add(1), GuestAddress(avail + 2))
            .unwrap();
        let chain = self.queues[qi].pop_descriptor_chain(&*self.mem).unwrap();
        assert_eq!(chain.head_index(), head);
        chain
    }

    /// Places `descs` as a chain on queue `q` and submits it to `group` as
    /// member `rank`.
    pub fn submit(
        &mut self,
        group: &Group,
        rank: u32,
        q: u16,
        descs: &[Desc],
        done: &Arc<dyn Completion>,
    ) -> Pending {
        let head = self.place(q, descs);
        let mem = self.mem.clone();
        let chain = self.pop(q, head);
        group.submit(rank, q, &mem, chain, done);
        Pending {
            rank,
            queue: q,
            head,
            resp: descs.last().map_or(0, |d| d.addr),
        }
    }

    /// A chain made of one indirect descriptor that points to a table
    /// holding `descs`; returns the head index.
    fn place_indirect(&mut self, q: u16, descs: &[Desc]) -> u16 {
        let table = self.next_indirect;
        self.next_indirect += 16 * descs.len() as u64 + 16;
        for (i, d) in descs.iter().enumerate() {
            let flags = chain_flags(descs, i);
            let raw = RawDescriptor::from(Descriptor::new(d.addr, d.len, flags, i as u16 + 1));
            self.mem
                .write_obj(raw, GuestAddress(table + 16 * i as u64))
                .unwrap();
        }
        let qi = usize::from(q);
        if self.next_desc[qi] + 1 > QSIZE {
            self.next_desc[qi] = 0;
        }
        let head = self.next_desc[qi];
        self.next_desc[qi] += 1;
        self.raw_desc(
            q,
            head,
            table,
            16 * descs.len() as u32,
            VRING_DESC_F_INDIRECT as u16,
            0,
        );
        head
    }
}

/// A member with its completion, to drive from its own thread.
pub(crate) type MemberPart = (Member, Arc<dyn Completion>);

/// A group with `n` test members.
pub(crate) struct World {
    pub group: Arc<Group>,
    pub members: Vec<Member>,
    pub hub: Arc<Hub>,
    dones: Vec<Arc<dyn Completion>>,
}

/// A config for tests: generous limits, a long timeout.
pub(crate) fn config(world: u32) -> GroupConfig {
    GroupConfig {
        world_size: world,
        num_queues: 4,
        max_segments: 64,
        max_comms: 8,
        max_bytes: 64 << 20,
        timeout: Duration::from_secs(60),
        reduce_threads: 0,
        group_id: 0x1234,
        faults: crate::fault::Faults::none(),
        timing: None,
        trace_capacity: 0,
        live_control: false,
        remote: None,
    }
}

impl World {
    pub fn new(cfg: GroupConfig) -> Self {
        Self::with_region(cfg, 4 << 20)
    }

    pub fn with_region(cfg: GroupConfig, region_size: u64) -> Self {
        let hub = Arc::new(Hub::default());
        let members = (0..cfg.world_size)
            .map(|_| Member::new(cfg.num_queues, region_size))
            .collect();
        let dones: Vec<Arc<dyn Completion>> = (0..cfg.world_size)
            .map(|rank| {
                Arc::new(Recorder {
                    rank,
                    hub: hub.clone(),
                }) as Arc<dyn Completion>
            })
            .collect();
        let group = Group::new(cfg);
        for rank in 0..dones.len() as u32 {
            group.member_ready(rank);
        }
        World {
            group,
            members,
            hub,
            dones,
        }
    }

    /// Submits `descs` as one direct chain of member `rank` on queue `q`.
    pub fn submit(&mut self, rank: u32, q: u16, descs: &[Desc]) -> Pending {
        let m = &mut self.members[rank as usize];
        m.submit(&self.group, rank, q, descs, &self.dones[rank as usize])
    }

    /// Submits `descs` through an indirect table.
    pub fn submit_indirect(&mut self, rank: u32, q: u16, descs: &[Desc]) -> Pending {
        let m = &mut self.members[rank as usize];
        let head = m.place_indirect(q, descs);
        self.submit_head(rank, q, head, descs.last().map_or(0, |d| d.addr))
    }

    /// Submits the chain already written at `head`.
    pub fn submit_head(&mut self, rank: u32, q: u16, head: u16, resp: u64) -> Pending {
        let m = &mut self.members[rank as usize];
        let mem = m.mem.clone();
        let chain = m.pop(q, head);
        self.group
            .submit(rank, q, &mem, chain, &self.dones[rank as usize]);
        Pending {
            rank,
            queue: q,
            head,
            resp,
        }
    }

    /// The completion of `p`, if it came within `timeout`.
    pub fn wait_for(&self, p: &Pending, timeout: Duration) -> Option<Done> {
        self.hub.wait_for(p, timeout)
    }

    /// The group, the completion hub, and each member with its completion,
    /// for tests that drive members from their own threads.
    pub fn into_parts(self) -> (Arc<Group>, Arc<Hub>, Vec<MemberPart>) {
        let parts = self.members.into_iter().zip(self.dones).collect();
        (self.group, self.hub, parts)
    }

    /// Waits (up to 10 s) for `p` and returns its written length and response.
    pub fn wait(&self, p: &Pending) -> (u32, VirtioDmlcResp) {
        let done = self
            .wait_for(p, Duration::from_secs(10))
            .unwrap_or_else(|| panic!("no completion for {p:?}"));
        let bytes = self.members[p.rank as usize].read(p.resp, RESP_SIZE);
        (
            done.written,
            VirtioDmlcResp::read_from_bytes(&bytes).unwrap(),
        )
    }

    /// As [`World::wait`], for a response of feature bit 1.
    pub fn wait_comm(&self, p: &Pending) -> (u32, VirtioDmlcRespComm) {
        let done = self
            .wait_for(p, Duration::from_secs(10))
            .unwrap_or_else(|| panic!("no completion for {p:?}"));
        let bytes = self.members[p.rank as usize].read(p.resp, RESP_COMM_SIZE);
        (
            done.written,
            VirtioDmlcRespComm::read_from_bytes(&bytes).unwrap(),
        )
    }

    /// True if `p` has not completed yet.
    pub fn is_pending(&self, p: &Pending) -> bool {
        !self
            .hub
            .done
            .lock()
            .unwrap()
            .iter()
            .any(|x| x.rank == p.rank && x.queue == p.queue && x.head == p.head)
    }

    /// Number of completions recorded and not yet taken.
    pub fn completions(&self) -> usize {
        self.hub.done.lock().unwrap().len()
    }
}

/// A request header.
#[allow(clippy::too_many_arguments)]
pub(crate) fn hdr(
    opcode: u16,
    dtype: u8,
    op: u8,
    root: u32,
    count: u64,
    tag: u64,
    flags: u32,
    timeout_ms: u32,
) -> VirtioDmlcReq {
    VirtioDmlcReq {
        opcode: opcode.into(),
        dtype,
        op,
        root: root.into(),
        count: count.into(),
        tag: tag.into(),
        flags: flags.into(),
        timeout_ms: timeout_ms.into(),
    }
}

/// A small deterministic generator (xorshift64*).
pub(crate) struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// Flags of descriptor `i` of a chain: WRITE as the descriptor says, NEXT
/// on all but the last.
fn chain_flags(descs: &[Desc], i: usize) -> u16 {
    let write = if descs[i].write {
        VRING_DESC_F_WRITE as u16
    } else {
        0
    };
    let next = if i + 1 < descs.len() {
        VRING_DESC_F_NEXT as u16
    } else {
        0
    };
    write | next
}
