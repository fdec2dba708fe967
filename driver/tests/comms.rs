//! Communicators, send and receive, all-to-all, gather and scatter (spec
//! 5.X.6.13) through the driver over the host transport, against the real
//! daemon: every member a `Device` of this process on its own thread, as
//! separate VMs would be. Each rank checks its own results against values
//! it computes itself from the formula every rank's input follows.

use std::thread;

use dmlc_driver::{CommRequest, Device, Dtype, Error, Opcode, OpenOptions, ReduceOp, Request};
use dmlc_test_support::Backend;
use virtio_dmlc::comm::{
    CommOpcode, ANY_SOURCE, VIRTIO_DMLC_F_BLOCKS, VIRTIO_DMLC_F_COMM, VIRTIO_DMLC_F_P2P,
};

/// Element `k` that rank `i` gives rank `j`: every value says where it
/// came from.
fn val(i: u32, j: u32, k: u64) -> f32 {
    (1000 * i + 100 * j) as f32 + k as f32
}

fn open(backend: &Backend, rank: u32) -> Device {
    dmlc_driver::host::open(&backend.socket(rank), &OpenOptions::default())
        .unwrap_or_else(|e| panic!("cannot open rank {rank}: {e}"))
}

/// Runs `f(device)` on every rank at once, each on its own thread.
fn on_every_rank(n: u32, tag: &str, f: impl Fn(&Device) + Sync) {
    on_every_rank_of(n, tag, &[], f)
}

/// As [`on_every_rank`], with `extra` options for the daemon.
fn on_every_rank_of(n: u32, tag: &str, extra: &[&str], f: impl Fn(&Device) + Sync) {
    let args: Vec<&str> = ["--timeout-ms", "20000"]
        .iter()
        .chain(extra)
        .copied()
        .collect();
    let backend = Backend::start(tag, n, &args);
    thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let (backend, f) = (&backend, &f);
                s.spawn(move || {
                    let dev = open(backend, r);
                    f(&dev);
                    // A rank that closed its device early would be lost to
                    // the others' requests still pending on communicators
                    // it is in (communicator 0, at least): leave together.
                    dev.barrier().expect("the closing barrier");
                })
            })
            .collect();
        for h in handles {
            h.join().expect("a rank failed");
        }
    });
}

/// A buffer of `n` f32 elements, each `f(k)`.
fn filled(dev: &Device, n: u64, f: impl Fn(u64) -> f32) -> dmlc_driver::DmaBuf {
    let mut b = dev.alloc((n as usize * 4).max(4)).expect("alloc");
    for (k, x) in b.as_elems_mut::<f32>().iter_mut().enumerate() {
        *x = f(k as u64);
    }
    b
}

fn elems(b: &dmlc_driver::DmaBuf, n: u64) -> Vec<f32> {
    b.as_elems::<f32>()[..n as usize].to_vec()
}

