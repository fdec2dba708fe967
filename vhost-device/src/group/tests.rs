//! Engine tests: collectives against a reference model, in-place buffers,
//! arrival order, mismatch, member loss, timeouts and split reductions.

use std::sync::Arc;
use std::time::{Duration, Instant};

use virtio_dmlc::{
    bad, buffer_elems, mismatch, Dtype, Opcode, ReduceOp, Status, VirtioDmlcReq, VirtioDmlcResp,
    FLAG_IN_PLACE, NO_PEER, RESP_SIZE,
};

use vm_memory::{Bytes, GuestAddress};
use zerocopy::{FromBytes, IntoBytes};

use super::harness::{config, hdr, Desc, Pending, Rng, World};
use super::Group;
use crate::GuestMem;

const REDUCING: [Opcode; 3] = [Opcode::Allreduce, Opcode::Reduce, Opcode::ReduceScatter];
const COPYING: [Opcode; 2] = [Opcode::Broadcast, Opcode::Allgather];

fn reduces(op: Opcode) -> bool {
    REDUCING.contains(&op)
}

fn has_root(op: Opcode) -> bool {
    matches!(op, Opcode::Broadcast | Opcode::Reduce)
}

/// `count` elements: random bits for integers, non-zero multiples of 1/4
/// up to 16 in magnitude for floats (exact in every float type).
fn gen(rng: &mut Rng, dtype: Dtype, count: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(count * dtype.size());
    for _ in 0..count {
        let r = rng.next();
        let v = ((r % 64) + 1) as f32 / 4.0 * if r & 0x100 != 0 { -1.0 } else { 1.0 };
        match dtype {
            Dtype::F32 => out.extend(v.to_le_bytes()),
            Dtype::F64 => out.extend(f64::from(v).to_le_bytes()),
            Dtype::F16 => out.extend(half::f16::from_f32(v).to_le_bytes()),
            Dtype::Bf16 => out.extend(half::bf16::from_f32(v).to_le_bytes()),
            _ => out.extend(&r.to_le_bytes()[..dtype.size()]),
        }
    }
    out
}

/// f32 values with spread-out exponents, so that the order of a sum shows.
fn gen_wide_f32(rng: &mut Rng, count: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(count * 4);
    for _ in 0..count {
        let r = rng.next();
        let bits = (r as u32 & 0x807f_ffff) | ((110 + (r >> 40) as u32 % 30) << 23);
        out.extend(f32::from_bits(bits).to_le_bytes());
    }
    out
}

macro_rules! int_fold {
    ($t:ty, $ins:expr, $op:expr, $n:expr) => {{
        const S: usize = std::mem::size_of::<$t>();
        let get =
            |b: &[u8], e: usize| <$t>::from_le_bytes(b[e * S..(e + 1) * S].try_into().unwrap());
        let mut out = Vec::new();
        for e in 0..$ins[0].len() / S {
            let mut acc = get($ins[0], e);
            for inp in &$ins[1..] {
                let v = get(inp, e);
                acc = match $op {
                    ReduceOp::Sum | ReduceOp::Avg => acc.wrapping_add(v),
                    ReduceOp::Prod => acc.wrapping_mul(v),
                    ReduceOp::Min => acc.min(v),
                    ReduceOp::Max => acc.max(v),
                    ReduceOp::Band => acc & v,
                    ReduceOp::Bor => acc | v,
                    ReduceOp::Bxor => acc ^ v,
                };
            }
            if $op == ReduceOp::Avg {
                acc = acc.wrapping_div($n as $t);
            }
            out.extend(acc.to_le_bytes());
        }
        out
    }};
}

macro_rules! float_fold {
    ($acc:ty, $size:expr, $ins:expr, $op:expr, $n:expr, $dec:expr, $enc:expr) => {{
        let mut out = Vec::new();
        for e in 0..$ins[0].len() / $size {
            let at = |b: &[u8]| -> $acc { $dec(&b[e * $size..(e + 1) * $size]) };
            let mut acc = at($ins[0]);
            for inp in &$ins[1..] {
                let v = at(inp);
                acc = match $op {
                    ReduceOp::Sum | ReduceOp::Avg => acc + v,
                    ReduceOp::Prod => acc * v,
                    ReduceOp::Min if acc.is_nan() || v.is_nan() => <$acc>::NAN,
                    ReduceOp::Max if acc.is_nan() || v.is_nan() => <$acc>::NAN,
                    ReduceOp::Min => acc.min(v),
                    ReduceOp::Max => acc.max(v),
                    _ => unreachable!("bitwise op on a float"),
                };
            }
            if $op == ReduceOp::Avg {
                acc /= $n as $acc;
            }
            out.extend($enc(acc));
        }
        out
    }};
}

/// The reduction of `ins` in the given order, as the spec defines it.
fn reduce_ref(dtype: Dtype, op: ReduceOp, n: u32, ins: &[&[u8]]) -> Vec<u8> {
    match dtype {
        Dtype::I8 => int_fold!(i8, ins, op, n),
        Dtype::U8 => int_fold!(u8, ins, op, n),
        Dtype::I32 => int_fold!(i32, ins, op, n),
        Dtype::U32 => int_fold!(u32, ins, op, n),
        Dtype::I64 => int_fold!(i64, ins, op, n),
        Dtype::U64 => int_fold!(u64, ins, op, n),
        Dtype::F32 => float_fold!(
            f32,
            4,
            ins,
            op,
            n,
            |b: &[u8]| f32::from_le_bytes(b.try_into().unwrap()),
            |a: f32| a.to_le_bytes()
        ),
        Dtype::F64 => float_fold!(
            f64,
            8,
            ins,
            op,
            n,
            |b: &[u8]| f64::from_le_bytes(b.try_into().unwrap()),
            |a: f64| a.to_le_bytes()
        ),
        Dtype::F16 => float_fold!(
            f32,
            2,
            ins,
            op,
            n,
            |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
            |a: f32| half::f16::from_f32(a).to_le_bytes()
        ),
        Dtype::Bf16 => float_fold!(
            f32,
            2,
            ins,
            op,
            n,
            |b: &[u8]| half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
            |a: f32| half::bf16::from_f32(a).to_le_bytes()
        ),
    }
}

/// One collective as every member asks for it.
#[derive(Clone, Copy, Debug)]
struct Coll {
    opcode: Opcode,
    dtype: Dtype,
    op: u8,
    root: u32,
    count: u64,
    tag: u64,
}

impl Coll {
    fn new(opcode: Opcode, dtype: Dtype, op: ReduceOp, count: u64) -> Self {
        Coll {
            opcode,
            dtype,
            op: op.raw(),
            root: 0,
            count,
            tag: 42,
        }
    }

    fn header(&self, in_place: bool) -> VirtioDmlcReq {
        let flags = if in_place { FLAG_IN_PLACE } else { 0 };
        hdr(
            self.opcode.raw(),
            self.dtype.raw(),
            self.op,
            self.root,
            self.count,
            self.tag,
            flags,
            0,
        )
    }

    fn input_elems(&self, n: u32, rank: u32) -> usize {
        buffer_elems(self.opcode, n, rank, self.root, self.count, false)
            .unwrap()
            .input as usize
    }

    /// Random inputs for every member.
    fn inputs(&self, n: u32, rng: &mut Rng) -> Vec<Vec<u8>> {
        (0..n)
            .map(|r| gen(rng, self.dtype, self.input_elems(n, r)))
            .collect()
    }

    /// Every member's output buffer after the collective.
    fn expected(&self, inputs: &[Vec<u8>], in_place: &[bool]) -> Vec<Vec<u8>> {
        let n = inputs.len() as u32;
        let b = self.count as usize * self.dtype.size();
        let op = ReduceOp::from_raw(self.op);
        let red = |range: std::ops::Range<usize>| {
            let ins: Vec<&[u8]> = inputs.iter().map(|i| &i[range.clone()]).collect();
            reduce_ref(self.dtype, op.unwrap(), n, &ins)
        };
        (0..n as usize)
            .map(|r| match self.opcode {
                Opcode::Allreduce => red(0..b),
                Opcode::Reduce if r == self.root as usize => red(0..b),
                Opcode::Reduce if in_place[r] => inputs[r].clone(),
                Opcode::Reduce => Vec::new(),
                Opcode::ReduceScatter if in_place[r] => {
                    let mut v = inputs[r].clone();
                    v[r * b..(r + 1) * b].copy_from_slice(&red(r * b..(r + 1) * b));
                    v
                }
                Opcode::ReduceScatter => red(r * b..(r + 1) * b),
                Opcode::Broadcast => inputs[self.root as usize].clone(),
                Opcode::Allgather => inputs.concat(),
                Opcode::Barrier | Opcode::Nop => Vec::new(),
            })
            .collect()
    }
}

/// A member's chain, written into its memory but not yet submitted.
struct Built {
    descs: Vec<Desc>,
    outputs: Vec<Desc>,
}

/// Builds member `r`'s chain for header `h` with `input` as its input (for
/// in place, it is placed in the output buffer where the spec says), the
/// data cut into segments of `cuts` elements.
fn build(w: &mut World, r: u32, h: &VirtioDmlcReq, input: &[u8], cuts: &[usize]) -> Built {
    let n = w.members.len() as u32;
    let in_place = h.flags.get() & FLAG_IN_PLACE != 0;
    let opcode = Opcode::from_raw(h.opcode.get()).unwrap();
    let es = Dtype::from_raw(h.dtype).map_or(1, Dtype::size);
    let el = buffer_elems(opcode, n, r, h.root.get(), h.count.get(), in_place).unwrap();
    let cuts: Vec<usize> = cuts.iter().map(|c| c * es).collect();
    let m = &mut w.members[r as usize];
    let mut descs = vec![m.header(h)];
    if !in_place {
        descs.extend(m.segments(input, &cuts, false));
    }
    let mut out = vec![0x5a; el.output as usize * es];
    if let Some((off, cnt)) = el.in_place_input {
        let (off, cnt) = (off as usize * es, cnt as usize * es);
        out[off..off + cnt].copy_from_slice(input);
    }
    let outputs = m.segments(&out, &cuts, true);
    descs.extend(outputs.iter().copied());
    descs.push(m.response());
    Built { descs, outputs }
}

struct Result1 {
    written: u32,
    resp: VirtioDmlcResp,
    output: Vec<u8>,
}

