//! C API with rabit's names; `include/dmlc_rabit.h` declares it.
//!
//! A thin layer over the process-wide worker of [`dmlc_comm::rabit`]: the same
//! environment, the same transports, the same results as the Rust API. The
//! names and the dtype and op numbers are those of rabit's `c_api.h` (with
//! f16, bf16 and the device's extra ops added after them), so a program or
//! a ctypes binding written for rabit finds what it knows. Unlike rabit,
//! every fallible function returns a status: 0 or a negative `RABIT_ERR_*`,
//! with a one-line message in a thread-local string
//! ([`RabitGetLastError`]). No function unwinds into C: panics are caught
//! and reported as [`RABIT_ERR_INTERNAL`].

// rabit's C names are CamelCase.
#![allow(non_snake_case)]

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_long, c_ulong, c_void, CStr, CString};
use std::sync::Mutex;

use crate::ffi_util::{self, guard_value, Codes, Fail};
use dmlc_cli_support::error_text;
use dmlc_comm::rabit::{self, Config, Op, Rabit, RabitError};
use dmlc_comm::CommError;
use dmlc_comm::TcpError;
use dmlc_driver::{Dtype, Error};

// Status codes (`rabit_status` in the header).
/// Success.
pub const RABIT_OK: c_int = 0;
/// NULL pointer, unknown dtype or op number, bad size or root.
pub const RABIT_ERR_INVALID_ARGUMENT: c_int = -1;
/// A collective before `RabitInit` (or after `RabitFinalize`).
pub const RABIT_ERR_NOT_INITIALIZED: c_int = -2;
/// `RabitInit` twice without `RabitFinalize`.
pub const RABIT_ERR_ALREADY_INITIALIZED: c_int = -3;
/// The DMLC environment (or an argv override) is wrong or incomplete.
pub const RABIT_ERR_ENVIRONMENT: c_int = -4;
/// The device could not be opened, or the TCP group could not be formed.
pub const RABIT_ERR_CONNECT: c_int = -5;
/// The op is not defined for the dtype (bitwise ops on floats).
pub const RABIT_ERR_UNSUPPORTED: c_int = -6;
/// The workers called different collectives (or with different sizes).
pub const RABIT_ERR_MISMATCH: c_int = -7;
/// A worker left (exited or crashed) during the collective.
pub const RABIT_ERR_PEER_LOST: c_int = -8;
/// A worker did not arrive in time.
pub const RABIT_ERR_TIMEOUT: c_int = -9;
/// Any other failure of a collective (transport, device).
pub const RABIT_ERR_COLLECTIVE: c_int = -10;
/// An internal error of the library (a caught panic).
pub const RABIT_ERR_INTERNAL: c_int = -11;

// Element types (`rabit_dtype`): rabit's numbers, then f16 and bf16.
pub const RABIT_CHAR: c_int = 0;
pub const RABIT_UCHAR: c_int = 1;
pub const RABIT_INT: c_int = 2;
pub const RABIT_UINT: c_int = 3;
pub const RABIT_LONG: c_int = 4;
pub const RABIT_ULONG: c_int = 5;
pub const RABIT_FLOAT: c_int = 6;
pub const RABIT_DOUBLE: c_int = 7;
pub const RABIT_LONGLONG: c_int = 8;
pub const RABIT_ULONGLONG: c_int = 9;
pub const RABIT_HALF: c_int = 10;
pub const RABIT_BFLOAT16: c_int = 11;

// Reduce operations (`rabit_op`): rabit's numbers, then the device's others.
pub const RABIT_MAX: c_int = 0;
pub const RABIT_MIN: c_int = 1;
pub const RABIT_SUM: c_int = 2;
pub const RABIT_BITOR: c_int = 3;
pub const RABIT_BITAND: c_int = 4;
pub const RABIT_BITXOR: c_int = 5;
pub const RABIT_PROD: c_int = 6;
pub const RABIT_AVG: c_int = 7;

