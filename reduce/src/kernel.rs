//! Element-wise reduction kernels over raw memory.
//!
//! A reduction of N inputs runs through an accumulator in a [`Scratch`],
//! one cache-sized chunk at a time, reading up to [`MAX_GROUP`] inputs per
//! pass in rank order: `acc = in0 op in1 op ..` ([`Kernel::first`]), then
//! `acc = acc op in_k op ..` for the next groups ([`Kernel::fold`]), then
//! [`Kernel::finish`] turns the accumulator into result bytes (the avg
//! division, the f16/bf16 rounding). Each element is folded left to right
//! in rank order whatever the grouping, so the result is the same bit for
//! bit. The backend's data path (`vhost-device/src/datapath.rs`) drives
//! these over scatter-gather lists of guest memory, and
//! [`crate::reduce_into`] over host buffers, both in the passes of
//! [`groups`].
//!
//! The semantics, NaNs included, are in the crate docs.
//!
//! Sources are guest memory that another process shares and may change at
//! any time, so the kernels read them only through unaligned raw-pointer
//! reads and never make a Rust reference to them. The loops are plain
//! element loops that LLVM vectorises; on x86-64 each exists twice, for the
//! baseline ISA and for AVX2 (with F16C for f16), and [`Kernel::new`] takes
//! the best one the CPU has.

use std::marker::PhantomData;
use std::slice;

use virtio_dmlc::{Dtype, ReduceOp};

use crate::scratch::Scratch;
use crate::store::{self, CopyFn, Stores, StreamLines};

/// Default accumulator size of one chunk, in bytes. 8 KiB keeps the
/// accumulator in L1 next to the input lines streaming through it: on
/// cache-resident data it was the fastest of 4 to 32 KiB or within 5% of
/// it, where 32 KiB was up to 43% slower; from DRAM no size stood out
/// (docs/benchmarks.md).
pub const CHUNK_BYTES: usize = 8 << 10;

/// Arithmetic of an accumulator type.
trait Num: Copy + Default + 'static {
    /// A NaN with its quiet bit set; anything else unchanged.
    fn quiet(self) -> Self;
    fn add(self, x: Self) -> Self;
    fn mul(self, x: Self) -> Self;
    /// Minimum; keeps `self` on ties; if either is NaN, the first NaN
    /// (`self` before `x`), quieted.
    fn min_of(self, x: Self) -> Self;
    /// Maximum; as [`Num::min_of`].
    fn max_of(self, x: Self) -> Self;
    /// `self / world` (integers truncate toward zero).
    fn div_world(self, world: u32) -> Self;
}

/// Bitwise operations of the integer accumulator types.
trait Bits: Num {
    fn and(self, x: Self) -> Self;
    fn or(self, x: Self) -> Self;
    fn xor(self, x: Self) -> Self;
}

macro_rules! float_num {
    ($($t:ty: $quiet_bit:expr),*) => {$(
        impl Num for $t {
            #[inline(always)]
            fn quiet(self) -> Self {
                // A select, so that loops over it vectorise.
                let quieted = <$t>::from_bits(self.to_bits() | $quiet_bit);
                if self.is_nan() { quieted } else { self }
            }
            #[inline(always)]
            fn add(self, x: Self) -> Self {
                self + x
            }
            #[inline(always)]
            fn mul(self, x: Self) -> Self {
                self * x
            }
            #[inline(always)]
            fn min_of(self, x: Self) -> Self {
                // A NaN `x` fails the comparison and is taken; a NaN `self`
                // is kept. Non-short-circuit `|` keeps the loop branch-free.
                // The selected NaN may be signalling: quiet it.
                (if self.is_nan() | (x >= self) { self } else { x }).quiet()
            }
            #[inline(always)]
            fn max_of(self, x: Self) -> Self {
                (if self.is_nan() | (x <= self) { self } else { x }).quiet()
            }
            #[inline(always)]
            fn div_world(self, world: u32) -> Self {
                self / world as $t
            }
        }
    )*};
}
float_num!(f32: 1 << 22, f64: 1 << 51);

macro_rules! int_num {
    ($($t:ty: $div:ident),*) => {$(
        impl Num for $t {
            #[inline(always)]
            fn quiet(self) -> Self {
                self
            }
            #[inline(always)]
            fn add(self, x: Self) -> Self {
                self.wrapping_add(x)
            }
            #[inline(always)]
            fn mul(self, x: Self) -> Self {
                self.wrapping_mul(x)
            }
            #[inline(always)]
            fn min_of(self, x: Self) -> Self {
                Ord::min(self, x)
            }
            #[inline(always)]
            fn max_of(self, x: Self) -> Self {
                Ord::max(self, x)
            }
            #[inline(always)]
            fn div_world(self, world: u32) -> Self {
                $div!(self, world, $t)
            }
        }
        impl Bits for $t {
            #[inline(always)]
            fn and(self, x: Self) -> Self {
                self & x
            }
            #[inline(always)]
            fn or(self, x: Self) -> Self {
                self | x
            }
            #[inline(always)]
            fn xor(self, x: Self) -> Self {
                self ^ x
            }
        }
    )*};
}
/// Integer avg division for types of up to 32 bits, through f64 because
/// that vectorises and integer division does not. Exact: for |a| < 2^32
/// the f64 quotient's rounding error, at most (|a|/b)·2^-53 < 2^-21/b,
/// cannot carry a non-integer quotient (at least 1/b from the next
/// integer) across it; `as` then truncates toward zero, and the quotient,
/// no larger than `a`, fits the type.
macro_rules! div_via_f64 {
    ($a:expr, $world:expr, $t:ty) => {
        (f64::from($a) / f64::from($world)) as $t
    };
}

/// Integer avg division for 64-bit types (f64 would not be exact).
macro_rules! div_int {
    ($a:expr, $world:expr, $t:ty) => {
        $a / <$t>::from($world)
    };
}

int_num!(i8: div_via_f64, u8: div_via_f64, i32: div_via_f64, u32: div_via_f64, i64: div_int, u64: div_int);

/// A dtype: how an element is stored and what it accumulates in.
trait Elem: 'static {
    /// The stored element (f16 and bf16 as their bits).
    type Raw: Copy + Default + 'static;
    /// The accumulator.
    type Acc: Num;
    /// `Raw` and `Acc` are one type and `widen`/`narrow` are the identity.
    const SAME: bool;
    fn widen(r: Self::Raw) -> Self::Acc;
    fn narrow(a: Self::Acc) -> Self::Raw;
    /// Narrows every accumulator into `out` (of the same length); a type
    /// may do it in blocks where that is faster.
    #[inline(always)]
    fn narrow_all(acc: &[Self::Acc], out: &mut [Self::Raw]) {
        for (o, &a) in out.iter_mut().zip(acc) {
            *o = Self::narrow(a);
        }
    }
}

/// A dtype that accumulates in itself.
struct Plain<T>(PhantomData<T>);

impl<T: Num> Elem for Plain<T> {
    type Raw = T;
    type Acc = T;
    const SAME: bool = true;
    #[inline(always)]
    fn widen(r: T) -> T {
        r
    }
    #[inline(always)]
    fn narrow(a: T) -> T {
        a
    }
}

/// IEEE binary16, accumulated in f32.
struct F16;

impl Elem for F16 {
    type Raw = u16;
    type Acc = f32;
    const SAME: bool = false;
    #[inline(always)]
    fn widen(r: u16) -> f32 {
        f16_to_f32(r)
    }
    #[inline(always)]
    fn narrow(a: f32) -> u16 {
        f32_to_f16(a)
    }
}

/// bfloat16, accumulated in f32.
struct Bf16;

impl Elem for Bf16 {
    type Raw = u16;
    type Acc = f32;
    const SAME: bool = false;
    #[inline(always)]
    fn widen(r: u16) -> f32 {
        bf16_to_f32(r)
    }
    #[inline(always)]
    fn narrow(a: f32) -> u16 {
        f32_to_bf16(a)
    }
}

/// IEEE binary16 through the F16C instructions, accumulated in f32. Only
/// for kernels compiled with the `f16c` target feature (the AVX2 ones).
#[cfg(target_arch = "x86_64")]
struct F16c;

