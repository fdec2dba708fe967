//! Collectives over TCP: the network path the device is compared with.
//!
//! **Connections.** A full mesh: every rank listens on the port of its own
//! address in the peer list, connects to every lower rank and accepts every
//! higher rank (accepting runs on a helper thread while connecting, so a
//! late rank only delays the ranks that need it). Connection attempts are
//! retried until the connect timeout (default 60 s: VMs boot at different
//! times); then the error names the missing rank and its address. Each
//! connection starts with a hello (magic, version, rank, world size) in both
//! directions, so a wrong peer list or a stray process fails at once.
//! Sockets use `TCP_NODELAY`.
//!
//! **Framing.** Every message is a 32-byte header (magic, sequence number,
//! opcode, dtype, op, phase, root, count, payload length) and the payload.
//! The receiver knows what it expects and checks every field, so members
//! that call different collectives fail with a mismatch naming the field
//! and the rank, like the device's `STATUS_MISMATCH`. A peer that closes
//! its connection fails the collective with [`TcpError::PeerClosed`] naming
//! it (a rank whose collective failed closes its connections too, so a
//! slower rank may name that one instead); a peer silent for longer than
//! the I/O timeout (default 120 s) with [`TcpError::Timeout`]: a VM that
//! is killed closes nothing, its peers see silence. After any failure the communicator refuses
//! further collectives ([`TcpError::Broken`]): the streams are out of step.
//!
//! **Algorithms** (N members, S bytes; suited to small groups, N <= 8):
//!
//! - allreduce, N = 2 or S <= 64 KiB: *direct exchange*: every rank sends
//!   its whole buffer to every other rank and folds all N contributions in
//!   rank order itself (one round trip).
//! - allreduce otherwise: *direct reduce-scatter, then direct allgather*:
//!   the buffer is cut into N chunks; rank r sends chunk j to rank j, and
//!   reduces the N contributions of chunk r in rank order 0..N-1; then every
//!   rank sends its reduced chunk to every other rank. Each rank sends
//!   2(N-1)/N·S bytes, as a ring would, but in two steps, not 2(N-1).
//! - broadcast: the root sends to every rank; allgather: every rank sends
//!   its block to every rank; barrier: an empty message to and from every
//!   rank.
//!
//! Not a ring: a ring reduce-scatter folds each chunk in a rotated rank
//! order, which would make float results differ from the device's. Here
//! every element is folded in rank order 0..N-1 with the device's
//! arithmetic ([`crate::reduce_rank_order`]), so results are bitwise
//! equal to the device's.
//!
//! All sends and receives of a step progress together on non-blocking
//! sockets under `poll(2)`, so large messages cannot deadlock on full
//! socket buffers. Writes use `MSG_NOSIGNAL`: a vanished peer gives an
//! error, not SIGPIPE.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout};

use dmlc_driver::{Dtype, ReduceOp};

pub use crate::error::TcpError;
use crate::{check_allgather, check_allreduce, check_root, reduce_into, Aligned, Communicator};

/// How long [`TcpComm::connect`] waits for slow peers by default.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a collective waits for a silent peer by default.
pub const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(120);
/// Environment variable with the peer list, `ip:port,ip:port,...` in rank
/// order.
pub const PEERS_ENV: &str = "DMLC_TCP_PEERS";

const HELLO_MAGIC: u32 = 0x484c_4d44; // "DMLH"
const FRAME_MAGIC: u32 = 0x544c_4d44; // "DMLT"
const VERSION: u32 = 1;
const HELLO_LEN: usize = 16;
const HEADER_LEN: usize = 32;
/// Largest allreduce done by direct exchange for N > 2.
const DIRECT_MAX_BYTES: usize = 64 << 10;
const RETRY_INTERVAL: Duration = Duration::from_millis(100);

/// Parses `ip:port,ip:port,...` (rank order; host names are resolved).
pub fn parse_peers(list: &str) -> Result<Vec<SocketAddr>, TcpError> {
    let mut peers = Vec::new();
    for (i, item) in list.split(',').map(str::trim).enumerate() {
        if item.is_empty() {
            return Err(TcpError::Peers(format!("entry {i} is empty")));
        }
        let addr = item
            .to_socket_addrs()
            .map_err(|e| TcpError::Peers(format!("entry {i} ({item}): {e}")))?
            .next()
            .ok_or_else(|| TcpError::Peers(format!("entry {i} ({item}) has no address")))?;
        peers.push(addr);
    }
    Ok(peers)
}

