//! Communicators (spec 5.X.6.13, feature bits 1 to 3) and the requests
//! on device buffers that name one: `dmlc_comm_split`, `dmlc_comm_create`,
//! `dmlc_comm_free`, `dmlc_get_comm_info`, `dmlc_comm_call` (any opcode,
//! blocking) and `dmlc_submit_comm` (the collectives of 5.X.6.3,
//! non-blocking). The same operations on ordinary memory are in
//! `comm_host.rs`.

use virtio_dmlc::comm::{
    self as vcomm, CommOpcode, VIRTIO_DMLC_F_BLOCKS, VIRTIO_DMLC_F_COMM, VIRTIO_DMLC_F_P2P,
};

use super::*;
use dmlc_driver::{CommInfo, CommRequest, Done};

/// The communicator of the whole group (`DMLC_COMM_WORLD`).
pub const DMLC_COMM_WORLD: u32 = vcomm::COMM_WORLD;
/// `peer` of a receive from whichever rank sends first.
pub const DMLC_ANY_SOURCE: u32 = vcomm::ANY_SOURCE;
/// `color` of a `dmlc_comm_split` member that joins no communicator.
pub const DMLC_UNDEFINED: u32 = vcomm::UNDEFINED;
/// `dmlc_comm_features` bits: the device's feature bits 1 to 3.
pub const DMLC_FEATURE_COMM: u32 = 1 << VIRTIO_DMLC_F_COMM;
pub const DMLC_FEATURE_P2P: u32 = 1 << VIRTIO_DMLC_F_P2P;
pub const DMLC_FEATURE_BLOCKS: u32 = 1 << VIRTIO_DMLC_F_BLOCKS;

/// `dmlc_comm_info`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DmlcCommInfo {
    pub id: u32,
    pub rank: u32,
    pub size: u32,
}

impl From<CommInfo> for DmlcCommInfo {
    fn from(c: CommInfo) -> Self {
        DmlcCommInfo {
            id: c.id,
            rank: c.rank,
            size: c.size,
        }
    }
}

/// `dmlc_comm_request`: the fields of `virtio_dmlc_req_comm` with native
/// integers, the table by pointer.
#[repr(C)]
pub struct DmlcCommRequest {
    pub opcode: u16,
    pub dtype: u8,
    pub op: u8,
    pub root: u32,
    pub count: u64,
    pub tag: u64,
    pub flags: u32,
    pub timeout_ms: u32,
    pub comm: u32,
    pub peer: u32,
    pub key: u32,
    pub table_bytes: u32,
    pub table: *const c_void,
}

/// `dmlc_comm_completion`: `dmlc_completion` and what the 40-byte response
/// adds.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DmlcCommCompletion {
    pub status: c_int,
    pub detail: u32,
    pub peer: u32,
    pub generation: u32,
    pub length: u64,
    pub comm: u32,
    pub comm_rank: u32,
    pub comm_size: u32,
    pub peer_world: u32,
}

/// Writes `info` to `out` (checked non-NULL before).
///
/// # Safety
///
/// `out` is writable for one `dmlc_comm_info`.
unsafe fn put_info(out: *mut DmlcCommInfo, info: DmlcCommInfo) {
    // SAFETY: per the contract.
    unsafe { out.write(info) };
}

/// The `dmlc_comm_info` out pointer, checked and cleared.
///
/// # Safety
///
/// `out` is NULL or writable for one `dmlc_comm_info`.
unsafe fn info_out(out: *mut DmlcCommInfo) -> Result<*mut DmlcCommInfo, Fail> {
    if out.is_null() {
        return Err(Fail::invalid("out is NULL"));
    }
    // SAFETY: non-NULL and writable per the contract.
    unsafe { put_info(out, DmlcCommInfo::default()) };
    Ok(out)
}

/// The feature bits of spec 5.X.6.13 the device offered and this library
/// negotiated, as `DMLC_FEATURE_*` bits; -1 if `dev` is NULL.
///
/// # Safety
///
/// `dev` is NULL or an open device.
#[no_mangle]
pub unsafe extern "C" fn dmlc_comm_features(dev: *const DmlcDevice) -> c_int {
    guard_value(-1, || {
        // SAFETY: forwarded contract.
        unsafe { device(dev) }.map_or(-1, |d| {
            [VIRTIO_DMLC_F_COMM, VIRTIO_DMLC_F_P2P, VIRTIO_DMLC_F_BLOCKS]
                .into_iter()
                .filter(|&b| d.dev.has_comm_feature(b))
                .fold(0, |m, b| m | (1 << b))
        })
    })
}

