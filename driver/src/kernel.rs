//! The kernel transport: the device through `/dev/dmlcN` of the
//! `virtio_dmlc` module (kernel-driver/, docs/kernel-driver.md).
//!
//! The module owns the virtqueues, pins the pages of every buffer and
//! builds the descriptor chains itself; this side passes each collective
//! as its header fields and the buffers' virtual addresses (the ioctl ABI
//! of `kernel-driver/include/uapi/virtio_dmlc.h`, mirrored below). Buffers
//! come from a plain memfd mapping, so no root, hugepages or pagemap are
//! needed: only read and write access to the device node.
//!
//! [`Device`]'s API is the same as over the other transports; what differs:
//! `submit_raw` is refused (the module builds every chain), `queue_size`
//! is the module's business (0 here), and a collective larger than one
//! device request is split by the module (`chunk_bytes` in `info`).
//!
//! Where the module negotiated feature bit 1 (communicators, spec
//! 5.X.6.13), a request's communicator, peer, key and table travel in the
//! fields `DMLC_IOC_SUBMIT` gained for them, and the response's length,
//! new communicator and `peer_world` come back in its `reply`; the device
//! then has the same communicator state as over the other transports.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use virtio_dmlc::comm::{VirtioDmlcConfigComm, RESP_COMM_SIZE, VIRTIO_DMLC_F_COMM};
use virtio_dmlc::{too_big, unsupported, VirtioDmlcConfig, VirtioDmlcResp, RESP_SIZE};
use zerocopy::IntoBytes;

use crate::device::{Completion, Device, Done, Handle, Header, Lease, OpenOptions, RawDesc, Reply};
use crate::dma::{CallerMemory, DmaMemory, MemfdMemory};
use crate::error::{Error, Result};
use crate::transport::{QueueAddrs, Transport, TransportError};

/// The first device node the module creates.
pub const DEFAULT_NODE: &str = "/dev/dmlc0";

