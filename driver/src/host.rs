//! Host transport: this process plays the VM and talks vhost-user to the
//! backend directly, as QEMU would.
//!
//! All device-visible memory is one memfd ([`MemfdMemory`]) announced to the
//! backend in `SET_MEM_TABLE` as guest-physical memory at [`GUEST_BASE`], so
//! descriptor addresses are `GUEST_BASE + offset`. Ring addresses in
//! `SET_VRING_ADDR` are, as in QEMU, addresses in this process. A notify
//! writes the queue's kick eventfd; an interrupt is the backend writing the
//! call eventfd.
//!
//! A backend that went away shows up as EOF, `EPIPE` or `ECONNRESET` on the
//! socket; every operation reports it as [`TransportError::Disconnected`],
//! and waiting checks the socket for hang-up alongside the call eventfd.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use vhost::vhost_user::message::{VhostUserConfigFlags, VhostUserHeaderFlag};
use vhost::vhost_user::{
    Frontend, VhostUserFrontend, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vmm_sys_util::eventfd::{EventFd, EFD_CLOEXEC, EFD_NONBLOCK};

use crate::device::{Device, OpenOptions};
use crate::dma::{DmaMemory, MemfdMemory};
use crate::error::Result as DriverResult;
use crate::transport::{poll_fds, QueueAddrs, Transport, TransportError};

/// Guest-physical address at which the backend sees the memfd.
pub const GUEST_BASE: u64 = 1 << 32;

/// Largest ring size offered; vhost-user has no way to ask the backend.
pub const MAX_RING_SIZE: u16 = 32768;

/// Protocol features used when the backend offers them (CONFIG is required).
fn wanted_protocol_features() -> VhostUserProtocolFeatures {
    VhostUserProtocolFeatures::CONFIG
        | VhostUserProtocolFeatures::MQ
        | VhostUserProtocolFeatures::REPLY_ACK
        | VhostUserProtocolFeatures::RESET_DEVICE
}

/// Maps a vhost error to a transport error, recognising a vanished backend.
fn vhost_error(during: &'static str) -> impl FnOnce(vhost::Error) -> TransportError {
    move |e| {
        use vhost::vhost_user::Error as U;
        let gone = match &e {
            vhost::Error::VhostUserProtocol(u) => match u {
                U::Disconnected | U::PartialMessage | U::SocketBroken(_) => true,
                U::SocketError(io) => matches!(
                    io.raw_os_error(),
                    Some(libc::EPIPE | libc::ECONNRESET | libc::ENOTCONN)
                ),
                _ => false,
            },
            _ => false,
        };
        if gone {
            TransportError::Disconnected { during }
        } else {
            TransportError::Protocol {
                during,
                source: Box::new(e),
            }
        }
    }
}

/// True if the peer hung up or the socket failed (revents of a poll).
fn hung_up(revents: libc::c_short) -> bool {
    revents & (libc::POLLHUP | libc::POLLRDHUP | libc::POLLERR | libc::POLLNVAL) != 0
}

/// Opens the device served by the vhost-user backend at `socket`: this
/// process plays the VM, its DMA memory a memfd that the backend maps.
pub fn open(socket: &Path, opts: &OpenOptions) -> DriverResult<Device> {
    let mem = Arc::new(MemfdMemory::new(opts.dma_bytes, GUEST_BASE)?);
    let transport = HostTransport::connect(socket, Arc::clone(&mem))?;
    let mem: Arc<dyn DmaMemory> = mem;
    Device::open(Box::new(transport), mem, opts)
}

/// How long to keep trying while the socket refuses connections or does not
/// exist yet (a daemon starting, or re-listening after a frontend left).
pub const CONNECT_RETRY: Duration = Duration::from_secs(1);

fn connect_with_retry(socket: &Path) -> std::io::Result<UnixStream> {
    let start = std::time::Instant::now();
    loop {
        match UnixStream::connect(socket) {
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound
                ) && start.elapsed() < CONNECT_RETRY =>
            {
                std::thread::sleep(Duration::from_millis(50));
            }
            r => return r,
        }
    }
}

