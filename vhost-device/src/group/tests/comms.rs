//! Communicators, send and receive (spec 5.X.6.13, feature bits 1 and 2):
//! split, create and free, collectives on communicators, matching of sends
//! and receives, refused requests, losses, limits. Every expected result
//! is computed here from the inputs, not by the engine.

use std::time::Duration;

use virtio_dmlc::comm::{
    CommOpcode, VirtioDmlcReqComm, VirtioDmlcRespComm, ANY_SOURCE, BAD_COMM, BAD_IN_PLACE_OPCODE,
    BAD_PEER, BAD_TABLE, MISMATCH_TABLE, TOO_BIG_COMMS, UNDEFINED, VIRTIO_DMLC_F_COMM,
    VIRTIO_DMLC_F_P2P,
};
use virtio_dmlc::{
    mismatch, unsupported, Dtype, Opcode, ReduceOp, Status, FLAG_IN_PLACE, NO_PEER,
    VIRTIO_DMLC_F_REQ_TIMEOUT,
};

use super::*;

pub(super) const FEATURES: u64 =
    1 << VIRTIO_DMLC_F_COMM | 1 << VIRTIO_DMLC_F_P2P | 1 << VIRTIO_DMLC_F_REQ_TIMEOUT;
pub(super) const F32: u8 = Dtype::F32 as u8;
pub(super) const SUM: u8 = ReduceOp::Sum as u8;

/// `n` members whose drivers negotiated bits 1 and 2.
pub(super) fn comm_world(n: u32) -> World {
    let w = World::new(config(n));
    for r in 0..n {
        w.group.set_member_features(r, FEATURES);
    }
    w
}

/// A header of feature bit 1.
#[allow(clippy::too_many_arguments)]
pub(super) fn creq(
    opcode: u16,
    comm: u32,
    peer: u32,
    key: u32,
    count: u64,
    tag: u64,
    root: u32,
    table: &[u8],
) -> VirtioDmlcReqComm {
    VirtioDmlcReqComm {
        base: hdr(opcode, F32, SUM, root, count, tag, 0, 0),
        comm: comm.into(),
        peer: peer.into(),
        key: key.into(),
        table_bytes: (table.len() as u32).into(),
    }
}

pub(super) struct Posted {
    pub(super) p: Pending,
    pub(super) out: Option<Desc>,
}

/// Submits member `r`'s request `h` (with `table`) on queue `q`, with
/// `input` as its input and `out_len` bytes of output filled with 0x5a.
pub(super) fn post(
    w: &mut World,
    r: u32,
    q: u16,
    h: &VirtioDmlcReqComm,
    table: &[u8],
    input: &[u8],
    out_len: usize,
) -> Posted {
    post_onto(w, r, q, h, table, input, &vec![0x5a; out_len])
}

/// As [`post`], with the output buffer holding `out` before the request.
pub(super) fn post_onto(
    w: &mut World,
    r: u32,
    q: u16,
    h: &VirtioDmlcReqComm,
    table: &[u8],
    input: &[u8],
    out: &[u8],
) -> Posted {
    let m = &mut w.members[r as usize];
    let mut d = vec![m.comm_header(h, table)];
    if !input.is_empty() {
        d.extend(m.segments(input, &[], false));
    }
    let out = (!out.is_empty()).then(|| {
        let a = m.alloc(out.len());
        m.write(a, out);
        Desc::w(a, out.len() as u32)
    });
    d.extend(out);
    d.push(m.comm_response());
    Posted {
        p: w.submit(r, q, &d),
        out,
    }
}

