//! Hostile frontends: one member of the group sends broken rings, broken
//! descriptor chains, broken request headers and broken vhost-user messages
//! to the real daemon, through real sockets, while the other members are
//! honest.
//!
//! Every case checks three things: the offending member gets the status the
//! spec gives (or `used.len == 0`, or is disconnected); the daemon keeps
//! running and serving (a valid allreduce across every member follows, and
//! honest members that were waiting get the documented status); nothing is
//! written outside the buffers offered as writable (every buffer sits
//! between canary guard bytes, checked in every member's memory, and
//! readable buffers must not change).

use std::io::{Read, Write};
use std::net::Shutdown;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use dmlc_test_support::frontend::{
    memfd, Desc, Member, VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE,
};
use dmlc_test_support::{free_local_addr, metric, Backend, PATIENCE};
use vhost::vhost_user::{VhostUserFrontend, VhostUserVirtioFeatures};
use vhost::VhostBackend;
use virtio_dmlc::{
    bad, too_big, unsupported, Dtype, Opcode, ReduceOp, Status, VirtioDmlcReq, VirtioDmlcResp,
    FLAG_IN_PLACE, NO_PEER, REQ_HEADER_SIZE, RESP_SIZE, VIRTIO_F_VERSION_1,
    VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC,
};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use zerocopy::IntoBytes;

const QUEUE_SIZE: u16 = 64;
/// Guard bytes on each side of every buffer.
const GUARD: usize = 64;
const CANARY: u8 = 0xa5;
/// What a writable buffer holds before the device writes it.
const FILL: u8 = 0x5a;
/// Elements of every valid allreduce.
const COUNT: usize = 4;
/// The daemon's limits in these tests.
const MAX_SEGMENTS: u32 = 8;
const MAX_BYTES: u64 = 64 << 10;
const MIB: u64 = 1 << 20;
/// The hostile member's memory: [0, 4M) and [4M, 6M) are adjacent (but
/// separate mappings in the daemon), [6M, 8M) is a hole, [8M, 10M) ends it.
const REGIONS: [(u64, usize); 3] = [(0, 4 << 20), (4 * MIB, 2 << 20), (8 * MIB, 2 << 20)];
const HOLE: u64 = 6 * MIB;
const MEM_END: u64 = 10 * MIB;

fn features() -> u64 {
    VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
        | 1 << VIRTIO_F_VERSION_1
        | 1 << VIRTIO_RING_F_INDIRECT_DESC
        | 1 << VIRTIO_RING_F_EVENT_IDX
}

/// A buffer in a member's memory, between two guards.
struct Buf {
    addr: u64,
    init: Vec<u8>,
    readable: bool,
}

/// A member and the buffers it has offered, for the canary checks.
struct Peer {
    m: Member,
    rank: u32,
    bufs: Vec<Buf>,
}

impl Peer {
    fn connect(daemon: &Backend, rank: u32, hostile: bool) -> Peer {
        let path = daemon.socket(rank);
        let mut m = if hostile {
            Member::connect_regions(&path, &REGIONS)
        } else {
            Member::connect(&path)
        };
        m.start(features(), 1, QUEUE_SIZE);
        Peer {
            m,
            rank,
            bufs: Vec::new(),
        }
    }

    /// Writes the bytes of `data` that lie inside guest memory.
    fn write_some(&self, addr: u64, data: &[u8]) {
        for (i, b) in data.iter().enumerate() {
            let a = GuestAddress(addr.wrapping_add(i as u64));
            if self.m.mem.address_in_range(a) {
                self.m.mem.write_obj(*b, a).unwrap();
            }
        }
    }

    /// Reads `len` bytes at `addr`; bytes outside guest memory read as `None`.
    fn read_some(&self, addr: u64, len: usize) -> Vec<Option<u8>> {
        (0..len as u64)
            .map(|i| {
                let a = GuestAddress(addr.wrapping_add(i));
                self.m.mem.read_obj::<u8>(a).ok()
            })
            .collect()
    }

    /// Puts a guarded buffer holding `init` at `addr` (guards in the
    /// `GUARD` bytes before and after it, where those are guest memory).
    /// A buffer placed over an older one's area replaces it.
    fn place(&mut self, addr: u64, init: &[u8], readable: bool) -> u64 {
        let span = |a: u64, len: usize| {
            let lo = a.saturating_sub(GUARD as u64);
            (lo, a.saturating_add((len + GUARD) as u64))
        };
        let (lo, hi) = span(addr, init.len());
        self.bufs.retain(|b| {
            let (blo, bhi) = span(b.addr, b.init.len());
            bhi <= lo || hi <= blo
        });
        self.write_some(addr.wrapping_sub(GUARD as u64), &[CANARY; GUARD]);
        self.write_some(addr, init);
        self.write_some(addr.wrapping_add(init.len() as u64), &[CANARY; GUARD]);
        self.bufs.push(Buf {
            addr,
            init: init.to_vec(),
            readable,
        });
        addr
    }

    fn guarded(&mut self, init: &[u8], readable: bool) -> u64 {
        let base = self.m.alloc(init.len() + 2 * GUARD);
        self.place(base + GUARD as u64, init, readable)
    }

    /// A guarded device-readable buffer.
    fn r(&mut self, init: &[u8]) -> u64 {
        self.guarded(init, true)
    }

    /// A guarded device-writable buffer of `len` bytes.
    fn w(&mut self, len: usize) -> u64 {
        self.guarded(&vec![FILL; len], false)
    }

    fn hdr(&mut self, h: &VirtioDmlcReq) -> u64 {
        self.r(h.as_bytes())
    }

    /// Every guard is intact and every readable buffer unchanged.
    fn check_canaries(&self, what: &str) {
        for b in &self.bufs {
            let before = self.read_some(b.addr.wrapping_sub(GUARD as u64), GUARD);
            let after = self.read_some(b.addr.wrapping_add(b.init.len() as u64), GUARD);
            for (i, v) in before.iter().chain(&after).enumerate() {
                assert!(
                    v.is_none_or(|v| v == CANARY),
                    "{what}: rank {} guard byte {i} of the buffer at {:#x} overwritten",
                    self.rank,
                    b.addr
                );
            }
            if b.readable {
                assert!(
                    self.unchanged(b.addr),
                    "{what}: rank {} readable buffer at {:#x} changed",
                    self.rank,
                    b.addr
                );
            }
        }
    }

    /// Whether the buffer placed around `addr` still holds what it was given.
    fn unchanged(&self, addr: u64) -> bool {
        let b = self
            .bufs
            .iter()
            .rev()
            .find(|b| b.addr <= addr && addr < b.addr + b.init.len() as u64)
            .expect("a placed buffer");
        self.read_some(b.addr, b.init.len())
            .iter()
            .zip(&b.init)
            .all(|(v, i)| v.is_none_or(|v| v == *i))
    }

    fn resp(&self, addr: u64) -> VirtioDmlcResp {
        self.m.read_resp(addr)
    }
}

fn req(opcode: u16, dtype: u8, op: u8, root: u32, count: u64, flags: u32) -> VirtioDmlcReq {
    VirtioDmlcReq {
        opcode: opcode.into(),
        dtype,
        op,
        root: root.into(),
        count: count.into(),
        flags: flags.into(),
        ..Default::default()
    }
}

/// The f32 sum allreduce header every valid request uses.
fn std_req(tag: u64) -> VirtioDmlcReq {
    let mut h = req(
        Opcode::Allreduce.raw(),
        Dtype::F32.raw(),
        ReduceOp::Sum.raw(),
        0,
        COUNT as u64,
        0,
    );
    h.tag = tag.into();
    h
}

/// Rank `rank`'s input in round `tag`: small integers, so sums are exact.
fn std_input(rank: u32, tag: u64) -> Vec<f32> {
    (0..COUNT)
        .map(|i| ((rank + 1) * 100) as f32 + (i * 3) as f32 + (tag % 1000) as f32)
        .collect()
}

