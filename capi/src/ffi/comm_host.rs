//! The requests of spec 5.X.6.13 on ordinary memory (`dmlc_send`,
//! `dmlc_recv`, `dmlc_alltoall(v)`, `dmlc_gather(v)`, `dmlc_scatter(v)`),
//! and the collectives on ordinary memory on a communicator
//! (`dmlc_*_host_comm`, `dmlc_barrier_comm`), through a staging buffer in
//! device memory ([`Stage`]), as `dmlc_driver::bounce` does for the group.
//!
//! Where requests are cut, every member cuts at the same places, from
//! numbers every member of the communicator knows:
//!
//! - send and receive: pieces of `max_bytes` rounded down to whole
//!   elements (spec 5.X.6.13.4, DRV-COMM-2), each one message, where
//!   `Device::send` and `Device::recv` cut (`Device::message_pieces`) and
//!   a receive ends as theirs do (`Device::message_piece_done`);
//! - the collectives of 5.X.6.3, all-to-all, gather and scatter: as the
//!   bounce buffer cuts those of the group (`dmlc_host_chunk_bytes`, over
//!   the communicator's size for the block collectives);
//! - the `v` forms: not cut (a member knows only its own counts, so the
//!   members could not agree on pieces): one request each.
//!
//! On communicator 0 the collectives of 5.X.6.3 go through the bounce
//! buffer itself (`dmlc_*_host`), so that they pair with those calls.

use std::sync::TryLockError;

use virtio_dmlc::comm::CommOpcode;
use virtio_dmlc::too_big;

use super::host::{bytes_of_count, host_in, host_out};
use super::*;
use dmlc_driver::{counts_table, CommInfo, CommRequest};

/// A staging buffer larger than this is freed after the call that needed
/// it (a message of up to `max_bytes` may need one that large).
const KEEP_BYTES: usize = 2 * dmlc_driver::bounce::DEFAULT_CHUNK_BYTES;

/// Smallest staging buffer allocated.
const MIN_BYTES: usize = 64;

/// A reusable staging buffer in device memory.
#[derive(Default)]
pub(crate) struct Stage {
    buf: Option<DmaBuf>,
}

impl Stage {
    /// The buffer, at least `bytes` long, free for a new request.
    fn buffer(&mut self, dev: &Device, bytes: usize) -> Result<&mut DmaBuf, Error> {
        // A request whose wait failed may still hold the old buffer: leave
        // it to that request and take a new one.
        if self
            .buf
            .as_ref()
            .is_none_or(|b| b.len() < bytes || b.is_in_flight())
        {
            self.buf = None; // free the old one before allocating
            self.buf = Some(dev.alloc(bytes.max(MIN_BYTES))?);
        }
        let buf = self.buf.as_mut().expect("staging buffer just set");
        // `&mut self` proves that the last call's borrows have ended.
        buf.reclaim();
        Ok(buf)
    }

    fn trim(&mut self) {
        if self.buf.as_ref().is_some_and(|b| b.len() > KEEP_BYTES) {
            self.buf = None;
        }
    }
}

/// Runs `f` with the device's staging buffer, or with a fresh one while
/// another thread uses it (a receive that waits must not hold up a send
/// on another thread).
fn with_stage(d: &DmlcDevice, f: impl FnOnce(&mut Stage) -> Result<(), Fail>) -> Result<(), Fail> {
    let mut cached = match d.stage.try_lock() {
        Ok(s) => s,
        Err(TryLockError::Poisoned(p)) => p.into_inner(),
        Err(TryLockError::WouldBlock) => return f(&mut Stage::default()),
    };
    let r = f(&mut cached);
    cached.trim();
    r
}

/// `count` elements of `dtype` at `p` (NULL only when there are none).
///
/// # Safety
///
/// `p` is NULL or readable for `count` elements, unchanged during the call.
unsafe fn input<'a>(
    p: *const c_void,
    count: u64,
    dtype: Dtype,
    what: &str,
) -> Result<&'a [u8], Fail> {
    let n = bytes_of_count(count, dtype)?;
    if n == 0 {
        return Ok(&[]);
    }
    // SAFETY: forwarded contract.
    unsafe { host_in(p, n, what) }
}

/// `count` elements of `dtype` at `p`, writable (NULL only when there are
/// none).
///
/// # Safety
///
/// `p` is NULL or readable and writable for `count` elements, not aliased
/// during the call.
unsafe fn output<'a>(
    p: *mut c_void,
    count: u64,
    dtype: Dtype,
    what: &str,
) -> Result<&'a mut [u8], Fail> {
    let n = bytes_of_count(count, dtype)?;
    if n == 0 {
        return Ok(&mut []);
    }
    // SAFETY: forwarded contract.
    unsafe { host_out(p, n, what) }
}

