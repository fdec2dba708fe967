//! Single-copy data movement over scatter-gather lists of host memory.
//!
//! A collective's buffers are lists of segments of the members' guest
//! memory, as mapped in this process. [`reduce_range`] reads every input
//! once and writes every output once: one cache-sized chunk at a time, it
//! folds the inputs but the last [`MAX_GROUP`] or fewer into this thread's
//! accumulator ([`dmlc_reduce`]) in rank order, up to [`MAX_GROUP`] inputs
//! per pass, and then the last pass ([`Kernel::through`]) reads the last
//! inputs a few lines at a time and writes each finished block straight
//! to every output: with non-temporal (streaming) stores when the
//! collective writes at least [`dmlc_reduce::STREAM_FROM`] bytes
//! ([`Tuning`]), fenced before the call returns. Each list is walked by its
//! own cursor: a segment boundary splits only the pass that reads it or
//! writes it (the lists of one pass are walked in lock-step), never the
//! chunk itself.
//!
//! Because every block is read from every input before any of it is
//! written, an output may be the very same memory as an input (in-place
//! collectives).
//! [`copy_range`] (broadcast, allgather) likewise reads each source chunk
//! once from memory for all of its destinations.
//!
//! All guest memory is touched through raw pointers only: a guest may
//! change its memory at any time, and every bit pattern is valid data, so
//! a misbehaving guest can spoil its own results but not this process.

use std::cell::RefCell;
use std::ptr;

use virtio_dmlc::{Dtype, ReduceOp};

use dmlc_reduce::{groups, lowest, Isa, Kernel, NonFinite, Scratch, Stores, MAX_GROUP};

/// Source bytes per step of a copy to several destinations: the chunk is
/// read from memory once and from cache for the other destinations.
pub const COPY_CHUNK_BYTES: usize = 64 << 10;

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

/// A cursor in a segment list: segment index and byte offset in it. It
/// always rests inside a non-empty segment, or past the last one.
#[derive(Clone, Copy, Debug)]
struct Pos {
    seg: usize,
    off: usize,
}

impl Pos {
    fn start(r: &SegRef<'_>) -> Pos {
        let mut pos = Pos {
            seg: 0,
            off: r.offset,
        };
        pos.settle(r.segs);
        pos
    }

    /// Moves past used-up and empty segments.
    fn settle(&mut self, segs: &[HostSeg]) {
        while let Some(seg) = segs.get(self.seg) {
            if self.off < seg.len {
                break;
            }
            self.off -= seg.len;
            self.seg += 1;
        }
    }

    /// The contiguous bytes from here to the end of the segment.
    fn piece(&self, segs: &[HostSeg]) -> (*mut u8, usize) {
        let seg = segs
            .get(self.seg)
            .expect("range runs past the end of a segment list");
        // Only an address computation; it is dereferenced under the
        // caller's promise that the segment is valid.
        (seg.ptr.wrapping_add(self.off), seg.len - self.off)
    }

    fn advance(&mut self, segs: &[HostSeg], n: usize) {
        self.off += n;
        self.settle(segs);
    }
}

/// Calls `f(at, ptr, n)` for the contiguous pieces of the next `len` bytes
/// of `segs`, `at` counting from the start of this walk.
fn walk(segs: &[HostSeg], pos: &mut Pos, len: usize, mut f: impl FnMut(usize, *mut u8, usize)) {
    let mut at = 0;
    while at < len {
        let (p, avail) = pos.piece(segs);
        let n = avail.min(len - at);
        f(at, p, n);
        pos.advance(segs, n);
        at += n;
    }
}

/// As [`walk`], over two lists in lock-step: pieces end at the boundaries
/// of either.
fn walk2(
    (a, a_pos): (&[HostSeg], &mut Pos),
    (b, b_pos): (&[HostSeg], &mut Pos),
    len: usize,
    mut f: impl FnMut(usize, *mut u8, *mut u8, usize),
) {
    let mut at = 0;
    while at < len {
        let (pa, na) = a_pos.piece(a);
        let (pb, nb) = b_pos.piece(b);
        let n = na.min(nb).min(len - at);
        f(at, pa, pb, n);
        a_pos.advance(a, n);
        b_pos.advance(b, n);
        at += n;
    }
}

