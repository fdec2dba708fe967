//! Writing results out: ordinary stores, or non-temporal (streaming)
//! stores that write whole cache lines without reading them first.
//!
//! An ordinary store to a line that is not in cache first reads the line
//! from memory (read for ownership), so writing S bytes that way moves 2·S
//! bytes. A streaming store fills a write-combining buffer and writes the
//! line out whole: S bytes moved for S written, and the line is not left
//! in cache. That pays when the output does not fit in cache anyway, and
//! costs when the next reader would have found it there; [`STREAM_FROM`]
//! is where the reduction micro-benchmark found the change to pay on the
//! machine it was measured on (docs/benchmarks-journal.md).
//!
//! Streaming stores are weakly ordered: another thread may see them after
//! later ordinary stores of the writer. A thread that wrote with
//! [`Stores::Streaming`] calls [`fence`] before it publishes the result
//! (a completion, an atomic that another thread acquires, a syscall).

use std::ptr;

use crate::kernel::{Isa, CHUNK_BYTES};

/// How results are written to their destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stores {
    /// Ordinary stores: the lines are read first and stay in cache.
    Cached,
    /// Non-temporal stores for every whole, aligned cache line of the
    /// destination; ordinary stores for a ragged head and tail. The
    /// writer must call [`fence`] before publishing the result. On a CPU
    /// without them (anything but x86-64), ordinary stores.
    Streaming,
}

/// Output bytes of one collective (all of its outputs together) from which
/// results are written with [`Stores::Streaming`]. In the reduction
/// micro-benchmark, from memory streaming stores were faster at every
/// size; on buffers that stay cached (an 8 MiB pool) ordinary ones were 4
/// to 6% faster, in a 16 MiB pool streaming ones 9 to 21% faster, which
/// first put the threshold at 2 MiB. End to end (`bench/backend-ab.sh`,
/// docs/benchmarks-journal.md "Streaming stores from 8 MiB"), where each member
/// has just written its output (as a program has a gradient bucket), 2
/// ranks at 1 and 2 MiB were 1.4x to 1.6x faster with ordinary stores
/// and 4 MiB and up the same, which moved it to 8 MiB. Once the last pass
/// wrote the outputs itself (`Kernel::through`) and prefetched its inputs,
/// the same A/B (docs/benchmarks-journal.md "Streaming stores from 2 MiB again")
/// found streaming from 2 MiB of output as fast at 1 MiB per rank and
/// faster at 2 MiB per rank, so it starts at 2 MiB again.
pub const STREAM_FROM: usize = 2 << 20;

/// Accumulator bytes of one chunk with [`Stores::Streaming`]. Larger than
/// [`CHUNK_BYTES`]: a chunk's reads and its output writes alternate, and
/// from memory longer runs of each were faster in the micro-benchmark
/// (docs/bench/reduce-stream-chunks.txt: 32 KiB 6 to 9% faster than 8 KiB,
/// 64 KiB within 6% of 32 KiB), while 32 KiB still fits in L1 on the
/// machine measured (48 KiB).
pub const STREAM_CHUNK_BYTES: usize = 32 << 10;

impl Stores {
    /// The accumulator bytes of one chunk for these stores:
    /// [`CHUNK_BYTES`], or [`STREAM_CHUNK_BYTES`] when streaming.
    pub fn chunk_bytes(self) -> usize {
        match self {
            Stores::Cached => CHUNK_BYTES,
            Stores::Streaming => STREAM_CHUNK_BYTES,
        }
    }

    /// The stores for a collective (or a reduction) that writes `bytes`
    /// bytes of output in all: [`Stores::Streaming`] from
    /// [`STREAM_FROM`] on.
    pub fn for_output(bytes: usize) -> Stores {
        if bytes >= STREAM_FROM {
            Stores::Streaming
        } else {
            Stores::Cached
        }
    }
}

/// Orders this thread's streaming stores before its later stores: once it
/// returns, every byte written with [`Stores::Streaming`] is visible to
/// any thread that sees a later store (such as a used ring index, or an
/// atomic released after it). Cheap when nothing is pending.
#[inline]
pub fn fence() {
    // SAFETY: SSE, which has `sfence`, is part of x86-64's baseline.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
    // Without streaming stores, the release fence of whatever publishes
    // the result orders them; this only keeps the compiler from moving
    // stores past the call.
    #[cfg(not(target_arch = "x86_64"))]
    std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::Release);
}