/// Most communicators alive at once, the group's own included; 0 without
/// communicators, -1 if `dev` is NULL.
///
/// # Safety
///
/// `dev` is NULL or an open device.
#[no_mangle]
pub unsafe extern "C" fn dmlc_max_comms(dev: *const DmlcDevice) -> i32 {
    guard_value(-1, || {
        // SAFETY: forwarded contract.
        unsafe { device(dev) }.map_or(-1, |d| {
            d.dev
                .max_comms()
                .map_or(0, |m| i32::try_from(m).unwrap_or(i32::MAX))
        })
    })
}

/// Communicator `comm` as this member knows it.
///
/// # Safety
///
/// `dev` is NULL or an open device; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn dmlc_get_comm_info(
    dev: *const DmlcDevice,
    comm: u32,
    out: *mut DmlcCommInfo,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let out = unsafe { info_out(out) }?;
        // SAFETY: forwarded contract.
        let d = unsafe { device(dev) }?;
        let info = d.dev.comm_info(comm)?;
        // SAFETY: checked writable above.
        unsafe { put_info(out, info.into()) };
        Ok(())
    })
}

/// Splits `comm` by `color` and `key`, collectively.
///
/// # Safety
///
/// `dev` is NULL or an open device; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn dmlc_comm_split(
    dev: *mut DmlcDevice,
    comm: u32,
    color: u32,
    key: u32,
    out: *mut DmlcCommInfo,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let out = unsafe { info_out(out) }?;
        // SAFETY: forwarded contract.
        let d = unsafe { device(dev) }?;
        let color = (color != DMLC_UNDEFINED).then_some(color);
        if let Some(info) = d.dev.comm_split(comm, color, key)? {
            // SAFETY: checked writable above.
            unsafe { put_info(out, info.into()) };
        }
        Ok(())
    })
}

/// Makes a communicator of `ranks` of `comm`, called by those ranks only.
///
/// # Safety
///
/// `dev` is NULL or an open device; `ranks` is NULL or readable for `n`
/// ranks; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn dmlc_comm_create(
    dev: *mut DmlcDevice,
    comm: u32,
    ranks: *const u32,
    n: usize,
    tag: u64,
    out: *mut DmlcCommInfo,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let out = unsafe { info_out(out) }?;
        // SAFETY: forwarded contract.
        let d = unsafe { device(dev) }?;
        if ranks.is_null() {
            return Err(Fail::invalid("ranks is NULL"));
        }
        // SAFETY: readable for `n` ranks per the contract.
        let list = unsafe { std::slice::from_raw_parts(ranks, n) };
        let info = d.dev.comm_create(comm, list, tag)?;
        // SAFETY: checked writable above.
        unsafe { put_info(out, info.into()) };
        Ok(())
    })
}

/// Frees communicator `comm`, collectively.
///
/// # Safety
///
/// `dev` is NULL or an open device.
#[no_mangle]
pub unsafe extern "C" fn dmlc_comm_free(dev: *mut DmlcDevice, comm: u32) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let d = unsafe { device(dev) }?;
        d.dev.comm_free(comm)?;
        Ok(())
    })
}

/// `dmlc_submit` on communicator `comm`.
///
/// # Safety
///
/// As [`dmlc_submit`].
#[no_mangle]
pub unsafe extern "C" fn dmlc_submit_comm(
    dev: *mut DmlcDevice,
    queue: u16,
    comm: u32,
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
            comm,
            req,
            (inputs, n_inputs),
            (outputs, n_outputs),
            handle,
        )
    }
}

