//! Collectives independent of the path the data takes.
//!
//! [`Communicator`] is what a training program or a benchmark needs: rank,
//! world size, allreduce, broadcast, allgather and barrier. Three
//! implementations:
//!
//! - [`DeviceComm`]: through the virtio-dmlc device ([`Device`]), copying
//!   through a persistent bounce buffer in device-visible memory that grows as
//!   needed. [`DeviceComm::device`] gives the zero-copy path (allocate a
//!   [`crate::DmaBuf`] and call the device directly).
//! - [`crate::tcp::TcpComm`]: over TCP between the members.
//! - [`SelfComm`]: a group of one (no I/O), for running a program outside a
//!   job.
//!
//! Every implementation gives bitwise the same results: reductions are a left
//! fold in rank order 0..N-1, exactly as the device does them (see
//! [`reduce_rank_order`]). The trait's methods work on bytes so that it stays
//! usable as `dyn Communicator` (and from C); [`CommunicatorExt`] adds the
//! typed methods on slices of any [`Element`].
//!
//! ```no_run
//! use dmlc_guest::comm::{Communicator, CommunicatorExt, DeviceComm};
//! use dmlc_guest::{Device, OpenOptions, ReduceOp};
//! let dev = Device::open_host("/tmp/dmlc.sock0".as_ref(), &OpenOptions::default())?;
//! let mut comm: Box<dyn Communicator> = Box::new(DeviceComm::new(dev));
//! let mut grads = vec![1.0f32; 1024];
//! comm.allreduce(ReduceOp::Sum, &mut grads)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::sync::Arc;

use half::{bf16, f16};

use crate::device::{Device, DmaBuf, Element};
use crate::{Dtype, ReduceOp};

/// Errors of the collectives.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// The device failed the collective (the message says how).
    #[error(transparent)]
    Device(#[from] crate::Error),
    /// The TCP transport failed (the message says how).
    #[error(transparent)]
    Tcp(#[from] crate::tcp::TcpError),
    /// A caller mistake found before anything was sent.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// band, bor and bxor are not defined on floating-point types.
    #[error("reduce op {op} is not defined for {dtype}")]
    OpForDtype { op: ReduceOp, dtype: Dtype },
}

/// Result of the collectives.
pub type Result<T> = std::result::Result<T, CommError>;

/// The collectives of one member of a group.
///
/// Every member must call the same collectives in the same order with
/// matching arguments (same dtype, op, length and root). The byte-level
/// methods keep the trait object-safe; use [`CommunicatorExt`] for slices
/// of numbers.
pub trait Communicator: Send {
    /// This member's rank, 0..world_size.
    fn rank(&self) -> u32;

    /// Number of members.
    fn world_size(&self) -> u32;

    /// Name of the path: "device", "tcp" or "self".
    fn transport(&self) -> &'static str;

    /// Allreduce in place of `data`, elements of `dtype` (little-endian
    /// bytes; the length must be a multiple of the element size).
    fn allreduce_raw(&mut self, dtype: Dtype, op: ReduceOp, data: &mut [u8]) -> Result<()>;

    /// Every member's `data` gets the root's `data` (equal lengths).
    fn broadcast_raw(&mut self, root: u32, data: &mut [u8]) -> Result<()>;

    /// `output` (`world_size` times as long as `input`) gets every member's
    /// `input` in rank order.
    fn allgather_raw(&mut self, input: &[u8], output: &mut [u8]) -> Result<()>;

    /// Returns once every member has arrived.
    fn barrier(&mut self) -> Result<()>;
}

impl<C: Communicator + ?Sized> Communicator for Box<C> {
    fn rank(&self) -> u32 {
        (**self).rank()
    }
    fn world_size(&self) -> u32 {
        (**self).world_size()
    }
    fn transport(&self) -> &'static str {
        (**self).transport()
    }
    fn allreduce_raw(&mut self, dtype: Dtype, op: ReduceOp, data: &mut [u8]) -> Result<()> {
        (**self).allreduce_raw(dtype, op, data)
    }
    fn broadcast_raw(&mut self, root: u32, data: &mut [u8]) -> Result<()> {
        (**self).broadcast_raw(root, data)
    }
    fn allgather_raw(&mut self, input: &[u8], output: &mut [u8]) -> Result<()> {
        (**self).allgather_raw(input, output)
    }
    fn barrier(&mut self) -> Result<()> {
        (**self).barrier()
    }
}

/// Typed collectives on slices, for every [`Communicator`] (including
/// `dyn Communicator`).
pub trait CommunicatorExt: Communicator {
    /// Allreduce of `data` in place.
    fn allreduce<T: Element>(&mut self, op: ReduceOp, data: &mut [T]) -> Result<()> {
        self.allreduce_raw(T::DTYPE, op, bytes_of_mut(data))
    }

    /// Every member's `data` gets the root's.
    fn broadcast<T: Element>(&mut self, root: u32, data: &mut [T]) -> Result<()> {
        self.broadcast_raw(root, bytes_of_mut(data))
    }

    /// `output` (`world_size` times as long as `input`) gets every member's
    /// `input` in rank order.
    fn allgather<T: Element>(&mut self, input: &[T], output: &mut [T]) -> Result<()> {
        self.allgather_raw(bytes_of(input), bytes_of_mut(output))
    }
}

impl<C: Communicator + ?Sized> CommunicatorExt for C {}

pub(crate) fn bytes_of<T: Element>(data: &[T]) -> &[u8] {
    // SAFETY: every `Element` is a plain number type without padding, so its
    // bytes may be read as `u8`; the length is the slice's size in bytes.
    unsafe { std::slice::from_raw_parts(data.as_ptr().cast(), std::mem::size_of_val(data)) }
}

pub(crate) fn bytes_of_mut<T: Element>(data: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `bytes_of`; moreover every bit pattern is a valid value
    // of every `Element` type, so writing arbitrary bytes is sound.
    unsafe { std::slice::from_raw_parts_mut(data.as_mut_ptr().cast(), std::mem::size_of_val(data)) }
}