/// How long the backend may take to answer the first request.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// vhost-user `GET_FEATURES` request code and header flags.
const GET_FEATURES: u32 = 1;
const VERSION_1: u32 = 0x1;
const REPLY_FLAG: u32 = 0x4;

/// Sends one `GET_FEATURES` and waits for its reply with a timeout.
///
/// The vhost-user frontend blocks without limit on replies, and a backend
/// socket that already serves another frontend accepts the connection but
/// never answers; this turns that hang into an error. `GET_FEATURES` has no
/// side effects, so the handshake proper may send it again.
fn probe(stream: &UnixStream, socket: &Path) -> Result<(), TransportError> {
    let io = |during| move |source| TransportError::Io { during, source };
    let mut msg = [0u8; 12];
    msg[0..4].copy_from_slice(&GET_FEATURES.to_le_bytes());
    msg[4..8].copy_from_slice(&VERSION_1.to_le_bytes());
    let mut s = stream;
    s.write_all(&msg).map_err(|e| match e.kind() {
        std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset => {
            TransportError::Disconnected {
                during: "sending the first request",
            }
        }
        _ => io("sending the first request")(e),
    })?;
    let mut fds = [libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    }];
    let ms = HANDSHAKE_TIMEOUT.as_millis() as i32;
    if poll_fds(&mut fds, ms, "waiting for the first reply")? == 0 {
        return Err(TransportError::Unresponsive {
            path: socket.display().to_string(),
            after: HANDSHAKE_TIMEOUT,
        });
    }
    stream
        .set_read_timeout(Some(HANDSHAKE_TIMEOUT))
        .map_err(io("setting a socket timeout"))?;
    let mut reply = [0u8; 20];
    let read = s.read_exact(&mut reply);
    stream
        .set_read_timeout(None)
        .map_err(io("setting a socket timeout"))?;
    read.map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset => {
            TransportError::Disconnected {
                during: "waiting for the first reply",
            }
        }
        _ => io("reading the first reply")(e),
    })?;
    let code = u32::from_le_bytes([reply[0], reply[1], reply[2], reply[3]]);
    let flags = u32::from_le_bytes([reply[4], reply[5], reply[6], reply[7]]);
    if code != GET_FEATURES || flags & REPLY_FLAG == 0 {
        return Err(TransportError::Protocol {
            during: "GET_FEATURES",
            source: format!("unexpected reply (request {code}, flags {flags:#x})").into(),
        });
    }
    Ok(())
}

struct HostQueue {
    kick: EventFd,
    call: EventFd,
}

/// vhost-user frontend for one device, with its memory.
pub struct HostTransport {
    frontend: Frontend,
    /// The frontend's socket, for hang-up checks (owned by `frontend`).
    sock: RawFd,
    mem: Arc<MemfdMemory>,
    device_features: u64,
    protocol: VhostUserProtocolFeatures,
    max_queues: u16,
    queues: Vec<Option<HostQueue>>,
}