#[cfg(target_arch = "x86_64")]
impl Elem for F16c {
    type Raw = u16;
    type Acc = f32;
    const SAME: bool = false;
    #[inline(always)]
    fn widen(r: u16) -> f32 {
        use std::arch::x86_64::{_mm_cvtph_ps, _mm_cvtsi32_si128, _mm_cvtss_f32};
        // SAFETY: F16c kernels exist only in code compiled with f16c, run
        // when the CPU has it (`Isa::Avx2`). LLVM turns this one-lane
        // conversion in a loop into 8-lane `vcvtph2ps`.
        unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(r)))) }
    }
    #[inline(always)]
    fn narrow(a: f32) -> u16 {
        use std::arch::x86_64::_MM_FROUND_TO_NEAREST_INT as NEAREST;
        use std::arch::x86_64::{_mm_cvtps_ph, _mm_cvtsi128_si32, _mm_set_ss};
        // SAFETY: as in `widen`.
        unsafe { _mm_cvtsi128_si32(_mm_cvtps_ph::<NEAREST>(_mm_set_ss(a))) as u16 }
    }
    #[inline(always)]
    fn narrow_all(acc: &[f32], out: &mut [u16]) {
        use std::arch::x86_64::_MM_FROUND_TO_NEAREST_INT as NEAREST;
        use std::arch::x86_64::{__m128i, _mm256_cvtps_ph, _mm256_loadu_ps, _mm_storeu_si128};
        // LLVM does not vectorise the one-lane form of this conversion.
        let done = out.len() / 8 * 8;
        let (head, tail) = out.split_at_mut(done);
        for (o, a) in head.chunks_exact_mut(8).zip(acc.chunks_exact(8)) {
            // SAFETY: as in `widen` (the CPU has f16c and AVX); `a` holds 8
            // f32 and `o` room for 8 u16, both ours; unaligned accesses.
            unsafe {
                let h = _mm256_cvtps_ph::<NEAREST>(_mm256_loadu_ps(a.as_ptr()));
                _mm_storeu_si128(o.as_mut_ptr().cast::<__m128i>(), h);
            }
        }
        for (o, &a) in tail.iter_mut().zip(&acc[done..]) {
            *o = Self::narrow(a);
        }
    }
}

/// f16 bits to f32 (exact). Every case is computed and one is selected, so
/// that loops over it vectorise; `half`'s scalar conversion would not.
#[inline(always)]
fn f16_to_f32(h: u16) -> f32 {
    const EXP: u32 = 0x1f << 23;
    let h = u32::from(h);
    let sign = (h & 0x8000) << 16;
    // Exponent and mantissa moved to their f32 places.
    let magnitude = (h & 0x7fff) << 13;
    let exp = magnitude & EXP;
    let normal = magnitude + ((127 - 15) << 23);
    let inf_nan = magnitude | (0xff << 23);
    // Subnormal m * 2^-24: build 2^-14 * (1 + m/1024) and subtract 2^-14,
    // which is exact.
    let subnormal =
        (f32::from_bits(normal + (1 << 23)) - f32::from_bits((127 - 14) << 23)).to_bits();
    let bits = if exp == EXP {
        inf_nan
    } else if exp == 0 {
        subnormal
    } else {
        normal
    };
    f32::from_bits(bits | sign)
}

/// f32 to f16 bits, rounding to nearest-even; a NaN gives a quiet NaN with
/// the same sign and the top 10 payload bits, as F16C and `half` do.
/// Branch-free like [`f16_to_f32`]; every case uses wrapping arithmetic
/// because all of them are computed for every input.
#[inline(always)]
fn f32_to_f16(f: f32) -> u16 {
    let x = f.to_bits();
    let sign = (x >> 16) & 0x8000;
    let a = x & 0x7fff_ffff;
    // |f| >= 2^16 is out of range even before rounding: Inf, or NaN.
    let nan = 0x7e00 | ((a >> 13) & 0x03ff);
    let inf_nan = if a > 0x7f80_0000 { nan } else { 0x7c00 };
    // |f| < 2^-14 becomes subnormal: adding 0.5 lines the f16 subnormal
    // step up with the f32 ulp, and the FPU rounds to nearest-even.
    let half = 0.5f32.to_bits();
    let subnormal = (f32::from_bits(a) + 0.5).to_bits().wrapping_sub(half);
    // Normal: rebias the exponent, then add just under half an f16 ulp,
    // plus one if the kept mantissa is odd (ties to even); a carry out of
    // the mantissa bumps the exponent, up to Inf.
    let normal = a
        .wrapping_sub((127 - 15) << 23)
        .wrapping_add(0xfff + ((a >> 13) & 1))
        >> 13;
    let h = if a >= (127 + 16) << 23 {
        inf_nan
    } else if a < (127 - 14) << 23 {
        subnormal
    } else {
        normal
    };
    (h | sign) as u16
}

/// bf16 bits to f32 (exact).
#[inline(always)]
fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// f32 to bf16 bits, rounding to nearest-even (NaN stays a quiet NaN).
#[inline(always)]
fn f32_to_bf16(f: f32) -> u16 {
    let x = f.to_bits();
    let rounded = x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16;
    let nan = (x >> 16) | 0x40;
    (if f.is_nan() { nan } else { rounded }) as u16
}

/// A reduce operation on accumulators.
trait Op<A>: 'static {
    /// The result is divided by the world size at the end.
    const AVG: bool = false;
    fn apply(acc: A, x: A) -> A;
}

struct Sum;
struct Prod;
struct Min;
struct Max;
struct Avg;
struct Band;
struct Bor;
struct Bxor;

macro_rules! op {
    ($name:ident: $bound:ident, $method:ident $(, $avg:expr)?) => {
        impl<A: $bound> Op<A> for $name {
            $(const AVG: bool = $avg;)?
            #[inline(always)]
            fn apply(acc: A, x: A) -> A {
                acc.$method(x)
            }
        }
    };
}
op!(Sum: Num, add);
op!(Prod: Num, mul);
op!(Min: Num, min_of);
op!(Max: Num, max_of);
op!(Avg: Num, add, true);
op!(Band: Bits, and);
op!(Bor: Bits, or);
op!(Bxor: Bits, xor);

// The kernel bodies. Contract shared by all of them: `acc` points to `n`
// initialised, aligned `E::Acc` in a scratch buffer of ours that nothing
// else accesses meanwhile; each source is valid for reads of `n` `E::Raw`
// (any alignment) and may be written by another process meanwhile; `stage`
// points to room for `n` aligned `E::Raw` of ours.

/// The sources of one pass: `K` pointers read from `srcs`.
#[inline(always)]
unsafe fn sources<E: Elem, const K: usize>(srcs: *const *const u8) -> [*const E::Raw; K] {
    // SAFETY: the caller passes `K` pointers at `srcs`.
    std::array::from_fn(|k| unsafe { srcs.add(k).read() }.cast::<E::Raw>())
}

/// Element `i` of a source, widened.
#[inline(always)]
unsafe fn read<E: Elem>(src: *const E::Raw, i: usize) -> E::Acc {
    // SAFETY: the source is readable for `n > i` elements (contract
    // above); guest memory is only read through this unaligned raw read,
    // never through a reference, and every bit pattern is a valid element.
    E::widen(unsafe { src.add(i).read_unaligned() })
}

/// `acc = src` (one source needs no op; NaNs are quieted all the same).
#[inline(always)]
unsafe fn load_body<E: Elem>(acc: *mut u8, srcs: *const *const u8, n: usize) {
    // SAFETY: `acc` is our scratch, aligned and holding `n` accumulators
    // (contract above); any bit pattern is a valid number.
    let acc = unsafe { slice::from_raw_parts_mut(acc.cast::<E::Acc>(), n) };
    // SAFETY: one source pointer (contract of `first`).
    let [src] = unsafe { sources::<E, 1>(srcs) };
    for (i, a) in acc.iter_mut().enumerate() {
        // SAFETY: `i < n`.
        *a = unsafe { read::<E>(src, i) }.quiet();
    }
}

/// `acc = s0 op s1 op .. op s(K-1)`, left to right.
#[inline(always)]
unsafe fn first_body<E: Elem, O: Op<E::Acc>, const K: usize>(
    acc: *mut u8,
    srcs: *const *const u8,
    n: usize,
) {
    // SAFETY: as in `load_body`.
    let acc = unsafe { slice::from_raw_parts_mut(acc.cast::<E::Acc>(), n) };
    // SAFETY: `K` source pointers (contract of `first`).
    let s = unsafe { sources::<E, K>(srcs) };
    for (i, a) in acc.iter_mut().enumerate() {
        // SAFETY: `i < n` for every source.
        let mut v = unsafe { read::<E>(s[0], i) };
        for &src in &s[1..] {
            // SAFETY: as above.
            v = O::apply(v, unsafe { read::<E>(src, i) });
        }
        *a = v;
    }
}

/// `acc = acc op s0 op .. op s(K-1)`, left to right.
#[inline(always)]
unsafe fn fold_body<E: Elem, O: Op<E::Acc>, const K: usize>(
    acc: *mut u8,
    srcs: *const *const u8,
    n: usize,
) {
    // SAFETY: as in `load_body`.
    let acc = unsafe { slice::from_raw_parts_mut(acc.cast::<E::Acc>(), n) };
    // SAFETY: `K` source pointers (contract of `fold`).
    let s = unsafe { sources::<E, K>(srcs) };
    for (i, a) in acc.iter_mut().enumerate() {
        let mut v = *a;
        for &src in &s {
            // SAFETY: `i < n` for every source.
            v = O::apply(v, unsafe { read::<E>(src, i) });
        }
        *a = v;
    }
}