fn std_sum(n: u32, tag: u64) -> Vec<f32> {
    (0..COUNT)
        .map(|i| (0..n).map(|r| std_input(r, tag)[i]).sum())
        .collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn status_of(r: &VirtioDmlcResp) -> (Option<Status>, u32) {
    (Status::from_raw(r.status.get()), r.detail.get())
}

/// A valid request of one member, in flight.
struct Pending {
    head: u16,
    out: u64,
    resp: u64,
}

/// What a hostile submission should get.
#[derive(Clone, Copy, Debug)]
enum Want {
    /// A response with this status and detail, and this used length.
    Status(Status, u32, u32),
    /// Used length 0 and nothing written.
    NoStatus,
    /// A valid request after all: it takes part in the round and gets the
    /// sum in the given output pieces.
    Ok,
}

/// A hostile submission.
struct Sent {
    head: u16,
    /// Where the response goes if the device finds one.
    resp: Option<u64>,
    /// Writable buffers of the chain (the response included).
    writable: Vec<u64>,
    /// For `Want::Ok`: the output, as (address, length) pieces in order.
    out: Vec<(u64, usize)>,
}

/// The daemon, one hostile member and honest ones.
struct Rig {
    daemon: Backend,
    peers: Vec<Option<Peer>>,
    hostile: u32,
    n: u32,
    round: u64,
    generation: u32,
    cases: usize,
    /// The daemon's metrics address, where a test needs to know that
    /// requests reached the engine.
    metrics: Option<String>,
}

impl Rig {
    fn new(n: u32, hostile: u32, extra: &[&str]) -> Rig {
        let daemon = Backend::start("hostile", n, extra);
        let peers = (0..n)
            .map(|r| Some(Peer::connect(&daemon, r, r == hostile)))
            .collect();
        Rig {
            daemon,
            peers,
            hostile,
            n,
            round: 1,
            generation: 1,
            cases: 0,
            metrics: None,
        }
    }

    /// As [`Rig::new`], with the metrics endpoint on.
    fn with_metrics(n: u32, hostile: u32, extra: &[&str]) -> Rig {
        let addr = free_local_addr();
        let mut rig = Rig::new(n, hostile, &[extra, &["--metrics-addr", &addr]].concat());
        rig.metrics = Some(addr);
        rig
    }

    /// Allreduce requests the daemon has taken from the rings so far.
    fn taken(&self) -> u64 {
        self.metric("dmlc_requests_total{opcode=\"allreduce\"}")
    }

    /// The value of the metrics series `series` (a counter or a gauge).
    fn metric(&self, series: &str) -> u64 {
        let addr = self.metrics.as_deref().expect("a rig with metrics");
        metric(addr, series) as u64
    }

    /// The honest members submit the valid allreduce, and this returns once
    /// the daemon has taken every one of them: a loss after that fails them
    /// all (one taken after a loss would belong to the new generation).
    fn submit_honest_taken(&mut self) -> Vec<Pending> {
        let before = self.taken();
        let honest = self.honest();
        let pending: Vec<Pending> = honest.iter().map(|&r| self.submit_std(r)).collect();
        let deadline = Instant::now() + PATIENCE;
        while self.taken() < before + honest.len() as u64 {
            assert!(Instant::now() < deadline, "requests not taken");
            std::thread::sleep(Duration::from_millis(2));
        }
        // The daemon counts a request under its state lock, so a loss
        // (which takes that lock) comes after the filing.
        pending
    }

    fn peer(&mut self, rank: u32) -> &mut Peer {
        self.peers[rank as usize]
            .as_mut()
            .expect("member connected")
    }

    fn bad(&mut self) -> &mut Peer {
        let h = self.hostile;
        self.peer(h)
    }

    fn honest(&self) -> Vec<u32> {
        (0..self.n).filter(|&r| r != self.hostile).collect()
    }

    /// Canaries of every connected member, and the daemon alive.
    fn check(&mut self, what: &str) {
        self.daemon.assert_running();
        for p in self.peers.iter().flatten() {
            p.check_canaries(what);
        }
    }

    /// Drops the hostile member (if connected) and connects it again.
    fn reconnect_hostile(&mut self) {
        let h = self.hostile as usize;
        if let Some(p) = self.peers[h].take() {
            // Keep its canaries checked one last time.
            p.check_canaries("before reconnecting");
        }
        self.peers[h] = Some(Peer::connect(&self.daemon, self.hostile, true));
    }

    /// A valid f32 sum allreduce of `rank` on queue 0, kicked.
    fn submit_std(&mut self, rank: u32) -> Pending {
        let tag = self.round;
        let p = self.peer(rank);
        let hdr = p.hdr(&std_req(tag));
        let inp = p.r(&f32_bytes(&std_input(rank, tag)));
        let out = p.w(4 * COUNT);
        let resp = p.w(RESP_SIZE);
        let head = p.m.submit(
            0,
            &[
                Desc::r(hdr, REQ_HEADER_SIZE),
                Desc::r(inp, 4 * COUNT),
                Desc::w(out, 4 * COUNT),
                Desc::w(resp, RESP_SIZE),
            ],
        );
        Pending { head, out, resp }
    }

    /// Waits for `p` of `rank` and checks an OK with the round's sum.
    fn finish_ok(&mut self, rank: u32, p: &Pending, what: &str) {
        let (sum, generation) = (std_sum(self.n, self.round), self.generation);
        let peer = self.peer(rank);
        let (head, len) = peer.m.wait_used(0);
        assert_eq!(head, p.head, "{what}: rank {rank} completion order");
        assert_eq!(len as usize, 4 * COUNT + RESP_SIZE, "{what}: used length");
        let r = peer.resp(p.resp);
        assert_eq!(status_of(&r), (Some(Status::Ok), 0), "{what}: rank {rank}");
        assert_eq!(r.peer.get(), NO_PEER);
        assert_eq!(r.generation.get(), generation, "{what}: generation");
        assert_eq!(
            peer.m.read_bytes(p.out, 4 * COUNT),
            f32_bytes(&sum),
            "{what}: rank {rank} sum"
        );
    }

    /// Waits for each honest member's `pending` request and checks that it
    /// met a copy of the hostile member's previous request: a tag mismatch
    /// naming the hostile rank.
    fn finish_tag_mismatch(&mut self, honest: &[u32], pending: &[Pending], what: &str) {
        let h = self.hostile;
        for (&r, pend) in honest.iter().zip(pending) {
            let peer = self.peer(r);
            let (head, _) = peer.m.wait_used(0);
            assert_eq!(head, pend.head, "{what}: rank {r} completion order");
            let resp = peer.resp(pend.resp);
            assert_eq!(
                status_of(&resp),
                (Some(Status::Mismatch), virtio_dmlc::mismatch::TAG),
                "{what}: rank {r}"
            );
            assert_eq!(resp.peer.get(), h, "{what}: rank {r} peer");
        }
    }

    /// Waits for `p` of `rank` and checks it failed with `status`, naming
    /// `peer_rank`, in the current generation.
    fn finish_failed(
        &mut self,
        rank: u32,
        p: &Pending,
        status: Status,
        peer_rank: u32,
        what: &str,
    ) {
        let generation = self.generation;
        let peer = self.peer(rank);
        let (head, len) = peer.m.wait_used(0);
        assert_eq!(head, p.head, "{what}: rank {rank} completion order");
        assert_eq!(len as usize, 4 * COUNT + RESP_SIZE, "{what}: used length");
        let r = peer.resp(p.resp);
        assert_eq!(status_of(&r), (Some(status), 0), "{what}: rank {rank}");
        assert_eq!(r.peer.get(), peer_rank, "{what}: peer");
        assert_eq!(r.generation.get(), generation, "{what}: generation");
    }

    /// The daemon still serves: a valid allreduce across every member.
    fn allreduce_all(&mut self, what: &str) {
        let pending: Vec<Pending> = (0..self.n).map(|r| self.submit_std(r)).collect();
        for (r, p) in (0..self.n).zip(&pending) {
            self.finish_ok(r, p, what);
        }
        self.round += 1;
        self.check(what);
    }

    /// One chain case: the honest members submit a valid allreduce, the
    /// hostile member submits what `build` makes, gets `want`, then (unless
    /// its chain was valid after all) its own valid request; every member
    /// gets the sum, and every canary holds.
    fn chain_case(&mut self, what: &str, want: Want, build: impl FnOnce(&mut Peer, u64) -> Sent) {
        let honest = self.honest();
        let pending: Vec<Pending> = honest.iter().map(|&r| self.submit_std(r)).collect();
        let tag = self.round;
        let generation = self.generation;
        let p = self.bad();
        let sent = build(p, tag);
        let (head, len) = p.m.wait_used(0);
        assert_eq!(head, sent.head, "{what}: head of the used element");
        match want {
            Want::Status(status, detail, used_len) => {
                let at = sent.resp.expect("a response address");
                let r = p.resp(at);
                assert_eq!(
                    status_of(&r),
                    (Some(status), detail),
                    "{what}: status and detail"
                );
                assert_eq!(r.peer.get(), NO_PEER, "{what}: peer");
                assert_eq!(r.generation.get(), generation, "{what}: generation");
                assert_eq!(len, used_len, "{what}: used length");
                for &w in sent.writable.iter().filter(|&&w| w != at) {
                    assert!(p.unchanged(w), "{what}: data buffer {w:#x} written");
                }
            }
            Want::NoStatus => {
                assert_eq!(len, 0, "{what}: used length");
                for &w in &sent.writable {
                    assert!(p.unchanged(w), "{what}: buffer {w:#x} written");
                }
            }
            Want::Ok => {
                let r = p.resp(sent.resp.expect("a response"));
                assert_eq!(status_of(&r), (Some(Status::Ok), 0), "{what}: status");
                let mut got = Vec::new();
                for &(a, l) in &sent.out {
                    got.extend(p.m.read_bytes(a, l));
                }
                assert_eq!(got, f32_bytes(&std_sum(self.n, tag)), "{what}: sum");
            }
        }
        if !matches!(want, Want::Ok) {
            let h = self.hostile;
            let mine = self.submit_std(h);
            self.finish_ok(h, &mine, what);
        }
        for (&r, p) in honest.iter().zip(&pending) {
            self.finish_ok(r, p, what);
        }
        self.round += 1;
        self.check(what);
        self.cases += 1;
    }
}

/// The usual chain of the hostile member, as descriptors, with its
/// writable buffers: [header] [input] [output] [response].
struct Std {
    descs: Vec<Desc>,
    out: u64,
    resp: u64,
}

fn std_chain(p: &mut Peer, h: &VirtioDmlcReq, tag: u64) -> Std {
    let hdr = p.hdr(h);
    let inp = p.r(&f32_bytes(&std_input(p.rank, tag)));
    let out = p.w(4 * COUNT);
    let resp = p.w(RESP_SIZE);
    Std {
        descs: vec![
            Desc::r(hdr, REQ_HEADER_SIZE),
            Desc::r(inp, 4 * COUNT),
            Desc::w(out, 4 * COUNT),
            Desc::w(resp, RESP_SIZE),
        ],
        out,
        resp,
    }
}

/// Submits `descs` as a plain chain; the response is the last descriptor.
fn send(p: &mut Peer, descs: &[Desc]) -> Sent {
    let head = p.m.submit(0, descs);
    let last = descs.last().unwrap();
    Sent {
        head,
        resp: Some(last.addr),
        writable: descs.iter().filter(|d| d.write).map(|d| d.addr).collect(),
        out: Vec::new(),
    }
}

/// Submits the standard chain with header `h` changed by `edit`.
fn send_edited(
    p: &mut Peer,
    h: &VirtioDmlcReq,
    tag: u64,
    edit: impl FnOnce(&mut Vec<Desc>),
) -> Sent {
    let mut s = std_chain(p, h, tag);
    edit(&mut s.descs);
    send(p, &s.descs)
}

fn flags_of(d: &Desc) -> u16 {
    if d.write {
        VRING_DESC_F_WRITE
    } else {
        0
    }
}

/// Writes an indirect table for `descs` (entry i's next is i + 1) into a
/// guarded readable buffer, at `at` if given, and returns its address.
fn table(p: &mut Peer, descs: &[(u64, u32, u16, u16)], at: Option<u64>) -> u64 {
    let mut bytes = Vec::new();
    for &(addr, len, flags, next) in descs {
        bytes.extend(addr.to_le_bytes());
        bytes.extend(len.to_le_bytes());
        bytes.extend(flags.to_le_bytes());
        bytes.extend(next.to_le_bytes());
    }
    match at {
        Some(a) => p.place(a, &bytes, true),
        None => p.r(&bytes),
    }
}

/// The entries of a well-formed indirect table for `descs`.
fn entries(descs: &[Desc]) -> Vec<(u64, u32, u16, u16)> {
    descs
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let last = i + 1 == descs.len();
            let next = if last { 0 } else { VRING_DESC_F_NEXT };
            (
                d.addr,
                d.len,
                flags_of(d) | next,
                if last { 0 } else { i as u16 + 1 },
            )
        })
        .collect()
}