/// Runs one collective: builds every member's chain, submits them in
/// `order`, and returns each member's completion and output.
fn run(
    w: &mut World,
    q: u16,
    hdrs: &[VirtioDmlcReq],
    inputs: &[Vec<u8>],
    cuts: &dyn Fn(u32) -> Vec<usize>,
    order: &[u32],
) -> Vec<Result1> {
    let n = w.members.len() as u32;
    let built: Vec<Built> = (0..n)
        .map(|r| build(w, r, &hdrs[r as usize], &inputs[r as usize], &cuts(r)))
        .collect();
    let mut pend: Vec<Option<Pending>> = vec![None; n as usize];
    for &r in order {
        pend[r as usize] = Some(w.submit(r, q, &built[r as usize].descs));
    }
    (0..n as usize)
        .map(|r| {
            let (written, resp) = w.wait(pend[r].as_ref().unwrap());
            Result1 {
                written,
                resp,
                output: w.members[r].gather(&built[r].outputs),
            }
        })
        .collect()
}

/// Different segmentation per member: rank 0 in pieces of 3 elements with
/// a zero-length descriptor, rank 1 in pieces of 1 and 2, others whole.
fn cuts_by_rank(r: u32) -> Vec<usize> {
    match r {
        0 => vec![3, 0, 3, 3],
        1 => vec![1, 2, 1, 2, 1, 2],
        _ => vec![],
    }
}

fn ok_resp(generation: u32) -> VirtioDmlcResp {
    VirtioDmlcResp {
        status: Status::Ok.raw().into(),
        detail: 0.into(),
        peer: NO_PEER.into(),
        generation: generation.into(),
    }
}

fn resp(status: Status, detail: u32, peer: u32, generation: u32) -> VirtioDmlcResp {
    VirtioDmlcResp {
        status: status.raw().into(),
        detail: detail.into(),
        peer: peer.into(),
        generation: generation.into(),
    }
}

/// Runs `c` with every member in place or not as `in_place` says, and
/// checks outputs and responses against the reference.
fn check(w: &mut World, c: &Coll, in_place: &[bool], order: &[u32], rng: &mut Rng) {
    let n = w.members.len() as u32;
    let inputs = c.inputs(n, rng);
    let hdrs: Vec<_> = in_place.iter().map(|&ip| c.header(ip)).collect();
    let res = run(w, 0, &hdrs, &inputs, &cuts_by_rank, order);
    let want = c.expected(&inputs, in_place);
    for (r, got) in res.iter().enumerate() {
        assert_eq!(got.resp, ok_resp(1), "{c:?} in_place {in_place:?} rank {r}");
        assert_eq!(
            got.written as usize,
            RESP_SIZE + got.output.len(),
            "{c:?} rank {r}"
        );
        assert_eq!(got.output, want[r], "{c:?} in_place {in_place:?} rank {r}");
    }
}

#[test]
fn every_opcode_dtype_op_matches_reference() {
    for n in [2u32, 3] {
        let mut w = World::new(config(n));
        let mut rng = Rng::new(u64::from(n));
        let order: Vec<u32> = (0..n).rev().collect();
        let mut done = 0;
        for opcode in REDUCING.into_iter().chain(COPYING) {
            for &dtype in Dtype::ALL {
                let ops: Vec<ReduceOp> = if reduces(opcode) {
                    ReduceOp::ALL
                        .iter()
                        .copied()
                        .filter(|o| o.supports(dtype))
                        .collect()
                } else {
                    vec![ReduceOp::Sum]
                };
                for op in ops {
                    for count in [1u64, 7] {
                        let mut c = Coll::new(opcode, dtype, op, count);
                        if has_root(opcode) {
                            c.root = n - 1;
                        }
                        check(&mut w, &c, &vec![false; n as usize], &order, &mut rng);
                        done += 1;
                    }
                }
            }
        }
        let m = w.group.metrics();
        assert_eq!(m.collectives_completed(Opcode::Allreduce), 2 * 68);
        assert_eq!(m.collectives_completed(Opcode::Allgather), 2 * 10);
        assert_eq!(done, 2 * (3 * 68 + 2 * 10));
    }
}

#[test]
fn in_place_for_every_opcode_that_allows_it() {
    let n = 3;
    let mut w = World::new(config(n));
    let mut rng = Rng::new(7);
    let patterns: [[bool; 3]; 3] = [[true; 3], [true, false, true], [false, true, false]];
    for opcode in REDUCING.into_iter().chain(COPYING) {
        for dtype in [Dtype::F32, Dtype::I32, Dtype::Bf16, Dtype::U8] {
            for op in [ReduceOp::Sum, ReduceOp::Max] {
                for root in [0, 2] {
                    if !has_root(opcode) && root != 0 {
                        continue;
                    }
                    for ip in &patterns {
                        let mut c = Coll::new(opcode, dtype, op, 5);
                        c.root = root;
                        check(&mut w, &c, ip, &[1, 2, 0], &mut rng);
                    }
                }
            }
        }
    }
}

#[test]
fn arrival_order_gives_bitwise_same_result() {
    let n = 3;
    let mut w = World::new(config(n));
    let mut rng = Rng::new(99);
    let orders = [
        [0, 1, 2],
        [0, 2, 1],
        [1, 0, 2],
        [1, 2, 0],
        [2, 0, 1],
        [2, 1, 0],
    ];
    for opcode in [Opcode::Allreduce, Opcode::ReduceScatter] {
        let c = Coll::new(opcode, Dtype::F32, ReduceOp::Sum, 33);
        let inputs: Vec<Vec<u8>> = (0..n)
            .map(|r| gen_wide_f32(&mut rng, c.input_elems(n, r)))
            .collect();
        let hdrs = vec![c.header(false); 3];
        let want = c.expected(&inputs, &[false; 3]);
        // The data are such that another summation order gives other bits.
        let reversed: Vec<&[u8]> = inputs.iter().rev().map(|v| &v[..]).collect();
        assert_ne!(
            reduce_ref(Dtype::F32, ReduceOp::Sum, n, &reversed),
            reduce_ref(
                Dtype::F32,
                ReduceOp::Sum,
                n,
                &inputs.iter().map(|v| &v[..]).collect::<Vec<_>>()
            )
        );
        for order in &orders {
            let res = run(&mut w, 1, &hdrs, &inputs, &cuts_by_rank, order);
            for (r, got) in res.iter().enumerate() {
                assert_eq!(got.resp, ok_resp(1));
                assert_eq!(got.output, want[r], "{opcode} order {order:?} rank {r}");
            }
        }
    }
}

#[test]
fn float_min_max_propagate_nan() {
    let n = 2;
    let mut w = World::new(config(n));
    for (dtype, op) in [
        (Dtype::F32, ReduceOp::Min),
        (Dtype::F64, ReduceOp::Max),
        (Dtype::Bf16, ReduceOp::Max),
        (Dtype::F16, ReduceOp::Min),
    ] {
        let c = Coll::new(Opcode::Allreduce, dtype, op, 3);
        let es = dtype.size();
        let enc = |v: f32| -> Vec<u8> {
            match dtype {
                Dtype::F32 => v.to_le_bytes().to_vec(),
                Dtype::F64 => f64::from(v).to_le_bytes().to_vec(),
                Dtype::F16 => half::f16::from_f32(v).to_le_bytes().to_vec(),
                _ => half::bf16::from_f32(v).to_le_bytes().to_vec(),
            }
        };
        let a: Vec<u8> = [1.0, f32::NAN, 2.0].iter().flat_map(|v| enc(*v)).collect();
        let b: Vec<u8> = [f32::NAN, 5.0, -3.0].iter().flat_map(|v| enc(*v)).collect();
        let res = run(
            &mut w,
            0,
            &[c.header(false); 2],
            &[a, b],
            &|_| vec![],
            &[0, 1],
        );
        for got in &res {
            assert_eq!(got.resp, ok_resp(1));
            let is_nan = |e: usize| {
                let b = &got.output[e * es..(e + 1) * es];
                match dtype {
                    Dtype::F32 => f32::from_le_bytes(b.try_into().unwrap()).is_nan(),
                    Dtype::F64 => f64::from_le_bytes(b.try_into().unwrap()).is_nan(),
                    Dtype::F16 => half::f16::from_le_bytes([b[0], b[1]]).is_nan(),
                    _ => half::bf16::from_le_bytes([b[0], b[1]]).is_nan(),
                }
            };
            assert!(is_nan(0) && is_nan(1), "{dtype} {op}");
            assert_eq!(
                got.output[2 * es..],
                enc(if op == ReduceOp::Min { -3.0 } else { 2.0 })[..]
            );
        }
    }
}

#[test]
fn barrier_completes_with_no_data_and_ignores_dtype_and_op() {
    let n = 3;
    let mut w = World::new(config(n));
    let hdrs: Vec<_> = (0..n)
        .map(|r| {
            hdr(
                Opcode::Barrier.raw(),
                0xf0 + r as u8,
                0xe0 + r as u8,
                0,
                0,
                5,
                0,
                0,
            )
        })
        .collect();
    for order in [[2, 0, 1], [0, 1, 2]] {
        let res = run(
            &mut w,
            2,
            &hdrs,
            &[vec![], vec![], vec![]],
            &|_| vec![],
            &order,
        );
        for got in &res {
            assert_eq!(got.resp, ok_resp(1));
            assert_eq!(got.written as usize, RESP_SIZE);
        }
    }
    assert_eq!(w.group.metrics().collectives_completed(Opcode::Barrier), 2);
    assert_eq!(w.group.metrics().skew_count(), 2);
}

#[test]
fn broadcast_and_allgather_ignore_op() {
    let n = 2;
    let mut w = World::new(config(n));
    let mut rng = Rng::new(3);
    for opcode in COPYING {
        let c = Coll::new(opcode, Dtype::F32, ReduceOp::Sum, 4);
        let inputs = c.inputs(n, &mut rng);
        let mut h1 = c.header(false);
        h1.op = 0xee; // unknown, and would be invalid for f32 if it counted
        let res = run(
            &mut w,
            0,
            &[c.header(false), h1],
            &inputs,
            &|_| vec![],
            &[1, 0],
        );
        let want = c.expected(&inputs, &[false, false]);
        for (r, got) in res.iter().enumerate() {
            assert_eq!(got.resp, ok_resp(1));
            assert_eq!(got.output, want[r]);
        }
    }
}