/// Returns true if the result is in `stage`, false if it is in `acc`.
#[inline(always)]
unsafe fn finish_body<E: Elem, O: Op<E::Acc>>(
    acc: *mut u8,
    stage: *mut u8,
    n: usize,
    world: u32,
) -> bool {
    if E::SAME && !O::AVG {
        return false;
    }
    // SAFETY: as in `load_body`.
    let acc = unsafe { slice::from_raw_parts_mut(acc.cast::<E::Acc>(), n) };
    if O::AVG {
        for a in acc.iter_mut() {
            *a = a.div_world(world);
        }
    }
    if E::SAME {
        return false;
    }
    // SAFETY: `stage` is our scratch with room for `n` aligned `E::Raw`,
    // disjoint from `acc` (contract above).
    let stage = unsafe { slice::from_raw_parts_mut(stage.cast::<E::Raw>(), n) };
    E::narrow_all(acc, stage);
    true
}

/// Elements of one block of [`Kernel::through`] with ordinary stores: the
/// block's results are computed into a buffer of ours (in L1), then
/// stored to every destination, so that the loads of the inputs and the
/// stores of the outputs interleave a few lines apart and the memory
/// system works on both at once. A streaming block is a whole number of
/// cache lines for every dtype, so that every block after the first
/// starts on a line boundary. The sizes come from quick runs of the reduction
/// micro-benchmark that were not kept (16 or 32 elements fastest with
/// ordinary stores, 64 to 128 with streaming ones); the figures in
/// docs/benchmarks.md ("The last pass writes the outputs") use them.
const CACHED_BLOCK: usize = 32;
/// Elements of one block with streaming stores.
const STREAM_BLOCK: usize = 128;
/// The larger of the two.
const BLOCK_ELEMS: usize = STREAM_BLOCK;

/// How far ahead of its current block a streaming pass asks for its
/// inputs: one 4 KiB page. The CPU's own stream prefetcher stops at page
/// boundaries, and guest memory is made of 4 KiB pages scattered in
/// physical memory, so without a hint every page of every input starts
/// with a miss. In the reduction micro-benchmark (N = 2 and 4 from 4 MiB,
/// docs/benchmarks.md "Inputs asked for one page ahead") this took the
/// reduction from 0.81 to 1.06 of the streaming copy of the same traffic
/// to 0.93 to 1.11. In quick runs that were not kept, 2 and 8 KiB ahead did
/// no better, and ordinary stores at 1 and 4 MiB did not gain from it, so
/// only streaming passes prefetch.
const PREFETCH_AHEAD: usize = 4 << 10;

