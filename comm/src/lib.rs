//! Collectives of one member of a group, independent of the path the data
//! takes.
//!
//! [`Communicator`] is what a training program or a benchmark needs: rank,
//! world size, allreduce, broadcast, allgather, barrier, reduce,
//! reduce-scatter, a send/receive step and all-to-all. Three
//! implementations:
//!
//! - [`DeviceComm`]: through the virtio-dmlc device ([`dmlc_driver::Device`]), copying
//!   through a bounce buffer in device-visible memory.
//!   [`DeviceComm::device`] gives the zero-copy path (allocate a
//!   [`dmlc_driver::DmaBuf`] and call the device directly).
//! - [`TcpComm`]: over TCP between the members, the baseline.
//! - [`SelfComm`]: a group of one (no I/O), for running a program outside a
//!   job.
//!
//! Every implementation gives bitwise the same results: reductions are a left
//! fold in rank order 0..N-1, exactly as the device does them (see
//! [`reduce_rank_order`]). The trait's methods work on bytes so that it stays
//! usable as `dyn Communicator` (and from C); [`CommunicatorExt`] adds the
//! typed methods on slices of any [`Element`]. [`rabit`] is the rabit-style
//! process-wide API on top.
//!
//! Modules depend one way: [`error`] ← this root (trait, checks, host-side
//! reduction, [`SelfComm`]) ← [`DeviceComm`], [`tcp`] ← [`rabit`].
//!
//! ```no_run
//! use dmlc_comm::{Communicator, CommunicatorExt, DeviceComm};
//! use dmlc_driver::{host, OpenOptions, ReduceOp};
//! let dev = host::open("/tmp/dmlc.sock0".as_ref(), &OpenOptions::default())?;
//! let mut comm: Box<dyn Communicator> = Box::new(DeviceComm::new(dev));
//! let mut grads = vec![1.0f32; 1024];
//! comm.allreduce(ReduceOp::Sum, &mut grads)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use dmlc_driver::{le_in_place, Dtype, Element, ReduceOp};

mod device_comm;
pub mod error;
pub mod rabit;
pub mod tcp;
#[cfg(test)]
mod testutil;