/// Makes one descriptor that refers to the table at `addr` available.
fn send_indirect(p: &mut Peer, addr: u64, len: u32, extra_flags: u16, next: u16) -> u16 {
    let head = p.m.take_descs(0, 1);
    p.m.raw_desc(
        0,
        head,
        addr,
        len,
        VRING_DESC_F_INDIRECT | extra_flags,
        next,
    );
    p.m.publish_head(0, head);
    p.m.kick(0);
    head
}

fn indirect_sent(head: u16, descs: &[Desc], resp: Option<u64>) -> Sent {
    Sent {
        head,
        resp,
        writable: descs.iter().filter(|d| d.write).map(|d| d.addr).collect(),
        out: Vec::new(),
    }
}

const F32: u8 = Dtype::F32 as u8;
const SUM: u8 = ReduceOp::Sum as u8;
const ALLREDUCE: u16 = Opcode::Allreduce as u16;

fn chain_daemon_args() -> Vec<String> {
    vec![
        "--max-segments".into(),
        MAX_SEGMENTS.to_string(),
        "--max-bytes".into(),
        MAX_BYTES.to_string(),
    ]
}

fn rig(n: u32, hostile: u32) -> Rig {
    let args = chain_daemon_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Rig::new(n, hostile, &args)
}

#[test]
fn descriptor_loops_and_bad_next_indices() {
    let mut rig = rig(3, 1);
    let resp16 = RESP_SIZE as u32;
    let bad_chain = Want::Status(Status::BadRequest, bad::CHAIN, resp16);
    let nf = VRING_DESC_F_NEXT;
    let wf = VRING_DESC_F_WRITE;

    // header -> response -> header -> ...: the walk stops at the response,
    // which closes the loop.
    rig.chain_case("loop header <-> response", bad_chain, |p, tag| {
        let s = std_chain(p, &std_req(tag), tag);
        let (h, r) = (s.descs[0], s.descs[3]);
        let b = p.m.take_descs(0, 2);
        p.m.raw_desc(0, b, h.addr, h.len, nf, b + 1);
        p.m.raw_desc(0, b + 1, r.addr, r.len, wf | nf, b);
        p.m.publish_head(0, b);
        p.m.kick(0);
        Sent {
            head: b,
            resp: Some(s.resp),
            writable: vec![s.out, s.resp],
            out: vec![],
        }
    });
    // A descriptor that points to itself, and it is the header: no response.
    rig.chain_case("header points to itself", Want::NoStatus, |p, tag| {
        let s = std_chain(p, &std_req(tag), tag);
        let b = p.m.take_descs(0, 1);
        p.m.raw_desc(0, b, s.descs[0].addr, 32, nf, b);
        p.m.publish_head(0, b);
        p.m.kick(0);
        Sent {
            head: b,
            resp: None,
            writable: vec![s.out, s.resp],
            out: vec![],
        }
    });
    // A full request whose response points back to the input: longer than
    // the queue: the walk stops at the response, which closes the loop.
    rig.chain_case("loop longer than the queue", bad_chain, |p, tag| {
        let s = std_chain(p, &std_req(tag), tag);
        let b = p.m.take_descs(0, 4);
        for (i, d) in s.descs.iter().enumerate() {
            let next = if i == 3 { b + 1 } else { b + i as u16 + 1 };
            p.m.raw_desc(0, b + i as u16, d.addr, d.len, flags_of(d) | nf, next);
        }
        p.m.publish_head(0, b);
        p.m.kick(0);
        Sent {
            head: b,
            resp: Some(s.resp),
            writable: vec![s.out, s.resp],
            out: vec![],
        }
    });
    // Loops of every length against the queue size of 64 (2 and 4 divide
    // it, 3 and 5 do not), back to the header or into the middle: the walk
    // stops at the descriptor that closes the loop, whatever the parity.
    // When that is the response: CHAIN there; when it is an output: no
    // status, and the response inside the loop is not written.
    for len in 2u16..=5 {
        for back_to in [0, len - 2] {
            rig.chain_case(
                &format!("loop of {len} closed by the response, back to {back_to}"),
                bad_chain,
                |p, tag| {
                    let s = std_chain(p, &std_req(tag), tag);
                    let b = p.m.take_descs(0, len);
                    // header, outputs (len - 2 of them), response.
                    let mut outs = vec![];
                    for i in 0..len {
                        let (addr, l, f) = match i {
                            0 => (s.descs[0].addr, 32, nf),
                            i if i == len - 1 => (s.resp, resp16, wf | nf),
                            _ => {
                                let o = p.w(4 * COUNT);
                                outs.push(o);
                                (o, 4 * COUNT as u32, wf | nf)
                            }
                        };
                        let next = if i == len - 1 { back_to } else { i + 1 };
                        p.m.raw_desc(0, b + i, addr, l, f, b + next);
                    }
                    p.m.publish_head(0, b);
                    p.m.kick(0);
                    outs.extend([s.out, s.resp]);
                    Sent {
                        head: b,
                        resp: Some(s.resp),
                        writable: outs,
                        out: vec![],
                    }
                },
            );
        }
        rig.chain_case(
            &format!("loop of {len} closed by an output"),
            Want::NoStatus,
            |p, tag| {
                let s = std_chain(p, &std_req(tag), tag);
                let b = p.m.take_descs(0, len + 1);
                // header, response, outputs (len - 1 of them) back to the header.
                let mut outs = vec![];
                for i in 0..=len {
                    let (addr, l, f) = match i {
                        0 => (s.descs[0].addr, 32, nf),
                        1 => (s.resp, resp16, wf | nf),
                        _ => {
                            // 8 bytes: not response-sized.
                            let o = p.w(8);
                            outs.push(o);
                            (o, 8, wf | nf)
                        }
                    };
                    let next = if i == len { 0 } else { i + 1 };
                    p.m.raw_desc(0, b + i, addr, l, f, b + next);
                }
                p.m.publish_head(0, b);
                p.m.kick(0);
                outs.extend([s.out, s.resp]);
                Sent {
                    head: b,
                    resp: None,
                    writable: outs,
                    out: vec![],
                }
            },
        );
    }
    // Next index out of range: from the response (so a status can go
    // there), and from the header (no response).
    for (from_resp, next) in [
        (true, QUEUE_SIZE),
        (true, u16::MAX),
        (false, QUEUE_SIZE + 1),
    ] {
        let want = if from_resp { bad_chain } else { Want::NoStatus };
        rig.chain_case(&format!("next {next} out of range"), want, |p, tag| {
            let s = std_chain(p, &std_req(tag), tag);
            let b = p.m.take_descs(0, 4);
            let n = if from_resp { 4 } else { 1 };
            for (i, d) in s.descs.iter().take(n).enumerate() {
                let nx = if i + 1 == n { next } else { b + i as u16 + 1 };
                p.m.raw_desc(0, b + i as u16, d.addr, d.len, flags_of(d) | nf, nx);
            }
            p.m.publish_head(0, b);
            p.m.kick(0);
            Sent {
                head: b,
                resp: from_resp.then_some(s.resp),
                writable: vec![s.out, s.resp],
                out: vec![],
            }
        });
    }
    // A lone header that ends the chain: no response.
    rig.chain_case("header alone, without a next", Want::NoStatus, |p, tag| {
        let s = std_chain(p, &std_req(tag), tag);
        send(p, &s.descs[..1])
    });
    let cases = rig.cases;
    rig.allreduce_all("after the loop cases");
    println!("hostile: {cases} descriptor-loop cases, daemon alive, canaries intact");
}

