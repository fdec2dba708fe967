//! Non-finite origin (spec 5.X.6.14, feature bit 4): a request with
//! `FLAG_CHECK_FINITE` completes with NONFINITE naming the lowest rank and
//! element whose input was a NaN or an infinity, whatever the split over
//! the reduction threads; the outputs are those of the unchecked
//! reduction. Every expected rank and index is placed by the test.

use virtio_dmlc::comm::VirtioDmlcRespComm;
use virtio_dmlc::{
    bad, Dtype, Opcode, ReduceOp, Status, FLAG_CHECK_FINITE, FLAG_IN_PLACE, NO_PEER,
    VIRTIO_DMLC_F_NONFINITE,
};

use super::comms::{creq, post, post_onto, status, FEATURES as COMM_FEATURES};
use super::*;

const FEATURES: u64 = COMM_FEATURES | 1 << VIRTIO_DMLC_F_NONFINITE;

/// `n` members whose drivers negotiated bits 1, 2 and 4, with `threads`
/// reduction threads and room for big buffers.
fn nf_world(n: u32, threads: usize) -> World {
    let mut cfg = config(n);
    cfg.reduce_threads = threads;
    let w = World::with_region(cfg, 24 << 20);
    for r in 0..n {
        w.group.set_member_features(r, FEATURES);
    }
    w
}

/// The bits of `v` as an element of the float `dtype`, little-endian.
fn elem(dtype: Dtype, v: f64) -> Vec<u8> {
    match dtype {
        Dtype::F32 => (v as f32).to_le_bytes().to_vec(),
        Dtype::F64 => v.to_le_bytes().to_vec(),
        Dtype::F16 => half::f16::from_f64(v).to_le_bytes().to_vec(),
        Dtype::Bf16 => half::bf16::from_f64(v).to_le_bytes().to_vec(),
        _ => unreachable!("a float dtype"),
    }
}

/// Member inputs of `elems` elements of `dtype` (small finite values), with
/// the non-finite values `bad` placed at (rank, element).
fn inputs(dtype: Dtype, n: u32, elems: usize, bad: &[(u32, usize, f64)]) -> Vec<Vec<u8>> {
    let mut ins: Vec<Vec<u8>> = (0..n)
        .map(|r| {
            (0..elems)
                .flat_map(|i| elem(dtype, ((i + r as usize) % 7) as f64 - 3.0))
                .collect()
        })
        .collect();
    let size = dtype.size();
    for &(r, i, v) in bad {
        ins[r as usize][i * size..(i + 1) * size].copy_from_slice(&elem(dtype, v));
    }
    ins
}

/// Runs one collective: member `r` posts `ins[r]` (in place when
/// `in_place[r]`) with `flags[r]`; returns every member's response and
/// output.
#[allow(clippy::too_many_arguments)]
fn run_coll(
    w: &mut World,
    opcode: Opcode,
    dtype: Dtype,
    op: ReduceOp,
    count: u64,
    ins: &[Vec<u8>],
    flags: &[u32],
    in_place: &[bool],
    tag: u64,
) -> Vec<(VirtioDmlcRespComm, Vec<u8>)> {
    let n = ins.len() as u32;
    let size = dtype.size();
    let posted: Vec<_> = (0..n)
        .map(|r| {
            let mut h = creq(opcode.raw(), 0, 0, 0, count, tag, 0, &[]);
            h.base.dtype = dtype.raw();
            h.base.op = op.raw();
            let ip = in_place[r as usize];
            h.base.flags = (flags[r as usize] | if ip { FLAG_IN_PLACE } else { 0 }).into();
            let out_elems = match opcode {
                Opcode::ReduceScatter if !ip => count as usize,
                Opcode::Reduce if r != 0 && !ip => 0,
                _ => ins[r as usize].len() / size,
            };
            if ip {
                post_onto(w, r, 0, &h, &[], &[], &ins[r as usize])
            } else {
                post(w, r, 0, &h, &[], &ins[r as usize], out_elems * size)
            }
        })
        .collect();
    posted
        .iter()
        .enumerate()
        .map(|(r, p)| {
            let (_, resp) = w.wait_comm(&p.p);
            let out = p
                .out
                .map(|d| w.members[r].read(d.addr, d.len as usize))
                .unwrap_or_default();
            (resp, out)
        })
        .collect()
}