/// Checks an allreduce's arguments the same way on every path.
pub(crate) fn check_allreduce(dtype: Dtype, op: ReduceOp, len: usize) -> Result<()> {
    if !op.supports(dtype) {
        return Err(CommError::OpForDtype { op, dtype });
    }
    if !len.is_multiple_of(dtype.size()) {
        return Err(CommError::InvalidArgument(format!(
            "{len} bytes is not a whole number of {dtype} elements"
        )));
    }
    Ok(())
}

pub(crate) fn check_root(root: u32, world: u32) -> Result<()> {
    if root >= world {
        return Err(CommError::InvalidArgument(format!(
            "root {root} is not in a group of {world}"
        )));
    }
    Ok(())
}

pub(crate) fn check_allgather(input: usize, output: usize, world: u32) -> Result<()> {
    if input.checked_mul(world as usize) != Some(output) {
        return Err(CommError::InvalidArgument(format!(
            "allgather output has {output} bytes, {input} x {world} needed"
        )));
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// The reduction, as the device defines it (docs/spec.md, 5.X.6.5).

/// Arithmetic of an accumulator type.
trait Arith: Copy + Default {
    fn add(self, x: Self) -> Self;
    fn mul(self, x: Self) -> Self;
    /// Keeps `self` (the lower ranks' value) on ties; NaN if either is NaN.
    fn min_of(self, x: Self) -> Self;
    fn max_of(self, x: Self) -> Self;
    /// `self / world`; integers truncate toward zero.
    fn div_world(self, world: u32) -> Self;
}

/// Bitwise ops of the integer types.
trait Bits: Arith {
    fn and(self, x: Self) -> Self;
    fn or(self, x: Self) -> Self;
    fn xor(self, x: Self) -> Self;
}

macro_rules! float_arith {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            #[inline(always)]
            fn add(self, x: Self) -> Self { self + x }
            #[inline(always)]
            fn mul(self, x: Self) -> Self { self * x }
            #[inline(always)]
            fn min_of(self, x: Self) -> Self {
                // A NaN `x` fails the comparison and is taken; a NaN `self`
                // is kept. Same choice as the backend, also on -0/+0 ties.
                if self.is_nan() | (x >= self) { self } else { x }
            }
            #[inline(always)]
            fn max_of(self, x: Self) -> Self {
                if self.is_nan() | (x <= self) { self } else { x }
            }
            #[inline(always)]
            fn div_world(self, world: u32) -> Self { self / world as $t }
        }
    )*};
}
float_arith!(f32, f64);

macro_rules! int_arith {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            #[inline(always)]
            fn add(self, x: Self) -> Self { self.wrapping_add(x) }
            #[inline(always)]
            fn mul(self, x: Self) -> Self { self.wrapping_mul(x) }
            #[inline(always)]
            fn min_of(self, x: Self) -> Self { Ord::min(self, x) }
            #[inline(always)]
            fn max_of(self, x: Self) -> Self { Ord::max(self, x) }
            #[inline(always)]
            fn div_world(self, world: u32) -> Self {
                // i128 holds every value of every integer dtype; `/`
                // truncates toward zero, and the quotient fits the type.
                (self as i128 / i128::from(world)) as $t
            }
        }
        impl Bits for $t {
            #[inline(always)]
            fn and(self, x: Self) -> Self { self & x }
            #[inline(always)]
            fn or(self, x: Self) -> Self { self | x }
            #[inline(always)]
            fn xor(self, x: Self) -> Self { self ^ x }
        }
    )*};
}
int_arith!(i8, u8, i32, u32, i64, u64);

/// A dtype's element and its accumulator.
trait Scalar: Element {
    type Acc: Arith;
    fn widen(self) -> Self::Acc;
    fn narrow(a: Self::Acc) -> Self;
}

macro_rules! same_scalar {
    ($($t:ty),*) => {$(
        impl Scalar for $t {
            type Acc = $t;
            #[inline(always)]
            fn widen(self) -> $t { self }
            #[inline(always)]
            fn narrow(a: $t) -> $t { a }
        }
    )*};
}
same_scalar!(f32, f64, i8, u8, i32, u32, i64, u64);

impl Scalar for f16 {
    type Acc = f32;
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn narrow(a: f32) -> f16 {
        // Round to nearest, ties to even, once.
        f16::from_f32(a)
    }
}

impl Scalar for bf16 {
    type Acc = f32;
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn narrow(a: f32) -> bf16 {
        bf16::from_f32(a)
    }
}

/// Elements folded per step: the accumulator block stays in L1.
const BLOCK: usize = 512;

/// `own` (the contribution of rank `own_rank`) becomes the left fold, in
/// rank order, of `own` and `others` (every other rank's contribution, in
/// rank order, `own_rank` left out), then divided by the world size if
/// `avg`.
fn fold<T: Scalar>(
    own_rank: usize,
    own: &mut [T],
    others: &[&[T]],
    f: impl Fn(T::Acc, T::Acc) -> T::Acc,
    avg: bool,
) {
    let world = others.len() + 1;
    let mut acc = [T::Acc::default(); BLOCK];
    let mut start = 0;
    while start < own.len() {
        let end = (start + BLOCK).min(own.len());
        let acc = &mut acc[..end - start];
        for k in 0..world {
            let src: &[T] = if k == own_rank {
                &own[start..end]
            } else {
                &others[k - usize::from(k > own_rank)][start..end]
            };
            if k == 0 {
                for (a, &x) in acc.iter_mut().zip(src) {
                    *a = x.widen();
                }
            } else {
                for (a, &x) in acc.iter_mut().zip(src) {
                    *a = f(*a, x.widen());
                }
            }
        }
        if avg {
            for (o, &a) in own[start..end].iter_mut().zip(acc.iter()) {
                *o = T::narrow(a.div_world(world as u32));
            }
        } else {
            for (o, &a) in own[start..end].iter_mut().zip(acc.iter()) {
                *o = T::narrow(a);
            }
        }
        start = end;
    }
}