#[test]
fn indirect_tables() {
    let mut rig = rig(3, 1);
    let bad_chain = Want::Status(Status::BadRequest, bad::CHAIN, RESP_SIZE as u32);

    // Valid indirect chain (control), also with WRITE set on the indirect
    // descriptor, which the device must ignore.
    for extra in [0, VRING_DESC_F_WRITE] {
        rig.chain_case(
            &format!("valid table, flags {extra:#x}"),
            Want::Ok,
            |p, tag| {
                let s = std_chain(p, &std_req(tag), tag);
                let t = table(p, &entries(&s.descs), None);
                let head = send_indirect(p, t, 64, extra, 0);
                Sent {
                    head,
                    resp: Some(s.resp),
                    writable: vec![],
                    out: vec![(s.out, 4 * COUNT)],
                }
            },
        );
    }
    // The table is outside guest memory, in the hole, or straddles the end
    // of memory or the hole: nothing can be found, nothing is written.
    for at in [
        1u64 << 40,
        HOLE + 0x100,
        MEM_END - 32,
        HOLE - 32,
        u64::MAX - 31,
    ] {
        rig.chain_case(&format!("table at {at:#x}"), Want::NoStatus, |p, tag| {
            let s = std_chain(p, &std_req(tag), tag);
            if at != 1 << 40 && at != u64::MAX - 31 {
                table(p, &entries(&s.descs), Some(at));
            }
            let head = send_indirect(p, at, 64, 0, 0);
            indirect_sent(head, &s.descs, None)
        });
    }
    // The table crosses from one region into the adjacent one: fine.
    rig.chain_case("table across two adjacent regions", Want::Ok, |p, tag| {
        let s = std_chain(p, &std_req(tag), tag);
        let t = table(p, &entries(&s.descs), Some(4 * MIB - 24));
        let head = send_indirect(p, t, 64, 0, 0);
        Sent {
            head,
            resp: Some(s.resp),
            writable: vec![],
            out: vec![(s.out, 4 * COUNT)],
        }
    });
    // Table length not a multiple of 16, zero, or bigger than the walk
    // allows (more than 65535 entries).
    for len in [24u32, 63, 0, 16 * 65536] {
        rig.chain_case(&format!("table length {len}"), Want::NoStatus, |p, tag| {
            let s = std_chain(p, &std_req(tag), tag);
            let t = table(p, &entries(&s.descs), None);
            let head = send_indirect(p, t, len, 0, 0);
            indirect_sent(head, &s.descs, None)
        });
    }
    // A table of one entry that says it has a next: the walk ends in the
    // table, at the response (a status), or at the header (none).
    rig.chain_case("table entries run off its end", bad_chain, |p, tag| {
        let s = std_chain(p, &std_req(tag), tag);
        let mut e = entries(&s.descs);
        e[3].2 |= VRING_DESC_F_NEXT;
        e[3].3 = 4;
        let t = table(p, &e, None);
        let head = send_indirect(p, t, 64, 0, 0);
        indirect_sent(head, &s.descs, Some(s.resp))
    });
    // A loop inside a table bigger than the chain: the walk reads at most
    // the table's entries, and stops at the descriptor that closes the
    // loop whatever the loop's length against the table's (a loop of 3 in
    // 6, 7 and 8 entries; before, 7 and 8 ended on the header or input).
    for size in [6u32, 7, 8] {
        rig.chain_case(
            &format!("loop of 3 in a table of {size}"),
            bad_chain,
            |p, tag| {
                let s = std_chain(p, &std_req(tag), tag);
                let mut e = entries(&[s.descs[0], s.descs[1], s.descs[3]]);
                e[2].2 |= VRING_DESC_F_NEXT;
                e[2].3 = 0;
                e.resize(size as usize, (0, 0, 0, 0));
                let t = table(p, &e, None);
                let head = send_indirect(p, t, 16 * size, 0, 0);
                indirect_sent(head, &s.descs, Some(s.resp))
            },
        );
    }
    // A loop inside the table.
    rig.chain_case("loop inside the table", bad_chain, |p, tag| {
        let s = std_chain(p, &std_req(tag), tag);
        let mut e = entries(&s.descs);
        e[3].2 |= VRING_DESC_F_NEXT;
        e[3].3 = 1;
        let t = table(p, &e, None);
        let head = send_indirect(p, t, 64, 0, 0);
        // The walk stops at the response, which closes the loop.
        indirect_sent(head, &s.descs, Some(s.resp))
    });
    // Nested indirect: a table entry that refers to another table.
    rig.chain_case("nested table after the response", bad_chain, |p, tag| {
        let s = std_chain(p, &std_req(tag), tag);
        let inner = table(p, &entries(&s.descs), None);
        let mut e = entries(&s.descs);
        e[3].2 |= VRING_DESC_F_NEXT;
        e[3].3 = 4;
        e.push((inner, 64, VRING_DESC_F_INDIRECT, 0));
        let t = table(p, &e, None);
        let head = send_indirect(p, t, 80, 0, 0);
        indirect_sent(head, &s.descs, Some(s.resp))
    });
    rig.chain_case("nested table after the header", Want::NoStatus, |p, tag| {
        let s = std_chain(p, &std_req(tag), tag);
        let inner = table(p, &entries(&s.descs[1..]), None);
        let e = vec![
            (s.descs[0].addr, 32, VRING_DESC_F_NEXT, 1),
            (inner, 48, VRING_DESC_F_INDIRECT, 0),
        ];
        let t = table(p, &e, None);
        let head = send_indirect(p, t, 32, 0, 0);
        indirect_sent(head, &s.descs, None)
    });
    // A direct chain ending in an indirect descriptor is allowed by
    // virtio: header direct, the rest in a table.
    rig.chain_case("direct header, then a table", Want::Ok, |p, tag| {
        let s = std_chain(p, &std_req(tag), tag);
        let t = table(p, &entries(&s.descs[1..]), None);
        let b = p.m.take_descs(0, 2);
        p.m.raw_desc(0, b, s.descs[0].addr, 32, VRING_DESC_F_NEXT, b + 1);
        p.m.raw_desc(0, b + 1, t, 48, VRING_DESC_F_INDIRECT, 0);
        p.m.publish_head(0, b);
        p.m.kick(0);
        Sent {
            head: b,
            resp: Some(s.resp),
            writable: vec![],
            out: vec![(s.out, 4 * COUNT)],
        }
    });
    // INDIRECT together with NEXT: the device follows the table and
    // ignores the next field; the descriptor it names is never used.
    rig.chain_case("indirect with NEXT", Want::Ok, |p, tag| {
        let s = std_chain(p, &std_req(tag), tag);
        let t = table(p, &entries(&s.descs), None);
        let decoy = p.w(RESP_SIZE);
        let b = p.m.take_descs(0, 2);
        p.m.raw_desc(0, b + 1, decoy, RESP_SIZE as u32, VRING_DESC_F_WRITE, 0);
        p.m.raw_desc(
            0,
            b,
            t,
            64,
            VRING_DESC_F_INDIRECT | VRING_DESC_F_NEXT,
            b + 1,
        );
        p.m.publish_head(0, b);
        p.m.kick(0);
        // Checked after the case through the canary list: the decoy must
        // keep its fill.
        p.bufs.push(Buf {
            addr: decoy,
            init: vec![FILL; RESP_SIZE],
            readable: true,
        });
        Sent {
            head: b,
            resp: Some(s.resp),
            writable: vec![],
            out: vec![(s.out, 4 * COUNT)],
        }
    });
    // Table entries that point outside guest memory.
    rig.chain_case(
        "table entry outside memory",
        Want::Status(Status::BadRequest, bad::ADDRESS, 32),
        |p, tag| {
            let s = std_chain(p, &std_req(tag), tag);
            let mut descs = s.descs.clone();
            descs[2].addr = HOLE + 0x40;
            let t = table(p, &entries(&descs), None);
            let head = send_indirect(p, t, 64, 0, 0);
            indirect_sent(head, &s.descs, Some(s.resp))
        },
    );
    let cases = rig.cases;
    rig.allreduce_all("after the indirect cases");
    println!("hostile: {cases} indirect-table cases, daemon alive, canaries intact");
}

#[test]
fn addresses_outside_and_across_guest_memory() {
    let mut rig = rig(2, 0);
    let addr_bad = |used: u32| Want::Status(Status::BadRequest, bad::ADDRESS, used);
    let std_used = (4 * COUNT + RESP_SIZE) as u32;

    // Input or output outside memory, in the hole, straddling the end of
    // memory or the start of the hole, or wrapping around.
    let spots: [(&str, u64); 6] = [
        ("far away", 1 << 40),
        ("in the hole", HOLE + 0x1000),
        ("across the end of memory", MEM_END - 8),
        ("across the start of the hole", HOLE - 8),
        ("wrapping around", u64::MAX - 7),
        ("at the last byte", u64::MAX),
    ];
    for (slot, name) in [(1usize, "input"), (2, "output")] {
        for (what, at) in spots {
            rig.chain_case(&format!("{name} {what}"), addr_bad(std_used), |p, tag| {
                let s = std_chain(p, &std_req(tag), tag);
                let mut d = s.descs.clone();
                // A guarded copy in place where that is guest memory.
                let init = if d[slot].write {
                    vec![FILL; 4 * COUNT]
                } else {
                    f32_bytes(&std_input(p.rank, tag))
                };
                if at < MEM_END {
                    p.place(at, &init, !d[slot].write);
                }
                d[slot].addr = at;
                let mut sent = send(p, &d);
                sent.writable.retain(|&w| w < MEM_END);
                sent
            });
        }
    }
    // The header outside memory or across the hole.
    for at in [HOLE - 16, 1 << 40, u64::MAX - 15] {
        rig.chain_case(
            &format!("header at {at:#x}"),
            addr_bad(std_used),
            |p, tag| {
                let mut s = std_chain(p, &std_req(tag), tag);
                if at < MEM_END {
                    p.place(at, std_req(tag).as_bytes(), true);
                }
                s.descs[0].addr = at;
                send(p, &s.descs)
            },
        );
    }
    // The response outside memory, or across its end or the hole: no status.
    for at in [MEM_END - 8, HOLE - 8, HOLE, u64::MAX - 7] {
        rig.chain_case(&format!("response at {at:#x}"), Want::NoStatus, |p, tag| {
            let mut s = std_chain(p, &std_req(tag), tag);
            if at < MEM_END {
                p.place(at, &[FILL; RESP_SIZE], false);
            }
            s.descs[3].addr = at;
            let mut sent = send(p, &s.descs);
            sent.writable.retain(|&w| w < MEM_END);
            sent
        });
    }
    // Lengths near 4 GiB: the chain is longer than virtio allows, its end
    // cannot be found, and nothing is answered.
    for slot in [1usize, 2] {
        rig.chain_case(
            &format!("descriptor {slot} of 0xffffffff bytes"),
            Want::NoStatus,
            |p, tag| {
                let mut s = std_chain(p, &std_req(tag), tag);
                s.descs[slot].len = u32::MAX;
                send(p, &s.descs)
            },
        );
    }
    // A zero-length data descriptor anywhere is ignored, even outside memory.
    rig.chain_case("empty descriptors outside memory", Want::Ok, |p, tag| {
        let s = std_chain(p, &std_req(tag), tag);
        let mut d = s.descs.clone();
        d.insert(2, Desc::w(u64::MAX, 0));
        d.insert(1, Desc::r(1 << 40, 0));
        let mut sent = send(p, &d);
        sent.out = vec![(s.out, 4 * COUNT)];
        sent
    });
    // One buffer at a time crosses between two adjacent regions (two
    // mappings in the daemon), some cutting an element in two: valid, and
    // the result lands right.
    let edge = 4 * MIB;
    for (slot, at) in [
        (0usize, edge - 12),
        (1, edge - 6),
        (2, edge - 2),
        (2, edge - 8),
        (3, edge - 4),
    ] {
        rig.chain_case(
            &format!("descriptor {slot} across two regions at {at:#x}"),
            Want::Ok,
            |p, tag| {
                let s = std_chain(p, &std_req(tag), tag);
                let mut d = s.descs.clone();
                let init = if d[slot].write {
                    vec![FILL; d[slot].len as usize]
                } else {
                    p.m.read_bytes(d[slot].addr, d[slot].len as usize)
                };
                d[slot].addr = p.place(at, &init, !d[slot].write);
                let mut sent = send(p, &d);
                sent.resp = Some(d[3].addr);
                sent.out = vec![(d[2].addr, 4 * COUNT)];
                sent
            },
        );
    }
    let cases = rig.cases;
    rig.allreduce_all("after the address cases");
    println!("hostile: {cases} address cases, daemon alive, canaries intact");
}

