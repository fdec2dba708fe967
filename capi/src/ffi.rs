//! C ABI of the driver; `include/dmlc_guest.h` declares it.
//!
//! Objects are opaque boxes handed to C: [`DmlcDevice`] (an `Arc<Device>`
//! plus a bounce buffer), [`DmlcBuffer`] (a [`DmaBuf`] holding a reference
//! to its device, so buffers may outlive `dmlc_close`) and [`DmlcHandle`]
//! (a submitted request). Every function checks its pointers, returns a
//! `dmlc_status` code, records a one-line description of any failure in a
//! thread-local string (`dmlc_last_error_message`), and catches panics so
//! that none unwinds into C.

use std::cell::{Cell, RefCell};
use std::ffi::{c_char, c_int, c_void, CStr, CString, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use virtio_dmlc::{
    bad, mismatch, unsupported, Dtype, Opcode, ReduceOp, FLAGS_KNOWN, FLAG_IN_PLACE, NO_PEER,
};

use crate::ffi_util::{self, guard_value, Codes, Fail};
use dmlc_cli_support::error_text;
use dmlc_comm::rabit::{self, Config, RabitError, TransportKind};
use dmlc_driver::bounce::Bounce;
use dmlc_driver::device::Wait;
use dmlc_driver::Error;
use dmlc_driver::{BufSlice, Device, DmaBuf, Handle, OpenOptions, Request};

// Opening from a job's environment, the collectives on ordinary memory,
// communicators and the requests of spec 5.X.6.13 on device buffers, and
// those on ordinary memory, each in its own file.
mod comm;
mod comm_host;
mod env;
mod host;
pub use comm::*;
pub use comm_host::*;
pub use env::{dmlc_open_env, dmlc_reaches_any_memory, dmlc_set_check_finite, dmlc_set_tag};
pub use host::{
    dmlc_allgather_host, dmlc_allreduce_host, dmlc_broadcast_host, dmlc_reduce_host,
    dmlc_reduce_scatter_host,
};

/// `DMLC_ABI_VERSION` of dmlc_guest.h: raised with every change of a
/// function, struct, constant or status (tests/c checks the two agree).
/// 2: communicators, send and receive, all-to-all, gather and scatter
/// (spec 5.X.6.13), `DMLC_ERR_TRUNCATE` reported, the mismatch mask's
/// table bit.
pub const DMLC_ABI_VERSION: u32 = 1;

/// The ABI version this library was built with.
#[no_mangle]
pub extern "C" fn dmlc_abi_version() -> u32 {
    DMLC_ABI_VERSION
}

/// The library's release: static text.
#[no_mangle]
pub extern "C" fn dmlc_version() -> *const c_char {
    // A static, NUL-terminated copy of the crate's version.
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

// Status codes (dmlc_status in the header). 0..=7 are the device's.
pub const DMLC_OK: c_int = 0;
pub const DMLC_ERR_INVALID_ARGUMENT: c_int = 100;
pub const DMLC_ERR_NO_STATUS: c_int = 101;
pub const DMLC_ERR_UNKNOWN_STATUS: c_int = 102;
pub const DMLC_ERR_WAIT_TIMEOUT: c_int = 103;
pub const DMLC_ERR_QUEUE_FULL: c_int = 104;
pub const DMLC_ERR_OUT_OF_MEMORY: c_int = 105;
pub const DMLC_ERR_UNKNOWN_HANDLE: c_int = 106;
pub const DMLC_ERR_TRANSPORT: c_int = 107;
pub const DMLC_ERR_DEVICE: c_int = 108;
pub const DMLC_ERR_INTERNAL: c_int = 109;
pub const DMLC_ERR_UNANSWERED: c_int = 110;
pub const DMLC_ERR_REQUEST_DROPPED: c_int = 111;
pub const DMLC_ERR_BUFFER_BUSY: c_int = 112;
pub const DMLC_ERR_ENVIRONMENT: c_int = 113;

/// An open device (`dmlc_device`).
pub struct DmlcDevice {
    dev: Arc<Device>,
    /// Bounce buffer of `dmlc_allreduce_host`.
    bounce: Mutex<Bounce>,
    /// Staging buffer of the operations of spec 5.X.6.13 on ordinary
    /// memory and of the collectives on other communicators than 0.
    stage: Mutex<comm_host::Stage>,
    /// The bounce buffer's chunk size (`dmlc_host_chunk_bytes`).
    chunk: usize,
    /// The device's `max_bytes`, read once (it never changes in a group).
    max_bytes: u64,
}

/// A device-visible buffer (`dmlc_buffer`).
pub struct DmlcBuffer {
    dev: Arc<Device>,
    buf: DmaBuf,
    /// Start of the memory, taken once from a unique borrow so that C may
    /// write through it.
    data: *mut u8,
}

/// A submitted request (`dmlc_handle`).
pub struct DmlcHandle {
    dev: Arc<Device>,
    handle: Handle,
}

/// `dmlc_config`: the config space with native integers.
#[repr(C)]
pub struct DmlcConfig {
    pub rank: u32,
    pub world_size: u32,
    pub num_queues: u32,
    pub max_segments: u32,
    pub max_bytes: u64,
    pub dtypes: u32,
    pub ops: u32,
    pub opcodes: u32,
    pub generation: u32,
    pub group_id: u64,
}

/// `dmlc_open_options.poll` for the hybrid wait (the default): spin up to
/// `HYBRID_SPIN_CAP` while recent waits mostly ended within it, then sleep
/// on the interrupt. 0 sleeps at once; any other value busy-polls.
pub const DMLC_WAIT_HYBRID: c_int = Wait::Hybrid.code();

/// The `dmlc_open_options.poll` value that stands for `o`'s wait.
fn wait_field(o: &OpenOptions) -> c_int {
    o.wait_kind().code()
}

/// `dmlc_open_options`.
#[repr(C)]
pub struct DmlcOpenOptions {
    pub poll: c_int,
    pub queue_size: u16,
    pub event_idx: c_int,
    pub dma_bytes: u64,
}

/// `dmlc_request`: the header fields of `VirtioDmlcReq` with native integers.
#[repr(C)]
pub struct DmlcRequest {
    pub opcode: u16,
    pub dtype: u8,
    pub op: u8,
    pub root: u32,
    pub count: u64,
    pub tag: u64,
    pub flags: u32,
    pub timeout_ms: u32,
}

/// `dmlc_segment`.
#[repr(C)]
pub struct DmlcSegment {
    pub buf: *const DmlcBuffer,
    pub offset: usize,
    pub len: usize,
}

/// `dmlc_completion`.
#[repr(C)]
pub struct DmlcCompletion {
    pub status: c_int,
    pub detail: u32,
    pub peer: u32,
    pub generation: u32,
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
    /// (status, detail, peer, length) of this thread's last failed call,
    /// for the calls that return only a status
    /// (`dmlc_last_error_completion`, `dmlc_last_error_length`).
    static LAST_REPORT: Cell<Report> = const { Cell::new((DMLC_OK, 0, NO_PEER, 0)) };
}

/// (status, detail, peer, length) of a failed call.
type Report = (c_int, u32, u32, u64);

impl Fail {
    fn invalid(msg: impl Into<String>) -> Self {
        Fail {
            status: DMLC_ERR_INVALID_ARGUMENT,
            msg: msg.into(),
        }
    }
}

impl From<Error> for Fail {
    fn from(e: Error) -> Self {
        // The device's detail and peer go only into the report: the
        // status and message are what every call returns.
        let (detail, peer) = detail_of(&e);
        let length = match e {
            Error::Truncated { length, .. } => length,
            Error::NonFinite { index, .. } => index,
            _ => 0,
        };
        LAST_REPORT.with(|r| r.set((status_of(&e), detail, peer, length)));
        Fail {
            status: status_of(&e),
            msg: error_text(&e),
        }
    }
}

/// The `dmlc_status` of a driver error.
fn status_of(e: &Error) -> c_int {
    #[allow(unreachable_patterns)] // future variants map to DEVICE
    match e {
        Error::BadRequest { .. } => virtio_dmlc::STATUS_BAD_REQUEST as c_int,
        Error::Mismatch { .. } => virtio_dmlc::STATUS_MISMATCH as c_int,
        Error::PeerLost { .. } => virtio_dmlc::STATUS_PEER_LOST as c_int,
        Error::Timeout { .. } => virtio_dmlc::STATUS_TIMEOUT as c_int,
        Error::Unsupported { .. } => virtio_dmlc::STATUS_UNSUPPORTED as c_int,
        Error::TooBig { .. } => virtio_dmlc::STATUS_TOO_BIG as c_int,
        Error::Reset => virtio_dmlc::STATUS_RESET as c_int,
        Error::Truncated { .. } => virtio_dmlc::STATUS_TRUNCATE as c_int,
        Error::NonFinite { .. } => virtio_dmlc::STATUS_NONFINITE as c_int,
        Error::NoStatus => DMLC_ERR_NO_STATUS,
        Error::UnknownStatus { .. } => DMLC_ERR_UNKNOWN_STATUS,
        Error::WaitTimeout => DMLC_ERR_WAIT_TIMEOUT,
        Error::QueueFull => DMLC_ERR_QUEUE_FULL,
        Error::OutOfDmaMemory => DMLC_ERR_OUT_OF_MEMORY,
        Error::UnknownHandle => DMLC_ERR_UNKNOWN_HANDLE,
        Error::InvalidArgument(_) => DMLC_ERR_INVALID_ARGUMENT,
        Error::Transport(_) => DMLC_ERR_TRANSPORT,
        Error::Unanswered { .. } => DMLC_ERR_UNANSWERED,
        Error::RequestDropped { .. } => DMLC_ERR_REQUEST_DROPPED,
        Error::BufferBusy { .. } => DMLC_ERR_BUFFER_BUSY,
        Error::BadConfig(_) | Error::Queue(_) | Error::Dma(_) => DMLC_ERR_DEVICE,
        _ => DMLC_ERR_DEVICE,
    }
}

/// (detail, peer) of a driver error, as the device reported them.
fn detail_of(e: &Error) -> (u32, u32) {
    match e {
        Error::BadRequest { detail, .. }
        | Error::Unsupported { detail }
        | Error::TooBig { detail } => (*detail, NO_PEER),
        Error::Mismatch { fields, peer } => {
            let names: Vec<&str> = fields.split(", ").collect();
            let mask = (0..7)
                .map(|b| 1u32 << b)
                .filter(|&bit| mismatch::fields(bit).any(|n| names.contains(&n)))
                .fold(0, |m, b| m | b);
            (mask, *peer)
        }
        Error::PeerLost { peer } | Error::Timeout { peer } | Error::Truncated { peer, .. } => {
            (0, *peer)
        }
        Error::NonFinite { rank, .. } => (0, *rank),
        _ => (0, NO_PEER),
    }
}

/// Runs `f`, turning failures and panics into a status code; a failure
/// not made from a device error is reported without detail or peer.
fn guard(f: impl FnOnce() -> Result<(), Fail>) -> c_int {
    let codes = Codes {
        ok: DMLC_OK,
        internal: DMLC_ERR_INTERNAL,
    };
    let before = LAST_REPORT.with(|r| r.replace((DMLC_OK, 0, NO_PEER, 0)));
    let status = ffi_util::guard(&LAST_ERROR, codes, f);
    LAST_REPORT.with(|r| match status {
        DMLC_OK => r.set(before),
        s if r.get().0 != s => r.set((s, 0, NO_PEER, 0)),
        _ => {}
    });
    status
}

/// The status, device detail and peer of this thread's last failed call
/// (`DMLC_OK` and `DMLC_NO_PEER` if none failed yet); `generation` is 0.
/// For calls that return only a status, such as the host forms.
///
/// # Safety
///
/// `out` is NULL (nothing is written) or writable for one `dmlc_completion`.
#[no_mangle]
pub unsafe extern "C" fn dmlc_last_error_completion(out: *mut DmlcCompletion) {
    let (status, detail, peer, _) = LAST_REPORT.with(Cell::get);
    // SAFETY: `out` is NULL or writable per the contract.
    if let Some(o) = unsafe { out.as_mut() } {
        *o = DmlcCompletion {
            status,
            detail,
            peer,
            generation: 0,
        };
    }
}

/// The length of this thread's last failed call's `DMLC_ERR_TRUNCATE`, in
/// bytes (a send: the receive's room; a receive: the message's size); 0
/// if that call failed otherwise or none failed.
#[no_mangle]
pub extern "C" fn dmlc_last_error_length() -> u64 {
    LAST_REPORT.with(Cell::get).3
}

/// Borrows a device pointer from C.
///
/// # Safety
///
/// `p` is NULL or a pointer returned by `dmlc_open_host*` and not yet closed.
unsafe fn device<'a>(p: *const DmlcDevice) -> Result<&'a DmlcDevice, Fail> {
    // SAFETY: per this function's contract, a non-NULL `p` points to a live
    // DmlcDevice that C does not free during the call.
    unsafe { p.as_ref() }.ok_or_else(|| Fail::invalid("device is NULL"))
}

/// Borrows an optional buffer of `dev` from C.
///
/// # Safety
///
/// `p` is NULL or a pointer returned by `dmlc_alloc` and not yet freed.
unsafe fn buffer<'a>(
    dev: &DmlcDevice,
    p: *const DmlcBuffer,
    what: &str,
) -> Result<Option<&'a DmlcBuffer>, Fail> {
    // SAFETY: per this function's contract, a non-NULL `p` points to a live
    // DmlcBuffer.
    let Some(b) = (unsafe { p.as_ref() }) else {
        return Ok(None);
    };
    if !Arc::ptr_eq(&b.dev, &dev.dev) {
        return Err(Fail::invalid(format!(
            "{what} buffer belongs to another device"
        )));
    }
    Ok(Some(b))
}