fn fold_arith<T: Scalar>(op: ReduceOp, own_rank: usize, own: &mut [T], others: &[&[T]]) {
    match op {
        ReduceOp::Sum => fold(own_rank, own, others, Arith::add, false),
        ReduceOp::Avg => fold(own_rank, own, others, Arith::add, true),
        ReduceOp::Prod => fold(own_rank, own, others, Arith::mul, false),
        ReduceOp::Min => fold(own_rank, own, others, Arith::min_of, false),
        ReduceOp::Max => fold(own_rank, own, others, Arith::max_of, false),
        // Callers check `op.supports(dtype)` first; integers go through
        // `fold_int`.
        ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor => {
            debug_assert!(false, "bitwise op on a float type")
        }
    }
}

fn fold_int<T: Scalar>(op: ReduceOp, own_rank: usize, own: &mut [T], others: &[&[T]])
where
    T::Acc: Bits,
{
    match op {
        ReduceOp::Band => fold(own_rank, own, others, Bits::and, false),
        ReduceOp::Bor => fold(own_rank, own, others, Bits::or, false),
        ReduceOp::Bxor => fold(own_rank, own, others, Bits::xor, false),
        _ => fold_arith(op, own_rank, own, others),
    }
}

/// `&[u8]` as `&[T]`, if aligned and of a whole number of elements.
fn cast<T: Element>(b: &[u8]) -> Option<&[T]> {
    // SAFETY: every bit pattern is a valid `Element`; `align_to` only puts
    // properly aligned whole elements in the middle part.
    let (pre, mid, post) = unsafe { b.align_to::<T>() };
    (pre.is_empty() && post.is_empty()).then_some(mid)
}

fn cast_mut<T: Element>(b: &mut [u8]) -> Option<&mut [T]> {
    // SAFETY: as in `cast`.
    let (pre, mid, post) = unsafe { b.align_to_mut::<T>() };
    (pre.is_empty() && post.is_empty()).then_some(mid)
}

/// An 8-byte aligned byte buffer (aligned for every dtype).
#[derive(Default)]
pub(crate) struct Aligned(Vec<u64>);

impl Aligned {
    /// Makes room for `len` bytes; returns them (contents unspecified).
    pub(crate) fn bytes(&mut self, len: usize) -> &mut [u8] {
        let words = len.div_ceil(8);
        if self.0.len() < words {
            self.0.resize(words, 0);
        }
        &mut bytes_of_mut(&mut self.0[..])[..len]
    }
}

fn reduce_typed<T: Scalar>(
    op: ReduceOp,
    own_rank: usize,
    own: &mut [u8],
    others: &[&[u8]],
    folder: fn(ReduceOp, usize, &mut [T], &[&[T]]),
) {
    let typed: Option<Vec<&[T]>> = others.iter().map(|o| cast::<T>(o)).collect();
    let mut copies = Vec::new();
    let others: Vec<&[T]> = match typed {
        Some(t) => t,
        None => {
            // Misaligned input (possible only from callers of the byte
            // API): reduce aligned copies.
            copies = others
                .iter()
                .map(|o| {
                    let mut a = Aligned::default();
                    a.bytes(o.len()).copy_from_slice(o);
                    (a, o.len())
                })
                .collect::<Vec<_>>();
            copies
                .iter_mut()
                .map(|(a, len)| &*cast_mut::<T>(a.bytes(*len)).expect("aligned copy"))
                .collect()
        }
    };
    match cast_mut::<T>(own) {
        Some(own) => folder(op, own_rank, own, &others),
        None => {
            let mut a = Aligned::default();
            let len = own.len();
            a.bytes(len).copy_from_slice(own);
            folder(
                op,
                own_rank,
                cast_mut::<T>(a.bytes(len)).expect("aligned copy"),
                &others,
            );
            own.copy_from_slice(a.bytes(len));
        }
    }
    drop(copies);
}

/// `own` (rank `own_rank`'s contribution) becomes the reduction of `own`
/// and `others` (the other ranks' contributions in rank order, of the same
/// length). Arguments must have been checked with [`check_allreduce`].
pub(crate) fn reduce_into(
    dtype: Dtype,
    op: ReduceOp,
    own_rank: usize,
    own: &mut [u8],
    others: &[&[u8]],
) {
    debug_assert!(others.iter().all(|o| o.len() == own.len()));
    match dtype {
        Dtype::F32 => reduce_typed::<f32>(op, own_rank, own, others, fold_arith),
        Dtype::F64 => reduce_typed::<f64>(op, own_rank, own, others, fold_arith),
        Dtype::F16 => reduce_typed::<f16>(op, own_rank, own, others, fold_arith),
        Dtype::Bf16 => reduce_typed::<bf16>(op, own_rank, own, others, fold_arith),
        Dtype::I8 => reduce_typed::<i8>(op, own_rank, own, others, fold_int),
        Dtype::U8 => reduce_typed::<u8>(op, own_rank, own, others, fold_int),
        Dtype::I32 => reduce_typed::<i32>(op, own_rank, own, others, fold_int),
        Dtype::U32 => reduce_typed::<u32>(op, own_rank, own, others, fold_int),
        Dtype::I64 => reduce_typed::<i64>(op, own_rank, own, others, fold_int),
        Dtype::U64 => reduce_typed::<u64>(op, own_rank, own, others, fold_int),
    }
}