#[test]
fn split_send_receive_and_block_collectives_on_four_ranks() {
    let n = 4;
    on_every_rank(n, "comms-all", |dev| {
        let r = dev.rank();
        for bit in [VIRTIO_DMLC_F_COMM, VIRTIO_DMLC_F_P2P, VIRTIO_DMLC_F_BLOCKS] {
            assert!(dev.has_comm_feature(bit), "bit {bit} negotiated");
        }
        assert_eq!(dev.max_comms(), Some(64));

        // Even and odd ranks, ordered by rank.
        let mine = dev
            .comm_split(0, Some(r % 2), r)
            .unwrap()
            .expect("a communicator");
        assert_eq!((mine.rank, mine.size), (r / 2, 2));
        let partner = r ^ 2;
        // An allreduce on it: the sum of the two members' values only.
        let input = filled(dev, 3, |k| val(r, 0, k));
        let output = dev.alloc(12).unwrap();
        let req = Request {
            comm: mine.id,
            ..Request::new(Opcode::Allreduce, Dtype::F32, ReduceOp::Sum, 3)
        };
        dev.run(&req, Some(&input), Some(&output)).unwrap();
        let want: Vec<f32> = (0..3).map(|k| val(r, 0, k) + val(partner, 0, k)).collect();
        assert_eq!(elems(&output, 3), want);

        // A ring on the group: even ranks send first, odd ranks receive
        // first (blocking calls), from any source.
        let to = (r + 1) % n;
        let from = (r + n - 1) % n;
        let msg = filled(dev, 5, |k| val(r, to, k));
        let room = dev.alloc(8 * 4).unwrap();
        let send = || dev.send(0, to, 7, Dtype::F32, &msg, 5).unwrap();
        let recv = || dev.recv(0, ANY_SOURCE, 7, Dtype::F32, &room, 8).unwrap();
        let got = if r % 2 == 0 {
            send();
            recv()
        } else {
            let got = recv();
            send();
            got
        };
        assert_eq!((got.length, got.peer), (20, from));
        let want: Vec<f32> = (0..5).map(|k| val(from, r, k)).collect();
        assert_eq!(elems(&room, 5), want);

        // All-to-all on the group: block j of rank i goes to rank j.
        let c = 2;
        let input = filled(dev, n as u64 * c, |k| val(r, (k / c) as u32, k % c));
        let output = dev.alloc((n as u64 * c * 4) as usize).unwrap();
        let req = CommRequest::new(CommOpcode::Alltoall, Dtype::F32, 0, c);
        dev.run_blocks(&req, Some(&input), Some(&output)).unwrap();
        let want: Vec<f32> = (0..n)
            .flat_map(|i| (0..c).map(move |k| val(i, r, k)))
            .collect();
        assert_eq!(elems(&output, n as u64 * c), want);

        // Gather to rank 2 and scatter from rank 1, on the group.
        let input = filled(dev, c, |k| val(r, 2, k));
        let out = dev.alloc((n as u64 * c * 4) as usize).unwrap();
        let req = CommRequest {
            root: 2,
            ..CommRequest::new(CommOpcode::Gather, Dtype::F32, 0, c)
        };
        dev.run_blocks(&req, Some(&input), Some(&out)).unwrap();
        if r == 2 {
            let want: Vec<f32> = (0..n)
                .flat_map(|i| (0..c).map(move |k| val(i, 2, k)))
                .collect();
            assert_eq!(elems(&out, n as u64 * c), want);
        }
        let all = filled(dev, n as u64 * c, |k| val(1, (k / c) as u32, k % c));
        let out = dev.alloc((c * 4) as usize).unwrap();
        let req = CommRequest {
            root: 1,
            ..CommRequest::new(CommOpcode::Scatter, Dtype::F32, 0, c)
        };
        dev.run_blocks(&req, (r == 1).then_some(&all), Some(&out))
            .unwrap();
        assert_eq!(
            elems(&out, c),
            (0..c).map(|k| val(1, r, k)).collect::<Vec<_>>()
        );

        // Counts per pair on the split communicator: rank a sends a + 2b + 1
        // elements to rank b (ranks of the communicator).
        let (a, size) = (mine.rank, mine.size);
        let count = |i: u32, j: u32| u64::from(i + 2 * j + 1);
        let group_of = |x: u32| if x == a { r } else { partner };
        let mut table: Vec<u64> = (0..size).map(|j| count(a, j)).collect();
        table.extend((0..size).map(|i| count(i, a)));
        let sends: u64 = (0..size).map(|j| count(a, j)).sum();
        let recvs: u64 = (0..size).map(|i| count(i, a)).sum();
        let mut input = dev.alloc((sends * 4) as usize).unwrap();
        let mut at = 0;
        for j in 0..size {
            for k in 0..count(a, j) {
                input.as_elems_mut::<f32>()[at] = val(r, group_of(j), k);
                at += 1;
            }
        }
        let output = dev.alloc((recvs * 4) as usize).unwrap();
        let req = CommRequest {
            table: dmlc_driver::counts_table(&table),
            ..CommRequest::new(CommOpcode::Alltoallv, Dtype::F32, mine.id, 0)
        };
        dev.run_blocks(&req, Some(&input), Some(&output)).unwrap();
        let want: Vec<f32> = (0..size)
            .flat_map(|i| (0..count(i, a)).map(move |k| val(group_of(i), r, k)))
            .collect();
        assert_eq!(elems(&output, recvs), want);

        // comm_create by ranks 3 and 1 only, in that order.
        if r % 2 == 1 {
            let made = dev.comm_create(0, &[3, 1], 5).unwrap();
            assert_eq!((made.rank, made.size), (if r == 3 { 0 } else { 1 }, 2));
            dev.comm_free(made.id).unwrap();
        }
        dev.comm_free(mine.id).unwrap();
        assert!(matches!(
            dev.comm_info(mine.id),
            Err(Error::BadRequest { .. })
        ));
    });
}