/// The device dtype of a `rabit_dtype` number. `long` follows the C
/// compiler's size of `long` on this target.
pub fn dtype_of(raw: c_int) -> Option<Dtype> {
    let long_is_64 = std::mem::size_of::<c_long>() == 8;
    Some(match raw {
        RABIT_CHAR => Dtype::I8,
        RABIT_UCHAR => Dtype::U8,
        RABIT_INT => Dtype::I32,
        RABIT_UINT => Dtype::U32,
        RABIT_LONG if long_is_64 => Dtype::I64,
        RABIT_LONG => Dtype::I32,
        RABIT_ULONG if long_is_64 => Dtype::U64,
        RABIT_ULONG => Dtype::U32,
        RABIT_FLOAT => Dtype::F32,
        RABIT_DOUBLE => Dtype::F64,
        RABIT_LONGLONG => Dtype::I64,
        RABIT_ULONGLONG => Dtype::U64,
        RABIT_HALF => Dtype::F16,
        RABIT_BFLOAT16 => Dtype::Bf16,
        _ => return None,
    })
}

/// The reduce op of a `rabit_op` number.
pub fn op_of(raw: c_int) -> Option<Op> {
    Some(match raw {
        RABIT_MAX => Op::Max,
        RABIT_MIN => Op::Min,
        RABIT_SUM => Op::Sum,
        RABIT_BITOR => Op::BitOR,
        RABIT_BITAND => Op::BitAND,
        RABIT_BITXOR => Op::BitXOR,
        RABIT_PROD => Op::Prod,
        RABIT_AVG => Op::Avg,
        _ => return None,
    })
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn invalid(msg: impl Into<String>) -> Fail {
    Fail {
        status: RABIT_ERR_INVALID_ARGUMENT,
        msg: msg.into(),
    }
}

impl From<RabitError> for Fail {
    fn from(e: RabitError) -> Self {
        if let RabitError::NotInitialized = e {
            // The Rust text names init(); C callers know RabitInit.
            return Fail {
                status: RABIT_ERR_NOT_INITIALIZED,
                msg: "rabit is not initialized: call RabitInit first".into(),
            };
        }
        // error_text leaves out a cause whose text the message already
        // ends with (a layer that prints its cause itself).
        Fail {
            status: status_of(&e),
            msg: error_text(&e),
        }
    }
}

/// The `rabit_status` of an error of the Rust API.
fn status_of(e: &RabitError) -> c_int {
    match e {
        RabitError::BadEnv { .. }
        | RabitError::MissingEnv { .. }
        | RabitError::NoDevice { .. }
        | RabitError::DeviceDisagrees { .. } => RABIT_ERR_ENVIRONMENT,
        RabitError::Open { .. } | RabitError::Connect(_) => RABIT_ERR_CONNECT,
        RabitError::NotInitialized => RABIT_ERR_NOT_INITIALIZED,
        RabitError::AlreadyInitialized => RABIT_ERR_ALREADY_INITIALIZED,
        RabitError::NotUtf8 => RABIT_ERR_INVALID_ARGUMENT,
        RabitError::Comm(c) => comm_status(c),
    }
}

fn comm_status(e: &CommError) -> c_int {
    #[allow(unreachable_patterns)] // variants added later are generic failures
    match e {
        CommError::InvalidArgument(_) => RABIT_ERR_INVALID_ARGUMENT,
        CommError::OpForDtype { .. } => RABIT_ERR_UNSUPPORTED,
        CommError::Device(d) => match d {
            Error::Mismatch { .. } => RABIT_ERR_MISMATCH,
            Error::PeerLost { .. } => RABIT_ERR_PEER_LOST,
            Error::Timeout { .. } => RABIT_ERR_TIMEOUT,
            Error::Unsupported { .. } => RABIT_ERR_UNSUPPORTED,
            Error::BadRequest { .. } | Error::InvalidArgument(_) => RABIT_ERR_INVALID_ARGUMENT,
            _ => RABIT_ERR_COLLECTIVE,
        },
        CommError::Tcp(t) => match t {
            TcpError::Mismatch { .. } => RABIT_ERR_MISMATCH,
            TcpError::PeerClosed { .. } => RABIT_ERR_PEER_LOST,
            TcpError::Timeout { .. } => RABIT_ERR_TIMEOUT,
            _ => RABIT_ERR_COLLECTIVE,
        },
        _ => RABIT_ERR_COLLECTIVE,
    }
}

/// Runs `f`, turning failures and panics into a status code.
fn guard(f: impl FnOnce() -> Result<(), Fail>) -> c_int {
    let codes = Codes {
        ok: RABIT_OK,
        internal: RABIT_ERR_INTERNAL,
    };
    ffi_util::guard(&LAST_ERROR, codes, f)
}

/// Serializes `RabitInit` and `RabitFinalize`, so that two threads cannot
/// both open the device (a second connection would disturb the group).
static LIFECYCLE: Mutex<()> = Mutex::new(());

/// `KEY=VALUE` arguments whose key starts with `DMLC_`: they override the
/// environment (rabit also takes its settings from argv).
///
/// # Safety
///
/// `argv` is NULL or points to `argc` pointers, each NULL or a
/// NUL-terminated string.
unsafe fn dmlc_args(
    argc: c_int,
    argv: *const *const c_char,
) -> Result<Vec<(String, String)>, Fail> {
    let n = usize::try_from(argc).map_err(|_| invalid(format!("argc is {argc}")))?;
    if n > 0 && argv.is_null() {
        return Err(invalid(format!("argv is NULL but argc is {argc}")));
    }
    let mut out = Vec::new();
    for i in 0..n {
        // SAFETY: `argv` has `argc` elements per the contract, and i < argc.
        let p = unsafe { argv.add(i).read() };
        if p.is_null() {
            continue;
        }
        // SAFETY: a non-NULL element is a NUL-terminated string.
        let arg = unsafe { CStr::from_ptr(p) }.to_bytes();
        if !arg.starts_with(b"DMLC_") {
            continue;
        }
        let text = std::str::from_utf8(arg)
            .map_err(|_| invalid(format!("argument {i} is not valid UTF-8")))?;
        if let Some((k, v)) = text.split_once('=') {
            out.push((k.to_string(), v.to_string()));
        }
    }
    Ok(out)
}

/// Joins the job described by the DMLC environment, where `argv` entries
/// `DMLC_NAME=VALUE` override the environment.
///
/// # Safety
///
/// `argv` is NULL or points to `argc` pointers, each NULL or a
/// NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn RabitInit(argc: c_int, argv: *const *const c_char) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let overrides = unsafe { dmlc_args(argc, argv) }?;
        let _lock = LIFECYCLE.lock().unwrap_or_else(|e| e.into_inner());
        if rabit::is_initialized() {
            return Err(RabitError::AlreadyInitialized.into());
        }
        let cfg = Config::from_lookup(|k| {
            overrides
                .iter()
                .rev()
                .find(|(name, _)| name == k)
                .map(|(_, v)| v.clone())
                .or_else(|| std::env::var(k).ok())
        })?;
        rabit::init_with(Rabit::with_config(&cfg)?)?;
        Ok(())
    })
}