fn dtype_of(raw: c_int) -> Result<Dtype, Fail> {
    u8::try_from(raw)
        .ok()
        .and_then(Dtype::from_raw)
        .ok_or_else(|| Fail {
            status: virtio_dmlc::STATUS_UNSUPPORTED as c_int,
            msg: format!("unsupported by the device: unknown dtype {raw}"),
        })
}

fn op_of(raw: c_int) -> Result<ReduceOp, Fail> {
    u8::try_from(raw)
        .ok()
        .and_then(ReduceOp::from_raw)
        .ok_or_else(|| Fail {
            status: virtio_dmlc::STATUS_UNSUPPORTED as c_int,
            msg: format!("unsupported by the device: unknown reduce op {raw}"),
        })
}

/// Runs one blocking collective on queue 0. `send` NULL or equal to
/// `recv` means in place.
///
/// # Safety
///
/// The pointers are NULL or live objects of this library.
unsafe fn collective(
    dev: *mut DmlcDevice,
    send: *const DmlcBuffer,
    recv: *mut DmlcBuffer,
    mut req: Request,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let d = unsafe { device(dev) }?;
        // SAFETY: as above.
        let send_buf = unsafe { buffer(d, send, "send") }?;
        // SAFETY: as above.
        let recv_buf = unsafe { buffer(d, recv, "recv") }?;
        if req.opcode.moves_data() && !req.op.supports(req.dtype) {
            return Err(Error::Unsupported {
                detail: unsupported::OP_FOR_DTYPE,
            }
            .into());
        }
        let world = d.dev.world_size();
        if matches!(req.opcode, Opcode::Broadcast | Opcode::Reduce) && req.root >= world {
            return Err(Fail {
                status: virtio_dmlc::STATUS_BAD_REQUEST as c_int,
                msg: format!(
                    "bad request: root {} is not below the world size {world}",
                    req.root
                ),
            });
        }
        req.in_place = send.is_null() || std::ptr::eq(send, recv);
        let input = if req.in_place {
            None
        } else {
            send_buf.map(|b| &b.buf)
        };
        d.dev.run(&req, input, recv_buf.map(|b| &b.buf))?;
        Ok(())
    })
}