impl HostTransport {
    /// Connects to the backend at `socket` and runs the first part of the
    /// vhost-user handshake (owner, features, protocol features, queue count).
    /// `mem` is what the backend will be given in the memory table.
    pub fn connect(socket: &Path, mem: Arc<MemfdMemory>) -> Result<Self, TransportError> {
        let connect_error = |source| TransportError::Connect {
            path: socket.display().to_string(),
            source,
        };
        let stream = connect_with_retry(socket).map_err(connect_error)?;
        probe(&stream, socket)?;
        let mut frontend = Frontend::from_stream(stream, u64::from(virtio_dmlc::MAX_QUEUES));
        let sock = frontend.as_raw_fd();
        frontend.set_owner().map_err(vhost_error("SET_OWNER"))?;
        let features = frontend
            .get_features()
            .map_err(vhost_error("GET_FEATURES"))?;
        let proto_bit = VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        if features & proto_bit == 0 {
            return Err(TransportError::Unsupported("vhost-user protocol features"));
        }
        let offered = frontend
            .get_protocol_features()
            .map_err(vhost_error("GET_PROTOCOL_FEATURES"))?;
        if !offered.contains(VhostUserProtocolFeatures::CONFIG) {
            return Err(TransportError::Unsupported(
                "the vhost-user CONFIG protocol feature",
            ));
        }
        let protocol = offered & wanted_protocol_features();
        frontend
            .set_protocol_features(protocol)
            .map_err(vhost_error("SET_PROTOCOL_FEATURES"))?;
        let max_queues = if protocol.contains(VhostUserProtocolFeatures::MQ) {
            let n = frontend
                .get_queue_num()
                .map_err(vhost_error("GET_QUEUE_NUM"))?;
            u16::try_from(n.min(u64::from(virtio_dmlc::MAX_QUEUES))).unwrap_or(1)
        } else {
            1
        };
        Ok(HostTransport {
            frontend,
            sock,
            mem,
            device_features: features & !proto_bit,
            protocol,
            max_queues,
            queues: (0..max_queues).map(|_| None).collect(),
        })
    }

    /// The memory shared with the backend.
    pub fn memory(&self) -> &Arc<MemfdMemory> {
        &self.mem
    }

    /// Protocol features in use.
    pub fn protocol_features(&self) -> VhostUserProtocolFeatures {
        self.protocol
    }

    fn queue(&self, queue: u16) -> Result<&HostQueue, TransportError> {
        self.queues
            .get(usize::from(queue))
            .and_then(Option::as_ref)
            .ok_or(TransportError::NoSuchQueue {
                queue,
                max: self.max_queues,
            })
    }
}

impl Transport for HostTransport {
    fn device_features(&self) -> u64 {
        self.device_features
    }

    fn negotiate(&mut self, features: u64) -> Result<(), TransportError> {
        let all = features | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        self.frontend
            .set_features(all)
            .map_err(vhost_error("SET_FEATURES"))?;
        // From here on the backend acknowledges every request, so a refused
        // memory table or ring address fails here, not silently later.
        if self.protocol.contains(VhostUserProtocolFeatures::REPLY_ACK) {
            self.frontend.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
        }
        let region = VhostUserMemoryRegionInfo {
            guest_phys_addr: self.mem.guest_base(),
            memory_size: self.mem.len() as u64,
            userspace_addr: self.mem.base() as u64,
            mmap_offset: 0,
            mmap_handle: self.mem.fd().as_raw_fd(),
        };
        self.frontend
            .set_mem_table(&[region])
            .map_err(vhost_error("SET_MEM_TABLE"))?;
        Ok(())
    }

    fn max_queues(&self) -> u16 {
        self.max_queues
    }

    fn max_queue_size(&self, _queue: u16) -> u16 {
        MAX_RING_SIZE
    }

    fn read_config(&self, offset: usize, buf: &mut [u8]) -> Result<(), TransportError> {
        let too_big = || TransportError::Unsupported("config reads beyond 4 KiB");
        let off = u32::try_from(offset).map_err(|_| too_big())?;
        let len = u32::try_from(buf.len()).map_err(|_| too_big())?;
        let zeros = vec![0u8; buf.len()];
        // The frontend handle is shared (an Arc around a locked socket), so
        // a clone gives the `&mut` its trait method wants.
        let (_, payload) = self
            .frontend
            .clone()
            .get_config(off, len, VhostUserConfigFlags::empty(), &zeros)
            .map_err(vhost_error("GET_CONFIG"))?;
        if payload.len() != buf.len() {
            return Err(TransportError::Protocol {
                during: "GET_CONFIG",
                source: format!("{} bytes returned, {} asked", payload.len(), buf.len()).into(),
            });
        }
        buf.copy_from_slice(&payload);
        Ok(())
    }