/// `a * b` bytes, or BAD_REQUEST / OVERFLOW.
fn times(a: usize, b: usize) -> Result<usize, Fail> {
    a.checked_mul(b)
        .ok_or_else(|| Fail::from(Error::bad_request(bad::OVERFLOW)))
}

/// The sum of `counts` elements of `dtype` in bytes.
fn sum_bytes(counts: &[u64], dtype: Dtype) -> Result<usize, Fail> {
    let total = counts
        .iter()
        .try_fold(0u64, |a, &c| a.checked_add(c))
        .ok_or_else(|| Fail::from(Error::bad_request(bad::OVERFLOW)))?;
    bytes_of_count(total, dtype)
}

/// `n` counts at `p` (NULL refused, naming `what`).
///
/// # Safety
///
/// `p` is NULL or readable for `n` numbers.
unsafe fn counts_at<'a>(p: *const u64, n: u32, what: &str) -> Result<&'a [u64], Fail> {
    if p.is_null() {
        return Err(Fail::invalid(format!("{what} is NULL")));
    }
    // SAFETY: readable for `n` numbers per the contract.
    Ok(unsafe { std::slice::from_raw_parts(p, n as usize) })
}

/// A device and one of its communicators.
struct On<'a> {
    d: &'a DmlcDevice,
    comm: u32,
    info: CommInfo,
}

impl<'a> On<'a> {
    /// `comm` of `d`, known to this member (BAD_REQUEST / BAD_COMM if not).
    fn new(d: &'a DmlcDevice, comm: u32) -> Result<Self, Fail> {
        Ok(On {
            d,
            comm,
            info: d.dev.comm_info(comm)?,
        })
    }

    fn dev(&self) -> &Device {
        &self.d.dev
    }

    fn size(&self) -> usize {
        self.info.size as usize
    }

    fn check_root(&self, root: u32) -> Result<(), Fail> {
        if root >= self.info.size {
            return Err(Fail {
                status: virtio_dmlc::STATUS_BAD_REQUEST as c_int,
                msg: format!(
                    "bad request: root {root} is not a rank of communicator {} of {}",
                    self.comm, self.info.size
                ),
            });
        }
        Ok(())
    }

    /// Bytes of one block per request of a block collective: the bounce
    /// buffer's chunk over the communicator's size, whole elements, at
    /// least one.
    fn block_piece(&self, dtype: Dtype) -> usize {
        (self.d.chunk / self.size() / dtype.size()).max(1) * dtype.size()
    }

    /// Bytes of one piece of an element-wise collective.
    fn step(&self, dtype: Dtype) -> usize {
        (self.d.chunk / dtype.size()).max(1) * dtype.size()
    }

    fn request(&self, opcode: CommOpcode, dtype: Dtype, bytes: usize) -> CommRequest {
        CommRequest::new(opcode, dtype, self.comm, (bytes / dtype.size()) as u64)
    }

    fn call(
        &self,
        req: &CommRequest,
        input: &[BufSlice],
        output: &[BufSlice],
    ) -> Result<dmlc_driver::Done, Error> {
        self.dev().comm_call(0, req, input, output, None)
    }

    /// A collective of 5.X.6.3 on this communicator, in place on the first
    /// `bytes` of `buf`.
    fn run_in_place(&self, req: Request, buf: &DmaBuf, bytes: usize) -> Result<(), Error> {
        let req = Request {
            in_place: true,
            comm: self.comm,
            ..req
        };
        self.dev()
            .call(0, &req, &[], &[buf.slice(0, bytes)], None)
            .map(drop)
    }
}

/// The request of a collective of 5.X.6.3 with `root`.
fn rooted(opcode: Opcode, dtype: Dtype, op: ReduceOp, root: u32, count: u64) -> Request {
    Request {
        root,
        ..Request::new(opcode, dtype, op, count)
    }
}

/// The number of elements of `dtype` in `bytes`.
fn elems(dtype: Dtype, bytes: usize) -> u64 {
    (bytes / dtype.size()) as u64
}