/// Hints the CPU to bring the cache lines of bytes `from..to` of `src`
/// into cache. A prefetch loads nothing into a register and never
/// faults; callers still keep the range inside the buffer, so that no
/// memory a guest did not offer is asked for.
#[inline(always)]
fn prefetch(src: *const u8, from: usize, to: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let mut at = from;
        while at < to {
            // SAFETY: a prefetch is only a hint; it has no architectural
            // effect and cannot fault, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(src.wrapping_add(at).cast()) };
            at += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (src, from, to);
}

/// A block's worth of elements, line-aligned.
#[repr(C, align(64))]
struct Block<T>([T; BLOCK_ELEMS]);

/// The shared operands of a [`Kernel::through`] pass.
struct Through {
    /// The accumulator (the first element of the range), read when folding.
    acc: *const u8,
    /// `K` source pointers.
    srcs: *const *const u8,
    /// The destinations.
    dsts: *const *mut u8,
    ndsts: usize,
    world: u32,
}

/// For elements `from..n`: `r = acc op s0 op .. op s(K-1)` (`FOLD`) or
/// `r = s0 op .. op s(K-1)`, finished as [`finish_body`] finishes (avg,
/// narrowing), written to every destination; with streaming stores for
/// whole lines if `streaming` (the destinations are then 64-aligned at
/// element `from`, which the caller ensures).
#[inline(always)]
unsafe fn through_body<E: Elem, O: Op<E::Acc>, L: StreamLines, const K: usize, const FOLD: bool>(
    t: &Through,
    from: usize,
    n: usize,
    streaming: bool,
) {
    // SAFETY: `K` source pointers (contract of `through`).
    let s = unsafe { sources::<E, K>(t.srcs) };
    let acc = t.acc.cast::<E::Acc>();
    // SAFETY: `ndsts` destination pointers (contract of `through`).
    let dsts = unsafe { slice::from_raw_parts(t.dsts, t.ndsts) };
    let size = std::mem::size_of::<E::Raw>();
    let mut accs = Block([E::Acc::default(); BLOCK_ELEMS]);
    let mut raws = Block([E::Raw::default(); BLOCK_ELEMS]);
    let cap = if streaming {
        STREAM_BLOCK
    } else {
        CACHED_BLOCK
    };
    let mut i = from;
    while i < n {
        let m = cap.min(n - i);
        if streaming {
            // The inputs of the block one page on, never past the range.
            let ahead = PREFETCH_AHEAD / size;
            let (lo, hi) = ((i + ahead).min(n) * size, (i + ahead + m).min(n) * size);
            for &src in &s {
                prefetch(src.cast(), lo, hi);
            }
        }
        for (j, a) in accs.0[..m].iter_mut().enumerate() {
            let v = if FOLD {
                // SAFETY: the accumulator holds `n > i + j` elements when
                // folding (contract of `through`); it is our scratch.
                unsafe { acc.add(i + j).read() }
            } else {
                // SAFETY: every source is readable for `n` elements.
                unsafe { read::<E>(s[0], i + j) }
            };
            // One source needs no op; its NaNs are quieted all the same.
            let mut v = if !FOLD && K == 1 { v.quiet() } else { v };
            for &src in &s[usize::from(!FOLD)..] {
                // SAFETY: as above.
                v = O::apply(v, unsafe { read::<E>(src, i + j) });
            }
            *a = if O::AVG { v.div_world(t.world) } else { v };
        }
        let block = if E::SAME {
            accs.0.as_ptr().cast::<u8>()
        } else {
            E::narrow_all(&accs.0[..m], &mut raws.0[..m]);
            raws.0.as_ptr().cast::<u8>()
        };
        for &dst in dsts {
            let dst = dst.wrapping_add(i * size);
            // SAFETY: every destination is writable for `n` elements and
            // overlaps no buffer of ours; `block` holds `m` results.
            unsafe {
                if streaming {
                    L::stream_lines(dst, block, m * size);
                } else if m == CACHED_BLOCK {
                    // A constant length, which the compiler inlines.
                    std::ptr::copy_nonoverlapping(block, dst, CACHED_BLOCK * size);
                } else {
                    std::ptr::copy_nonoverlapping(block, dst, m * size);
                }
            }
        }
        i += m;
    }
}

/// The most sources one kernel pass reads. Reading several inputs per pass
/// keeps more memory streams in flight and loads and stores the
/// accumulator once for all of them.
pub const MAX_GROUP: usize = 4;

/// The passes of a reduction of `n` inputs: consecutive groups of inputs
/// in rank order, each of at most [`MAX_GROUP`], as even as possible (7 is
/// 4 + 3, not 4 + 2 + 1): fewest passes, each with as many streams as the
/// others. The first pass goes to [`Kernel::first`], the others to
/// [`Kernel::fold`]. Every driver of the kernels uses these passes; any
/// grouping gives the same result bit for bit, so this is a choice of
/// speed only.
pub fn groups(n: usize) -> impl Iterator<Item = usize> {
    let count = n.div_ceil(MAX_GROUP);
    (0..count).map(move |g| n / count + usize::from(g < n % count))
}

type GroupFn = unsafe fn(*mut u8, *const *const u8, usize);
type FinishFn = unsafe fn(*mut u8, *mut u8, usize, u32) -> bool;
/// `(operands, from, n, streaming)`.
type ThroughFn = unsafe fn(&Through, usize, usize, bool);

/// The kernels of one dtype, op and ISA; `first[k - 1]` and `fold[k - 1]`
/// read `k` sources.
#[derive(Clone, Copy)]
struct Fns {
    first: [GroupFn; MAX_GROUP],
    fold: [GroupFn; MAX_GROUP],
    finish: FinishFn,
    /// `through[fold][k - 1]`: the last pass, straight to the outputs.
    through: [[ThroughFn; MAX_GROUP]; 2],
}

/// One copy of the kernels compiled for an instruction set: the bodies are
/// `inline(always)`, so they take on the wrapper's target features.
macro_rules! isa_kernels {
    ($module:ident, $lines:ty $(, $features:literal)?) => {
        mod $module {
            use super::*;

            $(#[target_feature(enable = $features)])?
            pub(super) unsafe fn load<E: Elem>(acc: *mut u8, srcs: *const *const u8, n: usize) {
                // SAFETY: the caller keeps the kernel contract.
                unsafe { load_body::<E>(acc, srcs, n) }
            }

            $(#[target_feature(enable = $features)])?
            pub(super) unsafe fn first<E: Elem, O: Op<E::Acc>, const K: usize>(
                acc: *mut u8,
                srcs: *const *const u8,
                n: usize,
            ) {
                // SAFETY: the caller keeps the kernel contract.
                unsafe { first_body::<E, O, K>(acc, srcs, n) }
            }

            $(#[target_feature(enable = $features)])?
            pub(super) unsafe fn fold<E: Elem, O: Op<E::Acc>, const K: usize>(
                acc: *mut u8,
                srcs: *const *const u8,
                n: usize,
            ) {
                // SAFETY: the caller keeps the kernel contract.
                unsafe { fold_body::<E, O, K>(acc, srcs, n) }
            }

            $(#[target_feature(enable = $features)])?
            pub(super) unsafe fn finish<E: Elem, O: Op<E::Acc>>(
                acc: *mut u8,
                stage: *mut u8,
                n: usize,
                world: u32,
            ) -> bool {
                // SAFETY: the caller keeps the kernel contract.
                unsafe { finish_body::<E, O>(acc, stage, n, world) }
            }

            $(#[target_feature(enable = $features)])?
            pub(super) unsafe fn through<E: Elem, O: Op<E::Acc>, const K: usize, const FOLD: bool>(
                t: &Through,
                from: usize,
                n: usize,
                streaming: bool,
            ) {
                // SAFETY: the caller keeps the kernel contract.
                unsafe { through_body::<E, O, $lines, K, FOLD>(t, from, n, streaming) }
            }

            pub(super) fn fns<E: Elem, O: Op<E::Acc>>() -> Fns {
                Fns {
                    first: [load::<E>, first::<E, O, 2>, first::<E, O, 3>, first::<E, O, 4>],
                    fold: [
                        fold::<E, O, 1>,
                        fold::<E, O, 2>,
                        fold::<E, O, 3>,
                        fold::<E, O, 4>,
                    ],
                    finish: finish::<E, O>,
                    through: [
                        [
                            through::<E, O, 1, false>,
                            through::<E, O, 2, false>,
                            through::<E, O, 3, false>,
                            through::<E, O, 4, false>,
                        ],
                        [
                            through::<E, O, 1, true>,
                            through::<E, O, 2, true>,
                            through::<E, O, 3, true>,
                            through::<E, O, 4, true>,
                        ],
                    ],
                }
            }
        }
    };
}

isa_kernels!(baseline, store::Sse2Lines);
#[cfg(target_arch = "x86_64")]
isa_kernels!(avx2, store::AvxLines, "avx2,f16c");

/// The kernels of one ISA, and the types it represents f16 with.
trait IsaKernels {
    type F16: Elem<Raw = u16, Acc = f32>;
    fn fns<E: Elem, O: Op<E::Acc>>() -> Fns;
}

struct Baseline;

impl IsaKernels for Baseline {
    type F16 = F16;
    fn fns<E: Elem, O: Op<E::Acc>>() -> Fns {
        baseline::fns::<E, O>()
    }
}

#[cfg(target_arch = "x86_64")]
struct Avx2;

#[cfg(target_arch = "x86_64")]
impl IsaKernels for Avx2 {
    type F16 = F16c;
    fn fns<E: Elem, O: Op<E::Acc>>() -> Fns {
        avx2::fns::<E, O>()
    }
}

#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c")
}

/// Instruction set the kernels are compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// The target's baseline (SSE2 on x86-64).
    Baseline,
    /// AVX2 with F16C (x86-64 only).
    Avx2,
}

impl Isa {
    /// Every instruction set this CPU can run, baseline first.
    pub fn available() -> Vec<Isa> {
        let mut isas = vec![Isa::Baseline];
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            isas.push(Isa::Avx2);
        }
        isas
    }

    /// The fastest instruction set this CPU can run.
    pub fn best() -> Isa {
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            return Isa::Avx2;
        }
        Isa::Baseline
    }
}

fn arith<I: IsaKernels, E: Elem>(op: ReduceOp) -> Option<Fns> {
    Some(match op {
        ReduceOp::Sum => I::fns::<E, Sum>(),
        ReduceOp::Prod => I::fns::<E, Prod>(),
        ReduceOp::Min => I::fns::<E, Min>(),
        ReduceOp::Max => I::fns::<E, Max>(),
        ReduceOp::Avg => I::fns::<E, Avg>(),
        ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor => return None,
    })
}

fn integer<I: IsaKernels, E: Elem>(op: ReduceOp) -> Option<Fns>
where
    E::Acc: Bits,
{
    match op {
        ReduceOp::Band => Some(I::fns::<E, Band>()),
        ReduceOp::Bor => Some(I::fns::<E, Bor>()),
        ReduceOp::Bxor => Some(I::fns::<E, Bxor>()),
        _ => arith::<I, E>(op),
    }
}

/// The kernels of `dtype` and `op` in ISA `I`.
fn table<I: IsaKernels>(dtype: Dtype, op: ReduceOp) -> Option<Fns> {
    match dtype {
        Dtype::F32 => arith::<I, Plain<f32>>(op),
        Dtype::F64 => arith::<I, Plain<f64>>(op),
        Dtype::F16 => arith::<I, I::F16>(op),
        Dtype::Bf16 => arith::<I, Bf16>(op),
        Dtype::I8 => integer::<I, Plain<i8>>(op),
        Dtype::U8 => integer::<I, Plain<u8>>(op),
        Dtype::I32 => integer::<I, Plain<i32>>(op),
        Dtype::U32 => integer::<I, Plain<u32>>(op),
        Dtype::I64 => integer::<I, Plain<i64>>(op),
        Dtype::U64 => integer::<I, Plain<u64>>(op),
    }
}

/// The kernels of one dtype and op, for one instruction set.
#[derive(Clone, Copy)]
pub struct Kernel {
    dtype: Dtype,
    op: ReduceOp,
    acc_size: usize,
    fns: Fns,
    /// The streaming copy of the same ISA.
    stream: CopyFn,
}

impl std::fmt::Debug for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kernel")
            .field("dtype", &self.dtype)
            .field("op", &self.op)
            .finish_non_exhaustive()
    }
}

impl Kernel {
    /// The kernels of `dtype` and `op` for the best ISA of this CPU, or
    /// `None` if `op` is not defined for `dtype`.
    pub fn new(dtype: Dtype, op: ReduceOp) -> Option<Kernel> {
        Kernel::with_isa(dtype, op, Isa::best())
    }

    /// As [`Kernel::new`] for a given ISA; `None` also if the CPU lacks it.
    pub fn with_isa(dtype: Dtype, op: ReduceOp, isa: Isa) -> Option<Kernel> {
        let fns = match isa {
            Isa::Baseline => table::<Baseline>(dtype, op),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 if has_avx2() => table::<Avx2>(dtype, op),
            Isa::Avx2 => None,
        }?;
        let acc_size = match dtype {
            Dtype::F16 | Dtype::Bf16 => 4,
            _ => dtype.size(),
        };
        Some(Kernel {
            dtype,
            op,
            acc_size,
            fns,
            stream: store::stream_fn(isa),
        })
    }

    /// Size of one element in memory, in bytes.
    pub fn elem_size(&self) -> usize {
        self.dtype.size()
    }

    /// Size of one accumulator element, in bytes (4 for f16 and bf16).
    pub fn acc_size(&self) -> usize {
        self.acc_size
    }

    /// How many elements one chunk of `scratch` holds.
    pub fn chunk_elems(&self, scratch: &Scratch) -> usize {
        scratch.bytes() / self.acc_size
    }

    /// Pointer to accumulator element `at`, after checking that `n`
    /// elements from there fit.
    fn acc_ptr(&self, scratch: &mut Scratch, at: usize, n: usize) -> *mut u8 {
        let end = at.checked_add(n).expect("chunk range overflows");
        assert!(
            end <= self.chunk_elems(scratch),
            "chunk exceeds the scratch"
        );
        // In bounds: checked just above.
        let acc = scratch.acc_lines().as_mut_ptr().cast::<u8>();
        acc.wrapping_add(at * self.acc_size)
    }

    /// `acc[at..at + n] = srcs[0][..n] op srcs[1][..n] op ..`, left to
    /// right, for 1 to [`MAX_GROUP`] sources.
    ///
    /// # Safety
    /// Each source must be valid for reads of `n` elements (any alignment);
    /// the memory may be changed by another process meanwhile.
    pub unsafe fn first(&self, scratch: &mut Scratch, at: usize, srcs: &[*const u8], n: usize) {
        let f = self.fns.first[Self::group(srcs)];
        let acc = self.acc_ptr(scratch, at, n);
        // SAFETY: `acc` addresses `n` accumulators of our scratch (checked
        // by `acc_ptr`; the scratch is line-aligned and initialised); `f`
        // reads as many pointers as `srcs` holds; the sources are the
        // caller's promise.
        unsafe { f(acc, srcs.as_ptr(), n) }
    }