/// The device's reduction of `inputs` (one per rank, in rank order, equal
/// lengths, elements of `dtype` as little-endian bytes) into `out`.
///
/// A left fold in rank order: `acc = x0; acc = acc op x1; ...`, in the
/// accumulator type (f16 and bf16 in f32, rounded to nearest-even once at
/// the end), integers wrapping, avg = sum / N (integers truncate toward
/// zero), float min/max NaN if any input is NaN (between equal values the
/// lower rank's is kept). The result is bitwise what the device computes.
pub fn reduce_rank_order(
    dtype: Dtype,
    op: ReduceOp,
    inputs: &[&[u8]],
    out: &mut [u8],
) -> Result<()> {
    check_allreduce(dtype, op, out.len())?;
    let Some((first, rest)) = inputs.split_first() else {
        return Err(CommError::InvalidArgument("no inputs to reduce".into()));
    };
    if inputs.iter().any(|i| i.len() != out.len()) {
        return Err(CommError::InvalidArgument(
            "inputs and output differ in length".into(),
        ));
    }
    out.copy_from_slice(first);
    reduce_into(dtype, op, 0, out, rest);
    Ok(())
}

/// [`reduce_rank_order`] on typed slices.
pub fn reduce_slices<T: Element>(op: ReduceOp, inputs: &[&[T]], out: &mut [T]) -> Result<()> {
    let inputs: Vec<&[u8]> = inputs.iter().map(|i| bytes_of(i)).collect();
    reduce_rank_order(T::DTYPE, op, &inputs, bytes_of_mut(out))
}

// ---------------------------------------------------------------------------
// A group of one.

/// A group of one member: every collective is local (allreduce applies the
/// op to the single contribution, which changes nothing but the NaN bits of
/// f16/bf16).
#[derive(Clone, Copy, Debug, Default)]
pub struct SelfComm;

impl Communicator for SelfComm {
    fn rank(&self) -> u32 {
        0
    }
    fn world_size(&self) -> u32 {
        1
    }
    fn transport(&self) -> &'static str {
        "self"
    }
    fn allreduce_raw(&mut self, dtype: Dtype, op: ReduceOp, data: &mut [u8]) -> Result<()> {
        check_allreduce(dtype, op, data.len())?;
        reduce_into(dtype, op, 0, data, &[]);
        Ok(())
    }
    fn broadcast_raw(&mut self, root: u32, _data: &mut [u8]) -> Result<()> {
        check_root(root, 1)
    }
    fn allgather_raw(&mut self, input: &[u8], output: &mut [u8]) -> Result<()> {
        check_allgather(input.len(), output.len(), 1)?;
        output.copy_from_slice(input);
        Ok(())
    }
    fn barrier(&mut self) -> Result<()> {
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// Through the device.

/// Largest piece one request carries by default: keeps the bounce buffer
/// (and the device-visible memory it needs) small.
pub const DEVICE_CHUNK_BYTES: usize = 16 << 20;

/// Collectives through the virtio-dmlc device, on ordinary memory copied
/// through a bounce buffer in device-visible memory.
///
/// The bounce buffer is allocated at first use and grown as needed (up to
/// the chunk size), then kept, so repeated collectives cost the copies and
/// the device's work only. Data larger than the chunk size (the smaller of
/// the device's `max_bytes` and [`DEVICE_CHUNK_BYTES`]) runs as several
/// requests; every member cuts at the same places because the chunk size
/// depends only on the group's config.
///
/// The bounce buffer lives in the device-visible memory of the [`Device`]
/// (`OpenOptions::dma_bytes`), which must have room for it: up to the chunk
/// size for allreduce and broadcast, `world_size` times the data (up to the
/// chunk size) for allgather. Zero-length collectives return at once
/// without a request.
///
/// For zero copy, allocate buffers with `comm.device().alloc(..)` and call
/// the [`Device`] methods (e.g. [`Device::allreduce_in_place`]) directly.
pub struct DeviceComm {
    dev: Arc<Device>,
    bounce: Option<DmaBuf>,
    chunk_bytes: usize,
}

impl DeviceComm {
    /// Wraps an open device (or a shared `Arc<Device>`).
    pub fn new(dev: impl Into<Arc<Device>>) -> Self {
        let dev = dev.into();
        let max = usize::try_from(dev.config().max_bytes.get()).unwrap_or(usize::MAX);
        let mut comm = DeviceComm {
            dev,
            bounce: None,
            chunk_bytes: 0,
        };
        comm.set_chunk_bytes(max.min(DEVICE_CHUNK_BYTES));
        comm
    }

    /// The device, for zero-copy collectives on [`DmaBuf`]s.
    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// Largest piece per request (rounded down to a multiple of 8 bytes,
    /// at least 8). Must be the same on every member.
    pub fn set_chunk_bytes(&mut self, bytes: usize) {
        self.chunk_bytes = (bytes / 8 * 8).max(8);
    }

    /// Largest piece per request.
    pub fn chunk_bytes(&self) -> usize {
        self.chunk_bytes
    }

    fn bounce<'a>(
        slot: &'a mut Option<DmaBuf>,
        dev: &Device,
        bytes: usize,
    ) -> Result<&'a mut DmaBuf> {
        // A request whose wait failed may still hold the old one.
        if slot
            .as_ref()
            .is_none_or(|b| b.len() < bytes || b.is_in_flight())
        {
            *slot = None; // free the old one first
            *slot = Some(dev.alloc(bytes.max(64))?);
        }
        let buf = slot.as_mut().expect("bounce buffer just set");
        // `&mut` proves that the last call's borrows have ended.
        buf.reclaim();
        Ok(buf)
    }
}

impl std::fmt::Debug for DeviceComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceComm")
            .field("dev", &self.dev)
            .field("chunk_bytes", &self.chunk_bytes)
            .finish()
    }
}

impl Communicator for DeviceComm {
    fn rank(&self) -> u32 {
        self.dev.rank()
    }

    fn world_size(&self) -> u32 {
        self.dev.world_size()
    }

