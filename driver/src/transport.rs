//! The transport: how the driver reaches the device.
//!
//! A transport negotiates features, reads the config space, tells the device
//! where a virtqueue's rings are, rings the doorbell (notify), and waits for
//! the device's used-buffer notification. Everything above it (virtqueue,
//! collective API) is the same for the host transport (vhost-user, the
//! process plays the VM) and a PCI transport.

use std::time::Duration;

use crate::dma::DmaError;

/// Where one ring lives, in both address spaces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingAddr {
    /// Host (driver process) address.
    pub vaddr: u64,
    /// Device address.
    pub paddr: u64,
}

/// The three rings of a split virtqueue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueAddrs {
    /// Number of descriptors (a power of two).
    pub size: u16,
    pub desc: RingAddr,
    pub avail: RingAddr,
    pub used: RingAddr,
}

/// Errors of a transport.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The device side went away (closed socket, broken pipe, reset by peer).
    #[error("device backend disconnected ({during})")]
    Disconnected { during: &'static str },
    /// The device refused or failed a control operation.
    #[error("{during} failed")]
    Protocol {
        during: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The device's socket or node could not be opened.
    #[error("cannot connect to {path}")]
    Connect {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The device did not answer at all (for vhost-user: another frontend
    /// probably holds the socket).
    #[error("{path} did not answer within {after:?} (is another process connected to it?)")]
    Unresponsive {
        path: String,
        after: std::time::Duration,
    },
    /// The device lacks something the driver needs.
    #[error("device does not support {0}")]
    Unsupported(&'static str),
    /// An OS call failed.
    #[error("{during} failed")]
    Io {
        during: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// Queue index out of range for this device.
    #[error("queue {queue} does not exist (device has {max})")]
    NoSuchQueue { queue: u16, max: u16 },
    /// Device-visible memory could not be set up.
    #[error("device memory setup failed")]
    Dma(#[from] DmaError),
}

/// A way to reach one virtio device.
///
/// Methods taking `&self` may be called from several threads at once (one per
/// queue); set-up methods take `&mut self` and run before any queue is used.
pub trait Transport: Send + Sync {
    /// Feature bits the device offers.
    fn device_features(&self) -> u64;

    /// Acknowledges `features` (a subset of [`Self::device_features`]).
    fn negotiate(&mut self, features: u64) -> Result<(), TransportError>;

    /// Number of queues the transport can set up.
    fn max_queues(&self) -> u16;

    /// Largest ring size the device accepts for `queue`.
    fn max_queue_size(&self, queue: u16) -> u16;

    /// Reads `buf.len()` bytes of the config space at `offset`.
    fn read_config(&self, offset: usize, buf: &mut [u8]) -> Result<(), TransportError>;

    /// Tells the device where queue `queue`'s rings are.
    fn setup_queue(&mut self, queue: u16, addrs: &QueueAddrs) -> Result<(), TransportError>;

    /// Lets the device start processing the queues set up so far.
    fn driver_ok(&mut self) -> Result<(), TransportError>;

    /// Notifies the device that queue `queue` has new available buffers.
    fn notify(&self, queue: u16) -> Result<(), TransportError>;

    /// Blocks until the device signals a used buffer on `queue`, or until
    /// `timeout` passes (`None`: no limit). Returns `false` on timeout.
    fn wait_interrupt(&self, queue: u16, timeout: Option<Duration>)
        -> Result<bool, TransportError>;

    /// Whether [`Self::wait_interrupt`] sleeps until the device signals.
    /// False where it can only nap and look again (PCI without
    /// uio_pci_generic): the hybrid wait then polls instead.
    fn can_sleep(&self) -> bool {
        true
    }

    /// Fails with [`TransportError::Disconnected`] if the device is gone.
    /// Cheap enough to call every few milliseconds from a polling loop.
    fn check_alive(&self) -> Result<(), TransportError>;

    /// Stops the device: it stops processing every queue.
    fn reset(&mut self) -> Result<(), TransportError>;
}

/// poll(2) on `fds`, retrying on EINTR; returns the number of ready fds.
/// (nix's `PollFlags` cannot express POLLRDHUP.)
pub(crate) fn poll_fds(
    fds: &mut [libc::pollfd],
    timeout_ms: i32,
    during: &'static str,
) -> Result<usize, TransportError> {
    loop {
        // SAFETY: `fds` is a valid, writable array of `fds.len()` pollfds.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let source = std::io::Error::last_os_error();
        if source.kind() != std::io::ErrorKind::Interrupted {
            return Err(TransportError::Io { during, source });
        }
    }
}
