//! Deterministic test data and raw element access.
//!
//! Every rank must be able to compute every other rank's input locally, so
//! inputs are a pure function of (seed, case, rank, element index): a
//! counter-based generator (SplitMix64's finaliser over a keyed counter)
//! gives random access without any state.

use half::{bf16, f16};
use virtio_dmlc::{Dtype, ReduceOp};

/// SplitMix64's output function: a good 64-bit mixer.
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Combines words into one key (order matters).
pub fn key(parts: &[u64]) -> u64 {
    parts
        .iter()
        .fold(0x243f_6a88_85a3_08d3, |acc, &p| mix64(acc ^ p))
}

/// The generator of one rank's input for one case.
#[derive(Clone, Copy, Debug)]
pub struct Gen {
    pub dtype: Dtype,
    pub op: ReduceOp,
    /// Key of (seed, case); the rank is mixed in per call.
    pub key: u64,
    /// Number of ranks, to keep products and sums in range.
    pub world: u32,
    /// Inject NaNs into float min/max inputs (NaN must propagate).
    pub nans: bool,
}

impl Gen {
    /// Raw bits (in the low `dtype.size()` bytes) of element `i` of `rank`'s input.
    pub fn value(&self, rank: u32, i: u64) -> u64 {
        let r = mix64(self.key ^ mix64(u64::from(rank) ^ i.wrapping_mul(0xd6e8_feb8_6659_fd93)));
        if !self.dtype.is_float() {
            return r & mask(self.dtype);
        }
        if self.nans
            && matches!(self.op, ReduceOp::Min | ReduceOp::Max)
            && i % 97 == 3
            && u64::from(rank) == (i / 97) % u64::from(self.world.max(1))
        {
            return float_bits(self.dtype, f64::NAN);
        }
        float_bits(self.dtype, self.float(r))
    }

    /// A non-zero float whose magnitude suits the op and dtype (no overflow,
    /// no zeros whose sign min/max would have to choose between).
    fn float(&self, r: u64) -> f64 {
        let sign = if r & 1 == 0 { 1.0 } else { -1.0 };
        let frac = ((r >> 1) & 0xffff) as f64 / 65536.0; // [0, 1)
        let e = ((r >> 17) & 0xf) as i32 - 8; // [-8, 7]
        match self.op {
            // [0.5, 2): products of a few ranks stay far from overflow and
            // from subnormals.
            ReduceOp::Prod => sign * (0.5 + 1.5 * frac),
            _ => {
                // Mixed exponents make the sum depend on the order of
                // additions, so the rank order is really tested.
                let e = if matches!(self.dtype, Dtype::F16) {
                    e.clamp(-6, 6)
                } else {
                    e
                };
                sign * (1.0 + frac) * 2f64.powi(e) * 8.0
            }
        }
    }
}

/// Mask of the low `dtype.size()` bytes.
pub fn mask(dtype: Dtype) -> u64 {
    match dtype.size() {
        8 => u64::MAX,
        n => (1u64 << (8 * n)) - 1,
    }
}

/// Bits of `x` rounded to `dtype` (a float dtype); never a zero.
pub fn float_bits(dtype: Dtype, x: f64) -> u64 {
    let bits = match dtype {
        Dtype::F64 => x.to_bits(),
        Dtype::F32 => u64::from((x as f32).to_bits()),
        Dtype::F16 => u64::from(f16::from_f64(x).to_bits()),
        Dtype::Bf16 => u64::from(bf16::from_f64(x).to_bits()),
        _ => unreachable!("float_bits on an integer dtype"),
    };
    if is_zero(dtype, bits) {
        float_bits(dtype, 1.0)
    } else {
        bits
    }
}

fn is_zero(dtype: Dtype, bits: u64) -> bool {
    bits & (mask(dtype) >> 1) == 0
}

/// True if `bits` is a NaN of the float `dtype`.
pub fn is_nan(dtype: Dtype, bits: u64) -> bool {
    match dtype {
        Dtype::F64 => f64::from_bits(bits).is_nan(),
        Dtype::F32 => f32::from_bits(bits as u32).is_nan(),
        Dtype::F16 => f16::from_bits(bits as u16).is_nan(),
        Dtype::Bf16 => bf16::from_bits(bits as u16).is_nan(),
        _ => false,
    }
}

/// Bitwise equality, except that any two NaNs are equal (the payload of a
/// propagated NaN is not specified).
pub fn same(dtype: Dtype, a: u64, b: u64) -> bool {
    a == b || (is_nan(dtype, a) && is_nan(dtype, b))
}

/// Reads element `i` of a little-endian buffer of `size`-byte elements.
pub fn read(buf: &[u8], size: usize, i: usize) -> u64 {
    let mut w = [0u8; 8];
    w[..size].copy_from_slice(&buf[i * size..(i + 1) * size]);
    u64::from_le_bytes(w)
}

/// Writes element `i` of a little-endian buffer of `size`-byte elements.
pub fn write(buf: &mut [u8], size: usize, i: usize, v: u64) {
    buf[i * size..(i + 1) * size].copy_from_slice(&v.to_le_bytes()[..size]);
}