/// A copy of `n` bytes from a source of ours to every destination:
/// `(dsts, src, n)`.
pub(crate) type CopyFn = unsafe fn(&[*mut u8], *const u8, usize);

/// The streaming copy of `isa`.
pub(crate) fn stream_fn(isa: Isa) -> CopyFn {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => stream_avx,
        #[cfg(target_arch = "x86_64")]
        Isa::Baseline => stream_sse2,
        #[cfg(not(target_arch = "x86_64"))]
        _ => plain_copy,
    }
}

/// Below this many bytes a copy has at most one whole line: ordinary
/// stores only. (Without streaming stores, not x86-64, only the tests'
/// lengths use it.)
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) const STREAM_MIN: usize = 128;

/// True if a copy of `n` bytes may use streaming stores: at least
/// [`STREAM_MIN`], on a CPU that has them.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn can_stream(n: usize) -> bool {
    n >= STREAM_MIN
}
/// Without streaming stores: never.
#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
pub(crate) fn can_stream(_n: usize) -> bool {
    false
}

/// A streaming copy of at least `WAYS` pages' worth of lines writes `WAYS`
/// stretches of it in turn, a line of each, as glibc's large copy and the
/// memcpy probe (bench/memcpy_bw.c -m nt) do with pages: on the machine of
/// docs/benchmarks-journal.md that made the probe's copy faster than one stretch
/// after another.
#[cfg(target_arch = "x86_64")]
const WAYS: usize = 4;

/// Copies with ordinary stores.
///
/// # Safety
/// `src` is valid for reads and every destination for writes of `n`
/// bytes; no destination overlaps `src` (they may overlap each other).
#[cfg_attr(target_arch = "x86_64", allow(dead_code))]
unsafe fn plain_copy(dsts: &[*mut u8], src: *const u8, n: usize) {
    for &dst in dsts {
        // SAFETY: the caller's promise.
        unsafe { ptr::copy_nonoverlapping(src, dst, n) }
    }
}

/// Splits a copy to `dst` of `n` bytes into a head up to `dst`'s first
/// 64-byte boundary, a number of whole lines, and a tail: (head, lines).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn lines_of(dst: *mut u8, n: usize) -> (usize, usize) {
    let head = (64 - dst.addr() % 64) % 64;
    if n < STREAM_MIN {
        return (n, 0);
    }
    (head, (n - head) / 64)
}

/// The body of the streaming copies: the heads and tails with ordinary
/// stores, every whole line of the destinations through `line(dst, src)`.
/// Destinations at the same offset in a line are written together, a line
/// of each in turn (several pages at a time, which the memcpy probe found
/// faster than one after another); others one after another.
///
/// # Safety
/// As for [`plain_copy`]; `line` writes the 64 bytes at its (64-aligned)
/// first argument from the 64 at its second.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn stream_with(
    dsts: &[*mut u8],
    src: *const u8,
    n: usize,
    line: impl Fn(*mut u8, *const u8),
) {
    let Some(first) = dsts.first() else {
        return;
    };
    let offset = first.addr() % 64;
    if dsts.iter().all(|d| d.addr() % 64 == offset) {
        // SAFETY: the caller's promise; every destination has `offset`.
        unsafe { stream_together(dsts, src, n, &line) }
    } else {
        for dst in dsts {
            // SAFETY: as above, one destination at a time.
            unsafe { stream_together(std::slice::from_ref(dst), src, n, &line) }
        }
    }
}

/// [`stream_with`] for destinations that all have the same offset in a
/// line.
///
/// # Safety
/// As for [`stream_with`].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn stream_together(
    dsts: &[*mut u8],
    src: *const u8,
    n: usize,
    line: &impl Fn(*mut u8, *const u8),
) {
    let (head, lines) = lines_of(dsts[0], n);
    for &dst in dsts {
        // SAFETY: `head <= n`: the first bytes of source and destination.
        unsafe { ptr::copy_nonoverlapping(src, dst, head) };
    }
    // Lines `l`, `l + part`, `l + 2·part`, .. in turn, then the rest.
    let ways = if lines >= WAYS * 64 { WAYS } else { 1 };
    let part = lines / ways;
    let write = |l: usize| {
        let at = head + 64 * l;
        for &dst in dsts {
            // In bounds: `l < lines` and `head + 64 * lines <= n`; `dst + at`
            // is 64-aligned, as `dsts[0] + head` is and all share its
            // offset in a line.
            line(dst.wrapping_add(at), src.wrapping_add(at));
        }
    };
    for l in 0..part {
        for w in 0..ways {
            write(w * part + l);
        }
    }
    for l in ways * part..lines {
        write(l);
    }
    let done = head + 64 * lines;
    for &dst in dsts {
        // SAFETY: bytes `done..n` of source and destination.
        unsafe { ptr::copy_nonoverlapping(src.add(done), dst.add(done), n - done) };
    }
}

