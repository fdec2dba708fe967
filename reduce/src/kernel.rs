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
/// (docs/benchmarks-journal.md).
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
    /// Neither NaN nor infinite (integers: always).
    fn finite(self) -> bool;
    /// What [`Num::nonfinite_bits`] returns.
    type Mask: Copy + Default + PartialEq + std::ops::BitOr<Output = Self::Mask>;
    /// Zero exactly when `self` is finite. The checked kernels OR these
    /// per source: an integer OR is associative, so their loops vectorise
    /// (per-element `bool` flags did not).
    fn nonfinite_bits(self) -> Self::Mask;
}

/// Bitwise operations of the integer accumulator types.
trait Bits: Num {
    fn and(self, x: Self) -> Self;
    fn or(self, x: Self) -> Self;
    fn xor(self, x: Self) -> Self;
}

macro_rules! float_num {
    ($($t:ty: $bits:ty, $quiet_bit:expr),*) => {$(
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
            #[inline(always)]
            fn finite(self) -> bool {
                self.is_finite()
            }
            type Mask = $bits;
            #[inline(always)]
            fn nonfinite_bits(self) -> $bits {
                // `x - x` is +0.0 (all bits zero) for every finite `x`,
                // -0.0 and subnormals included, and NaN for Inf and NaN.
                (self - self).to_bits()
            }
        }
    )*};
}
float_num!(f32: u32, 1 << 22, f64: u64, 1 << 51);

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
            #[inline(always)]
            fn finite(self) -> bool {
                true
            }
            type Mask = u8;
            #[inline(always)]
            fn nonfinite_bits(self) -> u8 {
                0
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

/// The CPU stores numbers big-endian: elements, little-endian in memory
/// (docs/spec.md 5.X.6.5.1), are byte-swapped as they are read and written.
/// False on every CPU the project runs on, where the swaps compile to
/// nothing; tests/cross-endian.sh runs the tests on s390x to check them.
const BIG_ENDIAN: bool = cfg!(target_endian = "big");

/// A stored element: its conversion between little-endian memory order and
/// the CPU's (the identity on a little-endian CPU).
trait Le: Copy {
    /// A little-endian element read from memory in the CPU's order, or a
    /// number in the CPU's order as it is stored: a byte swap on a
    /// big-endian CPU (its own inverse), the identity otherwise.
    fn swap_le(self) -> Self;
}

macro_rules! le_int {
    ($($t:ty),*) => {$(
        impl Le for $t {
            #[inline(always)]
            fn swap_le(self) -> Self {
                <$t>::from_le(self)
            }
        }
    )*};
}
le_int!(i8, u8, u16, i32, u32, i64, u64);

macro_rules! le_float {
    ($($t:ty: $bits:ty),*) => {$(
        impl Le for $t {
            #[inline(always)]
            fn swap_le(self) -> Self {
                <$t>::from_bits(<$bits>::from_le(self.to_bits()))
            }
        }
    )*};
}
le_float!(f32: u32, f64: u64);

/// A dtype: how an element is stored and what it accumulates in.
trait Elem: 'static {
    /// The stored element (f16 and bf16 as their bits), little-endian in
    /// memory ([`Le`]).
    type Raw: Copy + Default + Le + 'static;
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

impl<T: Num + Le> Elem for Plain<T> {
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
//
// With `CHECK` (the checked kernels of the float dtypes, spec 5.X.6.14) a
// body also ORs, per source, the `nonfinite_bits` of every element it
// read, in the loop that reads it (a widened f16 or bf16 is non-finite
// exactly when the element is), and only when a source was flagged finds the
// exact element by reading that source's range again (`first_bad`), before
// anything of that range is written. It returns the lowest flagged source
// and the lowest non-finite element in it: a [`NonFinite`].

/// The first non-finite input of a checked kernel pass: `(source, element)`,
/// the lowest source of the pass with a non-finite element in the range and
/// the lowest such element, counted from the start of the call.
pub type NonFinite = (usize, usize);

/// The lower of two [`NonFinite`]s, lexicographically (source, then
/// element): the one every split of a reduction agrees on.
pub fn lowest(a: Option<NonFinite>, b: Option<NonFinite>) -> Option<NonFinite> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, None) => a,
        (None, b) => b,
    }
}

/// Per source of a checked pass, the OR of its elements' `nonfinite_bits`.
type Flags<E, const K: usize> = [<<E as Elem>::Acc as Num>::Mask; K];

