//! The collectives on ordinary memory (`dmlc_*_host`), through the
//! device's one bounce buffer (`dmlc_driver::bounce`).

use super::*;

/// Allreduce on ordinary memory through the device's bounce buffer.
///
/// # Safety
///
/// `dev` is NULL or an open device; `send` is NULL, equal to `recv`, or
/// readable for `count` elements and not overlapping `recv`; `recv` is NULL
/// or readable and writable for `count` elements.
#[no_mangle]
pub unsafe extern "C" fn dmlc_allreduce_host(
    dev: *mut DmlcDevice,
    send: *const c_void,
    recv: *mut c_void,
    count: u64,
    dtype: c_int,
    op: c_int,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let d = unsafe { device(dev) }?;
        let dtype = dtype_of(dtype)?;
        let op = op_of(op)?;
        if recv.is_null() {
            return Err(Fail::invalid("recv is NULL"));
        }
        let bytes = bytes_of_count(count, dtype)?;
        let mut bounce = d.bounce.lock().unwrap_or_else(|e| e.into_inner());
        if send.is_null() || std::ptr::eq(send, recv.cast_const()) {
            // SAFETY: `recv` is readable and writable for `bytes` per the
            // contract (in place).
            let data = unsafe { std::slice::from_raw_parts_mut(recv.cast::<u8>(), bytes) };
            bounce.allreduce_in_place(&d.dev, dtype, op, data)?;
        } else {
            // SAFETY: `send` is readable and `recv` writable for `bytes` per
            // the contract, which also forbids partly overlapping buffers.
            let (input, output) = unsafe {
                (
                    std::slice::from_raw_parts(send.cast::<u8>(), bytes),
                    std::slice::from_raw_parts_mut(recv.cast::<u8>(), bytes),
                )
            };
            bounce.allreduce(&d.dev, dtype, op, input, output)?;
        }
        Ok(())
    })
}

/// `count` elements of `dtype` in bytes, or a BAD_REQUEST (overflow).
pub(super) fn bytes_of_count(count: u64, dtype: Dtype) -> Result<usize, Fail> {
    count
        .checked_mul(dtype.size() as u64)
        .and_then(|b| usize::try_from(b).ok())
        .ok_or_else(|| Fail::from(Error::bad_request(bad::OVERFLOW)))
}

/// `len` bytes at `p` (NULL refused, naming `what`), readable.
///
/// # Safety
///
/// `p` is NULL or readable for `len` bytes, unchanged while the slice lives.
pub(super) unsafe fn host_in<'a>(
    p: *const c_void,
    len: usize,
    what: &str,
) -> Result<&'a [u8], Fail> {
    if p.is_null() {
        return Err(Fail::invalid(format!("{what} is NULL")));
    }
    // SAFETY: readable for `len` bytes per the contract.
    Ok(unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) })
}

/// `len` bytes at `p` (NULL refused, naming `what`), writable.
///
/// # Safety
///
/// `p` is NULL or readable and writable for `len` bytes, not aliased while
/// the slice lives.
pub(super) unsafe fn host_out<'a>(
    p: *mut c_void,
    len: usize,
    what: &str,
) -> Result<&'a mut [u8], Fail> {
    if p.is_null() {
        return Err(Fail::invalid(format!("{what} is NULL")));
    }
    // SAFETY: readable and writable for `len` bytes, unaliased, per the
    // contract.
    Ok(unsafe { std::slice::from_raw_parts_mut(p.cast::<u8>(), len) })
}

/// Broadcast on ordinary memory through the device's bounce buffer.
///
/// # Safety
///
/// `dev` is NULL or an open device; `data` is NULL or readable and
/// writable for `count` elements.
#[no_mangle]
pub unsafe extern "C" fn dmlc_broadcast_host(
    dev: *mut DmlcDevice,
    data: *mut c_void,
    count: u64,
    dtype: c_int,
    root: u32,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let d = unsafe { device(dev) }?;
        let dtype = dtype_of(dtype)?;
        // SAFETY: forwarded contract.
        let data = unsafe { host_out(data, bytes_of_count(count, dtype)?, "data") }?;
        let mut bounce = d.bounce.lock().unwrap_or_else(|e| e.into_inner());
        Ok(bounce.broadcast(&d.dev, dtype, root, data)?)
    })
}

/// Reduce on ordinary memory, in place, through the bounce buffer.
///
/// # Safety
///
/// As [`dmlc_broadcast_host`].
#[no_mangle]
pub unsafe extern "C" fn dmlc_reduce_host(
    dev: *mut DmlcDevice,
    data: *mut c_void,
    count: u64,
    dtype: c_int,
    op: c_int,
    root: u32,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let d = unsafe { device(dev) }?;
        let (dtype, op) = (dtype_of(dtype)?, op_of(op)?);
        // SAFETY: forwarded contract.
        let data = unsafe { host_out(data, bytes_of_count(count, dtype)?, "data") }?;
        let mut bounce = d.bounce.lock().unwrap_or_else(|e| e.into_inner());
        Ok(bounce.reduce(&d.dev, dtype, op, root, data)?)
    })
}

/// Allgather on ordinary memory through the bounce buffer.
///
/// # Safety
///
/// `dev` is NULL or an open device; `send` is NULL or readable for
/// `sendcount` elements; `recv` is NULL or writable for `world_size *
/// sendcount` elements; the two do not overlap.
#[no_mangle]
pub unsafe extern "C" fn dmlc_allgather_host(
    dev: *mut DmlcDevice,
    send: *const c_void,
    recv: *mut c_void,
    sendcount: u64,
    dtype: c_int,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let d = unsafe { device(dev) }?;
        let dtype = dtype_of(dtype)?;
        let n = bytes_of_count(sendcount, dtype)?;
        let total = n
            .checked_mul(d.dev.world_size() as usize)
            .ok_or_else(|| Fail::from(Error::bad_request(bad::OVERFLOW)))?;
        // SAFETY: forwarded contract (distinct, non-overlapping memory).
        let (input, output) =
            unsafe { (host_in(send, n, "send")?, host_out(recv, total, "recv")?) };
        let mut bounce = d.bounce.lock().unwrap_or_else(|e| e.into_inner());
        Ok(bounce.allgather(&d.dev, dtype, input, output)?)
    })
}

/// Reduce-scatter on ordinary memory through the bounce buffer.
///
/// # Safety
///
/// `dev` is NULL or an open device; `send` is NULL or readable for
/// `world_size * recvcount` elements; `recv` is NULL or writable for
/// `recvcount` elements; the two do not overlap.
#[no_mangle]
pub unsafe extern "C" fn dmlc_reduce_scatter_host(
    dev: *mut DmlcDevice,
    send: *const c_void,
    recv: *mut c_void,
    recvcount: u64,
    dtype: c_int,
    op: c_int,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let d = unsafe { device(dev) }?;
        let (dtype, op) = (dtype_of(dtype)?, op_of(op)?);
        let n = bytes_of_count(recvcount, dtype)?;
        let total = n
            .checked_mul(d.dev.world_size() as usize)
            .ok_or_else(|| Fail::from(Error::bad_request(bad::OVERFLOW)))?;
        // SAFETY: forwarded contract (distinct, non-overlapping memory).
        let (input, output) =
            unsafe { (host_in(send, total, "send")?, host_out(recv, n, "recv")?) };
        let mut bounce = d.bounce.lock().unwrap_or_else(|e| e.into_inner());
        Ok(bounce.reduce_scatter(&d.dev, dtype, op, input, output)?)
    })
}