#[test]
fn a_message_larger_than_its_receive_is_truncated_on_both_ends() {
    on_every_rank(2, "comms-trunc", |dev| {
        let buf = filled(dev, 4, |k| k as f32);
        match dev.rank() {
            0 => match dev.send(0, 1, 3, Dtype::F32, &buf, 4) {
                Err(Error::Truncated { length, peer }) => assert_eq!((length, peer), (8, 1)),
                other => panic!("send: {other:?}"),
            },
            _ => match dev.recv(0, 0, 3, Dtype::F32, &buf, 2) {
                Err(Error::Truncated { length, peer }) => assert_eq!((length, peer), (16, 0)),
                other => panic!("receive: {other:?}"),
            },
        }
    });
}

#[test]
fn a_receive_and_a_send_posted_together_on_one_queue_complete_on_every_rank() {
    // A ring exchange: every rank posts its receive and its send before it
    // waits, as nccl-tests' sendrecv and torch's batch_isend_irecv do. With
    // blocking calls this pattern cannot complete.
    let n = 3;
    let count = 1000;
    on_every_rank(n, "comms-posted", |dev| {
        let (r, w) = (dev.rank(), dev.world_size());
        let (next, prev) = ((r + 1) % w, (r + w - 1) % w);
        let out = filled(dev, count, |k| val(r, next, k));
        let mut inp = filled(dev, count, |_| -1.0);
        let recv = CommRequest {
            peer: prev,
            tag: 9,
            ..CommRequest::new(CommOpcode::Recv, Dtype::F32, 0, count)
        };
        let send = CommRequest {
            peer: next,
            tag: 9,
            ..CommRequest::new(CommOpcode::Send, Dtype::F32, 0, count)
        };
        for round in 0..20 {
            inp.reclaim(); // the last round's check borrowed it
            let hr = dev
                .submit_comm(0, &recv, &[], &[inp.all()])
                .expect("post the receive");
            let hs = dev
                .submit_comm(0, &send, &[out.all()], &[])
                .expect("post the send");
            let got = dev.wait(hr, None).expect("receive").reply;
            dev.wait(hs, None).expect("send");
            assert_eq!((got.length, got.peer), (count * 4, prev), "round {round}");
            let want: Vec<f32> = (0..count).map(|k| val(prev, r, k)).collect();
            assert_eq!(elems(&inp, count), want, "round {round}");
        }
        let split = CommRequest::new(CommOpcode::CommSplit, Dtype::U8, 0, 0);
        match dev.submit_comm(0, &split, &[], &[]) {
            Err(Error::InvalidArgument(m)) => assert!(m.contains("comm_call"), "{m}"),
            other => panic!("comm_split through submit_comm: {other:?}"),
        }
    });
}

/// The daemon's `max_bytes` in the tests of messages cut in pieces: a
/// multiple of no element size but 1, so `P` differs by dtype (4099 bytes
/// for u8, 4098 for f16, 4096 for f32 and f64).
const MAX_BYTES: &str = "4099";

/// Byte `k` of the message rank `i` sends rank `j` with `tag`: 251 is prime,
/// so a piece out of place or missing shows.
fn byte(i: u32, j: u32, tag: u64, k: usize) -> u8 {
    ((k + 13 * i as usize + 29 * j as usize + 37 * tag as usize) % 251) as u8
}

/// A buffer of `bytes` bytes (at least one), each `byte(i, j, tag, k)`.
fn message(dev: &Device, i: u32, j: u32, tag: u64, bytes: usize) -> dmlc_driver::DmaBuf {
    let mut b = dev.alloc(bytes.max(1)).expect("alloc");
    for (k, x) in b.as_mut_slice().iter_mut().enumerate() {
        *x = byte(i, j, tag, k);
    }
    b
}