/// Fills `*opts` with the defaults.
///
/// # Safety
///
/// `opts` is NULL or points to writable memory for a `dmlc_open_options`.
#[no_mangle]
pub unsafe extern "C" fn dmlc_open_options_init(opts: *mut DmlcOpenOptions) {
    guard_value((), || {
        let d = OpenOptions::default();
        // SAFETY: per the contract, a non-NULL `opts` is writable.
        if let Some(o) = unsafe { opts.as_mut() } {
            *o = DmlcOpenOptions {
                poll: wait_field(&d),
                queue_size: d.queue_size,
                event_idx: c_int::from(d.event_idx),
                dma_bytes: d.dma_bytes as u64,
            };
        }
    })
}

/// Opens the device behind a vhost-user socket (host transport).
///
/// # Safety
///
/// `socket` is NULL or a NUL-terminated string; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn dmlc_open_host(
    socket: *const c_char,
    poll: c_int,
    out: *mut *mut DmlcDevice,
) -> c_int {
    let opts = DmlcOpenOptions {
        poll,
        ..default_open_options()
    };
    // SAFETY: the caller's pointers are forwarded unchanged; `opts` is live.
    unsafe { dmlc_open_host_ex(socket, &opts, out) }
}

fn default_open_options() -> DmlcOpenOptions {
    let d = OpenOptions::default();
    DmlcOpenOptions {
        poll: wait_field(&d),
        queue_size: d.queue_size,
        event_idx: c_int::from(d.event_idx),
        dma_bytes: d.dma_bytes as u64,
    }
}

/// Opens the device with explicit options.
///
/// # Safety
///
/// `socket` is NULL or a NUL-terminated string; `opts` is NULL or points to
/// a `dmlc_open_options`; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn dmlc_open_host_ex(
    socket: *const c_char,
    opts: *const DmlcOpenOptions,
    out: *mut *mut DmlcDevice,
) -> c_int {
    guard(|| {
        if out.is_null() {
            return Err(Fail::invalid("out is NULL"));
        }
        // SAFETY: `out` is non-NULL and writable per the contract.
        unsafe { out.write(std::ptr::null_mut()) };
        if socket.is_null() {
            return Err(Fail::invalid("socket path is NULL"));
        }
        // SAFETY: `socket` is a NUL-terminated string per the contract.
        let path = Path::new(OsStr::from_bytes(
            unsafe { CStr::from_ptr(socket) }.to_bytes(),
        ));
        // SAFETY: `opts` is NULL or points to a dmlc_open_options.
        let options = unsafe { open_options(opts) }?;
        let dev = dmlc_driver::host::open(path, &options).map_err(|e| {
            let mut f = Fail::from(e);
            f.msg = format!("cannot open the device at {}: {}", path.display(), f.msg);
            f
        })?;
        // SAFETY: `out` is non-NULL and writable per the contract.
        unsafe { out.write(boxed_device(dev)) };
        Ok(())
    })
}