/// Sends `count` elements at `buf` to rank `peer` of `comm`.
///
/// # Safety
///
/// `dev` is NULL or an open device; `buf` is NULL or readable for `count`
/// elements of `dtype`.
#[no_mangle]
pub unsafe extern "C" fn dmlc_send(
    dev: *mut DmlcDevice,
    comm: u32,
    peer: u32,
    tag: u64,
    dtype: c_int,
    buf: *const c_void,
    count: u64,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let d = unsafe { device(dev) }?;
        let dtype = dtype_of(dtype)?;
        // SAFETY: forwarded contract.
        let data = unsafe { input(buf, count, dtype, "buf") }?;
        let on = On::new(d, comm)?;
        with_stage(d, |stage| {
            // Where the device's own send cuts (a message of no element is
            // one request too).
            for piece in on.dev().message_pieces(dtype, data.len()) {
                let part = &data[piece.clone()];
                let req = CommRequest {
                    peer,
                    tag,
                    ..on.request(CommOpcode::Send, dtype, part.len())
                };
                let buf = stage.buffer(on.dev(), part.len())?;
                buf.as_mut_slice()[..part.len()].copy_from_slice(part);
                let input: Vec<BufSlice> = if part.is_empty() {
                    Vec::new()
                } else {
                    vec![buf.slice(0, part.len())]
                };
                match on.call(&req, &input, &[]) {
                    Ok(_) => {}
                    // The room of the receive: the pieces before, and this
                    // one's (its last).
                    Err(Error::Truncated { length, peer }) => {
                        return Err(Error::Truncated {
                            length: piece.start as u64 + length,
                            peer,
                        }
                        .into())
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            Ok(())
        })
    })
}

/// Receives one message from rank `peer` of `comm` (or any) into `buf`,
/// room for `count` elements.
///
/// # Safety
///
/// `dev` is NULL or an open device; `buf` is NULL or writable for `count`
/// elements of `dtype`; `length` and `source` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn dmlc_recv(
    dev: *mut DmlcDevice,
    comm: u32,
    peer: u32,
    tag: u64,
    dtype: c_int,
    buf: *mut c_void,
    count: u64,
    length: *mut u64,
    source: *mut u32,
) -> c_int {
    let mut got = (0u64, NO_PEER);
    let status = guard(|| {
        // SAFETY: forwarded contract.
        let d = unsafe { device(dev) }?;
        let dtype = dtype_of(dtype)?;
        // SAFETY: forwarded contract.
        let room = unsafe { output(buf, count, dtype, "buf") }?;
        let on = On::new(d, comm)?;
        with_stage(d, |stage| {
            let total = room.len();
            let mut from = peer;
            // Where the device's own receive cuts, and ends.
            for piece in on.dev().message_pieces(dtype, total) {
                let k = piece.len();
                let req = CommRequest {
                    peer: from,
                    tag,
                    ..on.request(CommOpcode::Recv, dtype, k)
                };
                let buf = stage.buffer(on.dev(), k)?;
                let output: Vec<BufSlice> = if k == 0 {
                    Vec::new()
                } else {
                    vec![buf.slice(0, k)]
                };
                let reply = match on.call(&req, &[], &output) {
                    Ok(done) => done.reply,
                    Err(Error::Truncated { length, peer }) => {
                        // The message's size as far as known: the pieces
                        // before, and this one's.
                        got = (piece.start as u64 + length, peer);
                        return Err(Error::Truncated {
                            length: got.0,
                            peer,
                        }
                        .into());
                    }
                    Err(e) => return Err(e.into()),
                };
                let n = usize::try_from(reply.length).unwrap_or(usize::MAX).min(k);
                room[piece.start..piece.start + n].copy_from_slice(&buf.as_slice()[..n]);
                // Later pieces come from the sender of the first.
                from = reply.peer;
                got = ((piece.start + n) as u64, from);
                match on
                    .dev()
                    .message_piece_done(dtype, total, piece, reply.length, from)
                {
                    Ok(true) => return Ok(()),
                    Ok(false) => {}
                    // Spec 5.X.6.13.4: a message above max_bytes needs a
                    // receive of its size, or both ends cut elsewhere. The
                    // C library reports it as TRUNCATE, with the message's
                    // size.
                    Err(e) => {
                        let mut f = Fail::from(Error::Truncated {
                            length: got.0,
                            peer: from,
                        });
                        f.msg = match e {
                            Error::InvalidArgument(m) => m,
                            e => e.to_string(),
                        };
                        return Err(f);
                    }
                }
            }
            unreachable!("the last piece of a receive ends it")
        })
    });
    // SAFETY: NULL or writable per the contract.
    unsafe {
        if let Some(l) = length.as_mut() {
            *l = got.0;
        }
        if let Some(s) = source.as_mut() {
            *s = got.1;
        }
    }
    status
}