/// The bytes of `buf` that differ from what rank `i` sent rank `j` with
/// `tag` (its first `bytes`).
fn wrong_bytes(buf: &dmlc_driver::DmaBuf, i: u32, j: u32, tag: u64, bytes: usize) -> Vec<usize> {
    let got = buf.as_slice();
    (0..bytes)
        .filter(|&k| got[k] != byte(i, j, tag, k))
        .collect()
}

#[test]
fn messages_over_max_bytes_go_in_pieces_and_arrive_whole() {
    // Spec 5.X.6.13.4 (DRV-COMM-2): Device::send and Device::recv cut a
    // message over max_bytes into pieces of P = max_bytes - max_bytes %
    // element size, one request each; the receive's room is the message's
    // size. Several times max_bytes, not a multiple of P, in both
    // directions, from a named source and from any.
    on_every_rank_of(2, "comms-pieces", &["--max-bytes", MAX_BYTES], |dev| {
        let (r, other) = (dev.rank(), 1 - dev.rank());
        assert_eq!(dev.config().max_bytes.get(), 4099);
        for (tag, dtype, count) in [
            (1u64, Dtype::U8, 3 * 4099 + 1234),
            (2, Dtype::F16, 5 * 2049 + 7),
            (3, Dtype::F32, 4 * 1024 + 777),
            (4, Dtype::F64, 2 * 512 + 1),
            // Exactly two pieces, then one element over a piece.
            (5, Dtype::F32, 2 * 1024),
            (6, Dtype::F64, 513),
        ] {
            let bytes = count as usize * dtype.size();
            let p = dev.message_piece_bytes(dtype);
            assert_eq!(p, 4099 - 4099 % dtype.size(), "{dtype}");
            let pieces: Vec<_> = dev.message_pieces(dtype, bytes).collect();
            assert_eq!(pieces.len(), bytes.div_ceil(p), "{dtype}: {bytes} bytes");
            let msg = message(dev, r, other, tag, bytes);
            let room = dev.alloc(bytes).unwrap();
            let what = format!("{dtype} x {count} ({bytes} bytes, pieces of {p})");
            let send = || {
                dev.send(0, other, tag, dtype, &msg, count)
                    .unwrap_or_else(|e| panic!("send {what}: {e}"))
            };
            let from = if tag % 2 == 0 { ANY_SOURCE } else { other };
            let recv = || {
                dev.recv(0, from, tag, dtype, &room, count)
                    .unwrap_or_else(|e| panic!("receive {what}: {e}"))
            };
            let got = if r == 0 {
                send();
                recv()
            } else {
                let got = recv();
                send();
                got
            };
            assert_eq!((got.length, got.peer), (bytes as u64, other), "{what}");
            let wrong = wrong_bytes(&room, other, r, tag, bytes);
            assert!(
                wrong.is_empty(),
                "{what}: {} wrong bytes, first at {}",
                wrong.len(),
                wrong[0]
            );
        }

        // A message of one piece into a room of several: an ordinary short
        // message, the rest of the room left as it was.
        let room = message(dev, 9, 9, 9, 3 * 4096);
        if r == 0 {
            dev.send(0, 1, 7, Dtype::F32, &message(dev, 0, 1, 7, 400), 100)
                .unwrap();
        } else {
            let got = dev.recv(0, 0, 7, Dtype::F32, &room, 3 * 1024).unwrap();
            assert_eq!((got.length, got.peer), (400, 0));
            assert!(wrong_bytes(&room, 0, 1, 7, 400).is_empty());
            let rest = &room.as_slice()[400..];
            assert!(rest
                .iter()
                .enumerate()
                .all(|(k, &x)| x == byte(9, 9, 9, k + 400)));
        }
        // An empty message is one request.
        let empty = dev.alloc(8).unwrap();
        if r == 1 {
            dev.send(0, 0, 8, Dtype::F64, &empty, 0).unwrap();
        } else {
            let got = dev.recv(0, ANY_SOURCE, 8, Dtype::F64, &empty, 0).unwrap();
            assert_eq!((got.length, got.peer), (0, 1));
        }
    });
}

