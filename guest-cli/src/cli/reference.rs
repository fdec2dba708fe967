//! An independent scalar reference of the device's semantics.
//!
//! Written from the spec, element by element, with no code shared with the
//! backend: reduce in rank order 0..N-1 in the accumulator type (f16 and
//! bf16 accumulate in f32 and round once), integers wrap, avg is the sum
//! divided by N (integers truncate toward zero), float min/max propagate NaN.
//! With members on several hosts ([`Case::per_host`]) the fold is the
//! two-level one of spec 5.X.6.5.4: per host in local rank order (each
//! partial rounded to the dtype), then the partials in host order.

use super::data::mask;
use half::{bf16, f16};
use virtio_dmlc::{Dtype, Opcode, ReduceOp};

macro_rules! fold_int {
    ($t:ty, $dtype:expr, $op:expr, $vals:expr) => {{
        let mut vals = $vals.map(|v| v as $t);
        let mut acc: $t = vals.next().expect("at least one rank");
        let mut n: i128 = 1;
        for x in vals {
            n += 1;
            acc = match $op {
                ReduceOp::Sum | ReduceOp::Avg => acc.wrapping_add(x),
                ReduceOp::Prod => acc.wrapping_mul(x),
                ReduceOp::Min => acc.min(x),
                ReduceOp::Max => acc.max(x),
                ReduceOp::Band => acc & x,
                ReduceOp::Bor => acc | x,
                ReduceOp::Bxor => acc ^ x,
            };
        }
        if $op == ReduceOp::Avg {
            // The quotient's magnitude is at most the sum's, so it fits.
            acc = (acc as i128 / n) as $t;
        }
        (acc as u64) & mask($dtype)
    }};
}

/// Reduces the values (raw bits, rank order) of one element position.
pub fn reduce(dtype: Dtype, op: ReduceOp, vals: impl Iterator<Item = u64>) -> u64 {
    match dtype {
        Dtype::F32 => fold_f32(op, vals.map(|v| f32::from_bits(v as u32))).to_bits() as u64,
        Dtype::F64 => fold_f64(op, vals.map(f64::from_bits)).to_bits(),
        Dtype::F16 => {
            let acc = fold_f32(op, vals.map(|v| f16::from_bits(v as u16).to_f32()));
            u64::from(f16::from_f32(acc).to_bits())
        }
        Dtype::Bf16 => {
            let acc = fold_f32(op, vals.map(|v| bf16::from_bits(v as u16).to_f32()));
            u64::from(bf16::from_f32(acc).to_bits())
        }
        Dtype::I8 => fold_int!(i8, dtype, op, vals),
        Dtype::U8 => fold_int!(u8, dtype, op, vals),
        Dtype::I32 => fold_int!(i32, dtype, op, vals),
        Dtype::U32 => fold_int!(u32, dtype, op, vals),
        Dtype::I64 => fold_int!(i64, dtype, op, vals),
        Dtype::U64 => fold_int!(u64, dtype, op, vals),
    }
}

macro_rules! fold_float {
    ($name:ident, $t:ty) => {
        fn $name(op: ReduceOp, mut vals: impl Iterator<Item = $t>) -> $t {
            let mut acc = vals.next().expect("at least one rank");
            let mut n: u32 = 1;
            for x in vals {
                n += 1;
                acc = match op {
                    ReduceOp::Sum | ReduceOp::Avg => acc + x,
                    ReduceOp::Prod => acc * x,
                    ReduceOp::Min | ReduceOp::Max if acc.is_nan() || x.is_nan() => <$t>::NAN,
                    ReduceOp::Min => {
                        if x < acc {
                            x
                        } else {
                            acc
                        }
                    }
                    ReduceOp::Max => {
                        if x > acc {
                            x
                        } else {
                            acc
                        }
                    }
                    ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor => {
                        unreachable!("bitwise op on a float")
                    }
                };
            }
            if op == ReduceOp::Avg {
                acc / n as $t
            } else {
                acc
            }
        }
    };
}
fold_float!(fold_f32, f32);
fold_float!(fold_f64, f64);