/// All-to-all on ordinary memory: block `j` of `send` goes to rank `j`.
///
/// # Safety
///
/// `dev` is NULL or an open device; `send` is NULL or readable and `recv`
/// NULL or writable for `size * count` elements of `dtype` (`size` the
/// communicator's); they do not overlap.
#[no_mangle]
pub unsafe extern "C" fn dmlc_alltoall(
    dev: *mut DmlcDevice,
    comm: u32,
    send: *const c_void,
    recv: *mut c_void,
    count: u64,
    dtype: c_int,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let d = unsafe { device(dev) }?;
        let dtype = dtype_of(dtype)?;
        let on = On::new(d, comm)?;
        let n = on.size();
        let c = bytes_of_count(count, dtype)?;
        let all = times(c, n)?;
        // SAFETY: forwarded contract.
        let (src, dst) = unsafe {
            (
                input(send, elems(dtype, all), dtype, "send")?,
                output(recv, elems(dtype, all), dtype, "recv")?,
            )
        };
        let piece = on.block_piece(dtype);
        with_stage(d, |stage| {
            let mut off = 0;
            while off < c {
                let k = piece.min(c - off);
                let buf = stage.buffer(on.dev(), 2 * n * k)?;
                let m = buf.as_mut_slice();
                for j in 0..n {
                    m[j * k..(j + 1) * k].copy_from_slice(&src[j * c + off..j * c + off + k]);
                }
                let req = on.request(CommOpcode::Alltoall, dtype, k);
                on.call(&req, &[buf.slice(0, n * k)], &[buf.slice(n * k, n * k)])?;
                let s = &buf.as_slice()[n * k..];
                for j in 0..n {
                    dst[j * c + off..j * c + off + k].copy_from_slice(&s[j * k..(j + 1) * k]);
                }
                off += k;
            }
            Ok(())
        })
    })
}

/// All-to-all with counts per pair on ordinary memory: one request.
///
/// # Safety
///
/// `dev` is NULL or an open device; `sendcounts` and `recvcounts` are NULL
/// or readable for the communicator's size; `send` is NULL or readable for
/// their sum of elements, `recv` NULL or writable for theirs; no overlap.
#[no_mangle]
pub unsafe extern "C" fn dmlc_alltoallv(
    dev: *mut DmlcDevice,
    comm: u32,
    send: *const c_void,
    recv: *mut c_void,
    sendcounts: *const u64,
    recvcounts: *const u64,
    dtype: c_int,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let d = unsafe { device(dev) }?;
        let dtype = dtype_of(dtype)?;
        let on = On::new(d, comm)?;
        // SAFETY: forwarded contract.
        let (sc, rc) = unsafe {
            (
                counts_at(sendcounts, on.info.size, "sendcounts")?,
                counts_at(recvcounts, on.info.size, "recvcounts")?,
            )
        };
        let (ib, ob) = (sum_bytes(sc, dtype)?, sum_bytes(rc, dtype)?);
        // SAFETY: forwarded contract.
        let (src, dst) = unsafe {
            (
                input(send, elems(dtype, ib), dtype, "send")?,
                output(recv, elems(dtype, ob), dtype, "recv")?,
            )
        };
        let table: Vec<u64> = sc.iter().chain(rc).copied().collect();
        let req = CommRequest {
            table: counts_table(&table),
            ..on.request(CommOpcode::Alltoallv, dtype, 0)
        };
        one_request(&on, &req, src, ib, dst, ob)
    })
}

/// Runs `req` once: `input` (`ib` bytes) in, `ob` bytes out into `out`
/// (the first `ob` bytes, if it is not empty).
fn one_request(
    on: &On<'_>,
    req: &CommRequest,
    input: &[u8],
    ib: usize,
    out: &mut [u8],
    ob: usize,
) -> Result<(), Fail> {
    let max = on.d.max_bytes;
    if ib as u64 > max || ob as u64 > max {
        return Err(Error::TooBig {
            detail: too_big::BYTES,
        }
        .into());
    }
    with_stage(on.d, |stage| {
        let buf = stage.buffer(on.dev(), ib + ob)?;
        buf.as_mut_slice()[..ib].copy_from_slice(&input[..ib]);
        let slice = |at, n| -> Vec<BufSlice> {
            if n == 0 {
                Vec::new()
            } else {
                vec![buf.slice(at, n)]
            }
        };
        on.call(req, &slice(0, ib), &slice(ib, ob))?;
        if !out.is_empty() {
            out[..ob].copy_from_slice(&buf.as_slice()[ib..ib + ob]);
        }
        Ok(())
    })
}

