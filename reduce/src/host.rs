//! Reduction of host buffers: safe slices in, the device's result out.
//!
//! The reductions that do not run in the backend (the TCP and self
//! communicators) call these. They drive the very kernels the backend's
//! data path drives, in the same chunks of a per-thread [`Scratch`] and the
//! same passes ([`groups`]), so a result equals the device's bit for bit,
//! NaN payloads included, by construction.

use std::cell::RefCell;
use std::cmp::Ordering;
use std::ptr;

use virtio_dmlc::{Dtype, ReduceOp};

use crate::kernel::{groups, Kernel, MAX_GROUP};
use crate::scratch::Scratch;
use crate::store::{self, Stores};

/// Why a reduction of host buffers was refused. Nothing has been written
/// when one is returned.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReduceError {
    /// The op is not defined for the dtype (a bitwise op on a float).
    #[error("{op} is not defined for {dtype}")]
    Unsupported { dtype: Dtype, op: ReduceOp },
    /// There is nothing to reduce.
    #[error("no inputs to reduce")]
    NoInputs,
    /// The divisor of avg is zero.
    #[error("world size is zero")]
    ZeroWorld,
    /// The buffer of `rank` differs in length from the output.
    #[error("the input of rank {rank} has {len} bytes, the output {want}")]
    LengthMismatch {
        rank: usize,
        len: usize,
        want: usize,
    },
    /// The buffers do not hold a whole number of elements.
    #[error("{len} bytes is not a whole number of {dtype} elements")]
    PartialElement { dtype: Dtype, len: usize },
    /// The caller's own rank is not a position among the inputs.
    #[error("own rank {rank} is out of range for {inputs} inputs")]
    RankOutOfRange { rank: usize, inputs: usize },
}

thread_local! {
    /// Kept between calls, so that a thread's calls allocate nothing once
    /// its first has sized it.
    static SCRATCH: RefCell<Scratch> = const { RefCell::new(Scratch::new()) };
}

/// `out = inputs[0] op inputs[1] op .. op inputs[n-1]`, element-wise, the
/// inputs in rank order (index = rank), with the semantics of docs/spec.md
/// and bit for bit the result of the device.
///
/// Buffers hold elements of `dtype` in memory order (little-endian, as on
/// the device), at any alignment, all of `out`'s length. `world` is the
/// divisor of avg (normally `inputs.len()`, as on the device).
///
/// # Errors
/// If `op` is not defined for `dtype`, `inputs` is empty, `world` is 0, a
/// length differs from `out`'s or is not a whole number of elements; then
/// `out` is left as it was.
pub fn reduce_into(
    dtype: Dtype,
    op: ReduceOp,
    world: u32,
    inputs: &[&[u8]],
    out: &mut [u8],
) -> Result<(), ReduceError> {
    let stores = Stores::for_output(out.len());
    reduce_into_tuned(dtype, op, world, inputs, out, stores.chunk_bytes(), stores)
}

/// As [`reduce_into`], where the output is one of the inputs: `own`, the
/// contribution of rank `own_rank`, becomes the reduction of it and
/// `others`, the other ranks' contributions in rank order with `own_rank`
/// left out (rank `r` is `others[r]` below `own_rank`, `others[r - 1]`
/// above it).
///
/// # Errors
/// As [`reduce_into`] (with `own` as the output and one of the inputs),
/// and if `own_rank > others.len()`; then `own` is left as it was.
pub fn reduce_in_place(
    dtype: Dtype,
    op: ReduceOp,
    world: u32,
    own_rank: usize,
    own: &mut [u8],
    others: &[&[u8]],
) -> Result<(), ReduceError> {
    let stores = Stores::for_output(own.len());
    let chunk_bytes = stores.chunk_bytes();
    reduce_in_place_tuned(dtype, op, world, own_rank, own, others, chunk_bytes, stores)
}

/// [`reduce_into`] with chunks of `chunk_bytes` accumulator bytes and the
/// given stores (for tests: many chunks from small buffers, streaming
/// stores below the threshold).
fn reduce_into_tuned(
    dtype: Dtype,
    op: ReduceOp,
    world: u32,
    inputs: &[&[u8]],
    out: &mut [u8],
    chunk_bytes: usize,
    stores: Stores,
) -> Result<(), ReduceError> {
    let len = out.len();
    let kernel = prepare(dtype, op, world, inputs.len(), len)?;
    if let Some((rank, input)) = inputs.iter().enumerate().find(|(_, i)| i.len() != len) {
        return Err(ReduceError::LengthMismatch {
            rank,
            len: input.len(),
            want: len,
        });
    }
    let out = out.as_mut_ptr();
    let src = |r: usize| inputs[r].as_ptr();
    // SAFETY: every input is a shared slice of `len` bytes and `out` an
    // exclusive one of as many, all borrowed for the whole call: readable,
    // writable, unchanged by anyone else, and `out` disjoint from the
    // inputs.
    unsafe {
        drive(
            &kernel,
            world,
            inputs.len(),
            src,
            out,
            len,
            (chunk_bytes, stores),
        )
    };
    Ok(())
}