/// The peer list from `DMLC_TCP_PEERS`.
pub fn peers_from_env() -> Result<Vec<SocketAddr>, TcpError> {
    let list =
        std::env::var(PEERS_ENV).map_err(|_| TcpError::Peers(format!("{PEERS_ENV} is not set")))?;
    parse_peers(&list)
}

/// Binds the listening socket of `addr`: the address itself, or the same
/// port on every interface if the address is not local (behind NAT, or a
/// VM that does not know its own address).
pub fn listen(addr: SocketAddr) -> Result<TcpListener, TcpError> {
    match TcpListener::bind(addr) {
        Err(e) if e.kind() == io::ErrorKind::AddrNotAvailable => {
            let any: IpAddr = if addr.is_ipv4() {
                Ipv4Addr::UNSPECIFIED.into()
            } else {
                Ipv6Addr::UNSPECIFIED.into()
            };
            TcpListener::bind((any, addr.port()))
        }
        r => r,
    }
    .map_err(|source| TcpError::Listen { addr, source })
}

/// One member of a group over TCP.
pub struct TcpComm {
    rank: u32,
    world: u32,
    /// Indexed by rank; `None` at our own.
    streams: Vec<Option<TcpStream>>,
    seq: u32,
    io_timeout: Option<Duration>,
    broken: bool,
    scratch: Aligned,
}

impl std::fmt::Debug for TcpComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpComm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("seq", &self.seq)
            .field("broken", &self.broken)
            .finish()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Hello {
    rank: u32,
    world: u32,
}

impl Hello {
    fn encode(self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&VERSION.to_le_bytes());
        b[8..12].copy_from_slice(&self.rank.to_le_bytes());
        b[12..16].copy_from_slice(&self.world.to_le_bytes());
        b
    }

    fn decode(b: &[u8; HELLO_LEN]) -> Result<Hello, String> {
        let word = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        if word(0) != HELLO_MAGIC {
            return Err("not a dmlc-guest tcp peer".into());
        }
        if word(4) != VERSION {
            return Err(format!("protocol version {} (this is {VERSION})", word(4)));
        }
        Ok(Hello {
            rank: word(8),
            world: word(12),
        })
    }
}

/// What a message claims to be; the receiver compares it with what it
/// expects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Header {
    seq: u32,
    opcode: u8,
    dtype: u8,
    op: u8,
    phase: u8,
    root: u32,
    count: u64,
    len: u64,
}

/// Opcodes on the wire (the device's, plus the allreduce variants).
mod wire {
    pub const ALLREDUCE_DIRECT: u8 = 0;
    pub const ALLREDUCE_SCATTER: u8 = 1;
    pub const BROADCAST: u8 = 2;
    pub const ALLGATHER: u8 = 3;
    pub const BARRIER: u8 = 4;
    pub const SENDRECV: u8 = 5;
    pub const ALLTOALL: u8 = 6;
}

impl Header {
    fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&self.seq.to_le_bytes());
        b[8] = self.opcode;
        b[9] = self.dtype;
        b[10] = self.op;
        b[11] = self.phase;
        b[12..16].copy_from_slice(&self.root.to_le_bytes());
        b[16..24].copy_from_slice(&self.count.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    fn decode(b: &[u8; HEADER_LEN]) -> Option<Header> {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        (u32_at(0) == FRAME_MAGIC).then(|| Header {
            seq: u32_at(4),
            opcode: b[8],
            dtype: b[9],
            op: b[10],
            phase: b[11],
            root: u32_at(12),
            count: u64_at(16),
            len: u64_at(24),
        })
    }

    /// The first field that differs, in the order a reader would want it.
    fn first_difference(&self, theirs: &Header) -> Option<(&'static str, u64, u64)> {
        let fields: [(&'static str, u64, u64); 8] = [
            ("opcode", self.opcode.into(), theirs.opcode.into()),
            ("dtype", self.dtype.into(), theirs.dtype.into()),
            ("op", self.op.into(), theirs.op.into()),
            ("count", self.count, theirs.count),
            ("root", self.root.into(), theirs.root.into()),
            ("sequence number", self.seq.into(), theirs.seq.into()),
            ("phase", self.phase.into(), theirs.phase.into()),
            ("length", self.len, theirs.len),
        ];
        fields.into_iter().find(|(_, a, b)| a != b)
    }
}

/// One message to send in a step.
struct Out<'a> {
    peer: usize,
    hdr: [u8; HEADER_LEN],
    data: &'a [u8],
    sent: usize,
}

/// One message to receive in a step.
struct In<'a> {
    peer: usize,
    want: Header,
    hdr: [u8; HEADER_LEN],
    data: &'a mut [u8],
    got: usize,
}