/// Gather to `root` on ordinary memory.
///
/// # Safety
///
/// `dev` is NULL or an open device; `send` is NULL or readable for `count`
/// elements; on the root `recv` is NULL or writable for `size * count`
/// elements (elsewhere unused); no overlap, except `send` NULL at the root:
/// its block of `recv` is its input.
#[no_mangle]
pub unsafe extern "C" fn dmlc_gather(
    dev: *mut DmlcDevice,
    comm: u32,
    send: *const c_void,
    recv: *mut c_void,
    count: u64,
    dtype: c_int,
    root: u32,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let d = unsafe { device(dev) }?;
        let dtype = dtype_of(dtype)?;
        let on = On::new(d, comm)?;
        on.check_root(root)?;
        let (n, r) = (on.size(), on.info.rank as usize);
        let is_root = r == root as usize;
        let c = bytes_of_count(count, dtype)?;
        let all = times(c, n)?;
        // SAFETY: forwarded contract.
        let dst = unsafe {
            if is_root {
                output(recv, elems(dtype, all), dtype, "recv")?
            } else {
                &mut []
            }
        };
        let in_place = is_root && send.is_null();
        let src = if in_place {
            &[]
        } else {
            // SAFETY: forwarded contract.
            unsafe { input(send, count, dtype, "send") }?
        };
        let piece = on.block_piece(dtype);
        with_stage(d, |stage| {
            let mut off = 0;
            while off < c {
                let k = piece.min(c - off);
                let req = on.request(CommOpcode::Gather, dtype, k);
                let req = CommRequest {
                    root,
                    in_place: is_root,
                    ..req
                };
                if is_root {
                    let buf = stage.buffer(on.dev(), n * k)?;
                    let m = buf.as_mut_slice();
                    let mine = if in_place {
                        &dst[r * c + off..r * c + off + k]
                    } else {
                        &src[off..off + k]
                    };
                    m[r * k..(r + 1) * k].copy_from_slice(mine);
                    on.call(&req, &[], &[buf.slice(0, n * k)])?;
                    let s = buf.as_slice();
                    for j in 0..n {
                        dst[j * c + off..j * c + off + k].copy_from_slice(&s[j * k..(j + 1) * k]);
                    }
                } else {
                    let buf = stage.buffer(on.dev(), k)?;
                    buf.as_mut_slice()[..k].copy_from_slice(&src[off..off + k]);
                    on.call(&req, &[buf.slice(0, k)], &[])?;
                }
                off += k;
            }
            Ok(())
        })
    })
}

/// Gather with a count per member on ordinary memory: one request.
///
/// # Safety
///
/// `dev` is NULL or an open device; `send` is NULL or readable for `count`
/// elements; on the root `recvcounts` is NULL or readable for the
/// communicator's size and `recv` NULL or writable for their sum (elsewhere
/// both unused); no overlap, except `send` NULL at the root: its block of
/// `recv` is its input.
#[no_mangle]
pub unsafe extern "C" fn dmlc_gatherv(
    dev: *mut DmlcDevice,
    comm: u32,
    send: *const c_void,
    recv: *mut c_void,
    count: u64,
    recvcounts: *const u64,
    dtype: c_int,
    root: u32,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let d = unsafe { device(dev) }?;
        let dtype = dtype_of(dtype)?;
        let on = On::new(d, comm)?;
        on.check_root(root)?;
        let r = on.info.rank as usize;
        let is_root = r == root as usize;
        let ib = bytes_of_count(count, dtype)?;
        let req = CommRequest {
            root,
            ..on.request(CommOpcode::Gatherv, dtype, ib)
        };
        if !is_root {
            // SAFETY: forwarded contract.
            let src = unsafe { input(send, count, dtype, "send") }?;
            return one_request(&on, &req, src, ib, &mut [], 0);
        }
        // SAFETY: forwarded contract.
        let rc = unsafe { counts_at(recvcounts, on.info.size, "recvcounts") }?;
        let ob = sum_bytes(rc, dtype)?;
        // SAFETY: forwarded contract.
        let dst = unsafe { output(recv, elems(dtype, ob), dtype, "recv") }?;
        let req = CommRequest {
            table: counts_table(rc),
            ..req
        };
        if send.is_null() {
            // In place: the root's input is its block of `recv`.
            let at = sum_bytes(&rc[..r], dtype)?;
            let mine = dst
                .get(at..at + ib)
                .ok_or_else(|| Fail::from(Error::bad_request(bad::INPUT_LENGTH)))?
                .to_vec();
            return one_request(&on, &req, &mine, ib, dst, ob);
        }
        // SAFETY: forwarded contract.
        let src = unsafe { input(send, count, dtype, "send") }?;
        one_request(&on, &req, src, ib, dst, ob)
    })
}