/// Reduces the values (raw bits, rank order) of one element position as a
/// group of hosts with `per_host` members each does (spec 5.X.6.5.4):
/// `p_h` = the flat fold of host `h`'s members (sum for avg), rounded to
/// the dtype; then a fold of `p_0 .. p_{H-1}` in the accumulator type, the
/// division by N for avg made once at its end, rounded once. Integer
/// results do not depend on the order, so they are the flat fold's.
pub fn reduce_hosts(dtype: Dtype, op: ReduceOp, per_host: usize, vals: &[u64]) -> u64 {
    let n = vals.len();
    if per_host == 0 || per_host >= n || !dtype.is_float() {
        return reduce(dtype, op, vals.iter().copied());
    }
    let inner = if op == ReduceOp::Avg {
        ReduceOp::Sum
    } else {
        op
    };
    let parts: Vec<u64> = vals
        .chunks(per_host)
        .map(|host| reduce(dtype, inner, host.iter().copied()))
        .collect();
    let avg = op == ReduceOp::Avg;
    let f32_of = |acc: f32| if avg { acc / n as f32 } else { acc };
    match dtype {
        Dtype::F32 => {
            let acc = fold_f32(inner, parts.iter().map(|&p| f32::from_bits(p as u32)));
            u64::from(f32_of(acc).to_bits())
        }
        Dtype::F64 => {
            let acc = fold_f64(inner, parts.iter().map(|&p| f64::from_bits(p)));
            let acc = if avg { acc / n as f64 } else { acc };
            acc.to_bits()
        }
        Dtype::F16 => {
            let acc = fold_f32(
                inner,
                parts.iter().map(|&p| f16::from_bits(p as u16).to_f32()),
            );
            u64::from(f16::from_f32(f32_of(acc)).to_bits())
        }
        Dtype::Bf16 => {
            let acc = fold_f32(
                inner,
                parts.iter().map(|&p| bf16::from_bits(p as u16).to_f32()),
            );
            u64::from(bf16::from_f32(f32_of(acc)).to_bits())
        }
        _ => unreachable!("integer dtypes fold flat"),
    }
}

/// What a member's output is the result of: a collective of spec
/// 5.X.6.3, or one of the two exchanges of feature bits 2 and 3 that the
/// bench times.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pattern {
    Collective(Opcode),
    /// Every member sends `count` elements to the next rank and receives
    /// as many from the previous one (nccl-tests' sendrecv).
    SendRecv,
    /// All-to-all of equal blocks of `count` elements.
    Alltoall,
}

impl Pattern {
    pub fn from_name(s: &str) -> Option<Pattern> {
        match s {
            "sendrecv" => Some(Pattern::SendRecv),
            "alltoall" => Some(Pattern::Alltoall),
            _ => Opcode::from_name(s).map(Pattern::Collective),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Pattern::Collective(o) => o.name(),
            Pattern::SendRecv => "sendrecv",
            Pattern::Alltoall => "alltoall",
        }
    }
}

impl std::fmt::Display for Pattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One member's view of a collective, enough to say what its output holds.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub pattern: Pattern,
    pub dtype: Dtype,
    pub op: ReduceOp,
    pub world: u32,
    pub rank: u32,
    pub root: u32,
    pub count: u64,
    pub in_place: bool,
    /// Members per host when the group spans hosts (ranks host-major): the
    /// reduction order is spec 5.X.6.5.4's. 0: one host, flat rank order.
    pub per_host: u32,
}

impl Case {
    /// The output elements that have a defined value after the collective,
    /// as a range of output indices. Elements outside it must be unchanged
    /// (they are the guard or, in place, the rest of the buffer).
    pub fn checked_range(&self) -> std::ops::Range<u64> {
        let n = u64::from(self.world);
        let opcode = match self.pattern {
            Pattern::Collective(o) => o,
            Pattern::SendRecv => return 0..self.count,
            Pattern::Alltoall => return 0..n * self.count,
        };
        match opcode {
            Opcode::Allreduce | Opcode::Broadcast => 0..self.count,
            Opcode::Reduce => 0..self.count,
            Opcode::Allgather => 0..n * self.count,
            Opcode::ReduceScatter if self.in_place => {
                let start = u64::from(self.rank) * self.count;
                start..start + self.count
            }
            Opcode::ReduceScatter => 0..self.count,
            Opcode::Barrier | Opcode::Nop => 0..0,
        }
    }