/// Leaves the job: waits for every worker to arrive, then closes. The
/// worker is gone afterwards even if the wait failed.
#[no_mangle]
pub extern "C" fn RabitFinalize() -> c_int {
    guard(|| {
        let _lock = LIFECYCLE.lock().unwrap_or_else(|e| e.into_inner());
        Ok(rabit::finalize()?)
    })
}

/// This worker's rank (0 before `RabitInit`).
#[no_mangle]
pub extern "C" fn RabitGetRank() -> c_int {
    guard_value(0, || {
        c_int::try_from(rabit::get_rank()).unwrap_or(c_int::MAX)
    })
}

/// Number of workers (1 before `RabitInit`).
#[no_mangle]
pub extern "C" fn RabitGetWorldSize() -> c_int {
    guard_value(1, || {
        c_int::try_from(rabit::get_world_size()).unwrap_or(c_int::MAX)
    })
}

/// 1 if there is more than one worker, else 0.
#[no_mangle]
pub extern "C" fn RabitIsDistributed() -> c_int {
    guard_value(0, || c_int::from(rabit::is_distributed()))
}

/// Prints `msg` on stderr as whole lines (see [`rabit::tracker_print`]).
/// Bytes that are not UTF-8 are replaced.
///
/// # Safety
///
/// `msg` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn RabitTrackerPrint(msg: *const c_char) -> c_int {
    guard(|| {
        if msg.is_null() {
            return Err(invalid("msg is NULL"));
        }
        // SAFETY: a non-NULL `msg` is a NUL-terminated string per the contract.
        let text = unsafe { CStr::from_ptr(msg) }.to_string_lossy();
        rabit::tracker_print(&text);
        Ok(())
    })
}