/// Scatter from `root` on ordinary memory.
///
/// # Safety
///
/// `dev` is NULL or an open device; on the root `send` is NULL or readable
/// for `size * count` elements (elsewhere unused); `recv` is NULL or
/// writable for `count` elements (NULL allowed at the root: its block
/// stays in `send`); no overlap.
#[no_mangle]
pub unsafe extern "C" fn dmlc_scatter(
    dev: *mut DmlcDevice,
    comm: u32,
    send: *const c_void,
    recv: *mut c_void,
    count: u64,
    dtype: c_int,
    root: u32,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let d = unsafe { device(dev) }?;
        let dtype = dtype_of(dtype)?;
        let on = On::new(d, comm)?;
        on.check_root(root)?;
        let (n, r) = (on.size(), on.info.rank as usize);
        let is_root = r == root as usize;
        let c = bytes_of_count(count, dtype)?;
        let all = times(c, n)?;
        // SAFETY: forwarded contract.
        let src = unsafe {
            if is_root {
                input(send, elems(dtype, all), dtype, "send")?
            } else {
                &[]
            }
        };
        let dst = if is_root && recv.is_null() {
            &mut []
        } else {
            // SAFETY: forwarded contract.
            unsafe { output(recv, count, dtype, "recv") }?
        };
        let piece = on.block_piece(dtype);
        with_stage(d, |stage| {
            let mut off = 0;
            while off < c {
                let k = piece.min(c - off);
                let req = CommRequest {
                    root,
                    in_place: is_root,
                    ..on.request(CommOpcode::Scatter, dtype, k)
                };
                if is_root {
                    let buf = stage.buffer(on.dev(), n * k)?;
                    let m = buf.as_mut_slice();
                    for j in 0..n {
                        m[j * k..(j + 1) * k].copy_from_slice(&src[j * c + off..j * c + off + k]);
                    }
                    on.call(&req, &[], &[buf.slice(0, n * k)])?;
                    if !dst.is_empty() {
                        dst[off..off + k].copy_from_slice(&buf.as_slice()[r * k..(r + 1) * k]);
                    }
                } else {
                    let buf = stage.buffer(on.dev(), k)?;
                    on.call(&req, &[], &[buf.slice(0, k)])?;
                    dst[off..off + k].copy_from_slice(&buf.as_slice()[..k]);
                }
                off += k;
            }
            Ok(())
        })
    })
}

/// Scatter with a count per member on ordinary memory: one request.
///
/// # Safety
///
/// `dev` is NULL or an open device; on the root `sendcounts` is NULL or
/// readable for the communicator's size and `send` NULL or readable for
/// their sum (elsewhere both unused); `recv` is NULL or writable for
/// `count` elements (NULL allowed at the root: its block stays in `send`);
/// no overlap.
#[no_mangle]
pub unsafe extern "C" fn dmlc_scatterv(
    dev: *mut DmlcDevice,
    comm: u32,
    send: *const c_void,
    recv: *mut c_void,
    sendcounts: *const u64,
    count: u64,
    dtype: c_int,
    root: u32,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let d = unsafe { device(dev) }?;
        let dtype = dtype_of(dtype)?;
        let on = On::new(d, comm)?;
        on.check_root(root)?;
        let is_root = on.info.rank == root;
        let ob = bytes_of_count(count, dtype)?;
        let req = CommRequest {
            root,
            ..on.request(CommOpcode::Scatterv, dtype, ob)
        };
        if !is_root {
            // SAFETY: forwarded contract.
            let dst = unsafe { output(recv, count, dtype, "recv") }?;
            return one_request(&on, &req, &[], 0, dst, ob);
        }
        // SAFETY: forwarded contract.
        let sc = unsafe { counts_at(sendcounts, on.info.size, "sendcounts") }?;
        let ib = sum_bytes(sc, dtype)?;
        // SAFETY: forwarded contract.
        let src = unsafe { input(send, elems(dtype, ib), dtype, "send") }?;
        let req = CommRequest {
            table: counts_table(sc),
            ..req
        };
        let mut kept = Vec::new();
        let dst = if recv.is_null() {
            // The root's own block is not wanted: it lands here.
            kept.resize(ob, 0);
            &mut kept[..]
        } else {
            // SAFETY: forwarded contract.
            unsafe { output(recv, count, dtype, "recv") }?
        };
        one_request(&on, &req, src, ib, dst, ob)
    })
}

// ---- The collectives of 5.X.6.3 on ordinary memory, on a communicator ----