#[test]
fn a_room_over_max_bytes_of_another_size_than_the_message_fails() {
    // Above max_bytes a receive must have the message's size (DRV-COMM-2):
    // a larger room ends on a short piece (the receive fails, naming both
    // sizes), a smaller one on a piece that completes with TRUNCATE on both
    // ends, each naming the other end's whole size. Nothing is left over:
    // the next message of the pair arrives whole.
    on_every_rank_of(2, "comms-pieces-bad", &["--max-bytes", MAX_BYTES], |dev| {
        let (small, large) = (10_000usize, 12_000usize); // 3 pieces of u8 each
        let r = dev.rank();
        let msg = message(dev, 0, 1, 1, large);
        let mut room = dev.alloc(large).unwrap();
        // Rank 0 sends 10000 bytes, rank 1 has room for 12000.
        if r == 0 {
            dev.send(0, 1, 1, Dtype::U8, &msg, small as u64).unwrap();
        } else {
            match dev.recv(0, 0, 1, Dtype::U8, &room, large as u64) {
                Err(Error::InvalidArgument(m)) => {
                    for want in ["10000 bytes", "12000 bytes", "rank 0", "4099", "DRV-COMM-2"] {
                        assert!(m.contains(want), "{want:?} not in {m:?}");
                    }
                }
                other => panic!("a room larger than the message: {other:?}"),
            }
            assert!(wrong_bytes(&room, 0, 1, 1, small).is_empty());
        }
        // Rank 0 sends 12000 bytes, rank 1 has room for 10000.
        room.reclaim(); // the check above borrowed it
        if r == 0 {
            match dev.send(0, 1, 2, Dtype::U8, &msg, large as u64) {
                Err(Error::Truncated { length, peer }) => {
                    assert_eq!((length, peer), (small as u64, 1))
                }
                other => panic!("a send larger than the room: {other:?}"),
            }
        } else {
            let err = dev
                .recv(0, 0, 2, Dtype::U8, &room, small as u64)
                .expect_err("a receive smaller than the message");
            assert!(
                matches!(err, Error::Truncated { length, peer: 0 } if length == large as u64),
                "{err:?}"
            );
            assert!(err.to_string().contains("12000 bytes"), "{err}");
        }
        // The pair goes on: a message of three pieces, whole.
        let msg = message(dev, 0, 1, 3, small);
        room.reclaim();
        if r == 0 {
            dev.send(0, 1, 1, Dtype::U8, &msg, small as u64).unwrap();
        } else {
            let got = dev.recv(0, 0, 1, Dtype::U8, &room, small as u64).unwrap();
            assert_eq!((got.length, got.peer), (small as u64, 0));
            assert!(wrong_bytes(&room, 0, 1, 3, small).is_empty());
        }
    });
}

/// `Device::set_tag` tags collectives, which the device compares between
/// members, and leaves sends and receives to their own tag: the same tag on
/// both ranks reduces, a send tagged 3 still meets a receive of tag 3, and
/// different tags fail the next allreduce with a mismatch of the tag.
#[test]
fn set_tag_tags_collectives_but_not_messages() {
    on_every_rank(2, "comms-tag", |dev| {
        let r = dev.rank();
        let buf = filled(dev, 4, |k| (k + u64::from(r)) as f32);
        dev.set_tag(7);
        assert_eq!(dev.tag(), 7);
        dev.allreduce_in_place(Dtype::F32, ReduceOp::Sum, &buf, 4)
            .unwrap();
        assert_eq!(elems(&buf, 4), vec![1.0, 3.0, 5.0, 7.0]);
        let msg = filled(dev, 4, |k| k as f32);
        let room = dev.alloc(4 * 4).unwrap();
        match r {
            0 => dev.send(0, 1, 3, Dtype::F32, &msg, 4).map(|_| ()),
            _ => dev.recv(0, 0, 3, Dtype::F32, &room, 4).map(|_| ()),
        }
        .unwrap();
        dev.set_tag(8 + u64::from(r));
        let other = filled(dev, 4, |k| k as f32);
        match dev.allreduce_in_place(Dtype::F32, ReduceOp::Sum, &other, 4) {
            Err(Error::Mismatch { fields, .. }) => assert!(fields.contains("tag"), "{fields}"),
            other => panic!("different tags: {other:?}"),
        }
        dev.set_tag(0);
    });
}