impl Out<'_> {
    fn done(&self) -> bool {
        self.sent == HEADER_LEN + self.data.len()
    }
}

impl In<'_> {
    fn done(&self) -> bool {
        self.got == HEADER_LEN + self.data.len()
    }
}

fn gone(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::UnexpectedEof
    )
}

fn peer_error(peer: usize, e: io::Error) -> TcpError {
    if gone(&e) {
        TcpError::PeerClosed { rank: peer as u32 }
    } else {
        TcpError::Io {
            rank: peer as u32,
            source: e,
        }
    }
}

/// `writev` without SIGPIPE: a vanished peer gives EPIPE, not a signal
/// (which would kill a C program that did not ignore it), and without
/// blocking.
fn send_vectored(s: &TcpStream, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
    // SAFETY: an all-zero msghdr is valid (no address, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    // IoSlice is ABI-compatible with iovec on Unix (std documents it);
    // sendmsg only reads the buffers.
    msg.msg_iov = bufs.as_ptr().cast_mut().cast::<libc::iovec>();
    msg.msg_iovlen = bufs.len() as _;
    // SAFETY: `msg` points at `bufs`, which outlive the call; the fd is
    // the stream's open socket.
    let n = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Sends as much of `o` as the socket takes now. Ok(true) when done.
fn push(s: &TcpStream, o: &mut Out<'_>) -> Result<bool, TcpError> {
    while !o.done() {
        let (a, b): (&[u8], &[u8]) = if o.sent < HEADER_LEN {
            (&o.hdr[o.sent..], o.data)
        } else {
            (&o.data[o.sent - HEADER_LEN..], &[])
        };
        let iov = [IoSlice::new(a), IoSlice::new(b)];
        let n = if b.is_empty() { 1 } else { 2 };
        match send_vectored(s, &iov[..n]) {
            Ok(0) => {
                return Err(TcpError::PeerClosed {
                    rank: o.peer as u32,
                })
            }
            Ok(k) => o.sent += k,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(peer_error(o.peer, e)),
        }
    }
    Ok(true)
}

/// Receives as much of `i` as has arrived. Ok(true) when done.
fn pull(s: &TcpStream, i: &mut In<'_>) -> Result<bool, TcpError> {
    let rank = i.peer as u32;
    while !i.done() {
        let before = i.got;
        let r = if i.got < HEADER_LEN {
            let mut iov = [
                IoSliceMut::new(&mut i.hdr[before..]),
                IoSliceMut::new(i.data),
            ];
            let n = if iov[1].is_empty() { 1 } else { 2 };
            (&*s).read_vectored(&mut iov[..n])
        } else {
            (&*s).read(&mut i.data[before - HEADER_LEN..])
        };
        match r {
            Ok(0) => return Err(TcpError::PeerClosed { rank }),
            Ok(k) => i.got += k,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(peer_error(i.peer, e)),
        }
        if before < HEADER_LEN && i.got >= HEADER_LEN {
            let theirs = Header::decode(&i.hdr).ok_or(TcpError::BadFrame { rank })?;
            if let Some((field, ours, theirs)) = i.want.first_difference(&theirs) {
                return Err(TcpError::Mismatch {
                    field,
                    rank,
                    ours,
                    theirs,
                });
            }
        }
    }
    Ok(true)
}

/// Drives every send and receive of one step to completion.
fn exchange(
    streams: &[Option<TcpStream>],
    outs: &mut [Out<'_>],
    ins: &mut [In<'_>],
    timeout: Option<Duration>,
) -> Result<(), TcpError> {
    let stream = |peer: usize| streams[peer].as_ref().expect("stream to every peer");
    let deadline = timeout.map(|t| Instant::now() + t);
    let mut fds: Vec<(usize, bool)> = Vec::with_capacity(outs.len() + ins.len());
    loop {
        fds.clear();
        for o in outs.iter_mut().filter(|o| !o.done()) {
            if !push(stream(o.peer), o)? {
                fds.push((o.peer, true));
            }
        }
        for i in ins.iter_mut().filter(|i| !i.done()) {
            if !pull(stream(i.peer), i)? {
                fds.push((i.peer, false));
            }
        }
        if fds.is_empty() {
            return Ok(());
        }
        let wait = match deadline {
            None => PollTimeout::NONE,
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                // Round up so that a wait never ends just short of the deadline.
                PollTimeout::try_from(left + Duration::from_micros(999)).unwrap_or(PollTimeout::MAX)
            }
        };
        let mut pfds: Vec<PollFd<'_>> = fds
            .iter()
            .map(|&(peer, out)| {
                let ev = if out {
                    PollFlags::POLLOUT
                } else {
                    PollFlags::POLLIN
                };
                PollFd::new(stream(peer).as_fd(), ev)
            })
            .collect();
        match nix::poll::poll(&mut pfds, wait) {
            Ok(0) => {
                // Name a rank we wait to hear from, else one we cannot send to.
                let peer = fds.iter().find(|(_, out)| !out).unwrap_or(&fds[0]).0;
                return Err(TcpError::Timeout {
                    rank: peer as u32,
                    waited: timeout.unwrap_or_default(),
                });
            }
            Ok(_) | Err(nix::Error::EINTR) => {}
            Err(e) => return Err(TcpError::Poll(e)),
        }
    }
}

/// Element range `[lo, hi)` of chunk `j` of `count` elements cut in `n`.
fn chunk(count: usize, n: usize, j: usize) -> (usize, usize) {
    (j * count / n, (j + 1) * count / n)
}

impl TcpComm {
    /// Joins the group: listens on `peers[rank]` (see [`listen`]), connects
    /// to every lower rank and accepts every higher one, retrying for up to
    /// `timeout`.
    pub fn connect(
        rank: u32,
        peers: &[SocketAddr],
        timeout: Duration,
    ) -> Result<TcpComm, TcpError> {
        let world = peers.len() as u32;
        let own = *peers
            .get(rank as usize)
            .ok_or(TcpError::Rank { rank, world })?;
        let listener = if rank + 1 < world {
            Some(listen(own)?)
        } else {
            None
        };
        Self::setup(rank, listener, peers, timeout)
    }

    /// As [`Self::connect`], with a listening socket the caller bound
    /// (e.g. on port 0 before telling the others the port).
    pub fn with_listener(
        rank: u32,
        listener: TcpListener,
        peers: &[SocketAddr],
        timeout: Duration,
    ) -> Result<TcpComm, TcpError> {
        Self::setup(rank, Some(listener), peers, timeout)
    }

    fn setup(
        rank: u32,
        listener: Option<TcpListener>,
        peers: &[SocketAddr],
        timeout: Duration,
    ) -> Result<TcpComm, TcpError> {
        let world = u32::try_from(peers.len()).unwrap_or(u32::MAX);
        if world == 0 {
            return Err(TcpError::Peers("no peers".into()));
        }
        if rank >= world {
            return Err(TcpError::Rank { rank, world });
        }
        let start = Instant::now();
        let deadline = start + timeout;
        let me = Hello { rank, world };
        // `stop` tells the acceptor that connecting failed; `abort` tells
        // the connecting loop that accepting failed.
        let stop = AtomicBool::new(false);
        let abort = AtomicBool::new(false);
        let (lower, higher) = std::thread::scope(|s| {
            let acceptor = listener.map(|l| {
                let (stop, abort) = (&stop, &abort);
                s.spawn(move || {
                    let r = accept_all(&l, me, peers, deadline, stop);
                    if r.is_err() {
                        abort.store(true, Ordering::Relaxed);
                    }
                    r
                })
            });
            let mut lower = Ok(Vec::new());
            for j in 0..rank {
                match connect_one(me, j, peers[j as usize], deadline, &abort) {
                    Ok(Some(s)) => {
                        if let Ok(v) = lower.as_mut() {
                            v.push(s);
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        lower = Err(e);
                        break;
                    }
                }
            }
            if lower.is_err() {
                stop.store(true, Ordering::Relaxed);
            }
            let higher = match acceptor {
                Some(a) => a.join().unwrap_or_else(|p| std::panic::resume_unwind(p)),
                None => Ok(Vec::new()),
            };
            (lower, higher)
        });
        // A connect failure first (the lowest missing rank), then an accept
        // failure (which may also have cut the connecting short).
        let lower = lower?;
        let higher = higher?;
        debug_assert_eq!(lower.len(), rank as usize);
        let mut streams: Vec<Option<TcpStream>> = lower.into_iter().map(Some).collect();
        streams.push(None);
        streams.extend(higher.into_iter().map(Some));
        for (peer, s) in streams.iter().enumerate() {
            if let Some(s) = s {
                let up = |source| TcpError::Io {
                    rank: peer as u32,
                    source,
                };
                s.set_nodelay(true).map_err(up)?;
                s.set_nonblocking(true).map_err(up)?;
            }
        }
        log::debug!(
            "tcp: rank {rank} of {world} connected in {:?}",
            start.elapsed()
        );
        Ok(TcpComm {
            rank,
            world,
            streams,
            seq: 0,
            io_timeout: Some(DEFAULT_IO_TIMEOUT),
            broken: false,
            scratch: Aligned::default(),
        })
    }

    /// How long a collective waits for a silent peer (`None`: forever).
    pub fn set_io_timeout(&mut self, timeout: Option<Duration>) {
        self.io_timeout = timeout;
    }

    fn header(&self, opcode: u8, dtype: u8, op: u8, root: u32, count: u64) -> Header {
        Header {
            seq: self.seq,
            opcode,
            dtype,
            op,
            phase: 0,
            root,
            count,
            len: 0,
        }
    }

    /// Runs `f` unless broken; marks broken if it fails; counts the step.
    fn guarded(&mut self, f: impl FnOnce(&mut Self) -> Result<(), TcpError>) -> crate::Result<()> {
        if self.broken {
            return Err(TcpError::Broken.into());
        }
        let r = f(self);
        self.seq = self.seq.wrapping_add(1);
        if r.is_err() {
            self.broken = true;
        }
        Ok(r?)
    }

    fn others(&self) -> impl Iterator<Item = usize> + '_ {
        let me = self.rank as usize;
        (0..self.world as usize).filter(move |&j| j != me)
    }

    fn allreduce_direct(
        &mut self,
        dtype: Dtype,
        op: ReduceOp,
        data: &mut [u8],
    ) -> Result<(), TcpError> {
        let n = data.len();
        let want = Header {
            len: n as u64,
            ..self.header(
                wire::ALLREDUCE_DIRECT,
                dtype.raw(),
                op.raw(),
                0,
                (n / dtype.size()) as u64,
            )
        };
        let peers: Vec<usize> = self.others().collect();
        let mut scratch = std::mem::take(&mut self.scratch);
        let r = (|| {
            let buf = scratch.bytes(n * peers.len());
            let mut parts: Vec<&mut [u8]> = if n == 0 {
                peers.iter().map(|_| Default::default()).collect()
            } else {
                buf.chunks_mut(n).collect()
            };
            {
                let mut outs: Vec<Out<'_>> = peers
                    .iter()
                    .map(|&p| Out {
                        peer: p,
                        hdr: want.encode(),
                        data: &*data,
                        sent: 0,
                    })
                    .collect();
                let mut ins: Vec<In<'_>> = peers
                    .iter()
                    .zip(parts.iter_mut())
                    .map(|(&p, d)| In {
                        peer: p,
                        want,
                        hdr: [0; HEADER_LEN],
                        data: d,
                        got: 0,
                    })
                    .collect();
                exchange(&self.streams, &mut outs, &mut ins, self.io_timeout)?;
            }
            let others: Vec<&[u8]> = parts.iter().map(|p| &**p).collect();
            reduce_into(dtype, op, self.rank as usize, data, &others)?;
            Ok(())
        })();
        self.scratch = scratch;
        r
    }

    fn allreduce_scatter(
        &mut self,
        dtype: Dtype,
        op: ReduceOp,
        data: &mut [u8],
    ) -> Result<(), TcpError> {
        let size = dtype.size();
        let count = data.len() / size;
        let world = self.world as usize;
        let me = self.rank as usize;
        let base = self.header(
            wire::ALLREDUCE_SCATTER,
            dtype.raw(),
            op.raw(),
            0,
            count as u64,
        );
        let bytes = |j: usize| {
            let (lo, hi) = chunk(count, world, j);
            (lo * size, hi * size)
        };
        let (mlo, mhi) = bytes(me);
        let mine = mhi - mlo;
        let peers: Vec<usize> = self.others().collect();
        let mut scratch = std::mem::take(&mut self.scratch);
        let r = (|| {
            // Step 1: chunk j to rank j; chunk `me` from everyone.
            let buf = scratch.bytes(mine * peers.len());
            let mut parts: Vec<&mut [u8]> = if mine == 0 {
                peers.iter().map(|_| Default::default()).collect()
            } else {
                buf.chunks_mut(mine).collect()
            };
            {
                let mut outs: Vec<Out<'_>> = peers
                    .iter()
                    .filter_map(|&p| {
                        let (lo, hi) = bytes(p);
                        let hdr = Header {
                            phase: 1,
                            len: (hi - lo) as u64,
                            ..base
                        };
                        (hi > lo).then(|| Out {
                            peer: p,
                            hdr: hdr.encode(),
                            data: &data[lo..hi],
                            sent: 0,
                        })
                    })
                    .collect();
                let want = Header {
                    phase: 1,
                    len: mine as u64,
                    ..base
                };
                let mut ins: Vec<In<'_>> = if mine == 0 {
                    Vec::new()
                } else {
                    peers
                        .iter()
                        .zip(parts.iter_mut())
                        .map(|(&p, d)| In {
                            peer: p,
                            want,
                            hdr: [0; HEADER_LEN],
                            data: d,
                            got: 0,
                        })
                        .collect()
                };
                exchange(&self.streams, &mut outs, &mut ins, self.io_timeout)?;
            }
            let others: Vec<&[u8]> = parts.iter().map(|p| &**p).collect();
            reduce_into(dtype, op, me, &mut data[mlo..mhi], &others)?;

            // Step 2: the reduced chunk `me` to everyone; chunk j from rank j.
            let mut chunks: Vec<&mut [u8]> = Vec::with_capacity(world);
            let mut rest = &mut *data;
            for j in 0..world {
                let (lo, hi) = bytes(j);
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(hi - lo);
                chunks.push(head);
                rest = tail;
            }
            let mut own: &[u8] = &[];
            let mut theirs: Vec<(usize, &mut [u8])> = Vec::new();
            for (j, c) in chunks.into_iter().enumerate() {
                if j == me {
                    own = c;
                } else if !c.is_empty() {
                    theirs.push((j, c));
                }
            }
            let hdr = Header {
                phase: 2,
                len: own.len() as u64,
                ..base
            }
            .encode();
            let mut outs: Vec<Out<'_>> = if own.is_empty() {
                Vec::new()
            } else {
                peers
                    .iter()
                    .map(|&p| Out {
                        peer: p,
                        hdr,
                        data: own,
                        sent: 0,
                    })
                    .collect()
            };
            let mut ins: Vec<In<'_>> = theirs
                .into_iter()
                .map(|(j, c)| In {
                    peer: j,
                    want: Header {
                        phase: 2,
                        len: c.len() as u64,
                        ..base
                    },
                    hdr: [0; HEADER_LEN],
                    data: c,
                    got: 0,
                })
                .collect();
            exchange(&self.streams, &mut outs, &mut ins, self.io_timeout)
        })();
        self.scratch = scratch;
        r
    }
}