#[test]
fn header_and_response_descriptors() {
    let mut rig = rig(3, 2);
    let std_used = (4 * COUNT + RESP_SIZE) as u32;
    let bad = |d: u32, used: u32| Want::Status(Status::BadRequest, d, used);

    rig.chain_case(
        "writable header",
        bad(bad::HEADER, std_used + 32),
        |p, tag| send_edited(p, &std_req(tag), tag, |d| d[0].write = true),
    );
    for len in [0u32, 16, 31, 33, 4096] {
        rig.chain_case(
            &format!("header of {len} bytes"),
            bad(bad::HEADER, std_used),
            |p, tag| send_edited(p, &std_req(tag), tag, |d| d[0].len = len),
        );
    }
    rig.chain_case(
        "header split in two",
        bad(bad::HEADER, std_used),
        |p, tag| {
            send_edited(p, &std_req(tag), tag, |d| {
                let h = d[0];
                d[0].len = 16;
                d.insert(1, Desc::r(h.addr + 16, 16));
            })
        },
    );
    rig.chain_case(
        "a response alone",
        bad(bad::HEADER, RESP_SIZE as u32),
        |p, tag| {
            let s = std_chain(p, &std_req(tag), tag);
            send(p, &s.descs[3..])
        },
    );
    for len in [0u32, 8, 15, 17, 32] {
        rig.chain_case(
            &format!("response of {len} bytes"),
            Want::NoStatus,
            |p, tag| send_edited(p, &std_req(tag), tag, |d| d[3].len = len),
        );
    }
    rig.chain_case("readable response", Want::NoStatus, |p, tag| {
        send_edited(p, &std_req(tag), tag, |d| d[3].write = false)
    });
    rig.chain_case("response split in two", Want::NoStatus, |p, tag| {
        send_edited(p, &std_req(tag), tag, |d| {
            let r = d[3];
            d[3].len = 8;
            d.push(Desc::w(r.addr + 8, 8));
        })
    });
    // Without the response, the 16-byte output ends the chain and is
    // taken for the response: the output is then missing.
    rig.chain_case(
        "no response descriptor",
        bad(bad::OUTPUT_LENGTH, 16),
        |p, tag| {
            send_edited(p, &std_req(tag), tag, |d| {
                d.pop();
            })
        },
    );
    rig.chain_case("no response and no output", Want::NoStatus, |p, tag| {
        send_edited(p, &std_req(tag), tag, |d| d.truncate(2))
    });
    rig.chain_case(
        "readable after writable",
        bad(bad::ORDER, std_used),
        |p, tag| send_edited(p, &std_req(tag), tag, |d| d.swap(1, 2)),
    );
    rig.chain_case(
        "readable between output and response",
        bad(bad::ORDER, std_used),
        |p, tag| {
            send_edited(p, &std_req(tag), tag, |d| {
                let input = d[1];
                d.insert(3, input);
            })
        },
    );
    rig.chain_case(
        "empty readable after the output",
        bad(bad::ORDER, std_used),
        |p, tag| send_edited(p, &std_req(tag), tag, |d| d.insert(3, Desc::r(0, 0))),
    );
    let cases = rig.cases;
    rig.allreduce_all("after the header cases");
    println!("hostile: {cases} header/response cases, daemon alive, canaries intact");
}

#[test]
fn sizes_counts_and_segments() {
    let mut rig = rig(3, 1);
    let std_used = (4 * COUNT + RESP_SIZE) as u32;
    let bad = |d: u32| Want::Status(Status::BadRequest, d, std_used);
    let big = |d: u32| Want::Status(Status::TooBig, d, std_used);
    let f64_ = Dtype::F64.raw();
    let allgather = Opcode::Allgather.raw();

    let headers: [(&str, VirtioDmlcReq, Want); 8] = [
        (
            "f64 count 2^61 overflows u64",
            req(ALLREDUCE, f64_, SUM, 0, 1 << 61, 0),
            bad(bad::OVERFLOW),
        ),
        (
            "count u64::MAX",
            req(ALLREDUCE, F32, SUM, 0, u64::MAX, 0),
            bad(bad::OVERFLOW),
        ),
        (
            "allgather count * world overflows",
            req(allgather, Dtype::U8.raw(), 0, 0, u64::MAX / 2, 0),
            bad(bad::OVERFLOW),
        ),
        (
            "count just over max_bytes",
            req(ALLREDUCE, F32, SUM, 0, MAX_BYTES / 4 + 1, 0),
            big(too_big::BYTES),
        ),
        (
            "count 2^61 - 1 f32 (fits u64, not the limit)",
            req(ALLREDUCE, F32, SUM, 0, (1 << 61) - 1, 0),
            big(too_big::BYTES),
        ),
        (
            "allgather output over max_bytes",
            req(allgather, F32, 0, 0, MAX_BYTES / 8, 0),
            big(too_big::BYTES),
        ),
        (
            "count too small for the buffers",
            req(ALLREDUCE, F32, SUM, 0, 3, 0),
            bad(bad::INPUT_LENGTH),
        ),
        (
            "count too large for the buffers",
            req(ALLREDUCE, F32, SUM, 0, 5, 0),
            bad(bad::INPUT_LENGTH),
        ),
    ];
    for (what, h, want) in headers {
        rig.chain_case(what, want, |p, tag| send_edited(p, &h, tag, |_| {}));
    }
    // Nine data segments of one element each; eight allowed.
    rig.chain_case(
        "too many segments",
        Want::Status(Status::TooBig, too_big::SEGMENTS, 4 * 4 + 16),
        |p, _| {
            let h = req(ALLREDUCE, F32, SUM, 0, 5, 0);
            let mut d = vec![Desc::r(p.hdr(&h), 32)];
            for _ in 0..5 {
                d.push(Desc::r(p.r(&[1, 2, 3, 4]), 4));
            }
            for _ in 0..4 {
                d.push(Desc::w(p.w(4), 4));
            }
            d.push(Desc::w(p.w(RESP_SIZE), RESP_SIZE));
            send(p, &d)
        },
    );
    // Hundreds of empty descriptors through an indirect table are not
    // segments: the request is valid.
    rig.chain_case("1000 empty descriptors", Want::Ok, |p, tag| {
        let s = std_chain(p, &std_req(tag), tag);
        let mut d = s.descs.clone();
        for _ in 0..1000 {
            d.insert(2, Desc::w(0, 0));
        }
        let t = table(p, &entries(&d), None);
        let head = send_indirect(p, t, 16 * d.len() as u32, 0, 0);
        Sent {
            head,
            resp: Some(s.resp),
            writable: vec![],
            out: vec![(s.out, 4 * COUNT)],
        }
    });
    rig.chain_case(
        "segments that cut elements",
        bad(bad::SEGMENT_ALIGN),
        |p, tag| {
            send_edited(p, &std_req(tag), tag, |d| {
                let i = d[1];
                d[1].len = 6;
                d.insert(2, Desc::r(i.addr + 6, 10));
            })
        },
    );
    rig.chain_case(
        "output too long",
        Want::Status(Status::BadRequest, bad::OUTPUT_LENGTH, std_used + 4),
        |p, tag| {
            send_edited(p, &std_req(tag), tag, |d| {
                let o = d[2];
                d.insert(3, Desc::w(o.addr, 4));
            })
        },
    );
    rig.chain_case(
        "in place with an input",
        bad(bad::IN_PLACE_INPUT),
        |p, tag| {
            let mut h = std_req(tag);
            h.flags = FLAG_IN_PLACE.into();
            send_edited(p, &h, tag, |_| {})
        },
    );
    rig.chain_case("barrier with data", bad(bad::BARRIER_DATA), |p, tag| {
        send_edited(p, &req(Opcode::Barrier.raw(), 0, 0, 0, 0, 0), tag, |_| {})
    });
    let cases = rig.cases;
    rig.allreduce_all("after the size cases");
    println!("hostile: {cases} size cases, daemon alive, canaries intact");
}