/// [`reduce_in_place`] with chunks of `chunk_bytes` accumulator bytes and
/// the given stores.
#[allow(clippy::too_many_arguments)]
fn reduce_in_place_tuned(
    dtype: Dtype,
    op: ReduceOp,
    world: u32,
    own_rank: usize,
    own: &mut [u8],
    others: &[&[u8]],
    chunk_bytes: usize,
    stores: Stores,
) -> Result<(), ReduceError> {
    let len = own.len();
    let inputs = others.len() + 1;
    let kernel = prepare(dtype, op, world, inputs, len)?;
    if own_rank >= inputs {
        return Err(ReduceError::RankOutOfRange {
            rank: own_rank,
            inputs,
        });
    }
    if let Some((i, other)) = others.iter().enumerate().find(|(_, o)| o.len() != len) {
        return Err(ReduceError::LengthMismatch {
            rank: i + usize::from(i >= own_rank),
            len: other.len(),
            want: len,
        });
    }
    // One pointer for reading and writing `own`: it is both an input and
    // the output.
    let own = own.as_mut_ptr();
    let src = |r: usize| match r.cmp(&own_rank) {
        Ordering::Less => others[r].as_ptr(),
        Ordering::Equal => own.cast_const(),
        Ordering::Greater => others[r - 1].as_ptr(),
    };
    // SAFETY: as in `reduce_into_tuned`, except that `own` is an input
    // too, which `drive` allows: it is the very same memory as the output.
    unsafe { drive(&kernel, world, inputs, src, own, len, (chunk_bytes, stores)) };
    Ok(())
}

/// The kernel of `dtype` and `op`, after the checks common to both entry
/// points.
fn prepare(
    dtype: Dtype,
    op: ReduceOp,
    world: u32,
    inputs: usize,
    len: usize,
) -> Result<Kernel, ReduceError> {
    let kernel = Kernel::new(dtype, op).ok_or(ReduceError::Unsupported { dtype, op })?;
    if inputs == 0 {
        return Err(ReduceError::NoInputs);
    }
    if world == 0 {
        return Err(ReduceError::ZeroWorld);
    }
    if !len.is_multiple_of(dtype.size()) {
        return Err(ReduceError::PartialElement { dtype, len });
    }
    Ok(kernel)
}

/// Reduces `len` bytes of the `inputs` sources `src(0)`, `src(1)`, .. (rank
/// order) into `out`, as the backend's data path does: one chunk of
/// `chunk_bytes` accumulator bytes at a time, read from every source in the
/// passes of [`groups`] ([`Kernel::first`], then [`Kernel::fold`]), then
/// finished and written out with `stores` ([`Kernel::write`]; streaming
/// stores are fenced before the return).
///
/// # Safety
/// `len` is a multiple of the kernel's element size, `inputs > 0` and
/// `world > 0`; for every `r < inputs`, `src(r)` is valid for reads of
/// `len` bytes, and `out` for writes of `len` bytes, for the whole call.
/// `out` may be the very same memory as a source: every chunk is read from
/// all of them before any of it is written.
unsafe fn drive(
    kernel: &Kernel,
    world: u32,
    inputs: usize,
    src: impl Fn(usize) -> *const u8,
    out: *mut u8,
    len: usize,
    (chunk_bytes, stores): (usize, Stores),
) {
    let size = kernel.elem_size();
    let chunk_elems = (chunk_bytes / kernel.acc_size()).max(1);
    SCRATCH.with_borrow_mut(|scratch| {
        scratch.reserve(chunk_elems * kernel.acc_size());
        let mut done = 0;
        while done < len {
            let bytes = (chunk_elems * size).min(len - done);
            let n = bytes / size;
            let mut start = 0;
            for group in groups(inputs) {
                let mut srcs = [ptr::null::<u8>(); MAX_GROUP];
                for (k, s) in srcs[..group].iter_mut().enumerate() {
                    // In bounds: `done < len`.
                    *s = src(start + k).wrapping_add(done);
                }
                let srcs = &srcs[..group];
                // SAFETY: each pointer addresses bytes `done..done + bytes`
                // of a source, readable by the caller's promise; `n`
                // elements fit the scratch (reserved above).
                unsafe {
                    if start == 0 {
                        kernel.first(scratch, 0, srcs, n);
                    } else {
                        kernel.fold(scratch, 0, srcs, n);
                    }
                }
                start += group;
            }
            let result = kernel.finish(scratch, n, world);
            // SAFETY: bytes `done..done + bytes` of `out` are writable by
            // the caller's promise; `result` (`bytes` long) is our scratch,
            // which cannot overlap them.
            unsafe { kernel.write(result, out.add(done), stores) };
            done += bytes;
        }
    });
    if stores == Stores::Streaming {
        store::fence();
    }
}