fn assert_non_finite(got: &[(VirtioDmlcRespComm, Vec<u8>)], rank: u32, index: u64, what: &str) {
    for (r, (resp, _)) in got.iter().enumerate() {
        assert_eq!(status(resp), (Status::NonFinite, 0), "{what}: rank {r}");
        assert_eq!(resp.base.peer.get(), rank, "{what}: rank {r}: peer");
        assert_eq!(resp.peer_world.get(), rank, "{what}: rank {r}: peer_world");
        assert_eq!(resp.length.get(), index, "{what}: rank {r}: index");
    }
}

/// Every float dtype, out of place and in place: NaN in rank 2, +Inf in
/// rank 0 and -Inf in rank 1 (rank 0 wins though its element is the
/// highest); NaN in rank 0 and rank 2 (rank 0 wins); every member gets
/// the same rank and element, and the outputs are those of the same
/// collective without the flag.
#[test]
fn the_lowest_rank_then_the_lowest_element_is_named_on_every_member() {
    let n = 3;
    let mut w = nf_world(n, 0);
    let elems = 1000;
    let mut tag = 0;
    for dtype in [Dtype::F32, Dtype::F64, Dtype::F16, Dtype::Bf16] {
        for (bad, want) in [
            (
                vec![
                    (2, 5, f64::NAN),
                    (0, 700, f64::INFINITY),
                    (1, 3, f64::NEG_INFINITY),
                    (0, 900, f64::NAN),
                ],
                (0, 700),
            ),
            (vec![(2, 1, f64::NAN), (0, 999, -f64::NAN)], (0, 999)),
            (vec![(1, 0, f64::NEG_INFINITY)], (1, 0)),
        ] {
            for ip in [[false; 3], [true, false, true]] {
                let ins = inputs(dtype, n, elems, &bad);
                let what = format!("{dtype} {bad:?} in place {ip:?}");
                tag += 1;
                let checked = run_coll(
                    &mut w,
                    Opcode::Allreduce,
                    dtype,
                    ReduceOp::Sum,
                    elems as u64,
                    &ins,
                    &[FLAG_CHECK_FINITE; 3],
                    &ip,
                    tag,
                );
                assert_non_finite(&checked, want.0, want.1, &what);
                tag += 1;
                let plain = run_coll(
                    &mut w,
                    Opcode::Allreduce,
                    dtype,
                    ReduceOp::Sum,
                    elems as u64,
                    &ins,
                    &[0; 3],
                    &ip,
                    tag,
                );
                for (r, ((c, co), (p, po))) in checked.iter().zip(&plain).enumerate() {
                    // Without the flag: OK, the NaN in the output as today.
                    assert_eq!(status(p), (Status::Ok, 0), "{what}: rank {r}");
                    assert_eq!(p.base.peer.get(), NO_PEER);
                    assert_eq!(c.base.generation, p.base.generation);
                    if let Err(e) = dmlc_reduce::reference::check(dtype, co, po) {
                        panic!("{what}: rank {r}: output: {e}");
                    }
                }
            }
        }
    }
}

/// A collective split over reduction threads names the same (rank,
/// element) as inline: the non-finite values lie in ranges that different
/// threads reduce, and the lowest rank's lies in the last range.
#[test]
fn threads_agree_on_the_lexicographic_minimum() {
    let n = 3;
    let elems = 3 << 18; // 3 MiB of f32 per member: split into many ranges.
    let bad = [
        (2, 0, f64::NAN),
        (1, elems - 1, f64::INFINITY),
        (1, elems / 2 + 17, f64::NAN),
        (2, elems / 3, f64::NEG_INFINITY),
    ];
    let ins = inputs(Dtype::F32, n, elems, &bad);
    for threads in [3usize, 0] {
        let mut w = nf_world(n, threads);
        let got = run_coll(
            &mut w,
            Opcode::Allreduce,
            Dtype::F32,
            ReduceOp::Sum,
            elems as u64,
            &ins,
            &[FLAG_CHECK_FINITE; 3],
            &[false, true, false],
            1,
        );
        assert_non_finite(
            &got,
            1,
            (elems / 2 + 17) as u64,
            &format!("threads {threads}"),
        );
        assert_eq!(
            w.group.metrics().split_count(),
            if threads > 0 { 1 } else { 0 }
        );
    }
}