/// How a kernel writes `n` bytes from a buffer of ours to a 64-aligned
/// destination with streaming stores: every whole line streamed, the rest
/// with ordinary stores. One implementation per ISA, so that the kernels
/// of that ISA inline it.
pub(crate) trait StreamLines {
    /// # Safety
    /// `src` is valid for reads and `dst` for writes of `n` bytes; they do
    /// not overlap; `dst` is 64-aligned; the CPU has the ISA.
    unsafe fn stream_lines(dst: *mut u8, src: *const u8, n: usize);
}

/// 16-byte streaming stores (SSE2, x86-64's baseline); elsewhere an
/// ordinary copy.
pub(crate) struct Sse2Lines;

impl StreamLines for Sse2Lines {
    #[inline(always)]
    unsafe fn stream_lines(dst: *mut u8, src: *const u8, n: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
            let whole = n / 64 * 64;
            for at in (0..whole).step_by(16) {
                // SAFETY: 16 bytes at `at < whole <= n` of each; `dst + at`
                // is 16-aligned; the load is unaligned.
                unsafe {
                    let v = _mm_loadu_si128(src.add(at).cast::<__m128i>());
                    _mm_stream_si128(dst.add(at).cast::<__m128i>(), v);
                }
            }
            // SAFETY: the bytes `whole..n` of each.
            unsafe { ptr::copy_nonoverlapping(src.add(whole), dst.add(whole), n - whole) };
        }
        #[cfg(not(target_arch = "x86_64"))]
        // SAFETY: the caller's promise.
        unsafe {
            ptr::copy_nonoverlapping(src, dst, n)
        };
    }
}

/// 32-byte streaming stores (AVX), for the AVX2 kernels (3 to 5% faster
/// than 16-byte ones from memory in micro-benchmark runs that were not
/// kept).
#[cfg(target_arch = "x86_64")]
pub(crate) struct AvxLines;

#[cfg(target_arch = "x86_64")]
impl StreamLines for AvxLines {
    #[inline(always)]
    unsafe fn stream_lines(dst: *mut u8, src: *const u8, n: usize) {
        use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256};
        let whole = n / 64 * 64;
        for at in (0..whole).step_by(32) {
            // SAFETY: 32 bytes at `at < whole <= n` of each; `dst + at` is
            // 32-aligned; the load is unaligned; the CPU has AVX (the
            // caller's promise, inlined into an AVX2 kernel).
            unsafe {
                let v = _mm256_loadu_si256(src.add(at).cast::<__m256i>());
                _mm256_stream_si256(dst.add(at).cast::<__m256i>(), v);
            }
        }
        // SAFETY: the bytes `whole..n` of each.
        unsafe { ptr::copy_nonoverlapping(src.add(whole), dst.add(whole), n - whole) };
    }
}

/// Streaming copy with SSE2 (x86-64's baseline): four 16-byte
/// non-temporal stores a line.
///
/// # Safety
/// As for [`plain_copy`].
#[cfg(target_arch = "x86_64")]
unsafe fn stream_sse2(dsts: &[*mut u8], src: *const u8, n: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    let line = |d: *mut u8, s: *const u8| {
        for k in 0..4 {
            // SAFETY: 16 bytes at offset 16·k of the 64 bytes `stream_with`
            // hands over (16-aligned in `d`); the load is unaligned.
            unsafe {
                let v = _mm_loadu_si128(s.add(16 * k).cast::<__m128i>());
                _mm_stream_si128(d.add(16 * k).cast::<__m128i>(), v);
            }
        }
    };
    // SAFETY: the caller's promise; `stream_with` hands `line` 64 bytes of
    // each buffer, the destination's 64-aligned.
    unsafe { stream_with(dsts, src, n, line) }
}