    fn setup_queue(&mut self, queue: u16, addrs: &QueueAddrs) -> Result<(), TransportError> {
        if queue >= self.max_queues {
            return Err(TransportError::NoSuchQueue {
                queue,
                max: self.max_queues,
            });
        }
        let eventfd = || {
            EventFd::new(EFD_NONBLOCK | EFD_CLOEXEC).map_err(|source| TransportError::Io {
                during: "creating an eventfd",
                source,
            })
        };
        let q = HostQueue {
            kick: eventfd()?,
            call: eventfd()?,
        };
        let index = usize::from(queue);
        let f = &self.frontend;
        f.set_vring_num(index, addrs.size)
            .map_err(vhost_error("SET_VRING_NUM"))?;
        let config = VringConfigData {
            queue_max_size: addrs.size,
            queue_size: addrs.size,
            flags: 0,
            desc_table_addr: addrs.desc.vaddr,
            used_ring_addr: addrs.used.vaddr,
            avail_ring_addr: addrs.avail.vaddr,
            log_addr: None,
        };
        f.set_vring_addr(index, &config)
            .map_err(vhost_error("SET_VRING_ADDR"))?;
        f.set_vring_base(index, 0)
            .map_err(vhost_error("SET_VRING_BASE"))?;
        f.set_vring_call(index, &q.call)
            .map_err(vhost_error("SET_VRING_CALL"))?;
        f.set_vring_kick(index, &q.kick)
            .map_err(vhost_error("SET_VRING_KICK"))?;
        self.queues[index] = Some(q);
        Ok(())
    }

    fn driver_ok(&mut self) -> Result<(), TransportError> {
        for (index, q) in self.queues.iter().enumerate() {
            if q.is_some() {
                self.frontend
                    .set_vring_enable(index, true)
                    .map_err(vhost_error("SET_VRING_ENABLE"))?;
            }
        }
        Ok(())
    }

    fn notify(&self, queue: u16) -> Result<(), TransportError> {
        self.queue(queue)?
            .kick
            .write(1)
            .map_err(|source| TransportError::Io {
                during: "writing the kick eventfd",
                source,
            })
    }

    fn wait_interrupt(
        &self,
        queue: u16,
        timeout: Option<Duration>,
    ) -> Result<bool, TransportError> {
        let q = self.queue(queue)?;
        let timeout_ms = match timeout {
            None => -1,
            // Round up so that a short timeout still sleeps.
            Some(t) => i32::try_from(t.as_micros().div_ceil(1000)).unwrap_or(i32::MAX),
        };
        let mut fds = [
            libc::pollfd {
                fd: q.call.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.sock,
                events: libc::POLLRDHUP,
                revents: 0,
            },
        ];
        if poll_fds(&mut fds, timeout_ms, "polling the call eventfd")? == 0 {
            return Ok(false);
        }
        if hung_up(fds[1].revents) {
            return Err(TransportError::Disconnected {
                during: "waiting for a used buffer",
            });
        }
        // Reset the counter; EAGAIN means another waiter took it, which is
        // fine: the ring is what the caller looks at.
        match q.call.read() {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(source) => {
                return Err(TransportError::Io {
                    during: "reading the call eventfd",
                    source,
                })
            }
        }
        Ok(true)
    }

    fn check_alive(&self) -> Result<(), TransportError> {
        let mut fds = [libc::pollfd {
            fd: self.sock,
            events: libc::POLLRDHUP,
            revents: 0,
        }];
        poll_fds(&mut fds, 0, "polling the backend socket")?;
        if hung_up(fds[0].revents) {
            return Err(TransportError::Disconnected {
                during: "checking the backend socket",
            });
        }
        Ok(())
    }