/// reduce_scatter counts the element in the member's whole input (block
/// `r` starts at `r * count`) and reduce checks every member's input, the
/// root's output only being written; a member without the flag completes
/// with OK; max and min, which may not carry an infinity to the output,
/// are checked all the same.
#[test]
fn every_reducing_opcode_is_checked_and_members_without_the_flag_get_ok() {
    let n = 3;
    let mut w = nf_world(n, 0);
    let count = 100;
    let ins = inputs(Dtype::F32, n, 3 * count, &[(2, 2 * count + 4, f64::NAN)]);
    let got = run_coll(
        &mut w,
        Opcode::ReduceScatter,
        Dtype::F32,
        ReduceOp::Sum,
        count as u64,
        &ins,
        &[FLAG_CHECK_FINITE, 0, FLAG_CHECK_FINITE],
        &[false, false, true],
        1,
    );
    assert_non_finite(&got[..1], 2, (2 * count + 4) as u64, "reduce_scatter");
    assert_non_finite(&got[2..], 2, (2 * count + 4) as u64, "reduce_scatter");
    assert_eq!(status(&got[1].0), (Status::Ok, 0));
    for op in [ReduceOp::Max, ReduceOp::Min] {
        let ins = inputs(Dtype::Bf16, n, count, &[(1, 9, f64::INFINITY)]);
        let got = run_coll(
            &mut w,
            Opcode::Reduce,
            Dtype::Bf16,
            op,
            count as u64,
            &ins,
            &[FLAG_CHECK_FINITE; 3],
            &[false; 3],
            2,
        );
        assert_non_finite(&got, 1, 9, &format!("reduce {op}"));
    }
}

/// The flag on an integer reduction changes nothing; finite float inputs
/// whose sum overflows are finite inputs; the flag of a member that did
/// not negotiate bit 4 is a reserved bit (`BAD_REQUEST` / `FLAGS`), and
/// bit 4 does not count without bit 1.
#[test]
fn the_flag_is_ignored_for_integers_and_reserved_without_bit_4() {
    let n = 2;
    let mut w = nf_world(n, 0);
    let ones: Vec<u8> = [0x7f80_0000u32; 8]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let got = run_coll(
        &mut w,
        Opcode::Allreduce,
        Dtype::U32,
        ReduceOp::Sum,
        8,
        &[ones.clone(), ones],
        &[FLAG_CHECK_FINITE; 2],
        &[false; 2],
        1,
    );
    for (resp, _) in &got {
        assert_eq!(status(resp), (Status::Ok, 0));
    }
    let big: Vec<u8> = [f32::MAX; 4].iter().flat_map(|x| x.to_le_bytes()).collect();
    let got = run_coll(
        &mut w,
        Opcode::Allreduce,
        Dtype::F32,
        ReduceOp::Sum,
        4,
        &[big.clone(), big],
        &[FLAG_CHECK_FINITE; 2],
        &[false; 2],
        2,
    );
    for (resp, out) in &got {
        assert_eq!(status(resp), (Status::Ok, 0));
        assert_eq!(&out[..4], &f32::INFINITY.to_le_bytes());
    }
    for acked in [
        COMM_FEATURES,
        FEATURES & !(1 << virtio_dmlc::comm::VIRTIO_DMLC_F_COMM),
    ] {
        w.group.set_member_features(0, acked);
        let mut h = creq(Opcode::Allreduce.raw(), 0, 0, 0, 4, 3, 0, &[]);
        h.base.flags = FLAG_CHECK_FINITE.into();
        let m = &mut w.members[0];
        let (hdr_desc, resp_desc) = if acked & (1 << virtio_dmlc::comm::VIRTIO_DMLC_F_COMM) != 0 {
            (m.comm_header(&h, &[]), m.comm_response())
        } else {
            (m.header(&h.base), m.response())
        };
        let mut d = vec![hdr_desc];
        d.extend(m.segments(&[0; 16], &[], false));
        d.extend(m.segments(&[0; 16], &[], true));
        d.push(resp_desc);
        let p = w.submit(0, 0, &d);
        let (_, resp) = w.wait(&p);
        assert_eq!(
            (resp.status.get(), resp.detail.get()),
            (Status::BadRequest.raw(), bad::FLAGS),
            "acked {acked:#x}"
        );
    }
}