const ABI_VERSION: u32 = 1;
const SUBMIT_IN_PLACE: u32 = 0x1;
const SUBMIT_WAIT: u32 = 0x2;
const WAIT_PEEK: u32 = 0x1;
// _IO(0xd3, nr): no size or direction bits; each struct carries argsz.
const IOC_INFO: libc::c_ulong = 0xd300;
const IOC_SUBMIT: libc::c_ulong = 0xd301;
const IOC_WAIT: libc::c_ulong = 0xd302;

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct Info {
    argsz: u32,
    flags: u32,
    abi_version: u32,
    rank: u32,
    world_size: u32,
    num_queues: u32,
    max_segments: u32,
    dtypes: u32,
    ops: u32,
    opcodes: u32,
    generation: u32,
    chunk_bytes: u32,
    group_id: u64,
    max_bytes: u64,
    features: u64,
    pinned_limit: u64,
    pinned_bytes: u64,
    pinned_total: u64,
    in_flight: u32,
    resets: u32,
    /// Added with feature bit 1; 0 from a module without it.
    max_comms: u32,
    reserved: u32,
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct Iovec {
    addr: u64,
    len: u64,
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct KCompletion {
    id: u64,
    user_data: u64,
    error: i32,
    status: u32,
    detail: u32,
    peer: u32,
    generation: u32,
    requests: u32,
    written: u32,
    reserved: u32,
}

/// `struct dmlc_reply`: what a response of feature bit 1 adds.
#[repr(C)]
#[derive(Default, Clone, Copy, Debug, PartialEq, Eq)]
struct KReply {
    length: u64,
    comm: u32,
    comm_rank: u32,
    comm_size: u32,
    peer_world: u32,
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct Submit {
    argsz: u32,
    flags: u32,
    opcode: u16,
    dtype: u8,
    op: u8,
    root: u32,
    count: u64,
    tag: u64,
    timeout_ms: u32,
    queue: u32,
    in_iov: u64,
    out_iov: u64,
    in_cnt: u32,
    out_cnt: u32,
    user_data: u64,
    spin_us: u32,
    wait_ms: u32,
    id: u64,
    done: KCompletion,
    // Added with feature bit 1 (a module without it reads 0 past its size).
    comm: u32,
    peer: u32,
    key: u32,
    table_bytes: u32,
    /// User pointer to `table_bytes` bytes of table.
    table: u64,
    reply: KReply,
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct Wait {
    argsz: u32,
    flags: u32,
    id: u64,
    timeout_ms: u32,
    spin_us: u32,
    done: KCompletion,
    reply: KReply,
}

// The layouts of kernel-driver/include/uapi/virtio_dmlc.h (x86-64 and every
// other 64-bit ABI: no padding in any of them), which the module checks
// with the same numbers (BUILD_BUG_ON in dmlc_probe). The offsets of the
// first added fields are the sizes of the first version of each struct,
// which the module still accepts.
const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<Iovec>() == 16);
    assert!(size_of::<KCompletion>() == 48);
    assert!(size_of::<KReply>() == 24);
    assert!(size_of::<Info>() == 112);
    assert!(offset_of!(Info, max_comms) == 104);
    assert!(size_of::<Submit>() == 184);
    assert!(offset_of!(Submit, id) == 80);
    assert!(offset_of!(Submit, done) == 88);
    assert!(offset_of!(Submit, comm) == 136);
    assert!(offset_of!(Submit, table) == 152);
    assert!(offset_of!(Submit, reply) == 160);
    assert!(size_of::<Wait>() == 96);
    assert!(offset_of!(Wait, done) == 24);
    assert!(offset_of!(Wait, reply) == 72);
};

/// The argsz of an ioctl struct.
fn argsz<T>() -> u32 {
    std::mem::size_of::<T>() as u32
}

/// One ioctl; the errno on failure.
fn ioctl_once<T>(file: &File, cmd: libc::c_ulong, arg: &mut T) -> std::io::Result<()> {
    // SAFETY: `arg` is a live, writable `#[repr(C)]` struct of the layout
    // the module expects for `cmd`, and starts with its argsz; the module
    // writes back at most argsz bytes. The user pointers inside it (a
    // submit's iovec arrays and table) are the callers' live slices of the
    // lengths they give, and the module reads them within this call.
    let r = unsafe { libc::ioctl(file.as_raw_fd(), cmd, std::ptr::from_mut(arg)) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// One ioctl that may be repeated, retried on EINTR (not SUBMIT: an
/// interrupted SUBMIT has submitted already).
fn ioctl<T>(file: &File, cmd: libc::c_ulong, arg: &mut T) -> std::io::Result<()> {
    loop {
        match ioctl_once(file, cmd, arg) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            r => return r,
        }
    }
}

fn read_info(file: &File) -> std::result::Result<Info, TransportError> {
    let mut info = Info {
        argsz: argsz::<Info>(),
        ..Info::default()
    };
    ioctl(file, IOC_INFO, &mut info).map_err(|source| TransportError::Io {
        during: "DMLC_IOC_INFO",
        source,
    })?;
    Ok(info)
}

/// True if the module negotiated feature bit 1 (communicators).
fn has_comm(info: &Info) -> bool {
    info.features & (1 << VIRTIO_DMLC_F_COMM) != 0
}

/// The config space as the module read it (generation and group id afresh).
fn config_of(info: &Info) -> VirtioDmlcConfig {
    VirtioDmlcConfig {
        rank: info.rank.into(),
        world_size: info.world_size.into(),
        num_queues: info.num_queues.into(),
        max_segments: info.max_segments.into(),
        max_bytes: info.max_bytes.into(),
        dtypes: info.dtypes.into(),
        ops: info.ops.into(),
        opcodes: info.opcodes.into(),
        generation: info.generation.into(),
        group_id: info.group_id.into(),
    }
}

/// The config space's bytes as the device shows them: with feature bit 1,
/// `max_comms` after the fields of 5.X.4 (spec 5.X.6.13.1).
fn config_bytes(info: &Info) -> Vec<u8> {
    let base = config_of(info);
    if has_comm(info) {
        VirtioDmlcConfigComm {
            base,
            max_comms: info.max_comms.into(),
            reserved: 0.into(),
        }
        .as_bytes()
        .to_vec()
    } else {
        base.as_bytes().to_vec()
    }
}

/// What [`Device`] reaches through the [`Transport`] trait: the config
/// space (through `DMLC_IOC_INFO`). The module sets up the queues itself.
struct KernelTransport {
    file: Arc<File>,
    features: u64,
    queues: u16,
}

impl Transport for KernelTransport {
    fn device_features(&self) -> u64 {
        self.features
    }

    fn negotiate(&mut self, _features: u64) -> std::result::Result<(), TransportError> {
        Ok(()) // the module negotiated at probe
    }

    fn max_queues(&self) -> u16 {
        self.queues
    }

    fn max_queue_size(&self, _queue: u16) -> u16 {
        0
    }

    fn read_config(
        &self,
        offset: usize,
        buf: &mut [u8],
    ) -> std::result::Result<(), TransportError> {
        let raw = config_bytes(&read_info(&self.file)?);
        let end = offset
            .checked_add(buf.len())
            .filter(|&e| e <= raw.len())
            .ok_or(TransportError::Unsupported(
                "a config read past the config space",
            ))?;
        buf.copy_from_slice(&raw[offset..end]);
        Ok(())
    }

    fn setup_queue(&mut self, _: u16, _: &QueueAddrs) -> std::result::Result<(), TransportError> {
        Err(TransportError::Unsupported(
            "queue set-up by the driver library",
        ))
    }

    fn driver_ok(&mut self) -> std::result::Result<(), TransportError> {
        Ok(())
    }

    fn notify(&self, _queue: u16) -> std::result::Result<(), TransportError> {
        Err(TransportError::Unsupported(
            "notifications by the driver library",
        ))
    }

    fn wait_interrupt(
        &self,
        _queue: u16,
        _timeout: Option<Duration>,
    ) -> std::result::Result<bool, TransportError> {
        Err(TransportError::Unsupported(
            "interrupts in the driver library",
        ))
    }

    fn check_alive(&self) -> std::result::Result<(), TransportError> {
        Ok(())
    }

    fn reset(&mut self) -> std::result::Result<(), TransportError> {
        Ok(()) // closing the file resets the device if it still holds buffers
    }
}

/// How a waiter waits in the module: spin this long, then sleep.
#[derive(Clone, Copy, Debug)]
enum Spin {
    /// Until done (or the wait's limit).
    Poll,
    /// Up to this long.
    For(Duration),
}

/// The kernel side of a [`Device`] opened with [`open`].
pub(crate) struct KernelFile {
    file: Arc<File>,
    queues: u16,
    spin: Spin,
    /// The module negotiated feature bit 1: its completions carry a reply.
    comm: bool,
    /// Each collective's holds on its buffers, by the module's id.
    leases: Mutex<HashMap<u64, Vec<Lease>>>,
    /// Where buffers over the caller's own memory come from
    /// ([`Device::wrap_caller_memory`]): the module pins any user page.
    pub(crate) caller: Arc<dyn DmaMemory>,
}

/// Opens the device node `node` (default [`DEFAULT_NODE`]).
pub fn open(node: Option<&Path>, opts: &OpenOptions) -> Result<Device> {
    let node = node.unwrap_or(Path::new(DEFAULT_NODE));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(node)
        .map_err(|source| {
            Error::Transport(TransportError::Connect {
                path: format!(
                    "{} (the virtio_dmlc module's device node; is the module loaded, and is \
                     this user in the node's group?{})",
                    node.display(),
                    if source.raw_os_error() == Some(libc::EBUSY) {
                        " EBUSY: another process has it open"
                    } else {
                        ""
                    }
                ),
                source,
            })
        })?;
    let info = read_info(&file)?;
    if info.abi_version != ABI_VERSION {
        return Err(Error::BadConfig(format!(
            "{} speaks ioctl ABI {}, this library {ABI_VERSION}",
            node.display(),
            info.abi_version
        )));
    }
    let mut queues = u16::try_from(info.num_queues).unwrap_or(u16::MAX);
    if opts.max_queues > 0 {
        queues = queues.min(opts.max_queues);
    }
    let file = Arc::new(file);
    let transport = KernelTransport {
        file: file.clone(),
        features: info.features,
        queues,
    };
    let spin = if opts.poll {
        Spin::Poll
    } else {
        Spin::For(opts.spin_cap)
    };
    let mem: Arc<dyn DmaMemory> = Arc::new(MemfdMemory::at_own_addresses(opts.dma_bytes)?);
    let kernel = KernelFile {
        file,
        queues,
        spin,
        comm: has_comm(&info),
        leases: Mutex::new(HashMap::new()),
        caller: Arc::new(CallerMemory),
    };
    Device::over_kernel(Box::new(transport), mem, config_of(&info), kernel, opts)
}

/// The data descriptors of a standard chain as two iovec lists.
fn iovecs(chain: &[RawDesc]) -> Result<(Vec<Iovec>, Vec<Iovec>)> {
    let (mut input, mut output) = (Vec::new(), Vec::new());
    let n = chain.len();
    let standard =
        n >= 2 && matches!(chain[0], RawDesc::Header) && matches!(chain[n - 1], RawDesc::Response);
    if !standard {
        return Err(Error::InvalidArgument(
            "the kernel transport takes only [header, inputs, outputs, response] chains: the \
             module builds every chain itself"
                .into(),
        ));
    }
    for d in &chain[1..n - 1] {
        let (list, s) = match d {
            RawDesc::Read(s) if output.is_empty() => (&mut input, s),
            RawDesc::Write(s) => (&mut output, s),
            _ => {
                return Err(Error::InvalidArgument(
                    "the kernel transport takes inputs before outputs, and one header and \
                     response"
                        .into(),
                ))
            }
        };
        if s.is_empty() {
            continue;
        }
        s.device_ranges(&mut |addr, len| {
            list.push(Iovec {
                addr,
                len: len as u64,
            })
        });
    }
    Ok((input, output))
}

fn us(d: Duration) -> u32 {
    u32::try_from(d.as_micros()).unwrap_or(u32::MAX)
}

fn ms_ceil(d: Duration) -> u32 {
    u32::try_from(d.as_micros().div_ceil(1000))
        .unwrap_or(u32::MAX)
        .max(1)
}

fn os_error(during: &'static str, errno: i32) -> Error {
    Error::Transport(TransportError::Io {
        during,
        source: std::io::Error::from_raw_os_error(errno),
    })
}

/// A collective the module ended itself (not a device status).
fn driver_error(errno: i32) -> Error {
    match errno {
        libc::ECONNRESET => Error::Reset,
        libc::ENODEV => Error::Transport(TransportError::Disconnected {
            during: "a collective (the device was removed)",
        }),
        libc::E2BIG => Error::TooBig {
            detail: too_big::SEGMENTS,
        },
        libc::EIO => Error::NoStatus,
        e => os_error("a collective in the kernel driver", e),
    }
}

impl KernelFile {
    pub(crate) fn num_queues(&self) -> u16 {
        self.queues
    }

    /// The module's spin bound for a wait that may last `limit`.
    fn spin_us(&self, limit: Option<Duration>) -> u32 {
        match self.spin {
            Spin::Poll => limit.map_or(u32::MAX, us),
            Spin::For(d) => us(limit.map_or(d, |l| l.min(d))),
        }
    }

    /// Submits `chain` (a standard one) under `header`; with `wait`,
    /// blocks until it is done or the deadline (`None` inside: no limit)
    /// passes and returns its outcome too, in one system call when nothing
    /// interrupts it.
    pub(crate) fn submit(
        &self,
        queue: u16,
        header: &Header<'_>,
        chain: &[RawDesc],
        leases: Vec<Lease>,
        wait: Option<Option<Instant>>,
    ) -> Result<(Handle, Option<Result<Done>>)> {
        if queue >= self.queues {
            return Err(Error::InvalidArgument(format!(
                "queue {queue} does not exist (device has {})",
                self.queues
            )));
        }
        let (input, output) = iovecs(chain)?;
        // `input`, `output` and the header's table outlive the ioctl below.
        let mut s = submit_args(queue, header, &input, &output)?;
        if let Some(deadline) = wait {
            let limit = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            s.flags |= SUBMIT_WAIT;
            s.spin_us = self.spin_us(limit);
            s.wait_ms = limit.map_or(0, ms_ceil);
        }
        let submitted = ioctl_once(&self.file, IOC_SUBMIT, &mut s);
        if s.id == 0 {
            // Nothing was submitted.
            let errno = submitted.err().and_then(|e| e.raw_os_error()).unwrap_or(0);
            return Err(match errno {
                libc::E2BIG => Error::TooBig {
                    detail: too_big::SEGMENTS,
                },
                libc::EBUSY => Error::QueueFull,
                libc::ENODEV => Error::Transport(TransportError::Disconnected {
                    during: "DMLC_IOC_SUBMIT (the device was removed)",
                }),
                // A communicator's fields where the module did not
                // negotiate bit 1 ([`Device`] sends them only where it did).
                libc::EOPNOTSUPP => Error::Unsupported {
                    detail: unsupported::OPCODE,
                },
                errno => os_error("DMLC_IOC_SUBMIT", errno),
            });
        }
        let handle = Handle::kernel(queue, s.id);
        let errno = submitted.err().map(|e| e.raw_os_error().unwrap_or(0));
        match (wait, errno) {
            (None, None) => {
                self.keep(s.id, leases);
                Ok((handle, None))
            }
            (Some(_), None) => {
                drop(leases); // the module is done with every buffer
                Ok((handle, Some(self.outcome(&s.done, &s.reply))))
            }
            // Submitted, but the wait ended early: wait again, as a
            // separate call, until the caller's deadline.
            (Some(deadline), Some(libc::EINTR | libc::ETIMEDOUT)) => {
                self.keep(s.id, leases);
                Ok((handle, Some(self.wait(handle, deadline))))
            }
            (_, Some(errno)) => {
                self.keep(s.id, leases);
                Err(os_error("DMLC_IOC_SUBMIT", errno))
            }
        }
    }

    fn keep(&self, id: u64, leases: Vec<Lease>) {
        self.leases
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, leases);
    }

    /// Waits for `h` until `deadline`.
    pub(crate) fn wait(&self, h: Handle, deadline: Option<Instant>) -> Result<Done> {
        let r = loop {
            let limit = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if limit.is_some_and(|l| l.is_zero()) {
                return Err(Error::WaitTimeout);
            }
            let mut w = Wait {
                argsz: argsz::<Wait>(),
                id: h.serial(),
                timeout_ms: limit.map_or(0, ms_ceil),
                spin_us: self.spin_us(limit),
                ..Wait::default()
            };
            match ioctl_once(&self.file, IOC_WAIT, &mut w) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                r => break r.map(|()| (w.done, w.reply)),
            }
        };
        match r {
            Ok((done, reply)) => {
                self.leases
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&h.serial());
                self.outcome(&done, &reply)
            }
            Err(e) => Err(match e.raw_os_error().unwrap_or(0) {
                libc::ETIMEDOUT => Error::WaitTimeout,
                libc::ENOENT => Error::UnknownHandle,
                errno => os_error("DMLC_IOC_WAIT", errno),
            }),
        }
    }

    /// The outcome of a completion the module reported, with its reply
    /// where the module negotiated feature bit 1.
    fn outcome(&self, c: &KCompletion, reply: &KReply) -> Result<Done> {
        outcome(c, self.comm.then_some(reply))
    }

    /// True if `h` is done (its result waits in [`Self::wait`]).
    pub(crate) fn is_done(&self, h: Handle) -> Result<bool> {
        let mut w = Wait {
            argsz: argsz::<Wait>(),
            flags: WAIT_PEEK,
            id: h.serial(),
            ..Wait::default()
        };
        match ioctl(&self.file, IOC_WAIT, &mut w) {
            Ok(()) => Ok(true),
            Err(e) => match e.raw_os_error().unwrap_or(0) {
                libc::EAGAIN => Ok(false),
                libc::ENOENT => Err(Error::UnknownHandle),
                errno => Err(os_error("DMLC_IOC_WAIT", errno)),
            },
        }
    }
}