/// The driver's options from C's, checked.
///
/// # Safety
///
/// `opts` is NULL or points to a `dmlc_open_options`.
unsafe fn open_options(opts: *const DmlcOpenOptions) -> Result<OpenOptions, Fail> {
    // SAFETY: forwarded contract.
    let o = unsafe { opts.as_ref() }.ok_or_else(|| Fail::invalid("options are NULL"))?;
    // Any value that names no mode polls, as the header says.
    let wait = Wait::ALL
        .into_iter()
        .find(|w| w.code() == o.poll)
        .unwrap_or(Wait::Poll);
    Ok(OpenOptions {
        queue_size: o.queue_size,
        event_idx: o.event_idx != 0,
        dma_bytes: usize::try_from(o.dma_bytes)
            .map_err(|_| Fail::invalid("dma_bytes is too large"))?,
        ..OpenOptions::default()
    }
    .wait(wait))
}

fn boxed_device(dev: Device) -> *mut DmlcDevice {
    let bounce = Bounce::new(&dev);
    Box::into_raw(Box::new(DmlcDevice {
        chunk: bounce.chunk_bytes(),
        max_bytes: dev.config().max_bytes.get(),
        bounce: Mutex::new(bounce),
        stage: Mutex::new(comm_host::Stage::default()),
        dev: Arc::new(dev),
    }))
}

/// Opens the virtio-dmlc PCI device from inside a guest.
///
/// # Safety
///
/// `addr` is NULL (the first device) or a NUL-terminated PCI address such
/// as `0000:00:03.0`; `opts` is NULL or points to a `dmlc_open_options`;
/// `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn dmlc_open_pci(
    addr: *const c_char,
    opts: *const DmlcOpenOptions,
    out: *mut *mut DmlcDevice,
) -> c_int {
    guard(|| {
        if out.is_null() {
            return Err(Fail::invalid("out is NULL"));
        }
        // SAFETY: `out` is non-NULL and writable per the contract.
        unsafe { out.write(std::ptr::null_mut()) };
        let addr = if addr.is_null() {
            None
        } else {
            // SAFETY: `addr` is a NUL-terminated string per the contract.
            let a = unsafe { CStr::from_ptr(addr) };
            Some(
                a.to_str()
                    .map_err(|_| Fail::invalid("the PCI address is not UTF-8"))?
                    .to_owned(),
            )
        };
        // SAFETY: `opts` is NULL or points to a dmlc_open_options.
        let options = unsafe { open_options(opts) }?;
        let dev = dmlc_driver::pci::open(addr.as_deref(), &options).map_err(|e| {
            let mut f = Fail::from(e);
            let which = addr.as_deref().unwrap_or("(the first one)");
            f.msg = format!("cannot open the PCI device {which}: {}", f.msg);
            f
        })?;
        // SAFETY: `out` is non-NULL and writable per the contract.
        unsafe { out.write(boxed_device(dev)) };
        Ok(())
    })
}

/// Opens the device through the virtio_dmlc kernel module from inside a
/// guest: no root or hugepages, only access to the device node.
///
/// # Safety
///
/// `node` is NULL (/dev/dmlc0) or a NUL-terminated path; `opts` is NULL or
/// points to a `dmlc_open_options`; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn dmlc_open_kernel(
    node: *const c_char,
    opts: *const DmlcOpenOptions,
    out: *mut *mut DmlcDevice,
) -> c_int {
    guard(|| {
        if out.is_null() {
            return Err(Fail::invalid("out is NULL"));
        }
        // SAFETY: `out` is non-NULL and writable per the contract.
        unsafe { out.write(std::ptr::null_mut()) };
        let node = if node.is_null() {
            None
        } else {
            // SAFETY: `node` is a NUL-terminated string per the contract.
            let n = unsafe { CStr::from_ptr(node) };
            Some(std::path::PathBuf::from(
                n.to_str()
                    .map_err(|_| Fail::invalid("the node path is not UTF-8"))?,
            ))
        };
        // SAFETY: `opts` is NULL or points to a dmlc_open_options.
        let options = unsafe { open_options(opts) }?;
        let dev = dmlc_driver::kernel::open(node.as_deref(), &options).map_err(|e| {
            let mut f = Fail::from(e);
            f.msg = format!("cannot open the kernel driver's device: {}", f.msg);
            f
        })?;
        // SAFETY: `out` is non-NULL and writable per the contract.
        unsafe { out.write(boxed_device(dev)) };
        Ok(())
    })
}

/// Closes a device (buffers keep its memory alive until freed).
///
/// # Safety
///
/// `dev` is NULL or an open device, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn dmlc_close(dev: *mut DmlcDevice) {
    if dev.is_null() {
        return;
    }
    // SAFETY: `dev` came from Box::into_raw in dmlc_open_host_ex and the
    // caller gives up its ownership here.
    let boxed = unsafe { Box::from_raw(dev) };
    guard_value((), move || drop(boxed));
}

/// # Safety
///
/// `dev` is NULL or an open device.
#[no_mangle]
pub unsafe extern "C" fn dmlc_rank(dev: *const DmlcDevice) -> i32 {
    guard_value(-1, || {
        // SAFETY: forwarded contract (`dev` is NULL or open).
        unsafe { device(dev) }.map_or(-1, |d| d.dev.rank() as i32)
    })
}

/// # Safety
///
/// `dev` is NULL or an open device.
#[no_mangle]
pub unsafe extern "C" fn dmlc_world_size(dev: *const DmlcDevice) -> i32 {
    guard_value(-1, || {
        // SAFETY: forwarded contract (`dev` is NULL or open).
        unsafe { device(dev) }.map_or(-1, |d| d.dev.world_size() as i32)
    })
}

/// # Safety
///
/// `dev` is NULL or an open device.
#[no_mangle]
pub unsafe extern "C" fn dmlc_num_queues(dev: *const DmlcDevice) -> i32 {
    guard_value(-1, || {
        // SAFETY: forwarded contract (`dev` is NULL or open).
        unsafe { device(dev) }.map_or(-1, |d| i32::from(d.dev.num_queues()))
    })
}

/// Re-reads the config space.
///
/// # Safety
///
/// `dev` is NULL or an open device; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn dmlc_get_config(dev: *const DmlcDevice, out: *mut DmlcConfig) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let d = unsafe { device(dev) }?;
        if out.is_null() {
            return Err(Fail::invalid("out is NULL"));
        }
        let c = d.dev.try_config()?;
        let cfg = DmlcConfig {
            rank: c.rank.get(),
            world_size: c.world_size.get(),
            num_queues: c.num_queues.get(),
            max_segments: c.max_segments.get(),
            max_bytes: c.max_bytes.get(),
            dtypes: c.dtypes.get(),
            ops: c.ops.get(),
            opcodes: c.opcodes.get(),
            generation: c.generation.get(),
            group_id: c.group_id.get(),
        };
        // SAFETY: `out` is non-NULL and writable per the contract.
        unsafe { out.write(cfg) };
        Ok(())
    })
}