#[cfg(test)]
mod tests {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    use super::*;
    use crate::reference::{self, Rng};
    use crate::CHUNK_BYTES;

    /// `bytes` at byte offset `skew` of a fresh buffer (unaligned for
    /// every dtype wider than a byte when `skew` is odd).
    fn shifted(bytes: &[u8], skew: usize) -> Vec<u8> {
        let mut v = vec![0x5a; skew];
        v.extend_from_slice(bytes);
        v
    }

    /// Reduces `inputs` out of place (output and inputs at odd offsets)
    /// and in place as every rank; checks all against the reference and
    /// the in-place results against the out-of-place one, bit for bit.
    fn check_all(dtype: Dtype, op: ReduceOp, inputs: &[Vec<u8>], chunk_bytes: usize) {
        let world = inputs.len() as u32;
        let len = inputs[0].len();
        let what = format!("{dtype} {op} N={world} len={len} chunk={chunk_bytes}");
        let refs: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
        let want = reference::reduce(dtype, op, world, &refs);
        let held: Vec<Vec<u8>> = inputs
            .iter()
            .enumerate()
            .map(|(r, b)| shifted(b, 1 + r % 7))
            .collect();
        let unaligned: Vec<&[u8]> = held
            .iter()
            .enumerate()
            .map(|(r, b)| &b[1 + r % 7..])
            .collect();
        for stores in [Stores::Cached, Stores::Streaming] {
            let what = format!("{what} {stores:?}");
            let mut out = vec![0xee; len + 3];
            reduce_into_tuned(
                dtype,
                op,
                world,
                &unaligned,
                &mut out[3..],
                chunk_bytes,
                stores,
            )
            .unwrap_or_else(|e| panic!("{what}: {e}"));
            let got = &out[3..];
            reference::check(dtype, got, &want).unwrap_or_else(|e| panic!("{what}: {e}"));
            for own_rank in 0..inputs.len() {
                let mut own = shifted(&inputs[own_rank], 1);
                let others: Vec<&[u8]> = (0..inputs.len())
                    .filter(|&r| r != own_rank)
                    .map(|r| unaligned[r])
                    .collect();
                reduce_in_place_tuned(
                    dtype,
                    op,
                    world,
                    own_rank,
                    &mut own[1..],
                    &others,
                    chunk_bytes,
                    stores,
                )
                .unwrap_or_else(|e| panic!("{what} own rank {own_rank}: {e}"));
                assert_eq!(&own[1..], got, "{what}: in place as rank {own_rank}");
            }
        }
    }

    #[test]
    fn every_dtype_op_and_world_matches_the_reference_across_chunks() {
        let mut rng = Rng::new(21);
        // 256 accumulator bytes: 32 to 256 elements a chunk, so a few
        // hundred elements cross several chunk boundaries.
        let chunk_bytes = 256;
        for (dtype, op) in reference::pairs() {
            let acc = Kernel::new(dtype, op).unwrap().acc_size();
            let ce = chunk_bytes / acc;
            for world in 1..=9 {
                for n in [0, 1, 3, 17, ce - 1, ce, ce + 1, 2 * ce + 3, 3 * ce] {
                    let inputs: Vec<Vec<u8>> = (0..world).map(|_| rng.elems(dtype, n)).collect();
                    check_all(dtype, op, &inputs, chunk_bytes);
                }
            }
        }
    }