/// Which sources `flags` flag, for [`first_bad`]: a copy, because flags
/// passed by reference would live in memory that the sources might alias,
/// which LLVM checks for in every loop.
#[inline(always)]
fn flagged<M: Copy + Default + PartialEq, const K: usize>(flags: &[M; K]) -> [bool; K] {
    flags.map(|f| f != M::default())
}

/// ORs `x`'s `nonfinite_bits` into `flag`; nothing unless `CHECK`.
#[inline(always)]
fn flag<A: Num, const CHECK: bool>(flag: &mut A::Mask, x: A) {
    if CHECK {
        *flag = *flag | x.nonfinite_bits();
    }
}

/// The lowest source flagged in `bad` and its first non-finite element in
/// `from..to`. Run only when a pass flagged a source, before the range is
/// written. A guest that changed the element meanwhile (spec DRV-OP-3
/// forbids it) leaves it unfound: the range's first element is named.
#[cold]
#[inline(never)]
unsafe fn first_bad<E: Elem>(
    srcs: &[*const E::Raw],
    bad: &[bool],
    from: usize,
    to: usize,
) -> Option<NonFinite> {
    let k = bad.iter().position(|&b| b)?;
    let at = (from..to)
        // SAFETY: the source is readable for `to` elements (contract of
        // the body that flagged it).
        .find(|&i| !unsafe { read::<E>(srcs[k], i) }.finite())
        .unwrap_or(from);
    Some((k, at))
}

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
    E::widen(unsafe { src.add(i).read_unaligned() }.swap_le())
}

/// `acc = src` (one source needs no op; NaNs are quieted all the same).
#[inline(always)]
unsafe fn load_body<E: Elem, const CHECK: bool>(
    acc: *mut u8,
    srcs: *const *const u8,
    n: usize,
) -> Option<NonFinite> {
    // SAFETY: `acc` is our scratch, aligned and holding `n` accumulators
    // (contract above); any bit pattern is a valid number.
    let acc = unsafe { slice::from_raw_parts_mut(acc.cast::<E::Acc>(), n) };
    // SAFETY: one source pointer (contract of `first`).
    let s = unsafe { sources::<E, 1>(srcs) };
    let mut flags: Flags<E, 1> = [Default::default(); 1];
    for (i, a) in acc.iter_mut().enumerate() {
        // SAFETY: `i < n`.
        let x = unsafe { read::<E>(s[0], i) };
        flag::<_, CHECK>(&mut flags[0], x);
        *a = x.quiet();
    }
    let bad = flagged(&flags);
    // SAFETY: the source is readable for `n` elements.
    (CHECK && bad[0]).then(|| unsafe { first_bad::<E>(&s, &bad, 0, n) })?
}

/// `acc = s0 op s1 op .. op s(K-1)`, left to right.
#[inline(always)]
unsafe fn first_body<E: Elem, O: Op<E::Acc>, const K: usize, const CHECK: bool>(
    acc: *mut u8,
    srcs: *const *const u8,
    n: usize,
) -> Option<NonFinite> {
    // SAFETY: as in `load_body`.
    let acc = unsafe { slice::from_raw_parts_mut(acc.cast::<E::Acc>(), n) };
    // SAFETY: `K` source pointers (contract of `first`).
    let s = unsafe { sources::<E, K>(srcs) };
    let mut flags: Flags<E, K> = [Default::default(); K];
    for (i, a) in acc.iter_mut().enumerate() {
        // SAFETY: `i < n` for every source.
        let mut v = unsafe { read::<E>(s[0], i) };
        flag::<_, CHECK>(&mut flags[0], v);
        // Slices of constant length, not `.skip(1)`: LLVM unrolls these
        // and then vectorises the element loop.
        for (f, &src) in flags[1..].iter_mut().zip(&s[1..]) {
            // SAFETY: as above.
            let x = unsafe { read::<E>(src, i) };
            flag::<_, CHECK>(f, x);
            v = O::apply(v, x);
        }
        *a = v;
    }
    let bad = flagged(&flags);
    // SAFETY: every source is readable for `n` elements.
    (CHECK && bad.contains(&true)).then(|| unsafe { first_bad::<E>(&s, &bad, 0, n) })?
}