pub(super) fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub(super) fn read_f32s(w: &World, r: u32, d: Desc) -> Vec<f32> {
    w.members[r as usize]
        .read(d.addr, d.len as usize)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

pub(super) fn status(r: &VirtioDmlcRespComm) -> (Status, u32) {
    (
        Status::from_raw(r.base.status.get()).unwrap(),
        r.base.detail.get(),
    )
}

/// Splits communicator `comm` of `ranks` (group ranks, in its rank order)
/// with `(color, key)` per member; returns each member's response.
pub(super) fn split(
    w: &mut World,
    comm: u32,
    ranks: &[u32],
    given: &[(u32, u32)],
) -> Vec<VirtioDmlcRespComm> {
    let posted: Vec<Posted> = ranks
        .iter()
        .zip(given)
        .map(|(&r, &(color, key))| {
            let h = creq(CommOpcode::CommSplit.raw(), comm, color, key, 0, 0, 0, &[]);
            post(w, r, 0, &h, &[], &[], 0)
        })
        .collect();
    posted.iter().map(|x| w.wait_comm(&x.p).1).collect()
}

/// Runs an allreduce (sum of f32) on communicator `comm` by `ranks`, each
/// giving `inputs[i]`; returns each member's response and output.
fn allreduce(
    w: &mut World,
    comm: u32,
    ranks: &[u32],
    inputs: &[Vec<f32>],
) -> Vec<(VirtioDmlcRespComm, Vec<f32>)> {
    let count = inputs[0].len();
    let posted: Vec<Posted> = ranks
        .iter()
        .zip(inputs)
        .map(|(&r, x)| {
            let h = creq(Opcode::Allreduce.raw(), comm, 0, 0, count as u64, 0, 0, &[]);
            post(w, r, 1, &h, &[], &f32s(x), count * 4)
        })
        .collect();
    ranks
        .iter()
        .zip(&posted)
        .map(|(&r, x)| (w.wait_comm(&x.p).1, read_f32s(w, r, x.out.unwrap())))
        .collect()
}

#[test]
fn split_makes_communicators_whose_collectives_are_their_own() {
    let mut w = comm_world(4);
    // Even and odd ranks, ordered by descending rank through the key.
    let given: Vec<(u32, u32)> = (0..4).map(|r| (r % 2, 10 - r)).collect();
    let resps = split(&mut w, 0, &[0, 1, 2, 3], &given);
    for (r, resp) in resps.iter().enumerate() {
        assert_eq!(status(resp), (Status::Ok, 0), "rank {r}");
        // Ranks 2 and 3 come first in their communicators (larger rank,
        // smaller key).
        let want_rank = if r >= 2 { 0 } else { 1 };
        assert_eq!(
            (resp.comm_rank.get(), resp.comm_size.get()),
            (want_rank, 2),
            "rank {r}"
        );
    }
    let even = resps[0].comm.get();
    let odd = resps[1].comm.get();
    assert!(even != 0 && odd != 0 && even != odd);
    assert_eq!(resps[2].comm.get(), even);
    assert_eq!(resps[3].comm.get(), odd);

    // An allreduce on each: the sum of its two members' inputs only.
    let x = |r: u32| vec![r as f32 + 1.0, 10.0 * r as f32];
    for (comm, ranks) in [(even, [2, 0]), (odd, [3, 1])] {
        let out = allreduce(&mut w, comm, &ranks, &[x(ranks[0]), x(ranks[1])]);
        let want: Vec<f32> = (0..2).map(|i| x(ranks[0])[i] + x(ranks[1])[i]).collect();
        for (resp, got) in out {
            assert_eq!(status(&resp), (Status::Ok, 0));
            assert_eq!(got, want);
        }
    }
    // The group's own collectives are numbered apart: this is its second.
    let all: Vec<Vec<f32>> = (0..4).map(x).collect();
    let out = allreduce(&mut w, 0, &[0, 1, 2, 3], &all);
    let want: Vec<f32> = (0..2).map(|i| (0..4).map(|r| x(r)[i]).sum()).collect();
    assert!(out
        .iter()
        .all(|(r, o)| status(r) == (Status::Ok, 0) && *o == want));

    // A broadcast rooted at rank 1 of the even communicator (group rank 0).
    let posted: Vec<(u32, Posted)> = [2u32, 0]
        .iter()
        .map(|&r| {
            let h = creq(Opcode::Broadcast.raw(), even, 0, 0, 2, 0, 1, &[]);
            let input = if r == 0 { f32s(&x(0)) } else { Vec::new() };
            (r, post(&mut w, r, 0, &h, &[], &input, 8))
        })
        .collect();
    for (r, x0) in &posted {
        assert_eq!(status(&w.wait_comm(&x0.p).1), (Status::Ok, 0));
        assert_eq!(read_f32s(&w, *r, x0.out.unwrap()), x(0));
    }

    // Freed: later requests naming it are refused, the other one serves.
    let frees: Vec<Posted> = [0, 2]
        .iter()
        .map(|&r| {
            let h = creq(CommOpcode::CommFree.raw(), even, 0, 0, 0, 0, 0, &[]);
            post(&mut w, r, 0, &h, &[], &[], 0)
        })
        .collect();
    for f in &frees {
        assert_eq!(status(&w.wait_comm(&f.p).1), (Status::Ok, 0));
    }
    let h = creq(Opcode::Barrier.raw(), even, 0, 0, 0, 0, 0, &[]);
    let late = post(&mut w, 0, 2, &h, &[], &[], 0);
    let (_, r) = w.wait_comm(&late.p);
    assert_eq!(status(&r), (Status::BadRequest, BAD_COMM));
    let out = allreduce(&mut w, odd, &[3, 1], &[x(3), x(1)]);
    assert!(out.iter().all(|(r, _)| status(r) == (Status::Ok, 0)));
}

#[test]
fn split_with_undefined_color_and_mismatched_split() {
    let mut w = comm_world(3);
    let resps = split(&mut w, 0, &[0, 1, 2], &[(7, 0), (UNDEFINED, 0), (7, 0)]);
    assert!(resps.iter().all(|r| status(r) == (Status::Ok, 0)));
    assert_eq!(resps[1].comm.get(), 0);
    assert_eq!(resps[0].comm.get(), resps[2].comm.get());
    assert_eq!((resps[2].comm_rank.get(), resps[2].comm_size.get()), (1, 2));
    // Rank 1 is not in it: naming it is BAD_COMM, at once.
    let h = creq(
        Opcode::Barrier.raw(),
        resps[0].comm.get(),
        0,
        0,
        0,
        0,
        0,
        &[],
    );
    let x = post(&mut w, 1, 0, &h, &[], &[], 0);
    assert!(w.wait_for(&x.p, Duration::ZERO).is_some());
    let b = w.members[1].read(x.p.resp, 40);
    let r = <VirtioDmlcRespComm as zerocopy::FromBytes>::read_from_bytes(&b).unwrap();
    assert_eq!(status(&r), (Status::BadRequest, BAD_COMM));
    // A split against a barrier: MISMATCH on the opcode, every member.
    let a = post(
        &mut w,
        0,
        0,
        &creq(CommOpcode::CommSplit.raw(), 0, 1, 0, 0, 0, 0, &[]),
        &[],
        &[],
        0,
    );
    let b: Vec<Posted> = [1, 2]
        .iter()
        .map(|&r| {
            let h = creq(Opcode::Barrier.raw(), 0, 0, 0, 0, 0, 0, &[]);
            post(&mut w, r, 0, &h, &[], &[], 0)
        })
        .collect();
    let (_, ra) = w.wait_comm(&a.p);
    assert_eq!(status(&ra), (Status::Mismatch, mismatch::OPCODE));
    for x in &b {
        assert_eq!(status(&w.wait_comm(&x.p).1).0, Status::Mismatch);
    }
}

#[test]
fn comm_create_is_called_by_the_listed_ranks_only() {
    let mut w = comm_world(4);
    let list = |ranks: &[u32]| -> Vec<u8> { ranks.iter().flat_map(|r| r.to_le_bytes()).collect() };
    // Ranks 3 and 1, in that order; ranks 0 and 2 do nothing.
    let t = list(&[3, 1]);
    let h = creq(CommOpcode::CommCreate.raw(), 0, 0, 0, 0, 9, 0, &t);
    let a = post(&mut w, 1, 0, &h, &t, &[], 0);
    assert!(w.is_pending(&a.p));
    let b = post(&mut w, 3, 2, &h, &t, &[], 0);
    let (ra, rb) = (w.wait_comm(&a.p).1, w.wait_comm(&b.p).1);
    assert_eq!(status(&ra), (Status::Ok, 0));
    assert_eq!(ra.comm.get(), rb.comm.get());
    assert_eq!((ra.comm_rank.get(), rb.comm_rank.get()), (1, 0));
    assert_eq!(ra.comm_size.get(), 2);
    // Its rank 0 is group rank 3.
    let out = allreduce(&mut w, ra.comm.get(), &[3, 1], &[vec![1.0], vec![2.0]]);
    assert!(out.iter().all(|(_, o)| *o == vec![3.0]));

    // Lists that disagree: MISMATCH / TABLE naming the lowest such rank.
    let t1 = list(&[0, 2]);
    let t2 = list(&[2, 0]);
    let x = post(
        &mut w,
        0,
        0,
        &creq(CommOpcode::CommCreate.raw(), 0, 0, 0, 0, 9, 0, &t1),
        &t1,
        &[],
        0,
    );
    let y = post(
        &mut w,
        2,
        0,
        &creq(CommOpcode::CommCreate.raw(), 0, 0, 0, 0, 9, 0, &t2),
        &t2,
        &[],
        0,
    );
    for p in [&x, &y] {
        let (_, r) = w.wait_comm(&p.p);
        assert_eq!(status(&r), (Status::Mismatch, MISMATCH_TABLE));
        assert_eq!((r.base.peer.get(), r.peer_world.get()), (2, 2));
    }
}

#[test]
fn send_and_receive_match_in_order_with_any_source_and_sizes() {
    let mut w = comm_world(3);
    let send =
        |to: u32, count: u64, tag: u64| creq(CommOpcode::Send.raw(), 0, to, 0, count, tag, 0, &[]);
    let recv = |from: u32, count: u64, tag: u64| {
        creq(CommOpcode::Recv.raw(), 0, from, 0, count, tag, 0, &[])
    };
    // Two messages 0 -> 1 with tag 5, on different queues, then a receive
    // from any source and one from 0: they arrive in order.
    let m1 = [1.0f32, 2.0];
    let m2 = [3.0f32, 4.0, 5.0];
    let s1 = post(&mut w, 0, 0, &send(1, 2, 5), &[], &f32s(&m1), 0);
    let s2 = post(&mut w, 0, 3, &send(1, 3, 5), &[], &f32s(&m2), 0);
    assert!(w.is_pending(&s1.p) && w.is_pending(&s2.p));
    let r1 = post(&mut w, 1, 1, &recv(ANY_SOURCE, 4, 5), &[], &[], 16);
    let r2 = post(&mut w, 1, 2, &recv(0, 3, 5), &[], &[], 12);
    let (_, a) = w.wait_comm(&r1.p);
    assert_eq!(status(&a), (Status::Ok, 0));
    assert_eq!(
        (a.length.get(), a.base.peer.get(), a.peer_world.get()),
        (8, 0, 0)
    );
    // The message at the start, the rest of the room as it was.
    let got = w.members[1].read(r1.out.unwrap().addr, 16);
    assert_eq!(&got[..8], &f32s(&m1)[..]);
    assert!(got[8..].iter().all(|&b| b == 0x5a));
    let (_, b) = w.wait_comm(&r2.p);
    assert_eq!(status(&b), (Status::Ok, 0));
    assert_eq!(read_f32s(&w, 1, r2.out.unwrap()), m2);
    for (s, len) in [(&s1, 8), (&s2, 12)] {
        let (_, r) = w.wait_comm(&s.p);
        assert_eq!(status(&r), (Status::Ok, 0));
        assert_eq!(r.length.get(), len);
    }

    // A receive posted first, from 2; a send of another tag does not match.
    let r3 = post(&mut w, 1, 0, &recv(2, 1, 7), &[], &[], 4);
    let other = post(&mut w, 2, 0, &send(1, 1, 8), &[], &f32s(&[9.0]), 0);
    assert!(w.is_pending(&r3.p) && w.is_pending(&other.p));
    let s3 = post(&mut w, 2, 1, &send(1, 1, 7), &[], &f32s(&[6.0]), 0);
    assert_eq!(status(&w.wait_comm(&r3.p).1), (Status::Ok, 0));
    assert_eq!(read_f32s(&w, 1, r3.out.unwrap()), vec![6.0]);
    assert_eq!(status(&w.wait_comm(&s3.p).1), (Status::Ok, 0));

    // Too small a receive: TRUNCATE on both, each naming the other size;
    // no data moves.
    let r4 = post(&mut w, 1, 0, &recv(2, 0, 8), &[], &[], 0);
    let (_, t) = w.wait_comm(&r4.p);
    assert_eq!(status(&t), (Status::Truncate, 0));
    assert_eq!((t.length.get(), t.base.peer.get()), (4, 2));
    let (_, t) = w.wait_comm(&other.p);
    assert_eq!(status(&t), (Status::Truncate, 0));
    assert_eq!((t.length.get(), t.base.peer.get()), (0, 1));

    // Different dtypes: MISMATCH / DTYPE on both.
    let mut h = send(2, 1, 1);
    h.base.dtype = Dtype::I32 as u8;
    let s5 = post(&mut w, 0, 0, &h, &[], &[1, 0, 0, 0], 0);
    let r5 = post(&mut w, 2, 0, &recv(0, 1, 1), &[], &[], 4);
    for (p, peer) in [(&s5, 2), (&r5, 0)] {
        let (_, r) = w.wait_comm(&p.p);
        assert_eq!(status(&r), (Status::Mismatch, mismatch::DTYPE));
        assert_eq!(r.base.peer.get(), peer);
    }
    assert_eq!(read_f32s(&w, 2, r5.out.unwrap())[0].to_bits(), 0x5a5a_5a5a);
}

#[test]
fn a_send_or_receive_that_times_out_leaves_no_trace() {
    let mut w = comm_world(2);
    let mut h = creq(CommOpcode::Recv.raw(), 0, 1, 0, 1, 3, 0, &[]);
    h.base.timeout_ms = 50.into();
    let r = post(&mut w, 0, 0, &h, &[], &[], 4);
    let (_, resp) = w.wait_comm(&r.p);
    assert_eq!(status(&resp), (Status::Timeout, 0));
    assert_eq!((resp.base.peer.get(), resp.peer_world.get()), (1, 1));
    // The pair's next send matches the next receive.
    let s = post(
        &mut w,
        1,
        0,
        &creq(CommOpcode::Send.raw(), 0, 0, 0, 1, 3, 0, &[]),
        &[],
        &f32s(&[2.5]),
        0,
    );
    let r2 = post(
        &mut w,
        0,
        0,
        &creq(CommOpcode::Recv.raw(), 0, ANY_SOURCE, 0, 1, 3, 0, &[]),
        &[],
        &[],
        4,
    );
    assert_eq!(status(&w.wait_comm(&r2.p).1), (Status::Ok, 0));
    assert_eq!(read_f32s(&w, 0, r2.out.unwrap()), vec![2.5]);
    assert_eq!(status(&w.wait_comm(&s.p).1), (Status::Ok, 0));
}

#[test]
fn requests_are_refused_with_the_detail_that_names_the_fault() {
    let mut w = comm_world(2);
    let refused =
        |w: &mut World, r: u32, h: VirtioDmlcReqComm, table: &[u8], input: &[u8], out: usize| {
            let x = post(w, r, 0, &h, table, input, out);
            let (_, resp) = w
                .wait_for(&x.p, Duration::ZERO)
                .map(|_| {
                    let b = w.members[r as usize].read(x.p.resp, 40);
                    (
                        (),
                        <VirtioDmlcRespComm as zerocopy::FromBytes>::read_from_bytes(&b).unwrap(),
                    )
                })
                .expect("refused at once");
            status(&resp)
        };
    let send = |to: u32| creq(CommOpcode::Send.raw(), 0, to, 0, 1, 0, 0, &[]);
    let one = f32s(&[1.0]);
    // To itself, or outside the communicator.
    assert_eq!(
        refused(&mut w, 0, send(0), &[], &one, 0),
        (Status::BadRequest, BAD_PEER)
    );
    assert_eq!(
        refused(&mut w, 0, send(2), &[], &one, 0),
        (Status::BadRequest, BAD_PEER)
    );
    // An id never given; freeing communicator 0.
    let mut h = send(1);
    h.comm = 77.into();
    assert_eq!(
        refused(&mut w, 0, h, &[], &one, 0),
        (Status::BadRequest, BAD_COMM)
    );
    let free0 = creq(CommOpcode::CommFree.raw(), 0, 0, 0, 0, 0, 0, &[]);
    assert_eq!(
        refused(&mut w, 0, free0, &[], &[], 0),
        (Status::BadRequest, BAD_COMM)
    );
    // A table where none belongs; a comm_create list without the caller.
    let t = [0u8; 8];
    let ar = creq(Opcode::Allreduce.raw(), 0, 0, 0, 1, 0, 0, &t);
    assert_eq!(
        refused(&mut w, 0, ar, &t, &one, 4),
        (Status::BadRequest, BAD_TABLE)
    );
    let l = 1u32.to_le_bytes();
    let cc = creq(CommOpcode::CommCreate.raw(), 0, 0, 0, 0, 0, 0, &l);
    assert_eq!(
        refused(&mut w, 0, cc, &l, &[], 0),
        (Status::BadRequest, BAD_TABLE)
    );
    // A table longer than any opcode needs.
    let big = vec![0u8; 64];
    let cc = creq(CommOpcode::CommCreate.raw(), 0, 0, 0, 0, 0, 0, &big);
    assert_eq!(
        refused(&mut w, 0, cc, &big, &[], 0),
        (Status::BadRequest, BAD_TABLE)
    );
    // A send in place.
    let mut h = send(1);
    h.base.flags = FLAG_IN_PLACE.into();
    assert_eq!(
        refused(&mut w, 0, h, &[], &[], 0),
        (Status::BadRequest, BAD_IN_PLACE_OPCODE)
    );
    // All-to-all: bit 3, which these members did not negotiate.
    let a2a = creq(CommOpcode::Alltoall.raw(), 0, 0, 0, 1, 0, 0, &[]);
    assert_eq!(
        refused(&mut w, 0, a2a, &[], &f32s(&[1.0, 2.0]), 8),
        (Status::Unsupported, unsupported::OPCODE)
    );
    // None of them took a sequence number: the group's first allreduce
    // pairs rank 0's and rank 1's.
    let out = allreduce(&mut w, 0, &[0, 1], &[vec![1.0], vec![2.0]]);
    assert!(out
        .iter()
        .all(|(r, o)| status(r) == (Status::Ok, 0) && *o == vec![3.0]));
}

#[test]
fn without_bit_1_the_new_opcodes_are_unsupported_and_sizes_unchanged() {
    let mut w = World::new(config(2));
    let m = &mut w.members[0];
    let h = hdr(CommOpcode::CommSplit.raw(), 0, 0, 0, 0, 0, 0, 0);
    let d = vec![m.header(&h), m.response()];
    let p = w.submit(0, 0, &d);
    let (_, r) = w.wait(&p);
    assert_eq!(
        r,
        resp(Status::Unsupported, unsupported::OPCODE, NO_PEER, 1)
    );
}

#[test]
fn a_loss_fails_only_the_communicators_that_contain_the_lost_member() {
    let mut w = comm_world(4);
    // {0, 1} and {2, 3}.
    let resps = split(&mut w, 0, &[0, 1, 2, 3], &[(0, 0), (0, 0), (1, 0), (1, 0)]);
    let (a, b) = (resps[0].comm.get(), resps[2].comm.get());
    // Pending: rank 0 on A, rank 2 on B, rank 3's receive from rank 1.
    let h = |comm| creq(Opcode::Allreduce.raw(), comm, 0, 0, 1, 0, 0, &[]);
    let on_a = post(&mut w, 0, 1, &h(a), &[], &f32s(&[1.0]), 4);
    let on_b = post(&mut w, 2, 1, &h(b), &[], &f32s(&[2.0]), 4);
    let rx = post(
        &mut w,
        3,
        0,
        &creq(CommOpcode::Recv.raw(), 0, 1, 0, 1, 0, 0, &[]),
        &[],
        &[],
        4,
    );
    w.group.member_lost(1);
    for x in [&on_a, &rx] {
        let (_, r) = w.wait_comm(&x.p);
        assert_eq!(status(&r), (Status::PeerLost, 0));
        // Group rank 1 is rank 1 of A and of the group.
        assert_eq!((r.base.peer.get(), r.peer_world.get()), (1, 1));
        assert_eq!(r.base.generation.get(), 2);
    }
    // B goes on: rank 3's request completes rank 2's, same sequence.
    assert!(w.is_pending(&on_b.p));
    let b3 = post(&mut w, 3, 1, &h(b), &[], &f32s(&[5.0]), 4);
    for (r, x) in [(2, &on_b), (3, &b3)] {
        let (_, resp) = w.wait_comm(&x.p);
        assert_eq!(status(&resp), (Status::Ok, 0));
        assert_eq!(resp.base.generation.get(), 2);
        assert_eq!(read_f32s(&w, r, x.out.unwrap()), vec![7.0]);
    }
    // A is revoked: a request on it fails at once, its free succeeds.
    let again = post(&mut w, 0, 1, &h(a), &[], &f32s(&[1.0]), 4);
    let (_, r) = w.wait_comm(&again.p);
    assert_eq!(status(&r), (Status::PeerLost, 0));
    assert_eq!(r.peer_world.get(), 1);
    let free = post(
        &mut w,
        0,
        0,
        &creq(CommOpcode::CommFree.raw(), a, 0, 0, 0, 0, 0, &[]),
        &[],
        &[],
        0,
    );
    assert_eq!(status(&w.wait_comm(&free.p).1), (Status::Ok, 0));
    let after = post(&mut w, 0, 1, &h(a), &[], &f32s(&[1.0]), 4);
    assert_eq!(
        status(&w.wait_comm(&after.p).1),
        (Status::BadRequest, BAD_COMM)
    );
}

#[test]
fn a_reset_ends_every_communicator_but_the_group() {
    let mut w = comm_world(2);
    let resps = split(&mut w, 0, &[0, 1], &[(0, 0), (0, 0)]);
    let c = resps[0].comm.get();
    let h = creq(Opcode::Allreduce.raw(), c, 0, 0, 1, 0, 0, &[]);
    let x = post(&mut w, 0, 0, &h, &[], &f32s(&[1.0]), 4);
    w.group.reset();
    assert_eq!(status(&w.wait_comm(&x.p).1), (Status::Reset, 0));
    let y = post(&mut w, 1, 0, &h, &[], &f32s(&[1.0]), 4);
    assert_eq!(status(&w.wait_comm(&y.p).1), (Status::BadRequest, BAD_COMM));
}

#[test]
fn communicators_beyond_max_comms_are_refused() {
    // The harness's config allows 8, the group's own included.
    let mut w = comm_world(2);
    let mut made = 0;
    loop {
        let resps = split(&mut w, 0, &[0, 1], &[(0, 0), (1, 0)]);
        match status(&resps[0]) {
            (Status::Ok, 0) => made += 2,
            s => {
                assert_eq!(s, (Status::TooBig, TOO_BIG_COMMS));
                assert_eq!(status(&resps[1]), s);
                break;
            }
        }
        assert!(made < 100);
    }
    assert_eq!(made, 6);
}

#[test]
fn across_hosts_the_bits_are_not_offered_nor_taken_if_acknowledged() {
    let (tx, _rx) = std::sync::mpsc::channel();
    let mut cfg = config(2);
    cfg.remote = Some(crate::group::remote::RemoteLink {
        host: 0,
        hosts: 2,
        tx,
        abandon: Default::default(),
    });
    let mut w = World::new(cfg);
    assert_eq!(w.group.comm_features(), 0);
    assert_eq!(
        w.group.config_space(0).base.opcodes.get(),
        Opcode::all_mask()
    );
    // A driver that acknowledges bit 1 anyway keeps 32-byte headers, and
    // the new opcodes are UNSUPPORTED.
    w.group.set_member_features(0, FEATURES);
    let m = &mut w.members[0];
    let h = hdr(CommOpcode::Send.raw(), F32, 0, 0, 0, 0, 0, 0);
    let d = vec![m.header(&h), m.response()];
    let p = w.submit(0, 0, &d);
    let (_, r) = w.wait(&p);
    assert_eq!(
        r,
        resp(Status::Unsupported, unsupported::OPCODE, NO_PEER, 1)
    );
}

#[test]
fn the_flight_recorder_names_the_new_opcodes_and_their_communicator() {
    let mut cfg = config(2);
    cfg.trace_capacity = 16;
    let mut w = World::new(cfg);
    for r in 0..2 {
        w.group.set_member_features(r, FEATURES);
    }
    let resps = split(&mut w, 0, &[0, 1], &[(5, 0), (5, 0)]);
    let c = resps[0].comm.get();
    let s = post(
        &mut w,
        0,
        0,
        &creq(CommOpcode::Send.raw(), c, 1, 0, 1, 4, 0, &[]),
        &[],
        &f32s(&[1.0]),
        0,
    );
    let r = post(
        &mut w,
        1,
        0,
        &creq(CommOpcode::Recv.raw(), c, 0, 0, 1, 4, 0, &[]),
        &[],
        &[],
        4,
    );
    w.wait_comm(&s.p);
    w.wait_comm(&r.p);
    let records = w.group.recorder().expect("a recorder").records();
    let seen: Vec<(String, u32)> = records
        .iter()
        .map(|r| (r.opcode.to_string(), r.comm))
        .collect();
    assert_eq!(
        seen,
        vec![("comm_split".to_string(), 0), ("send".to_string(), c)]
    );
    // Both ends of the message are in its record.
    assert!(records[1].members.iter().all(|m| m.arrived.is_some()));
}