impl Communicator for TcpComm {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn world_size(&self) -> u32 {
        self.world
    }

    fn transport(&self) -> &'static str {
        "tcp"
    }

    fn allreduce_raw(&mut self, dtype: Dtype, op: ReduceOp, data: &mut [u8]) -> crate::Result<()> {
        check_allreduce(dtype, op, data.len())?;
        if self.world == 1 {
            reduce_into(dtype, op, 0, data, &[])?;
            return self.guarded(|_| Ok(()));
        }
        // Every member picks the same algorithm: it depends only on
        // arguments that must match.
        let direct = self.world == 2 || data.len() <= DIRECT_MAX_BYTES;
        self.guarded(|c| {
            if direct {
                c.allreduce_direct(dtype, op, data)
            } else {
                c.allreduce_scatter(dtype, op, data)
            }
        })
    }

    fn broadcast_raw(&mut self, root: u32, data: &mut [u8]) -> crate::Result<()> {
        check_root(root, self.world)?;
        let hdr = Header {
            len: data.len() as u64,
            ..self.header(wire::BROADCAST, 0, 0, root, data.len() as u64)
        };
        self.guarded(|c| {
            if c.rank == root {
                let mut outs: Vec<Out<'_>> = c
                    .others()
                    .map(|p| Out {
                        peer: p,
                        hdr: hdr.encode(),
                        data: &*data,
                        sent: 0,
                    })
                    .collect();
                exchange(&c.streams, &mut outs, &mut [], c.io_timeout)
            } else {
                let mut ins = [In {
                    peer: root as usize,
                    want: hdr,
                    hdr: [0; HEADER_LEN],
                    data,
                    got: 0,
                }];
                exchange(&c.streams, &mut [], &mut ins, c.io_timeout)
            }
        })
    }

    fn allgather_raw(&mut self, input: &[u8], output: &mut [u8]) -> crate::Result<()> {
        check_allgather(input.len(), output.len(), self.world)?;
        let n = input.len();
        let me = self.rank as usize;
        let hdr = Header {
            len: n as u64,
            ..self.header(wire::ALLGATHER, 0, 0, 0, n as u64)
        };
        self.guarded(|c| {
            let mut ins: Vec<In<'_>> = Vec::new();
            let blocks: Vec<&mut [u8]> = if n == 0 {
                (0..c.world).map(|_| Default::default()).collect()
            } else {
                output.chunks_mut(n).collect()
            };
            for (j, b) in blocks.into_iter().enumerate() {
                if j == me {
                    b.copy_from_slice(input);
                } else {
                    ins.push(In {
                        peer: j,
                        want: hdr,
                        hdr: [0; HEADER_LEN],
                        data: b,
                        got: 0,
                    });
                }
            }
            let mut outs: Vec<Out<'_>> = c
                .others()
                .map(|p| Out {
                    peer: p,
                    hdr: hdr.encode(),
                    data: input,
                    sent: 0,
                })
                .collect();
            exchange(&c.streams, &mut outs, &mut ins, c.io_timeout)
        })
    }

    fn barrier(&mut self) -> crate::Result<()> {
        let hdr = self.header(wire::BARRIER, 0, 0, 0, 0);
        self.guarded(|c| {
            let mut outs: Vec<Out<'_>> = c
                .others()
                .map(|p| Out {
                    peer: p,
                    hdr: hdr.encode(),
                    data: &[],
                    sent: 0,
                })
                .collect();
            let mut ins: Vec<In<'_>> = c
                .others()
                .map(|p| In {
                    peer: p,
                    want: hdr,
                    hdr: [0; HEADER_LEN],
                    data: &mut [],
                    got: 0,
                })
                .collect();
            exchange(&c.streams, &mut outs, &mut ins, c.io_timeout)
        })
    }

    fn sendrecv_raw(
        &mut self,
        to: u32,
        input: &[u8],
        from: u32,
        output: &mut [u8],
    ) -> crate::Result<()> {
        crate::check_sendrecv(to, from, self.rank, self.world)?;
        let hdr = |n: usize| Header {
            len: n as u64,
            ..self.header(wire::SENDRECV, 0, 0, 0, n as u64)
        };
        let (out_hdr, in_hdr) = (hdr(input.len()), hdr(output.len()));
        self.guarded(|c| {
            let mut outs = [Out {
                peer: to as usize,
                hdr: out_hdr.encode(),
                data: input,
                sent: 0,
            }];
            let mut ins = [In {
                peer: from as usize,
                want: in_hdr,
                hdr: [0; HEADER_LEN],
                data: output,
                got: 0,
            }];
            exchange(&c.streams, &mut outs, &mut ins, c.io_timeout)
        })
    }

    fn alltoall_raw(&mut self, input: &[u8], output: &mut [u8]) -> crate::Result<()> {
        crate::check_alltoall(input.len(), output.len(), self.world)?;
        let world = self.world as usize;
        let n = input.len() / world;
        let me = self.rank as usize;
        let hdr = Header {
            len: n as u64,
            ..self.header(wire::ALLTOALL, 0, 0, 0, n as u64)
        };
        self.guarded(|c| {
            let blocks: Vec<&mut [u8]> = if n == 0 {
                (0..world).map(|_| Default::default()).collect()
            } else {
                output.chunks_mut(n).collect()
            };
            let mut ins: Vec<In<'_>> = Vec::new();
            for (j, b) in blocks.into_iter().enumerate() {
                if j == me {
                    b.copy_from_slice(&input[j * n..(j + 1) * n]);
                } else {
                    ins.push(In {
                        peer: j,
                        want: hdr,
                        hdr: [0; HEADER_LEN],
                        data: b,
                        got: 0,
                    });
                }
            }
            let mut outs: Vec<Out<'_>> = c
                .others()
                .map(|p| Out {
                    peer: p,
                    hdr: hdr.encode(),
                    data: &input[p * n..(p + 1) * n],
                    sent: 0,
                })
                .collect();
            exchange(&c.streams, &mut outs, &mut ins, c.io_timeout)
        })
    }
}