/// A streaming 64-bit digest of bytes, to compare a buffer with the value
/// it should hold without keeping a second copy. Each 8-byte word goes
/// through `h = (rotl(h, 5) ^ w) * K` (K odd), a bijection of `h` for a
/// given word and of the word for a given `h`: two inputs that differ in
/// exactly one word always get different digests. The result does not
/// depend on how the bytes are split between `write` calls.
#[derive(Clone, Debug)]
pub struct Digest {
    h: u64,
    len: u64,
    tail: [u8; 8],
    tail_len: usize,
}

impl Default for Digest {
    fn default() -> Self {
        Digest {
            h: 0x243f_6a88_85a3_08d3,
            len: 0,
            tail: [0; 8],
            tail_len: 0,
        }
    }
}

impl Digest {
    const K: u64 = 0x517c_c1b7_2722_0a95;

    fn word(&mut self, w: u64) {
        self.h = (self.h.rotate_left(5) ^ w).wrapping_mul(Self::K);
    }

    pub fn write(&mut self, mut bytes: &[u8]) {
        self.len += bytes.len() as u64;
        if self.tail_len > 0 {
            let take = (8 - self.tail_len).min(bytes.len());
            self.tail[self.tail_len..self.tail_len + take].copy_from_slice(&bytes[..take]);
            self.tail_len += take;
            bytes = &bytes[take..];
            if self.tail_len < 8 {
                return;
            }
            self.word(u64::from_le_bytes(self.tail));
            self.tail_len = 0;
        }
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            self.word(u64::from_le_bytes(w.try_into().unwrap_or_default()));
        }
        let rest = words.remainder();
        self.tail[..rest.len()].copy_from_slice(rest);
        self.tail_len = rest.len();
    }

    pub fn finish(mut self) -> u64 {
        if self.tail_len > 0 {
            let mut w = [0u8; 8];
            w[..self.tail_len].copy_from_slice(&self.tail[..self.tail_len]);
            self.word(u64::from_le_bytes(w));
        }
        mix64(self.h ^ self.len)
    }

    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> u64 {
        let mut d = Digest::default();
        d.write(bytes);
        d.finish()
    }
}

/// Human-readable value of `bits` for messages.
pub fn show(dtype: Dtype, bits: u64) -> String {
    match dtype {
        Dtype::F64 => format!("{:e} ({bits:#018x})", f64::from_bits(bits)),
        Dtype::F32 => format!("{:e} ({bits:#010x})", f32::from_bits(bits as u32)),
        Dtype::F16 => format!("{} ({bits:#06x})", f16::from_bits(bits as u16)),
        Dtype::Bf16 => format!("{} ({bits:#06x})", bf16::from_bits(bits as u16)),
        Dtype::I8 => format!("{}", bits as u8 as i8),
        Dtype::I32 => format!("{}", bits as u32 as i32),
        Dtype::I64 => format!("{}", bits as i64),
        Dtype::U8 | Dtype::U32 | Dtype::U64 => format!("{bits}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generator_is_deterministic_and_rank_dependent() {
        let g = Gen {
            dtype: Dtype::F32,
            op: ReduceOp::Sum,
            key: key(&[1, 2]),
            world: 2,
            nans: false,
        };
        assert_eq!(g.value(0, 5), g.value(0, 5));
        assert_ne!(g.value(0, 5), g.value(1, 5));
        assert!((0..1000).all(|i| !is_zero(Dtype::F32, g.value(0, i))));
    }

    #[test]
    fn nans_only_where_asked() {
        let mut g = Gen {
            dtype: Dtype::F16,
            op: ReduceOp::Max,
            key: 7,
            world: 3,
            nans: true,
        };
        assert!((0..400).any(|i| (0..3).any(|r| is_nan(Dtype::F16, g.value(r, i)))));
        g.nans = false;
        assert!((0..400).all(|i| !is_nan(Dtype::F16, g.value(0, i))));
    }

    #[test]
    fn digest_ignores_the_split_and_sees_one_changed_byte() {
        let bytes: Vec<u8> = (0..1000u32).map(|i| mix64(u64::from(i)) as u8).collect();
        let whole = Digest::of(&bytes);
        for split in [0, 1, 7, 8, 9, 500, 999, 1000] {
            let mut d = Digest::default();
            d.write(&bytes[..split]);
            d.write(&bytes[split..]);
            assert_eq!(d.finish(), whole, "split at {split}");
        }
        for i in [0, 3, 8, 517, 999] {
            let mut b = bytes.clone();
            b[i] ^= 0x10;
            assert_ne!(Digest::of(&b), whole, "byte {i}");
        }
        // The length counts: trailing zero bytes are not ignored.
        assert_ne!(Digest::of(&[1, 0]), Digest::of(&[1]));
    }

    #[test]
    fn element_round_trip() {
        let mut buf = vec![0u8; 16];
        write(&mut buf, 2, 3, 0xbeef);
        assert_eq!(read(&buf, 2, 3), 0xbeef);
        assert_eq!(buf[6..8], [0xef, 0xbe]);
        assert!(same(Dtype::F32, 0x7fc0_0000, 0x7fc0_0001));
        assert!(!same(Dtype::U32, 0x7fc0_0000, 0x7fc0_0001));
    }
}