/// `dmlc_allreduce_host` on communicator `comm`.
///
/// # Safety
///
/// As [`dmlc_allreduce_host`].
#[no_mangle]
pub unsafe extern "C" fn dmlc_allreduce_host_comm(
    dev: *mut DmlcDevice,
    comm: u32,
    send: *const c_void,
    recv: *mut c_void,
    count: u64,
    dtype: c_int,
    op: c_int,
) -> c_int {
    if comm == DMLC_COMM_WORLD {
        // SAFETY: forwarded contract.
        return unsafe { dmlc_allreduce_host(dev, send, recv, count, dtype, op) };
    }
    guard(|| {
        // SAFETY: forwarded contract.
        let d = unsafe { device(dev) }?;
        let (dtype, op) = (dtype_of(dtype)?, op_of(op)?);
        let on = On::new(d, comm)?;
        // SAFETY: forwarded contract.
        let data = unsafe { output(recv, count, dtype, "recv") }?;
        let src = if send.is_null() || std::ptr::eq(send, recv.cast_const()) {
            None
        } else {
            // SAFETY: forwarded contract (apart from `recv`).
            Some(unsafe { input(send, count, dtype, "send") }?)
        };
        let step = on.step(dtype);
        with_stage(d, |stage| {
            for (i, piece) in data.chunks_mut(step).enumerate() {
                let k = piece.len();
                let from = src.map_or(&*piece, |s| &s[i * step..i * step + k]);
                let buf = stage.buffer(on.dev(), k)?;
                buf.as_mut_slice()[..k].copy_from_slice(from);
                let req = Request::new(Opcode::Allreduce, dtype, op, elems(dtype, k));
                on.run_in_place(req, buf, k)?;
                piece.copy_from_slice(&buf.as_slice()[..k]);
            }
            Ok(())
        })
    })
}

/// `dmlc_broadcast_host` on communicator `comm` (`root` a rank of it).
///
/// # Safety
///
/// As [`dmlc_broadcast_host`].
#[no_mangle]
pub unsafe extern "C" fn dmlc_broadcast_host_comm(
    dev: *mut DmlcDevice,
    comm: u32,
    data: *mut c_void,
    count: u64,
    dtype: c_int,
    root: u32,
) -> c_int {
    if comm == DMLC_COMM_WORLD {
        // SAFETY: forwarded contract.
        return unsafe { dmlc_broadcast_host(dev, data, count, dtype, root) };
    }
    // SAFETY: forwarded contract.
    unsafe { rooted_host(dev, comm, data, count, dtype, None, root) }
}

/// `dmlc_reduce_host` on communicator `comm` (`root` a rank of it).
///
/// # Safety
///
/// As [`dmlc_reduce_host`].
#[no_mangle]
pub unsafe extern "C" fn dmlc_reduce_host_comm(
    dev: *mut DmlcDevice,
    comm: u32,
    data: *mut c_void,
    count: u64,
    dtype: c_int,
    op: c_int,
    root: u32,
) -> c_int {
    if comm == DMLC_COMM_WORLD {
        // SAFETY: forwarded contract.
        return unsafe { dmlc_reduce_host(dev, data, count, dtype, op, root) };
    }
    // SAFETY: forwarded contract.
    unsafe { rooted_host(dev, comm, data, count, dtype, Some(op), root) }
}

/// Broadcast (`op` None) or reduce in place on `data`, on `comm`.
///
/// # Safety
///
/// As [`dmlc_broadcast_host`].
unsafe fn rooted_host(
    dev: *mut DmlcDevice,
    comm: u32,
    data: *mut c_void,
    count: u64,
    dtype: c_int,
    op: Option<c_int>,
    root: u32,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let d = unsafe { device(dev) }?;
        let dtype = dtype_of(dtype)?;
        let op = op.map(op_of).transpose()?;
        let on = On::new(d, comm)?;
        on.check_root(root)?;
        // SAFETY: forwarded contract.
        let data = unsafe { output(data, count, dtype, "data") }?;
        let is_root = on.info.rank == root;
        let (opcode, rop) = match op {
            Some(o) => (Opcode::Reduce, o),
            None => (Opcode::Broadcast, ReduceOp::Sum),
        };
        let step = on.step(dtype);
        with_stage(d, |stage| {
            for piece in data.chunks_mut(step) {
                let k = piece.len();
                let buf = stage.buffer(on.dev(), k)?;
                // Broadcast reads the root's only; reduce every member's.
                if is_root || op.is_some() {
                    buf.as_mut_slice()[..k].copy_from_slice(piece);
                }
                on.run_in_place(rooted(opcode, dtype, rop, root, elems(dtype, k)), buf, k)?;
                // Reduce writes the root's only.
                if is_root || op.is_none() {
                    piece.copy_from_slice(&buf.as_slice()[..k]);
                }
            }
            Ok(())
        })
    })
}