#[test]
fn unknown_and_invalid_header_fields() {
    let mut rig = rig(3, 0);
    let std_used = (4 * COUNT + RESP_SIZE) as u32;
    let uns = |d: u32| Want::Status(Status::Unsupported, d, std_used);
    let bad = |d: u32| Want::Status(Status::BadRequest, d, std_used);
    let bcast = Opcode::Broadcast.raw();
    let reduce = Opcode::Reduce.raw();

    let cases: Vec<(&str, VirtioDmlcReq, Want)> = vec![
        (
            "opcode 7",
            req(7, F32, SUM, 0, 4, 0),
            uns(unsupported::OPCODE),
        ),
        (
            "a nop with a count and data",
            req(Opcode::Nop.raw(), F32, SUM, 0, 4, 0),
            bad(bad::BARRIER_DATA),
        ),
        (
            "opcode 0xffff",
            req(0xffff, F32, SUM, 0, 4, 0),
            uns(unsupported::OPCODE),
        ),
        (
            "dtype 10",
            req(ALLREDUCE, 10, SUM, 0, 4, 0),
            uns(unsupported::DTYPE),
        ),
        (
            "dtype 255",
            req(ALLREDUCE, 255, SUM, 0, 4, 0),
            uns(unsupported::DTYPE),
        ),
        (
            "op 8",
            req(ALLREDUCE, F32, 8, 0, 4, 0),
            uns(unsupported::OP),
        ),
        (
            "op 255",
            req(ALLREDUCE, F32, 255, 0, 4, 0),
            uns(unsupported::OP),
        ),
        (
            "bxor on f32",
            req(ALLREDUCE, F32, ReduceOp::Bxor.raw(), 0, 4, 0),
            uns(unsupported::OP_FOR_DTYPE),
        ),
        (
            "band on bf16",
            req(ALLREDUCE, Dtype::Bf16.raw(), ReduceOp::Band.raw(), 0, 8, 0),
            uns(unsupported::OP_FOR_DTYPE),
        ),
        (
            "flag bit 1",
            req(ALLREDUCE, F32, SUM, 0, 4, 1 << 1),
            bad(bad::FLAGS),
        ),
        (
            "flag bit 31",
            req(ALLREDUCE, F32, SUM, 0, 4, 1 << 31),
            bad(bad::FLAGS),
        ),
        (
            "every flag",
            req(ALLREDUCE, F32, SUM, 0, 4, u32::MAX),
            bad(bad::FLAGS),
        ),
        (
            "broadcast root = world size",
            req(bcast, F32, 0, 3, 4, 0),
            bad(bad::ROOT),
        ),
        (
            "reduce root u32::MAX",
            req(reduce, F32, SUM, u32::MAX, 4, 0),
            bad(bad::ROOT),
        ),
        (
            "allreduce root 1",
            req(ALLREDUCE, F32, SUM, 1, 4, 0),
            bad(bad::ROOT),
        ),
        (
            "unknown opcode before bad flags",
            req(9, 99, 99, 7, u64::MAX, u32::MAX),
            uns(unsupported::OPCODE),
        ),
    ];
    for (what, h, want) in cases {
        rig.chain_case(what, want, |p, tag| send_edited(p, &h, tag, |_| {}));
    }
    let cases = rig.cases;
    rig.allreduce_all("after the field cases");
    println!("hostile: {cases} header-field cases, daemon alive, canaries intact");
}

#[test]
fn ring_indices_jumping() {
    let mut rig = Rig::with_metrics(3, 1, &["--timeout-ms", "1500"]);
    let h = rig.hostile;
    let mut cases = 0;

    // A head index at or beyond the queue size: the chain cannot be
    // returned (the used ring holds only valid heads), so the device drops
    // it; the queue keeps working.
    for head in [QUEUE_SIZE, u16::MAX] {
        let honest = rig.honest();
        let pending: Vec<Pending> = honest.iter().map(|&r| rig.submit_std(r)).collect();
        let p = rig.bad();
        let resp = p.w(RESP_SIZE);
        p.m.publish_head(0, head);
        p.m.kick(0);
        assert_eq!(p.m.wait_used_for(0, Duration::from_millis(200)), None);
        assert!(p.unchanged(resp));
        let mine = rig.submit_std(h);
        rig.finish_ok(h, &mine, "after a bad head");
        for (&r, p) in honest.iter().zip(&pending) {
            rig.finish_ok(r, p, "after a bad head");
        }
        rig.round += 1;
        rig.check("bad head");
        cases += 1;
    }

    // The avail index jumps by more than the queue size (forwards, or
    // backwards): the ring is broken and the device ignores it. The honest
    // members waiting on this member time out (peer = the hostile rank).
    for jump in [QUEUE_SIZE + 1, 1000, u16::MAX] {
        let honest = rig.honest();
        let started = Instant::now();
        let pending: Vec<Pending> = honest.iter().map(|&r| rig.submit_std(r)).collect();
        let p = rig.bad();
        let idx = p.m.avail_idx(0).wrapping_add(jump);
        p.m.set_avail_idx(0, idx);
        p.m.kick(0);
        for (&r, pend) in honest.iter().zip(&pending) {
            rig.finish_failed(r, pend, Status::Timeout, h, "broken avail index");
        }
        assert!(started.elapsed() >= Duration::from_millis(1500));
        assert_eq!(
            rig.bad().m.wait_used_for(0, Duration::from_millis(50)),
            None
        );
        // The member resets its device and comes back: a new generation.
        rig.reconnect_hostile();
        rig.generation += 1;
        rig.allreduce_all("after a broken avail index");
        cases += 1;
    }

    // A broken ring while a collective waits, then a reset of the device
    // (what the driver does to recover): the others fail at once with
    // PEER_LOST instead of waiting for the timeout.
    let honest = rig.honest();
    let pending = rig.submit_honest_taken();
    let broken_before = rig.daemon.log().matches("malformed virtqueue").count();
    let p = rig.bad();
    let idx = p.m.avail_idx(0).wrapping_add(3 * QUEUE_SIZE);
    p.m.set_avail_idx(0, idx);
    p.m.kick(0);
    let deadline = Instant::now() + PATIENCE;
    while rig.daemon.log().matches("malformed virtqueue").count() == broken_before {
        assert!(
            Instant::now() < deadline,
            "the daemon never saw the broken ring"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let started = Instant::now();
    rig.bad().m.fe.reset_device().expect("RESET_DEVICE");
    rig.generation += 1;
    for (&r, pend) in honest.iter().zip(&pending) {
        rig.finish_failed(r, pend, Status::PeerLost, h, "reset after a broken ring");
    }
    // PEER_LOST (not TIMEOUT, checked above) is what shows that the others
    // did not wait for the 1.5 s timeout; the time only has to be sane.
    assert!(started.elapsed() < PATIENCE);
    rig.reconnect_hostile();
    rig.allreduce_all("after the reset");
    cases += 1;

    // The same head made available twice while in flight: two requests
    // (the ring does not forbid it to the device, as long as no more
    // chains are in flight than the queue size); both are served.
    let honest = rig.honest();
    let first: Vec<Pending> = honest.iter().map(|&r| rig.submit_std(r)).collect();
    let mine = rig.submit_std(h);
    let p = rig.bad();
    p.m.publish_head(0, mine.head);
    p.m.kick(0);
    for (&r, pend) in honest.iter().zip(&first) {
        rig.finish_ok(r, pend, "first of a doubled head");
    }
    rig.finish_ok(h, &mine, "first of a doubled head");
    rig.round += 1;
    let second: Vec<Pending> = honest.iter().map(|&r| rig.submit_std(r)).collect();
    // The doubled request carries the previous round's tag: a mismatch.
    rig.finish_tag_mismatch(&honest, &second, "doubled head");
    let p = rig.bad();
    let (head, _) = p.m.wait_used(0);
    assert_eq!(head, mine.head);
    assert_eq!(
        status_of(&p.resp(mine.resp)),
        (Some(Status::Mismatch), virtio_dmlc::mismatch::TAG)
    );
    rig.round += 1;
    rig.check("doubled head");
    rig.allreduce_all("after a doubled head");
    cases += 1;

    println!("hostile: {cases} ring-index cases, daemon alive, canaries intact");
}

/// A driver that makes one chain available again and again while it is in
/// flight (10 times the queue size) gets no more than the queue size of
/// requests into the daemon's engine: past that the queue is stopped until
/// the device is reset (warned once, counted in
/// `dmlc_queue_overruns_total`). The requests taken before take part in
/// their collectives as usual, the honest members keep being served, and
/// every canary holds.
#[test]
fn one_chain_made_available_again_and_again() {
    let mut rig = Rig::with_metrics(3, 1, &["--timeout-ms", "30000"]);
    let h = rig.hostile;
    let size = u64::from(QUEUE_SIZE);
    let taken_before = rig.taken();
    let overruns = "dmlc_queue_overruns_total";
    let pending = "dmlc_requests_pending";
    assert_eq!(rig.metric(pending), 0);

    // The hostile member's valid request for this round, then copies of
    // its head in batches no bigger than the ring has room for.
    let mine = rig.submit_std(h);
    let started = Instant::now();
    let (flood, batch) = (10 * QUEUE_SIZE, QUEUE_SIZE / 4);
    let mut offered = 1u64;
    let mut peak = 0;
    let mut stopped = false;
    for _ in 0..flood / batch {
        let p = rig.bad();
        for _ in 0..batch {
            p.m.publish_head(0, mine.head);
        }
        p.m.kick(0);
        offered += u64::from(batch);
        // Until the daemon took the batch, or stopped the queue.
        let deadline = Instant::now() + PATIENCE;
        while !stopped {
            stopped = rig.metric(overruns) > 0;
            if rig.taken() - taken_before == offered {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the daemon neither took nor refused the chains"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        peak = peak.max(rig.metric(pending));
    }
    let flooded = started.elapsed();
    let taken = rig.taken() - taken_before;
    println!(
        "hostile: {} copies of a request offered in {:.0} ms on a queue of {size}: \
         {taken} taken, at most {peak} requests pending",
        offered - 1,
        flooded.as_secs_f64() * 1e3
    );
    assert!(stopped, "the queue was never stopped");
    assert_eq!(taken, size, "requests taken from the flooded queue");
    assert!(peak <= size, "{peak} requests pending");
    assert_eq!(rig.metric(pending), size);
    assert_eq!(rig.metric(overruns), 1);
    assert_eq!(
        rig.daemon.log().matches("requests in flight").count(),
        1,
        "one warning"
    );
    rig.check("flooded queue");

    // The honest members' collective with the hostile member's first
    // request completes as usual, on every member.
    let honest = rig.honest();
    let first: Vec<Pending> = honest.iter().map(|&r| rig.submit_std(r)).collect();
    for (&r, pend) in honest.iter().zip(&first) {
        rig.finish_ok(r, pend, "beside a flooded queue");
    }
    rig.finish_ok(h, &mine, "first of a flooded chain");
    rig.round += 1;
    // Their next one meets a copy (the previous round's tag): MISMATCH at
    // once, not a hang.
    let second: Vec<Pending> = honest.iter().map(|&r| rig.submit_std(r)).collect();
    rig.finish_tag_mismatch(&honest, &second, "after a flood");
    let (head, _) = rig.bad().m.wait_used(0);
    assert_eq!(head, mine.head);
    rig.round += 1;
    // The stopped queue takes nothing new, even with room in the engine.
    let fresh = rig.submit_std(h);
    assert_eq!(
        rig.bad().m.wait_used_for(0, Duration::from_millis(200)),
        None
    );
    assert!(rig.bad().unchanged(fresh.resp));
    assert_eq!(rig.metric(pending), size - 2);
    rig.check("stopped queue");

    // A reset (here: a reconnect) drops the copies and serves the queue again.
    rig.reconnect_hostile();
    rig.generation += 1;
    let deadline = Instant::now() + PATIENCE;
    while rig.metric(pending) != 0 {
        assert!(
            Instant::now() < deadline,
            "copies still pending after the reset"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    rig.allreduce_all("after a flooded queue");
    assert_eq!(rig.metric(overruns), 1);
    println!("hostile: flooded queue bounded, daemon alive, canaries intact");
}

// ---- vhost-user messages ------------------------------------------------

const GET_FEATURES: u32 = 1;
const SET_FEATURES: u32 = 2;
const SET_OWNER: u32 = 3;
const SET_MEM_TABLE: u32 = 5;
const SET_VRING_NUM: u32 = 8;
const SET_VRING_ADDR: u32 = 9;
const SET_VRING_BASE: u32 = 10;
const GET_VRING_BASE: u32 = 11;
const SET_VRING_KICK: u32 = 12;
const SET_VRING_CALL: u32 = 13;
const GET_CONFIG: u32 = 24;
const VERSION: u32 = 1;
const REPLY: u32 = 4;

/// One raw vhost-user message.
fn msg(code: u32, flags: u32, size: u32, payload: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(12 + payload.len());
    m.extend(code.to_le_bytes());
    m.extend(flags.to_le_bytes());
    m.extend(size.to_le_bytes());
    m.extend(payload);
    m
}

/// A well-framed message with `payload`.
fn framed(code: u32, payload: &[u8]) -> Vec<u8> {
    msg(code, VERSION, payload.len() as u32, payload)
}

fn vring_state(index: u32, num: u32) -> Vec<u8> {
    [index.to_le_bytes(), num.to_le_bytes()].concat()
}

fn vring_addr(index: u32, desc: u64, used: u64, avail: u64) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend(index.to_le_bytes());
    p.extend(0u32.to_le_bytes());
    for a in [desc, used, avail, 0] {
        p.extend(a.to_le_bytes());
    }
    p
}

/// A SET_MEM_TABLE payload: (guest address, size, user address, offset).
fn mem_table(regions: &[(u64, u64, u64, u64)]) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend((regions.len() as u32).to_le_bytes());
    p.extend(0u32.to_le_bytes());
    for &(gpa, size, user, off) in regions {
        for v in [gpa, size, user, off] {
            p.extend(v.to_le_bytes());
        }
    }
    p
}

/// Sends `bytes` with `fds` attached (SCM_RIGHTS).
fn send_fds(s: &UnixStream, bytes: &[u8], fds: &[RawFd]) {
    let fd_bytes = std::mem::size_of_val(fds);
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes as u32) } as usize;
    let mut control = vec![0u8; space];
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: msghdr is a plain C struct; all zeroes is a valid empty one.
    let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
    mh.msg_iov = &mut iov;
    mh.msg_iovlen = 1;
    if !fds.is_empty() {
        mh.msg_control = control.as_mut_ptr().cast();
        mh.msg_controllen = space;
        // SAFETY: msg_control points to `space` bytes, enough for one
        // header and the descriptors (CMSG_SPACE above); the header and
        // data pointers come from the CMSG macros over that buffer.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&mh);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(fd_bytes as u32) as usize;
            std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast(), fds.len());
        }
    }
    // SAFETY: mh describes valid buffers that outlive the call.
    let n = unsafe { libc::sendmsg(s.as_raw_fd(), &mh, libc::MSG_NOSIGNAL) };
    assert_eq!(
        n,
        bytes.len() as isize,
        "sendmsg: {}",
        std::io::Error::last_os_error()
    );
}

