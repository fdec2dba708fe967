//! The test oracle: a straightforward scalar reduction over host buffers,
//! written apart from the kernels (f64/i128 arithmetic, `half`
//! conversions, one element at a time, no chunks or groups) to check them
//! and every driver of them against.
//!
//! It follows docs/spec.md directly and is slow; it exists for tests (this
//! crate's, the backend's data-path tests, the communicators'). Outside
//! this crate's own tests it needs the `reference` feature. [`check`]
//! compares a result with the oracle's, any NaN matching any NaN (the
//! oracle does not model NaN payloads of sum, prod and avg); [`Rng`] makes
//! reproducible inputs.
use half::{bf16, f16};
use virtio_dmlc::{Dtype, ReduceOp};

fn fold_float<F>(
    op: ReduceOp,
    xs: &[F],
    world: u32,
    quiet: impl Fn(F) -> F,
    avg: impl Fn(F, u32) -> F,
) -> F
where
    F: Copy + PartialOrd + std::ops::Add<Output = F> + std::ops::Mul<Output = F>,
{
    #[allow(clippy::eq_op)]
    let is_nan = |v: F| v != v;
    let mut acc = quiet(xs[0]);
    for &x in &xs[1..] {
        acc = match op {
            ReduceOp::Sum | ReduceOp::Avg => acc + x,
            ReduceOp::Prod => acc * x,
            ReduceOp::Min | ReduceOp::Max if is_nan(acc) => acc,
            ReduceOp::Min | ReduceOp::Max if is_nan(x) => quiet(x),
            ReduceOp::Min if x < acc => x,
            ReduceOp::Max if x > acc => x,
            ReduceOp::Min | ReduceOp::Max => acc,
            _ => unreachable!("bitwise op on a float"),
        };
    }
    if op == ReduceOp::Avg {
        avg(acc, world)
    } else {
        acc
    }
}

fn fold_int(op: ReduceOp, xs: &[i128], world: u32, wrap: impl Fn(i128) -> i128) -> i128 {
    let v = match op {
        ReduceOp::Sum => xs.iter().sum(),
        ReduceOp::Prod => xs.iter().fold(1i128, |a, &x| a.wrapping_mul(x)),
        ReduceOp::Min => *xs.iter().min().unwrap(),
        ReduceOp::Max => *xs.iter().max().unwrap(),
        ReduceOp::Avg => wrap(xs.iter().sum()) / i128::from(world),
        ReduceOp::Band => xs.iter().fold(-1, |a, &x| a & x),
        ReduceOp::Bor => xs.iter().fold(0, |a, &x| a | x),
        ReduceOp::Bxor => xs.iter().fold(0, |a, &x| a ^ x),
    };
    wrap(v)
}

/// A NaN with its quiet bit set (written apart from the kernels').
fn quiet32(v: f32) -> f32 {
    if v.is_nan() {
        f32::from_bits(v.to_bits() | 0x0040_0000)
    } else {
        v
    }
}

fn quiet64(v: f64) -> f64 {
    if v.is_nan() {
        f64::from_bits(v.to_bits() | 0x0008_0000_0000_0000)
    } else {
        v
    }
}

/// Element `i` of every input.
fn column<const W: usize>(inputs: &[&[u8]], i: usize) -> Vec<[u8; W]> {
    inputs
        .iter()
        .map(|b| b[i * W..(i + 1) * W].try_into().unwrap())
        .collect()
}

/// Every (dtype, op) pair the spec defines.
pub fn pairs() -> impl Iterator<Item = (Dtype, ReduceOp)> {
    Dtype::ALL
        .iter()
        .flat_map(|&d| ReduceOp::ALL.iter().map(move |&o| (d, o)))
        .filter(|&(d, o)| o.supports(d))
}