/// The arguments of `DMLC_IOC_SUBMIT` for `header` over these iovecs (not
/// yet the wait's): pointers into `input`, `output` and the header's
/// table, which must outlive the ioctl.
fn submit_args(
    queue: u16,
    header: &Header<'_>,
    input: &[Iovec],
    output: &[Iovec],
) -> Result<Submit> {
    let base = header.base();
    let pieces = |v: &[Iovec]| {
        u32::try_from(v.len()).map_err(|_| {
            Error::InvalidArgument(format!("{} buffer pieces in one request", v.len()))
        })
    };
    let mut s = Submit {
        argsz: argsz::<Submit>(),
        flags: if base.flags.get() & virtio_dmlc::FLAG_IN_PLACE != 0 {
            SUBMIT_IN_PLACE
        } else {
            0
        },
        opcode: base.opcode.get(),
        dtype: base.dtype,
        op: base.op,
        root: base.root.get(),
        count: base.count.get(),
        tag: base.tag.get(),
        timeout_ms: base.timeout_ms.get(),
        queue: u32::from(queue),
        in_iov: input.as_ptr() as u64,
        out_iov: output.as_ptr() as u64,
        in_cnt: pieces(input)?,
        out_cnt: pieces(output)?,
        ..Submit::default()
    };
    if let Header::Comm(h, table) = header {
        s.comm = h.comm.get();
        s.peer = h.peer.get();
        s.key = h.key.get();
        // The module copies this many bytes from `table`: its length, not
        // the header's word for it (which [`Device`] makes equal).
        debug_assert_eq!(h.table_bytes.get() as usize, table.len());
        s.table_bytes = u32::try_from(table.len())
            .map_err(|_| Error::InvalidArgument(format!("a table of {} bytes", table.len())))?;
        s.table = if table.is_empty() {
            0
        } else {
            table.as_ptr() as u64
        };
    }
    Ok(s)
}