    #[test]
    fn lengths_around_the_real_chunk_edges_match_the_reference() {
        let mut rng = Rng::new(22);
        for (dtype, op) in reference::pairs() {
            let ce = CHUNK_BYTES / Kernel::new(dtype, op).unwrap().acc_size();
            for world in [1, 2, 5, 9] {
                for n in [ce - 1, ce, ce + 1, 2 * ce + 1] {
                    let inputs: Vec<Vec<u8>> = (0..world).map(|_| rng.elems(dtype, n)).collect();
                    check_all(dtype, op, &inputs, CHUNK_BYTES);
                }
            }
        }
    }

    /// The public entry points (the built-in chunk size) agree with the
    /// kernels driven by hand in a single chunk and one pass per input:
    /// the same bits, NaN payloads included.
    #[test]
    fn results_equal_the_kernels_bit_for_bit_nans_included() {
        let mut rng = Rng::new(23);
        // Signalling NaNs with payloads, of either sign.
        let nan = |dtype| -> Vec<u8> {
            match dtype {
                Dtype::F32 => 0x7f80_0001u32.to_le_bytes().to_vec(),
                Dtype::F64 => 0xfff4_0000_0000_0abcu64.to_le_bytes().to_vec(),
                Dtype::F16 => 0x7c01u16.to_le_bytes().to_vec(),
                _ => 0xffa3u16.to_le_bytes().to_vec(),
            }
        };
        for (dtype, op) in reference::pairs() {
            let kernel = Kernel::new(dtype, op).unwrap();
            let size = dtype.size();
            let n = CHUNK_BYTES / kernel.acc_size() + 5;
            for world in 1..=6usize {
                let mut inputs: Vec<Vec<u8>> = (0..world).map(|_| rng.elems(dtype, n)).collect();
                if dtype.is_float() {
                    for _ in 0..40 {
                        let (r, i) = (rng.below(world), rng.below(n));
                        inputs[r][i * size..(i + 1) * size].copy_from_slice(&nan(dtype));
                    }
                }
                let refs: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
                let mut got = vec![0; n * size];
                reduce_into(dtype, op, world as u32, &refs, &mut got).unwrap();
                let mut scratch = Scratch::with_bytes(n * kernel.acc_size());
                for (r, input) in inputs.iter().enumerate() {
                    // SAFETY: every input holds `n` elements.
                    unsafe {
                        if r == 0 {
                            kernel.first(&mut scratch, 0, &[input.as_ptr()], n);
                        } else {
                            kernel.fold(&mut scratch, 0, &[input.as_ptr()], n);
                        }
                    }
                }
                let want = kernel.finish(&mut scratch, n, world as u32);
                assert!(got == want, "{dtype} {op} N={world}");
            }
        }
    }

    /// Either side of the streaming threshold (so through both kinds of
    /// stores), out of place at an odd output offset and in place: the
    /// reference's bits.
    #[test]
    fn results_either_side_of_the_streaming_threshold_match_the_reference() {
        let mut rng = Rng::new(25);
        let dtype = Dtype::F32;
        for len in [crate::STREAM_FROM - 4, crate::STREAM_FROM] {
            assert_eq!(
                Stores::for_output(len) == Stores::Streaming,
                len == crate::STREAM_FROM
            );
            let inputs: Vec<Vec<u8>> = (0..3).map(|_| rng.elems(dtype, len / 4)).collect();
            let refs: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
            let want = reference::reduce(dtype, ReduceOp::Sum, 3, &refs);
            let mut out = vec![0u8; len + 4];
            reduce_into(dtype, ReduceOp::Sum, 3, &refs, &mut out[4..]).unwrap();
            assert!(out[4..] == want[..], "out of place, {len} bytes");
            assert_eq!(out[..4], [0; 4], "before the output");
            let mut own = inputs[1].clone();
            reduce_in_place(dtype, ReduceOp::Sum, 3, 1, &mut own, &[refs[0], refs[2]]).unwrap();
            assert!(own == want, "in place, {len} bytes");
        }
    }