#[test]
fn single_member_group_completes_at_once() {
    let mut w = World::new(config(1));
    let mut rng = Rng::new(1);
    for opcode in REDUCING.into_iter().chain(COPYING) {
        let c = Coll::new(opcode, Dtype::I64, ReduceOp::Prod, 9);
        check(&mut w, &c, &[false], &[0], &mut rng);
        check(&mut w, &c, &[true], &[0], &mut rng);
    }
}

#[test]
fn queues_match_independently() {
    let n = 2;
    let mut w = World::new(config(n));
    let mut rng = Rng::new(5);
    let c0 = Coll::new(Opcode::Allreduce, Dtype::U32, ReduceOp::Sum, 6);
    let c1 = Coll::new(Opcode::Allgather, Dtype::U8, ReduceOp::Sum, 3);
    let in0 = c0.inputs(n, &mut rng);
    let in1 = c1.inputs(n, &mut rng);
    let b00 = build(&mut w, 0, &c0.header(false), &in0[0], &[]);
    let b01 = build(&mut w, 1, &c0.header(false), &in0[1], &[]);
    let b10 = build(&mut w, 0, &c1.header(false), &in1[0], &[]);
    let b11 = build(&mut w, 1, &c1.header(false), &in1[1], &[]);
    // Member 0 on queue 0 then 1; member 1 on queue 1 then 0.
    let p00 = w.submit(0, 0, &b00.descs);
    let p10 = w.submit(0, 1, &b10.descs);
    let p11 = w.submit(1, 1, &b11.descs);
    assert!(w.is_pending(&p00));
    let p01 = w.submit(1, 0, &b01.descs);
    let want0 = c0.expected(&in0, &[false; 2]);
    let want1 = c1.expected(&in1, &[false; 2]);
    for (p, b, want) in [
        (p00, &b00, &want0[0]),
        (p01, &b01, &want0[1]),
        (p10, &b10, &want1[0]),
        (p11, &b11, &want1[1]),
    ] {
        assert_eq!(w.wait(&p).1, ok_resp(1));
        assert_eq!(&w.members[p.rank as usize].gather(&b.outputs), want);
    }
}

/// Member `differs` asks for something else in one header field.
#[test]
fn mismatch_names_the_field_and_peer_on_every_member() {
    let n = 3;
    let mut w = World::new(config(n));
    let mut rng = Rng::new(11);
    type Change = fn(&mut VirtioDmlcReq);
    let cases: [(u32, Opcode, Change); 6] = [
        (mismatch::OPCODE, Opcode::Allreduce, |h| {
            h.opcode = Opcode::Allgather.raw().into()
        }),
        (mismatch::DTYPE, Opcode::Allreduce, |h| {
            h.dtype = Dtype::I32.raw()
        }),
        (mismatch::OP, Opcode::ReduceScatter, |h| {
            h.op = ReduceOp::Max.raw()
        }),
        (mismatch::COUNT, Opcode::Allgather, |h| h.count = 5.into()),
        (mismatch::ROOT, Opcode::Broadcast, |h| h.root = 2.into()),
        (mismatch::TAG, Opcode::Reduce, |h| h.tag = 43.into()),
    ];
    let mut q_seq = 0u16;
    for (mask, opcode, change) in cases {
        for differs in 0..n {
            let c = Coll::new(opcode, Dtype::F32, ReduceOp::Sum, 4);
            let mut hdrs = vec![c.header(false); n as usize];
            change(&mut hdrs[differs as usize]);
            let inputs: Vec<Vec<u8>> = (0..n)
                .map(|r| {
                    let h = &hdrs[r as usize];
                    let el = buffer_elems(
                        Opcode::from_raw(h.opcode.get()).unwrap(),
                        n,
                        r,
                        h.root.get(),
                        h.count.get(),
                        false,
                    )
                    .unwrap();
                    gen(
                        &mut rng,
                        Dtype::from_raw(h.dtype).unwrap(),
                        el.input as usize,
                    )
                })
                .collect();
            let q = q_seq % 4;
            q_seq += 1;
            let res = run(&mut w, q, &hdrs, &inputs, &|_| vec![], &[2, 1, 0]);
            // Compared with rank 0: if rank 0 is the odd one, rank 1 differs first.
            let peer = if differs == 0 { 1 } else { differs };
            for (r, got) in res.iter().enumerate() {
                assert_eq!(
                    got.resp,
                    resp(Status::Mismatch, mask, peer, 1),
                    "field {:?} differs on {differs}, member {r}",
                    mismatch::fields(mask).collect::<Vec<_>>()
                );
                assert_eq!(got.written as usize, RESP_SIZE + got.output.len());
                assert!(got.output.iter().all(|&b| b == 0x5a), "output untouched");
            }
        }
    }
    assert_eq!(w.group.metrics().errors(Status::Mismatch), 6 * 3 * 3);
}

#[test]
fn mismatch_mask_collects_every_differing_field() {
    let n = 3;
    let mut w = World::new(config(n));
    let c = Coll::new(Opcode::Allreduce, Dtype::F32, ReduceOp::Sum, 4);
    let mut hdrs = vec![c.header(false); 3];
    hdrs[2].tag = 1.into();
    hdrs[1].dtype = Dtype::F64.raw();
    hdrs[1].count = 2.into();
    let inputs = vec![vec![0; 16], vec![0; 16], vec![0; 16]];
    let res = run(&mut w, 0, &hdrs, &inputs, &|_| vec![], &[0, 1, 2]);
    let mask = mismatch::TAG | mismatch::DTYPE | mismatch::COUNT;
    for got in &res {
        assert_eq!(got.resp, resp(Status::Mismatch, mask, 1, 1));
    }
}

#[test]
fn in_place_flag_may_differ_per_member() {
    let n = 2;
    let mut w = World::new(config(n));
    let mut rng = Rng::new(13);
    let c = Coll::new(Opcode::Allgather, Dtype::I8, ReduceOp::Sum, 3);
    check(&mut w, &c, &[true, false], &[0, 1], &mut rng);
}

fn barrier_descs(w: &mut World, r: u32) -> Vec<Desc> {
    let m = &mut w.members[r as usize];
    vec![
        m.header(&hdr(Opcode::Barrier.raw(), 0, 0, 0, 0, 0, 0, 0)),
        m.response(),
    ]
}

/// A nop is answered at once for its member alone: while a peer is
/// missing, between the halves of a pending collective, with the
/// generation of the moment; it takes no sequence number, so the
/// collective still matches. With data it is refused like a barrier.
#[test]
fn nop_is_answered_at_once_for_its_member_alone() {
    let n = 2;
    let mut w = World::new(config(n));
    let nop = hdr(Opcode::Nop.raw(), 0xf7, 0xe3, 0, 0, 9, 0, 0);
    let d = {
        let m = &mut w.members[0];
        vec![m.header(&nop), m.response()]
    };
    let p = w.submit(0, 0, &d);
    assert_eq!(w.wait(&p), (RESP_SIZE as u32, ok_resp(1)));

    // Member 0 waits in a barrier on queue 0; nops on the same queue
    // still come back, and member 1's barrier then completes both.
    let d = barrier_descs(&mut w, 0);
    let barrier0 = w.submit(0, 0, &d);
    for _ in 0..3 {
        let d = {
            let m = &mut w.members[0];
            vec![m.header(&nop), m.response()]
        };
        let p = w.submit(0, 0, &d);
        assert_eq!(w.wait(&p).1, ok_resp(1));
    }
    assert!(w.is_pending(&barrier0));
    let d = barrier_descs(&mut w, 1);
    let barrier1 = w.submit(1, 0, &d);
    assert_eq!(w.wait(&barrier0).1, ok_resp(1));
    assert_eq!(w.wait(&barrier1).1, ok_resp(1));

    // With a count, or a data segment: BAD_REQUEST, as for a barrier.
    let counted = hdr(Opcode::Nop.raw(), 0, 0, 0, 4, 0, 0, 0);
    let d = {
        let m = &mut w.members[1];
        vec![m.header(&counted), m.response()]
    };
    let p = w.submit(1, 0, &d);
    assert_eq!(
        w.wait(&p).1,
        resp(Status::BadRequest, bad::BARRIER_DATA, NO_PEER, 1)
    );
    assert_eq!(w.group.metrics().collectives_completed(Opcode::Nop), 0);
    assert_eq!(w.group.metrics().collectives_completed(Opcode::Barrier), 1);
}

#[test]
fn member_lost_fails_waiting_peers_promptly_and_restarts_sequences() {
    let n = 3;
    let mut w = World::new(config(n));
    let mut rng = Rng::new(17);
    // Member 2 has a request of its own waiting on queue 1.
    let d = barrier_descs(&mut w, 2);
    let own = w.submit(2, 1, &d);
    // Member 0 has two requests waiting on queue 0, member 1 one.
    let mut waiting = Vec::new();
    for r in [0, 0, 1] {
        let d = barrier_descs(&mut w, r);
        waiting.push(w.submit(r, 0, &d));
    }
    assert_eq!(w.completions(), 0);
    assert_eq!(w.group.config_space(0).base.generation.get(), 1);

    let t = Instant::now();
    w.group.member_lost(2);
    for p in &waiting {
        let (written, r) = w.wait(p);
        assert_eq!(r, resp(Status::PeerLost, 0, 2, 2));
        assert_eq!(written as usize, RESP_SIZE);
    }
    // Far from the 60 s timeout (a bound a loaded machine keeps).
    assert!(t.elapsed() < config(n).timeout / 2, "not prompt");
    assert_eq!(w.group.config_space(1).base.generation.get(), 2);
    assert_eq!(w.group.metrics().errors(Status::PeerLost), 3);

    // The lost member's own request is dropped, and so are its chains until
    // it is ready again.
    assert!(w.wait_for(&own, Duration::from_millis(100)).is_none());
    let d = barrier_descs(&mut w, 2);
    let stale = w.submit(2, 0, &d);
    assert!(w.wait_for(&stale, Duration::from_millis(50)).is_none());
    w.group.member_ready(2);

    // Every member starts again at sequence 0 on every queue.
    let c = Coll::new(Opcode::Allreduce, Dtype::I64, ReduceOp::Sum, 5);
    let inputs = c.inputs(n, &mut rng);
    for q in [0, 1] {
        let res = run(
            &mut w,
            q,
            &[c.header(false); 3],
            &inputs,
            &cuts_by_rank,
            &[2, 0, 1],
        );
        let want = c.expected(&inputs, &[false; 3]);
        for (r, got) in res.iter().enumerate() {
            assert_eq!(got.resp, ok_resp(2));
            assert_eq!(got.output, want[r]);
        }
    }
    assert_eq!(w.completions(), 0);
}