/// The driver's request of spec 5.X.6.13 for a C `dmlc_comm_request`
/// whose opcode is 7 or above.
///
/// # Safety
///
/// `r.table` is NULL or readable for `r.table_bytes` bytes.
unsafe fn comm_request_of(r: &DmlcCommRequest) -> Result<CommRequest, Fail> {
    let opcode = CommOpcode::from_raw(r.opcode)
        .ok_or_else(|| unknown(unsupported::OPCODE, "opcode", r.opcode.into()))?;
    let manages = matches!(
        opcode,
        CommOpcode::CommSplit | CommOpcode::CommCreate | CommOpcode::CommFree
    );
    let dtype = match Dtype::from_raw(r.dtype) {
        Some(d) => d,
        // The communicator requests move no data: any dtype stands in.
        None if manages => Dtype::U8,
        None => return Err(unknown(unsupported::DTYPE, "dtype", r.dtype.into())),
    };
    if r.flags & !FLAGS_KNOWN != 0 {
        return Err(Error::bad_request(bad::FLAGS).into());
    }
    let table = match (r.table_bytes, r.table.is_null()) {
        (0, _) => Vec::new(),
        (_, true) => return Err(Fail::invalid("table is NULL, table_bytes is not 0")),
        (n, false) => {
            // SAFETY: readable for `table_bytes` per the contract.
            unsafe { std::slice::from_raw_parts(r.table.cast::<u8>(), n as usize) }.to_vec()
        }
    };
    Ok(CommRequest {
        opcode,
        dtype,
        comm: r.comm,
        peer: r.peer,
        key: r.key,
        root: r.root,
        count: r.count,
        tag: r.tag,
        in_place: r.flags & FLAG_IN_PLACE != 0,
        timeout_ms: r.timeout_ms,
        table,
    })
}

/// Runs any request (opcodes 0 to 17) on device buffers and waits for it.
///
/// # Safety
///
/// `dev` is NULL or an open device; `req` is NULL or readable, its table
/// NULL or readable for `table_bytes`; `inputs` and `outputs` are NULL or
/// point to as many segments as given; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn dmlc_comm_call(
    dev: *mut DmlcDevice,
    queue: u16,
    req: *const DmlcCommRequest,
    inputs: *const DmlcSegment,
    n_inputs: usize,
    outputs: *const DmlcSegment,
    n_outputs: usize,
    out: *mut DmlcCommCompletion,
) -> c_int {
    let mut completion = DmlcCommCompletion {
        status: DMLC_OK,
        detail: 0,
        peer: NO_PEER,
        generation: 0,
        length: 0,
        comm: 0,
        comm_rank: 0,
        comm_size: 0,
        peer_world: NO_PEER,
    };
    let status = guard(|| {
        // SAFETY: forwarded contract.
        let d = unsafe { device(dev) }?;
        // SAFETY: `req` is NULL or readable per the contract.
        let r = unsafe { req.as_ref() }.ok_or_else(|| Fail::invalid("request is NULL"))?;
        // SAFETY: forwarded contract.
        let ins = unsafe { slices(d, inputs, n_inputs, "input") }?;
        // SAFETY: forwarded contract.
        let outs = unsafe { slices(d, outputs, n_outputs, "output") }?;
        let result = if r.opcode < vcomm::OPCODE_SEND {
            if r.table_bytes != 0 {
                return Err(Error::bad_request(vcomm::BAD_TABLE).into());
            }
            let base = DmlcRequest {
                opcode: r.opcode,
                dtype: r.dtype,
                op: r.op,
                root: r.root,
                count: r.count,
                tag: r.tag,
                flags: r.flags,
                timeout_ms: r.timeout_ms,
            };
            let request = request_of(&base, r.comm)?;
            d.dev.call(queue, &request, &ins, &outs, None)
        } else {
            // SAFETY: forwarded contract (the table).
            let request = unsafe { comm_request_of(r) }?;
            d.dev.comm_call(queue, &request, &ins, &outs, None)
        };
        match result {
            Ok(done) => {
                fill(
                    &mut completion,
                    &done,
                    d.dev.has_comm_feature(VIRTIO_DMLC_F_COMM),
                );
                Ok(())
            }
            Err(e) => {
                (completion.detail, completion.peer) = detail_of(&e);
                if let Error::Truncated { length, .. } | Error::NonFinite { index: length, .. } = e
                {
                    completion.length = length;
                }
                // The driver's errors carry no peer_world: known only on
                // the group itself.
                if r.comm == DMLC_COMM_WORLD {
                    completion.peer_world = completion.peer;
                }
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

/// `c`'s fields from a completed request (`comm_resp`: the device wrote
/// the 40-byte response).
fn fill(c: &mut DmlcCommCompletion, done: &Done, comm_resp: bool) {
    c.generation = done.generation;
    if comm_resp {
        let r = done.reply;
        c.length = r.length;
        c.comm = r.comm;
        c.comm_rank = r.comm_rank;
        c.comm_size = r.comm_size;
        c.peer = r.peer;
        c.peer_world = r.peer_world;
    }
}