/// Writes this machine's host name to `out_name` (at most `max_len` bytes
/// with the terminating NUL) and its full length to `*out_len`. A name too
/// long for the buffer is cut and reported as an error.
///
/// # Safety
///
/// `out_name` is NULL or writable for `max_len` bytes; `out_len` is NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn RabitGetProcessorName(
    out_name: *mut c_char,
    out_len: *mut c_ulong,
    max_len: c_ulong,
) -> c_int {
    guard(|| {
        if out_name.is_null() || out_len.is_null() {
            return Err(invalid("out_name or out_len is NULL"));
        }
        let max = usize::try_from(max_len).map_err(|_| invalid("max_len is too large"))?;
        if max == 0 {
            return Err(invalid("max_len is 0"));
        }
        let name = host_name();
        let n = name.len().min(max - 1);
        // SAFETY: `out_name` is writable for `max_len` bytes and n + 1 <=
        // max_len; `name` is a separate Rust allocation, so no overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(name.as_ptr(), out_name.cast::<u8>(), n);
            out_name.add(n).write(0);
        }
        let full = c_ulong::try_from(name.len()).unwrap_or(c_ulong::MAX);
        // SAFETY: `out_len` is non-NULL and writable per the contract.
        unsafe { out_len.write(full) };
        if n < name.len() {
            return Err(invalid(format!(
                "the name needs {} bytes, max_len is {max}",
                name.len() + 1
            )));
        }
        Ok(())
    })
}

/// The host name, without its terminating NUL.
fn host_name() -> Vec<u8> {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into `buf`, which
    // lives for the call.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast::<c_char>(), buf.len()) };
    if rc != 0 {
        return b"localhost".to_vec();
    }
    let len = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    buf[..len].to_vec()
}

/// Borrows `count` elements of `elem` bytes at `p` as bytes (empty for a
/// zero count, whatever `p` is).
///
/// # Safety
///
/// For a non-zero count, `p` is NULL or valid for reads and writes of
/// `count * elem` bytes, and nothing else accesses them during the borrow.
unsafe fn bytes_at<'a>(p: *mut c_void, count: usize, elem: usize) -> Result<&'a mut [u8], Fail> {
    if count == 0 {
        return Ok(&mut []);
    }
    if p.is_null() {
        return Err(invalid("buffer is NULL"));
    }
    let len = count
        .checked_mul(elem)
        .filter(|&n| isize::try_from(n).is_ok())
        .ok_or_else(|| invalid(format!("{count} elements of {elem} bytes is too large")))?;
    // SAFETY: per the contract, `p` is valid and unaliased for `len` bytes;
    // u8 has no alignment requirement.
    Ok(unsafe { std::slice::from_raw_parts_mut(p.cast::<u8>(), len) })
}