#[test]
fn member_lost_with_nothing_pending_still_bumps_generation() {
    let mut w = World::new(config(2));
    w.group.member_lost(1);
    w.group.member_ready(1);
    assert_eq!(w.group.generation(), 2);
    let d0 = barrier_descs(&mut w, 0);
    let d1 = barrier_descs(&mut w, 1);
    let p0 = w.submit(0, 0, &d0);
    let p1 = w.submit(1, 0, &d1);
    assert_eq!(w.wait(&p0).1, ok_resp(2));
    assert_eq!(w.wait(&p1).1, ok_resp(2));
    assert!(w.group.metrics().render().contains("dmlc_generation 2"));
}

/// Bounds are relative to the timeouts (150 ms for the members present,
/// the 60 s default for the late one), so that a loaded machine does not
/// fail them.
#[test]
fn timeout_fails_present_members_and_late_arrivals() {
    let n = 3;
    let cfg = config(n);
    let default = cfg.timeout;
    let mut w = World::new(cfg);
    let mut rng = Rng::new(19);
    let c = Coll::new(Opcode::Allreduce, Dtype::F32, ReduceOp::Sum, 4);
    let inputs = c.inputs(n, &mut rng);
    // Members 0 and 2 ask for 150 ms; member 1 has the default.
    for r in [0, 2] {
        w.group
            .set_member_features(r, 1 << virtio_dmlc::VIRTIO_DMLC_F_REQ_TIMEOUT);
    }
    let mut short = c.header(false);
    short.timeout_ms = 150.into();
    let built: Vec<Built> = (0..n)
        .map(|r| {
            let h = if r == 1 { c.header(false) } else { short };
            build(&mut w, r, &h, &inputs[r as usize], &[])
        })
        .collect();
    let t = Instant::now();
    let p0 = w.submit(0, 0, &built[0].descs);
    let p2 = w.submit(2, 0, &built[2].descs);
    for (p, b) in [(p0, &built[0]), (p2, &built[2])] {
        let (written, r) = w.wait(&p);
        assert_eq!(r, resp(Status::Timeout, 0, 1, 1));
        assert_eq!(written as usize, RESP_SIZE + 16);
        assert!(w.members[p.rank as usize]
            .gather(&b.outputs)
            .iter()
            .all(|&x| x == 0x5a));
    }
    let waited = t.elapsed();
    assert!(waited >= Duration::from_millis(150), "{waited:?}");
    assert!(waited < default / 2, "{waited:?}");

    // The late member fails at once for the same collective, long before
    // its own timeout.
    let t = Instant::now();
    let p1 = w.submit(1, 0, &built[1].descs);
    assert_eq!(w.wait(&p1).1, resp(Status::Timeout, 0, 1, 1));
    assert!(t.elapsed() < default / 2, "{:?}", t.elapsed());
    assert_eq!(w.group.metrics().errors(Status::Timeout), 3);

    // The next collective matches normally.
    let res = run(
        &mut w,
        0,
        &[c.header(false); 3],
        &inputs,
        &|_| vec![],
        &[1, 2, 0],
    );
    let want = c.expected(&inputs, &[false; 3]);
    for (r, got) in res.iter().enumerate() {
        assert_eq!(got.resp, ok_resp(1));
        assert_eq!(got.output, want[r]);
    }
}

#[test]
fn request_timeout_needs_the_feature() {
    let n = 2;
    let mut w = World::new(config(n)); // 60 s default
    let h = hdr(Opcode::Barrier.raw(), 0, 0, 0, 0, 0, 0, 100);
    let mk = |w: &mut World, r: u32| {
        let m = &mut w.members[r as usize];
        vec![m.header(&h), m.response()]
    };

    w.group
        .set_member_features(0, 1 << virtio_dmlc::VIRTIO_DMLC_F_REQ_TIMEOUT);
    let d = mk(&mut w, 0);
    let t = Instant::now();
    let p = w.submit(0, 0, &d);
    assert_eq!(w.wait(&p).1, resp(Status::Timeout, 0, 1, 1));
    assert!(t.elapsed() >= Duration::from_millis(100));

    // Without the feature timeout_ms is ignored.
    w.group.set_member_features(0, 0);
    let d = mk(&mut w, 0);
    let p = w.submit(0, 0, &d);
    assert!(w.wait_for(&p, Duration::from_millis(400)).is_none());
    // Member 1 first fails for the timed-out (0, 0), then meets (0, 1).
    let d = mk(&mut w, 1);
    let late = w.submit(1, 0, &d);
    assert_eq!(w.wait(&late).1, resp(Status::Timeout, 0, 1, 1));
    let d = mk(&mut w, 1);
    let p1 = w.submit(1, 0, &d);
    assert_eq!(w.wait(&p1).1, ok_resp(1));
    assert_eq!(w.wait(&p).1, ok_resp(1));
}

/// Later submissions with earlier deadlines fire on time, not at the
/// earlier submission's later deadline: each fires no earlier than its
/// own timeout, in deadline order, and well before the 20 s default that
/// the first one waits for (bounds a loaded machine keeps).
#[test]
fn timer_handles_many_deadlines() {
    let n = 2;
    let mut cfg = config(n);
    cfg.timeout = Duration::from_secs(20);
    let default = cfg.timeout;
    let mut w = World::new(cfg);
    w.group.set_member_features(0, 1);
    let mut ps = Vec::new();
    for (q, ms) in [(0u16, 0u32), (1, 200), (2, 50)] {
        let m = &mut w.members[0];
        let d = vec![
            m.header(&hdr(Opcode::Barrier.raw(), 0, 0, 0, 0, 0, 0, ms)),
            m.response(),
        ];
        ps.push((w.submit(0, q, &d), Instant::now(), ms));
    }
    let mut fired = Vec::new();
    for (p, t, ms) in &ps[1..] {
        let done = w.wait_for(p, default).expect("fired");
        let b = w.members[0].read(p.resp, RESP_SIZE);
        assert_eq!(
            VirtioDmlcResp::read_from_bytes(&b).unwrap(),
            resp(Status::Timeout, 0, 1, 1)
        );
        let took = done.at.saturating_duration_since(*t);
        assert!(
            took >= Duration::from_millis(u64::from(*ms)),
            "{ms}: {took:?}"
        );
        assert!(took < default / 2, "{ms}: {took:?}");
        fired.push(done.at);
    }
    assert!(
        fired[1] <= fired[0],
        "the 50 ms deadline fired after the 200 ms one"
    );
    // The first one still waits for its default deadline.
    assert!(w.is_pending(&ps[0].0));
    w.group.reset();
    assert_eq!(w.wait(&ps[0].0).1, resp(Status::Reset, 0, NO_PEER, 2));
}

/// The same big collectives with reduction threads and without give the
/// same bytes, and the reference ones.
#[test]
fn big_collectives_split_over_threads_match_inline() {
    let n = 3;
    let mut rng = Rng::new(23);
    let count = 3 << 18; // 3 MiB of f32 per member
    let cases = [
        Coll::new(Opcode::Allreduce, Dtype::F32, ReduceOp::Sum, count),
        Coll::new(Opcode::ReduceScatter, Dtype::Bf16, ReduceOp::Avg, count / 4),
        Coll::new(Opcode::Allgather, Dtype::U8, ReduceOp::Sum, count),
    ];
    let inputs: Vec<Vec<Vec<u8>>> = cases
        .iter()
        .map(|c| {
            (0..n)
                .map(|r| {
                    if c.dtype == Dtype::F32 {
                        gen_wide_f32(&mut rng, c.input_elems(n, r))
                    } else {
                        gen(&mut rng, c.dtype, c.input_elems(n, r))
                    }
                })
                .collect()
        })
        .collect();
    // Odd segment sizes, different per member.
    let cuts = |r: u32| -> Vec<usize> {
        let piece = [100_003usize, 65_537, 1_000_001][r as usize];
        vec![piece; 40]
    };
    let mut outputs = Vec::new();
    for threads in [3usize, 0] {
        let mut cfg = config(n);
        cfg.reduce_threads = threads;
        cfg.max_segments = 1024;
        let mut w = World::with_region(cfg, 24 << 20);
        let mut outs = Vec::new();
        for (c, ins) in cases.iter().zip(&inputs) {
            for ip in [[false; 3], [true, false, true]] {
                let hdrs: Vec<_> = ip.iter().map(|&p| c.header(p)).collect();
                let res = run(&mut w, 0, &hdrs, ins, &cuts, &[2, 0, 1]);
                let want = c.expected(ins, &ip);
                for (r, got) in res.iter().enumerate() {
                    assert_eq!(got.resp, ok_resp(1));
                    assert!(got.output == want[r], "{c:?} threads {threads} rank {r}");
                }
                outs.push(res.into_iter().map(|g| g.output).collect::<Vec<_>>());
            }
        }
        let splits = w.group.metrics().split_count();
        assert_eq!(splits, if threads > 0 { 6 } else { 0 });
        outputs.push(outs);
    }
    assert!(outputs[0] == outputs[1]);
}

#[test]
fn config_space_reports_group() {
    let w = World::new(config(3));
    let space = w.group.config_space(2);
    assert_eq!(space.max_comms.get(), 8);
    let c = space.base;
    assert_eq!(c.rank.get(), 2);
    assert_eq!(c.world_size.get(), 3);
    assert_eq!(c.num_queues.get(), 4);
    assert_eq!(c.max_segments.get(), 64);
    assert_eq!(c.max_bytes.get(), 64 << 20);
    assert_eq!(c.dtypes.get(), 0x3ff);
    assert_eq!(c.ops.get(), 0xff);
    // The opcodes of 5.X.6.1 (0 to 6), then those of bits 1 to 3 (7 to 17).
    assert_eq!(c.opcodes.get(), 0x3_ffff);
    assert_eq!(c.generation.get(), 1);
    assert_eq!(c.group_id.get(), 0x1234);
}