    #[test]
    fn bad_arguments_are_errors_and_write_nothing() {
        let a = [1u8; 8];
        let b = [2u8; 8];
        let mut out = [9u8; 8];
        let mut call = |dtype, op, world, inputs: &[&[u8]], len: usize| {
            let r = reduce_into(dtype, op, world, inputs, &mut out[..len]);
            assert_eq!(out, [9; 8]);
            r.unwrap_err()
        };
        use ReduceError::*;
        let (f32_, sum) = (Dtype::F32, ReduceOp::Sum);
        assert_eq!(
            call(f32_, ReduceOp::Band, 2, &[&a, &b], 8),
            Unsupported {
                dtype: f32_,
                op: ReduceOp::Band
            }
        );
        assert_eq!(call(f32_, sum, 2, &[], 8), NoInputs);
        assert_eq!(call(f32_, sum, 0, &[&a, &b], 8), ZeroWorld);
        assert_eq!(
            call(f32_, sum, 2, &[&a, &b[..4]], 8),
            LengthMismatch {
                rank: 1,
                len: 4,
                want: 8
            }
        );
        assert_eq!(
            call(f32_, sum, 2, &[&a[..6], &b[..6]], 6),
            PartialElement {
                dtype: f32_,
                len: 6
            }
        );
        let mut own = [9u8; 8];
        let mut call = |rank, others: &[&[u8]]| {
            let r = reduce_in_place(f32_, sum, 3, rank, &mut own, others);
            assert_eq!(own, [9; 8]);
            r.unwrap_err()
        };
        assert_eq!(call(3, &[&a, &b]), RankOutOfRange { rank: 3, inputs: 3 });
        // Ranks name the contributions, `own` counted.
        assert_eq!(
            call(0, &[&a, &b[..4]]),
            LengthMismatch {
                rank: 2,
                len: 4,
                want: 8
            }
        );
        assert_eq!(
            call(2, &[&a, &b[..4]]),
            LengthMismatch {
                rank: 1,
                len: 4,
                want: 8
            }
        );
        assert_eq!(
            Unsupported {
                dtype: Dtype::Bf16,
                op: ReduceOp::Bxor
            }
            .to_string(),
            "bxor is not defined for bf16"
        );
    }

    #[test]
    fn a_world_of_one_quiets_nans_and_avg_divides_by_world() {
        // A lone signalling NaN comes out quiet, as on the device.
        let mut own = 0x7f80_0001u32.to_le_bytes();
        reduce_in_place(Dtype::F32, ReduceOp::Sum, 1, 0, &mut own, &[]).unwrap();
        assert_eq!(u32::from_le_bytes(own), 0x7fc0_0001);
        // avg divides by `world`, not by the number of inputs.
        let mut out = [0u8; 4];
        let two = 2i32.to_le_bytes();
        reduce_into(Dtype::I32, ReduceOp::Avg, 4, &[&two, &two], &mut out).unwrap();
        assert_eq!(i32::from_le_bytes(out), 1);
    }

    /// Counts the calling thread's allocations, for
    /// `warm_calls_do_not_allocate`; everything else passes through.
    struct Counting;

    thread_local! {
        static ALLOCATIONS: Cell<usize> = const { Cell::new(0) };
    }

    fn count() {
        // `try_with`: a thread's last frees may come after its locals die.
        let _ = ALLOCATIONS.try_with(|c| c.set(c.get() + 1));
    }

    // SAFETY: every call is passed on to `System` unchanged; counting
    // touches only a const-initialised thread-local `Cell` (no allocation,
    // no destructor).
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            count();
            // SAFETY: the caller's promises are `System`'s.
            unsafe { System.alloc(layout) }
        }
        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            count();
            // SAFETY: as in `alloc`.
            unsafe { System.alloc_zeroed(layout) }
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            count();
            // SAFETY: as in `alloc`.
            unsafe { System.realloc(ptr, layout, new_size) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            // SAFETY: as in `alloc`.
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    #[global_allocator]
    static COUNTING: Counting = Counting;

    #[test]
    fn warm_calls_do_not_allocate() {
        let mut rng = Rng::new(24);
        let n = 3 * CHUNK_BYTES;
        let inputs: Vec<Vec<u8>> = (0..7).map(|_| rng.elems(Dtype::F16, n)).collect();
        let refs: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
        let mut out = vec![0u8; inputs[0].len()];
        let mut own = inputs[2].clone();
        let others = [refs[0], refs[1], refs[3], refs[4], refs[5], refs[6]];
        // The first call sizes this thread's scratch.
        reduce_into(Dtype::F16, ReduceOp::Avg, 7, &refs, &mut out).unwrap();
        let before = ALLOCATIONS.with(Cell::get);
        for _ in 0..3 {
            reduce_into(Dtype::F16, ReduceOp::Avg, 7, &refs, &mut out).unwrap();
            reduce_into(Dtype::U64, ReduceOp::Bxor, 7, &refs, &mut out).unwrap();
            reduce_in_place(Dtype::F16, ReduceOp::Avg, 7, 2, &mut own, &others).unwrap();
            own.copy_from_slice(refs[2]);
        }
        assert_eq!(ALLOCATIONS.with(Cell::get), before);
        assert_eq!(out.len(), n * 2);
    }
}