/// Writes `bytes`, tolerating a daemon that already closed the socket.
fn send_raw(s: &mut UnixStream, bytes: &[u8]) {
    let _ = s.write_all(bytes);
}

/// Whether the daemon closes the connection within `PATIENCE` (any
/// replies before that are read and dropped).
fn closed_by_daemon(s: &mut UnixStream) -> bool {
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut buf = [0u8; 512];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => return false,
            Err(_) => return true,
        }
    }
}

/// Whether the connection still answers GET_FEATURES with the device's
/// features.
fn still_answers(s: &mut UnixStream) -> bool {
    if s.write_all(&framed(GET_FEATURES, &[])).is_err() {
        return false;
    }
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut reply = [0u8; 20];
    if s.read_exact(&mut reply).is_err() {
        return false;
    }
    let word = |i: usize| u32::from_le_bytes(reply[i..i + 4].try_into().unwrap());
    word(0) == GET_FEATURES && word(4) == VERSION | REPLY && word(8) == 8
}

/// What a raw message case expects of the connection.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Conn {
    /// The daemon closes it.
    Closed,
    /// The daemon ignores the message and keeps answering.
    Answers,
}

/// A raw connection on the hostile member's socket, with the usual
/// opening (SET_OWNER) if `owner`.
fn raw_connect(rig: &mut Rig, owner: bool) -> UnixStream {
    // The member's own connection goes first; the daemon accepts the next
    // one once it has cleaned up the old.
    let h = rig.hostile as usize;
    if let Some(p) = rig.peers[h].take() {
        p.check_canaries("before a raw connection");
        drop(p);
        rig.generation += 1;
    }
    let mut s = UnixStream::connect(rig.daemon.socket(rig.hostile)).expect("connect");
    if owner {
        send_raw(&mut s, &framed(SET_OWNER, &[]));
    }
    s
}

/// After a raw case: the daemon alive, the hostile rank served again.
fn raw_case_done(rig: &mut Rig, what: &str, s: UnixStream) {
    drop(s);
    rig.daemon.assert_running();
    rig.reconnect_hostile();
    rig.allreduce_all(what);
    rig.cases += 1;
}