/// Size of one element of `dtype`, or 0 if unknown.
#[no_mangle]
pub extern "C" fn dmlc_dtype_size(dtype: c_int) -> usize {
    dtype_of(dtype).map_or(0, |d| d.size())
}

/// Allocates a zeroed device-visible buffer.
///
/// # Safety
///
/// `dev` is NULL or an open device; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn dmlc_alloc(
    dev: *mut DmlcDevice,
    bytes: usize,
    out: *mut *mut DmlcBuffer,
) -> c_int {
    // SAFETY: forwarded contract.
    unsafe {
        new_buffer(dev, out, |d| {
            if bytes == 0 {
                return Err(Fail::invalid("cannot allocate 0 bytes"));
            }
            Ok(d.alloc(bytes)?)
        })
    }
}

/// Wraps the caller's own memory as a buffer (kernel transport only).
///
/// # Safety
///
/// `dev` is NULL or an open device; `out` is NULL or writable; `data` is
/// valid for reads and writes of `bytes` until the buffer is freed and no
/// request using it is pending, and is not accessed while a request writes
/// it (dmlc_guest.h).
#[no_mangle]
pub unsafe extern "C" fn dmlc_wrap_memory(
    dev: *mut DmlcDevice,
    data: *mut c_void,
    bytes: usize,
    out: *mut *mut DmlcBuffer,
) -> c_int {
    // SAFETY: forwarded contract; C reaches the bytes only through `data`
    // and keeps the rules of `DmaBuf` (dmlc_guest.h).
    unsafe { new_buffer(dev, out, |d| Ok(d.wrap_caller_memory(data.cast(), bytes)?)) }
}

/// Sets `*out` to NULL, then to a new buffer of `dev` that `make` returns.
///
/// # Safety
///
/// `dev` is NULL or an open device; `out` is NULL or writable.
unsafe fn new_buffer(
    dev: *mut DmlcDevice,
    out: *mut *mut DmlcBuffer,
    make: impl FnOnce(&Device) -> Result<DmaBuf, Fail>,
) -> c_int {
    guard(|| {
        if out.is_null() {
            return Err(Fail::invalid("out is NULL"));
        }
        // SAFETY: `out` is non-NULL and writable per the contract.
        unsafe { out.write(std::ptr::null_mut()) };
        // SAFETY: forwarded contract.
        let d = unsafe { device(dev) }?;
        let buf = make(&d.dev)?;
        // C accesses the buffer through this pointer and keeps the rules of
        // `DmaBuf` itself (dmlc_guest.h: no access while in flight).
        let data = buf.as_ptr();
        let boxed = Box::new(DmlcBuffer {
            dev: Arc::clone(&d.dev),
            buf,
            data,
        });
        // SAFETY: `out` is non-NULL and writable per the contract.
        unsafe { out.write(Box::into_raw(boxed)) };
        Ok(())
    })
}

/// Frees a buffer.
///
/// # Safety
///
/// `buf` is NULL or a live buffer, not used afterwards and not part of a
/// pending request.
#[no_mangle]
pub unsafe extern "C" fn dmlc_free(buf: *mut DmlcBuffer) {
    if buf.is_null() {
        return;
    }
    // SAFETY: `buf` came from Box::into_raw in dmlc_alloc and the caller
    // gives up its ownership here.
    let boxed = unsafe { Box::from_raw(buf) };
    guard_value((), move || drop(boxed));
}

/// The buffer's memory.
///
/// # Safety
///
/// `buf` is NULL or a live buffer.
#[no_mangle]
pub unsafe extern "C" fn dmlc_buffer_data(buf: *const DmlcBuffer) -> *mut c_void {
    // SAFETY: per the contract, a non-NULL `buf` is live.
    unsafe { buf.as_ref() }.map_or(std::ptr::null_mut(), |b| b.data.cast())
}

/// The buffer's size in bytes.
///
/// # Safety
///
/// `buf` is NULL or a live buffer.
#[no_mangle]
pub unsafe extern "C" fn dmlc_buffer_size(buf: *const DmlcBuffer) -> usize {
    // SAFETY: per the contract, a non-NULL `buf` is live.
    unsafe { buf.as_ref() }.map_or(0, |b| b.buf.len())
}

/// # Safety
///
/// Pointers are NULL or live objects of this library.
#[no_mangle]
pub unsafe extern "C" fn dmlc_allreduce(
    dev: *mut DmlcDevice,
    send: *const DmlcBuffer,
    recv: *mut DmlcBuffer,
    count: u64,
    dtype: c_int,
    op: c_int,
) -> c_int {
    let req = match (dtype_of(dtype), op_of(op)) {
        (Ok(d), Ok(o)) => Request::new(Opcode::Allreduce, d, o, count),
        (Err(f), _) | (_, Err(f)) => return guard(|| Err(f)),
    };
    // SAFETY: forwarded contract.
    unsafe { collective(dev, send, recv, req) }
}

/// # Safety
///
/// Pointers are NULL or live objects of this library.
#[no_mangle]
pub unsafe extern "C" fn dmlc_broadcast(
    dev: *mut DmlcDevice,
    send: *const DmlcBuffer,
    recv: *mut DmlcBuffer,
    count: u64,
    dtype: c_int,
    root: u32,
) -> c_int {
    let mut req = match dtype_of(dtype) {
        Ok(d) => Request::new(Opcode::Broadcast, d, ReduceOp::Sum, count),
        Err(f) => return guard(|| Err(f)),
    };
    req.root = root;
    // SAFETY: forwarded contract.
    unsafe { collective(dev, send, recv, req) }
}

/// # Safety
///
/// Pointers are NULL or live objects of this library.
#[no_mangle]
pub unsafe extern "C" fn dmlc_reduce(
    dev: *mut DmlcDevice,
    send: *const DmlcBuffer,
    recv: *mut DmlcBuffer,
    count: u64,
    dtype: c_int,
    op: c_int,
    root: u32,
) -> c_int {
    let mut req = match (dtype_of(dtype), op_of(op)) {
        (Ok(d), Ok(o)) => Request::new(Opcode::Reduce, d, o, count),
        (Err(f), _) | (_, Err(f)) => return guard(|| Err(f)),
    };
    req.root = root;
    // SAFETY: forwarded contract.
    unsafe { collective(dev, send, recv, req) }
}