/// The outcome of a completion the module reported; `reply` with feature
/// bit 1 (its fields become [`Reply`]'s, as over the other transports).
fn outcome(c: &KCompletion, reply: Option<&KReply>) -> Result<Done> {
    if c.error != 0 {
        return Err(driver_error(-c.error));
    }
    let resp = VirtioDmlcResp {
        status: c.status.into(),
        detail: c.detail.into(),
        peer: c.peer.into(),
        generation: c.generation.into(),
    };
    let (resp_size, reply) = match reply {
        Some(r) => (
            RESP_COMM_SIZE,
            Reply {
                length: r.length,
                comm: r.comm,
                comm_rank: r.comm_rank,
                comm_size: r.comm_size,
                peer: c.peer,
                peer_world: r.peer_world,
            },
        ),
        None => (RESP_SIZE, Reply::default()),
    };
    crate::device::completion_result(&Completion {
        len: c.written.max(resp_size as u32),
        resp,
        has_resp: true,
        reply,
    })
}

#[cfg(test)]
mod tests {
    use virtio_dmlc::comm::{CommOpcode, VirtioDmlcReqComm, ANY_SOURCE};
    use virtio_dmlc::{Opcode, VirtioDmlcReq, CONFIG_SIZE, STATUS_TRUNCATE};