/// `acc = acc op s0 op .. op s(K-1)`, left to right.
#[inline(always)]
unsafe fn fold_body<E: Elem, O: Op<E::Acc>, const K: usize, const CHECK: bool>(
    acc: *mut u8,
    srcs: *const *const u8,
    n: usize,
) -> Option<NonFinite> {
    // SAFETY: as in `load_body`.
    let acc = unsafe { slice::from_raw_parts_mut(acc.cast::<E::Acc>(), n) };
    // SAFETY: `K` source pointers (contract of `fold`).
    let s = unsafe { sources::<E, K>(srcs) };
    let mut flags: Flags<E, K> = [Default::default(); K];
    for (i, a) in acc.iter_mut().enumerate() {
        let mut v = *a;
        for (f, &src) in flags.iter_mut().zip(&s) {
            // SAFETY: `i < n` for every source.
            let x = unsafe { read::<E>(src, i) };
            flag::<_, CHECK>(f, x);
            v = O::apply(v, x);
        }
        *a = v;
    }
    let bad = flagged(&flags);
    // SAFETY: every source is readable for `n` elements.
    (CHECK && bad.contains(&true)).then(|| unsafe { first_bad::<E>(&s, &bad, 0, n) })?
}

/// Returns true if the result is in `stage`, false if it is in `acc`.
#[inline(always)]
unsafe fn finish_body<E: Elem, O: Op<E::Acc>>(
    acc: *mut u8,
    stage: *mut u8,
    n: usize,
    world: u32,
) -> bool {
    // The accumulator is the result as it is, unless a big-endian CPU has
    // to swap it into memory order in `stage`.
    if E::SAME && !O::AVG && !BIG_ENDIAN {
        return false;
    }
    // SAFETY: as in `load_body`.
    let acc = unsafe { slice::from_raw_parts_mut(acc.cast::<E::Acc>(), n) };
    if O::AVG {
        for a in acc.iter_mut() {
            *a = a.div_world(world);
        }
    }
    if E::SAME && !BIG_ENDIAN {
        return false;
    }
    // SAFETY: `stage` is our scratch with room for `n` aligned `E::Raw`,
    // disjoint from `acc` (contract above).
    let stage = unsafe { slice::from_raw_parts_mut(stage.cast::<E::Raw>(), n) };
    E::narrow_all(acc, stage);
    to_le_all::<E>(stage);
    true
}