#[test]
fn dropping_the_group_stops_its_threads() {
    let mut cfg = config(2);
    cfg.reduce_threads = 2;
    let mut w = World::new(cfg);
    let d = barrier_descs(&mut w, 0);
    let _pending = w.submit(0, 0, &d);
    // Drop joins the timer and reduction threads; a hang here fails the test
    // by timing out the test run.
    drop(w);
}

#[test]
fn repeated_member_lost_is_one_loss() {
    let mut w = World::new(config(2));
    w.group.member_lost(1);
    w.group.member_lost(1);
    assert_eq!(w.group.generation(), 2);
    // Member 0 waits in the new generation; another call for the same loss
    // does not fail it.
    let d = barrier_descs(&mut w, 0);
    let p = w.submit(0, 0, &d);
    w.group.member_lost(1);
    assert!(w.wait_for(&p, Duration::from_millis(50)).is_none());
    w.group.member_ready(1);
    w.group.member_lost(1);
    assert_eq!(w.wait(&p).1, resp(Status::PeerLost, 0, 1, 3));
    assert_eq!(w.group.generation(), 3);
}

/// Guests may hand buffers at any byte address.
#[test]
fn misaligned_buffers() {
    let n = 2;
    let mut w = World::new(config(n));
    let mut rng = Rng::new(29);
    for (dtype, op) in [(Dtype::F64, ReduceOp::Sum), (Dtype::I32, ReduceOp::Bxor)] {
        let c = Coll::new(Opcode::Allreduce, dtype, op, 9);
        let inputs = c.inputs(n, &mut rng);
        let b = 9 * dtype.size();
        let mut ps = Vec::new();
        for r in 0..n {
            let m = &mut w.members[r as usize];
            let inp = m.alloc_misaligned(b, 1 + u64::from(r));
            m.write(inp, &inputs[r as usize]);
            let out = m.alloc_misaligned(b, 3);
            let d = vec![
                m.header(&c.header(false)),
                Desc::r(inp, b as u32),
                Desc::w(out, b as u32),
                m.response(),
            ];
            ps.push((w.submit(r, 0, &d), out));
        }
        let want = c.expected(&inputs, &[false; 2]);
        for (p, out) in ps {
            assert_eq!(w.wait(&p).1, ok_resp(1));
            assert_eq!(
                w.members[p.rank as usize].read(out, b),
                want[p.rank as usize]
            );
        }
    }
}