    /// Expected raw value of output element `j` (an index into this
    /// member's output buffer), given every member's input: `input(r, i)` is
    /// element `i` of member `r`'s input (its own indexing, whether or not it
    /// was supplied in place).
    pub fn expected(&self, j: u64, input: impl Fn(u32, u64) -> u64) -> u64 {
        let all = 0..self.world;
        let red = |i: u64| {
            let vals: Vec<u64> = all.clone().map(|r| input(r, i)).collect();
            reduce_hosts(self.dtype, self.op, self.per_host as usize, &vals)
        };
        let opcode = match self.pattern {
            Pattern::Collective(o) => o,
            Pattern::SendRecv => return input((self.rank + self.world - 1) % self.world, j),
            // Block s of the output is block `rank` of member s's input.
            Pattern::Alltoall => {
                let (s, k) = (j / self.count, j % self.count);
                return input(s as u32, u64::from(self.rank) * self.count + k);
            }
        };
        match opcode {
            Opcode::Allreduce => red(j),
            Opcode::Broadcast => input(self.root, j),
            Opcode::Reduce if self.rank == self.root => red(j),
            // A non-root in-place member's buffer is read, not written.
            Opcode::Reduce => input(self.rank, j),
            Opcode::Allgather => input((j / self.count) as u32, j % self.count),
            Opcode::ReduceScatter if self.in_place => red(j),
            Opcode::ReduceScatter => red(u64::from(self.rank) * self.count + j),
            Opcode::Barrier | Opcode::Nop => unreachable!("{opcode} has no output"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn red(dtype: Dtype, op: ReduceOp, v: &[u64]) -> u64 {
        reduce(dtype, op, v.iter().copied())
    }

    #[test]
    fn integers_wrap_and_avg_truncates() {
        assert_eq!(red(Dtype::U8, ReduceOp::Sum, &[200, 100]), 44);
        assert_eq!(red(Dtype::I8, ReduceOp::Prod, &[0x80, 0xff]), 0x80);
        // (-7 + 0) / 2 = -3 (toward zero), as an i8 bit pattern.
        assert_eq!(
            red(Dtype::I8, ReduceOp::Avg, &[(-7i8) as u8 as u64, 0]),
            0xfd
        );
        assert_eq!(
            red(Dtype::I32, ReduceOp::Min, &[0xffff_ffff, 1]),
            0xffff_ffff
        );
        assert_eq!(red(Dtype::U32, ReduceOp::Min, &[0xffff_ffff, 1]), 1);
        assert_eq!(red(Dtype::U64, ReduceOp::Bxor, &[6, 3, 1]), 4);
        assert_eq!(red(Dtype::I64, ReduceOp::Avg, &[u64::MAX, u64::MAX, 0]), 0);
    }

    #[test]
    fn floats_reduce_in_rank_order() {
        let v = [1e8f32, 1.0, -1e8];
        let bits: Vec<u64> = v.iter().map(|x| u64::from(x.to_bits())).collect();
        // (1e8 + 1) - 1e8 = 0 in f32, whereas 1e8 - 1e8 + 1 would be 1.
        assert_eq!(red(Dtype::F32, ReduceOp::Sum, &bits), 0);
        let avg = f32::from_bits(red(Dtype::F32, ReduceOp::Avg, &bits[..2]) as u32);
        assert_eq!(avg, (1e8f32 + 1.0) / 2.0);
    }

    #[test]
    fn half_accumulates_in_f32_and_rounds_once() {
        // 2048 + 1 + 1: in f16 each step would round back to 2048.
        let h = |x: f32| u64::from(f16::from_f32(x).to_bits());
        let got = red(Dtype::F16, ReduceOp::Sum, &[h(2048.0), h(1.0), h(1.0)]);
        assert_eq!(f16::from_bits(got as u16).to_f32(), 2050.0);
        let b = |x: f32| u64::from(bf16::from_f32(x).to_bits());
        let got = red(Dtype::Bf16, ReduceOp::Max, &[b(1.0), b(f32::NAN), b(3.0)]);
        assert!(bf16::from_bits(got as u16).is_nan());
    }

    #[test]
    fn several_hosts_fold_partials_in_host_order() {
        let f = |x: f32| u64::from(x.to_bits());
        // (1e8 + 1) + (-1e8 + 1) = 0 per hosts of 2 (1e8 + 1 rounds to
        // 1e8), whereas the flat fold ((1e8 + 1) - 1e8) + 1 = 1.
        let v = [f(1e8), f(1.0), f(-1e8), f(1.0)];
        assert_eq!(reduce_hosts(Dtype::F32, ReduceOp::Sum, 2, &v), f(0.0));
        assert_eq!(reduce_hosts(Dtype::F32, ReduceOp::Sum, 0, &v), f(1.0));
        assert_eq!(reduce_hosts(Dtype::F32, ReduceOp::Sum, 4, &v), f(1.0));
        // f16: host 0's partial 2048 + 1 is rounded to f16 (2048), then
        // the partials are summed in f32 and rounded once: 2048 + 1 -> 2048;
        // flat: 2048 + 1 + 1 = 2050. avg: 2049 / 4 = 512.25 -> 512 (ties
        // to even) against 2050 / 4 = 512.5.
        let h = |x: f32| u64::from(f16::from_f32(x).to_bits());
        let v = [h(2048.0), h(1.0), h(1.0), h(0.0)];
        let val = |op, per_host| {
            f16::from_bits(reduce_hosts(Dtype::F16, op, per_host, &v) as u16).to_f32()
        };
        assert_eq!(val(ReduceOp::Sum, 2), 2048.0);
        assert_eq!(val(ReduceOp::Sum, 0), 2050.0);
        assert_eq!(val(ReduceOp::Avg, 2), 512.0);
        assert_eq!(val(ReduceOp::Avg, 0), 512.5);
        // Integers: the same bits in any order.
        let i = [200, 100, 7, 9];
        assert_eq!(
            reduce_hosts(Dtype::U8, ReduceOp::Avg, 2, &i),
            reduce(Dtype::U8, ReduceOp::Avg, i.iter().copied())
        );
    }

    #[test]
    fn expected_layouts() {
        let c = Case {
            pattern: Pattern::Collective(Opcode::ReduceScatter),
            dtype: Dtype::U32,
            op: ReduceOp::Sum,
            world: 3,
            rank: 1,
            root: 0,
            count: 2,
            in_place: false,
            per_host: 0,
        };
        let input = |r: u32, i: u64| u64::from(r) * 100 + i;
        // Block 1 = elements 2 and 3: sum over ranks of (100 r + i).
        assert_eq!(c.expected(0, input), 300 + 6);
        assert_eq!(c.checked_range(), 0..2);
        let ip = Case {
            in_place: true,
            ..c
        };
        assert_eq!(ip.checked_range(), 2..4);
        assert_eq!(ip.expected(2, input), 300 + 6);
        let ag = Case {
            pattern: Pattern::Collective(Opcode::Allgather),
            ..c
        };
        assert_eq!(ag.expected(5, input), 201);
        // Rank 1 of 3 receives from rank 0.
        let sr = Case {
            pattern: Pattern::SendRecv,
            ..c
        };
        assert_eq!((sr.checked_range(), sr.expected(1, input)), (0..2, 1));
        // Output block 2 of rank 1 is block 1 (elements 2, 3) of rank 2.
        let a2a = Case {
            pattern: Pattern::Alltoall,
            ..c
        };
        assert_eq!(a2a.checked_range(), 0..6);
        assert_eq!(a2a.expected(5, input), 203);
    }
}