/// Streaming copy with AVX: two 32-byte non-temporal stores a line.
///
/// # Safety
/// As for [`plain_copy`]; the CPU has AVX (`Isa::Avx2`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn stream_avx(dsts: &[*mut u8], src: *const u8, n: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256};
    let line = |d: *mut u8, s: *const u8| {
        for k in 0..2 {
            // SAFETY: 32 bytes at offset 32·k of the 64 (32-aligned in
            // `d`); the load is unaligned; the closure inherits this
            // function's AVX.
            unsafe {
                let v = _mm256_loadu_si256(s.add(32 * k).cast::<__m256i>());
                _mm256_stream_si256(d.add(32 * k).cast::<__m256i>(), v);
            }
        }
    };
    // SAFETY: as in `stream_sse2`.
    unsafe { stream_with(dsts, src, n, line) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Several destinations at once, at the same offset in a line (written
    /// together) and at different ones (one after another), for every ISA:
    /// each gets exactly its bytes.
    #[test]
    fn streaming_copies_to_several_destinations_write_each_exactly() {
        let src: Vec<u8> = (0..17_000u32).map(|i| (i * 13 + 1) as u8).collect();
        for isa in Isa::available() {
            let copy = stream_fn(isa);
            for offsets in [[0, 0, 0], [8, 8, 8], [4, 4, 36], [1, 2, 3]] {
                for n in [0, 100, 127, 128, 4096 + 33, 16_593] {
                    let mut buf = vec![0u64; 3 * 32768 / 8 + 64];
                    let base = buf.as_mut_ptr().cast::<u8>();
                    let align = (64 - base.addr() % 64) % 64;
                    let starts: Vec<usize> =
                        (0..3).map(|k| align + k * 32768 + offsets[k]).collect();
                    let dsts: Vec<*mut u8> = starts.iter().map(|&s| base.wrapping_add(s)).collect();
                    // SAFETY: each destination lies in its own 32 KiB of
                    // `buf` (`n` + 63 bytes at most); `src` is a separate
                    // Vec.
                    unsafe { copy(&dsts, src.as_ptr(), n) };
                    fence();
                    let bytes: Vec<u8> = buf.iter().flat_map(|w| w.to_ne_bytes()).collect();
                    let mut want = vec![0u8; bytes.len()];
                    for &s in &starts {
                        want[s..s + n].copy_from_slice(&src[..n]);
                    }
                    assert!(bytes == want, "{isa:?} offsets {offsets:?} n {n}");
                }
            }
        }
    }

    #[test]
    fn the_threshold_picks_streaming_from_its_value_on() {
        assert_eq!(Stores::for_output(0), Stores::Cached);
        assert_eq!(Stores::for_output(STREAM_FROM - 1), Stores::Cached);
        assert_eq!(Stores::for_output(STREAM_FROM), Stores::Streaming);
        assert_eq!(Stores::for_output(usize::MAX), Stores::Streaming);
    }

    /// Every ISA's streaming copy, every destination alignment in a line,
    /// lengths around `STREAM_MIN` and a few lines: the bytes arrive, and
    /// nothing either side of the destination is written.
    #[test]
    fn streaming_copies_write_exactly_their_bytes_at_every_alignment() {
        let src: Vec<u8> = (0..17_000u32).map(|i| (i * 7 + 3) as u8).collect();
        for isa in Isa::available() {
            let copy = stream_fn(isa);
            for skew in 0..64 {
                // Up to four pages and a few lines (written in four
                // stretches, then the rest).
                for n in [
                    0, 1, 63, 64, 65, 127, 128, 129, 191, 192, 1000, 16_383, 16_593,
                ] {
                    // A line-aligned buffer with room either side.
                    let mut buf = vec![0u64; (n + 256) / 8 + 1];
                    let base = buf.as_mut_ptr().cast::<u8>();
                    let lead = (64 - base.addr() % 64) % 64 + skew;
                    let src = &src[skew..skew + n];
                    // SAFETY: `lead + n` plus a canary byte fits `buf`;
                    // `src` is a separate Vec.
                    unsafe { copy(&[base.add(lead)], src.as_ptr(), n) };
                    fence();
                    let bytes: Vec<u8> = buf.iter().flat_map(|w| w.to_ne_bytes()).collect();
                    let what = format!("{isa:?} skew {skew} n {n}");
                    assert_eq!(&bytes[lead..lead + n], src, "{what}");
                    assert!(bytes[..lead].iter().all(|&b| b == 0), "{what}: before");
                    assert!(bytes[lead + n..].iter().all(|&b| b == 0), "{what}: after");
                }
            }
        }
    }
}