    fn transport(&self) -> &'static str {
        "device"
    }

    fn allreduce_raw(&mut self, dtype: Dtype, op: ReduceOp, data: &mut [u8]) -> Result<()> {
        check_allreduce(dtype, op, data.len())?;
        let size = dtype.size();
        let step = (self.chunk_bytes / size).max(1) * size;
        for piece in data.chunks_mut(step) {
            let buf = Self::bounce(&mut self.bounce, &self.dev, piece.len())?;
            buf.as_mut_slice()[..piece.len()].copy_from_slice(piece);
            let count = (piece.len() / size) as u64;
            self.dev.allreduce_in_place(dtype, op, buf, count)?;
            piece.copy_from_slice(&buf.as_slice()[..piece.len()]);
        }
        Ok(())
    }

    fn broadcast_raw(&mut self, root: u32, data: &mut [u8]) -> Result<()> {
        check_root(root, self.world_size())?;
        let is_root = root == self.rank();
        for piece in data.chunks_mut(self.chunk_bytes) {
            let buf = Self::bounce(&mut self.bounce, &self.dev, piece.len())?;
            if is_root {
                buf.as_mut_slice()[..piece.len()].copy_from_slice(piece);
            }
            self.dev
                .broadcast_in_place(Dtype::U8, root, buf, piece.len() as u64)?;
            piece.copy_from_slice(&buf.as_slice()[..piece.len()]);
        }
        Ok(())
    }

    fn allgather_raw(&mut self, input: &[u8], output: &mut [u8]) -> Result<()> {
        let world = self.world_size() as usize;
        check_allgather(input.len(), output.len(), world as u32)?;
        let rank = self.rank() as usize;
        let piece_max = (self.chunk_bytes / world).max(1);
        let mut off = 0;
        while off < input.len() {
            let n = piece_max.min(input.len() - off);
            let buf = Self::bounce(&mut self.bounce, &self.dev, n * world)?;
            buf.as_mut_slice()[rank * n..(rank + 1) * n].copy_from_slice(&input[off..off + n]);
            self.dev.allgather_in_place(Dtype::U8, buf, n as u64)?;
            for j in 0..world {
                let dst = j * input.len() + off;
                output[dst..dst + n].copy_from_slice(&buf.as_slice()[j * n..(j + 1) * n]);
            }
            off += n;
        }
        Ok(())
    }

    fn barrier(&mut self) -> Result<()> {
        Ok(self.dev.barrier()?)
    }
}

#[cfg(test)]
pub(crate) mod testutil {
    //! Shared by the tests of comm, tcp and rabit: data of every dtype, and
    //! the backend daemon started next to the test binary.

    use std::path::{Path, PathBuf};
    use std::process::{Child, Command, Stdio};
    use std::sync::{Mutex, MutexGuard};
    use std::time::{Duration, Instant};

    use virtio_dmlc::{Dtype, ReduceOp};

    /// The heavy tests (daemon, many threads) run one at a time: the
    /// machine may have two cores.
    pub fn serial() -> MutexGuard<'static, ()> {
        static LOCK: Mutex<()> = Mutex::new(());
        LOCK.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A small deterministic generator (xorshift64*).
    pub struct Rng(pub u64);

    impl Rng {
        pub fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
    }

    /// `count` elements of `dtype` as bytes: floats are small values of
    /// mixed sign and magnitude (sums of them round), with an occasional
    /// NaN if `nan`; integers are arbitrary bits.
    pub fn data(dtype: Dtype, count: usize, seed: u64, nan: bool) -> Vec<u8> {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let mut out = Vec::with_capacity(count * dtype.size());
        for i in 0..count {
            let r = rng.next();
            let f = ((r >> 11) as f64 / (1u64 << 53) as f64 - 0.5)
                * [1.0, 3.0e-3, 7.0e2][(r % 3) as usize];
            let f = if nan && i % 97 == 13 { f64::NAN } else { f };
            match dtype {
                Dtype::F32 => out.extend((f as f32).to_le_bytes()),
                Dtype::F64 => out.extend(f.to_le_bytes()),
                Dtype::F16 => out.extend(half::f16::from_f64(f).to_le_bytes()),
                Dtype::Bf16 => out.extend(half::bf16::from_f64(f).to_le_bytes()),
                _ => out.extend(&r.to_le_bytes()[..dtype.size()]),
            }
        }
        out
    }

    /// True if `a` and `b` are bitwise equal, counting any two NaNs as
    /// equal (the spec leaves NaN payloads open).
    pub fn same(dtype: Dtype, a: &[u8], b: &[u8]) -> bool {
        if a.len() != b.len() {
            return false;
        }
        let nan = |x: &[u8]| match dtype {
            Dtype::F32 => f32::from_le_bytes(x.try_into().unwrap()).is_nan(),
            Dtype::F64 => f64::from_le_bytes(x.try_into().unwrap()).is_nan(),
            Dtype::F16 => half::f16::from_le_bytes(x.try_into().unwrap()).is_nan(),
            Dtype::Bf16 => half::bf16::from_le_bytes(x.try_into().unwrap()).is_nan(),
            _ => false,
        };
        a.chunks(dtype.size())
            .zip(b.chunks(dtype.size()))
            .all(|(x, y)| x == y || (nan(x) && nan(y)))
    }

    /// Every (dtype, op) pair the device defines.
    pub fn all_pairs() -> impl Iterator<Item = (Dtype, ReduceOp)> {
        Dtype::ALL.iter().flat_map(|&d| {
            ReduceOp::ALL
                .iter()
                .filter(move |op| op.supports(d))
                .map(move |&op| (d, op))
        })
    }

