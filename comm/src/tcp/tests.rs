//! Unit tests for the TCP communicator in `tcp.rs`: collectives, connect and handshake failures, peer lists and headers.

use std::net::TcpListener;
use std::thread;

use super::*;
use crate::testutil::{all_pairs, data, naive, on_each, same, serial, tcp_group};
use crate::{CommError, CommunicatorExt};

fn free_port() -> SocketAddr {
    // Bound and released at once; the tests that use it start their
    // listener right away.
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

fn tcp_err(e: CommError) -> TcpError {
    match e {
        CommError::Tcp(e) => e,
        other => panic!("expected a tcp error, got {other:?}"),
    }
}

#[test]
fn allreduce_every_dtype_and_op_in_groups_of_2_3_4() {
    let _serial = serial();
    for world in [2u32, 3, 4] {
        // 20_000 elements of 4 or 8 bytes take the reduce-scatter path
        // for world > 2; 2 and 3 elements leave chunks empty.
        type Case = (Dtype, ReduceOp, Vec<Vec<u8>>, Vec<u8>);
        let cases: Vec<Case> = all_pairs()
            .enumerate()
            .flat_map(|(i, (dtype, op))| {
                [0usize, 1, 2, 3, 1000, 20_000]
                    .into_iter()
                    .enumerate()
                    .map(move |(k, count)| {
                        let seed = |r: u32| (i * 8 + k) as u64 * 16 + u64::from(r);
                        let inputs: Vec<Vec<u8>> = (0..world)
                            .map(|r| data(dtype, count, seed(r), k == 4))
                            .collect();
                        let want = naive(dtype, op, &inputs);
                        (dtype, op, inputs, want)
                    })
            })
            .collect();
        on_each(tcp_group(world), |mut c| {
            let rank = c.rank();
            assert_eq!((c.world_size(), c.transport()), (world, "tcp"));
            for (dtype, op, inputs, want) in &cases {
                let mut got = inputs[rank as usize].clone();
                c.allreduce_raw(*dtype, *op, &mut got).unwrap();
                assert!(
                    same(*dtype, &got, want),
                    "{dtype} {op} count {} world {world} rank {rank}",
                    got.len() / dtype.size()
                );
            }
        });
    }
}

#[test]
fn broadcast_allgather_barrier_and_misaligned_bytes() {
    let _serial = serial();
    on_each(tcp_group(3), |mut c| {
        let rank = c.rank();
        for root in 0..3 {
            for len in [0usize, 1, 100_000] {
                let mut v: Vec<u8> = if rank == root {
                    (0..len).map(|i| (i * 7 + root as usize) as u8).collect()
                } else {
                    vec![0xee; len]
                };
                c.broadcast(root, &mut v).unwrap();
                assert!(v
                    .iter()
                    .enumerate()
                    .all(|(i, &x)| x == (i * 7 + root as usize) as u8));
            }
        }
        for n in [0usize, 3, 50_000] {
            let mine: Vec<i64> = (0..n as i64).map(|i| i * 3 + i64::from(rank)).collect();
            let mut all = vec![0i64; 3 * n];
            c.allgather(&mine, &mut all).unwrap();
            for j in 0..3 {
                assert!(all[j * n..(j + 1) * n]
                    .iter()
                    .enumerate()
                    .all(|(i, &x)| x == i as i64 * 3 + j as i64));
            }
        }
        c.barrier().unwrap();
        // f32 at an odd address through the byte API.
        let mut raw = vec![0u8; 4 * 1000 + 1];
        for (i, b) in raw[1..].chunks_mut(4).enumerate() {
            b.copy_from_slice(&(i as f32 + rank as f32).to_le_bytes());
        }
        c.allreduce_raw(Dtype::F32, ReduceOp::Sum, &mut raw[1..])
            .unwrap();
        for (i, b) in raw[1..].chunks(4).enumerate() {
            assert_eq!(
                f32::from_le_bytes(b.try_into().unwrap()),
                3.0 * i as f32 + 3.0
            );
        }
        // Local argument errors do not break the communicator.
        let mut v = [1.0f32; 4];
        assert!(c.broadcast(3, &mut v).is_err());
        assert!(c.allgather(&v, &mut [0.0; 4]).is_err());
        assert!(c.allreduce(ReduceOp::Bxor, &mut v).is_err());
        c.allreduce(ReduceOp::Max, &mut v).unwrap();
    });
}

#[test]
fn mismatched_collectives_name_the_field_and_rank() {
    let errs = on_each(tcp_group(2), |mut c| {
        let mut v = vec![0u32; 4 + c.rank() as usize];
        let e = tcp_err(c.allreduce(ReduceOp::Sum, &mut v).unwrap_err());
        // The streams are out of step now: nothing more runs.
        let again = tcp_err(c.barrier().unwrap_err());
        assert!(matches!(again, TcpError::Broken), "{again}");
        e
    });
    assert_eq!(
        errs[0].to_string(),
        "collective mismatch: count differs on rank 1 (5 there, 4 here)"
    );
    assert_eq!(
        errs[1].to_string(),
        "collective mismatch: count differs on rank 0 (4 there, 5 here)"
    );
    let errs = on_each(tcp_group(2), |mut c| {
        let e = if c.rank() == 0 {
            c.allreduce(ReduceOp::Sum, &mut [0u32; 4])
        } else {
            c.allreduce(ReduceOp::Max, &mut [0u32; 4])
        };
        tcp_err(e.unwrap_err())
    });
    assert!(matches!(
        errs[0],
        TcpError::Mismatch {
            field: "op",
            rank: 1,
            ..
        }
    ));
    let errs = on_each(tcp_group(2), |mut c| {
        let e = if c.rank() == 0 {
            c.barrier()
        } else {
            c.allreduce(ReduceOp::Sum, &mut [0u32; 4])
        };
        tcp_err(e.unwrap_err())
    });
    assert!(
        matches!(
            errs[1],
            TcpError::Mismatch {
                field: "opcode",
                rank: 0,
                ..
            }
        ),
        "{}",
        errs[1]
    );
}

#[test]
fn a_peer_that_disappears_is_named() {
    // The survivors keep their connections until both have seen the
    // loss: a failed rank closes its connections too, and a slower
    // survivor could see that closure first and name it instead.
    let seen = std::sync::atomic::AtomicU32::new(0);
    let errs = on_each(tcp_group(3), |mut c| {
        let mut v = vec![1.0f32; 100_000];
        c.allreduce(ReduceOp::Sum, &mut v).unwrap();
        if c.rank() == 2 {
            drop(c); // the process "exits"
            return None;
        }
        let t = Instant::now();
        let e = tcp_err(c.allreduce(ReduceOp::Sum, &mut v).unwrap_err());
        assert!(t.elapsed() < Duration::from_secs(5), "noticed late");
        seen.fetch_add(1, Ordering::SeqCst);
        while seen.load(Ordering::SeqCst) < 2 && t.elapsed() < Duration::from_secs(10) {
            thread::sleep(Duration::from_millis(1));
        }
        Some(e)
    });
    for e in errs.into_iter().flatten() {
        assert!(matches!(e, TcpError::PeerClosed { rank: 2 }), "{e}");
        assert_eq!(e.to_string(), "rank 2 closed the connection");
    }
}

#[test]
fn a_silent_peer_times_out() {
    let errs = on_each(tcp_group(2), |mut c| {
        if c.rank() == 1 {
            thread::sleep(Duration::from_millis(600));
            return None;
        }
        c.set_io_timeout(Some(Duration::from_millis(200)));
        let t = Instant::now();
        let e = tcp_err(c.barrier().unwrap_err());
        assert!(t.elapsed() >= Duration::from_millis(200));
        Some(e)
    });
    let e = errs[0].as_ref().unwrap();
    assert!(matches!(e, TcpError::Timeout { rank: 1, .. }), "{e}");
    assert_eq!(e.to_string(), "timed out after 0.2 s waiting for rank 1");
}

#[test]
fn connecting_retries_until_a_late_peer_starts() {
    let peers = [free_port(), free_port(), free_port()];
    let t = Instant::now();
    let comms = thread::scope(|s| {
        let late = s.spawn(|| {
            thread::sleep(Duration::from_millis(700));
            TcpComm::connect(0, &peers, Duration::from_secs(10))
        });
        let others: Vec<_> = [1u32, 2]
            .map(|r| s.spawn(move || TcpComm::connect(r, &peers, Duration::from_secs(10))))
            .into_iter()
            .collect();
        let mut all = vec![late.join().unwrap().unwrap()];
        all.extend(others.into_iter().map(|h| h.join().unwrap().unwrap()));
        all
    });
    assert!(t.elapsed() >= Duration::from_millis(700));
    let sums = on_each(comms, |mut c| {
        let mut v = [c.rank() as u64 + 1];
        c.allreduce(ReduceOp::Sum, &mut v).unwrap();
        v[0]
    });
    assert_eq!(sums, [6, 6, 6]);
}

#[test]
fn missing_peers_are_named_after_the_timeout() {
    let peers = [free_port(), free_port()];
    let t = Instant::now();
    let e = TcpComm::connect(1, &peers, Duration::from_millis(400)).unwrap_err();
    assert!(t.elapsed() >= Duration::from_millis(300));
    assert!(matches!(e, TcpError::Connect { rank: 0, .. }), "{e}");
    assert!(
        e.to_string()
            .starts_with(&format!("cannot reach rank 0 at {} within ", peers[0])),
        "{e}"
    );
    let peers = [free_port(), free_port(), free_port()];
    let e = TcpComm::connect(0, &peers, Duration::from_millis(300)).unwrap_err();
    assert!(
        matches!(
            e,
            TcpError::NotConnected {
                rank: 1,
                more: 1,
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string()
            .starts_with(&format!("rank 1 ({}) did not connect within ", peers[1])),
        "{e}"
    );
    assert!(e.to_string().ends_with(" s (and 1 more ranks)"), "{e}");
}

#[test]
fn peer_lists_that_differ_fail_the_handshake() {
    let a = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = a.local_addr().unwrap();
    let errs = thread::scope(|s| {
        let zero = s.spawn(|| {
            TcpComm::with_listener(0, a, &[addr, free_port()], Duration::from_secs(20)).unwrap_err()
        });
        let other = s.spawn(move || {
            TcpComm::connect(
                2,
                &[addr, free_port(), free_port()],
                Duration::from_secs(20),
            )
            .unwrap_err()
        });
        (zero.join().unwrap(), other.join().unwrap())
    });
    assert!(matches!(errs.0, TcpError::Handshake { .. }), "{}", errs.0);
    assert!(
        errs.0
            .to_string()
            .ends_with("group of 3 there, 2 here: the peer lists differ"),
        "{}",
        errs.0
    );
    // The connecting side learns it from the answer, at once.
    assert!(matches!(errs.1, TcpError::Handshake { .. }), "{}", errs.1);
    assert!(
        errs.1
            .to_string()
            .ends_with("group of 2 there, 3 here: the peer lists differ"),
        "{}",
        errs.1
    );
}

#[test]
fn a_failed_accept_cuts_the_connecting_short() {
    // Rank 1 waits for a missing rank 0 while a member of another
    // group (of 5) knocks on its port: it fails at once, not after its
    // timeout.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let peers = [free_port(), addr, free_port()];
    let t = Instant::now();
    let e = thread::scope(|s| {
        let one = s.spawn(|| TcpComm::with_listener(1, listener, &peers, Duration::from_secs(20)));
        let mut other = TcpStream::connect(addr).unwrap();
        other
            .write_all(&Hello { rank: 4, world: 5 }.encode())
            .unwrap();
        one.join().unwrap().unwrap_err()
    });
    assert!(t.elapsed() < Duration::from_secs(5));
    assert!(matches!(e, TcpError::Handshake { .. }), "{e}");
}

#[test]
fn strangers_on_the_port_are_ignored() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let peers = [addr, free_port()];
    thread::scope(|s| {
        let zero = s.spawn(|| TcpComm::with_listener(0, listener, &peers, Duration::from_secs(10)));
        // A port scanner: connects, says something else, leaves.
        let mut stranger = TcpStream::connect(addr).unwrap();
        stranger.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        drop(stranger);
        let one = s.spawn(|| TcpComm::connect(1, &peers, Duration::from_secs(10)));
        let comms = vec![zero.join().unwrap().unwrap(), one.join().unwrap().unwrap()];
        on_each(comms, |mut c| c.barrier().unwrap());
    });
}

#[test]
fn peer_lists_parse() {
    let p = parse_peers("127.0.0.1:9000, 10.0.2.15:9001,[::1]:7").unwrap();
    assert_eq!(
        p,
        [
            "127.0.0.1:9000".parse().unwrap(),
            "10.0.2.15:9001".parse().unwrap(),
            "[::1]:7".parse().unwrap()
        ]
    );
    assert!(parse_peers("127.0.0.1:9000,,127.0.0.1:1")
        .unwrap_err()
        .to_string()
        .contains("entry 1 is empty"));
    assert!(parse_peers("127.0.0.1").is_err());
    assert!(matches!(
        TcpComm::connect(2, &p[..2], Duration::from_secs(1)),
        Err(TcpError::Rank { rank: 2, world: 2 })
    ));
}

#[test]
fn a_group_of_one_needs_no_network() {
    let mut c = TcpComm::connect(0, &[free_port()], Duration::from_secs(1)).unwrap();
    let mut v = [3i32, -4];
    c.allreduce(ReduceOp::Avg, &mut v).unwrap();
    assert_eq!(v, [3, -4]);
    c.barrier().unwrap();
    let mut all = [0i32; 2];
    c.allgather(&v, &mut all).unwrap();
    assert_eq!(all, v);
}

#[test]
fn headers_round_trip() {
    let h = Header {
        seq: 7,
        opcode: wire::ALLREDUCE_SCATTER,
        dtype: 3,
        op: 4,
        phase: 2,
        root: 1,
        count: 1 << 40,
        len: 12,
    };
    assert_eq!(Header::decode(&h.encode()), Some(h));
    let mut b = h.encode();
    b[0] ^= 1;
    assert_eq!(Header::decode(&b), None);
    assert_eq!(h.first_difference(&h), None);
    let other = Header {
        root: 0,
        len: 3,
        ..h
    };
    assert_eq!(h.first_difference(&other), Some(("root", 1, 0)));
    let hello = Hello { rank: 3, world: 4 };
    assert_eq!(Hello::decode(&hello.encode()), Ok(hello));
}
