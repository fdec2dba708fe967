//! Unit tests for the reduction kernels in `kernel.rs`: half conversions, kernels against the reference, NaNs and bounds.

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
                    let inputs: Vec<Vec<u8>> = (0..world).map(|_| rng.elems(dtype, n)).collect();
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
                let mut inputs: Vec<Vec<u8>> = (0..world).map(|_| rng.elems(dtype, n)).collect();
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
            Dtype::F32 => (v as f32).to_le_bytes().to_vec(),
            Dtype::F64 => v.to_le_bytes().to_vec(),
            Dtype::F16 => f16::from_f64(v).to_le_bytes().to_vec(),
            Dtype::Bf16 => bf16::from_f64(v).to_le_bytes().to_vec(),
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
                        let what =
                            format!("{isa:?} {dtype} {op} N={world} lane {lane:x?}: got {got:#x}");
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
        assert_eq!(run_kernels(&k, &inputs, 2), 0.0f32.to_le_bytes(), "{isa:?}");
        let k = Kernel::with_isa(Dtype::F32, ReduceOp::Max, isa).unwrap();
        let inputs = [floats(Dtype::F32, &[-0.0]), floats(Dtype::F32, &[0.0])];
        assert_eq!(
            run_kernels(&k, &inputs, 2),
            (-0.0f32).to_le_bytes(),
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
            f16::from_f64(1.0 + 2.0 * tiny).to_le_bytes(),
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
            bf16::from_f64(1.0 + 2.0 * tiny).to_le_bytes(),
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
        assert_eq!(out, want.to_le_bytes(), "{isa:?}");
    }
}