/// Connects to lower rank `j` at `addr`, retrying until `deadline`.
fn connect_one(
    me: Hello,
    j: u32,
    addr: SocketAddr,
    deadline: Instant,
    abort: &AtomicBool,
) -> Result<Option<TcpStream>, TcpError> {
    let start = Instant::now();
    let mut last: io::Error;
    loop {
        if abort.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let attempt = TcpStream::connect_timeout(
            &addr,
            left.clamp(Duration::from_millis(1), Duration::from_secs(5)),
        )
        .and_then(|mut s| {
            // The acceptor answers as soon as its helper thread sees us; a
            // peer that accepted but never answers is not the peer we want.
            s.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
            s.write_all(&me.encode())?;
            let mut b = [0u8; HELLO_LEN];
            s.read_exact(&mut b)?;
            s.set_read_timeout(None)?;
            Ok((s, b))
        });
        match attempt {
            Ok((s, b)) => {
                let reason = match Hello::decode(&b) {
                    Ok(h)
                        if h == (Hello {
                            rank: j,
                            world: me.world,
                        }) =>
                    {
                        return Ok(Some(s))
                    }
                    Ok(h) if h.world != me.world => format!(
                        "group of {} there, {} here: the peer lists differ",
                        h.world, me.world
                    ),
                    Ok(h) => format!("expected rank {j}, found rank {}", h.rank),
                    Err(r) => r,
                };
                return Err(TcpError::Handshake { addr, reason });
            }
            Err(e) => last = e,
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(TcpError::Connect {
                rank: j,
                addr,
                waited: start.elapsed(),
                source: last,
            });
        }
        log::debug!("tcp: rank {j} at {addr} not ready ({last}), retrying");
        std::thread::sleep(RETRY_INTERVAL.min(deadline - now));
    }
}

