//! Single-copy data movement over scatter-gather lists of host memory.
//!
//! Skeleton: signatures agreed between the group engine and the data path.

use virtio_dmlc::{Dtype, ReduceOp};

/// One contiguous piece of a member's buffer, as mapped in this process.
#[derive(Clone, Copy, Debug)]
pub struct HostSeg {
    pub ptr: *mut u8,
    pub len: usize,
}

// SAFETY: a HostSeg is a plain address range; whoever dereferences it must
// uphold the validity rules documented on the functions that take it.
unsafe impl Send for HostSeg {}
// SAFETY: as above; the type itself gives no access.
unsafe impl Sync for HostSeg {}

/// A member's buffer (a list of segments) and a byte offset into it.
#[derive(Clone, Copy, Debug)]
pub struct SegRef<'a> {
    pub segs: &'a [HostSeg],
    pub offset: usize,
}

/// Reduces `len` bytes: for every output `o`, `o[..len] = reduce(inputs[0][..len], .., inputs[n-1][..len])`,
/// inputs in the order given (rank order), moving through a cache-sized scratch.
///
/// # Safety
/// Every segment must be valid for reads (inputs) or writes (outputs) for
/// the ranges addressed; `len` must be a multiple of `dtype.size()`, and
/// every segment boundary crossed must fall on an element boundary.
pub unsafe fn reduce_range(
    dtype: Dtype,
    op: ReduceOp,
    world: u32,
    inputs: &[SegRef<'_>],
    outputs: &[SegRef<'_>],
    len: usize,
) {
    let _ = (dtype, op, world, inputs, outputs, len);
    todo!("datapath::reduce_range")
}

/// Copies `len` bytes from `src` into every destination in `dsts`.
/// A destination that is the very same memory as the source is skipped.
///
/// # Safety
/// As for [`reduce_range`].
pub unsafe fn copy_range(src: SegRef<'_>, dsts: &[SegRef<'_>], len: usize) {
    let _ = (src, dsts, len);
    todo!("datapath::copy_range")
}