pub use device_comm::{DeviceComm, DEVICE_CHUNK_BYTES};
pub use error::{CommError, Result, TcpError};
pub use tcp::TcpComm;

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

    /// Tags every later collective with `tag` (0: none), e.g. a trainer's
    /// step number, which `dmlc-ctl freeze --tag` can name
    /// (docs/debugging.md); every member must set the same. Only the
    /// device carries tags: the default ignores it.
    fn set_tag(&mut self, tag: u64) {
        let _ = tag;
    }

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

    /// One step in which every member sends `input` to rank `to` and
    /// receives `output` from rank `from`, both at once (nccl-tests'
    /// sendrecv: with `to` the next rank and `from` the previous, a ring
    /// shift). `to` and `from` are other members; the message from `from`
    /// must be exactly as long as `output`.
    fn sendrecv_raw(&mut self, to: u32, input: &[u8], from: u32, output: &mut [u8]) -> Result<()>;

    /// All-to-all of equal blocks: block `j` of `input` goes to rank `j`,
    /// block `j` of `output` comes from rank `j` (both `world_size`
    /// blocks, the same length).
    fn alltoall_raw(&mut self, input: &[u8], output: &mut [u8]) -> Result<()>;

    /// The root's `data` gets the reduction of every member's `data`; the
    /// others' stays as it was.
    ///
    /// The default runs an allreduce on a copy (the same result, bitwise,
    /// on every path); [`DeviceComm`] uses the device's own reduce.
    fn reduce_raw(&mut self, dtype: Dtype, op: ReduceOp, root: u32, data: &mut [u8]) -> Result<()> {
        check_root(root, self.world_size())?;
        let mut copy = Aligned::default();
        let all = copy.bytes(data.len());
        all.copy_from_slice(data);
        self.allreduce_raw(dtype, op, all)?;
        if self.rank() == root {
            data.copy_from_slice(all);
        }
        Ok(())
    }

    /// `output` gets block `rank` of the reduction of every member's
    /// `input` (`world_size` blocks, each as long as `output`).
    ///
    /// The default runs an allreduce on a copy of `input`; [`DeviceComm`]
    /// uses the device's own reduce-scatter.
    fn reduce_scatter_raw(
        &mut self,
        dtype: Dtype,
        op: ReduceOp,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<()> {
        check_reduce_scatter(input.len(), output.len(), self.world_size())?;
        let mut copy = Aligned::default();
        let all = copy.bytes(input.len());
        all.copy_from_slice(input);
        self.allreduce_raw(dtype, op, all)?;
        let (n, r) = (output.len(), self.rank() as usize);
        output.copy_from_slice(&all[r * n..(r + 1) * n]);
        Ok(())
    }
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
    fn set_tag(&mut self, tag: u64) {
        (**self).set_tag(tag)
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
    fn sendrecv_raw(&mut self, to: u32, input: &[u8], from: u32, output: &mut [u8]) -> Result<()> {
        (**self).sendrecv_raw(to, input, from, output)
    }
    fn alltoall_raw(&mut self, input: &[u8], output: &mut [u8]) -> Result<()> {
        (**self).alltoall_raw(input, output)
    }
    fn reduce_raw(&mut self, dtype: Dtype, op: ReduceOp, root: u32, data: &mut [u8]) -> Result<()> {
        (**self).reduce_raw(dtype, op, root, data)
    }
    fn reduce_scatter_raw(
        &mut self,
        dtype: Dtype,
        op: ReduceOp,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<()> {
        (**self).reduce_scatter_raw(dtype, op, input, output)
    }
}

/// Typed collectives on slices, for every [`Communicator`] (including
/// `dyn Communicator`).
pub trait CommunicatorExt: Communicator {
    /// Allreduce of `data` in place.
    fn allreduce<T: Element>(&mut self, op: ReduceOp, data: &mut [T]) -> Result<()> {
        // The raw collectives reduce little-endian elements (spec
        // 5.X.6.5.1); `le_in_place` is a no-op on a little-endian CPU.
        le_in_place(data);
        let r = self.allreduce_raw(T::DTYPE, op, bytes_of_mut(data));
        le_in_place(data);
        r
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

    /// Sends `input` to rank `to` and receives `output` from rank `from`.
    fn sendrecv<T: Element>(
        &mut self,
        to: u32,
        input: &[T],
        from: u32,
        output: &mut [T],
    ) -> Result<()> {
        self.sendrecv_raw(to, bytes_of(input), from, bytes_of_mut(output))
    }

    /// Block `j` of `input` goes to rank `j`, block `j` of `output` comes
    /// from rank `j`.
    fn alltoall<T: Element>(&mut self, input: &[T], output: &mut [T]) -> Result<()> {
        self.alltoall_raw(bytes_of(input), bytes_of_mut(output))
    }

    /// The root's `data` gets the reduction; the others' stays as it was.
    fn reduce<T: Element>(&mut self, op: ReduceOp, root: u32, data: &mut [T]) -> Result<()> {
        // As in `allreduce`.
        le_in_place(data);
        let r = self.reduce_raw(T::DTYPE, op, root, bytes_of_mut(data));
        le_in_place(data);
        r
    }

    /// `output` gets block `rank` of the reduction of every member's
    /// `input` (`world_size` times as long as `output`).
    fn reduce_scatter<T: Element>(
        &mut self,
        op: ReduceOp,
        input: &[T],
        output: &mut [T],
    ) -> Result<()> {
        if cfg!(target_endian = "big") {
            // As in `allreduce`, on a copy of the input.
            let mut le = input.to_vec();
            le_in_place(&mut le);
            let r = self.reduce_scatter_raw(T::DTYPE, op, bytes_of(&le), bytes_of_mut(output));
            le_in_place(output);
            return r;
        }
        self.reduce_scatter_raw(T::DTYPE, op, bytes_of(input), bytes_of_mut(output))
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

/// `to` and `from` must be other members of the group.
pub(crate) fn check_sendrecv(to: u32, from: u32, rank: u32, world: u32) -> Result<()> {
    for (what, peer) in [("destination", to), ("source", from)] {
        if peer >= world || peer == rank {
            return Err(CommError::InvalidArgument(format!(
                "{what} rank {peer}: not another member of a group of {world}"
            )));
        }
    }
    Ok(())
}

pub(crate) fn check_alltoall(input: usize, output: usize, world: u32) -> Result<()> {
    if input != output || !input.is_multiple_of(world as usize) {
        return Err(CommError::InvalidArgument(format!(
            "all-to-all of {input} bytes into {output}: both must be the same multiple of \
             {world} blocks"
        )));
    }
    Ok(())
}

pub(crate) fn check_reduce_scatter(input: usize, output: usize, world: u32) -> Result<()> {
    if output.checked_mul(world as usize) != Some(input) {
        return Err(CommError::InvalidArgument(format!(
            "reduce-scatter input has {input} bytes, {output} x {world} needed"
        )));
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// The reduction, as the device defines it (docs/spec.md, 5.X.6.5): the
// backend's own kernels, from dmlc-reduce, so results are bitwise equal.

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

/// `own` (rank `own_rank`'s contribution) becomes the reduction of `own`
/// and `others` (the other ranks' contributions in rank order, of the same
/// length; the world is all of them). Arguments must have been checked
/// with [`check_allreduce`].
pub(crate) fn reduce_into(
    dtype: Dtype,
    op: ReduceOp,
    own_rank: usize,
    own: &mut [u8],
    others: &[&[u8]],
) -> std::result::Result<(), dmlc_reduce::ReduceError> {
    // A world beyond u32 cannot exist; saturating keeps this total.
    let world = u32::try_from(others.len() + 1).unwrap_or(u32::MAX);
    dmlc_reduce::reduce_in_place(dtype, op, world, own_rank, own, others)
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
    Ok(reduce_into(dtype, op, 0, out, rest)?)
}

/// [`reduce_rank_order`] on typed slices.
pub fn reduce_slices<T: Element>(op: ReduceOp, inputs: &[&[T]], out: &mut [T]) -> Result<()> {
    if cfg!(target_endian = "big") {
        // The reduction is of little-endian elements (spec 5.X.6.5.1): on
        // copies of the inputs, and the result swapped back.
        let le: Vec<Vec<T>> = inputs
            .iter()
            .map(|i| {
                let mut v = i.to_vec();
                le_in_place(&mut v);
                v
            })
            .collect();
        let inputs: Vec<&[u8]> = le.iter().map(|i| bytes_of(i)).collect();
        let r = reduce_rank_order(T::DTYPE, op, &inputs, bytes_of_mut(out));
        le_in_place(out);
        return r;
    }
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
        reduce_into(dtype, op, 0, data, &[])?;
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
    fn sendrecv_raw(&mut self, to: u32, _: &[u8], from: u32, _: &mut [u8]) -> Result<()> {
        check_sendrecv(to, from, 0, 1) // always an error: there is no other member
    }
    fn alltoall_raw(&mut self, input: &[u8], output: &mut [u8]) -> Result<()> {
        check_alltoall(input.len(), output.len(), 1)?;
        output.copy_from_slice(input);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use half::{bf16, f16};

    use super::*;
    use crate::testutil::{
        all_pairs, data, naive, on_each, same, serial, start_backend, tcp_group, Backend,
    };
    use dmlc_driver::OpenOptions;

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
        DeviceComm::new(dmlc_driver::host::open(&backend.socket(rank), &opts).expect("open device"))
    }

    /// The device and TCP give bitwise the same results, and both match
    /// the reference, for every dtype and op, on the direct-exchange and the
    /// reduce-scatter paths of TCP.
    #[test]
    fn device_and_tcp_agree_bitwise() {
        let _serial = serial();
        for world in [2u32, 3] {
            let backend = start_backend("agree", world);
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
        let backend = start_backend("devcomm", world);
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

    /// A ring shift and an all-to-all, each rank checking what it got
    /// against the bytes it knows the sender put there.
    fn shift_and_transpose(c: &mut dyn Communicator, sizes: &[usize]) {
        let (me, world) = (c.rank(), c.world_size());
        // Byte k of what rank i sends rank j.
        let byte = |i: u32, j: u32, k: usize| (i as usize * 61 + j as usize * 17 + k) as u8;
        let (next, prev) = ((me + 1) % world, (me + world - 1) % world);
        for &n in sizes {
            let input: Vec<u8> = (0..n).map(|k| byte(me, next, k)).collect();
            let mut output = vec![0xee; n];
            c.sendrecv_raw(next, &input, prev, &mut output).unwrap();
            let bad = (0..n).filter(|&k| output[k] != byte(prev, me, k)).count();
            assert_eq!(bad, 0, "{}: {n}-byte sendrecv", c.transport());

            let input: Vec<u8> = (0..world)
                .flat_map(|j| (0..n).map(move |k| byte(me, j, k)))
                .collect();
            let mut output = vec![0xee; n * world as usize];
            c.alltoall_raw(&input, &mut output).unwrap();
            for (k, &x) in output.iter().enumerate() {
                let want = byte((k / n) as u32, me, k % n);
                assert_eq!(x, want, "{}: byte {k} of {n}-byte blocks", c.transport());
            }
        }
        // Bad arguments are refused before anything is sent.
        assert!(c.sendrecv_raw(me, &[1], prev, &mut [0]).is_err());
        assert!(c.sendrecv_raw(next, &[1], world, &mut [0]).is_err());
        assert!(c.alltoall_raw(&[0; 4], &mut [0; 5]).is_err());
        c.barrier().unwrap();
    }

    /// sendrecv and all-to-all over TCP, on the device (cut into several
    /// requests at sizes that divide none of the lengths) and on a group
    /// of one.
    #[test]
    fn sendrecv_shifts_a_ring_and_alltoall_transposes_blocks() {
        let _serial = serial();
        let world = 3u32;
        let sizes = [0usize, 1, 5000, 100_000];
        on_each(tcp_group(world), |mut c| {
            shift_and_transpose(&mut c, &sizes)
        });
        // Messages over max_bytes go in pieces of it; all-to-all in
        // pieces of the chunk.
        let backend = Backend::start(
            "p2p",
            world,
            &["--max-bytes", "4099", "--log-level", "warn"],
        );
        let members: Vec<_> = (0..world).map(|r| open(&backend, r)).collect();
        on_each(members, |mut c| {
            c.set_chunk_bytes(3000);
            shift_and_transpose(&mut c, &sizes);
        });
        let mut one = SelfComm;
        assert!(one.sendrecv_raw(0, &[1], 0, &mut [0]).is_err());
        let mut out = [0u32; 3];
        one.alltoall(&[1u32, 2, 3], &mut out).unwrap();
        assert_eq!(out, [1, 2, 3]);
    }

    /// A receive shorter than the message it matches is named on the
    /// device (both ends of a pair must pass the same length).
    #[test]
    fn device_sendrecv_of_different_lengths_is_an_error() {
        let _serial = serial();
        let backend = start_backend("p2plen", 2);
        let members: Vec<_> = (0..2).map(|r| open(&backend, r)).collect();
        let errs = on_each(members, |mut c| {
            let other = 1 - c.rank();
            let mut out = vec![0u8; 8 + 8 * c.rank() as usize];
            let input = vec![1u8; 8 + 8 * c.rank() as usize];
            c.sendrecv_raw(other, &input, other, &mut out)
                .unwrap_err()
                .to_string()
        });
        // Rank 0 expects 8 bytes and is sent 16; rank 1 expects 16, gets 8.
        assert!(errs[0].to_lowercase().contains("trunc"), "{}", errs[0]);
        assert!(errs[1].contains("8 bytes where 16"), "{}", errs[1]);
    }

    /// reduce and reduce-scatter on the device (cut into several requests)
    /// and over TCP (the trait's default, from an allreduce) both give the
    /// reference's result, computed here from every rank's input.
    #[test]
    fn reduce_and_reduce_scatter_match_the_reference_on_device_and_tcp() {
        let _serial = serial();
        let world = 3u32;
        let backend = start_backend("reduce", world);
        let members: Vec<_> = tcp_group(world)
            .into_iter()
            .enumerate()
            .map(|(r, t)| (open(&backend, r as u32), t))
            .collect();
        on_each(members, |(mut dev, mut tcp)| {
            dev.set_chunk_bytes(4096);
            let rank = dev.rank();
            for (dtype, op) in [(Dtype::F32, ReduceOp::Sum), (Dtype::I64, ReduceOp::Max)] {
                // 3001 elements per block: several requests on the device.
                let block = 3001 * dtype.size();
                let inputs: Vec<Vec<u8>> = (0..world)
                    .map(|r| data(dtype, 3001 * world as usize, u64::from(r) + 7, false))
                    .collect();
                let want = naive(dtype, op, &inputs);
                let mine = &inputs[rank as usize];
                let r = rank as usize;
                for c in [&mut dev as &mut dyn Communicator, &mut tcp] {
                    let what = format!("{dtype} {op} on {}", c.transport());
                    let mut out = vec![0u8; block];
                    c.reduce_scatter_raw(dtype, op, mine, &mut out).unwrap();
                    assert_eq!(
                        out,
                        want[r * block..(r + 1) * block],
                        "reduce-scatter {what}"
                    );
                    let mut d = mine.clone();
                    c.reduce_raw(dtype, op, 1, &mut d).unwrap();
                    let root_gets = if rank == 1 { &want } else { mine };
                    assert_eq!(&d, root_gets, "reduce {what}");
                    assert!(c.reduce_scatter_raw(dtype, op, mine, &mut d[..8]).is_err());
                    assert!(c.reduce_raw(dtype, op, world, &mut d).is_err());
                }
            }
        });
    }
}