/// Accepts every rank above `me.rank`, until `deadline` or `stop`.
fn accept_all(
    listener: &TcpListener,
    me: Hello,
    peers: &[SocketAddr],
    deadline: Instant,
    stop: &AtomicBool,
) -> Result<Vec<TcpStream>, TcpError> {
    let start = Instant::now();
    let first = me.rank as usize + 1;
    let mut got: Vec<Option<TcpStream>> = (first..peers.len()).map(|_| None).collect();
    let local = listener.local_addr().unwrap_or(peers[me.rank as usize]);
    listener
        .set_nonblocking(true)
        .map_err(|source| TcpError::Listen {
            addr: local,
            source,
        })?;
    while got.iter().any(Option::is_none) {
        if stop.load(Ordering::Relaxed) {
            // The caller failed already and reports its own error.
            return Ok(Vec::new());
        }
        match listener.accept() {
            Ok((s, from)) => {
                if let Some((rank, s)) = greet(s, from, me, deadline)? {
                    if got[rank - first].replace(s).is_some() {
                        log::debug!("tcp: rank {rank} connected again; keeping the new connection");
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<usize> = got
                        .iter()
                        .enumerate()
                        .filter(|(_, s)| s.is_none())
                        .map(|(i, _)| first + i)
                        .collect();
                    return Err(TcpError::NotConnected {
                        rank: missing[0] as u32,
                        addr: peers[missing[0]],
                        more: missing.len() - 1,
                        waited: start.elapsed(),
                    });
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(source) => {
                return Err(TcpError::Listen {
                    addr: local,
                    source,
                })
            }
        }
    }
    Ok(got.into_iter().map(|s| s.expect("all connected")).collect())
}

/// Reads an accepted connection's hello and answers it. `Ok(None)`: not a
/// peer (ignored); an error: a peer of another group.
fn greet(
    mut s: TcpStream,
    from: SocketAddr,
    me: Hello,
    deadline: Instant,
) -> Result<Option<(usize, TcpStream)>, TcpError> {
    let io = (|| {
        s.set_nonblocking(false)?;
        let left = deadline.saturating_duration_since(Instant::now());
        s.set_read_timeout(Some(
            left.clamp(Duration::from_millis(1), Duration::from_secs(10)),
        ))?;
        let mut b = [0u8; HELLO_LEN];
        s.read_exact(&mut b)?;
        Ok::<_, io::Error>(b)
    })();
    let b = match io {
        Ok(b) => b,
        Err(e) => {
            log::warn!("tcp: ignoring a connection from {from}: {e}");
            return Ok(None);
        }
    };
    let h = match Hello::decode(&b) {
        Ok(h) => h,
        Err(reason) => {
            log::warn!("tcp: ignoring a connection from {from}: {reason}");
            return Ok(None);
        }
    };
    if h.world != me.world {
        // Answer anyway, so that the other side reports the mismatch too
        // instead of retrying until its timeout.
        let _ = s.write_all(&me.encode());
        return Err(TcpError::Handshake {
            addr: from,
            reason: format!(
                "group of {} there, {} here: the peer lists differ",
                h.world, me.world
            ),
        });
    }
    if h.rank <= me.rank || h.rank >= me.world {
        return Err(TcpError::Handshake {
            addr: from,
            reason: format!(
                "rank {} connected to rank {}; only higher ranks connect",
                h.rank, me.rank
            ),
        });
    }
    let answered = s
        .write_all(&me.encode())
        .and_then(|()| s.set_read_timeout(None));
    if let Err(e) = answered {
        log::warn!(
            "tcp: rank {} at {from} left during the handshake: {e}",
            h.rank
        );
        return Ok(None);
    }
    Ok(Some((h.rank as usize, s)))
}

#[cfg(test)]
mod tests;