#[test]
fn integer_avg_truncates_toward_zero() {
    for isa in Isa::available() {
        let k = Kernel::with_isa(Dtype::I32, ReduceOp::Avg, isa).unwrap();
        let input = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
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
            let m =
                (rng.next_u64() % (u64::from(u32::MAX) / u64::from(w) + 1)) as i64 * i64::from(w);
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

/// Bits of every kind of non-finite value of a float dtype: NaNs
/// (signalling, of either sign, quiet), +Inf and -Inf.
fn non_finite(dtype: Dtype) -> Vec<u64> {
    let (nans, _) = nans(dtype);
    let infs: [u64; 2] = match dtype {
        Dtype::F32 => [0x7f80_0000, 0xff80_0000],
        Dtype::F64 => [0x7ff0_0000_0000_0000, 0xfff0_0000_0000_0000],
        Dtype::F16 => [0x7c00, 0xfc00],
        Dtype::Bf16 => [0x7f80, 0xff80],
        _ => unreachable!(),
    };
    nans.iter().chain(&infs).copied().collect()
}

/// Reduces `inputs` with `k` as the data path does (`run_through`, the
/// sources at an odd address) into one output, or in place into the last
/// input, and returns the output and the lowest non-finite input the
/// passes reported, as (input, element).
fn run_checked(
    k: &Kernel,
    inputs: &[Vec<u8>],
    stores: Stores,
    in_place: bool,
) -> (Vec<u8>, Option<NonFinite>) {
    let size = k.elem_size();
    let n = inputs[0].len() / size;
    let mut shifted: Vec<Vec<u8>> = inputs
        .iter()
        .map(|b| {
            let mut v = vec![0x5a];
            v.extend_from_slice(b);
            v
        })
        .collect();
    let mut out = vec![0u8; n * size];
    let srcs: Vec<*const u8> = shifted.iter().map(|b| b[1..].as_ptr()).collect();
    let dst = if in_place {
        shifted.last_mut().unwrap()[1..].as_mut_ptr()
    } else {
        out.as_mut_ptr()
    };
    let groups: Vec<usize> = groups(srcs.len()).collect();
    let (before, last) = groups.split_at(groups.len() - 1);
    let mut scratch = Scratch::with_bytes(n.max(1) * k.acc_size());
    let mut found = None;
    let mut next = 0;
    for (g, &len) in before.iter().enumerate() {
        let group = &srcs[next..next + len];
        // SAFETY: live buffers of `n` elements each.
        let f = unsafe {
            if g == 0 {
                k.first(&mut scratch, 0, group, n)
            } else {
                k.fold(&mut scratch, 0, group, n)
            }
        };
        found = lowest(found, f.map(|(s, i)| (s + next, i)));
        next += len;
    }
    let acc = (next > 0).then_some((&mut scratch, 0));
    // SAFETY: as above; `dst` is `out` or the last input, `n` elements.
    let f = unsafe { k.through(acc, &srcs[next..], &[dst], n, inputs.len() as u32, stores) };
    crate::fence();
    found = lowest(found, f.map(|(s, i)| (s + next, i)));
    assert_eq!(next + last[0], inputs.len());
    if in_place {
        out.copy_from_slice(&shifted.last().unwrap()[1..]);
    }
    (out, found)
}

/// The checked kernels of every float dtype and ISA, for worlds that use
/// every kind of pass, name the lowest rank with a non-finite input and
/// the lowest such element in it, whatever the kind (NaN of any sign or
/// payload, +Inf, -Inf), the stores and in place; finite inputs whose
/// reduction overflows are not flagged; the output is the unchecked
/// kernels' (bit for bit but for the unspecified payloads of NaN sums);
/// integer kernels ignore the check.
#[test]
fn checked_kernels_name_the_lowest_rank_and_element() {
    let mut rng = Rng::new(39);
    for isa in Isa::available() {
        for dtype in [Dtype::F32, Dtype::F64, Dtype::F16, Dtype::Bf16] {
            let bad = non_finite(dtype);
            let size = dtype.size();
            for op in [ReduceOp::Sum, ReduceOp::Max] {
                let plain = Kernel::with_isa(dtype, op, isa).unwrap();
                let k = Kernel::with_check(dtype, op, isa, true).unwrap();
                for world in [1usize, 2, 3, 5, 9] {
                    for n in [1usize, 40, 300, 2000] {
                        for trial in 0..4 {
                            let mut inputs: Vec<Vec<u8>> =
                                (0..world).map(|_| rng.elems(dtype, n)).collect();
                            let mut want: Option<NonFinite> = None;
                            for _ in 0..trial {
                                let (r, i) = (rng.below(world), rng.below(n));
                                let b = bad[rng.below(bad.len())];
                                inputs[r][i * size..(i + 1) * size].copy_from_slice(&raw(dtype, b));
                                want = lowest(want, Some((r, i)));
                            }
                            for stores in [Stores::Cached, Stores::Streaming] {
                                for in_place in [false, true] {
                                    let (got_out, got) = run_checked(&k, &inputs, stores, in_place);
                                    let (plain_out, none) =
                                        run_checked(&plain, &inputs, stores, in_place);
                                    let what = format!(
                                        "{isa:?} {dtype} {op} N={world} n={n} {stores:?} \
                                         in place {in_place}"
                                    );
                                    assert_eq!(got, want, "{what}");
                                    assert_eq!(none, None, "{what}: unchecked");
                                    // NaN payloads of sum are not specified.
                                    if let Err(e) = reference::check(dtype, &got_out, &plain_out) {
                                        panic!("{what}: output: {e}");
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        // Finite inputs whose sum overflows are finite inputs.
        let k = Kernel::with_check(Dtype::F16, ReduceOp::Sum, isa, true).unwrap();
        let big = raw(Dtype::F16, 0x7bff).repeat(8);
        let (out, found) = run_checked(&k, &[big.clone(), big], Stores::Cached, false);
        assert_eq!(found, None);
        assert_eq!(&out[..2], &raw(Dtype::F16, 0x7c00)[..]);
        // Integers have no non-finite value: the check changes nothing.
        let k = Kernel::with_check(Dtype::I32, ReduceOp::Sum, isa, true).unwrap();
        let ones = raw(Dtype::I32, 0x7f80_0000).repeat(4);
        assert_eq!(
            run_checked(&k, &[ones.clone(), ones], Stores::Cached, false).1,
            None
        );
    }
}

/// Finite values next to the non-finite ones, as bits: +0, -0, the least
/// and the greatest subnormal, the least normal, the greatest finite of
/// either sign. `x - x` is +0 for all of them, which the checked kernels
/// rely on.
fn edge_finite(dtype: Dtype) -> Vec<u64> {
    match dtype {
        Dtype::F32 => vec![
            0,
            1 << 31,
            1,
            0x7f_ffff,
            0x80_0000,
            0x7f7f_ffff,
            0xff7f_ffff,
        ],
        Dtype::F64 => vec![
            0,
            1 << 63,
            1,
            0x000f_ffff_ffff_ffff,
            0x0010_0000_0000_0000,
            0x7fef_ffff_ffff_ffff,
            0xffef_ffff_ffff_ffff,
        ],
        Dtype::F16 => vec![0, 1 << 15, 1, 0x03ff, 0x0400, 0x7bff, 0xfbff],
        Dtype::Bf16 => vec![0, 1 << 15, 1, 0x007f, 0x0080, 0x7f7f, 0xff7f],
        _ => unreachable!(),
    }
}

/// `world` inputs of `n` elements of only [`edge_finite`] values, then
/// copies of them with one non-finite element first, last, or at the last
/// or first element of a block (32 elements with ordinary stores, 128
/// streaming), in the first or the last rank, plus one in the next rank at
/// element 0; each with the (rank, element) a checked reduction names.
fn edge_cases(dtype: Dtype, world: usize, n: usize) -> Vec<(Option<NonFinite>, Vec<Vec<u8>>)> {
    let (edge, bad) = (edge_finite(dtype), non_finite(dtype));
    let size = dtype.size();
    let elem = |r: usize, i: usize| raw(dtype, edge[(r + i) % edge.len()]);
    let inputs: Vec<Vec<u8>> = (0..world)
        .map(|r| (0..n).flat_map(|i| elem(r, i)).collect())
        .collect();
    let mut cases = vec![(None, inputs.clone())];
    let ats = [0, n - 1, 31, 32, 127, 128]
        .into_iter()
        .filter(|&at| at < n);
    for (c, at) in ats.enumerate() {
        for r in [0, world - 1] {
            let mut inputs = inputs.clone();
            let b = raw(dtype, bad[(c + r) % bad.len()]);
            inputs[r][at * size..(at + 1) * size].copy_from_slice(&b);
            // A later rank's lower element does not win.
            if r + 1 < world {
                inputs[r + 1][..size].copy_from_slice(&b);
            }
            cases.push((Some((r, at)), inputs));
        }
    }
    cases
}

/// The checked kernels of every float dtype and ISA on [`edge_cases`]:
/// zeros of either sign, subnormals and the greatest finite values (whose
/// sums overflow) are not flagged; a non-finite element at the edges of
/// the vector loops and of the blocks is named; the output is the
/// unchecked kernels'.
#[test]
fn checked_kernels_find_non_finite_elements_at_block_edges_and_nothing_else() {
    for isa in Isa::available() {
        for dtype in [Dtype::F32, Dtype::F64, Dtype::F16, Dtype::Bf16] {
            for op in [ReduceOp::Sum, ReduceOp::Max] {
                let plain = Kernel::with_isa(dtype, op, isa).unwrap();
                let k = Kernel::with_check(dtype, op, isa, true).unwrap();
                for (world, n) in [1usize, 2, 4, 5]
                    .into_iter()
                    .flat_map(|w| [1usize, 8, 31, 33, 129, 300].map(|n| (w, n)))
                {
                    for (want, inputs) in edge_cases(dtype, world, n) {
                        for (stores, in_place) in [
                            (Stores::Cached, false),
                            (Stores::Cached, true),
                            (Stores::Streaming, false),
                            (Stores::Streaming, true),
                        ] {
                            let what = format!(
                                "{isa:?} {dtype} {op} N={world} n={n} {want:?} {stores:?} \
                                 in place {in_place}"
                            );
                            let (out, got) = run_checked(&k, &inputs, stores, in_place);
                            assert_eq!(got, want, "{what}");
                            let (plain_out, _) = run_checked(&plain, &inputs, stores, in_place);
                            if let Err(e) = reference::check(dtype, &out, &plain_out) {
                                panic!("{what}: output: {e}");
                            }
                        }
                    }
                }
            }
        }
    }
}