/// Reduces `inputs` (one per rank, in rank order; same length, whole
/// elements of `dtype`, little-endian as spec 5.X.6.5.1 stores them) as
/// docs/spec.md says, avg dividing by `world`.
///
/// # Panics
/// If `inputs` is empty or a bitwise op is asked of a float dtype.
pub fn reduce(dtype: Dtype, op: ReduceOp, world: u32, inputs: &[&[u8]]) -> Vec<u8> {
    let len = inputs[0].len();
    let size = dtype.size();
    let mut out = Vec::with_capacity(len);
    for i in 0..len / size {
        macro_rules! int {
            ($t:ty, $w:literal) => {{
                let xs: Vec<i128> = column::<$w>(inputs, i)
                    .into_iter()
                    .map(|b| i128::from(<$t>::from_le_bytes(b)))
                    .collect();
                let v = fold_int(op, &xs, world, |v| i128::from(v as $t));
                out.extend_from_slice(&(v as $t).to_le_bytes());
            }};
        }
        match dtype {
            Dtype::F32 => {
                let xs: Vec<f32> = column::<4>(inputs, i)
                    .into_iter()
                    .map(f32::from_le_bytes)
                    .collect();
                let v = fold_float(op, &xs, world, quiet32, |s, w| s / w as f32);
                out.extend_from_slice(&v.to_le_bytes());
            }
            Dtype::F64 => {
                let xs: Vec<f64> = column::<8>(inputs, i)
                    .into_iter()
                    .map(f64::from_le_bytes)
                    .collect();
                let v = fold_float(op, &xs, world, quiet64, |s, w| s / f64::from(w));
                out.extend_from_slice(&v.to_le_bytes());
            }
            Dtype::F16 => {
                let xs: Vec<f32> = column::<2>(inputs, i)
                    .into_iter()
                    .map(|b| f16::from_le_bytes(b).to_f32())
                    .collect();
                let v = fold_float(op, &xs, world, quiet32, |s, w| s / w as f32);
                out.extend_from_slice(&f16::from_f32(v).to_le_bytes());
            }
            Dtype::Bf16 => {
                let xs: Vec<f32> = column::<2>(inputs, i)
                    .into_iter()
                    .map(|b| bf16::from_le_bytes(b).to_f32())
                    .collect();
                let v = fold_float(op, &xs, world, quiet32, |s, w| s / w as f32);
                out.extend_from_slice(&bf16::from_f32(v).to_le_bytes());
            }
            Dtype::I8 => int!(i8, 1),
            Dtype::U8 => int!(u8, 1),
            Dtype::I32 => int!(i32, 4),
            Dtype::U32 => int!(u32, 4),
            Dtype::I64 => int!(i64, 8),
            Dtype::U64 => int!(u64, 8),
        }
    }
    out
}

/// Checks that `got` equals `want` element by element, any NaN
/// matching any NaN; names the first difference.
///
/// # Panics
/// If the lengths differ.
pub fn check(dtype: Dtype, got: &[u8], want: &[u8]) -> Result<(), String> {
    assert_eq!(got.len(), want.len(), "result lengths differ");
    let size = dtype.size();
    for (i, (g, w)) in got.chunks(size).zip(want.chunks(size)).enumerate() {
        let nan = |b: &[u8]| match dtype {
            Dtype::F32 => f32::from_le_bytes(b.try_into().unwrap()).is_nan(),
            Dtype::F64 => f64::from_le_bytes(b.try_into().unwrap()).is_nan(),
            Dtype::F16 => f16::from_le_bytes(b.try_into().unwrap()).is_nan(),
            Dtype::Bf16 => bf16::from_le_bytes(b.try_into().unwrap()).is_nan(),
            _ => false,
        };
        let same = if nan(w) { nan(g) } else { g == w };
        if !same {
            return Err(format!("{dtype} element {i}: got {g:02x?}, want {w:02x?}"));
        }
    }
    Ok(())
}

/// A small deterministic generator (xorshift64*).
pub struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed` (any value).
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// `n` random finite elements of `dtype`: a mix of small values
    /// (which meet often in sums, products and ties) and arbitrary
    /// bit patterns.
    pub fn elems(&mut self, dtype: Dtype, n: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(n * dtype.size());
        for _ in 0..n {
            let bits = self.next_u64();
            let small = self.next_u64() % 3 == 1;
            let signed_small = (bits % 17) as i64 - 8;
            match dtype {
                Dtype::F32 => {
                    let mut v = f32::from_bits(bits as u32);
                    if small || !v.is_finite() {
                        v = signed_small as f32 * 0.375;
                    }
                    out.extend_from_slice(&v.to_le_bytes());
                }
                Dtype::F64 => {
                    let mut v = f64::from_bits(bits);
                    if small || !v.is_finite() {
                        v = signed_small as f64 * 0.375;
                    }
                    out.extend_from_slice(&v.to_le_bytes());
                }
                Dtype::F16 => {
                    let mut v = f16::from_bits(bits as u16);
                    if small || !v.is_finite() {
                        v = f16::from_f32(signed_small as f32 * 0.375);
                    }
                    out.extend_from_slice(&v.to_le_bytes());
                }
                Dtype::Bf16 => {
                    let mut v = bf16::from_bits(bits as u16);
                    if small || !v.is_finite() {
                        v = bf16::from_f32(signed_small as f32 * 0.375);
                    }
                    out.extend_from_slice(&v.to_le_bytes());
                }
                _ => {
                    let v = if small { signed_small as u64 } else { bits };
                    out.extend_from_slice(&v.to_le_bytes()[..dtype.size()]);
                }
            }
        }
        out
    }
}