    use super::*;

    fn info(features: u64) -> Info {
        Info {
            rank: 1,
            world_size: 3,
            num_queues: 2,
            max_segments: 64,
            group_id: 0x1234,
            features,
            max_comms: 9,
            ..Info::default()
        }
    }

    #[test]
    fn the_config_space_has_max_comms_only_with_bit_1() {
        let with = config_bytes(&info(1 << VIRTIO_DMLC_F_COMM));
        assert_eq!(with.len(), std::mem::size_of::<VirtioDmlcConfigComm>());
        assert_eq!(&with[0x30..0x34], &9u32.to_le_bytes());
        assert_eq!(&with[..CONFIG_SIZE], config_of(&info(0)).as_bytes());
        let without = config_bytes(&info(0));
        assert_eq!(without.len(), CONFIG_SIZE);
    }

    fn base(opcode: u16, count: u64) -> VirtioDmlcReq {
        VirtioDmlcReq {
            opcode: opcode.into(),
            dtype: 0,
            op: 0,
            root: 2.into(),
            count: count.into(),
            tag: 77.into(),
            flags: 0.into(),
            timeout_ms: 500.into(),
        }
    }

    #[test]
    fn a_comm_header_fills_the_added_fields_and_a_base_one_leaves_them_0() {
        let input = [Iovec {
            addr: 0x1000,
            len: 8,
        }];
        let s = submit_args(3, &Header::Base(base(0, 2)), &input, &[]).unwrap();
        assert_eq!(s.argsz, 184);
        assert_eq!((s.opcode, s.root, s.count, s.tag), (0, 2, 2, 77));
        assert_eq!((s.timeout_ms, s.queue, s.in_cnt, s.out_cnt), (500, 3, 1, 0));
        assert_eq!(s.in_iov, input.as_ptr() as u64);
        assert_eq!(
            (s.comm, s.peer, s.key, s.table_bytes, s.table),
            (0, 0, 0, 0, 0)
        );

        let table = [1u8, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0];
        let h = VirtioDmlcReqComm {
            base: base(CommOpcode::Gatherv.raw(), 1),
            comm: 5.into(),
            peer: ANY_SOURCE.into(),
            key: 4.into(),
            table_bytes: (table.len() as u32).into(),
        };
        let s = submit_args(0, &Header::Comm(h, &table), &[], &input).unwrap();
        assert_eq!(s.opcode, CommOpcode::Gatherv.raw());
        assert_eq!((s.comm, s.peer, s.key), (5, ANY_SOURCE, 4));
        assert_eq!((s.table_bytes, s.table), (16, table.as_ptr() as u64));
        assert_eq!((s.in_cnt, s.out_cnt), (0, 1));

        // A comm header without a table passes no table pointer.
        let h = VirtioDmlcReqComm {
            base: base(Opcode::Allreduce.raw(), 1),
            ..VirtioDmlcReqComm::default()
        };
        let s = submit_args(0, &Header::Comm(h, &[]), &[], &[]).unwrap();
        assert_eq!((s.table_bytes, s.table), (0, 0));
    }