    /// `acc[at..at + n] = acc[at..at + n] op srcs[0][..n] op ..`, left to
    /// right, for 1 to [`MAX_GROUP`] sources.
    ///
    /// # Safety
    /// As for [`Kernel::first`].
    pub unsafe fn fold(&self, scratch: &mut Scratch, at: usize, srcs: &[*const u8], n: usize) {
        let f = self.fns.fold[Self::group(srcs)];
        let acc = self.acc_ptr(scratch, at, n);
        // SAFETY: as in `first`.
        unsafe { f(acc, srcs.as_ptr(), n) }
    }

    /// Index of the kernel for `srcs.len()` sources.
    fn group(srcs: &[*const u8]) -> usize {
        assert!(
            (1..=MAX_GROUP).contains(&srcs.len()),
            "a kernel pass reads 1 to {MAX_GROUP} sources"
        );
        srcs.len() - 1
    }

    /// Turns `acc[..n]` into the result, `n * elem_size()` bytes in memory
    /// order: divides by `world` for avg and rounds f16/bf16.
    pub fn finish<'s>(&self, scratch: &'s mut Scratch, n: usize, world: u32) -> &'s [u8] {
        assert!(world > 0, "world size is zero");
        let acc = self.acc_ptr(scratch, 0, n);
        let stage = scratch.stage_lines().as_mut_ptr().cast::<u8>();
        // SAFETY: `acc` holds `n` accumulators (checked by `acc_ptr`);
        // `stage` is as large as the accumulator and elements are never
        // larger than accumulators, so it has room for `n` elements; both
        // are ours and line-aligned.
        let in_stage = unsafe { (self.fns.finish)(acc, stage, n, world) };
        let bytes = n * self.elem_size();
        let lines = if in_stage {
            scratch.stage_lines()
        } else {
            scratch.acc_lines()
        };
        // SAFETY: `bytes` is within the buffer (see above); the bytes are
        // initialised (zeroed at allocation, then written as numbers) and
        // borrowed from `scratch` for the returned lifetime.
        unsafe { slice::from_raw_parts(lines.as_ptr().cast::<u8>(), bytes) }
    }

    /// The last pass of a reduction, straight to the outputs: for every
    /// destination, `dst[..n] = finish(acc[at..at + n] op srcs[0][..n] op ..)`
    /// when `acc` is given (the earlier passes' accumulator and `at`), or
    /// `finish(srcs[0][..n] op ..)` for a reduction of one pass; finished
    /// as [`Kernel::finish`] finishes. With [`Stores::Streaming`] the whole
    /// lines of the destinations get streaming stores when all of them
    /// have the same offset in a line (ordinary stores otherwise), and the
    /// caller calls [`crate::fence`] before the result is published.
    ///
    /// Each block of a few lines is read from every source before any of
    /// it is written, so a destination may be the very memory of a source
    /// at the same position (in place).
    ///
    /// # Safety
    /// Each source must be valid for reads and each destination for writes
    /// of `n` elements (any alignment); the memory may be read or written
    /// by another process meanwhile; no destination overlaps the scratch.
    pub unsafe fn through(
        &self,
        acc: Option<(&mut Scratch, usize)>,
        srcs: &[*const u8],
        dsts: &[*mut u8],
        n: usize,
        world: u32,
        stores: Stores,
    ) {
        assert!(world > 0, "world size is zero");
        let k = Self::group(srcs);
        let (acc, fold) = match acc {
            Some((scratch, at)) => (self.acc_ptr(scratch, at, n).cast_const(), true),
            None => (std::ptr::null(), false),
        };
        let f = self.fns.through[usize::from(fold)][k];
        let t = Through {
            acc,
            srcs: srcs.as_ptr(),
            dsts: dsts.as_ptr(),
            ndsts: dsts.len(),
            world,
        };
        // Elements before the destinations' first whole line, if they
        // can stream at all.
        let size = self.elem_size();
        let head = match dsts.first() {
            Some(first) if stores == Stores::Streaming && n * size >= store::STREAM_MIN => {
                let offset = first.addr() % 64;
                let head = (64 - offset) % 64;
                let same = dsts.iter().all(|d| d.addr() % 64 == offset);
                (same && head % size == 0).then_some(head / size)
            }
            _ => None,
        };
        // SAFETY: `acc` addresses `n` accumulators of our scratch when
        // folding (checked by `acc_ptr`); `f` reads `srcs.len()` source
        // and `dsts.len()` destination pointers; sources and destinations
        // are the caller's promise; streaming starts at `head`, where
        // every destination is 64-aligned.
        unsafe {
            match head {
                Some(head) => {
                    f(&t, 0, head, false);
                    f(&t, head, n, true);
                }
                None => f(&t, 0, n, false),
            }
        }
    }

    /// Writes `result` (what [`Kernel::finish`] returned, or any bytes of
    /// ours) to `dst` with `stores`. After [`Stores::Streaming`], the
    /// caller calls [`crate::fence`] before the result is published.
    ///
    /// # Safety
    /// `dst` must be valid for writes of `result.len()` bytes and must not
    /// overlap `result`; the memory may be read or written by another
    /// process meanwhile.
    pub unsafe fn write(&self, result: &[u8], dst: *mut u8, stores: Stores) {
        // SAFETY: the caller's promise.
        unsafe { self.write_many(result, &[dst], stores) }
    }

    /// As [`Kernel::write`], to every destination in `dsts`; streaming
    /// stores write the destinations together, a line of each in turn,
    /// where they have the same offset in a cache line.
    ///
    /// # Safety
    /// As for [`Kernel::write`], for every destination (which may overlap
    /// each other).
    pub unsafe fn write_many(&self, result: &[u8], dsts: &[*mut u8], stores: Stores) {
        let (src, n) = (result.as_ptr(), result.len());
        // SAFETY: `src` holds `n` bytes (a slice), the destinations are
        // the caller's promise; the streaming copy of this kernel's ISA
        // runs only where the CPU has it (`Kernel::with_isa`).
        unsafe {
            match stores {
                Stores::Cached => {
                    for &dst in dsts {
                        std::ptr::copy_nonoverlapping(src, dst, n);
                    }
                }
                Stores::Streaming => (self.stream)(dsts, src, n),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::{self, Rng};
    use half::{bf16, f16};

    #[test]
    fn f16_widening_is_exact_for_every_value() {
        for h in 0..=u16::MAX {
            let want = f16::from_bits(h).to_f32();
            let got = f16_to_f32(h);
            if want.is_nan() {
                assert!(got.is_nan(), "{h:#06x}");
                assert_eq!(got.to_bits() >> 31, u32::from(h >> 15), "sign of {h:#06x}");
            } else {
                assert_eq!(got.to_bits(), want.to_bits(), "{h:#06x}");
            }
        }
    }

    /// f32 values around every rounding decision of a 16-bit format whose
    /// values widen to `widen(h)`: each value, the midpoints to its
    /// neighbour (ties) and one f32 ulp either side of them.
    fn rounding_probes(widen: impl Fn(u16) -> f32) -> Vec<f32> {
        let mut probes = Vec::new();
        for h in 0..0x7c00u16 {
            let lo = f64::from(widen(h));
            let hi = f64::from(widen(h + 1));
            let mid = ((lo + hi) / 2.0) as f32;
            for v in [lo as f32, mid, f32::from_bits(mid.to_bits() + 1)] {
                probes.extend([v, -v]);
            }
            if mid.to_bits() > 0 {
                probes.push(f32::from_bits(mid.to_bits() - 1));
            }
        }
        // A sweep over all f32 bit patterns, NaNs, infinities and the
        // largest values included.
        probes.extend((0..=u32::MAX).step_by(65_521).map(f32::from_bits));
        probes.extend([
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
        ]);
        probes.extend([65_519.99, 65_520.0, 65_504.0, 1e-8, 5.96e-8, 2.98e-8]);
        probes
    }

    #[test]
    fn f16_narrowing_rounds_to_nearest_even() {
        for v in rounding_probes(|h| f16::from_bits(h).to_f32()) {
            let want = f16::from_f32(v);
            let got = f32_to_f16(v);
            if want.is_nan() {
                assert!(f16::from_bits(got).is_nan(), "{v:e}");
            } else {
                assert_eq!(got, want.to_bits(), "{v:e} ({:#010x})", v.to_bits());
            }
        }
    }

    #[test]
    fn bf16_conversions_match_half() {
        for h in 0..=u16::MAX {
            let want = bf16::from_bits(h).to_f32();
            let got = bf16_to_f32(h);
            // `half` quiets signalling NaNs; we keep the bits.
            if want.is_nan() {
                assert!(got.is_nan(), "{h:#06x}");
            } else {
                assert_eq!(got.to_bits(), want.to_bits(), "{h:#06x}");
            }
        }
        // bf16 neighbours are f32 values 2^16 bit patterns apart.
        let mut probes = rounding_probes(|h| bf16::from_bits(h).to_f32());
        probes.extend((0..0x7f80u32).flat_map(|h| {
            let mid = (h << 16) | 0x8000;
            [mid - 1, mid, mid + 1, mid | 0x8000_0000].map(f32::from_bits)
        }));
        for v in probes {
            let want = bf16::from_f32(v);
            let got = f32_to_bf16(v);
            if want.is_nan() {
                assert!(bf16::from_bits(got).is_nan(), "{v:e}");
            } else {
                assert_eq!(got, want.to_bits(), "{v:e} ({:#010x})", v.to_bits());
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn f16c_conversions_match_half() {
        // The F16C kernels are only chosen where the CPU has F16C.
        if !has_avx2() {
            return;
        }
        for h in 0..=u16::MAX {
            let want = f16::from_bits(h).to_f32();
            let got = F16c::widen(h);
            assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()));
        }
        let probes = rounding_probes(|h| f16::from_bits(h).to_f32());
        // Blocks of 8 and a tail of 5.
        let probes = &probes[..(probes.len() - 5) / 8 * 8 + 5];
        let mut got = vec![0u16; probes.len()];
        F16c::narrow_all(probes, &mut got);
        for (&v, &g) in probes.iter().zip(&got) {
            let want = f16::from_f32(v);
            if want.is_nan() {
                assert!(f16::from_bits(g).is_nan(), "{v:e}");
            } else {
                assert_eq!(g, want.to_bits(), "{v:e} ({:#010x})", v.to_bits());
            }
        }
    }

    #[test]
    fn bitwise_ops_on_floats_have_no_kernel() {
        for &d in Dtype::ALL {
            for &o in ReduceOp::ALL {
                assert_eq!(Kernel::new(d, o).is_some(), o.supports(d), "{d} {o}");
            }
        }
    }

    /// Folds `srcs` into the accumulator at element `at`, in passes of
    /// `groups` sources (`first`, then `fold`); every pointer addresses
    /// `n` elements of a live buffer.
    fn fold_passes(
        k: &Kernel,
        scratch: &mut Scratch,
        at: usize,
        srcs: &[*const u8],
        groups: &[usize],
        n: usize,
    ) {
        let mut next = 0;
        for (g, &len) in groups.iter().enumerate() {
            let group = &srcs[next..next + len];
            // SAFETY: the caller's pointers, `n` elements each.
            unsafe {
                if g == 0 {
                    k.first(scratch, at, group, n);
                } else {
                    k.fold(scratch, at, group, n);
                }
            }
            next += len;
        }
    }

    /// Runs the kernels by hand over host buffers, at an odd byte offset
    /// (unaligned sources) and into the middle of the accumulator, reading
    /// the inputs in passes of `groups` sources.
    fn run_grouped(k: &Kernel, inputs: &[Vec<u8>], world: u32, groups: &[usize]) -> Vec<u8> {
        assert_eq!(groups.iter().sum::<usize>(), inputs.len());
        let size = k.elem_size();
        let n = inputs[0].len() / size;
        let at = 5;
        let mut scratch = Scratch::with_bytes((n + at) * k.acc_size());
        let shifted: Vec<Vec<u8>> = inputs
            .iter()
            .map(|b| {
                let mut v = vec![0xa5];
                v.extend_from_slice(b);
                v
            })
            .collect();
        let ptrs: Vec<*const u8> = shifted.iter().map(|b| b[1..].as_ptr()).collect();
        fold_passes(k, &mut scratch, at, &ptrs, groups, n);
        // `finish` works on the chunk from 0: move the result there first.
        let acc_bytes = k.acc_size() * n;
        let head = scratch.acc_lines().as_mut_ptr().cast::<u8>();
        // SAFETY: both ranges lie in the accumulator (n + at elements).
        unsafe { std::ptr::copy(head.add(at * k.acc_size()), head, acc_bytes) };
        k.finish(&mut scratch, n, world).to_vec()
    }

    /// As `run_grouped`, in passes of as many sources as a kernel takes.
    fn run_kernels(k: &Kernel, inputs: &[Vec<u8>], world: u32) -> Vec<u8> {
        let groups: Vec<usize> = (0..inputs.len())
            .step_by(MAX_GROUP)
            .map(|r| (inputs.len() - r).min(MAX_GROUP))
            .collect();
        run_grouped(k, inputs, world, &groups)
    }

    #[test]
    fn kernels_match_reference_for_every_dtype_op_isa_and_grouping() {
        let mut rng = Rng::new(1);
        for isa in Isa::available() {
            for (dtype, op) in reference::pairs() {
                let k = Kernel::with_isa(dtype, op, isa).unwrap();
                for world in 1..=9usize {
                    // One source per pass, the most per pass, and a random
                    // split: every kernel of every group size runs.
                    let mut random = Vec::new();
                    let mut left = world;
                    while left > 0 {
                        let g = (1 + rng.below(MAX_GROUP)).min(left);
                        random.push(g);
                        left -= g;
                    }
                    let full: Vec<usize> = (0..world)
                        .step_by(MAX_GROUP)
                        .map(|r| (world - r).min(MAX_GROUP))
                        .collect();
                    for groups in [vec![1; world], full, random] {
                        for n in [1usize, 7, 16, 33, 67] {
                            let inputs: Vec<Vec<u8>> =
                                (0..world).map(|_| rng.elems(dtype, n)).collect();
                            let refs: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
                            let want = reference::reduce(dtype, op, world as u32, &refs);
                            let got = run_grouped(&k, &inputs, world as u32, &groups);
                            if let Err(e) = reference::check(dtype, &got, &want) {
                                panic!("{isa:?} {op} N={world} groups {groups:?} n={n}: {e}");
                            }
                        }
                    }
                }
            }
        }
    }

    /// Reduces `inputs` as the data path does: the passes before the last
    /// into the accumulator at element `at`, then `through` from the last
    /// pass's sources to `dsts` (each a pointer `n` elements long).
    fn run_through(
        k: &Kernel,
        srcs: &[*const u8],
        dsts: &[*mut u8],
        n: usize,
        world: u32,
        stores: Stores,
    ) {
        let groups: Vec<usize> = groups(srcs.len()).collect();
        let earlier = srcs.len() - groups[groups.len() - 1];
        let at = 3;
        let mut scratch = Scratch::with_bytes((n + at) * k.acc_size());
        fold_passes(k, &mut scratch, at, srcs, &groups[..groups.len() - 1], n);
        let acc = (earlier > 0).then_some((&mut scratch, at));
        // SAFETY: as above; the destinations are the caller's buffers.
        unsafe { k.through(acc, &srcs[earlier..], dsts, n, world, stores) };
        crate::fence();
    }

    #[test]
    fn through_writes_every_output_exactly_for_every_dtype_op_isa_and_alignment() {
        let mut rng = Rng::new(7);
        // Guard bytes either side of every destination.
        const GUARD: usize = 64;
        for isa in Isa::available() {
            for (dtype, op) in reference::pairs() {
                let k = Kernel::with_isa(dtype, op, isa).unwrap();
                let size = k.elem_size();
                for world in [1usize, 2, 4, 5, 9] {
                    // Below, at and above the streaming minimum, and a few
                    // blocks with a ragged tail.
                    let lens = [
                        1,
                        store::STREAM_MIN / size - 1,
                        store::STREAM_MIN / size,
                        517,
                    ];
                    for n in lens {
                        let inputs: Vec<Vec<u8>> =
                            (0..world).map(|_| rng.elems(dtype, n)).collect();
                        let refs: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
                        let want = reference::reduce(dtype, op, world as u32, &refs);
                        let srcs: Vec<*const u8> = inputs.iter().map(|b| b.as_ptr()).collect();
                        // Line-aligned destinations, destinations sharing an
                        // unaligned offset, and offsets that differ.
                        for offsets in [[0, 0, 0], [size, size, size], [0, size, 2 * size]] {
                            for stores in [Stores::Cached, Stores::Streaming] {
                                let mut out = vec![vec![0x5a_u8; 2 * GUARD + 64 + n * size]; 3];
                                // Where each destination starts: a line
                                // boundary, plus the offset.
                                let starts: Vec<usize> = out
                                    .iter()
                                    .zip(offsets)
                                    .map(|(o, off)| {
                                        let base = o.as_ptr().addr() + GUARD;
                                        GUARD + (64 - base % 64) % 64 + off
                                    })
                                    .collect();
                                let dsts: Vec<*mut u8> = out
                                    .iter_mut()
                                    .zip(&starts)
                                    .map(|(o, &at)| o[at..].as_mut_ptr())
                                    .collect();
                                let dsts = &dsts[..1 + world % 3];
                                run_through(&k, &srcs, dsts, n, world as u32, stores);
                                for (d, (b, &at)) in
                                    out.iter().zip(&starts).take(dsts.len()).enumerate()
                                {
                                    let ctx = format!(
                                        "{isa:?} {dtype:?} {op} N={world} n={n} {stores:?} out {d} at {at}"
                                    );
                                    let end = at + n * size;
                                    if let Err(e) = reference::check(dtype, &b[at..end], &want) {
                                        panic!("{ctx}: {e}");
                                    }
                                    assert!(b[..at].iter().all(|&x| x == 0x5a), "{ctx}: head");
                                    assert!(b[end..].iter().all(|&x| x == 0x5a), "{ctx}: tail");
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn through_in_place_overwrites_every_input_with_the_result() {
        let mut rng = Rng::new(8);
        for isa in Isa::available() {
            for (dtype, op) in reference::pairs() {
                let k = Kernel::with_isa(dtype, op, isa).unwrap();
                for world in [1usize, 3, 6] {
                    let n = 1031;
                    let mut inputs: Vec<Vec<u8>> =
                        (0..world).map(|_| rng.elems(dtype, n)).collect();
                    let refs: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
                    let want = reference::reduce(dtype, op, world as u32, &refs);
                    // Every input is also an output, as in an in-place
                    // allreduce of one process's ranks.
                    let dsts: Vec<*mut u8> = inputs.iter_mut().map(|b| b.as_mut_ptr()).collect();
                    let srcs: Vec<*const u8> = dsts.iter().map(|&p| p.cast_const()).collect();
                    run_through(&k, &srcs, &dsts, n, world as u32, Stores::Streaming);
                    for (r, b) in inputs.iter().enumerate() {
                        if let Err(e) = reference::check(dtype, b, &want) {
                            panic!("{isa:?} {dtype:?} {op} N={world} rank {r}: {e}");
                        }
                    }
                }
            }
        }
    }

    fn floats(dtype: Dtype, vals: &[f64]) -> Vec<u8> {
        vals.iter()
            .flat_map(|&v| match dtype {
                Dtype::F32 => (v as f32).to_ne_bytes().to_vec(),
                Dtype::F64 => v.to_ne_bytes().to_vec(),
                Dtype::F16 => f16::from_f64(v).to_ne_bytes().to_vec(),
                Dtype::Bf16 => bf16::from_f64(v).to_ne_bytes().to_vec(),
                _ => unreachable!(),
            })
            .collect()
    }

    #[test]
    fn nan_in_any_input_gives_nan_for_min_and_max() {
        let nan = f64::NAN;
        for isa in Isa::available() {
            for dtype in [Dtype::F32, Dtype::F64, Dtype::F16, Dtype::Bf16] {
                for op in [ReduceOp::Min, ReduceOp::Max, ReduceOp::Sum] {
                    let k = Kernel::with_isa(dtype, op, isa).unwrap();
                    // NaN first, in the middle, last, everywhere, nowhere.
                    let inputs = vec![
                        floats(dtype, &[nan, 1.0, 1.0, nan, 1.0]),
                        floats(dtype, &[2.0, nan, 2.0, nan, -0.0]),
                        floats(dtype, &[-3.0, 3.0, nan, nan, 0.0]),
                    ];
                    let out = run_kernels(&k, &inputs, 3);
                    let want = floats(dtype, &[nan, nan, nan, nan, 0.0]);
                    let size = dtype.size();
                    let refs: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
                    reference::check(dtype, &out[..4 * size], &want[..4 * size])
                        .unwrap_or_else(|e| panic!("{isa:?} {op}: {e}"));
                    reference::check(dtype, &out, &reference::reduce(dtype, op, 3, &refs))
                        .unwrap_or_else(|e| panic!("{isa:?} {op}: {e}"));
                }
            }
        }
    }

    /// Raw bits of `v` as an element of `dtype` (little-endian bytes).
    fn raw(dtype: Dtype, bits: u64) -> Vec<u8> {
        bits.to_le_bytes()[..dtype.size()].to_vec()
    }

    /// (a signalling NaN, another one of the other sign, a quiet NaN) of
    /// each float dtype, with payloads, and the quiet bit.
    fn nans(dtype: Dtype) -> ([u64; 3], u64) {
        match dtype {
            Dtype::F32 => ([0x7f80_0001, 0xffa0_1234, 0x7fc0_0005], 1 << 22),
            Dtype::F64 => (
                [
                    0x7ff0_0000_0000_0001,
                    0xfff4_0000_0000_0abc,
                    0x7ff8_0000_0000_0042,
                ],
                1 << 51,
            ),
            Dtype::F16 => ([0x7c01, 0xfd23, 0x7e05], 1 << 9),
            Dtype::Bf16 => ([0x7f81, 0xffa3, 0x7fc3], 1 << 6),
            _ => unreachable!(),
        }
    }

    fn is_nan_bits(dtype: Dtype, bits: u64) -> bool {
        match dtype {
            Dtype::F32 => f32::from_bits(bits as u32).is_nan(),
            Dtype::F64 => f64::from_bits(bits).is_nan(),
            Dtype::F16 => f16::from_bits(bits as u16).is_nan(),
            Dtype::Bf16 => bf16::from_bits(bits as u16).is_nan(),
            _ => false,
        }
    }

    /// Every float dtype, every op, every ISA, worlds of 1 to 5 (every
    /// kernel grouping), a signalling or quiet NaN in each position: the
    /// result is a quiet NaN; for min and max it is the first NaN in rank
    /// order with its quiet bit set, bit for bit; lanes without a NaN
    /// match the reference.
    #[test]
    fn nan_results_are_quiet_for_every_float_dtype_op_and_position() {
        let floats_of = [Dtype::F32, Dtype::F64, Dtype::F16, Dtype::Bf16];
        let ops = [
            ReduceOp::Sum,
            ReduceOp::Prod,
            ReduceOp::Min,
            ReduceOp::Max,
            ReduceOp::Avg,
        ];
        let mut checked = 0;
        for isa in Isa::available() {
            for dtype in floats_of {
                let (nan, quiet_bit) = nans(dtype);
                let size = dtype.size();
                let two = floats(dtype, &[2.0]);
                let two_bits = {
                    let mut b = [0u8; 8];
                    b[..size].copy_from_slice(&two);
                    u64::from_le_bytes(b)
                };
                for op in ops {
                    let k = Kernel::with_isa(dtype, op, isa).unwrap();
                    for world in 1..=5usize {
                        // Element e: which inputs hold which NaN. Lane 0
                        // has no NaN; lanes 1.. put NaN k at rank r, and
                        // lane "all" has a different NaN at every rank.
                        let mut lanes: Vec<Vec<u64>> = vec![vec![two_bits; world]];
                        for r in 0..world {
                            for &n in &nan {
                                let mut l = vec![two_bits; world];
                                l[r] = n;
                                lanes.push(l);
                            }
                        }
                        lanes.push((0..world).map(|r| nan[(r + 1) % 3]).collect());
                        if world > 1 {
                            // A quiet NaN first, a signalling one after it.
                            let mut l = vec![two_bits; world];
                            l[0] = nan[2];
                            l[world - 1] = nan[0];
                            lanes.push(l);
                        }
                        let inputs: Vec<Vec<u8>> = (0..world)
                            .map(|r| lanes.iter().flat_map(|l| raw(dtype, l[r])).collect())
                            .collect();
                        let out = run_kernels(&k, &inputs, world as u32);
                        let refs: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
                        let want = reference::reduce(dtype, op, world as u32, &refs);
                        for (e, lane) in lanes.iter().enumerate() {
                            let mut b = [0u8; 8];
                            b[..size].copy_from_slice(&out[e * size..(e + 1) * size]);
                            let got = u64::from_le_bytes(b);
                            let what = format!(
                                "{isa:?} {dtype} {op} N={world} lane {lane:x?}: got {got:#x}"
                            );
                            let first_nan = lane.iter().copied().find(|&x| is_nan_bits(dtype, x));
                            match first_nan {
                                None => reference::check(
                                    dtype,
                                    &out[e * size..(e + 1) * size],
                                    &want[e * size..(e + 1) * size],
                                )
                                .unwrap_or_else(|m| panic!("{what}: {m}")),
                                Some(first) => {
                                    assert!(is_nan_bits(dtype, got), "{what}: not a NaN");
                                    assert_ne!(got & quiet_bit, 0, "{what}: signalling NaN");
                                    if matches!(op, ReduceOp::Min | ReduceOp::Max) {
                                        assert_eq!(
                                            got,
                                            first | quiet_bit,
                                            "{what}: not the first NaN, quieted"
                                        );
                                    }
                                }
                            }
                            checked += 1;
                        }
                    }
                }
            }
        }
        assert!(checked > 1000, "{checked}");
    }

    /// The baseline f16 narrowing gives the same NaN bits as F16C and
    /// `half`: sign, quiet bit, the top 10 payload bits.
    #[test]
    fn f16_narrowing_of_nan_keeps_sign_and_payload() {
        for bits in [
            0x7f80_0001u32,
            0xffa0_1234,
            0x7fc0_0005,
            0x7fff_ffff,
            0xff80_2000,
        ] {
            let v = f32::from_bits(bits);
            let want = f16::from_f32(v).to_bits();
            assert_eq!(f32_to_f16(v), want, "{bits:#x}");
            assert_eq!(want & 0x7e00, 0x7e00, "{bits:#x}");
            #[cfg(target_arch = "x86_64")]
            if has_avx2() {
                assert_eq!(F16c::narrow(v), want, "F16C {bits:#x}");
            }
        }
    }

    #[test]
    fn min_and_max_keep_the_lower_rank_on_ties() {
        // IEEE minimum/maximum would order -0 below +0; we keep rank 0's.
        for isa in Isa::available() {
            let k = Kernel::with_isa(Dtype::F32, ReduceOp::Min, isa).unwrap();
            let inputs = [floats(Dtype::F32, &[0.0]), floats(Dtype::F32, &[-0.0])];
            assert_eq!(run_kernels(&k, &inputs, 2), 0.0f32.to_ne_bytes(), "{isa:?}");
            let k = Kernel::with_isa(Dtype::F32, ReduceOp::Max, isa).unwrap();
            let inputs = [floats(Dtype::F32, &[-0.0]), floats(Dtype::F32, &[0.0])];
            assert_eq!(
                run_kernels(&k, &inputs, 2),
                (-0.0f32).to_ne_bytes(),
                "{isa:?}"
            );
        }
    }

    #[test]
    fn half_types_round_once_at_the_end() {
        // 1 + 2^-11 + 2^-11: rounding after each step would tie back to 1
        // twice; f32 accumulation gives 1 + 2^-10, an f16 value.
        let tiny = 2f64.powi(-11);
        for isa in Isa::available() {
            let k = Kernel::with_isa(Dtype::F16, ReduceOp::Sum, isa).unwrap();
            let inputs: Vec<Vec<u8>> = [1.0, tiny, tiny]
                .iter()
                .map(|&v| floats(Dtype::F16, &[v]))
                .collect();
            let out = run_kernels(&k, &inputs, 3);
            assert_eq!(
                out,
                f16::from_f64(1.0 + 2.0 * tiny).to_ne_bytes(),
                "{isa:?}"
            );
            // bf16 has 8 significant bits: the same with 2^-8 steps.
            let k = Kernel::with_isa(Dtype::Bf16, ReduceOp::Sum, isa).unwrap();
            let tiny = 2f64.powi(-8);
            let inputs: Vec<Vec<u8>> = [1.0, tiny, tiny]
                .iter()
                .map(|&v| floats(Dtype::Bf16, &[v]))
                .collect();
            let out = run_kernels(&k, &inputs, 3);
            assert_eq!(
                out,
                bf16::from_f64(1.0 + 2.0 * tiny).to_ne_bytes(),
                "{isa:?}"
            );
            // avg divides in f32 before the one rounding: (1 + 2 + 2^-11*3) / 3.
            let k = Kernel::with_isa(Dtype::F16, ReduceOp::Avg, isa).unwrap();
            let inputs: Vec<Vec<u8>> = [1.0, 2.0, 3.0 * 2f64.powi(-11)]
                .iter()
                .map(|&v| floats(Dtype::F16, &[v]))
                .collect();
            let out = run_kernels(&k, &inputs, 3);
            let want = f16::from_f32((1.0 + 2.0 + 3.0 * 2f32.powi(-11)) / 3.0);
            assert_eq!(out, want.to_ne_bytes(), "{isa:?}");
        }
    }

    #[test]
    fn integer_avg_truncates_toward_zero() {
        for isa in Isa::available() {
            let k = Kernel::with_isa(Dtype::I32, ReduceOp::Avg, isa).unwrap();
            let input = |v: &[i32]| v.iter().flat_map(|x| x.to_ne_bytes()).collect::<Vec<u8>>();
            let inputs = vec![input(&[-7, 7, -1, i32::MAX]), input(&[0, 0, 0, 1])];
            let out = run_kernels(&k, &inputs, 2);
            // -7/2 = -3, 7/2 = 3, -1/2 = 0, and MAX + 1 wraps to MIN: MIN/2.
            assert_eq!(out, input(&[-3, 3, 0, i32::MIN / 2]), "{isa:?}");
            let k = Kernel::with_isa(Dtype::I8, ReduceOp::Avg, isa).unwrap();
            // A world larger than any i8: -128 / 200 truncates to 0, and
            // the divisor is not narrowed to i8.
            let inputs = vec![vec![(-128i8) as u8, 100], vec![0, 100]];
            let out = run_kernels(&k, &inputs, 200);
            // 100 + 100 wraps to -56; -56 / 200 = 0.
            assert_eq!(out, vec![0, 0], "{isa:?}");
            let out = run_kernels(&k, &[vec![(-128i8) as u8]], 128);
            assert_eq!(out, vec![(-1i8) as u8], "{isa:?}");
        }
    }

    #[test]
    fn integer_avg_division_is_exact_at_the_extremes() {
        let mut rng = Rng::new(3);
        let worlds = [
            1,
            2,
            3,
            7,
            128,
            129,
            1000,
            65_537,
            1 << 21,
            (1 << 21) + 1,
            u32::MAX,
        ];
        let edges = [
            0i64,
            1,
            -1,
            2,
            127,
            -128,
            255,
            i32::MAX as i64,
            i32::MIN as i64,
        ];
        for &w in &worlds {
            let mut values: Vec<i64> = edges.to_vec();
            values.extend((0..2000).map(|_| rng.next_u64() as i64));
            // Multiples of the world size and their neighbours, where a
            // rounding error would show.
            values.extend((0..2000).flat_map(|_| {
                let m = (rng.next_u64() % (u64::from(u32::MAX) / u64::from(w) + 1)) as i64
                    * i64::from(w);
                [m - 1, m, m + 1, -m - 1, -m, -m + 1]
            }));
            for &v in &values {
                let want = |x: i64| x / i64::from(w);
                assert_eq!(
                    i64::from((v as i32).div_world(w)),
                    want(i64::from(v as i32)),
                    "{v} / {w}"
                );
                assert_eq!(
                    i64::from((v as u32).div_world(w)),
                    want(i64::from(v as u32)),
                    "{v} / {w}"
                );
                assert_eq!(
                    i64::from((v as i8).div_world(w)),
                    want(i64::from(v as i8)),
                    "{v} / {w}"
                );
                assert_eq!(
                    i64::from((v as u8).div_world(w)),
                    want(i64::from(v as u8)),
                    "{v} / {w}"
                );
                assert_eq!(v.div_world(w), want(v), "{v} / {w}");
                assert_eq!(
                    (v as u64).div_world(w),
                    v as u64 / u64::from(w),
                    "{v} / {w}"
                );
            }
        }
    }

    #[test]
    fn groups_split_evenly_in_rank_order() {
        let split = |n| groups(n).collect::<Vec<_>>();
        assert_eq!(split(0), Vec::<usize>::new());
        assert_eq!(split(1), [1]);
        assert_eq!(split(4), [4]);
        assert_eq!(split(5), [3, 2]);
        assert_eq!(split(7), [4, 3]);
        assert_eq!(split(8), [4, 4]);
        assert_eq!(split(9), [3, 3, 3]);
        for n in 1..200 {
            let g = split(n);
            assert_eq!(g.iter().sum::<usize>(), n);
            assert_eq!(g.len(), n.div_ceil(MAX_GROUP));
            assert!(g.iter().all(|&k| (1..=MAX_GROUP).contains(&k)));
            assert!(g.windows(2).all(|w| w[0] >= w[1] && w[0] - w[1] <= 1));
        }
    }

    #[test]
    #[should_panic(expected = "a kernel pass reads 1 to 4 sources")]
    fn kernels_refuse_too_many_sources() {
        let k = Kernel::new(Dtype::U8, ReduceOp::Sum).unwrap();
        let mut scratch = Scratch::with_bytes(64);
        let src = [0u8; 8];
        // SAFETY: every source holds 8 elements; the kernel must refuse 5.
        unsafe { k.fold(&mut scratch, 0, &[src.as_ptr(); 5], 8) };
    }

    #[test]
    #[should_panic(expected = "chunk exceeds the scratch")]
    fn kernels_refuse_ranges_beyond_the_scratch() {
        let k = Kernel::new(Dtype::F32, ReduceOp::Sum).unwrap();
        let mut scratch = Scratch::with_bytes(64);
        let src = [0u8; 128];
        // SAFETY: the source holds 32 f32; the kernel must refuse at 17.
        unsafe { k.first(&mut scratch, 0, &[src.as_ptr()], 17) };
    }
}