/// Members on their own threads, two queues each, small and big
/// collectives interleaved: every result is right.
#[test]
fn concurrent_members_get_right_results() {
    let n = 3u32;
    let mut cfg = config(n);
    cfg.reduce_threads = 2;
    let w = World::with_region(cfg, 16 << 20);
    let (group, hub, parts) = w.into_parts();
    let threads: Vec<_> = parts
        .into_iter()
        .enumerate()
        .map(|(r, (mut m, done))| {
            let group = group.clone();
            let hub = hub.clone();
            std::thread::spawn(move || {
                let r = r as u32;
                for iter in 0..120u32 {
                    let big = iter % 40 == 7;
                    let count: u64 = if big { 300_000 } else { 5 };
                    let mut ps = Vec::new();
                    for q in 0..2u16 {
                        let c = Coll::new(Opcode::Allreduce, Dtype::I32, ReduceOp::Sum, count);
                        let val = |rank: u32| (rank * 1000 + iter * 2 + u32::from(q)) as i32;
                        let input: Vec<u8> =
                            (0..count).flat_map(|_| val(r).to_le_bytes()).collect();
                        let b = input.len();
                        let inp = m.alloc(b);
                        m.write(inp, &input);
                        let out = m.alloc(b);
                        let d = vec![
                            m.header(&c.header(false)),
                            Desc::r(inp, b as u32),
                            Desc::w(out, b as u32),
                            m.response(),
                        ];
                        let sum: i32 = (0..n).map(val).sum();
                        ps.push((m.submit(&group, r, q, &d, &done), out, b, sum));
                    }
                    for (p, out, b, sum) in ps {
                        let d = hub
                            .wait_for(&p, Duration::from_secs(20))
                            .unwrap_or_else(|| panic!("rank {r} iter {iter}: no completion"));
                        assert_eq!(d.written as usize, RESP_SIZE + b);
                        let got = m.read(out, b);
                        assert!(
                            got.chunks(4)
                                .all(|x| i32::from_le_bytes(x.try_into().unwrap()) == sum),
                            "rank {r} iter {iter}"
                        );
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(
        group.metrics().collectives_completed(Opcode::Allreduce),
        240
    );
    assert_eq!(group.metrics().split_count(), 6);
}

/// A member is lost and comes back again and again while the others keep
/// submitting: nothing hangs, and the others' requests all complete with
/// OK, PEER_LOST or TIMEOUT.
#[test]
fn losses_while_members_submit() {
    let n = 3u32;
    let mut cfg = config(n);
    cfg.timeout = Duration::from_millis(500);
    let w = World::new(cfg);
    let (group, hub, parts) = w.into_parts();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let threads: Vec<_> = parts
        .into_iter()
        .enumerate()
        .map(|(r, (mut m, done))| {
            let group = group.clone();
            let hub = hub.clone();
            let stop = stop.clone();
            std::thread::spawn(move || {
                let r = r as u32;
                let mut seen = [0u32; 8];
                let mut iter = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    iter += 1;
                    let d = vec![
                        m.header(&hdr(Opcode::Barrier.raw(), 0, 0, 0, 0, 0, 0, 0)),
                        m.response(),
                    ];
                    let p = m.submit(&group, r, 0, &d, &done);
                    // Member 2's chains are dropped while it is lost.
                    // Others complete by the 500 ms timeout at the latest.
                    let limit = if r == 2 { 300 } else { 20 * 500 };
                    match hub.wait_for(&p, Duration::from_millis(limit)) {
                        Some(_) => {
                            let b = m.read(p.resp, RESP_SIZE);
                            let resp = <VirtioDmlcResp as zerocopy::FromBytes>::read_from_bytes(&b)
                                .unwrap();
                            let st = resp.status.get();
                            assert!(
                                [Status::Ok, Status::PeerLost, Status::Timeout]
                                    .iter()
                                    .any(|s| s.raw() == st),
                                "rank {r}: status {st}"
                            );
                            seen[st as usize] += 1;
                        }
                        None => assert_eq!(r, 2, "rank {r} iter {iter}: no completion"),
                    }
                }
                seen
            })
        })
        .collect();
    for _ in 0..5 {
        std::thread::sleep(Duration::from_millis(30));
        group.member_lost(2);
        std::thread::sleep(Duration::from_millis(10));
        group.member_ready(2);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let seen: Vec<[u32; 8]> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert!(seen[0][Status::Ok.raw() as usize] > 0);
    assert_eq!(group.generation(), 6);
}

/// Buffers whose elements are cut by the boundary of two guest memory
/// regions give the same results as any others.
#[test]
fn elements_cut_by_a_region_boundary() {
    let mut rng = Rng::new(31);
    let cases = [
        (Opcode::Allreduce, Dtype::F64, 13, false),
        (Opcode::Allreduce, Dtype::F32, 3, true),
        (Opcode::Allgather, Dtype::F64, 5, false),
        (Opcode::Allgather, Dtype::I32, 6, true),
        (Opcode::ReduceScatter, Dtype::I64, 9, true),
        (Opcode::Broadcast, Dtype::Bf16, 1, false),
    ];
    for (opcode, dtype, before, in_place) in cases {
        let n = 2;
        let mut w = World::new(config(n));
        let c = Coll::new(opcode, dtype, ReduceOp::Sum, 6);
        let inputs = c.inputs(n, &mut rng);
        let es = dtype.size();
        let mut pend = Vec::new();
        for r in 0..n {
            // Member 0's input (or in-place buffer) and member 1's output
            // straddle the boundary.
            let ip = in_place && r == 0;
            let el = buffer_elems(opcode, n, r, 0, 6, ip).unwrap();
            let (ib, ob) = (el.input as usize * es, el.output as usize * es);
            let m = &mut w.members[r as usize];
            let mut d = vec![m.header(&c.header(ip))];
            if ib > 0 {
                let a = if r == 0 {
                    m.alloc_across_regions(before, ib)
                } else {
                    m.alloc(ib)
                };
                m.write(a, &inputs[r as usize]);
                d.push(Desc::r(a, ib as u32));
            }
            let mut out = vec![0x5a; ob];
            if let Some((off, cnt)) = el.in_place_input {
                let (off, cnt) = (off as usize * es, cnt as usize * es);
                out[off..off + cnt].copy_from_slice(&inputs[r as usize]);
            }
            let a = if r == 1 || ip {
                m.alloc_across_regions(before, ob)
            } else {
                m.alloc(ob)
            };
            m.write(a, &out);
            d.push(Desc::w(a, ob as u32));
            d.push(m.response());
            pend.push((w.submit(r, 0, &d), a, ob));
        }
        let want = c.expected(&inputs, &[in_place, false]);
        for (p, a, ob) in pend {
            assert_eq!(w.wait(&p).1, ok_resp(1));
            let got = w.members[p.rank as usize].read(a, ob);
            assert_eq!(
                got, want[p.rank as usize],
                "{opcode} {dtype} rank {}",
                p.rank
            );
        }
    }
}

#[test]
fn reset_fails_pending_collectives_with_reset() {
    let mut w = World::new(config(3));
    let d = barrier_descs(&mut w, 0);
    let p0 = w.submit(0, 0, &d);
    let d = barrier_descs(&mut w, 2);
    let p2 = w.submit(2, 1, &d);
    w.group.reset();
    assert_eq!(w.wait(&p0).1, resp(Status::Reset, 0, NO_PEER, 2));
    assert_eq!(w.wait(&p2).1, resp(Status::Reset, 0, NO_PEER, 2));
    // Members stay active and start again at sequence 0.
    let hdrs = vec![hdr(Opcode::Barrier.raw(), 0, 0, 0, 0, 0, 0, 0); 3];
    let res = run(
        &mut w,
        1,
        &hdrs,
        &[vec![], vec![], vec![]],
        &|_| vec![],
        &[0, 1, 2],
    );
    for got in &res {
        assert_eq!(got.resp, ok_resp(2));
    }
    assert_eq!(w.group.metrics().errors(Status::Reset), 2);
}

#[test]
fn members_are_active_only_after_ready() {
    let mut cfg = config(2);
    cfg.num_queues = 1;
    // Members with their memory and queues, and a fresh group that nobody
    // has joined yet.
    let (_, _, mut parts) = World::new(cfg.clone()).into_parts();
    let group = Group::new(cfg);
    let (m0, done0) = &mut parts[0];
    let barrier = hdr(Opcode::Barrier.raw(), 0, 0, 0, 0, 0, 0, 0);
    let d = vec![m0.header(&barrier), m0.response()];
    m0.submit(&group, 0, 0, &d, done0);
    assert_eq!(group.metrics().dropped_count(), 1);
    // Losing a member that was never active is no loss.
    group.member_lost(0);
    assert_eq!(group.generation(), 1);
    group.member_ready(0);
    group.member_ready(1);
    assert!(group
        .metrics()
        .render()
        .contains("dmlc_members_connected 2"));
    group.member_lost(1);
    assert!(group
        .metrics()
        .render()
        .contains("dmlc_members_connected 1"));
    assert_eq!(group.generation(), 2);
}

/// Guest bytes behind `descs` in `mem`.
fn gather_in(mem: &GuestMem, descs: &[Desc]) -> Vec<u8> {
    let mut v = Vec::new();
    for d in descs {
        let mut b = vec![0; d.len as usize];
        mem.read_slice(&mut b, GuestAddress(d.addr)).unwrap();
        v.extend(b);
    }
    v
}

/// The last `len` bytes behind `descs` (all in the last descriptor).
fn tail_in(mem: &GuestMem, descs: &[Desc], len: usize) -> Vec<u8> {
    let d = descs.last().unwrap();
    let mut b = vec![0; len];
    mem.read_slice(&mut b, GuestAddress(d.addr + u64::from(d.len) - len as u64))
        .unwrap();
    b
}

/// Times of one loss during a running collective, from the moment the
/// losses were called.
#[derive(Debug)]
struct LossFigures {
    /// The waiting member's PEER_LOST.
    peer_lost: Duration,
    /// The slowest `member_lost` call.
    lose_returned: Duration,
    /// The first survivor's completion of the running collective (its data
    /// movement had ended just before).
    collective_done: Duration,
}

/// A 16 MiB i32 allreduce of `n` members that member `runner` runs on its
/// own thread (its request arrives last), helped by `threads` reduction
/// threads. While it runs, the members in `lost` are lost, each from its
/// own thread, and member `waiter` waits in a barrier on queue 1 that the
/// lost members never join.
///
/// Checks: every `member_lost` returns only after the collective's last
/// write into that member's buffers (its output is complete when the call
/// returns, and unchanged afterwards); the waiter gets PEER_LOST before the
/// collective ends; the survivors get OK with the full result; the lost
/// members' completions are dropped. Returns `None`, having checked
/// nothing, if the collective was done with a lost member before the
/// losses came (a busy machine can delay this thread that long in an
/// optimized build).
fn try_lose_during_a_big_allreduce(
    n: u32,
    runner: u32,
    lost: &[u32],
    waiter: u32,
    threads: usize,
) -> Option<LossFigures> {
    assert!(!lost.contains(&waiter));
    let mut rng = Rng::new(47);
    // Long enough in a debug build that the losses land in the middle.
    let c = Coll::new(Opcode::Allreduce, Dtype::I32, ReduceOp::Sum, 4 << 20);
    let inputs = c.inputs(n, &mut rng);
    let want = c.expected(&inputs, &vec![false; n as usize]);
    let mut cfg = config(n);
    cfg.reduce_threads = threads;
    let mut w = World::with_region(cfg, 20 << 20);
    let built: Vec<Built> = (0..n)
        .map(|r| build(&mut w, r, &c.header(false), &inputs[r as usize], &[]))
        .collect();
    let d = barrier_descs(&mut w, waiter);
    let barrier = w.submit(waiter, 1, &d);
    let mut big: Vec<Option<Pending>> = (0..n)
        .map(|r| (r != runner).then(|| w.submit(r, 0, &built[r as usize].descs)))
        .collect();
    let (group, hub, mut parts) = w.into_parts();
    let mems: Vec<Arc<GuestMem>> = parts.iter().map(|(m, _)| m.mem.clone()).collect();
    let (mut m_run, done_run) = parts.swap_remove(runner as usize);
    let descs = built[runner as usize].descs.clone();
    let run_thread = {
        let group = group.clone();
        std::thread::spawn(move || m_run.submit(&group, runner, 0, &descs, &done_run))
    };
    // The collective runs once its skew is recorded.
    let deadline = Instant::now() + Duration::from_secs(10);
    while group.metrics().skew_count() == 0 {
        assert!(Instant::now() < deadline, "the collective never ran");
        std::thread::yield_now();
    }
    let too_late = lost.iter().any(|&l| {
        let end = &want[l as usize][want[l as usize].len() - 64..];
        tail_in(&mems[l as usize], &built[l as usize].outputs, 64) == end
    });
    if too_late {
        run_thread.join().unwrap();
        return None;
    }
    let t = Instant::now();
    let losers: Vec<_> = lost
        .iter()
        .map(|&l| {
            let group = group.clone();
            let mem = mems[l as usize].clone();
            let outputs = built[l as usize].outputs.clone();
            std::thread::spawn(move || {
                group.member_lost(l);
                let at = Instant::now();
                (at, gather_in(&mem, &outputs))
            })
        })
        .collect();
    let returned: Vec<(Instant, Vec<u8>)> = losers.into_iter().map(|h| h.join().unwrap()).collect();
    big[runner as usize] = Some(run_thread.join().unwrap());

    let failed = hub
        .wait_for(&barrier, Duration::from_secs(10))
        .expect("the waiting barrier failed");
    let r = VirtioDmlcResp::read_from_bytes(&gather_in(
        &mems[waiter as usize],
        &[Desc::w(barrier.resp, RESP_SIZE as u32)],
    ))
    .unwrap();
    assert_eq!(Status::from_raw(r.status.get()), Some(Status::PeerLost));
    assert!(lost.contains(&r.peer.get()), "peer {}", r.peer.get());
    assert_eq!(failed.written as usize, RESP_SIZE);

    let mut collective_done = None::<Instant>;
    for r in 0..n {
        let p = big[r as usize].unwrap();
        let outputs = &built[r as usize].outputs;
        let mem = &mems[r as usize];
        if lost.contains(&r) {
            assert!(hub.wait_for(&p, Duration::from_millis(50)).is_none());
            continue;
        }
        let done = hub
            .wait_for(&p, Duration::from_secs(10))
            .unwrap_or_else(|| panic!("no completion for member {r}"));
        let b = gather_in(mem, &[Desc::w(p.resp, RESP_SIZE as u32)]);
        let resp = VirtioDmlcResp::read_from_bytes(&b).unwrap();
        assert_eq!(Status::from_raw(resp.status.get()), Some(Status::Ok));
        assert!(
            gather_in(mem, outputs) == want[r as usize],
            "member {r}'s sum"
        );
        collective_done = Some(collective_done.map_or(done.at, |d| d.min(done.at)));
    }
    let collective_done = collective_done.unwrap();
    assert!(
        failed.at < collective_done,
        "PEER_LOST came only after the running collective"
    );
    for (&l, (_, at_return)) in lost.iter().zip(&returned) {
        let now = gather_in(&mems[l as usize], &built[l as usize].outputs);
        assert!(
            *at_return == want[l as usize],
            "member {l}'s buffers were still being written when its loss returned"
        );
        assert!(
            now == *at_return,
            "member {l}'s buffers changed after its loss"
        );
    }
    assert_eq!(group.metrics().pending(), 0);
    let last_return = returned.iter().map(|(at, _)| *at).max().unwrap();
    let figures = LossFigures {
        peer_lost: failed.at.saturating_duration_since(t),
        lose_returned: last_return.saturating_duration_since(t),
        collective_done: collective_done.saturating_duration_since(t),
    };
    eprintln!(
        "16 MiB allreduce of {n} run by member {runner} ({threads} reduction threads), \
         members {lost:?} lost: {figures:?}"
    );
    // The others' failures are delivered before the loss waits.
    assert!(figures.peer_lost <= figures.lose_returned, "{figures:?}");
    Some(figures)
}

/// [`try_lose_during_a_big_allreduce`] until the losses come in the middle
/// of the collective (the first time, in a debug build).
fn lose_during_a_big_allreduce(
    n: u32,
    runner: u32,
    lost: &[u32],
    waiter: u32,
    threads: usize,
) -> LossFigures {
    for _ in 0..5 {
        if let Some(f) = try_lose_during_a_big_allreduce(n, runner, lost, waiter, threads) {
            return f;
        }
        eprintln!("the collective was done before the losses; again");
    }
    panic!("the losses never came in the middle of the collective");
}

/// The gap of a reset answered while another member's thread still
/// writes the reset member's buffers: the loss waits for the collective.
#[test]
fn a_loss_waits_for_a_collective_that_another_member_runs() {
    for threads in [0, 2] {
        let f = lose_during_a_big_allreduce(3, 0, &[1], 2, threads);
        // The loss came in the middle, so it waited for a good part of it.
        assert!(f.lose_returned > f.peer_lost, "{f:?}");
        assert!(f.collective_done > f.peer_lost, "{f:?}");
    }
}

/// The lost member's own thread runs the collective (its arrival came
/// last): the others' waiting collectives fail at once, and the loss
/// returns once the collective is done with the member's memory.
#[test]
fn a_loss_waits_for_a_collective_that_its_own_thread_runs() {
    lose_during_a_big_allreduce(3, 1, &[1], 2, 0);
}

/// Two members lost at once, one of them the runner, with reduction
/// threads (which may move the last bytes after the runner's thread has
/// left): neither loss returns early and neither deadlocks.
#[test]
fn two_losses_at_once_both_wait_for_the_running_collective() {
    lose_during_a_big_allreduce(4, 1, &[1, 2], 3, 2);
}

/// Config with the test faults `spec`.
fn faulty(n: u32, threads: usize, spec: &str) -> super::GroupConfig {
    let mut cfg = config(n);
    cfg.reduce_threads = threads;
    cfg.faults = crate::fault::Faults::parse(spec).unwrap();
    cfg
}

/// Runs an i32 sum allreduce of `count` on queue 0 and returns every
/// member's result.
fn allreduce_i32(w: &mut World, count: u64, rng: &mut Rng) -> (Coll, Vec<Vec<u8>>, Vec<Result1>) {
    let n = w.members.len() as u32;
    let c = Coll::new(Opcode::Allreduce, Dtype::I32, ReduceOp::Sum, count);
    let inputs = c.inputs(n, rng);
    let hdrs = vec![c.header(false); n as usize];
    // The last to arrive runs it: rank 0.
    let order: Vec<u32> = (0..n).rev().collect();
    let res = run(w, 0, &hdrs, &inputs, &|_| vec![], &order);
    let want = c.expected(&inputs, &vec![false; n as usize]);
    (c, want, res)
}

/// A panic in the data movement of a collective (planned with the
/// `panic-reduce` test fault), small (on the arriving thread) or split
/// (on the reduction threads and the arriving one): every member gets
/// RESET in the new generation, so does a collective waiting on another
/// queue, the daemon's threads keep serving, a loss does not wait for the
/// failed collective, and the next allreduce is bitwise correct.
#[test]
fn a_panic_in_a_collective_fails_it_on_every_member_and_the_group_serves_on() {
    let n = 3;
    let mut rng = Rng::new(53);
    for (threads, count) in [(0usize, 7u64), (2, 7), (0, 300_000), (3, 3 << 18)] {
        let what = format!("{threads} threads, {count} elements");
        let mut w = World::with_region(faulty(n, threads, "panic-reduce:1"), 16 << 20);
        // Collective 0 runs as usual.
        let (_, want, res) = allreduce_i32(&mut w, count, &mut rng);
        for (r, got) in res.iter().enumerate() {
            assert_eq!(got.resp, ok_resp(1), "{what}");
            assert!(got.output == want[r], "{what}");
        }
        // A barrier of member 0 waits on queue 1 meanwhile.
        let d = barrier_descs(&mut w, 0);
        let waiting = w.submit(0, 1, &d);
        // Collective 1 panics.
        let (_, _, res) = allreduce_i32(&mut w, count, &mut rng);
        for got in &res {
            assert_eq!(got.resp, resp(Status::Reset, 0, NO_PEER, 2), "{what}");
            assert_eq!(got.written as usize, RESP_SIZE + 4 * count as usize);
        }
        assert_eq!(
            w.wait(&waiting).1,
            resp(Status::Reset, 0, NO_PEER, 2),
            "{what}"
        );
        assert_eq!(w.group.generation(), 2, "{what}");
        assert_eq!(w.group.metrics().errors(Status::Reset), 4, "{what}");
        assert_eq!(w.group.live_workers(), threads, "{what}");
        assert_eq!(w.group.metrics().pending(), 0, "{what}");
        // The next collective is right, bit for bit.
        let (_, want, res) = allreduce_i32(&mut w, count, &mut rng);
        for (r, got) in res.iter().enumerate() {
            assert_eq!(got.resp, ok_resp(2), "{what}");
            assert!(got.output == want[r], "{what} rank {r}");
        }
        // The failed collective is no longer counted as running: a loss
        // returns (from another thread, so that a hang fails the test).
        let group = w.group.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            group.member_lost(2);
            tx.send(()).unwrap();
        });
        rx.recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|_| panic!("{what}: a loss waits for the failed collective"));
        assert_eq!(w.group.generation(), 3);
    }
}

/// The panic lands on a reduction thread (the panicking part is the last
/// one, which a helper takes unless the arriving thread gets there
/// first): the thread survives and keeps taking parts.
#[test]
fn a_reduction_thread_that_panics_keeps_serving() {
    let n = 2;
    let mut rng = Rng::new(59);
    let threads = 3;
    let tries = 8;
    let plan: Vec<String> = (0..tries).map(|i| format!("panic-reduce:{i}")).collect();
    let mut w = World::with_region(faulty(n, threads, &plan.join(",")), 16 << 20);
    let mut generation = 1;
    for i in 0..tries {
        let (_, _, res) = allreduce_i32(&mut w, 300_000, &mut rng);
        generation += 1;
        for got in &res {
            assert_eq!(
                got.resp,
                resp(Status::Reset, 0, NO_PEER, generation),
                "try {i}"
            );
        }
    }
    assert!(
        w.group.worker_panics() > 0,
        "no panic reached a reduction thread in {tries} tries"
    );
    assert_eq!(w.group.live_workers(), threads);
    let splits = w.group.metrics().split_count();
    let (_, want, res) = allreduce_i32(&mut w, 300_000, &mut rng);
    for (r, got) in res.iter().enumerate() {
        assert_eq!(got.resp, ok_resp(generation));
        assert!(got.output == want[r], "rank {r}");
    }
    assert_eq!(w.group.metrics().split_count(), splits + 1);
}

/// The `skip-write` test fault: the N-th data-moving collective (barriers
/// do not count) completes with OK everywhere, but one rank's output is
/// left as it was; the collectives before and after are right.
#[test]
fn skip_write_leaves_one_ranks_output_unwritten_and_nothing_else() {
    let n = 3;
    let mut rng = Rng::new(61);
    for (threads, count) in [(0usize, 5u64), (2, 3 << 18)] {
        let mut w = World::with_region(faulty(n, threads, "skip-write:1:1"), 16 << 20);
        for i in 0..3 {
            // A barrier before each: it moves no data, so it is not counted.
            let pend: Vec<Pending> = (0..n)
                .map(|r| {
                    let d = barrier_descs(&mut w, r);
                    w.submit(r, 2, &d)
                })
                .collect();
            for p in &pend {
                assert_eq!(w.wait(p).1, ok_resp(1));
            }
            let (_, want, res) = allreduce_i32(&mut w, count, &mut rng);
            for (r, got) in res.iter().enumerate() {
                assert_eq!(got.resp, ok_resp(1), "collective {i} rank {r}");
                if i == 1 && r == 1 {
                    assert!(got.output.iter().all(|&b| b == 0x5a), "rank 1 written");
                } else {
                    assert!(got.output == want[r], "collective {i} rank {r}");
                }
            }
        }
    }
}

/// Every float dtype and op through the whole engine, with signalling and
/// quiet NaNs in either member's input: every NaN result is quiet, and
/// min/max give the first NaN (rank order), quieted.
#[test]
fn nan_results_are_quiet_through_the_engine() {
    let n = 2;
    let mut w = World::new(config(n));
    // (dtype, signalling NaN, quiet NaN, quiet bit, 2.0)
    let cases: [(Dtype, u64, u64, u64, u64); 4] = [
        (
            Dtype::F32,
            0x7f80_0001,
            0xffc0_0007,
            1 << 22,
            2f32.to_bits().into(),
        ),
        (
            Dtype::F64,
            0xfff0_0000_0000_0003,
            0x7ff8_0000_0000_0009,
            1 << 51,
            2f64.to_bits(),
        ),
        (Dtype::F16, 0x7c01, 0xfe03, 1 << 9, 0x4000),
        (Dtype::Bf16, 0xff81, 0x7fc5, 1 << 6, 0x4000),
    ];
    for (dtype, snan, qnan, quiet, two) in cases {
        let es = dtype.size();
        let enc = |v: &[u64]| -> Vec<u8> {
            v.iter()
                .flat_map(|x| x.to_le_bytes()[..es].to_vec())
                .collect()
        };
        // Elements: sNaN/2, 2/sNaN, qNaN/2, 2/qNaN, sNaN/qNaN, qNaN/sNaN.
        let a = enc(&[snan, two, qnan, two, snan, qnan]);
        let b = enc(&[two, snan, two, qnan, qnan, snan]);
        let firsts = [snan, snan, qnan, qnan, snan, qnan];
        for op in [
            ReduceOp::Sum,
            ReduceOp::Prod,
            ReduceOp::Min,
            ReduceOp::Max,
            ReduceOp::Avg,
        ] {
            let c = Coll::new(Opcode::Allreduce, dtype, op, 6);
            let res = run(
                &mut w,
                0,
                &[c.header(false); 2],
                &[a.clone(), b.clone()],
                &|_| vec![],
                &[0, 1],
            );
            for got in &res {
                assert_eq!(got.resp, ok_resp(1));
                for (e, first) in firsts.iter().enumerate() {
                    let mut x = [0u8; 8];
                    x[..es].copy_from_slice(&got.output[e * es..(e + 1) * es]);
                    let x = u64::from_le_bytes(x);
                    assert_ne!(x & quiet, 0, "{dtype} {op} element {e}: {x:#x} not quiet");
                    if matches!(op, ReduceOp::Min | ReduceOp::Max) {
                        assert_eq!(x, first | quiet, "{dtype} {op} element {e}");
                    }
                }
            }
        }
    }
}

/// A completion that records the generation config space shows when it
/// is made, and can hold the completing thread until released.
struct Probe {
    group: std::sync::OnceLock<std::sync::Weak<Group>>,
    seen: std::sync::Mutex<Vec<u32>>,
    hold: std::sync::Mutex<Option<std::sync::mpsc::Receiver<()>>>,
    inner: Arc<dyn super::Completion>,
}

impl super::Completion for Probe {
    fn put(&self, queue: u16, head: u16, written: u32) -> bool {
        let group = self.group.get().and_then(std::sync::Weak::upgrade).unwrap();
        self.seen.lock().unwrap().push(group.generation());
        if let Some(rx) = self.hold.lock().unwrap().take() {
            rx.recv().unwrap();
        }
        self.inner.put(queue, head, written)
    }

    fn notify(&self, queue: u16) {
        self.inner.notify(queue);
    }
}

/// A generation change makes the new generation visible in config space
/// only once every request it fails has been completed, and once every
/// collective running at the change has completed on every member; their
/// responses carry the new generation all the same.
#[test]
fn config_space_shows_a_new_generation_only_after_its_failures_are_completed() {
    let n = 3;
    let (group, hub, parts) = World::new(config(n)).into_parts();
    let probes: Vec<Arc<Probe>> = parts
        .iter()
        .map(|(_, done)| {
            let p = Arc::new(Probe {
                group: std::sync::OnceLock::new(),
                seen: std::sync::Mutex::new(Vec::new()),
                hold: std::sync::Mutex::new(None),
                inner: done.clone(),
            });
            p.group.set(Arc::downgrade(&group)).unwrap();
            p
        })
        .collect();
    let dones: Vec<Arc<dyn super::Completion>> = probes.iter().map(|p| p.clone() as _).collect();
    let mut members: Vec<_> = parts.into_iter().map(|(m, _)| m).collect();
    let barrier = hdr(Opcode::Barrier.raw(), 0, 0, 0, 0, 0, 0, 0);

    // Members 0 and 1 wait in a barrier; member 2 is lost.
    let mut waiting = Vec::new();
    for r in 0..2 {
        let m = &mut members[r];
        let d = vec![m.header(&barrier), m.response()];
        waiting.push(m.submit(&group, r as u32, 0, &d, &dones[r]));
    }
    group.member_lost(2);
    assert_eq!(group.generation(), 2);
    for (r, p) in waiting.iter().enumerate() {
        assert!(hub.wait_for(p, Duration::from_secs(10)).is_some());
        let got = VirtioDmlcResp::read_from_bytes(&members[r].read(p.resp, RESP_SIZE)).unwrap();
        assert_eq!(got, resp(Status::PeerLost, 0, 2, 2));
        assert_eq!(
            probes[r].seen.lock().unwrap()[..],
            [1],
            "rank {r} saw the new generation first"
        );
    }
    group.member_ready(2);

    // A collective of all three runs on member 1's thread; member 0's
    // completion holds that thread while member 2 is lost again.
    let (release, held) = std::sync::mpsc::channel();
    *probes[0].hold.lock().unwrap() = Some(held);
    let mut pend = Vec::new();
    for r in [0usize, 2] {
        let m = &mut members[r];
        let d = vec![m.header(&barrier), m.response()];
        pend.push(m.submit(&group, r as u32, 1, &d, &dones[r]));
    }
    let mut m1 = members.remove(1);
    let d1 = vec![m1.header(&barrier), m1.response()];
    let done1 = dones[1].clone();
    let runner = {
        let group = group.clone();
        std::thread::spawn(move || m1.submit(&group, 1, 1, &d1, &done1))
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while probes[0].seen.lock().unwrap().len() < 2 {
        assert!(Instant::now() < deadline, "the collective never completed");
        std::thread::yield_now();
    }
    group.member_lost(2);
    // Member 1's completion of the running collective is still to come.
    assert_eq!(
        group.generation(),
        2,
        "shown before the running collective completed"
    );
    release.send(()).unwrap();
    let p1 = runner.join().unwrap();
    assert!(hub.wait_for(&p1, Duration::from_secs(10)).is_some());
    assert!(hub.wait_for(&pend[0], Duration::from_secs(10)).is_some());
    assert_eq!(probes[1].seen.lock().unwrap()[..], [1, 2]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while group.generation() != 3 {
        assert!(Instant::now() < deadline, "generation 3 never shown");
        std::thread::yield_now();
    }
}

/// The generation never takes the value 0: it starts at 1, goes up by
/// one per change, and wraps from `u32::MAX` to 1.
/// Logs each put and notification of its member, in one log shared by the
/// group, and asks to be notified after every put.
struct Logged {
    rank: u32,
    log: Arc<std::sync::Mutex<Vec<(&'static str, u32)>>>,
    inner: Arc<dyn super::Completion>,
}

impl super::Completion for Logged {
    fn put(&self, queue: u16, head: u16, written: u32) -> bool {
        self.log.lock().unwrap().push(("put", self.rank));
        self.inner.put(queue, head, written);
        true
    }

    fn notify(&self, queue: u16) {
        self.log.lock().unwrap().push(("notify", self.rank));
        self.inner.notify(queue);
    }
}

/// Every member of a collective gets its used element before any of them
/// is notified, for a collective that moves data and for a mismatch: a
/// notification can hand the CPU to the woken frontend, and a daemon
/// killed then would leave the members one collective apart.
#[test]
fn a_collective_puts_every_member_before_notifying_any() {
    let n = 3;
    let (group, hub, parts) = World::new(config(n)).into_parts();
    let log = Arc::new(std::sync::Mutex::new(Vec::new()));
    let dones: Vec<Arc<dyn super::Completion>> = parts
        .iter()
        .enumerate()
        .map(|(r, (_, done))| {
            Arc::new(Logged {
                rank: r as u32,
                log: log.clone(),
                inner: done.clone(),
            }) as _
        })
        .collect();
    let mut members: Vec<_> = parts.into_iter().map(|(m, _)| m).collect();
    let count = 4u64;
    for tags in [[7u64, 7, 7], [1, 2, 1]] {
        log.lock().unwrap().clear();
        let mut pend = Vec::new();
        for (r, m) in members.iter_mut().enumerate() {
            let h = hdr(
                Opcode::Allreduce.raw(),
                Dtype::F32.raw(),
                ReduceOp::Sum.raw(),
                0,
                count,
                tags[r],
                0,
                0,
            );
            let input: Vec<u8> = (0..count).flat_map(|i| (i as f32).to_le_bytes()).collect();
            let mut d = vec![m.header(&h)];
            d.extend(m.segments(&input, &[], false));
            d.extend(m.segments(&vec![0; input.len()], &[], true));
            d.push(m.response());
            pend.push(m.submit(&group, r as u32, 0, &d, &dones[r]));
        }
        for p in &pend {
            assert!(hub.wait_for(p, Duration::from_secs(10)).is_some());
        }
        let got = log.lock().unwrap().clone();
        let puts = got.iter().filter(|(what, _)| *what == "put").count();
        let first_notify = got.iter().position(|(what, _)| *what == "notify");
        assert_eq!(puts, n as usize, "tags {tags:?}: {got:?}");
        assert_eq!(first_notify, Some(n as usize), "tags {tags:?}: {got:?}");
        assert_eq!(got.len(), 2 * n as usize, "tags {tags:?}: {got:?}");
    }
}

#[test]
fn generation_starts_at_one_and_wraps_past_zero() {
    assert_eq!(super::generation_of(0), 1);
    assert_eq!(super::generation_of(1), 2);
    let last = u64::from(u32::MAX) - 1;
    assert_eq!(super::generation_of(last), u32::MAX);
    assert_eq!(super::generation_of(last + 1), 1);
    assert_eq!(super::generation_of(last + 2), 2);
    for era in [0, last, last + 1, 2 * last + 1, 2 * last + 2, u64::MAX] {
        assert_ne!(super::generation_of(era), 0, "era {era}");
    }
    assert_eq!(World::new(config(2)).group.generation(), 1);
}

/// Every member reads the same configuration space but for `rank`, which
/// is its own and differs from every other member's, also after the
/// generation changed.
#[test]
fn every_member_sees_the_same_config_but_its_own_rank() {
    let n = 4;
    let w = World::new(config(n));
    for lost in [None, Some(2)] {
        if let Some(r) = lost {
            w.group.member_lost(r);
            w.group.member_ready(r);
        }
        let spaces: Vec<_> = (0..n).map(|r| w.group.config_space(r)).collect();
        for (r, c) in spaces.iter().enumerate() {
            assert_eq!(c.base.rank.get(), r as u32);
            let mut same = *c;
            same.base.rank = spaces[0].base.rank;
            assert_eq!(same, spaces[0], "rank {r}");
        }
        let want = if lost.is_some() { 2 } else { 1 };
        assert_eq!(spaces[0].base.generation.get(), want);
    }
}

/// The device reads a header once, when the request arrives: a driver that
/// rewrites the header memory afterwards changes nothing (here the tag,
/// which would otherwise be a mismatch).
#[test]
fn a_header_rewritten_after_arrival_has_no_effect() {
    let mut w = World::new(config(2));
    let tagged = |tag| hdr(Opcode::Barrier.raw(), 0, 0, 0, 0, tag, 0, 0);
    let d0 = {
        let m = &mut w.members[0];
        vec![m.header(&tagged(5)), m.response()]
    };
    let p0 = w.submit(0, 0, &d0);
    assert!(w.is_pending(&p0));
    w.members[0].write(d0[0].addr, tagged(6).as_bytes());
    let d1 = {
        let m = &mut w.members[1];
        vec![m.header(&tagged(5)), m.response()]
    };
    let p1 = w.submit(1, 0, &d1);
    assert_eq!(w.wait(&p1).1, ok_resp(1));
    assert_eq!(w.wait(&p0).1, ok_resp(1));
}

mod blocks;
mod comms;
mod freeze;
mod nonfinite;
mod timed;

/// `split` cuts every piece into page-aligned ranges that cover it in
/// order, at least `MIN_PART` long but a piece's last, a few per thread.
#[test]
fn split_ranges_are_page_aligned_and_cover_every_piece() {
    use super::pieces::{split, BufAt, Piece, MIN_PART, PARTS_PER_THREAD, PART_ALIGN};
    let at = BufAt {
        member: 0,
        output: false,
        base: 0,
    };
    let piece = |len| Piece::Copy {
        src: at,
        dsts: vec![],
        len,
    };
    for threads in [1, 2, 7] {
        for lens in [
            vec![1 << 20],
            vec![64 << 20],
            vec![(3 << 20) + 4, 12, 1 << 20],
            vec![(64 << 20) - 8],
        ] {
            let pieces: Vec<Piece> = lens.iter().map(|&l| piece(l)).collect();
            let parts = split(&pieces, threads);
            let total: usize = lens.iter().sum();
            let most = (PARTS_PER_THREAD * (threads + 1)).max(total.div_ceil(MIN_PART));
            assert!(parts.len() <= most + lens.len(), "{threads} {lens:?}");
            for (i, &len) in lens.iter().enumerate() {
                let mine: Vec<_> = parts.iter().filter(|p| p.0 == i).collect();
                let mut next = 0;
                for (k, &&(_, start, n)) in mine.iter().enumerate() {
                    assert_eq!(start, next, "{threads} {lens:?}: in order, no gaps");
                    assert_eq!(start % PART_ALIGN, 0, "{threads} {lens:?}: aligned");
                    if k + 1 < mine.len() {
                        assert!(n >= MIN_PART && n % PART_ALIGN == 0, "{threads} {lens:?}");
                    }
                    next += n;
                }
                assert_eq!(next, len, "{threads} {lens:?}: covered");
            }
        }
    }
}