    macro_rules! naive_float {
        ($t:ty, $acc:ty, $from:expr, $to:expr, $op:expr, $inputs:expr, $out:expr) => {{
            let sz = std::mem::size_of::<$t>();
            let world = $inputs.len();
            for i in 0..$out.len() / sz {
                let x = |r: usize| {
                    let b: [u8; std::mem::size_of::<$t>()] =
                        $inputs[r][i * sz..(i + 1) * sz].try_into().unwrap();
                    $from(<$t>::from_le_bytes(b))
                };
                let mut acc = x(0);
                for r in 1..world {
                    let v = x(r);
                    acc = match $op {
                        ReduceOp::Sum | ReduceOp::Avg => acc + v,
                        ReduceOp::Prod => acc * v,
                        ReduceOp::Min | ReduceOp::Max if acc.is_nan() || v.is_nan() => <$acc>::NAN,
                        ReduceOp::Min => {
                            if v < acc {
                                v
                            } else {
                                acc
                            }
                        }
                        ReduceOp::Max => {
                            if v > acc {
                                v
                            } else {
                                acc
                            }
                        }
                        _ => unreachable!("bitwise op on floats"),
                    };
                }
                if $op == ReduceOp::Avg {
                    acc /= world as $acc;
                }
                let out: $t = $to(acc);
                $out[i * sz..(i + 1) * sz].copy_from_slice(&out.to_le_bytes());
            }
        }};
    }

    macro_rules! naive_int {
        ($t:ty, $op:expr, $inputs:expr, $out:expr) => {{
            let sz = std::mem::size_of::<$t>();
            let world = $inputs.len();
            for i in 0..$out.len() / sz {
                let x = |r: usize| {
                    <$t>::from_le_bytes($inputs[r][i * sz..(i + 1) * sz].try_into().unwrap())
                };
                let mut acc = x(0);
                for r in 1..world {
                    let v = x(r);
                    acc = match $op {
                        ReduceOp::Sum | ReduceOp::Avg => acc.wrapping_add(v),
                        ReduceOp::Prod => acc.wrapping_mul(v),
                        ReduceOp::Min => acc.min(v),
                        ReduceOp::Max => acc.max(v),
                        ReduceOp::Band => acc & v,
                        ReduceOp::Bor => acc | v,
                        ReduceOp::Bxor => acc ^ v,
                    };
                }
                if $op == ReduceOp::Avg {
                    // Truncation toward zero, computed in a wider type.
                    acc = (acc as i128 / world as i128) as $t;
                }
                $out[i * sz..(i + 1) * sz].copy_from_slice(&acc.to_le_bytes());
            }
        }};
    }

    /// An element-by-element reference written apart from the library's
    /// fold: rank order, f16/bf16 in f32, integers wrapping.
    pub fn naive(dtype: Dtype, op: ReduceOp, inputs: &[Vec<u8>]) -> Vec<u8> {
        use half::{bf16, f16};
        let mut out = vec![0u8; inputs[0].len()];
        let id32 = |x: f32| x;
        let id64 = |x: f64| x;
        match dtype {
            Dtype::F32 => naive_float!(f32, f32, id32, id32, op, inputs, out),
            Dtype::F64 => naive_float!(f64, f64, id64, id64, op, inputs, out),
            Dtype::F16 => naive_float!(f16, f32, f16::to_f32, f16::from_f32, op, inputs, out),
            Dtype::Bf16 => naive_float!(bf16, f32, bf16::to_f32, bf16::from_f32, op, inputs, out),
            Dtype::I8 => naive_int!(i8, op, inputs, out),
            Dtype::U8 => naive_int!(u8, op, inputs, out),
            Dtype::I32 => naive_int!(i32, op, inputs, out),
            Dtype::U32 => naive_int!(u32, op, inputs, out),
            Dtype::I64 => naive_int!(i64, op, inputs, out),
            Dtype::U64 => naive_int!(u64, op, inputs, out),
        }
        out
    }