/// Every worker's `count` elements at `sendrecvbuf` become the element-wise
/// reduction of all workers'. `prepare_fun`, if not NULL, is called with
/// `prepare_arg` just before, to fill the buffer (as in rabit).
///
/// # Safety
///
/// `sendrecvbuf` is valid for reads and writes of `count` elements of
/// `enum_dtype`; `prepare_fun` is NULL or a function that does not unwind.
#[no_mangle]
pub unsafe extern "C" fn RabitAllreduce(
    sendrecvbuf: *mut c_void,
    count: usize,
    enum_dtype: c_int,
    enum_op: c_int,
    prepare_fun: Option<unsafe extern "C" fn(arg: *mut c_void)>,
    prepare_arg: *mut c_void,
) -> c_int {
    guard(|| {
        let dtype =
            dtype_of(enum_dtype).ok_or_else(|| invalid(format!("unknown dtype {enum_dtype}")))?;
        let op = op_of(enum_op).ok_or_else(|| invalid(format!("unknown op {enum_op}")))?;
        if !rabit::is_initialized() {
            return Err(RabitError::NotInitialized.into());
        }
        // SAFETY: forwarded from this function's contract.
        let buf = unsafe { bytes_at(sendrecvbuf, count, dtype.size()) }?;
        if let Some(prepare) = prepare_fun {
            // Called outside the worker's lock: it may call RabitGetRank.
            // SAFETY: a C function pointer given for this purpose; it gets
            // back the caller's own argument.
            unsafe { prepare(prepare_arg) };
        }
        Ok(rabit::allreduce_raw(dtype, op, buf)?)
    })
}

/// Every worker's `size` bytes at `sendrecv_data` become the root's.
///
/// # Safety
///
/// `sendrecv_data` is valid for reads and writes of `size` bytes.
#[no_mangle]
pub unsafe extern "C" fn RabitBroadcast(
    sendrecv_data: *mut c_void,
    size: c_ulong,
    root: c_int,
) -> c_int {
    guard(|| {
        let root = u32::try_from(root).map_err(|_| invalid(format!("root is {root}")))?;
        let size = usize::try_from(size).map_err(|_| invalid("size is too large"))?;
        if !rabit::is_initialized() {
            return Err(RabitError::NotInitialized.into());
        }
        // SAFETY: forwarded from this function's contract.
        let buf = unsafe { bytes_at(sendrecv_data, size, 1) }?;
        Ok(rabit::broadcast(buf, root)?)
    })
}

/// Returns once every worker has called it.
#[no_mangle]
pub extern "C" fn RabitBarrier() -> c_int {
    guard(|| Ok(rabit::barrier()?))
}