/// # Safety
///
/// Pointers are NULL or live objects of this library.
#[no_mangle]
pub unsafe extern "C" fn dmlc_allgather(
    dev: *mut DmlcDevice,
    send: *const DmlcBuffer,
    recv: *mut DmlcBuffer,
    sendcount: u64,
    dtype: c_int,
) -> c_int {
    let req = match dtype_of(dtype) {
        Ok(d) => Request::new(Opcode::Allgather, d, ReduceOp::Sum, sendcount),
        Err(f) => return guard(|| Err(f)),
    };
    // SAFETY: forwarded contract.
    unsafe { collective(dev, send, recv, req) }
}

/// # Safety
///
/// Pointers are NULL or live objects of this library.
#[no_mangle]
pub unsafe extern "C" fn dmlc_reduce_scatter(
    dev: *mut DmlcDevice,
    send: *const DmlcBuffer,
    recv: *mut DmlcBuffer,
    recvcount: u64,
    dtype: c_int,
    op: c_int,
) -> c_int {
    let req = match (dtype_of(dtype), op_of(op)) {
        (Ok(d), Ok(o)) => Request::new(Opcode::ReduceScatter, d, o, recvcount),
        (Err(f), _) | (_, Err(f)) => return guard(|| Err(f)),
    };
    // SAFETY: forwarded contract.
    unsafe { collective(dev, send, recv, req) }
}

/// # Safety
///
/// `dev` is NULL or an open device.
#[no_mangle]
pub unsafe extern "C" fn dmlc_barrier(dev: *mut DmlcDevice) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let d = unsafe { device(dev) }?;
        d.dev.barrier()?;
        Ok(())
    })
}

/// Turns C segments into buffer slices of `dev`.
///
/// # Safety
///
/// `segs` is NULL (with `n == 0`) or points to `n` segments whose buffers
/// are NULL or live.
unsafe fn slices(
    dev: &DmlcDevice,
    segs: *const DmlcSegment,
    n: usize,
    what: &str,
) -> Result<Vec<BufSlice>, Fail> {
    if n == 0 {
        return Ok(Vec::new());
    }
    if segs.is_null() {
        return Err(Fail::invalid(format!("{what} segments are NULL")));
    }
    // SAFETY: `segs` points to `n` segments per the contract.
    let segs = unsafe { std::slice::from_raw_parts(segs, n) };
    segs.iter()
        .enumerate()
        .map(|(i, s)| {
            // SAFETY: the segment's buffer is NULL or live per the contract.
            let b = unsafe { buffer(dev, s.buf, what) }?
                .ok_or_else(|| Fail::invalid(format!("{what} segment {i} has a NULL buffer")))?;
            match s.offset.checked_add(s.len) {
                Some(end) if end <= b.buf.len() => Ok(b.buf.slice(s.offset, s.len)),
                _ => Err(Fail::invalid(format!(
                    "{what} segment {i} ({} bytes at {}) is outside its buffer of {} bytes",
                    s.len,
                    s.offset,
                    b.buf.len()
                ))),
            }
        })
        .collect()
}

/// Posts a request; returns at once with a handle for `dmlc_wait`.
///
/// # Safety
///
/// `dev` is NULL or an open device; `req` is NULL or readable; `inputs` and
/// `outputs` are NULL or point to as many segments as given; `handle` is
/// NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn dmlc_submit(
    dev: *mut DmlcDevice,
    queue: u16,
    req: *const DmlcRequest,
    inputs: *const DmlcSegment,
    n_inputs: usize,
    outputs: *const DmlcSegment,
    n_outputs: usize,
    handle: *mut *mut DmlcHandle,
) -> c_int {
    // SAFETY: forwarded contract.
    unsafe {
        submit_on(
            dev,
            queue,
            0,
            req,
            (inputs, n_inputs),
            (outputs, n_outputs),
            handle,
        )
    }
}

/// C segments: the pointer and their number.
type Segs = (*const DmlcSegment, usize);

/// `dmlc_submit` on communicator `comm`.
///
/// # Safety
///
/// As [`dmlc_submit`].
pub(crate) unsafe fn submit_on(
    dev: *mut DmlcDevice,
    queue: u16,
    comm: u32,
    req: *const DmlcRequest,
    inputs: Segs,
    outputs: Segs,
    handle: *mut *mut DmlcHandle,
) -> c_int {
    guard(|| {
        if handle.is_null() {
            return Err(Fail::invalid("handle is NULL"));
        }
        // SAFETY: `handle` is non-NULL and writable per the contract.
        unsafe { handle.write(std::ptr::null_mut()) };
        // SAFETY: forwarded contract.
        let d = unsafe { device(dev) }?;
        // SAFETY: `req` is NULL or readable per the contract.
        let r = unsafe { req.as_ref() }.ok_or_else(|| Fail::invalid("request is NULL"))?;
        let request = request_of(r, comm)?;
        // SAFETY: forwarded contract.
        let ins = unsafe { slices(d, inputs.0, inputs.1, "input") }?;
        // SAFETY: forwarded contract.
        let outs = unsafe { slices(d, outputs.0, outputs.1, "output") }?;
        let h = d.dev.submit(queue, &request, &ins, &outs)?;
        let boxed = Box::new(DmlcHandle {
            dev: Arc::clone(&d.dev),
            handle: h,
        });
        // SAFETY: `handle` is non-NULL and writable per the contract.
        unsafe { handle.write(Box::into_raw(boxed)) };
        Ok(())
    })
}

/// A failure for an unknown `what` (opcode, dtype, op) of value `raw`.
fn unknown(detail: u32, what: &str, raw: u32) -> Fail {
    Fail {
        status: virtio_dmlc::STATUS_UNSUPPORTED as c_int,
        msg: format!("unsupported by the device: unknown {what} {raw} (detail {detail})"),
    }
}