#[test]
fn vhost_user_messages_out_of_order_or_malformed() {
    let mut rig = Rig::new(2, 1, &["--queue-size", "256"]);
    let memfd = memfd(1 << 20);
    let efd = EventFd::new(EFD_NONBLOCK).unwrap();

    // Framed messages on a fresh connection, with what the daemon must do.
    let cases: Vec<(&str, Vec<u8>, Conn)> = vec![
        (
            "SET_VRING_ADDR before SET_MEM_TABLE",
            framed(SET_VRING_ADDR, &vring_addr(0, 0x1000, 0x3000, 0x2000)),
            Conn::Closed,
        ),
        (
            "SET_VRING_NUM of vring 99",
            framed(SET_VRING_NUM, &vring_state(99, 64)),
            Conn::Closed,
        ),
        (
            "SET_VRING_NUM 0",
            framed(SET_VRING_NUM, &vring_state(0, 0)),
            Conn::Closed,
        ),
        (
            "SET_VRING_NUM over the maximum",
            framed(SET_VRING_NUM, &vring_state(0, 512)),
            Conn::Closed,
        ),
        (
            "SET_VRING_NUM 100, not a power of two",
            framed(SET_VRING_NUM, &vring_state(0, 100)),
            Conn::Answers,
        ),
        (
            "SET_VRING_ADDR of vring 7",
            framed(SET_VRING_ADDR, &vring_addr(7, 0, 0, 0)),
            Conn::Closed,
        ),
        (
            "SET_VRING_BASE of vring u32::MAX",
            framed(SET_VRING_BASE, &vring_state(u32::MAX, 0)),
            Conn::Closed,
        ),
        (
            "GET_VRING_BASE of vring 1",
            framed(GET_VRING_BASE, &vring_state(1, 0)),
            Conn::Closed,
        ),
        (
            "SET_VRING_CALL of vring 200, no fd",
            framed(SET_VRING_CALL, &(200u64 | 1 << 8).to_le_bytes()),
            Conn::Closed,
        ),
        (
            "SET_FEATURES with unknown bits",
            framed(SET_FEATURES, &(1u64 << 50).to_le_bytes()),
            Conn::Closed,
        ),
        (
            "SET_MEM_TABLE with 0 regions",
            framed(SET_MEM_TABLE, &mem_table(&[])),
            Conn::Closed,
        ),
        (
            "SET_MEM_TABLE without the fd",
            framed(SET_MEM_TABLE, &mem_table(&[(0, 1 << 20, 0x7000_0000, 0)])),
            Conn::Closed,
        ),
        (
            "SET_MEM_TABLE with 33 regions",
            framed(SET_MEM_TABLE, &mem_table(&[(0, 4096, 0, 0); 33])),
            Conn::Closed,
        ),
        (
            "payload shorter than its type",
            framed(SET_VRING_NUM, &[1, 2, 3]),
            Conn::Closed,
        ),
        (
            "payload longer than its type",
            framed(SET_VRING_NUM, &[0; 16]),
            Conn::Closed,
        ),
        ("unknown request code", framed(0x7777, &[]), Conn::Closed),
        ("request code 0", framed(0, &[]), Conn::Closed),
        (
            "size field over the maximum",
            msg(SET_OWNER, VERSION, 0x1001, &[]),
            Conn::Closed,
        ),
        (
            "size field u32::MAX",
            msg(SET_VRING_NUM, VERSION, u32::MAX, &[0; 8]),
            Conn::Closed,
        ),
        ("version 2", msg(SET_OWNER, 2, 0, &[]), Conn::Closed),
        (
            "reply flag on a request",
            msg(SET_OWNER, VERSION | REPLY, 0, &[]),
            Conn::Closed,
        ),
        (
            "reserved flag bits",
            msg(SET_OWNER, VERSION | 1 << 20, 0, &[]),
            Conn::Closed,
        ),
        (
            "GET_CONFIG of 4096 bytes",
            framed(GET_CONFIG, &[[0u8; 12].as_slice(), &[0u8; 4084]].concat()),
            Conn::Closed,
        ),
        (
            "garbage",
            (0..64u8).map(|i| i.wrapping_mul(37) ^ 0xc3).collect(),
            Conn::Closed,
        ),
    ];
    for (what, bytes, want) in cases {
        let mut s = raw_connect(&mut rig, true);
        send_raw(&mut s, &bytes);
        let got = if closed_by_daemon_quickly(&mut s) {
            Conn::Closed
        } else if still_answers(&mut s) {
            Conn::Answers
        } else {
            Conn::Closed
        };
        assert_eq!(got, want, "{what}");
        raw_case_done(&mut rig, what, s);
    }

    // Messages that carry descriptors.
    let fd_cases: Vec<(&str, Vec<u8>, Vec<RawFd>)> = vec![
        (
            "SET_VRING_KICK before SET_MEM_TABLE, then a kick",
            framed(SET_VRING_KICK, &0u64.to_le_bytes()),
            vec![efd.as_raw_fd()],
        ),
        (
            "SET_MEM_TABLE with overlapping regions",
            framed(
                SET_MEM_TABLE,
                &mem_table(&[
                    (0, 1 << 20, 0x7000_0000, 0),
                    (4096, 1 << 20, 0x7100_0000, 0),
                ]),
            ),
            vec![memfd.as_raw_fd(), memfd.as_raw_fd()],
        ),
        (
            "SET_MEM_TABLE with fewer fds than regions",
            framed(
                SET_MEM_TABLE,
                &mem_table(&[(0, 4096, 0x7000_0000, 0), (1 << 20, 4096, 0x7100_0000, 0)]),
            ),
            vec![memfd.as_raw_fd()],
        ),
        (
            "SET_MEM_TABLE region of size 0",
            framed(SET_MEM_TABLE, &mem_table(&[(0, 0, 0x7000_0000, 0)])),
            vec![memfd.as_raw_fd()],
        ),
        (
            "SET_MEM_TABLE region wrapping around",
            framed(
                SET_MEM_TABLE,
                &mem_table(&[(u64::MAX - 4095, 1 << 20, 0x7000_0000, 0)]),
            ),
            vec![memfd.as_raw_fd()],
        ),
        (
            "SET_MEM_TABLE region past the end of its file",
            framed(SET_MEM_TABLE, &mem_table(&[(0, 4 << 20, 0x7000_0000, 0)])),
            vec![memfd.as_raw_fd()],
        ),
        (
            "SET_MEM_TABLE offset past the end of its file",
            framed(
                SET_MEM_TABLE,
                &mem_table(&[(0, 1 << 20, 0x7000_0000, 1 << 20)]),
            ),
            vec![memfd.as_raw_fd()],
        ),
        (
            "SET_VRING_NUM with an fd attached",
            framed(SET_VRING_NUM, &vring_state(0, 64)),
            vec![efd.as_raw_fd()],
        ),
    ];
    for (i, (what, bytes, fds)) in fd_cases.into_iter().enumerate() {
        let mut s = raw_connect(&mut rig, true);
        send_fds(&s, &bytes, &fds);
        if i == 0 {
            // The kick wakes a worker that has no memory to read from.
            efd.write(1).unwrap();
            std::thread::sleep(Duration::from_millis(50));
            assert!(still_answers(&mut s), "{what}: connection closed");
        } else {
            assert!(closed_by_daemon(&mut s), "{what}: connection kept");
        }
        raw_case_done(&mut rig, what, s);
    }

    // A size field larger than what follows: the daemon waits for the
    // rest; when the frontend gives up, the connection ends.
    for (what, bytes) in [
        (
            "size field larger than the payload",
            msg(SET_VRING_NUM, VERSION, 64, &[0; 8]),
        ),
        ("truncated header", framed(SET_OWNER, &[])[..6].to_vec()),
        (
            "truncated payload",
            framed(SET_VRING_NUM, &vring_state(0, 64))[..15].to_vec(),
        ),
    ] {
        let mut s = raw_connect(&mut rig, true);
        send_raw(&mut s, &bytes);
        rig.daemon.assert_running();
        s.shutdown(Shutdown::Write).unwrap();
        assert!(closed_by_daemon(&mut s), "{what}: connection kept");
        raw_case_done(&mut rig, what, s);
    }
    let cases = rig.cases;
    println!("hostile: {cases} vhost-user message cases, daemon alive, canaries intact");
}

/// Like [`closed_by_daemon`], but gives up after a short wait: used where
/// the daemon may instead ignore the message.
fn closed_by_daemon_quickly(s: &mut UnixStream) -> bool {
    s.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let mut buf = [0u8; 512];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return false
            }
            Err(_) => return true,
        }
    }
}

#[test]
fn vhost_user_attacks_on_an_active_member() {
    let mut rig = Rig::with_metrics(3, 2, &[]);
    let h = rig.hostile;
    let attacks: Vec<(&str, Vec<u8>)> = vec![
        ("garbage", vec![0xff; 40]),
        (
            "SET_VRING_NUM 0 while running",
            framed(SET_VRING_NUM, &vring_state(0, 0)),
        ),
        ("unknown request code", framed(0x4242, &[0; 8])),
        (
            "size field over the maximum",
            msg(SET_VRING_NUM, VERSION, 0x10_0000, &[]),
        ),
    ];
    for (what, bytes) in attacks {
        // The honest members wait for the hostile one; it breaks its
        // connection instead of submitting.
        let honest = rig.honest();
        let pending = rig.submit_honest_taken();
        assert_eq!(rig.peer(0).m.try_used(0), None);
        let started = Instant::now();
        let mut s = rig.bad().m.raw_stream();
        send_raw(&mut s, &bytes);
        assert!(closed_by_daemon(&mut s), "{what}: connection kept");
        rig.generation += 1;
        for (&r, p) in honest.iter().zip(&pending) {
            rig.finish_failed(r, p, Status::PeerLost, h, what);
        }
        assert!(started.elapsed() < PATIENCE);
        // Config space shows the new generation once every request the
        // change failed is completed: just after the last one, possibly.
        let deadline = Instant::now() + PATIENCE;
        while rig.peer(0).m.config().generation.get() != rig.generation {
            assert!(Instant::now() < deadline, "{what}: generation not shown");
            std::thread::sleep(Duration::from_millis(1));
        }
        rig.round += 1;
        drop(s);
        rig.reconnect_hostile();
        rig.allreduce_all(what);
        rig.cases += 1;
    }

    // A memory table whose region is bigger than the file behind it: the
    // daemon must refuse it (touching such a mapping past the end of the
    // file kills the process with SIGBUS).
    let honest = rig.honest();
    let pending = rig.submit_honest_taken();
    let p = rig.bad();
    let mut lying = p.m.mem_table();
    // The last region, so that it overlaps no other.
    lying.last_mut().unwrap().memory_size *= 2;
    if p.m.fe.set_mem_table(&lying).is_ok() {
        // Show what it costs: a header past the end of the file.
        let resp = p.w(RESP_SIZE);
        p.m.submit(0, &[Desc::r(11 * MIB, 32), Desc::w(resp, RESP_SIZE)]);
        std::thread::sleep(Duration::from_millis(300));
        rig.daemon.assert_running();
        panic!("a memory table larger than its file was accepted");
    }
    rig.generation += 1;
    for (&r, p) in honest.iter().zip(&pending) {
        rig.finish_failed(
            r,
            p,
            Status::PeerLost,
            h,
            "memory table past the end of its file",
        );
    }
    rig.round += 1;
    rig.reconnect_hostile();
    rig.allreduce_all("after a lying memory table");
    rig.cases += 1;

    let cases = rig.cases;
    println!(
        "hostile: {cases} vhost-user attacks on an active member, daemon alive, canaries intact"
    );
}

#[test]
fn queue_size_not_a_power_of_two() {
    // Split rings are a power of two in size (virtio 2.7); a device that
    // used another size than the driver's would read and write the rings
    // at the wrong places. The daemon must leave such a ring alone.
    let mut rig = Rig::new(2, 1, &["--timeout-ms", "1000"]);
    let h = rig.hostile;
    let mut cases = 0;
    for size in [48u16, 100, 24] {
        let old = rig.peers[h as usize].take().expect("hostile member");
        drop(old);
        rig.generation += 1;
        let mut m = Member::connect_regions(&rig.daemon.socket(h), &REGIONS);
        m.start(features(), 1, size);
        let mut p = Peer {
            m,
            rank: h,
            bufs: Vec::new(),
        };
        // Guard everything after the used ring up to the next queue.
        let (_, used_end, area_end) = p.m.queue_area(0);
        p.place(
            used_end + GUARD as u64,
            &vec![CANARY; (area_end - used_end) as usize - 2 * GUARD],
            true,
        );
        rig.peers[h as usize] = Some(p);
        let honest = rig.honest();
        let pending: Vec<Pending> = honest.iter().map(|&r| rig.submit_std(r)).collect();
        let mine = rig.submit_std(h);
        for (&r, pend) in honest.iter().zip(&pending) {
            rig.finish_failed(r, pend, Status::Timeout, h, "queue size not a power of two");
        }
        assert_eq!(
            rig.bad().m.wait_used_for(0, Duration::from_millis(50)),
            None
        );
        assert!(rig.bad().unchanged(mine.resp));
        rig.round += 1;
        rig.check("queue size not a power of two");
        rig.reconnect_hostile();
        rig.generation += 1;
        rig.allreduce_all("after a queue size not a power of two");
        cases += 1;
    }
    println!("hostile: {cases} queue-size cases, daemon alive, canaries intact");
}