/// The message of the last failure on this thread ("" if none). Valid until
/// the next failing call on the same thread; never NULL.
#[no_mangle]
pub extern "C" fn RabitGetLastError() -> *const c_char {
    // The pointer stays valid while the thread-local string is unchanged,
    // which is until the next failure on this thread, as documented.
    ffi_util::last_error_ptr(&LAST_ERROR)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last_error() -> String {
        // SAFETY: RabitGetLastError returns a NUL-terminated string valid
        // until the next failure on this thread.
        unsafe { CStr::from_ptr(RabitGetLastError()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn numbers_map_to_the_device() {
        assert_eq!(dtype_of(RABIT_FLOAT), Some(Dtype::F32));
        assert_eq!(dtype_of(RABIT_ULONGLONG), Some(Dtype::U64));
        assert_eq!(
            dtype_of(RABIT_LONG).map(Dtype::size),
            Some(std::mem::size_of::<c_long>())
        );
        assert_eq!(dtype_of(12), None);
        assert_eq!(dtype_of(-1), None);
        assert_eq!(op_of(RABIT_BITOR), Some(Op::BitOR));
        assert_eq!(op_of(RABIT_AVG), Some(Op::Avg));
        assert_eq!(op_of(8), None);
        // Every device op is reachable from C.
        let ops: Vec<Op> = (0..8).filter_map(op_of).collect();
        assert_eq!(ops.len(), dmlc_driver::ReduceOp::ALL.len());
        let dtypes: std::collections::HashSet<Dtype> = (0..12).filter_map(dtype_of).collect();
        assert_eq!(dtypes.len(), Dtype::ALL.len());
    }

    #[test]
    fn errors_have_statuses_and_messages() {
        // Checked before the worker is looked at, so no global state is
        // touched (the_process_wide_worker in rabit.rs owns it).
        // SAFETY: NULL and a zero count are allowed.
        let rc = unsafe {
            RabitAllreduce(
                std::ptr::null_mut(),
                0,
                99,
                RABIT_SUM,
                None,
                std::ptr::null_mut(),
            )
        };
        assert_eq!(rc, RABIT_ERR_INVALID_ARGUMENT);
        assert_eq!(last_error(), "unknown dtype 99");
        // SAFETY: as above.
        let rc = unsafe { RabitBroadcast(std::ptr::null_mut(), 0, -1) };
        assert_eq!(rc, RABIT_ERR_INVALID_ARGUMENT);
        assert_eq!(last_error(), "root is -1");
        // SAFETY: NULL is refused.
        let rc = unsafe { RabitTrackerPrint(std::ptr::null()) };
        assert_eq!(rc, RABIT_ERR_INVALID_ARGUMENT);
        // SAFETY: argv NULL with a positive argc is refused before use.
        let rc = unsafe { RabitInit(2, std::ptr::null()) };
        assert_eq!(rc, RABIT_ERR_INVALID_ARGUMENT);
        assert_eq!(last_error(), "argv is NULL but argc is 2");
        assert_eq!(guard(|| panic!("boom")), RABIT_ERR_INTERNAL);
        assert_eq!(last_error(), "internal error: boom");
        let e = RabitError::Comm(CommError::Device(Error::PeerLost { peer: 1 }));
        assert_eq!(status_of(&e), RABIT_ERR_PEER_LOST);
        let e = RabitError::Comm(CommError::Tcp(TcpError::PeerClosed { rank: 1 }));
        assert_eq!(status_of(&e), RABIT_ERR_PEER_LOST);
        let f = Fail::from(RabitError::Comm(CommError::Device(Error::Timeout {
            peer: 1,
        })));
        assert_eq!(f.status, RABIT_ERR_TIMEOUT);
        assert!(f.msg.starts_with("collective timed out"), "{}", f.msg);
        assert_eq!(f.msg.matches("timed out").count(), 1, "{}", f.msg);
    }

    #[test]
    fn argv_settings_are_picked_out() {
        let args: Vec<CString> = [
            "prog",
            "DMLC_TASK_ID=1",
            "rabit_x=2",
            "DMLC_ROLE=worker",
            "DMLC_BAD",
        ]
        .iter()
        .map(|s| CString::new(*s).unwrap())
        .collect();
        let mut ptrs: Vec<*const c_char> = args.iter().map(|s| s.as_ptr()).collect();
        ptrs.push(std::ptr::null());
        // SAFETY: `ptrs` holds argc live strings and a NULL.
        let got = unsafe { dmlc_args(ptrs.len() as c_int, ptrs.as_ptr()) }
            .map_err(|f| f.msg)
            .unwrap();
        assert_eq!(
            got,
            vec![
                ("DMLC_TASK_ID".to_string(), "1".to_string()),
                ("DMLC_ROLE".to_string(), "worker".to_string())
            ]
        );
        // SAFETY: a zero argc never reads argv.
        assert!(unsafe { dmlc_args(0, std::ptr::null()) }.is_ok_and(|v| v.is_empty()));
    }

    #[test]
    fn processor_name_fits_or_says_so() {
        let mut buf = [0 as c_char; 300];
        let mut len: c_ulong = 0;
        // SAFETY: `buf` is writable for its length; `len` is writable.
        let rc = unsafe { RabitGetProcessorName(buf.as_mut_ptr(), &mut len, buf.len() as c_ulong) };
        assert_eq!(rc, RABIT_OK);
        // SAFETY: the function NUL-terminated the buffer.
        let name = unsafe { CStr::from_ptr(buf.as_ptr()) };
        assert_eq!(name.to_bytes().len() as c_ulong, len);
        assert_eq!(name.to_bytes(), host_name().as_slice());
        let mut two = [0x7f as c_char; 2];
        // SAFETY: as above, with a 2-byte buffer.
        let rc = unsafe { RabitGetProcessorName(two.as_mut_ptr(), &mut len, 2) };
        if host_name().len() > 1 {
            assert_eq!(rc, RABIT_ERR_INVALID_ARGUMENT);
        }
        assert_eq!(two[1], 0);
        // SAFETY: NULL pointers are refused.
        let rc = unsafe { RabitGetProcessorName(std::ptr::null_mut(), &mut len, 2) };
        assert_eq!(rc, RABIT_ERR_INVALID_ARGUMENT);
    }
}