    fn completion(status: u32, peer: u32) -> KCompletion {
        KCompletion {
            status,
            peer,
            generation: 4,
            written: 40 + 12,
            ..KCompletion::default()
        }
    }

    const REPLY: KReply = KReply {
        length: 12,
        comm: 7,
        comm_rank: 1,
        comm_size: 2,
        peer_world: 3,
    };

    #[test]
    fn a_completion_with_bit_1_carries_the_reply_as_the_rings_do() {
        let done = outcome(&completion(0, 1), Some(&REPLY)).unwrap();
        assert_eq!((done.generation, done.written), (4, 52));
        assert_eq!(
            done.reply,
            Reply {
                length: 12,
                comm: 7,
                comm_rank: 1,
                comm_size: 2,
                peer: 1,
                peer_world: 3,
            }
        );
        // A truncation names the other end's size and rank.
        match outcome(&completion(STATUS_TRUNCATE, 1), Some(&REPLY)) {
            Err(Error::Truncated { length, peer }) => assert_eq!((length, peer), (12, 1)),
            other => panic!("{other:?}"),
        }
        // Without bit 1 the reply is all 0, as over the rings.
        let done = outcome(&completion(0, 1), None).unwrap();
        assert_eq!(done.reply, Reply::default());
        // A collective the module ended has no device status.
        let ended = KCompletion {
            error: -libc::ECONNRESET,
            ..completion(0, 1)
        };
        assert!(matches!(outcome(&ended, Some(&REPLY)), Err(Error::Reset)));
    }
}