/// Turns results in the CPU's byte order into memory order (little-endian,
/// spec 5.X.6.5.1): nothing on a little-endian CPU.
#[inline(always)]
fn to_le_all<E: Elem>(raws: &mut [E::Raw]) {
    if BIG_ENDIAN {
        for r in raws {
            *r = r.swap_le();
        }
    }
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
/// docs/benchmarks-journal.md ("The last pass writes the outputs") use them.
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
/// docs/benchmarks-journal.md "Inputs asked for one page ahead") this took the
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
/// element `from`, which the caller ensures). With `CHECK`, each block's
/// flagged sources are searched before the block is written (in place,
/// writing it overwrites the inputs).
#[inline(always)]
unsafe fn through_body<
    E: Elem,
    O: Op<E::Acc>,
    L: StreamLines,
    const K: usize,
    const FOLD: bool,
    const CHECK: bool,
>(
    t: &Through,
    from: usize,
    n: usize,
    streaming: bool,
) -> Option<NonFinite> {
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
    let mut found: Option<NonFinite> = None;
    let mut i = from;
    while i < n {
        let m = cap.min(n - i);
        let mut flags: Flags<E, K> = [Default::default(); K];
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
                let x = unsafe { read::<E>(s[0], i + j) };
                flag::<_, CHECK>(&mut flags[0], x);
                x
            };
            // One source needs no op; its NaNs are quieted all the same.
            let mut v = if !FOLD && K == 1 { v.quiet() } else { v };
            // The rest of the sources: constant-length slices, as in
            // `first_body`.
            let rest = usize::from(!FOLD);
            for (f, &src) in flags[rest..].iter_mut().zip(&s[rest..]) {
                // SAFETY: as above.
                let x = unsafe { read::<E>(src, i + j) };
                flag::<_, CHECK>(f, x);
                v = O::apply(v, x);
            }
            *a = if O::AVG { v.div_world(t.world) } else { v };
        }
        // Sources below the lowest one found so far only: a higher one
        // cannot win.
        let below = found.map_or(K, |(k, _)| k);
        let bad = flagged(&flags);
        if CHECK && bad[..below].contains(&true) {
            // SAFETY: every source is readable for `n >= i + m` elements,
            // and nothing of this block is written yet.
            found = lowest(found, unsafe {
                first_bad::<E>(&s, &bad[..below], i, i + m)
            });
        }
        let block = if E::SAME && !BIG_ENDIAN {
            accs.0.as_ptr().cast::<u8>()
        } else {
            E::narrow_all(&accs.0[..m], &mut raws.0[..m]);
            to_le_all::<E>(&mut raws.0[..m]);
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
    found
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

type GroupFn = unsafe fn(*mut u8, *const *const u8, usize) -> Option<NonFinite>;
type FinishFn = unsafe fn(*mut u8, *mut u8, usize, u32) -> bool;
/// `(operands, from, n, streaming)`.
type ThroughFn = unsafe fn(&Through, usize, usize, bool) -> Option<NonFinite>;

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
            pub(super) unsafe fn load<E: Elem, const C: bool>(
                acc: *mut u8,
                srcs: *const *const u8,
                n: usize,
            ) -> Option<NonFinite> {
                // SAFETY: the caller keeps the kernel contract.
                unsafe { load_body::<E, C>(acc, srcs, n) }
            }

            $(#[target_feature(enable = $features)])?
            pub(super) unsafe fn first<E: Elem, O: Op<E::Acc>, const K: usize, const C: bool>(
                acc: *mut u8,
                srcs: *const *const u8,
                n: usize,
            ) -> Option<NonFinite> {
                // SAFETY: the caller keeps the kernel contract.
                unsafe { first_body::<E, O, K, C>(acc, srcs, n) }
            }

            $(#[target_feature(enable = $features)])?
            pub(super) unsafe fn fold<E: Elem, O: Op<E::Acc>, const K: usize, const C: bool>(
                acc: *mut u8,
                srcs: *const *const u8,
                n: usize,
            ) -> Option<NonFinite> {
                // SAFETY: the caller keeps the kernel contract.
                unsafe { fold_body::<E, O, K, C>(acc, srcs, n) }
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
            pub(super) unsafe fn through<
                E: Elem,
                O: Op<E::Acc>,
                const K: usize,
                const FOLD: bool,
                const C: bool,
            >(
                t: &Through,
                from: usize,
                n: usize,
                streaming: bool,
            ) -> Option<NonFinite> {
                // SAFETY: the caller keeps the kernel contract.
                unsafe { through_body::<E, O, $lines, K, FOLD, C>(t, from, n, streaming) }
            }

            /// The kernels; with `C`, the checked ones (spec 5.X.6.14).
            pub(super) fn fns<E: Elem, O: Op<E::Acc>, const C: bool>() -> Fns {
                Fns {
                    first: [
                        load::<E, C>,
                        first::<E, O, 2, C>,
                        first::<E, O, 3, C>,
                        first::<E, O, 4, C>,
                    ],
                    fold: [
                        fold::<E, O, 1, C>,
                        fold::<E, O, 2, C>,
                        fold::<E, O, 3, C>,
                        fold::<E, O, 4, C>,
                    ],
                    finish: finish::<E, O>,
                    through: [
                        [
                            through::<E, O, 1, false, C>,
                            through::<E, O, 2, false, C>,
                            through::<E, O, 3, false, C>,
                            through::<E, O, 4, false, C>,
                        ],
                        [
                            through::<E, O, 1, true, C>,
                            through::<E, O, 2, true, C>,
                            through::<E, O, 3, true, C>,
                            through::<E, O, 4, true, C>,
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
    fn fns<E: Elem, O: Op<E::Acc>, const C: bool>() -> Fns;
}

struct Baseline;

impl IsaKernels for Baseline {
    type F16 = F16;
    fn fns<E: Elem, O: Op<E::Acc>, const C: bool>() -> Fns {
        baseline::fns::<E, O, C>()
    }
}

#[cfg(target_arch = "x86_64")]
struct Avx2;

#[cfg(target_arch = "x86_64")]
impl IsaKernels for Avx2 {
    type F16 = F16c;
    fn fns<E: Elem, O: Op<E::Acc>, const C: bool>() -> Fns {
        avx2::fns::<E, O, C>()
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
        // (No `mut` vector: on other CPUs nothing would be pushed, and the
        // `mut` would warn.)
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            return vec![Isa::Baseline, Isa::Avx2];
        }
        vec![Isa::Baseline]
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

fn arith<I: IsaKernels, E: Elem, const C: bool>(op: ReduceOp) -> Option<Fns> {
    Some(match op {
        ReduceOp::Sum => I::fns::<E, Sum, C>(),
        ReduceOp::Prod => I::fns::<E, Prod, C>(),
        ReduceOp::Min => I::fns::<E, Min, C>(),
        ReduceOp::Max => I::fns::<E, Max, C>(),
        ReduceOp::Avg => I::fns::<E, Avg, C>(),
        ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor => return None,
    })
}

fn integer<I: IsaKernels, E: Elem>(op: ReduceOp) -> Option<Fns>
where
    E::Acc: Bits,
{
    match op {
        ReduceOp::Band => Some(I::fns::<E, Band, false>()),
        ReduceOp::Bor => Some(I::fns::<E, Bor, false>()),
        ReduceOp::Bxor => Some(I::fns::<E, Bxor, false>()),
        _ => arith::<I, E, false>(op),
    }
}

/// The kernels of a float `dtype` and `op` in ISA `I`, checked with `C`;
/// `None` for an integer dtype or an op floats lack.
fn floats<I: IsaKernels, const C: bool>(dtype: Dtype, op: ReduceOp) -> Option<Fns> {
    match dtype {
        Dtype::F32 => arith::<I, Plain<f32>, C>(op),
        Dtype::F64 => arith::<I, Plain<f64>, C>(op),
        Dtype::F16 => arith::<I, I::F16, C>(op),
        Dtype::Bf16 => arith::<I, Bf16, C>(op),
        _ => None,
    }
}

/// The kernels of `dtype` and `op` in ISA `I`; with `check`, for a float
/// dtype, the checked ones (integers have no non-finite values: theirs
/// are the same either way).
fn table<I: IsaKernels>(dtype: Dtype, op: ReduceOp, check: bool) -> Option<Fns> {
    if check {
        return floats::<I, true>(dtype, op).or_else(|| table::<I>(dtype, op, false));
    }
    match dtype {
        Dtype::F32 | Dtype::F64 | Dtype::F16 | Dtype::Bf16 => floats::<I, false>(dtype, op),
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
        Kernel::with_check(dtype, op, isa, false)
    }

    /// As [`Kernel::with_isa`]; with `check`, the checked kernels (spec
    /// 5.X.6.14): [`Kernel::first`], [`Kernel::fold`] and
    /// [`Kernel::through`] also return the first non-finite input they
    /// read, found in the same loop (for an integer dtype, which has
    /// none, the kernels are the unchecked ones).
    pub fn with_check(dtype: Dtype, op: ReduceOp, isa: Isa, check: bool) -> Option<Kernel> {
        let fns = match isa {
            Isa::Baseline => table::<Baseline>(dtype, op, check),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 if has_avx2() => table::<Avx2>(dtype, op, check),
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
    /// right, for 1 to [`MAX_GROUP`] sources. A checked kernel
    /// ([`Kernel::with_check`]) returns the lowest source that held a NaN
    /// or an infinity and its lowest such element ([`NonFinite`]); an
    /// unchecked one, `None`.
    ///
    /// # Safety
    /// Each source must be valid for reads of `n` elements (any alignment);
    /// the memory may be changed by another process meanwhile.
    pub unsafe fn first(
        &self,
        scratch: &mut Scratch,
        at: usize,
        srcs: &[*const u8],
        n: usize,
    ) -> Option<NonFinite> {
        let f = self.fns.first[Self::group(srcs)];
        let acc = self.acc_ptr(scratch, at, n);
        // SAFETY: `acc` addresses `n` accumulators of our scratch (checked
        // by `acc_ptr`; the scratch is line-aligned and initialised); `f`
        // reads as many pointers as `srcs` holds; the sources are the
        // caller's promise.
        unsafe { f(acc, srcs.as_ptr(), n) }
    }

    /// `acc[at..at + n] = acc[at..at + n] op srcs[0][..n] op ..`, left to
    /// right, for 1 to [`MAX_GROUP`] sources; returns as [`Kernel::first`].
    ///
    /// # Safety
    /// As for [`Kernel::first`].
    pub unsafe fn fold(
        &self,
        scratch: &mut Scratch,
        at: usize,
        srcs: &[*const u8],
        n: usize,
    ) -> Option<NonFinite> {
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
    /// at the same position (in place). Returns as [`Kernel::first`] (the
    /// sources only: the accumulator's were checked by the earlier
    /// passes), the element found before its block is written.
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
    ) -> Option<NonFinite> {
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
            Some(first) if stores == Stores::Streaming && store::can_stream(n * size) => {
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
                Some(head) => lowest(f(&t, 0, head, false), f(&t, head, n, true)),
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
mod tests;