/// As [`walk`], over several lists in lock-step, those of `a` then those
/// of `b` (a group of inputs and the outputs): pieces end at the
/// boundaries of any of them, and `f` gets one pointer per list, in
/// `ptrs`.
fn walk_lists(
    (a, a_pos): (&[SegRef<'_>], &mut [Pos]),
    (b, b_pos): (&[SegRef<'_>], &mut [Pos]),
    ptrs: &mut Vec<*mut u8>,
    len: usize,
    mut f: impl FnMut(usize, &[*mut u8], usize),
) {
    let mut at = 0;
    while at < len {
        let mut n = len - at;
        ptrs.clear();
        for (r, p) in a.iter().zip(a_pos.iter()).chain(b.iter().zip(b_pos.iter())) {
            let (piece, avail) = p.piece(r.segs);
            ptrs.push(piece);
            n = n.min(avail);
        }
        f(at, ptrs, n);
        for (r, p) in a
            .iter()
            .zip(a_pos.iter_mut())
            .chain(b.iter().zip(b_pos.iter_mut()))
        {
            p.advance(r.segs, n);
        }
        at += n;
    }
}

/// Per-thread state of the data path, kept between calls so that a call
/// allocates nothing once the thread has warmed up.
struct State {
    scratch: Scratch,
    inputs: Vec<Pos>,
    outputs: Vec<Pos>,
    /// The pointers of one piece of a walk.
    ptrs: Vec<*mut u8>,
}

thread_local! {
    static STATE: RefCell<State> = const {
        RefCell::new(State {
            scratch: Scratch::new(),
            inputs: Vec::new(),
            outputs: Vec::new(),
            ptrs: Vec::new(),
        })
    };
}

/// How [`reduce_range_tuned`] moves its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tuning {
    /// Accumulator bytes of one chunk.
    pub chunk_bytes: usize,
    /// How the outputs are written.
    pub stores: Stores,
}

impl Tuning {
    /// The stores for a collective that writes `output_bytes` bytes in
    /// all, every output counted ([`Stores::for_output`]), and their
    /// chunk ([`Stores::chunk_bytes`]). Every range of one collective
    /// takes the tuning of the whole.
    pub fn for_output(output_bytes: usize) -> Tuning {
        let stores = Stores::for_output(output_bytes);
        Tuning {
            chunk_bytes: stores.chunk_bytes(),
            stores,
        }
    }
}

/// Reduces `len` bytes: for every output `o`, `o[..len] = reduce(inputs[0][..len], .., inputs[n-1][..len])`,
/// inputs in the order given (rank order), moving through a cache-sized scratch.
///
/// `world` is the divisor of avg. An output may be the very same memory as
/// an input at the same position (in place): each chunk is read fully
/// before any of it is written. The tuning is that of a collective of
/// these `len` bytes ([`Tuning::for_output`]).
///
/// # Panics
/// If `op` is not defined for `dtype`, `inputs` is empty, `world` is 0, or
/// the preconditions on lengths below do not hold (checked as the lists are
/// walked, so outputs may be partly written).
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
    let tuning = Tuning::for_output(len.saturating_mul(outputs.len()));
    // SAFETY: the caller's promises are those of `reduce_range_tuned`.
    unsafe { reduce_range_tuned(dtype, op, world, inputs, outputs, len, tuning) }
}

/// [`reduce_range`] with the given chunk size and stores (the engine's
/// ranges of one collective all take its tuning; tests and the benchmark
/// set their own). With [`Stores::Streaming`], the outputs are fenced
/// ([`dmlc_reduce::fence`]) before it returns, so that whoever publishes
/// the result after it (a completion, an atomic) publishes all of it.
///
/// # Panics
/// As [`reduce_range`].
///
/// # Safety
/// As [`reduce_range`].
pub unsafe fn reduce_range_tuned(
    dtype: Dtype,
    op: ReduceOp,
    world: u32,
    inputs: &[SegRef<'_>],
    outputs: &[SegRef<'_>],
    len: usize,
    tuning: Tuning,
) {
    // SAFETY: the caller's promises.
    unsafe { reduce_range_with(dtype, op, world, inputs, outputs, len, tuning, false) };
}

/// [`reduce_range_tuned`] that also checks the inputs for NaN and infinity
/// in the loops that read them (spec 5.X.6.14), writing the outputs as
/// the unchecked reduction would: returns the lowest input (its index in
/// `inputs`) with a non-finite element and the lowest such element of it,
/// counted from the start of the range. For an integer dtype, `None`.
///
/// # Panics
/// As [`reduce_range`].
///
/// # Safety
/// As [`reduce_range`].
pub unsafe fn reduce_range_checked(
    dtype: Dtype,
    op: ReduceOp,
    world: u32,
    inputs: &[SegRef<'_>],
    outputs: &[SegRef<'_>],
    len: usize,
    tuning: Tuning,
) -> Option<NonFinite> {
    // SAFETY: the caller's promises.
    unsafe { reduce_range_with(dtype, op, world, inputs, outputs, len, tuning, true) }
}

/// [`reduce_range_tuned`], checked or not.
///
/// # Safety
/// As [`reduce_range`].
#[allow(clippy::too_many_arguments)]
unsafe fn reduce_range_with(
    dtype: Dtype,
    op: ReduceOp,
    world: u32,
    inputs: &[SegRef<'_>],
    outputs: &[SegRef<'_>],
    len: usize,
    tuning: Tuning,
    check: bool,
) -> Option<NonFinite> {
    let Tuning {
        chunk_bytes,
        stores,
    } = tuning;
    let kernel = Kernel::with_check(dtype, op, Isa::best(), check)
        .unwrap_or_else(|| panic!("{op} is not defined for {dtype}"));
    let size = dtype.size();
    assert!(!inputs.is_empty(), "reduction without inputs");
    assert!(world > 0, "world size is zero");
    assert_eq!(len % size, 0, "length is not a whole number of elements");
    if len == 0 {
        return None;
    }
    let chunk_elems = (chunk_bytes / kernel.acc_size()).max(1);
    let whole = |n: usize| {
        assert_eq!(n % size, 0, "segment boundary inside an element");
        n / size
    };
    // No allocation: this runs for every piece of every collective.
    let passes = groups(inputs.len()).count();
    let last = groups(inputs.len()).last().expect("inputs is not empty");
    // The inputs before the last pass; without them no accumulator is
    // needed, and the last pass runs over the whole range at once.
    let earlier = inputs.len() - last;
    let chunk = if earlier == 0 {
        len
    } else {
        chunk_elems * size
    };
    // The lowest (input, element) found so far, elements counted from the
    // start of the range.
    let mut found: Option<NonFinite> = None;
    STATE.with_borrow_mut(|st| {
        let State {
            scratch,
            inputs: in_pos,
            outputs: out_pos,
            ptrs,
        } = st;
        if earlier > 0 {
            scratch.reserve(chunk_elems * kernel.acc_size());
        }
        in_pos.clear();
        in_pos.extend(inputs.iter().map(Pos::start));
        out_pos.clear();
        out_pos.extend(outputs.iter().map(Pos::start));
        let mut done = 0;
        while done < len {
            let bytes = chunk.min(len - done);
            // Fold the chunk of every input but the last pass's into the
            // accumulator, a group of inputs per pass, in rank order.
            let mut start = 0;
            for group in groups(inputs.len()).take(passes - 1) {
                let end = start + group;
                let no_outputs = (&outputs[..0], &mut out_pos[..0]);
                let group_inputs = (&inputs[start..end], &mut in_pos[start..end]);
                walk_lists(group_inputs, no_outputs, ptrs, bytes, |at, srcs, n| {
                    let (at, n) = (whole(at), whole(n));
                    let mut group_srcs = [ptr::null::<u8>(); MAX_GROUP];
                    for (g, s) in group_srcs.iter_mut().zip(srcs) {
                        *g = s.cast_const();
                    }
                    let srcs = &group_srcs[..srcs.len()];
                    // SAFETY: every piece lies in an input segment, which
                    // the caller guarantees readable; the kernel reads
                    // them through raw pointers only.
                    let bad = unsafe {
                        if start == 0 {
                            kernel.first(scratch, at, srcs, n)
                        } else {
                            kernel.fold(scratch, at, srcs, n)
                        }
                    };
                    let chunk_at = whole(done) + at;
                    found = lowest(found, bad.map(|(k, i)| (start + k, chunk_at + i)));
                });
                start = end;
            }
            // The last pass reads its inputs and writes every output in
            // the same loop, a few lines at a time (Kernel::through).
            let last_inputs = (&inputs[earlier..], &mut in_pos[earlier..]);
            let all_outputs = (outputs, &mut out_pos[..]);
            walk_lists(last_inputs, all_outputs, ptrs, bytes, |at, ptrs, n| {
                let (at, n) = (whole(at), whole(n));
                let (srcs, dsts) = ptrs.split_at(last);
                let mut last_srcs = [ptr::null::<u8>(); MAX_GROUP];
                for (l, s) in last_srcs.iter_mut().zip(srcs) {
                    *l = s.cast_const();
                }
                let acc = (earlier > 0).then_some((&mut *scratch, at));
                // SAFETY: the sources lie in input segments (readable) and
                // the destinations in output segments (writable), by the
                // caller's promise; no guest memory overlaps our scratch.
                let bad =
                    unsafe { kernel.through(acc, &last_srcs[..last], dsts, n, world, stores) };
                let chunk_at = whole(done) + at;
                found = lowest(found, bad.map(|(k, i)| (earlier + k, chunk_at + i)));
            });
            done += bytes;
        }
    });
    if stores == Stores::Streaming {
        dmlc_reduce::fence();
    }
    found
}

/// Copies `len` bytes from `src` into every destination in `dsts`.
/// A destination that is the very same memory as the source is skipped.
///
/// # Panics
/// If a list ends before `len` bytes (checked as the lists are walked).
///
/// # Safety
/// As for [`reduce_range`].
pub unsafe fn copy_range(src: SegRef<'_>, dsts: &[SegRef<'_>], len: usize) {
    if len == 0 {
        return;
    }
    // With one destination there is nothing to keep in cache.
    let step = if dsts.len() > 1 {
        COPY_CHUNK_BYTES
    } else {
        len
    };
    STATE.with_borrow_mut(|st| {
        let mut src_pos = Pos::start(&src);
        st.outputs.clear();
        st.outputs.extend(dsts.iter().map(Pos::start));
        let mut done = 0;
        while done < len {
            let bytes = step.min(len - done);
            for (dst, pos) in dsts.iter().zip(&mut st.outputs) {
                let mut from = src_pos;
                walk2(
                    (src.segs, &mut from),
                    (dst.segs, pos),
                    bytes,
                    |_, s, d, n| {
                        if s != d {
                            // SAFETY: `s` lies in a source segment
                            // (readable) and `d` in a destination segment
                            // (writable), by the caller's promise;
                            // `ptr::copy` allows a guest's buffers to
                            // overlap each other.
                            unsafe { ptr::copy(s, d, n) }
                        }
                    },
                );
            }
            walk(src.segs, &mut src_pos, bytes, |_, _, _| {});
            done += bytes;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use dmlc_reduce::reference::{self, Rng};
    use dmlc_reduce::CHUNK_BYTES;

    const CANARY: u8 = 0xcd;
    const GAP: usize = 8;

    /// A buffer scattered over host memory: its segments lie in reverse
    /// order with canary bytes between them.
    struct Buf {
        _mem: Vec<u8>,
        base: *mut u8,
        size: usize,
        segs: Vec<HostSeg>,
    }

    impl Buf {
        /// A buffer of `lens` segments (in logical order).
        fn new(lens: &[usize]) -> Buf {
            let size = lens.iter().sum::<usize>() + GAP * (lens.len() + 1);
            let mut mem = vec![CANARY; size];
            let base = mem.as_mut_ptr();
            let mut end = size - GAP;
            let segs = lens
                .iter()
                .map(|&len| {
                    end -= len;
                    let seg = HostSeg {
                        ptr: base.wrapping_add(end),
                        len,
                    };
                    end -= GAP;
                    seg
                })
                .collect();
            Buf {
                _mem: mem,
                base,
                size,
                segs,
            }
        }

        /// A buffer of `elems` elements of `size` bytes in random segments:
        /// single elements, empty ones and longer runs.
        fn random(rng: &mut Rng, elems: usize, size: usize) -> Buf {
            let mut lens = Vec::new();
            let mut left = elems;
            while left > 0 {
                let n = match rng.below(4) {
                    0 => 1,
                    1 => 0,
                    2 => rng.below(8),
                    _ => rng.below(400),
                }
                .min(left);
                lens.push(n * size);
                left -= n;
            }
            Buf::new(&lens)
        }

        fn whole(&self) -> SegRef<'_> {
            self.at(0)
        }

        fn at(&self, offset: usize) -> SegRef<'_> {
            SegRef {
                segs: &self.segs,
                offset,
            }
        }

        /// The buffer's bytes in logical order.
        fn read(&self) -> Vec<u8> {
            let mut out = Vec::new();
            for seg in &self.segs {
                // SAFETY: the segment lies in `_mem`, which lives as long as
                // `self`; nothing writes it meanwhile.
                out.extend_from_slice(unsafe { std::slice::from_raw_parts(seg.ptr, seg.len) });
            }
            out
        }

        fn write(&self, data: &[u8]) {
            let mut at = 0;
            for seg in &self.segs {
                // SAFETY: as in `read`; `data` is ours and disjoint.
                unsafe { ptr::copy_nonoverlapping(data[at..].as_ptr(), seg.ptr, seg.len) };
                at += seg.len;
            }
            assert_eq!(at, data.len());
        }

        /// Checks that nothing outside the segments was written.
        fn assert_canaries(&self) {
            // SAFETY: `base` addresses the `size` bytes of `_mem`.
            let mem = unsafe { std::slice::from_raw_parts(self.base, self.size) };
            let mut inside = vec![false; self.size];
            for seg in &self.segs {
                let start = seg.ptr as usize - self.base as usize;
                inside[start..start + seg.len].fill(true);
            }
            for (i, (&b, &ins)) in mem.iter().zip(&inside).enumerate() {
                assert!(ins || b == CANARY, "byte {i} outside the segments written");
            }
        }
    }

    /// Inputs filled with random data, each member segmented its own way,
    /// and outputs segmented differently again.
    fn setup(rng: &mut Rng, dtype: Dtype, world: usize, elems: usize) -> (Vec<Buf>, Vec<Buf>) {
        let size = dtype.size();
        let inputs: Vec<Buf> = (0..world)
            .map(|_| {
                let buf = Buf::random(rng, elems, size);
                buf.write(&rng.elems(dtype, elems));
                buf
            })
            .collect();
        let outputs = (0..world).map(|_| Buf::random(rng, elems, size)).collect();
        (inputs, outputs)
    }

    fn want(dtype: Dtype, op: ReduceOp, inputs: &[Buf]) -> Vec<u8> {
        let data: Vec<Vec<u8>> = inputs.iter().map(Buf::read).collect();
        let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        reference::reduce(dtype, op, inputs.len() as u32, &refs)
    }

    const STORES: [Stores; 2] = [Stores::Cached, Stores::Streaming];

    fn tuning(chunk_bytes: usize, stores: Stores) -> Tuning {
        Tuning {
            chunk_bytes,
            stores,
        }
    }

    fn run(dtype: Dtype, op: ReduceOp, inputs: &[Buf], outputs: &[Buf], len: usize, t: Tuning) {
        let ins: Vec<SegRef> = inputs.iter().map(Buf::whole).collect();
        let outs: Vec<SegRef> = outputs.iter().map(Buf::whole).collect();
        // SAFETY: every segment lies in a live Buf of at least `len` bytes.
        unsafe { reduce_range_tuned(dtype, op, inputs.len() as u32, &ins, &outs, len, t) }
    }

    fn check_outputs(dtype: Dtype, outputs: &[Buf], want: &[u8], what: &str) {
        for (r, out) in outputs.iter().enumerate() {
            out.assert_canaries();
            if let Err(e) = reference::check(dtype, &out.read(), want) {
                panic!("{what}, output {r}: {e}");
            }
        }
    }

    #[test]
    fn reduce_matches_reference_for_every_dtype_op_and_world() {
        let mut rng = Rng::new(7);
        for (dtype, op) in reference::pairs() {
            for world in [1, 2, 3, 4, 5, 8, 9] {
                for (elems, stores) in [1, 3, 7, 33, 1001]
                    .into_iter()
                    .flat_map(|e| STORES.map(|s| (e, s)))
                {
                    let (inputs, outputs) = setup(&mut rng, dtype, world, elems);
                    let want = want(dtype, op, &inputs);
                    // Small chunks, so that 1001 elements take several
                    // chunks and a tail.
                    let t = tuning(448, stores);
                    run(dtype, op, &inputs, &outputs, elems * dtype.size(), t);
                    let what = format!("{dtype} {op} N={world} elems={elems} {stores:?}");
                    check_outputs(dtype, &outputs, &want, &what);
                    for input in &inputs {
                        input.assert_canaries();
                    }
                }
            }
        }
    }

    #[test]
    fn reduce_over_several_default_chunks_and_a_tail() {
        let mut rng = Rng::new(8);
        let cases = [
            (Dtype::F32, ReduceOp::Sum),
            (Dtype::U8, ReduceOp::Bxor),
            (Dtype::F16, ReduceOp::Avg),
            (Dtype::Bf16, ReduceOp::Max),
            (Dtype::I64, ReduceOp::Prod),
        ];
        for (dtype, op) in cases {
            let chunk_elems = CHUNK_BYTES / Kernel::new(dtype, op).unwrap().acc_size();
            let elems = 3 * chunk_elems + 17;
            let (inputs, outputs) = setup(&mut rng, dtype, 3, elems);
            let want = want(dtype, op, &inputs);
            let ins: Vec<SegRef> = inputs.iter().map(Buf::whole).collect();
            let outs: Vec<SegRef> = outputs.iter().map(Buf::whole).collect();
            // SAFETY: every segment lies in a live Buf of `elems` elements.
            unsafe { reduce_range(dtype, op, 3, &ins, &outs, elems * dtype.size()) };
            check_outputs(dtype, &outputs, &want, &format!("{dtype} {op}"));
        }
    }

    #[test]
    fn chunk_size_does_not_change_the_result() {
        let mut rng = Rng::new(9);
        let dtype = Dtype::F16;
        let (inputs, _) = setup(&mut rng, dtype, 4, 777);
        let want = want(dtype, ReduceOp::Sum, &inputs);
        for chunk in [1, 2, 4, 12, 100, 4096, 1 << 20] {
            for stores in STORES {
                let outputs: Vec<Buf> = (0..2).map(|_| Buf::random(&mut rng, 777, 2)).collect();
                run(
                    dtype,
                    ReduceOp::Sum,
                    &inputs,
                    &outputs,
                    777 * 2,
                    tuning(chunk, stores),
                );
                check_outputs(dtype, &outputs, &want, &format!("chunk {chunk} {stores:?}"));
            }
        }
    }

    #[test]
    fn reduce_in_place() {
        let mut rng = Rng::new(10);
        for (dtype, op) in [
            (Dtype::F32, ReduceOp::Sum),
            (Dtype::I8, ReduceOp::Avg),
            (Dtype::Bf16, ReduceOp::Prod),
            (Dtype::U64, ReduceOp::Min),
        ] {
            for (world, stores) in (1..=4).flat_map(|w| STORES.map(|s| (w, s))) {
                let elems = 1999;
                let (inputs, _) = setup(&mut rng, dtype, world, elems);
                let want = want(dtype, op, &inputs);
                // Outputs: the inputs' own lists, and for rank 0 the same
                // memory described by a different list (cut into pieces).
                let mut recut: Vec<HostSeg> = Vec::new();
                for seg in &inputs[0].segs {
                    let cut = (seg.len / dtype.size() / 2) * dtype.size();
                    recut.push(HostSeg {
                        ptr: seg.ptr,
                        len: cut,
                    });
                    recut.push(HostSeg {
                        ptr: seg.ptr.wrapping_add(cut),
                        len: seg.len - cut,
                    });
                }
                let ins: Vec<SegRef> = inputs.iter().map(Buf::whole).collect();
                let mut outs = ins.clone();
                outs[0] = SegRef {
                    segs: &recut,
                    offset: 0,
                };
                let len = elems * dtype.size();
                // SAFETY: every list addresses live Bufs of `len` bytes.
                unsafe {
                    reduce_range_tuned(
                        dtype,
                        op,
                        world as u32,
                        &ins,
                        &outs,
                        len,
                        tuning(1000, stores),
                    )
                };
                let what = format!("{dtype} {op} N={world} {stores:?}");
                check_outputs(dtype, &inputs, &want, &what);
            }
        }
    }

    /// Outputs whose segments start at many offsets in a cache line and a
    /// page, end inside lines, straddle page boundaries and lie apart (as
    /// a chain's segments in different memory regions do), with chunks
    /// that end inside lines too: both kinds of stores give the reference
    /// in every byte of them, and write none outside. Two of the outputs
    /// start at the same offset in a line and then part (written together,
    /// then one after the other), a third is cut at random.
    #[test]
    fn outputs_at_any_alignment_across_pages_get_exactly_their_bytes() {
        let mut rng = Rng::new(16);
        let (dtype, op) = (Dtype::F32, ReduceOp::Sum);
        let elems = 5000;
        let len = elems * 4;
        let (inputs, _) = setup(&mut rng, dtype, 3, elems);
        let want = want(dtype, op, &inputs);
        let ins: Vec<SegRef> = inputs.iter().map(Buf::whole).collect();
        const HALF: usize = 16 * 4096;
        let mut arena = vec![CANARY; 2 * HALF + 4096];
        for (stores, chunk) in STORES
            .into_iter()
            .flat_map(|s| [(s, 448), (s, s.chunk_bytes())])
        {
            for skew in (0..64).step_by(4).chain([4096 - 64, 4096 - 4]) {
                arena.fill(CANARY);
                let page = arena.as_ptr().addr().wrapping_neg() % 4096;
                let base = arena.as_mut_ptr().wrapping_add(page + 4096);
                // 20 bytes past the first page boundary, a short one, two
                // pages and 12 bytes, the rest; 100 + 4i bytes apart in the
                // first output, 164 + 8i in the second (half the arena on).
                let first = 4096 - skew + 20;
                let lens = [first, 44, 8192 + 12, len - first - 44 - 8204];
                let segs_at = |from: usize, gap: usize, step: usize| -> Vec<HostSeg> {
                    let mut at = from + skew;
                    lens.iter()
                        .enumerate()
                        .map(|(i, &n)| {
                            let seg = HostSeg {
                                ptr: base.wrapping_add(at),
                                len: n,
                            };
                            at += n + gap + step * i;
                            seg
                        })
                        .collect()
                };
                let lists = [segs_at(0, 100, 4), segs_at(HALF, 164, 8)];
                let other = Buf::random(&mut rng, elems, 4);
                let outs = [
                    SegRef {
                        segs: &lists[0],
                        offset: 0,
                    },
                    SegRef {
                        segs: &lists[1],
                        offset: 0,
                    },
                    other.whole(),
                ];
                let t = tuning(chunk, stores);
                // SAFETY: the inputs are live Bufs of `len` bytes; each list
                // lies in its half of `arena` (at most 4092 + len + 648
                // bytes from its start, one page past a page boundary).
                unsafe { reduce_range_tuned(dtype, op, 3, &ins, &outs, len, t) };
                let what = format!("{stores:?} chunk {chunk} skew {skew}");
                let mut inside = vec![false; arena.len()];
                for (k, segs) in lists.iter().enumerate() {
                    let mut got = Vec::new();
                    for seg in segs {
                        let start = seg.ptr.addr() - arena.as_ptr().addr();
                        got.extend_from_slice(&arena[start..start + seg.len]);
                        inside[start..start + seg.len].fill(true);
                    }
                    reference::check(dtype, &got, &want)
                        .unwrap_or_else(|e| panic!("{what}, output {k}: {e}"));
                }
                for (i, (&b, &ins)) in arena.iter().zip(&inside).enumerate() {
                    assert!(ins || b == CANARY, "{what}: byte {i} outside written");
                }
                check_outputs(dtype, &[other], &want, &what);
            }
        }
    }

    /// [`reduce_range`] takes its stores from the bytes it writes: either
    /// side of the threshold, the result is the reference's.
    #[test]
    fn reduce_either_side_of_the_streaming_threshold() {
        let mut rng = Rng::new(17);
        let (dtype, op) = (Dtype::F32, ReduceOp::Sum);
        let half = dmlc_reduce::STREAM_FROM / 2;
        for len in [half - 4, half] {
            let streaming = Tuning::for_output(2 * len).stores == Stores::Streaming;
            assert_eq!(streaming, len == half);
            let (inputs, outputs) = setup(&mut rng, dtype, 2, len / 4);
            let want = want(dtype, op, &inputs);
            let ins: Vec<SegRef> = inputs.iter().map(Buf::whole).collect();
            let outs: Vec<SegRef> = outputs.iter().map(Buf::whole).collect();
            // SAFETY: every segment lies in a live Buf of `len` bytes.
            unsafe { reduce_range(dtype, op, 2, &ins, &outs, len) };
            check_outputs(dtype, &outputs, &want, &format!("{len} bytes"));
        }
    }

    #[test]
    fn ranges_at_offsets_compose_into_the_whole() {
        let mut rng = Rng::new(11);
        let dtype = Dtype::I32;
        let op = ReduceOp::Sum;
        let elems = 2500;
        let (inputs, outputs) = setup(&mut rng, dtype, 3, elems);
        let want = want(dtype, op, &inputs);
        // Ranges as the engine's reduction threads would take them.
        let cuts = [0, 16, 1040, 1041, 2500];
        for w in cuts.windows(2) {
            let (offset, len) = (w[0] * 4, (w[1] - w[0]) * 4);
            let ins: Vec<SegRef> = inputs.iter().map(|b| b.at(offset)).collect();
            let outs: Vec<SegRef> = outputs.iter().map(|b| b.at(offset)).collect();
            // SAFETY: each range lies within the live Bufs.
            unsafe { reduce_range(dtype, op, 3, &ins, &outs, len) };
        }
        check_outputs(dtype, &outputs, &want, "ranges");
    }

    #[test]
    fn nan_propagates_through_segmented_buffers() {
        let mut rng = Rng::new(12);
        for dtype in [Dtype::F32, Dtype::F64, Dtype::F16, Dtype::Bf16] {
            for op in [ReduceOp::Min, ReduceOp::Max] {
                let elems = 500;
                let (inputs, outputs) = setup(&mut rng, dtype, 4, elems);
                let size = dtype.size();
                let mut nan_at = vec![false; elems];
                for input in &inputs {
                    let mut data = input.read();
                    for _ in 0..20 {
                        let i = rng.below(elems);
                        nan_at[i] = true;
                        let nan: &[u8] = match dtype {
                            Dtype::F32 => &f32::NAN.to_ne_bytes(),
                            Dtype::F64 => &f64::NAN.to_ne_bytes(),
                            Dtype::F16 => &half::f16::NAN.to_ne_bytes(),
                            _ => &half::bf16::NAN.to_ne_bytes(),
                        };
                        data[i * size..(i + 1) * size].copy_from_slice(nan);
                    }
                    input.write(&data);
                }
                let want = want(dtype, op, &inputs);
                let t = tuning(CHUNK_BYTES, Stores::Streaming);
                run(dtype, op, &inputs, &outputs, elems * size, t);
                check_outputs(dtype, &outputs, &want, &format!("{dtype} {op}"));
                let got = outputs[0].read();
                for (i, &nan) in nan_at.iter().enumerate() {
                    let e = &got[i * size..(i + 1) * size];
                    let is_nan = match dtype {
                        Dtype::F32 => f32::from_ne_bytes(e.try_into().unwrap()).is_nan(),
                        Dtype::F64 => f64::from_ne_bytes(e.try_into().unwrap()).is_nan(),
                        Dtype::F16 => half::f16::from_ne_bytes(e.try_into().unwrap()).is_nan(),
                        _ => half::bf16::from_ne_bytes(e.try_into().unwrap()).is_nan(),
                    };
                    assert_eq!(is_nan, nan, "{dtype} {op} element {i}");
                }
            }
        }
    }

    /// The communicators reduce host buffers with dmlc-reduce's host entry
    /// points (`reduce_in_place`, which shares `reduce_into`'s passes):
    /// its results equal the data path's bit for bit (NaN payloads
    /// included), whatever the segmentation.
    #[test]
    fn reduce_equals_the_host_reduction_bit_for_bit() {
        let mut rng = Rng::new(15);
        for (dtype, op) in reference::pairs() {
            let size = dtype.size();
            let elems = CHUNK_BYTES / Kernel::new(dtype, op).unwrap().acc_size() + 300;
            for world in 1..=9 {
                let (inputs, outputs) = setup(&mut rng, dtype, world, elems);
                let mut data: Vec<Vec<u8>> = inputs.iter().map(Buf::read).collect();
                if dtype.is_float() {
                    // Signalling NaNs with payloads, of either sign.
                    let nans: [u64; 2] = match dtype {
                        Dtype::F32 => [0x7f80_0001, 0xffa0_1234],
                        Dtype::F64 => [0x7ff0_0000_0000_0001, 0xfff4_0000_0000_0abc],
                        Dtype::F16 => [0x7c01, 0xfd23],
                        _ => [0x7f81, 0xffa3],
                    };
                    for _ in 0..30 {
                        let (r, i) = (rng.below(world), rng.below(elems));
                        let nan = nans[rng.below(2)].to_ne_bytes();
                        data[r][i * size..(i + 1) * size].copy_from_slice(&nan[..size]);
                    }
                    for (input, d) in inputs.iter().zip(&data) {
                        input.write(d);
                    }
                }
                let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
                let mut want = vec![0; elems * size];
                dmlc_reduce::reduce_into(dtype, op, world as u32, &refs, &mut want).unwrap();
                let ins: Vec<SegRef> = inputs.iter().map(Buf::whole).collect();
                let outs: Vec<SegRef> = outputs.iter().map(Buf::whole).collect();
                // SAFETY: every segment lies in a live Buf of `elems` elements.
                unsafe { reduce_range(dtype, op, world as u32, &ins, &outs, elems * size) };
                for (r, out) in outputs.iter().enumerate() {
                    assert!(out.read() == want, "{dtype} {op} N={world}, output {r}");
                }
            }
        }
    }

    #[test]
    fn empty_range_touches_nothing() {
        let bufs = [Buf::new(&[]), Buf::new(&[0, 0])];
        let refs: Vec<SegRef> = bufs.iter().map(Buf::whole).collect();
        // SAFETY: nothing is addressed.
        unsafe {
            reduce_range(Dtype::F32, ReduceOp::Sum, 2, &refs, &refs, 0);
            copy_range(refs[0], &refs, 0);
        }
        for b in &bufs {
            b.assert_canaries();
        }
    }

    #[test]
    #[should_panic(expected = "segment boundary inside an element")]
    fn segment_boundary_inside_an_element_is_refused() {
        let a = Buf::new(&[6, 2]);
        let b = Buf::new(&[8]);
        let ins = [a.whole(), b.whole()];
        // SAFETY: both lists hold 8 bytes.
        unsafe { reduce_range(Dtype::F32, ReduceOp::Sum, 2, &ins, &ins[1..], 8) };
    }

    #[test]
    #[should_panic(expected = "range runs past the end of a segment list")]
    fn range_beyond_the_list_is_refused() {
        let a = Buf::new(&[8]);
        let ins = [a.whole()];
        // SAFETY: the walk stops at the end of the list, before any access
        // beyond it.
        unsafe { reduce_range(Dtype::F32, ReduceOp::Sum, 1, &ins, &ins, 12) };
    }

    #[test]
    #[should_panic(expected = "band is not defined for f32")]
    fn bitwise_op_on_floats_is_refused() {
        let a = Buf::new(&[8]);
        let ins = [a.whole()];
        // SAFETY: the list holds 8 bytes.
        unsafe { reduce_range(Dtype::F32, ReduceOp::Band, 1, &ins, &ins, 8) };
    }

    #[test]
    fn copy_to_destinations_segmented_differently() {
        let mut rng = Rng::new(13);
        for len in [1, 3, 7, 33, 1001, 3 * COPY_CHUNK_BYTES + 5] {
            let src = Buf::random(&mut rng, len, 1);
            let data = rng.elems(Dtype::U8, len);
            src.write(&data);
            for ndst in 1..=3 {
                let dsts: Vec<Buf> = (0..ndst).map(|_| Buf::random(&mut rng, len, 1)).collect();
                let refs: Vec<SegRef> = dsts.iter().map(Buf::whole).collect();
                // SAFETY: all lists hold `len` bytes of live Bufs.
                unsafe { copy_range(src.whole(), &refs, len) };
                for d in &dsts {
                    d.assert_canaries();
                    assert!(d.read() == data, "len {len}, {ndst} destinations");
                }
                src.assert_canaries();
            }
        }
    }

    #[test]
    fn copy_skips_the_source_and_honours_offsets() {
        let mut rng = Rng::new(14);
        let len = 5000;
        let src = Buf::random(&mut rng, len, 1);
        let data = rng.elems(Dtype::U8, len);
        src.write(&data);
        let other = Buf::random(&mut rng, len, 1);
        // The source itself (as in-place allgather or broadcast at the
        // root), and the same memory cut differently.
        let mut recut = Vec::new();
        for seg in &src.segs {
            let cut = seg.len / 3;
            recut.push(HostSeg {
                ptr: seg.ptr,
                len: cut,
            });
            recut.push(HostSeg {
                ptr: seg.ptr.wrapping_add(cut),
                len: seg.len - cut,
            });
        }
        let (offset, part) = (1234, 2000);
        let dsts = [
            src.at(offset),
            other.at(offset),
            SegRef {
                segs: &recut,
                offset,
            },
        ];
        // SAFETY: every list holds `offset + part` bytes of live memory.
        unsafe { copy_range(src.at(offset), &dsts, part) };
        assert!(src.read() == data);
        let got = other.read();
        assert!(got[offset..offset + part] == data[offset..offset + part]);
        assert!(got[..offset].iter().all(|&b| b == CANARY));
        assert!(got[offset + part..].iter().all(|&b| b == CANARY));
        other.assert_canaries();
        src.assert_canaries();
    }
}