/// The driver's request of a C `dmlc_request` (opcodes 0 to 6) on
/// communicator `comm`: unknown values refused as the device would.
pub(crate) fn request_of(r: &DmlcRequest, comm: u32) -> Result<Request, Fail> {
    let opcode = Opcode::from_raw(r.opcode)
        .ok_or_else(|| unknown(unsupported::OPCODE, "opcode", r.opcode.into()))?;
    // Barrier ignores dtype and op; any valid stand-in will do.
    let dtype = match Dtype::from_raw(r.dtype) {
        Some(d) => d,
        None if opcode == Opcode::Barrier => Dtype::U8,
        None => return Err(unknown(unsupported::DTYPE, "dtype", r.dtype.into())),
    };
    let op = match ReduceOp::from_raw(r.op) {
        Some(o) => o,
        None if !matches!(
            opcode,
            Opcode::Allreduce | Opcode::Reduce | Opcode::ReduceScatter
        ) =>
        {
            ReduceOp::Sum
        }
        None => return Err(unknown(unsupported::OP, "op", r.op.into())),
    };
    if r.flags & !FLAGS_KNOWN != 0 {
        return Err(Error::bad_request(bad::FLAGS).into());
    }
    Ok(Request {
        opcode,
        dtype,
        op,
        root: r.root,
        count: r.count,
        tag: r.tag,
        in_place: r.flags & FLAG_IN_PLACE != 0,
        timeout_ms: r.timeout_ms,
        comm,
    })
}

/// Waits for a submitted request; consumes the handle unless the wait
/// timed out.
///
/// # Safety
///
/// `dev` is NULL or an open device; `handle` is NULL or a live handle;
/// `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn dmlc_wait(
    dev: *mut DmlcDevice,
    handle: *mut DmlcHandle,
    timeout_ms: i64,
    out: *mut DmlcCompletion,
) -> c_int {
    let mut completion = DmlcCompletion {
        status: DMLC_OK,
        detail: 0,
        peer: NO_PEER,
        generation: 0,
    };
    let status = guard(|| {
        // SAFETY: forwarded contract.
        let d = unsafe { device(dev) }?;
        // SAFETY: `handle` is NULL or live per the contract.
        let h = unsafe { handle.as_ref() }.ok_or_else(|| Fail::invalid("handle is NULL"))?;
        if !Arc::ptr_eq(&h.dev, &d.dev) {
            return Err(Error::UnknownHandle.into());
        }
        let timeout = u64::try_from(timeout_ms).ok().map(Duration::from_millis);
        let result = d.dev.wait(h.handle, timeout);
        if !matches!(result, Err(Error::WaitTimeout)) {
            // SAFETY: `handle` came from Box::into_raw in dmlc_submit; it is
            // consumed now, as documented.
            drop(unsafe { Box::from_raw(handle) });
        }
        match result {
            Ok(done) => {
                completion.generation = done.generation;
                Ok(())
            }
            Err(e) => {
                (completion.detail, completion.peer) = detail_of(&e);
                Err(e.into())
            }
        }
    });
    completion.status = status;
    // SAFETY: `out` is NULL or writable per the contract.
    if let Some(o) = unsafe { out.as_mut() } {
        *o = completion;
    }
    status
}

/// Static text naming `status`.
#[no_mangle]
pub extern "C" fn dmlc_strerror(status: c_int) -> *const c_char {
    let s: &'static CStr = match status {
        DMLC_OK => c"ok",
        1 => c"bad request",
        2 => c"collective mismatch",
        3 => c"peer lost",
        4 => c"collective timed out",
        5 => c"unsupported by the device",
        6 => c"request too big",
        7 => c"group reset",
        8 => c"message larger than its receive",
        9 => c"non-finite input (NaN or infinity)",
        DMLC_ERR_INVALID_ARGUMENT => c"invalid argument",
        DMLC_ERR_NO_STATUS => c"device returned no status",
        DMLC_ERR_UNKNOWN_STATUS => c"unknown device status",
        DMLC_ERR_WAIT_TIMEOUT => c"wait timed out",
        DMLC_ERR_QUEUE_FULL => c"queue full",
        DMLC_ERR_OUT_OF_MEMORY => c"out of device-visible memory",
        DMLC_ERR_UNKNOWN_HANDLE => c"unknown request handle",
        DMLC_ERR_TRANSPORT => c"transport error",
        DMLC_ERR_DEVICE => c"device error",
        DMLC_ERR_INTERNAL => c"internal error",
        DMLC_ERR_UNANSWERED => c"the device did not answer: reopen it",
        DMLC_ERR_REQUEST_DROPPED => c"the backend restarted and dropped the request: reopen",
        DMLC_ERR_BUFFER_BUSY => c"buffer busy",
        DMLC_ERR_ENVIRONMENT => c"the job's environment names no usable device",
        _ => c"unknown status",
    };
    s.as_ptr()
}