/// `dmlc_allgather_host` on communicator `comm`: `recv` holds the
/// communicator's size times `sendcount` elements.
///
/// # Safety
///
/// As [`dmlc_allgather_host`], with the communicator's size.
#[no_mangle]
pub unsafe extern "C" fn dmlc_allgather_host_comm(
    dev: *mut DmlcDevice,
    comm: u32,
    send: *const c_void,
    recv: *mut c_void,
    sendcount: u64,
    dtype: c_int,
) -> c_int {
    if comm == DMLC_COMM_WORLD {
        // SAFETY: forwarded contract.
        return unsafe { dmlc_allgather_host(dev, send, recv, sendcount, dtype) };
    }
    guard(|| {
        // SAFETY: forwarded contract.
        let d = unsafe { device(dev) }?;
        let dtype = dtype_of(dtype)?;
        let on = On::new(d, comm)?;
        let (n, r) = (on.size(), on.info.rank as usize);
        let c = bytes_of_count(sendcount, dtype)?;
        let all = times(c, n)?;
        // SAFETY: forwarded contract (distinct, non-overlapping memory).
        let (src, dst) = unsafe {
            (
                input(send, sendcount, dtype, "send")?,
                output(recv, elems(dtype, all), dtype, "recv")?,
            )
        };
        let piece = on.block_piece(dtype);
        with_stage(d, |stage| {
            let mut off = 0;
            while off < c {
                let k = piece.min(c - off);
                let buf = stage.buffer(on.dev(), n * k)?;
                buf.as_mut_slice()[r * k..(r + 1) * k].copy_from_slice(&src[off..off + k]);
                let req = Request::new(Opcode::Allgather, dtype, ReduceOp::Sum, elems(dtype, k));
                on.run_in_place(req, buf, n * k)?;
                let s = buf.as_slice();
                for j in 0..n {
                    dst[j * c + off..j * c + off + k].copy_from_slice(&s[j * k..(j + 1) * k]);
                }
                off += k;
            }
            Ok(())
        })
    })
}

/// `dmlc_reduce_scatter_host` on communicator `comm`: `send` holds the
/// communicator's size times `recvcount` elements.
///
/// # Safety
///
/// As [`dmlc_reduce_scatter_host`], with the communicator's size.
#[no_mangle]
pub unsafe extern "C" fn dmlc_reduce_scatter_host_comm(
    dev: *mut DmlcDevice,
    comm: u32,
    send: *const c_void,
    recv: *mut c_void,
    recvcount: u64,
    dtype: c_int,
    op: c_int,
) -> c_int {
    if comm == DMLC_COMM_WORLD {
        // SAFETY: forwarded contract.
        return unsafe { dmlc_reduce_scatter_host(dev, send, recv, recvcount, dtype, op) };
    }
    guard(|| {
        // SAFETY: forwarded contract.
        let d = unsafe { device(dev) }?;
        let (dtype, op) = (dtype_of(dtype)?, op_of(op)?);
        let on = On::new(d, comm)?;
        let (n, r) = (on.size(), on.info.rank as usize);
        let c = bytes_of_count(recvcount, dtype)?;
        let all = times(c, n)?;
        // SAFETY: forwarded contract (distinct, non-overlapping memory).
        let (src, dst) = unsafe {
            (
                input(send, elems(dtype, all), dtype, "send")?,
                output(recv, recvcount, dtype, "recv")?,
            )
        };
        let piece = on.block_piece(dtype);
        with_stage(d, |stage| {
            let mut off = 0;
            while off < c {
                let k = piece.min(c - off);
                let buf = stage.buffer(on.dev(), n * k)?;
                let m = buf.as_mut_slice();
                for j in 0..n {
                    m[j * k..(j + 1) * k].copy_from_slice(&src[j * c + off..j * c + off + k]);
                }
                let req = Request::new(Opcode::ReduceScatter, dtype, op, elems(dtype, k));
                on.run_in_place(req, buf, n * k)?;
                dst[off..off + k].copy_from_slice(&buf.as_slice()[r * k..(r + 1) * k]);
                off += k;
            }
            Ok(())
        })
    })
}

/// `dmlc_barrier` on communicator `comm`.
///
/// # Safety
///
/// `dev` is NULL or an open device.
#[no_mangle]
pub unsafe extern "C" fn dmlc_barrier_comm(dev: *mut DmlcDevice, comm: u32) -> c_int {
    guard(|| {
        // SAFETY: forwarded contract.
        let d = unsafe { device(dev) }?;
        let req = Request {
            comm,
            ..Request::new(Opcode::Barrier, Dtype::U8, ReduceOp::Sum, 0)
        };
        d.dev.run(&req, None, None)?;
        Ok(())
    })
}