    fn reset(&mut self) -> Result<(), TransportError> {
        let started = self.queues.iter().any(Option::is_some);
        for (index, q) in self.queues.iter_mut().enumerate() {
            if q.take().is_some() {
                self.frontend
                    .set_vring_enable(index, false)
                    .map_err(vhost_error("SET_VRING_ENABLE"))?;
                // GET_VRING_BASE stops the ring (vhost-user spec).
                self.frontend
                    .get_vring_base(index)
                    .map_err(vhost_error("GET_VRING_BASE"))?;
            }
        }
        // Stopped rings alone mean a paused VM to the device, whose
        // requests stay pending; RESET_DEVICE says the driver is gone (what
        // the patched QEMU sends when DRIVER_OK is cleared). After the stop:
        // the reset clears the backend's features, and it would refuse the
        // stop's SET_VRING_ENABLE. The device answers nothing to it, so a
        // GET_FEATURES round trip makes sure it is done (and no longer
        // touches our buffers) before we return.
        if started
            && self
                .protocol
                .contains(VhostUserProtocolFeatures::RESET_DEVICE)
        {
            self.frontend
                .reset_device()
                .map_err(vhost_error("RESET_DEVICE"))?;
            self.frontend
                .get_features()
                .map_err(vhost_error("GET_FEATURES"))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_to_missing_socket_names_the_path() {
        let mem = Arc::new(MemfdMemory::new(1 << 16, GUEST_BASE).unwrap());
        let path = Path::new("/nonexistent/dmlc-test.sock");
        let err = HostTransport::connect(path, mem).err().expect("must fail");
        assert!(
            err.to_string().contains("/nonexistent/dmlc-test.sock"),
            "{err}"
        );
    }

    #[test]
    fn disconnect_errors_are_recognised() {
        use vhost::vhost_user::Error as U;
        let broken = vhost::Error::VhostUserProtocol(U::SocketBroken(
            std::io::Error::from_raw_os_error(libc::EPIPE),
        ));
        assert!(matches!(
            vhost_error("X")(broken),
            TransportError::Disconnected { during: "X" }
        ));
        let reset = vhost::Error::VhostUserProtocol(U::SocketError(
            std::io::Error::from_raw_os_error(libc::ECONNRESET),
        ));
        assert!(matches!(
            vhost_error("X")(reset),
            TransportError::Disconnected { .. }
        ));
        let other = vhost::Error::VhostUserProtocol(U::InvalidMessage);
        assert!(matches!(
            vhost_error("X")(other),
            TransportError::Protocol { .. }
        ));
    }

    /// A socket that accepts but never answers (as one that already serves
    /// another frontend): the handshake gives up instead of hanging.
    #[test]
    fn silent_backend_is_reported() {
        let dir = std::env::temp_dir().join(format!("dmlc-host-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("silent.sock");
        let _ = std::fs::remove_file(&path);
        // Listening is enough: the kernel completes the connection.
        let _listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let mem = Arc::new(MemfdMemory::new(1 << 16, GUEST_BASE).unwrap());
        let t = std::time::Instant::now();
        let err = HostTransport::connect(&path, mem).err().expect("must fail");
        assert!(
            matches!(err, TransportError::Unresponsive { .. }),
            "got {err:?}"
        );
        assert!(t.elapsed() >= HANDSHAKE_TIMEOUT);
        assert!(err.to_string().contains("silent.sock"), "{err}");
        let _ = std::fs::remove_file(&path);
    }

    /// A backend that accepts and then dies: the handshake reports a
    /// disconnect, not a hang or a panic.
    #[test]
    fn backend_closing_early_is_a_disconnect() {
        let dir = std::env::temp_dir().join(format!("dmlc-host-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("early-close.sock");
        let _ = std::fs::remove_file(&path);
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let t = std::thread::spawn(move || {
            let (s, _) = listener.accept().unwrap();
            drop(s);
        });
        let mem = Arc::new(MemfdMemory::new(1 << 16, GUEST_BASE).unwrap());
        let err = HostTransport::connect(&path, mem).err().expect("must fail");
        t.join().unwrap();
        assert!(
            matches!(err, TransportError::Disconnected { .. }),
            "got {err:?}"
        );
        let _ = std::fs::remove_file(&path);
    }
}