/// The last error message of this thread ("" if none).
#[no_mangle]
pub extern "C" fn dmlc_last_error_message() -> *const c_char {
    // The CString lives in the thread-local until the next failure on this
    // thread replaces it, as the header documents.
    ffi_util::last_error_ptr(&LAST_ERROR)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_match_the_device() {
        for s in virtio_dmlc::Status::ALL {
            // SAFETY: dmlc_strerror returns a static NUL-terminated string.
            let text = unsafe { CStr::from_ptr(dmlc_strerror(s.raw() as c_int)) };
            assert!(!text.to_bytes().is_empty());
        }
        assert_eq!(status_of(&Error::PeerLost { peer: 1 }), 3);
        assert_eq!(status_of(&Error::WaitTimeout), DMLC_ERR_WAIT_TIMEOUT);
        // "Reopen the device" and "wait for the buffer" each have a code.
        let dropped = Error::RequestDropped {
            generation: (1, 1),
            group: (7, 8),
        };
        let unanswered = Error::Unanswered {
            after: std::time::Duration::from_secs(1),
        };
        let busy = Error::BufferBusy {
            reason: "in flight",
        };
        let codes = [&dropped, &unanswered, &busy].map(status_of);
        assert_eq!(
            codes,
            [
                DMLC_ERR_REQUEST_DROPPED,
                DMLC_ERR_UNANSWERED,
                DMLC_ERR_BUFFER_BUSY
            ]
        );
        for c in codes {
            // SAFETY: dmlc_strerror returns a static NUL-terminated string.
            let text = unsafe { CStr::from_ptr(dmlc_strerror(c)) };
            assert_ne!(text.to_bytes(), b"unknown status");
        }
        assert_eq!(
            detail_of(&Error::mismatch(mismatch::COUNT | mismatch::TAG, 2)),
            (mismatch::COUNT | mismatch::TAG, 2)
        );
        // Spec 5.X.6.13: TRUNCATE keeps its status, peer and length; the
        // mask keeps the table bit.
        let table = virtio_dmlc::comm::MISMATCH_TABLE;
        assert_eq!(detail_of(&Error::mismatch(table, 3)), (table, 3));
        let truncated = Error::Truncated {
            length: 12,
            peer: 1,
        };
        assert_eq!(status_of(&truncated), virtio_dmlc::STATUS_TRUNCATE as c_int);
        assert_eq!(detail_of(&truncated), (0, 1));
        assert_eq!(guard(|| Err(truncated.into())), 8);
        assert_eq!(dmlc_last_error_length(), 12);
        assert_eq!(guard(|| Err(Fail::invalid("x"))), DMLC_ERR_INVALID_ARGUMENT);
        assert_eq!(dmlc_last_error_length(), 0);
        // Spec 5.X.6.14: NONFINITE names the rank as the peer and the
        // element as the length.
        let non_finite = Error::NonFinite { rank: 1, index: 77 };
        assert_eq!(guard(|| Err(non_finite.into())), 9);
        assert_eq!(dmlc_last_error_length(), 77);
        let mut why = DmlcCompletion {
            status: 0,
            detail: 5,
            peer: 0,
            generation: 0,
        };
        // SAFETY: `why` is writable.
        unsafe { dmlc_last_error_completion(&mut why) };
        assert_eq!((why.status, why.detail, why.peer), (9, 0, 1));
    }

    #[test]
    fn null_pointers_are_refused_with_a_message() {
        // SAFETY: NULL is allowed everywhere and must be refused.
        let rc = unsafe {
            dmlc_allreduce(
                std::ptr::null_mut(),
                std::ptr::null(),
                std::ptr::null_mut(),
                1,
                0,
                0,
            )
        };
        assert_eq!(rc, DMLC_ERR_INVALID_ARGUMENT);
        // SAFETY: the message pointer is valid until the next failure here.
        let msg = unsafe { CStr::from_ptr(dmlc_last_error_message()) };
        assert_eq!(msg.to_str().unwrap(), "device is NULL");
        // SAFETY: as above.
        assert_eq!(unsafe { dmlc_rank(std::ptr::null()) }, -1);
        let mut out = std::ptr::null_mut();
        // SAFETY: `out` is writable; the socket is NULL on purpose.
        let rc = unsafe { dmlc_open_host(std::ptr::null(), 1, &mut out) };
        assert_eq!(rc, DMLC_ERR_INVALID_ARGUMENT);
        assert_eq!(dmlc_allreduce_dtype_check(), DMLC_ERR_INVALID_ARGUMENT);
    }

    #[test]
    fn the_poll_field_picks_interrupts_polling_or_the_hybrid_wait() {
        let with = |poll| {
            let o = DmlcOpenOptions {
                poll,
                ..default_open_options()
            };
            // SAFETY: `o` is a live dmlc_open_options.
            let Ok(got) = (unsafe { open_options(&o) }) else {
                panic!("options with poll {poll} were refused")
            };
            (got.poll, got.spin_cap)
        };
        assert_eq!(with(0), (false, Duration::ZERO));
        assert_eq!(with(1), (true, Duration::ZERO));
        assert_eq!(with(-1), (true, Duration::ZERO));
        let cap = dmlc_driver::device::HYBRID_SPIN_CAP;
        assert_eq!(with(DMLC_WAIT_HYBRID), (false, cap));
        // The defaults name the driver's default wait (the hybrid one).
        assert_eq!(default_options().poll, Wait::default().code());
        assert_eq!(default_options().poll, DMLC_WAIT_HYBRID);
    }

    /// The options `dmlc_open_options_init` gives.
    fn default_options() -> DmlcOpenOptions {
        let mut opts = DmlcOpenOptions {
            poll: 0,
            queue_size: 0,
            event_idx: 0,
            dma_bytes: 0,
        };
        // SAFETY: `opts` is writable.
        unsafe { dmlc_open_options_init(&mut opts) };
        opts
    }

    #[test]
    fn opening_a_missing_pci_device_fails_with_a_message() {
        let opts = default_options();
        let addr = CString::new("0000:ff:1f.7").unwrap();
        let mut out = std::ptr::dangling_mut();
        // SAFETY: valid string, options and out pointer.
        let rc = unsafe { dmlc_open_pci(addr.as_ptr(), &opts, &mut out) };
        assert_ne!(rc, DMLC_OK);
        assert!(out.is_null(), "out must be cleared on failure");
        // SAFETY: the message is a valid C string until the next failure.
        let msg = unsafe { CStr::from_ptr(dmlc_last_error_message()) };
        let msg = msg.to_string_lossy();
        assert!(
            msg.contains("cannot open the PCI device 0000:ff:1f.7"),
            "{msg}"
        );
        // NULL options are refused before anything is opened.
        // SAFETY: NULL options are allowed by the contract.
        let rc = unsafe { dmlc_open_pci(std::ptr::null(), std::ptr::null(), &mut out) };
        assert_eq!(rc, DMLC_ERR_INVALID_ARGUMENT);
    }

    #[test]
    fn opening_a_missing_kernel_node_fails_with_a_message() {
        let opts = default_options();
        let node = CString::new("/nonexistent/dmlc9").unwrap();
        let mut out = std::ptr::dangling_mut();
        // SAFETY: valid string, options and out pointer.
        let rc = unsafe { dmlc_open_kernel(node.as_ptr(), &opts, &mut out) };
        assert_ne!(rc, DMLC_OK);
        assert!(out.is_null(), "out must be cleared on failure");
        // SAFETY: the message is a valid C string until the next failure.
        let msg = unsafe { CStr::from_ptr(dmlc_last_error_message()) };
        let msg = msg.to_string_lossy();
        assert!(
            msg.contains("cannot open the kernel driver's device")
                && msg.contains("/nonexistent/dmlc9")
                && msg.contains("is the module loaded"),
            "{msg}"
        );
    }

    fn dmlc_allreduce_dtype_check() -> c_int {
        // Unknown dtype with a NULL device: the dtype is judged first.
        // SAFETY: NULL pointers are allowed.
        let rc = unsafe {
            dmlc_allreduce(
                std::ptr::null_mut(),
                std::ptr::null(),
                std::ptr::null_mut(),
                1,
                99,
                0,
            )
        };
        assert_eq!(rc, virtio_dmlc::STATUS_UNSUPPORTED as c_int);
        // SAFETY: NULL pointers are allowed.
        unsafe { dmlc_barrier(std::ptr::null_mut()) }
    }

    #[test]
    fn panics_do_not_escape() {
        let rc = guard(|| panic!("boom"));
        assert_eq!(rc, DMLC_ERR_INTERNAL);
        // SAFETY: valid until the next failure on this thread.
        let msg = unsafe { CStr::from_ptr(dmlc_last_error_message()) };
        assert_eq!(msg.to_str().unwrap(), "internal error: boom");
    }
}