    /// `n` TCP members over loopback, connected (in rank order).
    pub fn tcp_group(n: u32) -> Vec<crate::tcp::TcpComm> {
        let listeners: Vec<std::net::TcpListener> = (0..n)
            .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback"))
            .collect();
        let peers: Vec<std::net::SocketAddr> =
            listeners.iter().map(|l| l.local_addr().unwrap()).collect();
        std::thread::scope(|s| {
            let hs: Vec<_> = listeners
                .into_iter()
                .enumerate()
                .map(|(r, l)| {
                    let peers = &peers;
                    s.spawn(move || {
                        crate::tcp::TcpComm::with_listener(
                            r as u32,
                            l,
                            peers,
                            Duration::from_secs(20),
                        )
                        .expect("tcp group")
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Runs `f(member)` on a thread per member; results in rank order.
    pub fn on_each<C: Send, R: Send>(members: Vec<C>, f: impl Fn(C) -> R + Sync) -> Vec<R> {
        std::thread::scope(|s| {
            let f = &f;
            let hs: Vec<_> = members.into_iter().map(|m| s.spawn(move || f(m))).collect();
            hs.into_iter()
                .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .collect()
        })
    }

    /// The daemon next to the test binary (target/<profile>/).
    pub fn backend_bin() -> PathBuf {
        let exe = std::env::current_exe().expect("test binary path");
        // target/<profile>/deps/<test binary>
        let dir = exe
            .parent()
            .and_then(Path::parent)
            .expect("test binary in target/<profile>/deps");
        let bin = dir.join("vhost-device-dmlc");
        assert!(
            bin.is_file(),
            "the backend daemon {} is missing: build it first with \
             `cargo build -p vhost-device-dmlc` (or test the whole workspace)",
            bin.display()
        );
        bin
    }

    /// A running daemon with `ranks` sockets in a private folder; killed
    /// (and its folder removed) on drop.
    pub struct Backend {
        child: Child,
        dir: PathBuf,
    }

    impl Backend {
        pub fn start(tag: &str, ranks: u32) -> Backend {
            static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let dir =
                std::env::temp_dir().join(format!("dmlc-comm-{tag}-{}-{n}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("create temp dir");
            let child = Command::new(backend_bin())
                .arg("--socket-path")
                .arg(dir.join("s"))
                .arg("--socket-count")
                .arg(ranks.to_string())
                .args([
                    "--timeout-ms",
                    "20000",
                    "--reduce-threads",
                    "1",
                    "--log-level",
                    "warn",
                ])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("start the backend daemon");
            let b = Backend { child, dir };
            let deadline = Instant::now() + Duration::from_secs(20);
            while !(0..ranks).all(|i| b.socket(i).exists()) {
                assert!(Instant::now() < deadline, "backend sockets did not appear");
                std::thread::sleep(Duration::from_millis(5));
            }
            b
        }

        pub fn socket(&self, rank: u32) -> PathBuf {
            self.dir.join(format!("s{rank}"))
        }
    }

    impl Drop for Backend {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use half::{bf16, f16};

    use super::testutil::{all_pairs, data, naive, on_each, same, serial, tcp_group, Backend};
    use super::*;
    use crate::OpenOptions;

    fn reduce<T: Element>(op: ReduceOp, inputs: &[&[T]]) -> Vec<T> {
        let mut out = inputs[0].to_vec();
        reduce_slices(op, inputs, &mut out).unwrap();
        out
    }

    #[test]
    fn integer_semantics_follow_the_spec() {
        // The spec's avg examples: truncation toward zero after a wrapping sum.
        assert_eq!(reduce(ReduceOp::Avg, &[&[7i32], &[-2]]), [2]);
        assert_eq!(reduce(ReduceOp::Avg, &[&[-7i32], &[2]]), [-2]);
        assert_eq!(reduce(ReduceOp::Avg, &[&[200u8], &[100]]), [22]);
        assert_eq!(reduce(ReduceOp::Sum, &[&[127i8], &[1]]), [-128]);
        assert_eq!(reduce(ReduceOp::Prod, &[&[1u64 << 63], &[2]]), [0]);
        assert_eq!(reduce(ReduceOp::Min, &[&[-1i64], &[3]]), [-1]);
        assert_eq!(reduce(ReduceOp::Max, &[&[u32::MAX], &[3]]), [u32::MAX]);
        assert_eq!(
            reduce(ReduceOp::Band, &[&[0b1100u8], &[0b1010], &[0b1110]]),
            [0b1000]
        );
        assert_eq!(reduce(ReduceOp::Bor, &[&[0b1100u8], &[0b1010]]), [0b1110]);
        assert_eq!(reduce(ReduceOp::Bxor, &[&[0b1100u8], &[0b1010]]), [0b0110]);
        assert_eq!(
            reduce(ReduceOp::Avg, &[&[i64::MIN], &[-1], &[0]]),
            [i64::MAX / 3]
        );
    }

    #[test]
    fn floats_fold_in_rank_order() {
        // (1 + 1e8) rounds to 1e8, so the fold gives 0; another order gives 1.
        assert_eq!(reduce(ReduceOp::Sum, &[&[1.0f32], &[1e8], &[-1e8]]), [0.0]);
        assert_eq!(reduce(ReduceOp::Sum, &[&[1e8f32], &[-1e8], &[1.0]]), [1.0]);
        // f16 accumulates in f32: 2048 + 1 + 1 = 2050 (an f16 fold would
        // lose both ones).
        let h = f16::from_f32;
        assert_eq!(
            reduce(ReduceOp::Sum, &[&[h(2048.0)], &[h(1.0)], &[h(1.0)]]),
            [h(2050.0)]
        );
        let b = bf16::from_f32;
        assert_eq!(
            reduce(ReduceOp::Avg, &[&[b(256.0)], &[b(1.0)], &[b(1.0)]]),
            [b(86.0)]
        );
        assert_eq!(reduce(ReduceOp::Avg, &[&[1.0f64], &[2.0]]), [1.5]);
        let nan = reduce(ReduceOp::Min, &[&[1.0f32, f32::NAN], &[f32::NAN, 0.5]]);
        assert!(nan[0].is_nan() && nan[1].is_nan());
        let nan = reduce(ReduceOp::Max, &[&[h(1.0)], &[f16::NAN], &[h(9.0)]]);
        assert!(nan[0].is_nan());
        assert_eq!(reduce(ReduceOp::Min, &[&[3.0f64], &[-2.0]]), [-2.0]);
        // Between -0 and +0 the lower rank's is kept (the spec's rule).
        let z = reduce(ReduceOp::Min, &[&[0.0f32], &[-0.0]]);
        assert!(z[0].is_sign_positive());
    }

    #[test]
    fn reduce_matches_an_independent_reference() {
        for world in 1..=5u32 {
            for (i, (dtype, op)) in all_pairs().enumerate() {
                let count = 1 + (i * 37) % 1300;
                let inputs: Vec<Vec<u8>> = (0..world)
                    .map(|r| data(dtype, count, u64::from(r) * 100 + i as u64, i % 2 == 0))
                    .collect();
                let want = naive(dtype, op, &inputs);
                let refs: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
                let mut got = vec![0u8; want.len()];
                reduce_rank_order(dtype, op, &refs, &mut got).unwrap();
                assert!(same(dtype, &got, &want), "{dtype} {op} world {world}");
                // Misaligned buffers take the copying path, same result.
                let mut odd = vec![0u8; want.len() + 1];
                let shifted: Vec<Vec<u8>> =
                    inputs.iter().map(|v| [&[0u8][..], v].concat()).collect();
                let refs: Vec<&[u8]> = shifted.iter().map(|v| &v[1..]).collect();
                reduce_rank_order(dtype, op, &refs, &mut odd[1..]).unwrap();
                assert!(same(dtype, &odd[1..], &want), "{dtype} {op} misaligned");
            }
        }
    }

    #[test]
    fn reduce_rejects_bad_arguments() {
        let mut out = [0u8; 4];
        assert!(matches!(
            reduce_rank_order(Dtype::F32, ReduceOp::Bxor, &[&[0; 4]], &mut out),
            Err(CommError::OpForDtype { .. })
        ));
        assert!(matches!(
            reduce_rank_order(Dtype::F32, ReduceOp::Sum, &[], &mut out),
            Err(CommError::InvalidArgument(_))
        ));
        assert!(matches!(
            reduce_rank_order(Dtype::F32, ReduceOp::Sum, &[&[0; 8]], &mut out),
            Err(CommError::InvalidArgument(_))
        ));
        let mut three = [0u8; 3];
        let e = reduce_rank_order(Dtype::F32, ReduceOp::Sum, &[&[0; 3]], &mut three).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid argument: 3 bytes is not a whole number of f32 elements"
        );
    }

    #[test]
    fn a_group_of_one() {
        let mut c: Box<dyn Communicator> = Box::new(SelfComm);
        assert_eq!((c.rank(), c.world_size(), c.transport()), (0, 1, "self"));
        let mut v = [1.5f32, -2.0];
        c.allreduce(ReduceOp::Avg, &mut v).unwrap();
        assert_eq!(v, [1.5, -2.0]);
        let mut g = [0i32; 2];
        c.allgather(&[4, 5], &mut g).unwrap();
        assert_eq!(g, [4, 5]);
        c.broadcast(0, &mut g).unwrap();
        assert!(c.broadcast(1, &mut g).is_err());
        assert!(c.allgather(&[4], &mut g).is_err());
        assert!(matches!(
            c.allreduce(ReduceOp::Bor, &mut v),
            Err(CommError::OpForDtype { .. })
        ));
        c.barrier().unwrap();
    }

    fn open(backend: &Backend, rank: u32) -> DeviceComm {
        let opts = OpenOptions {
            poll: false,
            dma_bytes: 8 << 20,
            ..OpenOptions::default()
        };
        DeviceComm::new(Device::open_host(&backend.socket(rank), &opts).expect("open device"))
    }

    /// The device and TCP give bitwise the same results, and both match
    /// the reference, for every dtype and op, on the direct-exchange and the
    /// reduce-scatter paths of TCP.
    #[test]
    fn device_and_tcp_agree_bitwise() {
        let _serial = serial();
        for world in [2u32, 3] {
            let backend = Backend::start("agree", world);
            let members: Vec<_> = tcp_group(world)
                .into_iter()
                .enumerate()
                .map(|(r, t)| (open(&backend, r as u32), t))
                .collect();
            on_each(members, |(mut dev, mut tcp)| {
                let rank = dev.rank();
                assert_eq!(rank, tcp.rank());
                let counts: &[usize] = if world == 2 {
                    &[1, 777, 40_000]
                } else {
                    &[0, 1, 5, 3001, 40_000]
                };
                for (i, (dtype, op)) in all_pairs().enumerate() {
                    if world == 2 && !(dtype.is_float() && op == ReduceOp::Sum) {
                        continue;
                    }
                    for (k, &count) in counts.iter().enumerate() {
                        let seed = |r: u32| (i * 10 + k) as u64 * 64 + u64::from(r);
                        let nan = k == 2;
                        let inputs: Vec<Vec<u8>> = (0..world)
                            .map(|r| data(dtype, count, seed(r), nan))
                            .collect();
                        let want = naive(dtype, op, &inputs);
                        let mut d = inputs[rank as usize].clone();
                        dev.allreduce_raw(dtype, op, &mut d).unwrap();
                        let mut t = inputs[rank as usize].clone();
                        tcp.allreduce_raw(dtype, op, &mut t).unwrap();
                        let what = format!("{dtype} {op} count {count} world {world}");
                        if nan {
                            assert!(same(dtype, &d, &t), "device vs tcp: {what}");
                        } else {
                            assert_eq!(d, t, "device vs tcp (bitwise): {what}");
                        }
                        assert!(same(dtype, &d, &want), "device vs reference: {what}");
                    }
                }
            });
        }
    }

    #[test]
    fn device_comm_cuts_large_data_and_runs_every_collective() {
        let _serial = serial();
        let world = 3u32;
        let backend = Backend::start("devcomm", world);
        let members: Vec<_> = (0..world).map(|r| open(&backend, r)).collect();
        on_each(members, |mut c| {
            assert_eq!((c.world_size(), c.transport()), (world, "device"));
            let rank = c.rank();
            c.set_chunk_bytes(4096 + 3);
            assert_eq!(c.chunk_bytes(), 4096);
            // 3001 f64 = 24008 bytes: six requests of 4096, one smaller.
            let mut v: Vec<f64> = (0..3001).map(|i| f64::from(i + rank as i32)).collect();
            c.allreduce(ReduceOp::Sum, &mut v).unwrap();
            assert!(v.iter().enumerate().all(|(i, &x)| x == (3 * i + 3) as f64));
            let mut b: Vec<u8> = if rank == 1 {
                (0..10_000).map(|i| i as u8).collect()
            } else {
                vec![0; 10_000]
            };
            c.broadcast(1, &mut b).unwrap();
            assert!(b.iter().enumerate().all(|(i, &x)| x == i as u8));
            let mine: Vec<u32> = (0..2000).map(|i| i * 10 + rank).collect();
            let mut all = vec![0u32; 6000];
            c.allgather(&mine, &mut all).unwrap();
            for (j, block) in all.chunks(2000).enumerate() {
                assert!(block
                    .iter()
                    .enumerate()
                    .all(|(i, &x)| x == i as u32 * 10 + j as u32));
            }
            c.barrier().unwrap();
            let mut empty: [f32; 0] = [];
            c.allreduce(ReduceOp::Sum, &mut empty).unwrap();
            assert!(matches!(
                c.allreduce(ReduceOp::Band, &mut v),
                Err(CommError::OpForDtype { .. })
            ));
            assert!(c.broadcast(world, &mut b).is_err());
            // The zero-copy path is the device itself.
            let buf = c.device().alloc(16).unwrap();
            c.device()
                .allreduce_in_place(Dtype::U32, ReduceOp::Max, &buf, 4)
                .unwrap();
            std::thread::sleep(Duration::from_millis(1));
        });
    }
}
